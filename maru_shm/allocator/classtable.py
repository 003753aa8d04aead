"""The class table as this process last read it (FORMAT.md section 4).

Entries change only under the CLASSTAB lock (declare_exact) or in a repair holding every lock; each
change bumps CLASSES_VERSION, and a process re-reads the table when it sees the version move. An entry
whose shape is impossible, or a geometric entry that is not what creation wrote, is unusable: its
ClassInfo is None and nothing allocates from it.
"""

from __future__ import annotations

import bisect
import time

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import (CLASS_STRUCT, CLASSES_VERSION_OFF, KIND_EXACT, KIND_GEOMETRIC, KIND_UNUSED,
                             LOCK_CLASSTAB, U32)
from ..format.sizeclasses import exact_slab_floor, planned_geometric, slab_shape


class ClassInfo:
    __slots__ = ("cid", "kind", "k", "block", "bps")

    def __init__(self, cid, kind, k, block, bps):
        self.cid, self.kind, self.k, self.block, self.bps = cid, kind, k, block, bps


class ClassTable:
    def __init__(self, mm, geo, locks):
        self.mm, self.geo, self.locks = mm, geo, locks
        self.classes: list[ClassInfo | None] = []
        self.geo_sizes: list[int] = []  # block sizes of the usable geometric classes, ascending
        self.geo_cids: list[int] = []   # their class ids (not the list position: unusable classes are skipped)
        self.exact: dict[int, int] = {}  # block size -> exact-fit class id
        self.units_of = np.zeros(1, dtype=np.int64)  # units per slab by class id (0: unusable), + a 0 sentinel
        self.max_units = 0
        self.version = -1  # CLASSES_VERSION when last read; -1: read again
        self._arrays = None
        self._arrays_version = None
        self.refresh()

    def info(self, cid: int) -> ClassInfo | None:
        return self.classes[cid] if 0 <= cid < len(self.classes) else None

    def invalidate(self) -> None:
        """Read the table again at the next refresh, whatever the version says (a repair rewrote it)."""
        self.version = -1

    def _version_moved(self) -> bool:
        return U32.unpack_from(self.mm, CLASSES_VERSION_OFF)[0] != self.version

    def refresh(self) -> None:
        (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
        if ver == self.version:
            return
        g = self.geo
        classes, geometric, exact = [], [], {}
        planned = planned_geometric(g.granule, g.unit_size, g.max_value)
        for cid in range(g.class_cap):
            kind, k, block, bps = CLASS_STRUCT.unpack_from(self.mm, g.class_entry(cid))[:4]
            valid = g.class_fits(kind, k, block, bps)
            if cid < g.n_geo_classes and cid < len(planned):
                valid = valid and (kind, k, block, bps) == planned[cid]  # fixed at creation: damage = unusable
            info = ClassInfo(cid, kind, k, block, bps) if valid else None
            classes.append(info)
            if info and kind == KIND_GEOMETRIC and cid < g.n_geo_classes:
                geometric.append((block, cid))
            elif info and kind == KIND_EXACT:
                exact[block] = cid
        geometric.sort()  # ascending by construction; sorted anyway so bisect holds whatever the table says
        self.geo_sizes, self.geo_cids = [b for b, _ in geometric], [c for _, c in geometric]
        self.classes, self.exact = classes, exact
        self.units_of = np.array([c.k if c else 0 for c in classes] + [0], dtype=np.int64)
        self.max_units = int(self.units_of.max())
        self.version = ver

    def arrays(self):
        """(block sizes, blocks per slab) indexed by class id, 0 for unused classes (for numpy checks)."""
        if self._version_moved():
            self.refresh()
        if self._arrays_version != self.version:
            block = np.zeros(self.geo.class_cap, dtype=np.int64)
            per_slab = np.zeros(self.geo.class_cap, dtype=np.int64)
            for c in self.classes:
                if c is not None:
                    block[c.cid], per_slab[c.cid] = c.block, c.bps
            self._arrays = (block, per_slab)
            self._arrays_version = self.version
        return self._arrays

    def class_for(self, n: int) -> ClassInfo | None:
        """Exact-fit class of exactly n bytes if declared, else the smallest geometric class >= n."""
        cid = self.exact.get(n)
        if cid is None and self._version_moved():
            self.refresh()
            cid = self.exact.get(n)
        if cid is not None:
            return self.classes[cid]
        i = bisect.bisect_left(self.geo_sizes, max(n, 1))
        if i >= len(self.geo_sizes):
            return None
        return self.classes[self.geo_cids[i]]  # by class id: position i is not class i once one is skipped

    def declare_exact(self, n: int) -> ClassInfo:
        """Give block size n its own class (idempotent); geometric fallback when the table is full."""
        g = self.geo
        self.refresh()
        if n in self.exact:
            return self.classes[self.exact[n]]
        if n < g.granule or n > g.max_value:
            raise ValueError(f"exact size {n} outside [{g.granule}, {g.max_value}]")
        with self.locks.hold(LOCK_CLASSTAB):
            self.invalidate()
            self.refresh()
            if n in self.exact:
                return self.classes[self.exact[n]]
            for cid in range(g.n_geo_classes, g.class_cap):
                if U32.unpack_from(self.mm, g.class_entry(cid))[0] == KIND_UNUSED:
                    self._write_exact(cid, n)
                    break
            else:
                return self.class_for(n)
        self.refresh()
        return self.classes[self.exact[n]]

    def _write_exact(self, cid: int, n: int) -> None:
        """CLASSTAB held: entry cid (unused) becomes the exact-fit class of n-byte blocks; kind last."""
        g = self.geo
        off = g.class_entry(cid)
        # Up to twice the floor (a page that does not divide the floor's slab finds a k past it that wastes
        # under 1 %), and never more than a quarter of the units: a slab of more units than the pool has
        # would make the entry invalid (refresh drops it, and declare_size raised KeyError).
        floor = exact_slab_floor(g.data_bytes)
        reach = max(64, 2 * -(-floor // g.unit_size))
        k, per_slab = slab_shape(n, g.unit_size, max_units=min(reach, max(1, g.n_units // 4)), min_bytes=floor)
        CLASS_STRUCT.pack_into(self.mm, off, KIND_UNUSED, k, n, per_slab, 0, 0, 0, time.time_ns())
        U32.pack_into(self.mm, off, KIND_EXACT)  # kind last: the entry is complete
        if _cp.ARMED is not None:
            _cp.hit("classtab.mid_declare")
        (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
        U32.pack_into(self.mm, CLASSES_VERSION_OFF, (ver + 1) & 0xFFFFFFFF)
