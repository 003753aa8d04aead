"""Freeing blocks: the end of a lifetime and the derived state that follows it (CLASS lock).

The meta word goes to FREE first (blockmeta.py), then the slab's bitmap bit, free count, the class's
used count and the partial list follow; a death in between leaves only derived state stale, which
class repair rebuilds from the metas.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from .blockmeta import BlockMetas
from .classtable import ClassInfo
from .keptblocks import KeptBlocks
from .classlocks import AllocatorLocks
from .slabtable import SlabTable


class BlockRelease:
    def __init__(self, host, locks: AllocatorLocks, slabs: SlabTable, metas: BlockMetas, kept: KeptBlocks):
        self.host, self.locks, self.slabs, self.metas, self.kept = host, locks, slabs, metas, kept

    def free_blocks(self, blocks, keep: int = 0) -> int:
        """Free blocks given as (offset, word) if their word is unchanged; returns how many were freed.

        With `keep` (this process's owner value, slot + 1; the blocks must be unindexed: an overwrite's
        old block, claimed when it was unpublished, or one of ours that was not published), each class
        first keeps up to `keptblocks.keep_limit` of those still owned by `keep` with that word for this
        process's next allocations of the class (keptblocks.py). Only the rest is freed, under the class lock.
        So an overwrite-heavy process takes the class lock neither to free its old blocks nor to
        allocate new ones.
        """
        by_class: dict[int, list] = {}
        infos: dict[int, ClassInfo] = {}
        for off, word in blocks:
            h, info = self.slabs.head_of(off)
            if info is not None:
                by_class.setdefault(info.cid, []).append((off, word))
                infos[info.cid] = info
        freed = 0
        for cid, items in by_class.items():
            if keep:
                items = self.kept.offer(infos[cid], items, keep)
                if not items:
                    continue
            with self.locks.class_lock(cid):
                freed += self.free_listed(cid, items)
        return freed

    def free_listed(self, cid: int, items) -> int:
        """CLASS[cid] held: free each (offset, word) that is still a block of the class with that word."""
        freed = 0
        for off, word in items:
            loc = self.slabs.block_index(off)
            if loc is None or loc[1].cid != cid:
                continue
            if self.metas.word(self.metas.meta_off(off)) == word:
                self.free_block(loc[0], loc[1], loc[2], off)
                freed += 1
        return freed

    def free_block(self, h: int, info: ClassInfo, i: int, off: int) -> None:
        """CLASS held: mark a block FREE (word bumped first, so readers miss) and update derived state."""
        self.metas.free(self.metas.meta_off(off))
        if self.slabs.bit(h, i):
            self.slabs.set_bit(h, i, False)
            self.slabs.blocks_freed(h, info, 1)

    def free_many(self, info: ClassInfo, heads: np.ndarray, index: np.ndarray, g: np.ndarray) -> None:
        """CLASS held: mark a batch of blocks of one class FREE (blocks `index` of slabs `heads`, block
        metas `g`; their words checked by the caller), then update the derived state once per slab.

        Every word is bumped first (readers miss from then on), then owner and ref cleared; a crash
        before the bitmaps, counts and partial list agree leaves them to class repair, which derives
        them from the block metas.
        """
        self.metas.free_many(g)
        if _cp.ARMED is not None:
            _cp.hit("evict.block_mid")
        order = np.argsort(heads, kind="stable")
        hs, ix = heads[order].tolist(), index[order].tolist()
        j = 0
        while j < len(hs):
            h, bits = hs[j], 0
            while j < len(hs) and hs[j] == h:
                bits |= 1 << ix[j]
                j += 1
            bm = self.slabs.bitmap(h)
            cleared = (bm & bits).bit_count()
            if cleared:
                self.slabs.set_bitmap(h, bm & ~bits)
                self.slabs.blocks_freed(h, info, cleared)

    def owned_by_live(self, m: int) -> bool:
        """Does a live process own the block whose meta is at m?"""
        owner = self.metas.owner(m)
        return bool(owner) and self.host.slot_alive(owner)
