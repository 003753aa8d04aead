"""Runs of FREE units, where new slabs are formatted (POOL lock; FORMAT.md section 5, DESIGN.md section 7).

The free floor (superblock `free_floor`) is a hint: no unit below it is FREE. A search starts there and
reads the slab table in growing windows, so a full pool costs nothing to ask and a filling pool reads a
window, not the whole table (one 64-byte entry per unit).
"""

from __future__ import annotations

import numpy as np

from ..format.layout import FREE_FLOOR_OFF, U32, UNIT_FREE, UNIT_HEAD
from .classtable import ClassTable
from .slabtable import SlabTable


class FreeRuns:
    def __init__(self, mm, geo, slabs: SlabTable, classes: ClassTable):
        self.mm, self.geo, self.slabs, self.class_table = mm, geo, slabs, classes

    def find_free_run(self, k: int) -> int | None:
        runs = self.find_free_runs(k, 1)
        return runs[0] if runs else None

    def find_free_runs(self, k: int, count: int) -> list[int]:
        """POOL held: starts of up to `count` non-overlapping runs of k FREE units, lowest first.

        The search starts at the free floor and stops once it has enough runs; it then raises the floor
        to the first FREE unit it saw.
        """
        n = self.geo.n_units
        if k > n or count <= 0:
            return []
        floor = U32.unpack_from(self.mm, FREE_FLOOR_OFF)[0]
        lo = min(floor, n)
        if n - lo < k:  # the free units left at the end (if any) are too few for one slab
            return []
        # The slab table is 64 bytes per unit and cold after a large copy: read what a filling pool needs
        # (its runs sit right at the floor), doubling the window while runs are missing.
        window = max(64, 2 * k * count)
        out: list[int] = []
        first_free = None
        nxt = lo  # no run may start before this (the end of the last run taken)
        while lo < n and len(out) < count:
            hi = min(n, lo + window)
            bounds = self._free_segments(lo, hi)
            if first_free is None and bounds:
                first_free = bounds[0]
            resume = hi
            for s, e in zip(bounds[0::2], bounds[1::2]):
                # Maximal segments of FREE units [s, e), runs taken greedily from each start: the same runs
                # as trying every start in turn, without a Python step per unit of a large free area.
                u = max(s, nxt)
                if u + k <= e:
                    u = max(u, self.reach_before(s))  # past a damaged extent that runs into the segment
                while u + k <= e:
                    out.append(u)
                    if len(out) == count:
                        break
                    u += k
                nxt = max(nxt, u)
                if len(out) == count:
                    break
                if e == hi < n:  # the segment may go on past the window: resume where its runs stopped
                    resume = max(u, s)
            lo = resume if resume > lo else hi  # always forward
            window = min(2 * window, 1 << 16)
        new_floor = first_free if first_free is not None else lo
        if new_floor != floor:
            U32.pack_into(self.mm, FREE_FLOOR_OFF, new_floor)
        return out

    def _free_segments(self, lo: int, hi: int) -> list[int]:
        """Starts and ends, interleaved, of the maximal FREE segments of units [lo, hi)."""
        free = self.slabs.states[lo:hi] == UNIT_FREE
        bounds = (np.flatnonzero(free[1:] != free[:-1]) + (lo + 1)).tolist()
        if free[0]:
            bounds.insert(0, lo)
        if free[-1]:
            bounds.append(hi)
        return bounds

    def lower_free_floor(self, u: int) -> None:
        """POOL held: unit u is about to become FREE; lower the floor first so the search reaches it (a crash
        in between leaves the floor low: a longer search, never a unit it skips)."""
        if u < U32.unpack_from(self.mm, FREE_FLOOR_OFF)[0]:
            U32.pack_into(self.mm, FREE_FLOOR_OFF, max(0, u))

    def reset_floor(self) -> None:
        """POOL repair: whatever a dead holder left in the floor, the search starts at unit 0."""
        U32.pack_into(self.mm, FREE_FLOOR_OFF, 0)

    def _earlier_heads(self, u: int):
        """(heads, units per slab) of the HEADs close enough before unit u to extend over it."""
        ct = self.class_table
        lo = max(0, u - ct.max_units + 1)
        heads = np.flatnonzero(self.slabs.states[lo:u] == UNIT_HEAD) + lo
        cls = np.minimum(self.slabs.clsfield[heads], len(ct.units_of) - 1).astype(np.int64)
        return heads, ct.units_of[cls]

    def reach_before(self, s: int) -> int:
        """The first unit at or after s that no slab whose HEAD is before s extends over (s if none does).

        For a segment of FREE units starting at s, no HEAD lies inside the segment, so one read of the
        max_units units before s clears every start in it (`reached_by_earlier_slab`, once).
        """
        heads, units = self._earlier_heads(s)
        if not heads.size:
            return s
        return max(s, int((heads + units).max()))

    def reached_by_earlier_slab(self, u: int) -> bool:
        """Does a slab whose HEAD is before unit u extend to u or beyond?

        HEAD entries are the truth and TAIL entries derived, so a unit inside a slab's extent is not
        free whatever its own (damaged) entry says; a slab formatted there would overwrite that slab's
        values.
        """
        heads, units = self._earlier_heads(u)
        return bool(heads.size) and bool((heads + units > u).any())
