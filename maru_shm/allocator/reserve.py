"""Allocation: reserve one block per value, making room when the class has none (FORMAT.md section 8, DESIGN.md section 7).

Blocks come from the process's kept blocks first (no lock, keptblocks.py), then from the class's partial
slabs under CLASS[c]; with none left the class makes room as policy.py decides, with the mechanisms here
(free units for new slabs, a slab move) and in blockclock.py (eviction within the class).
"""

from __future__ import annotations

import numpy as np

from .blockclock import BlockClock
from ..batching import SMALL_BATCH
from .blockmeta import BlockMetas, digest_bytes
from .classtable import ClassInfo
from .freeruns import FreeRuns
from .keptblocks import KeptBlocks, spare_limit
from .classlocks import AllocatorLocks
from .policy import EvictionPolicy
from .slabmover import SlabMover
from .slabtable import SlabTable

_NO_DIGEST = bytes(16)  # a spare's digest: it holds no value yet


class Reserver:
    def __init__(self, locks: AllocatorLocks, slabs: SlabTable, metas: BlockMetas, kept: KeptBlocks,
                 runs: FreeRuns, policy: EvictionPolicy, clock: BlockClock, mover: SlabMover):
        self.locks, self.slabs, self.metas, self.kept = locks, slabs, metas, kept
        self.runs, self.policy, self.clock, self.mover = runs, policy, clock, mover

    def allocate(self, info: ClassInfo, digests: np.ndarray, lengths: np.ndarray, owner: int) -> list[int]:
        """Reserve one block per value; return their data offsets.

        `digests` are the keys' digests as (m, 2) little-endian u64 halves, `lengths` the values' lengths
        (numpy); a batch of at most SMALL_BATCH values may pass lists of 16-byte digests and ints instead.
        Fewer offsets than items means the pool could not make room (every candidate slab busy with
        writers). Each block is RESERVED with `owner`. Blocks are taken from the partial slabs first and
        reserved together (one numpy pass) before anything that may evict or repair this class: a taken
        block must carry its owner by then, or the eviction that makes room for the rest could free the
        slab under it.
        """
        out: list[int] = self.kept.reuse(info, digests, lengths, owner, self.policy.birth()) \
            if self.kept.count(info.cid) else []
        if len(out) == len(lengths):
            return out
        return self._allocate_locked(info, digests, lengths, owner, out)

    def _allocate_locked(self, info: ClassInfo, digests, lengths, owner: int, out: list[int]) -> list[int]:
        """The part of `allocate` under the class lock: values len(out) .. m-1 (out holds blocks reused)."""
        cid, m = info.cid, len(lengths)
        pending: list[int] = []

        def reserve_pending():
            if pending:
                self.kept.track(pending)
                self._reserve(pending, digests[len(out):], lengths[len(out):], owner, small=m <= SMALL_BATCH)
                out.extend(pending)
                pending.clear()

        rebuilt = False
        # Bounded: each round takes blocks, takes a slab off the partial list, makes room or rebuilds once.
        rounds = m + 2 * self.slabs.geo.n_units + 4
        with self.locks.class_lock(cid):
            self.policy.allocated(cid, (m - len(out)) * info.block)
            while len(out) + len(pending) < m and rounds > 0:
                rounds -= 1
                head = self.slabs.partial_head(cid)
                if head == 0:
                    reserve_pending()
                    if not self.policy.make_room(self, info, m - len(out)):
                        break
                    continue
                if not self.slabs.usable_partial(head - 1, info):
                    # The list names no partial slab of this class, or a slab whose extent or shape is not
                    # the class's (damage): blocks reserved there would overlap another slab's values.
                    # Rebuild the class from the slab table, once (blocks taken so far are reserved first:
                    # the rebuild derives the bitmaps from the block metas).
                    reserve_pending()
                    if rebuilt:
                        break
                    self.locks.repair_class(cid)
                    rebuilt = True
                    continue
                self.slabs.take_free(head - 1, info, m - len(out) - len(pending), m <= SMALL_BATCH, pending)
            reserve_pending()
            if m == 1 and out:
                self._reserve_spares(info, owner)
        return out

    def _reserve_spares(self, info: ClassInfo, owner: int) -> None:
        """CLASS held, a single-key put has its block: reserve spares from the partial slab for this
        process's next puts of the class (keptblocks.spare_limit), never making room for them."""
        want = spare_limit(info) - self.kept.count(info.cid)
        head = self.slabs.partial_head(info.cid)
        if want <= 0 or head == 0 or not self.slabs.usable_partial(head - 1, info):
            return
        spares: list[int] = []
        self.slabs.take_free(head - 1, info, want, True, spares)
        self.kept.track(spares)
        for off in spares:
            self.metas.reserve(off, _NO_DIGEST, 0, owner, self.policy.birth())
        self.kept.give_back(info.cid, spares)

    def _reserve(self, offsets: list[int], digests, lengths, owner: int, small: bool) -> None:
        ref = self.policy.birth()
        if small:  # scalar meta writes
            for j, off in enumerate(offsets):
                self.metas.reserve(off, digest_bytes(digests[j]), int(lengths[j]), owner, ref)
        else:
            self.metas.reserve_many(offsets, digests[:len(offsets)], lengths[:len(offsets)], owner, ref)

    def format_free_slabs(self, info: ClassInfo, nblocks: int) -> bool:
        """CLASS[c] held: format new slabs of the class on free units (one POOL round), enough for `nblocks`
        blocks, and one more for a batch that fills whole slabs (the next batch finds it partial); any?"""
        need = -(-nblocks // info.bps) + (nblocks >= info.bps)
        with self.locks.pool_lock():
            runs = self.runs.find_free_runs(info.k, need)
            for u in runs:
                self.slabs.format(u, info)
        return bool(runs)

    def move_slab(self, info: ClassInfo, donors) -> bool:
        """CLASS[c] held: a slab move into the class from the `donors` classes (None: any class)."""
        with self.locks.pool_lock():
            return self.mover.move_slab(info, donors)
