"""Vectorised lock-free lookup and validation of a batch of key digests.

The scalar read path (Store._lookup) costs a few microseconds of Python per
key; SGLang asks about 128 keys at a time. This module answers a whole batch
with a handful of numpy gathers over the mapped index, block metas and slab
table, applying the same checks as the scalar path and docs/FORMAT.md §8:
entry found, offset inside the data area, block meta word equal to the
entry's and LIVE, block meta digest equal to the key's, the offset a block
start of a formatted slab, and the length within that block and the data
area. A copy that follows must still re-read the word afterwards.
"""

from __future__ import annotations

import numpy as np

from .format import LIVE, UNIT_HEAD, UNIT_TAIL
from .index.table import ABSENT



class Resolved:
    """Per-key results of one batch: ok mask, offsets, words, lengths (numpy arrays)."""

    __slots__ = ("ok", "offsets", "words", "lengths")

    def __init__(self, ok, offsets, words, lengths):
        self.ok, self.offsets, self.words, self.lengths = ok, offsets, words, lengths



def resolve(store, digests: np.ndarray, full: bool = True) -> Resolved:
    """Look up and validate every digest of an (n, 16) uint8 array, without locks.

    full=False stops after the meta checks (enough to answer "exists", see
    docs/FORMAT.md §8); a caller that copies must use full=True.

    Each key's home slot is gathered and its block meta checked against the
    entry's word and the key's digest in one XOR/OR pass. The entry's own
    digest needs no separate check: a meta whose word equals the entry's word
    is the incarnation that entry published (every reuse of a block bumps its
    word), so a meta digest equal to the key's proves the entry is the key's.
    Keys that fail at their home slot but found it occupied (displaced by
    probing, absent behind a collision, or caught mid-update) probe on
    together (`Index.probe`, PROBE_WINDOW slots); the few still undecided after
    that, or found but failing the checks, are finished by the scalar path.
    """
    halves = np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1, 16).view("<u8")
    h0, h1 = halves[:, 0], halves[:, 1]
    idx = store.index
    offs, words, lengths, ok = _validate(store, idx.table[idx.home_slots(h0, h1)], h0, h1)
    if not ok.all():
        again = np.flatnonzero(~ok & (words != 0))
        if again.size > SCALAR_AGAIN:
            rows = idx.probe(h0[again], h1[again], PROBE_WINDOW, first_step=1)
            at = np.flatnonzero(rows >= 0)
            if at.size:
                sel = again[at]
                o2, w2, l2, ok2 = _validate(store, idx.table[rows[at]], h0[sel], h1[sel])
                offs[sel], words[sel], lengths[sel], ok[sel] = o2, w2, l2, ok2
            again = again[rows != ABSENT]
        if again.size:
            for i in again[~ok[again]].tolist():
                found = store._lookup(halves[i].tobytes())  # same checks, after a bounded probe
                if found is not None:
                    offs[i], words[i], lengths[i] = found[0], found[1], found[2]
                    ok[i] = True
    if full:
        ok &= _block_starts_ok(store, offs, lengths)
    return Resolved(ok, offs, words, lengths)


def _validate(store, e: np.ndarray, h0: np.ndarray, h1: np.ndarray):
    """(offsets, words, lengths, ok) of index entries `e` (rows of 4 u64) checked against their block metas."""
    g = store.geo
    words = e[:, 2]
    inside = e[:, 3] < np.uint64(g.data_bytes)
    offs = (e[:, 3] * inside).astype(np.intp)  # out-of-range offsets read meta 0 and fail below
    m = store.alloc.meta_q[offs >> _shift(g.granule)]
    lengths = (m[:, 3] & np.uint64(0xFFFFFFFF)).astype(np.intp)
    ok = (((m[:, 0] ^ words) | (m[:, 1] ^ h0) | (m[:, 2] ^ h1)) == 0) & inside \
        & ((words & np.uint64(3)) == LIVE) & (offs + lengths <= g.data_bytes)
    return offs, words, lengths, ok


