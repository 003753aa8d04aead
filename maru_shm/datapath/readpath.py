"""The read path: lock-free lookups and copies out of the pool (FORMAT.md section 8).

A reader takes no lock. It believes an index entry only under the rule of validity.py, copies the
value, then re-reads the block's meta word: a word changed during the copy means the block was reused
under it, and the key reports a miss rather than torn bytes. A good copy marks the block used, as the
eviction policy says (allocator/policy.py), and sets its slab's ref bit for the slab CLOCK (one byte store
each: a lost race only makes a value look less used).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from ..batching import SMALL_BATCH
from ..format.layout import SLAB_REF, U64
from ..copying.pieces import Pieces, PieceTable, piece_lengths
from .resolve import Resolved, resolve
from .validity import Hit, block_start_problem, lookup

RETRIES = 3  # a concurrent overwrite may move a key between lookup and copy: look again, briefly


class ReadPath:
    def __init__(self, att, engine, counters):
        self.att, self.engine, self.counters = att, engine, counters
        self.lookup = functools.partial(lookup, att.index, att.mm, att.geo)  # (digest) -> Hit | None

    def _mark_used(self, offset: int, meta: int) -> None:
        self.att.alloc.policy.mark_one(meta)
        self.att.mm[self.att.geo.slab_of(offset) + SLAB_REF] = 1

    def copy_out(self, hit: Hit, pieces: Pieces | memoryview) -> bool:
        """Copy one value into destination pieces, or to the start of a writable byte view; False if its
        block is unsafe or changed under the copy."""
        offset, word, length, meta = hit
        if block_start_problem(self.att.alloc, offset, length):
            return False  # not a block start of a formatted slab, or a length overrunning it: never copy
        if type(pieces) is not memoryview:
            self._copy_value(self.att.data + offset, pieces, length)
        elif length < self.engine.min_threaded:
            pieces[:length] = self.att.data_view[offset:offset + length]  # one memcpy, no ctypes call
        else:
            anchor = ctypes.c_char.from_buffer(pieces)
            self._copy_value(self.att.data + offset, ((ctypes.addressof(anchor), length),), length)
            del anchor
        if U64.unpack_from(self.att.mm, meta)[0] != word:
            return False
        self._mark_used(offset, meta)
        return True

    def _copy_value(self, src: int, pieces: Pieces, length: int) -> None:
        """One value out of the pool into its pieces: a large one by the copy engine."""
        if length >= self.engine.min_threaded:
            dsts, nbs = [a for a, _ in pieces], [n for _, n in pieces]
            self.engine.run(dsts, np.cumsum([src] + nbs[:-1]), nbs)
            return
        for addr, n in pieces:
            ctypes.memmove(addr, src, n)
            src += n

    def get_one(self, d: bytes, dest_of) -> int | None:
        """Copy the value of d into the pieces `dest_of(length)` gives (None: it does not fit); its length."""
        for _ in range(RETRIES):
            hit = self.lookup(d)
            if hit is None:
                return None
            pieces = dest_of(hit.length)
            if pieces is None:
                return None
            if self.copy_out(hit, pieces):
                return hit.length
        return None

    def get_one_into(self, d: bytes, view: memoryview) -> int | None:
        """get_one into the start of a writable 1-D byte view (a single-key get: no callback per call)."""
        cap = view.nbytes
        for _ in range(RETRIES):
            hit = self.lookup(d)
            if hit is None or hit.length > cap:
                return None
            if self.copy_out(hit, view):
                return hit.length
        return None

    def get_batch(self, darr: np.ndarray, pieces_list) -> list[bool]:
        """Load many values into destination pieces; per key True only if the stored length matches exactly."""
        n = len(darr)
        res = resolve(self.att, darr)
        if n <= SMALL_BATCH:
            out = self._get_scalar(res, pieces_list.tolist() if isinstance(pieces_list, np.ndarray) else pieces_list)
            hits = sum(out)
            nbytes = sum([length for length, o in zip(res.lengths.tolist(), out) if o])
        else:
            ok = self._get_vector(res, PieceTable.of(pieces_list, n))
            out = ok.tolist()
            hits = out.count(True)
            nbytes = int(res.lengths.sum()) if hits == n else int(res.lengths[ok].sum())
        self.counters.count(hits=hits, misses=n - hits, bytes_read=nbytes)
        return out

    def _get_scalar(self, res: Resolved, pieces_list) -> list[bool]:
        """Copy out a few values key by key (no numpy call per key: cheaper below SMALL_BATCH keys)."""
        oks, offs, words, lens = res.ok.tolist(), res.offsets.tolist(), res.words.tolist(), res.lengths.tolist()
        out = []
        att = self.att
        mm, data, memmove, meta_of = att.mm, att.data, ctypes.memmove, att.geo.meta_of
        for i, pieces in enumerate(pieces_list):
            ok = oks[i]
            if ok:
                if piece_lengths([pieces])[0] != lens[i]:
                    ok = False
                else:
                    off = offs[i]
                    if lens[i] >= self.engine.min_threaded:
                        self._copy_value(data + off, pieces, lens[i])
                    else:
                        src = data + off
                        for addr, n in pieces:
                            memmove(addr, src, n)
                            src += n
                    m = meta_of(off)
                    ok = U64.unpack_from(mm, m)[0] == words[i]  # unchanged across the copy: not torn
                    if ok:
                        self._mark_used(off, m)
            out.append(ok)
        return out

    def _get_vector(self, res: Resolved, table: PieceTable) -> np.ndarray:
        """Copy out a batch: one flat loop over every piece of the values found with the right length, then
        one pass re-reading their block words (a word changed since the lookup means the block was reused
        during the copy: that key's bytes may be torn, and it reports False) and marking the rest used."""
        att = self.att
        ok = res.ok & (res.lengths == table.lengths)
        rows = np.flatnonzero(ok)
        if rows.size:
            offs = res.offsets[rows]
            pool_at, host_at, nb = table.into(rows, att.data + offs)  # the pieces' places in the pool
            self.engine.run(host_at, pool_at, nb, table.period)
            gidx = offs >> att.geo.granule_shift
            still = att.alloc.meta_words[gidx] == res.words[rows]
            ok[rows] = still
            self._mark_used_many(offs[still], gidx[still])
        return ok

    def touch(self, darr: np.ndarray, found: Resolved | None = None) -> int:
        """Mark the values of these digests used, as a hit would, without a copy; the number present.
        `found`: their `resolve` answer, when the caller has one (no second lookup; its ok keys are marked)."""
        r = resolve(self.att, darr, full=False) if found is None else found
        offs = r.offsets[r.ok].astype(np.int64)
        self._mark_used_many(offs, offs >> self.att.geo.granule_shift)
        return len(offs)

    def _mark_used_many(self, offs: np.ndarray, gidx: np.ndarray) -> None:
        """The batch form of _mark_used: the blocks (granules gidx), and the ref bits of their slabs."""
        self.att.alloc.policy.mark_many(gidx)
        self.att.alloc.unit_refs[offs // self.att.geo.unit_size] = 1
