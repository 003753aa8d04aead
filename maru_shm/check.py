"""Whole-pool repair and the rules the checks share (`Store.check`, `maru-shm check --repair`).

Repair holds every class, pool and shard lock (in the documented order) so
it sees a quiescent pool, then verifies each rule of docs/FORMAT.md. Repair
re-runs every domain repair, which rebuilds derived state from the two
sources of truth (slab HEAD entries and block metas) and frees what no live
process or index entry owns.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from .sizeclasses import planned_geometric
from .format import (CLASS_ENTRY, CLASS_LOCK_BASE, CLASS_STRUCT, CLASSES_VERSION_OFF, FREE, KIND_EXACT, KIND_UNUSED,
                     LOCK_CLASSTAB, LOCK_POOL, SHARD_LOCK_BASE, UNIT_FREE, UNIT_HEAD, UNIT_TAIL, U32,
                     next_word, store_u64)
from .locks import lock_name
from .validity import entry_problem


@dataclasses.dataclass
class CheckReport:
    ok: bool = True
    problems: list = dataclasses.field(default_factory=list)
    repaired: int = 0
    checked_blocks: int = 0
    checked_entries: int = 0

    def problem(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)

    def __bool__(self) -> bool:
        return self.ok


def check_store(store, repair: bool = False, progress=None) -> CheckReport:
    """Verify the whole pool; with repair=True rebuild it first and report what is still wrong.

    Without repair this is the live check (livecheck.check_live): read-only, one lock domain at a time.
    Repair holds every lock for its whole run: it rewrites derived state across domains.
    """
    if not repair:
        from .inspect import PoolView
        from .livecheck import check_live
        return check_live(PoolView.of(store), timeout=store.timeout, progress=progress)
    locks = store.locks
    g = store.geo
    alloc = store.alloc
    report = CheckReport()
    if repair:
        # PROC repair: reap slots whose process died (settles their blocks). Reaping takes CLASS and
        # PROC locks itself, so it runs before this check holds every lock.
        report.repaired += store.reap_dead()
    alloc.refresh_classes()
    held: list[int] = []
    dirty: list[int] = []
    # Every class another process may be using: the geometric ones whatever their entry says now (a
    # damaged entry is not re-read by processes that cached it), and every entry with a kind.
    classes = [c for c in range(g.class_cap)
               if c < g.n_geo_classes or U32.unpack_from(store.mm, alloc.geo.class_entry(c))[0] != KIND_UNUSED]
    order = [LOCK_CLASSTAB] + [CLASS_LOCK_BASE + c for c in classes] + [LOCK_POOL] + \
        [SHARD_LOCK_BASE + s for s in range(g.index_shards)]
    try:
        for lock_id in order:
            if locks.acquire(lock_id):
                dirty.append(lock_id)
            held.append(lock_id)
        locks.all_held_by = threading.get_ident()  # repairs below ask the index without taking SHARD locks
        if repair:
            report.repaired += _repair_all(store, classes)
            dirty = []
        for lock_id in dirty:
            report.problem(f"lock {lock_name(lock_id)}: left dirty by a process that died holding it")
        from .livecheck import NoLocks, check_domains
        found = check_domains(store, NoLocks(), progress)
        for p in found.problems:
            report.problem(p)
        report.checked_blocks, report.checked_entries = found.checked_blocks, found.checked_entries
    finally:
        locks.all_held_by = 0
        for lock_id in reversed(held):
            locks.release(lock_id, clean=repair or lock_id not in dirty)
    return report


def planned_class(g, cid: int):
    """(kind, k, block_size, blocks_per_slab) creation wrote for geometric class cid (poolfile._write_header)."""
    return planned_geometric(g.granule, g.unit_size, g.max_value)[cid]


def _class_entry_problem(store, cid: int) -> str | None:
    """Why class entry cid is damaged, or None. Geometric entries must be exactly what creation wrote;
    an exact-fit entry must be usable (the shape rules refresh_classes applies); other kinds are invalid."""
    g, alloc = store.geo, store.alloc
    kind, k, block, bps = CLASS_STRUCT.unpack_from(store.mm, alloc.geo.class_entry(cid))[:4]
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


def _repair_classes(store) -> int:
    """CLASSTAB and the class locks held: rewrite geometric entries from the geometry, retire unusable
    exact-fit entries (their slabs then have no class and are dropped by _drop_bad_heads)."""
    g, alloc, mm = store.geo, store.alloc, store.mm
    alloc.invalidate_classes()
    alloc.refresh_classes()
    fixes = 0
    for cid in range(g.class_cap):
        if _class_entry_problem(store, cid) is None:
            continue
        o = alloc.geo.class_entry(cid)
        if cid < g.n_geo_classes:
            kind, k, block, bps = planned_class(g, cid)
            CLASS_STRUCT.pack_into(mm, o, KIND_UNUSED, k, block, bps, 0, 0, 0, 0)
            U32.pack_into(mm, o, kind)  # kind last, as at creation
        else:
            U32.pack_into(mm, o, KIND_UNUSED)
            mm[o:o + CLASS_ENTRY] = bytes(CLASS_ENTRY)
        fixes += 1
    if fixes:  # other processes cached the class table: make them re-read it
        (ver,) = U32.unpack_from(mm, CLASSES_VERSION_OFF)
        U32.pack_into(mm, CLASSES_VERSION_OFF, (ver + 1) & 0xFFFFFFFF)
        alloc.refresh_classes()
    return fixes


def _bad_heads(store):
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
        elif h + info.k > g.n_units:
            out.append((h, f"slab at unit {h}: {info.k} units run past the data area"))
        elif covered[h:h + info.k].any():
            out.append((h, f"slab at unit {h}: overlaps another slab"))
        else:
            covered[h:h + info.k] = True
    return out


def _drop_bad_units(store) -> int:
    """Every lock held: turn HEAD entries no reader or writer can use, and units in no valid state, into
    FREE units. Their block metas are freed next (no block starts there any more), their index entries
    dropped, and repair_pool clears the TAIL entries of dropped heads."""
    alloc = store.alloc
    bad = [h for h, _ in _bad_heads(store)]
    bad += np.flatnonzero((alloc.states != UNIT_FREE) & (alloc.states != UNIT_HEAD)
                          & (alloc.states != UNIT_TAIL)).tolist()
    for u in bad:
        U32.pack_into(store.mm, alloc.geo.slab_entry(u), UNIT_FREE)
    return len(bad)


def _repair_all(store, classes) -> int:
    alloc, g = store.alloc, store.geo
    fixes = _repair_classes(store)
    fixes += _drop_bad_units(store)
    fixes += alloc.repair_pool()
    # granules that are not block starts must be FREE
    starts = _block_starts(store)
    words = np.ndarray((g.n_granules,), dtype="<u8", buffer=store.mm, offset=g.off_blockmeta, strides=(32,))
    try:
        bad = np.flatnonzero(((words & np.uint64(3)) != 0) & ~starts)
        for gi in bad.tolist():
            w = int(words[gi])
            store_u64(store.mm, g.off_blockmeta + gi * 32, next_word(w, FREE))
            fixes += 1
    finally:
        del words
    for s in range(g.index_shards):
        kept, dropped = store.index.rebuild(s, lambda d, w, o: _readable(store, d, w, o),
                                            salvage=store.publisher.entry_salvage)
        fixes += dropped
    for c in classes:
        fixes += alloc.repair_class(c)
    return fixes


def _readable(store, d: bytes, word: int, offset: int) -> bool:
    """Would a reader accept this index entry (validity.py, rules 1-5)?"""
    return entry_problem(store.mm, store.geo, store.alloc, d, word, offset) is None


def _block_starts(store) -> np.ndarray:
    """Boolean per granule: a block of a formatted slab starts there."""
    g, alloc = store.geo, store.alloc
    starts = np.zeros(g.n_granules, dtype=bool)
    for h in np.flatnonzero(alloc.states == UNIT_HEAD).tolist():
        info = alloc.classes[int(alloc.clsfield[h])] if int(alloc.clsfield[h]) < len(alloc.classes) else None
        if info is None or h + info.k > g.n_units:
            continue
        offs = h * g.unit_size + np.arange(info.bps, dtype=np.int64) * info.block
        starts[offs // g.granule] = True
    return starts
