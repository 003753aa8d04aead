"""The Allocator: one object over the allocator's parts, with the face the store and the checks use.

    classtable   size classes as last read          slabtable   slab entries, bitmaps, partial lists
    blockmeta    block lifetimes (the metas)        freeruns    free units, the free floor
    keptblocks   blocks kept for our next puts      reserve     allocation, making room
    freeing      freeing and its derived state      policy      POLICY: every eviction decision (Settings)
    blockclock   MECHANISM: evict within a class    slabmover   MECHANISM: move a slab between classes
    demand       class demand, the retention rule
    repair       rebuild derived state, reaping     classlocks  CLASS / POOL locks with their repairs

What only the layer above knows comes in through `host` (host.AllocatorHost).
"""

from __future__ import annotations

from .blockclock import BlockClock
from .blockmeta import BlockMetas
from .classtable import ClassInfo, ClassTable
from .demand import Demand
from .freeruns import FreeRuns
from .host import AllocatorHost
from .keptblocks import KeptBlocks
from .classlocks import AllocatorLocks
from .policy import EvictionPolicy, current
from .freeing import BlockRelease
from .repair import Repairer
from .reserve import Reserver
from .slabmover import SlabMover
from .slabtable import SlabTable


class Allocator:
    def __init__(self, host: AllocatorHost):
        self.host = host
        mm, geo = host.mm, host.geo
        self.mm, self.geo = mm, geo
        self.locks = AllocatorLocks(host.locks)
        self.class_table = ClassTable(mm, geo, host.locks)
        self.slabs = SlabTable(mm, geo, self.class_table)
        self.metas = BlockMetas(mm, geo)
        self.runs = FreeRuns(mm, geo, self.slabs, self.class_table)
        self.demand = Demand(mm, geo)
        self.policy = EvictionPolicy(current(), mm, geo, self.metas.meta_refs, self.demand)
        self.kept_blocks = KeptBlocks(self.metas, self.slabs)
        self.release = BlockRelease(host, self.locks, self.slabs, self.metas, self.kept_blocks)
        self.clock = BlockClock(host, self.slabs, self.metas, self.release, self.policy)
        self.mover = SlabMover(host, self.locks, self.class_table, self.slabs, self.metas, self.runs, self.release)
        self.repairer = Repairer(host, self.locks, self.class_table, self.slabs, self.metas, self.runs, self.release)
        self.locks.repair_class = self.repairer.repair_class
        self.locks.repair_pool = self.repairer.repair_pool
        self.reserver = Reserver(self.locks, self.slabs, self.metas, self.kept_blocks, self.runs, self.policy,
                                 self.clock, self.mover)
        # The calls on every get and put go straight to the part that answers them (one Python call less).
        self.class_for = self.class_table.class_for          # (n) -> ClassInfo | None
        self.head_of = self.slabs.head_of                    # (offset) -> (head unit, ClassInfo) | (None, None)
        self.block_index = self.slabs.block_index            # (offset) -> (head, ClassInfo, block) | None
        self.meta_off = geo.meta_of                          # (offset) -> file offset of its block meta
        self.is_pinned = self.metas.is_pinned                # (offset) -> bool
        self.allocate = self.reserver.allocate               # (info, digests, lengths, owner) -> offsets
        self.free_blocks = self.release.free_blocks          # (blocks, keep=0) -> blocks freed

    def release_views(self) -> None:
        """Drop numpy views so the mapping can be closed."""
        self.slabs.release_views()
        self.metas.release_views()
        self.demand.release_views()
        self.policy.release_views()

    # ---------------------------------------------------------------- views (numpy, over the mapping)
    states = property(lambda self: self.slabs.states)
    clsfield = property(lambda self: self.slabs.clsfield)
    unit_refs = property(lambda self: self.slabs.unit_refs)
    meta_q = property(lambda self: self.metas.meta_q)
    meta_words = property(lambda self: self.metas.meta_words)
    meta_owners = property(lambda self: self.metas.meta_owners)
    meta_refs = property(lambda self: self.metas.meta_refs)
    cls_nslabs = property(lambda self: self.demand.cls_nslabs)

    # ---------------------------------------------------------------- classes
    classes = property(lambda self: self.class_table.classes)

    def refresh_classes(self) -> None:
        self.class_table.refresh()

    def invalidate_classes(self) -> None:
        """Read the class table again at the next refresh (a repair rewrote it)."""
        self.class_table.invalidate()

    def class_arrays(self):
        return self.class_table.arrays()

    def declare_exact(self, n: int) -> ClassInfo:
        return self.class_table.declare_exact(n)

    def free_kept(self) -> int:
        """Free every block this process keeps for its next puts (keptblocks.py); blocks freed. An owned block
        pins its slab against moves and eviction, so a put that found no room gives them up first."""
        return self.release.free_blocks(self.kept_blocks.take_all())

    # ---------------------------------------------------------------- repair and reaping
    def repair_pool(self) -> int:
        return self.repairer.repair_pool()

    def repair_class(self, cid: int) -> int:
        return self.repairer.repair_class(cid)

    def resolve_owned(self, blocks, dead_owner: int, busy=None, unindexed=frozenset()) -> int:
        return self.repairer.resolve_owned(blocks, dead_owner, busy, unindexed)
