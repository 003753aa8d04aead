"""Repair and reaping on the allocator's side: rebuild derived state from the two sources of truth.

A dirty CLASS lock makes its next holder run `repair_class`; a dirty POOL lock, `repair_pool`
(FORMAT.md section 9). Reaping a dead process settles the blocks it owned (`resolve_owned`). None of
them trusts the derived state they rebuild: HEAD entries and block metas decide.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import (CLS_NSLABS, CLS_PARTIAL, CLS_USED, FREE, LIVE, RESERVED, SLAB_CLS, SLAB_NBLOCKS,
                             UNIT_FREE, UNIT_HEAD, UNIT_TAIL, length_sound)
from .blockmeta import BlockMetas
from .classtable import ClassTable
from .freeruns import FreeRuns
from .classlocks import AllocatorLocks
from .freeing import BlockRelease
from .slabtable import SlabTable, set32


class Repairer:
    def __init__(self, host, locks: AllocatorLocks, classes: ClassTable, slabs: SlabTable, metas: BlockMetas,
                 runs: FreeRuns, release: BlockRelease):
        self.host, self.locks, self.class_table, self.slabs = host, locks, classes, slabs
        self.metas, self.runs, self.release = metas, runs, release

    def repair_pool(self) -> int:
        """POOL was left dirty: rewrite TAIL entries from HEAD entries, restart the free floor; returns fixes made."""
        slabs, n = self.slabs, self.slabs.geo.n_units
        mm, geo = slabs.mm, slabs.geo
        fixes = 0
        self.runs.reset_floor()
        covered = np.zeros(n, dtype=bool)
        for h in np.flatnonzero(slabs.states == UNIT_HEAD).tolist():
            if covered[h]:
                continue
            info = self.class_table.info(slabs.cls(h))
            if info is None or not geo.slab_fits(h, info.k):
                continue  # left to check(); class repair ignores unknown classes
            covered[h:h + info.k] = True
            for t in range(h + 1, h + info.k):
                if slabs.state(t) != UNIT_TAIL or slabs.cls(t) != h:
                    set32(mm, geo.slab_entry(t) + SLAB_CLS, h)
                    set32(mm, geo.slab_entry(t), UNIT_TAIL)
                    fixes += 1
        for t in np.flatnonzero((slabs.states == UNIT_TAIL) & ~covered).tolist():
            set32(mm, geo.slab_entry(t), UNIT_FREE)
            fixes += 1
        self.host.count(repairs=1)
        return fixes

    def repair_class(self, cid: int) -> int:
        """CLASS[cid] was left dirty (or `check --repair`): rebuild the class from block metas.

        Frees blocks of dead owners that never got published and LIVE blocks the index does not point
        at; returns the number of blocks freed. The index is asked under each shard's lock
        (host.indexed_many), once per shard, after a first pass has picked the LIVE blocks whose fate
        depends on it. Holding CLASS[cid], no block of the class changes between FREE and not FREE
        meanwhile. A LIVE block can still become owned: a live process that replaced or deleted its
        entry (under the shard lock, before the index was asked) claimed it, and may keep it and reuse it
        without this lock. So the owner and the word are read again just before a block is freed: a block
        a live process owns is its own to settle, and one whose word moved on was reused by its claimant
        (maybe published again, its owner already cleared): both stay used.
        """
        info = self.class_table.info(cid)
        if info is None:
            return 0
        heads = self.slabs.class_slabs(cid)
        doomed, damaged = self._doomed_blocks(info, heads)
        freed = used_total = 0
        set32(self.slabs.mm, self.slabs.geo.class_entry(cid) + CLS_PARTIAL, 0)
        for h in heads:
            n_freed, used = self._rebuild_slab(h, info, doomed, damaged)
            freed += n_freed
            used_total += used
        co = self.slabs.geo.class_entry(cid)
        set32(self.slabs.mm, co + CLS_NSLABS, len(heads))
        set32(self.slabs.mm, co + CLS_USED, used_total)
        self.host.count(repairs=1, orphans_freed=freed)
        return freed

    def _doomed_blocks(self, info, heads: list[int]) -> tuple[dict[int, int], set[int]]:
        """(offset -> word of the blocks to free unless a live process owns them by then or their word moved
        on, damaged blocks freed whoever owns them)."""
        unit = self.slabs.geo.unit_size
        doomed: dict[int, int] = {}
        damaged: set[int] = set()
        ask = []  # LIVE blocks kept only if indexed: (digest, offset, word, dead owner to clear or 0)
        for h in heads:
            for i in range(info.bps):
                off = h * unit + i * info.block
                word, d, length, owner, _, flags = self.metas.read(off)
                state = word & 3
                if state == FREE:
                    continue
                if state not in (RESERVED, LIVE) or not length_sound(length, flags) or length > info.block:
                    damaged.add(off)
                elif owner and self.host.slot_alive(owner):
                    continue  # a live writer's block (in flight or being unpublished): it settles it
                elif state == RESERVED:
                    doomed[off] = word
                else:
                    ask.append((d, off, word, owner))
        if ask:
            for (_, off, word, _), indexed in zip(ask, self.host.indexed_many(ask)):
                if not indexed:
                    doomed[off] = word
        return doomed, damaged

    def _rebuild_slab(self, h: int, info, doomed: dict, damaged: set) -> tuple[int, int]:
        """Free slab h's doomed blocks and derive its bitmap, counts and list membership: (freed, used)."""
        slabs, metas = self.slabs, self.metas
        slabs.unlink_all(info.cid, h)
        bitmap = 0
        used = freed = 0
        for i in range(info.bps):
            off = slabs.geo.block_offset(h, i, info.block)
            m = metas.meta_off(off)
            word = metas.word(m)
            if word & 3 == FREE:
                continue
            if off in damaged or (doomed.get(off) == word and not self.release.owned_by_live(m)):
                metas.free(m)
                freed += 1
                continue
            bitmap |= 1 << i
            used += 1
        slabs.set_bitmap(h, bitmap)
        set32(slabs.mm, slabs.geo.slab_entry(h) + SLAB_NBLOCKS, info.bps)
        slabs.set_nfree(h, info.bps - used)
        if used < info.bps:
            slabs.partial_push(info.cid, h)
        return freed, used

    def resolve_owned(self, blocks, dead_owner: int, busy=None, unindexed=frozenset()) -> int:
        """Reaping: settle blocks whose owner slot died. Returns blocks freed.

        RESERVED blocks are freed; a LIVE block is kept (its owner cleared, under the shard lock that pins
        its entry) if the index points at it, else freed if it is still the dead slot's with the word read
        first: a live process that replaced or deleted its entry before the index was asked claimed it (and
        may have reused it and published it again since, its owner cleared): it is that process's to settle.
        The owner may be our own live slot, settling what a call an exception ended still held: `busy(offset)`,
        asked last, under the class lock, says another holder in this process took the block since (a kept
        list, another thread's call): it stays. A LIVE block in `unindexed` (one the call never handed to
        the index) is freed without asking it.
        """
        by_class: dict[int, list[int]] = {}
        for off in blocks:
            h, info = self.slabs.head_of(off)
            if info is not None:
                by_class.setdefault(info.cid, []).append(off)
        freed = 0
        for cid, offs in by_class.items():
            with self.locks.class_lock(cid):
                freed += self._resolve_class(offs, dead_owner, busy, unindexed)
        return freed

    def _resolve_class(self, offs: list[int], dead_owner: int, busy, unindexed) -> int:
        metas = self.metas
        settle = []  # (offset, block location, word, keep)
        ask, where = [], {}
        for off in offs:
            loc = self.slabs.block_index(off)
            if loc is None:
                continue
            word, d, _, owner, _, _ = metas.read(off)
            if owner != dead_owner or word & 3 == FREE:
                continue
            if word & 3 == LIVE and off not in unindexed:
                ask.append((d, off, word, dead_owner))
                where[off] = loc
            else:
                settle.append((off, loc, word, False))
        if ask:
            kept = self.host.indexed_many(ask)  # clears the owner of the indexed ones
            settle += [(off, where[off], word, k) for (_, off, word, _), k in zip(ask, kept)]
        freed = 0
        for off, loc, word, keep in settle:
            m = metas.meta_off(off)
            if not keep and metas.word(m) == word and metas.owner(m) == dead_owner and not (busy and busy(off)):
                self.release.free_block(loc[0], loc[1], loc[2], off)
                freed += 1
            if _cp.ARMED is not None:
                _cp.hit("reap.mid")
        return freed

