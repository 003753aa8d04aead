"""Policy: which class deserves the pool's units (memcached's slab_automove.c, here decided per allocation).

Every allocation adds its bytes to its class's decayed demand (FORMAT.md section 4); a class that must
make room asks `should_move` whether to take a slab from the pool (slab CLOCK, slabmover.py) or to evict
its own blocks (block CLOCK, blockclock.py). This module decides and never moves anything.
"""

from __future__ import annotations

import numpy as np

from ..format import (CLASS_ENTRY, CLS_DEMAND, CLS_DEMAND_EPOCH, CLS_K, CLS_NSLABS, DEMAND_ACC_OFF,
                      DEMAND_EPOCH_OFF, U32, U64)
from .classtable import ClassInfo

# Every class's counter halves each time the pool has allocated data_bytes / DEMAND_EPOCH_DIV bytes
# (an epoch).
DEMAND_EPOCH_DIV = 4
# A class that must evict takes a slab from the pool (slab CLOCK) instead of evicting its own blocks
# while it is short of its share of demand d (a fraction) by more than min(MOVE_RATIO x d, MOVE_ABS)
# of the slab bytes (FORMAT.md section 8).
MOVE_RATIO = 0.5
MOVE_ABS = 0.05


class DemandPolicy:
    def __init__(self, mm, geo):
        self.mm, self.geo = mm, geo
        cap, oc = geo.class_cap, geo.off_classes

        def column(field: int, dtype: str) -> np.ndarray:
            return np.ndarray((cap,), dtype=dtype, buffer=mm, offset=oc + field, strides=(CLASS_ENTRY,))
        self.cls_k = column(CLS_K, "<u4")
        self.cls_nslabs = column(CLS_NSLABS, "<u4")
        self.cls_demand = column(CLS_DEMAND, "<u8")
        self.cls_epoch = column(CLS_DEMAND_EPOCH, "<u4")

    def release_views(self) -> None:
        self.cls_k = self.cls_nslabs = self.cls_demand = self.cls_epoch = None

    def add(self, cid: int, nbytes: int) -> None:
        """CLASS[cid] held: add an allocation's bytes to the class's decayed demand.

        The pool-wide epoch and its byte accumulator are hints written without a lock (a lost update
        only shifts when the next halving happens). The class counter is decayed lazily: it holds its
        value as of `epoch`, and is halved once per epoch passed since.
        """
        mm = self.mm
        (epoch,) = U32.unpack_from(mm, DEMAND_EPOCH_OFF)
        (acc,) = U64.unpack_from(mm, DEMAND_ACC_OFF)
        acc += nbytes
        if acc >= max(1, self.geo.data_bytes // DEMAND_EPOCH_DIV):
            epoch = (epoch + 1) & 0xFFFFFFFF
            U32.pack_into(mm, DEMAND_EPOCH_OFF, epoch)
            acc = 0
        U64.pack_into(mm, DEMAND_ACC_OFF, acc)
        co = self.geo.class_entry(cid)
        (dem,) = U64.unpack_from(mm, co + CLS_DEMAND)
        (ep,) = U32.unpack_from(mm, co + CLS_DEMAND_EPOCH)
        dem >>= min(63, (epoch - ep) & 0xFFFFFFFF)
        U64.pack_into(mm, co + CLS_DEMAND, min(dem + nbytes, 2**63))
        U32.pack_into(mm, co + CLS_DEMAND_EPOCH, epoch)

    def should_move(self, info: ClassInfo) -> bool:
        """The rule (FORMAT.md section 8): take a slab from the pool rather than evict within the class?

        Yes when the class has no slab, or when its share of the bytes in slabs falls short of its
        share d of the (decayed) demand of all classes by more than min(MOVE_RATIO x d, MOVE_ABS):
        by more than half for a class with a small share (noise in a small class's demand must not
        trade slabs back and forth: every move evicts a whole window and leaves a slab to fill), by
        more than 5 % of the pool for a class with a large share. Other classes' counters are read
        without their locks: a stale value only shifts one decision.
        """
        cid = info.cid
        nslabs = self.cls_nslabs.astype(np.float64)
        if nslabs[cid] == 0:
            return True
        (epoch,) = U32.unpack_from(self.mm, DEMAND_EPOCH_OFF)
        age = (np.uint32(epoch) - self.cls_epoch).astype(np.int64)
        dem = self.cls_demand.astype(np.float64) * np.exp2(-np.clip(age, 0, 63))
        slab = nslabs * self.cls_k
        total_dem, total_slab = float(dem.sum()), float(slab.sum())
        if total_dem <= 0 or total_slab <= 0:
            return False
        share = dem[cid] / total_dem
        return share - slab[cid] / total_slab > min(MOVE_RATIO * share, MOVE_ABS)
