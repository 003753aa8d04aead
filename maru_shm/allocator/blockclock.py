"""Mechanism: evict within a class the blocks the policy chooses (DESIGN.md section 7).

A class's blocks in address order (slabs by head unit, then block index) form a ring with a hand (class
entry `hand`); policy.py reads the ring through `Ring`, names the victims and moves the hand. This module
unpublishes and frees them.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import (CLS_HAND, LIVE, META_COL_DIGEST, META_COL_TAIL, META_COL_WORD, META_TAIL_LENGTH_MASK,
                             META_TAIL_REF_SHIFT, U64)
from ..batching import SMALL_BATCH
from .blockmeta import BlockMetas
from .classtable import ClassInfo
from .freeing import BlockRelease
from .slabtable import SlabTable


class Ring:
    """CLASS[c] held: class c's blocks as a ring, `n` positions, and its hand (the position it starts at)."""

    def __init__(self, slabs: SlabTable, metas: BlockMetas, info: ClassInfo, heads: np.ndarray):
        self.slabs, self.metas, self.info, self.heads = slabs, metas, info, heads
        bps = info.bps
        self.n = len(heads) * bps
        self._entry = slabs.geo.class_entry(info.cid)
        (hand,) = U64.unpack_from(slabs.mm, self._entry + CLS_HAND)
        j = int(np.searchsorted(heads, hand >> 8))
        p = j * bps + ((hand & 0xFF) if j < len(heads) and heads[j] == hand >> 8 and (hand & 0xFF) < bps else 0)
        self.hand = p % self.n

    def read(self, pos: np.ndarray):
        """Ring positions -> (granules, meta rows, eligible, ref bytes): a candidate is LIVE, unowned, unpinned."""
        info = self.info
        g = self.slabs.geo.block_offset(self.heads[pos // info.bps], pos % info.bps, info.block) >> self.metas.shift
        q = self.metas.meta_q[g]
        owner, _, pinned = BlockMetas.columns(q)
        ref = ((q[:, META_COL_TAIL] >> np.uint64(META_TAIL_REF_SHIFT)) & np.uint64(0xFF)).astype(np.uint8)
        return g, q, ((q[:, META_COL_WORD] & np.uint64(3)) == LIVE) & (owner == 0) & ~pinned, ref

    def move_hand(self, pos: int) -> None:
        """Leave the hand at ring position `pos` (where the next search starts)."""
        bps = self.info.bps
        U64.pack_into(self.slabs.mm, self._entry + CLS_HAND, (int(self.heads[pos // bps]) << 8) | (pos % bps))


class BlockClock:
    def __init__(self, host, slabs: SlabTable, metas: BlockMetas, release: BlockRelease, policy):
        self.host, self.slabs, self.metas, self.release, self.policy = host, slabs, metas, release, policy

    def evict_blocks(self, info: ClassInfo, m: int) -> int:
        """CLASS[c] held: evict up to m blocks of the class, as the policy chooses them; returns blocks freed.
        The victims are unpublished in one round of their shard locks (CLASS -> SHARD is the lock order),
        then freed, word first: a reader that found the entry before it went fails its second word check.
        """
        heads = np.asarray(self.slabs.class_slabs(info.cid), dtype=np.int64)
        if m <= 0 or not len(heads):
            return 0
        ring, rows = self.policy.victims(Ring(self.slabs, self.metas, info, heads), m)
        if not len(ring):
            return 0
        vheads, vindex = heads[ring // info.bps], ring % info.bps
        voffs = self.slabs.geo.block_offset(vheads, vindex, info.block)
        vwords = rows[:, META_COL_WORD]
        lens = rows[:, META_COL_TAIL] & np.uint64(META_TAIL_LENGTH_MASK)
        gone = self.host.unpublish_many(rows[:, META_COL_DIGEST:META_COL_DIGEST + 2], voffs.astype(np.uint64), vwords)
        # Free what we unpublished, and orphans (LIVE, unowned, not indexed); a block whose word moved on,
        # or that another process claimed by unpublishing it first, is not ours to free.
        g = voffs >> self.metas.shift
        now = self.metas.meta_q[g]
        ours = np.flatnonzero((now[:, META_COL_WORD] == vwords) & (gone | (BlockMetas.columns(now)[0] == 0)))
        self._free_victims(info, vheads[ours], vindex[ours], voffs[ours], g[ours], len(voffs) > SMALL_BATCH)
        evicted = gone[ours]
        self.host.count(evictions=int(evicted.sum()), evicted_bytes=int(lens[ours][evicted].sum()),
                        orphans_freed=int((~evicted).sum()))
        return len(ours)

    def _free_victims(self, info: ClassInfo, heads, index, offs, g, batch: bool) -> None:
        """Free victims still ours: a batch at once (release.free_many), a few block by block in victim order
        (no numpy call per slab)."""
        if batch:
            if len(g):
                self.release.free_many(info, heads, index, g)
            return
        for h, i, off in zip(heads.tolist(), index.tolist(), offs.tolist()):
            self.release.free_block(h, info, i, off)
            if _cp.ARMED is not None:
                _cp.hit("evict.block_mid")

