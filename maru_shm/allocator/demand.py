"""The retention rule: which classes may give a slab to one that must make room (memcached's slab_automove.c).

Every allocation adds its bytes to its class's decayed demand (FORMAT.md section 4); `donors` answers by
*retention*, a class's slab bytes over its decayed demand (DESIGN.md section 7): a request survives only
while its class with the shortest retention keeps its pages. policy.py asks; nothing here moves anything.
"""

from __future__ import annotations

import numpy as np

from ..format.layout import (CLASS_ENTRY, CLS_DEMAND, CLS_DEMAND_EPOCH, CLS_K, CLS_NSLABS, DEMAND_ACC_OFF,
                             DEMAND_EPOCH_OFF, U32, U64)
from .classtable import ClassInfo

# Every class's counter halves each time the pool has allocated data_bytes / DEMAND_EPOCH_DIV bytes
# (an epoch).
DEMAND_EPOCH_DIV = 4


class Demand:
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
        """CLASS[cid] held: add an allocation's bytes to the class's decayed demand, which holds its value as
        of its `epoch` and is halved once per epoch passed since. The pool-wide epoch and its accumulator are
        hints written without a lock: a lost update only shifts when the next halving happens."""
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

    def donors(self, info: ClassInfo, margin: float) -> np.ndarray:
        """The classes (ids) that may give a slab to class c = `info` now (the rule: DESIGN.md section 7).
        With retention r = slab units / decayed demand, d may give one if r_d after >= (1 + margin) x
        r_c after. "After" for d is less c's k units, not d's: the window is c's size and may take several
        of d's smaller slabs. Other classes' counters are read without their locks: a stale value only
        shifts one decision.
        """
        cid = info.cid
        k = self.cls_k.astype(np.float64)
        units = self.cls_nslabs.astype(np.float64) * k
        has_slab = self.cls_nslabs > 0
        if not has_slab[cid]:
            return np.flatnonzero(has_slab)
        (epoch,) = U32.unpack_from(self.mm, DEMAND_EPOCH_OFF)
        age = (np.uint32(epoch) - self.cls_epoch).astype(np.int64)
        dem = self.cls_demand.astype(np.float64) * np.exp2(-np.clip(age, 0, 63))
        if dem[cid] <= 0:
            return np.zeros(0, dtype=np.int64)
        taker = (units[cid] + k[cid]) / dem[cid]
        with np.errstate(divide="ignore", invalid="ignore"):
            giver = np.where(dem > 0, (units - k[cid]) / dem, np.inf)
        others = has_slab.copy()
        others[cid] = False
        return np.flatnonzero(others & (giver >= (1 + margin) * taker))
