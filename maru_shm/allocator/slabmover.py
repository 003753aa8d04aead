"""Mechanism: move a slab's worth of units from whatever holds them to a class (memcached's slabs_mover.c).

The slab CLOCK hand (superblock `slab_hand`) walks HEAD units, giving a referenced slab a second chance.
A window of k units is taken only if every slab overlapping it can be locked without waiting, is of a
donor class (demand.py decides whether to move, and from which classes) and holds no block of a live
process and no pinned block (DESIGN.md section 7). The window's live values are evicted.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import (FLAG_PINNED, FREE, LIVE, META_FLAGS_OFF, SLAB_HAND_OFF, U32, UNIT_FREE, UNIT_HEAD,
                             UNIT_TAIL, length_sound)
from .blockmeta import BlockMetas
from .classtable import ClassInfo, ClassTable
from .freeruns import FreeRuns
from .classlocks import AllocatorLocks
from .freeing import BlockRelease
from .slabtable import SlabTable


class SlabMover:
    def __init__(self, host, locks: AllocatorLocks, classes: ClassTable, slabs: SlabTable, metas: BlockMetas,
                 runs: FreeRuns, release: BlockRelease):
        self.host, self.locks, self.class_table, self.slabs = host, locks, classes, slabs
        self.metas, self.runs, self.release = metas, runs, release

    def move_slab(self, info: ClassInfo, donors=None) -> bool:
        """CLASS[c] and POOL held: empty a slab-CLOCK window of the `donors` classes' slabs (class ids; None: any
        class's), evicting its values, and format a slab of the class there."""
        u = self.evict_for(info, donors)
        if u is None:
            return False
        if _cp.ARMED is not None:
            _cp.hit("slab.mid_move")
        self.slabs.format(u, info)
        return True

    def evict_for(self, info: ClassInfo, donors=None) -> int | None:
        """CLASS+POOL held: free a window of info.k units by emptying its slabs (all of the `donors` classes,
        if given)."""
        mm, slabs = self.slabs.mm, self.slabs
        n, k = self.slabs.geo.n_units, info.k
        if k > n or (donors is not None and not donors):
            return None
        (hand,) = U32.unpack_from(mm, SLAB_HAND_OFF)
        hand %= n
        for sweep in range(3):
            for step in range(n):
                u = (hand + step) % n
                if slabs.state(u) != UNIT_HEAD:
                    continue
                cinfo = self.class_table.info(slabs.cls(u))
                if cinfo is None or (donors is not None and cinfo.cid not in donors):
                    continue
                if sweep < 2 and slabs.referenced(u, cinfo.k, clear=True):
                    continue
                if self.evict_window(min(u, n - k), k, info.cid, donors):
                    U32.pack_into(mm, SLAB_HAND_OFF, (u + 1) % n)
                    run = self.runs.find_free_run(k)
                    if run is not None:
                        return run
        return None

    def evict_window(self, w0: int, k: int, my_cid: int, donors=None) -> bool:
        """CLASS[my_cid] and POOL held: empty every slab overlapping units [w0, w0 + k) if all can go (and all
        are of the `donors` classes, if given)."""
        heads = self.slabs.heads_in(w0, k)
        if heads is None:
            return False
        locked: list[int] = []
        cut = False
        try:
            infos = []
            for h in heads:
                c = self.slabs.cls(h)
                cinfo = self.class_table.info(c)
                if cinfo is None or not self.slabs.geo.slab_fits(h, cinfo.k) or (donors is not None and c not in donors):
                    return False
                if c != my_cid and c not in locked:
                    dirty = self.locks.try_class(c)
                    if dirty is None:
                        return False
                    locked.append(c)
                    if dirty:
                        self.locks.repair_class(c)
                    if self.slabs.state(h) != UNIT_HEAD:
                        return False
                if not self.slab_evictable(h, cinfo):
                    return False
                infos.append((h, cinfo))
            self.evict_slabs(infos)
            return True
        except BaseException:
            cut = True
            raise
        finally:
            for c in locked:  # a donor's section cut short (a repair or an eviction) stays dirty: its next holder repairs
                self.locks.release_class(c, clean=not cut)

    def slab_evictable(self, h: int, info: ClassInfo) -> bool:
        """No block of the slab is owned by a live process or pinned (LIVE with FLAG_PINNED)."""
        metas, unit = self.metas, self.slabs.geo.unit_size
        for i in range(info.bps):
            m = metas.meta_off(h * unit + i * info.block)
            state = metas.word(m) & 3
            if state == LIVE and metas.mm[m + META_FLAGS_OFF] & FLAG_PINNED:
                return False
            owner = metas.owner(m)
            if owner and state != FREE and self.host.slot_alive(owner):
                return False
        return True

    def evict_slabs(self, slabs: list[tuple[int, ClassInfo]]) -> None:
        """Holding the slabs' CLASS locks and POOL: empty the slabs and return their units. Live values are
        unpublished in one round of their shard locks. A slab keeps its units if a live process claimed one
        of its blocks meanwhile (an owner, or, once the claimant kept, reused and published the block again, a
        word that moved on since `before`)."""
        before = [self.metas.meta_words[self._granules(h, info)] for h, info in slabs]  # copies (fancy index)
        live, lengths, where = self._live_blocks(slabs)
        gone = np.zeros(len(live), dtype=bool)
        if live:
            halves = np.frombuffer(b"".join([d for d, _, _ in live]), dtype="<u8").reshape(-1, 2)
            gone[:] = self.host.unpublish_many(halves, np.array([o for _, o, _ in live], dtype=np.uint64),
                                               np.array([w for _, _, w in live], dtype=np.uint64))
        evicted = int(gone.sum())
        evicted_bytes = sum(n for n, g in zip(lengths, gone.tolist()) if g and n > 0)
        moved = 0
        for s, ((h, info), words) in enumerate(zip(slabs, before)):
            if self.slab_evictable(h, info) and (self.metas.meta_words[self._granules(h, info)] == words).all():
                self._return_units(h, info)
                moved += 1
            else:  # no entry names these any more, and under the class lock no claim on them can follow
                self.release.free_listed(info.cid, [live[j][1:] for j in np.flatnonzero((where == s) & gone)])
        self.host.count(evictions=evicted, evicted_bytes=evicted_bytes, slab_moves=moved,
                        orphans_freed=len(live) - evicted)

    def _live_blocks(self, slabs):
        """(digest, offset, word), length and slab (position in `slabs`) of every LIVE block of the slabs. A length
        its check refutes is -1 (counted in no evicted bytes)."""
        live, lengths, where = [], [], []
        unit = self.slabs.geo.unit_size
        for s, (h, info) in enumerate(slabs):
            for i in range(info.bps):
                off = h * unit + i * info.block
                word, d, length, _, _, flags = self.metas.read(off)
                if word & 3 == LIVE:
                    live.append((d, off, word))
                    lengths.append(length if length_sound(length, flags) else -1)
                    where.append(s)
        return live, lengths, np.array(where, dtype=np.int64)

    def _granules(self, h: int, info: ClassInfo) -> np.ndarray:
        """The granules where the blocks of slab h start (their block metas)."""
        return self.slabs.geo.block_offset(h, np.arange(info.bps, dtype=np.int64), info.block) >> self.metas.shift

    def _return_units(self, h: int, info: ClassInfo) -> None:
        """Every block FREE at once (word bumped first, so readers miss), then owner and ref cleared; bitmap
        and free count need no upkeep: the slab leaves the class and is reformatted on reuse."""
        slabs, geo = self.slabs, self.slabs.geo
        g = self._granules(h, info)
        busy = (self.metas.meta_words[g] & np.uint64(3)) != FREE
        if busy.any():
            self.metas.free_many(g[busy])
            slabs.add_used(info.cid, -int(busy.sum()))
        slabs.partial_remove(info.cid, h)
        self.runs.lower_free_floor(h)
        U32.pack_into(slabs.mm, geo.slab_entry(h), UNIT_FREE)  # commit point: the units are free
        if _cp.ARMED is not None:
            _cp.hit("slab.mid_free")
        for t in range(h + 1, min(h + info.k, geo.n_units)):
            if slabs.state(t) == UNIT_TAIL:
                U32.pack_into(slabs.mm, geo.slab_entry(t), UNIT_FREE)
        slabs.add_slabs(info.cid, -1)