def leading_present(store, digests: np.ndarray, length: int | None = None) -> int:
    """How many digests, from the first, name a committed value (of exactly `length` bytes, if given).

    SGLang asks this of every prefetch (`batch_exists`, 128 keys), so the common
    case, every key in its home slot, takes one fused pass: the home entries and
    their block metas are gathered, and the checks `_validate` makes (section 8 of
    docs/FORMAT.md: value inside the data area, meta word equal to the entry's and
    LIVE, meta digest equal to the key's; here also the stored length) are XOR-ed
    and OR-ed into one u64 per key, zero only for a hit. The keys before the first
    nonzero one are hits; the others take the scalar probe (a few keys displaced
    from their home slot) or, if there are many, `resolve` decides from the first.
    """
    n = len(digests)
    g = store.geo
    if not n or (length is not None and not 0 <= length <= min(g.data_bytes, 0xFFFFFFFF)):
        return 0  # (a block meta holds a u32 length: a longer value is never stored)
    halves = digests.view("<u8")
    idx = store.index
    e = idx.table[idx.home_slots(halves[:, 0], halves[:, 1])]
    # an offset outside the data area reads a clipped meta, and fails its own check below
    m = store.alloc.meta_q.take((e[:, 3] >> np.uint64(_shift(g.granule))).view(np.int64), axis=0, mode="clip")
    d = m[:, 1:3] ^ halves
    bad = (m[:, 0] ^ e[:, 2]) | d[:, 0] | d[:, 1] | ((m[:, 0] & np.uint64(3)) ^ np.uint64(LIVE))
    if length is None:
        bad |= (e[:, 3] >= np.uint64(g.data_bytes)) | (e[:, 3] + (m[:, 3] & _LENGTH) > np.uint64(g.data_bytes))
    else:  # offset + length <= data_bytes, and offset inside it
        bad |= ((m[:, 3] ^ np.uint64(length)) & _LENGTH) | (e[:, 3] > np.uint64(g.data_bytes - max(length, 1)))
    nz = np.flatnonzero(bad)
    if not nz.size:
        return n
    if nz.size <= SCALAR_AGAIN:  # a few keys displaced from their home slot (or misses): the scalar probe
        for i in nz.tolist():
            found = store._lookup(digests[i].tobytes())
            if found is None or (length is not None and found[2] != length):
                return i
        return n
    first = int(nz[0])
    r = resolve(store, digests[first:], full=False)
    ok = r.ok if length is None else r.ok & (r.lengths == length)
    miss = np.flatnonzero(~ok)
    return first + (int(miss[0]) if miss.size else int(ok.size))


_LENGTH = np.uint64(0xFFFFFFFF)  # block meta bytes 24..27 of the u64 at 24: the value's length


SCALAR_AGAIN = 8  # up to this many keys displaced from their home slot take the scalar probe at once
PROBE_WINDOW = 16  # slots after the home slot probed together; keys still undecided take the scalar probe


def _shift(granule: int) -> int:
    return granule.bit_length() - 1  # granules are powers of two (Geometry.plan)


def _block_starts_ok(store, offs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Is each offset a block start of a formatted slab, with its length inside that block?"""
    g = store.geo
    unit = offs // g.unit_size
    st = store.alloc.states[unit]
    cls_u = store.alloc.clsfield[unit].astype(np.int64)
    head = np.where(st == UNIT_TAIL, np.minimum(cls_u, g.n_units - 1), unit)
    cid = np.minimum(store.alloc.clsfield[head].astype(np.int64), g.class_cap - 1)
    block, bps = store.alloc.class_arrays()
    blk = block[cid]
    rel = offs - head * g.unit_size
    safe_blk = np.maximum(blk, 1)
    return ((st == UNIT_HEAD) | (st == UNIT_TAIL)) & (store.alloc.states[head] == UNIT_HEAD) & (blk > 0) \
        & (rel >= 0) & (rel % safe_blk == 0) & (rel // safe_blk < bps[cid]) & (lengths <= blk)


__all__ = ["resolve", "leading_present", "Resolved", "PROBE_WINDOW"]
