"""The blocks of one put batch between reservation and publication, in a scalar and a vector form.

A numpy call costs a few microseconds whatever its length: below SMALL_BATCH keys (batching.py) plain Python per key is
cheaper (ScalarPut), above it one numpy operation over the batch is (VectorPut, SGLang's 128-page
batches). Both offer the same steps, in this order, and the write path and the publisher drive either
without knowing which:

  reserved()        the reserved words, after a bounds check of every block against the data area
  copy()            the values into their blocks, without locks
  commit()          RESERVED -> LIVE with the next lifetime counter: one aligned 8-byte store per block
  shards            the index shard of every placed key, set by reserved() (the publisher locks them together)
  publish_fast()    SHARD locks held: publish what needs no scalar work; the rest is returned
  disown(flags)     SHARD locks held: clear our owner on the blocks published for good

Position k below is a placed block; `placed_i[k]` is its key's position in the call.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .. import crashpoints as _cp
from ..errors import StoreError
from ..format.layout import LIVE, META_OWNER_OFF, U16, U64, next_word, next_words, store_u64


class _PutBatch:
    def __init__(self, att, engine, darr: np.ndarray, pieces, lengths: list, placed_i: list, placed_off: list,
                 in_key_order: bool = False):
        self.att, self.engine = att, engine
        self.in_key_order = in_key_order  # placed_i is exactly 0..n-1: every key placed, in order
        self.darr = darr  # digests of the whole call: (n, 16) array, or a list of bytes (ScalarPut)
        self.pieces = pieces  # per key (address, nbytes) lists, or a PieceTable (VectorPut)
        self.lengths = lengths  # per key, Python ints
        self.placed_i = placed_i
        self.placed_off = placed_off
        self.lives: list[int] = []

    def __len__(self) -> int:
        return len(self.placed_off)

    def digest(self, k: int) -> bytes:
        return self.darr[self.placed_i[k]].tobytes()

    def _out_of_bounds(self, end: int) -> None:
        if min(self.placed_off) < 0 or end > self.att.geo.data_bytes:
            raise StoreError("internal error: block outside the data area")


class ScalarPut(_PutBatch):
    """A few keys: Python ints and one struct call per block."""

    def reserved(self) -> list[int]:
        lengths = self.lengths
        self._out_of_bounds(max([off + lengths[i] for i, off in zip(self.placed_i, self.placed_off)]))
        geo, mm = self.att.geo, self.att.mm
        self.metas = [geo.meta_of(off) for off in self.placed_off]
        self.words = [U64.unpack_from(mm, m)[0] for m in self.metas]
        shard_of, darr = self.att.index.shard_of, self.darr
        self.shards = [shard_of(darr[i]) for i in self.placed_i]
        return self.words

    def digest(self, k: int) -> bytes:
        return self.darr[self.placed_i[k]]

    def copy(self) -> None:
        data, memmove, armed = self.att.data, ctypes.memmove, _cp.ARMED
        if armed is None and sum([self.lengths[i] for i in self.placed_i]) >= self.engine.min_threaded:
            return self._copy_large()
        for i, off in zip(self.placed_i, self.placed_off):
            dst = data + off
            for addr, nb in self.pieces[i]:
                memmove(dst, addr, nb)
                dst += nb
                if armed is not None:
                    _cp.hit("put.mid_copy")

    def _copy_large(self) -> None:
        """A few large values: every piece by the copy engine."""
        dsts, srcs, nbs = [], [], []
        data = self.att.data
        for i, off in zip(self.placed_i, self.placed_off):
            dst = data + off
            for addr, nb in self.pieces[i]:
                dsts.append(dst)
                srcs.append(addr)
                nbs.append(nb)
                dst += nb
        self.engine.run(dsts, srcs, nbs)

    def commit(self) -> list[int]:
        mm = self.att.mm
        self.lives = [next_word(w, LIVE) for w in self.words]
        for m, w in zip(self.metas, self.lives):
            store_u64(mm, m, w)  # one 8-byte store each
        return self.lives


    def publish_fast(self, res: list) -> tuple[list[bool], list[int]]:
        """Nothing is published in one pass: every block still ours takes the scalar path, by shard."""
        mm, lives = self.att.mm, self.lives
        slow = []
        for k, m in enumerate(self.metas):
            if U64.unpack_from(mm, m)[0] == lives[k]:  # not freed under us (we are alive: never)
                slow.append(k)
        slow.sort(key=self.shards.__getitem__)
        return [False] * len(self), slow

    def disown(self, published: list[bool]) -> None:
        mm = self.att.mm
        for m, p in zip(self.metas, published):
            if p:
                U16.pack_into(mm, m + META_OWNER_OFF, 0)


class VectorPut(_PutBatch):
    """Many keys: every step is a numpy operation over the batch, planned before the copy."""

    def reserved(self) -> list[int]:
        att = self.att
        offs = np.array(self.placed_off, dtype=np.int64)
        self._out_of_bounds(int((offs + self.pieces.lengths[self.placed_i]).max()))
        self.gidx = offs >> att.geo.granule_shift
        reserved = att.alloc.meta_words[self.gidx]
        # Everything the commit and the index insert need that the copy does not change is computed now,
        # while the caches still hold it: the batch's copy is larger than they are.
        self.live = next_words(reserved, LIVE)
        halves = self.darr.view("<u8")
        self.halves = halves if self.in_key_order else halves[self.placed_i]
        index = att.index
        self.shard_arr = (self.halves[:, 0] & index.smask_u).astype(np.int64)
        self.shards = self.shard_arr.tolist()
        self.home = index.home_plan(self.shard_arr, self.halves)
        self.offs = offs
        return reserved.tolist()

    def copy(self) -> None:
        """Every piece into its block by the copy engine (one piece at a time when a crash point is armed)."""
        dsts, srcs, nbs = self.pieces.into(self.placed_i, self.att.data + self.offs)
        if _cp.ARMED is None:
            self.engine.run(dsts, srcs, nbs, self.pieces.period)
        else:
            for dst, addr, nb in zip(dsts.tolist(), srcs.tolist(), nbs.tolist()):
                ctypes.memmove(dst, addr, nb)
                _cp.hit("put.mid_copy")

    def commit(self) -> list[int]:
        self.att.alloc.meta_words[self.gidx] = self.live
        self.lives = self.live.tolist()
        return self.lives

    def publish_fast(self, res: list) -> tuple[list[bool], list[int]]:
        """Insert every block still ours whose key is absent, in one Index.insert_absent pass; the keys it
        leaves (present, or sharing a probe run) are returned for the scalar path, in shard order."""
        index, n = self.att.index, len(self)
        offs_u = self.offs.astype(np.uint64)
        still = self.att.alloc.meta_words[self.gidx] == self.live
        if still.all():  # the common case: the batch as planned
            cand = None
            fast = index.insert_absent(self.shard_arr, self.halves, self.live, offs_u, plan=self.home)
        else:
            cand = np.flatnonzero(still)
            fast = index.insert_absent(self.shard_arr[cand], self.halves[cand], self.live[cand], offs_u[cand],
                                       plan=(self.home[0][cand], self.home[1][cand]))
        if cand is None and fast.all():
            if n == len(res):
                res[:] = [True] * n
            else:
                for i in self.placed_i:
                    res[i] = True
            return [True] * n, []
        published = [False] * n
        if cand is None:
            cand = np.arange(n)
        for k in cand[fast].tolist():
            res[self.placed_i[k]] = published[k] = True
        slow = cand[~fast]
        return published, slow[np.argsort(self.shard_arr[slow], kind="stable")].tolist()

    def disown(self, published: list[bool]) -> None:
        owners = self.att.alloc.meta_owners
        if all(published):
            owners[self.gidx] = 0
        else:
            pub = np.flatnonzero(np.array(published, dtype=bool))
            if len(pub):
                owners[self.gidx[pub]] = 0


__all__ = ["ScalarPut", "VectorPut"]
