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

from .format import LIVE, SLAB_ENTRY, UNIT_HEAD, UNIT_TAIL



class Resolved:
    """Per-key results of one batch: ok mask, offsets, words, lengths (numpy arrays)."""

    __slots__ = ("ok", "offsets", "words", "lengths")

    def __init__(self, ok, offsets, words, lengths):
        self.ok, self.offsets, self.words, self.lengths = ok, offsets, words, lengths


def resolve(store, digests: np.ndarray, full: bool = True) -> Resolved:
    """Look up and validate every digest of an (n, 16) uint8 array, without locks.

    full=False stops after the meta checks (enough to answer "exists", see
    docs/FORMAT.md §8); a caller that copies must use full=True.
    """
    g = store.geo
    idx = store.index
    halves = np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1, 16).view("<u8")
    entries = np.ndarray((idx.nshards * idx.slots, 4), dtype="<u8", buffer=store.mm, offset=idx.off)
    metas = np.ndarray((g.n_granules, 4), dtype="<u8", buffer=store.mm, offset=g.off_blockmeta)
    try:
        e = entries[((halves[:, 0] & idx.smask) * idx.slots + (halves[:, 1] & idx.mask)).astype(np.intp)]
        hit = (e[:, :2] == halves).all(axis=1)
        if not hit.all():  # empty home slot (a miss) or a displaced key: finish those with the scalar probe
            for i in np.flatnonzero(~hit & (e[:, 2] != 0)).tolist():
                found = idx.find(halves[i].tobytes())
                if found is not None:
                    e[i, :2], (e[i, 2], e[i, 3]) = halves[i], found
                    hit[i] = True
        words = e[:, 2]
        offs = np.where(hit & (e[:, 3] < g.data_bytes), e[:, 3], 0).astype(np.intp)
        m = metas[offs // g.granule]
    finally:
        del entries, metas
    lengths = (m[:, 3] & 0xFFFFFFFF).astype(np.intp)
    ok = hit & (words != 0) & (m[:, 0] == words) & ((m[:, 0] & 3) == LIVE) & (m[:, 1:3] == halves).all(axis=1) \
        & (e[:, 3] < g.data_bytes) & (offs + lengths <= g.data_bytes)
    if full:
        ok &= _block_starts_ok(store, offs, lengths)
    return Resolved(ok, offs, words, lengths)


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


__all__ = ["resolve", "Resolved", "SLAB_ENTRY"]
