"""The rules both checks share: what a report holds, and the slab-table facts derived from HEAD entries.

check.py applies every rule of docs/FORMAT.md domain by domain; repair.py repairs and then runs the
same live check with every lock held. The few facts both need about the slab table (which HEADs are
unusable, where blocks start, whether a class entry is what it must be) live here, once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..format.layout import CLASS_STRUCT, KIND_EXACT, KIND_UNUSED, UNIT_HEAD
from ..format.sizeclasses import planned_geometric


@dataclasses.dataclass
class CheckReport:
    ok: bool = True
    problems: list = dataclasses.field(default_factory=list)
    repaired: int = 0
    checked_blocks: int = 0
    checked_entries: int = 0
    to_reap: list = dataclasses.field(default_factory=list)
    # checked without locks, by a user who may not reach the pool's lock file: what writers were changing
    # meanwhile may read as problems, and no process's liveness is known
    unlocked: bool = False

    def problem(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)

    def reapable(self, msg: str) -> None:
        """What a process that exited left for the next opener to reap (FORMAT.md section 9, reaping): not damage."""
        self.to_reap.append(msg)

    def __bool__(self) -> bool:
        return self.ok


def planned_class(g, cid: int):
    """(kind, k, block_size, blocks_per_slab) creation wrote for geometric class cid (poolfile._write_header)."""
    return planned_geometric(g.granule, g.unit_size, g.max_value)[cid]


def class_entry_problem(store, cid: int) -> str | None:
    """Why class entry cid is damaged, or None. Geometric entries must be exactly what creation wrote;
    an exact-fit entry must be usable (the shape rules refresh_classes applies); other kinds are invalid."""
    g, alloc = store.geo, store.alloc
    kind, k, block, bps = CLASS_STRUCT.unpack_from(store.mm, g.class_entry(cid))[:4]
    if cid < g.n_geo_classes:
        want = planned_class(g, cid)
        if (kind, k, block, bps) != want:
            return f"class {cid}: entry (kind {kind}, {k} units, block {block}, {bps} blocks) is not " \
                   f"geometric class (kind {want[0]}, {want[1]} units, block {want[2]}, {want[3]} blocks)"
        return None
    if kind == KIND_UNUSED:
        return None
    if kind != KIND_EXACT:
        return f"class {cid}: invalid kind {kind}"
    if alloc.classes[cid] is None or block > g.max_value:
        return f"class {cid}: exact-fit entry with an impossible shape ({k} units, block {block}, {bps} blocks)"
    return None


def bad_heads(store):
    """(unit, reason) of every HEAD entry that names no usable class, runs past the data area, or
    overlaps an earlier slab (lowest unit first, as check() reports them)."""
    g, alloc = store.geo, store.alloc
    covered = np.zeros(g.n_units, dtype=bool)
    out = []
    for h in np.flatnonzero(alloc.states == UNIT_HEAD).tolist():
        c = int(alloc.clsfield[h])
        info = alloc.classes[c] if c < len(alloc.classes) else None
        if info is None:
            out.append((h, f"slab at unit {h}: unknown size class {c}"))
        elif not g.slab_fits(h, info.k):
            out.append((h, f"slab at unit {h}: {info.k} units run past the data area"))
        elif covered[h:h + info.k].any():
            out.append((h, f"slab at unit {h}: overlaps another slab"))
        else:
            covered[h:h + info.k] = True
    return out


def block_starts(store) -> np.ndarray:
    """Boolean per granule: a block of a formatted slab starts there."""
    g, alloc = store.geo, store.alloc
    starts = np.zeros(g.n_granules, dtype=bool)
    for h in np.flatnonzero(alloc.states == UNIT_HEAD).tolist():
        info = alloc.classes[int(alloc.clsfield[h])] if int(alloc.clsfield[h]) < len(alloc.classes) else None
        if info is None or not g.slab_fits(h, info.k):
            continue
        offs = g.block_offset(h, np.arange(info.bps, dtype=np.int64), info.block)
        starts[offs // g.granule] = True
    return starts
