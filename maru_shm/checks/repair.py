"""Whole-pool repair (`Store.check(repair=True)`, `maru-shm check --repair`), and Store.check's entry.

Repair holds every class, pool and shard lock (in the documented order) so
it sees a quiescent pool, then verifies each rule of docs/FORMAT.md. Repair
re-runs every domain repair, which rebuilds derived state from the two
sources of truth (slab HEAD entries and block metas) and frees what no live
process or index entry owns.
"""

from __future__ import annotations

import threading

import numpy as np

from ..format.layout import (CLASSES_VERSION_OFF, CLASS_ENTRY, CLASS_LOCK_BASE, CLASS_STRUCT, FREE, KIND_UNUSED,
                             LOCK_CLASSTAB, LOCK_POOL, META_SIZE, SHARD_LOCK_BASE, U32, UNIT_FREE, UNIT_HEAD,
                             UNIT_TAIL, next_word, store_u64)
from .rules import CheckReport, bad_heads, block_starts, class_entry_problem, planned_class
from .check import NoLocks, check_domains, check_live
from ..locking.locks import lock_name
from .view import PoolView
from ..datapath.validity import entry_problem


def check_store(store, repair: bool = False, progress=None) -> CheckReport:
    """Verify the whole pool; with repair=True rebuild it first and report what is still wrong.

    Without repair this is the live check (check.check_live): read-only, one lock domain at a time.
    Repair holds every lock for its whole run: it rewrites derived state across domains.
    """
    if not repair:
        report = check_live(PoolView.of(store), timeout=store.timeout, progress=progress)
        _report_untracked(store, report)
        return report
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
    done = False
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
        found = check_domains(store, NoLocks(), progress)
        for p in found.problems:
            report.problem(p)
        report.checked_blocks, report.checked_entries = found.checked_blocks, found.checked_entries
        done = True
    finally:
        locks.all_held_by = 0
        for lock_id in reversed(held):
            # A repair cut short (an exception, KeyboardInterrupt) may have half rebuilt any domain, or not
            # reached one a dead holder left dirty: every mark stays, and each domain's next holder repairs it.
            locks.release(lock_id, clean=done and (repair or lock_id not in dirty))
    leaked = untracked_blocks(store)  # ours, held by nothing in this process: settled as a dead slot's, once
    if leaked:  # the repair made their classes usable again
        store._reaper.settle(store.slot, leaked, store.alloc.kept_blocks.held_elsewhere)
        report.repaired += len(leaked)
    _report_untracked(store, report)
    return report


def untracked_blocks(store) -> list[int]:
    """Offsets of the blocks this process's slot owns that no kept list and no call in flight holds: what a
    call cut short left behind (DESIGN.md section 9). Only this process can tell: to another one (the live
    check of `maru-shm check`), a block owned by a live process is simply in flight."""
    slot, metas = store.slot, store.alloc.metas
    if slot < 0:
        return []

    def owned():  # a FREE block may still name its last owner (a free cut short): it is nobody's
        return [off for off in store._reaper.owned_blocks(slot) if metas.word(metas.meta_off(off)) & 3 != FREE]
    return store.alloc.kept_blocks.untracked(owned)


def _report_untracked(store, report: CheckReport) -> None:
    leaked = untracked_blocks(store)
    if leaked:
        report.problem(f"{len(leaked)} blocks owned by this process (slot {store.slot}) are held by nothing in "
                       f"it (first at data offset {leaked[0]}): leaked by a call cut short, or one that met damage; "
                       "check(repair=True) here, close(), or reaping once the process is gone settles them")


def _repair_classes(store) -> int:
    """CLASSTAB and the class locks held: rewrite geometric entries from the geometry, retire unusable
    exact-fit entries (their slabs then have no class and are dropped by _drop_bad_units)."""
    g, alloc, mm = store.geo, store.alloc, store.mm
    alloc.invalidate_classes()
    alloc.refresh_classes()
    fixes = 0
    for cid in range(g.class_cap):
        if class_entry_problem(store, cid) is None:
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


def _drop_bad_units(store) -> int:
    """Every lock held: turn HEAD entries no reader or writer can use, and units in no valid state, into
    FREE units. Their block metas are freed next (no block starts there any more), their index entries
    dropped, and repair_pool clears the TAIL entries of dropped heads."""
    alloc = store.alloc
    bad = [h for h, _ in bad_heads(store)]
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
    starts = block_starts(store)
    words = np.ndarray((g.n_granules,), dtype="<u8", buffer=store.mm, offset=g.off_blockmeta, strides=(META_SIZE,))
    try:
        bad = np.flatnonzero(((words & np.uint64(3)) != 0) & ~starts)
        for gi in bad.tolist():
            w = int(words[gi])
            store_u64(store.mm, g.meta_of(gi * g.granule), next_word(w, FREE))
            fixes += 1
    finally:
        del words
    for s in range(g.index_shards):
        kept, dropped = store.index.rebuild(s, lambda d, w, o: _readable(store, d, w, o),
                                            salvage=store._publisher.entry_salvage)
        fixes += dropped
    for c in classes:
        fixes += alloc.repair_class(c)
    return fixes


def _readable(store, d: bytes, word: int, offset: int) -> bool:
    """Would a reader accept this index entry (validity.py, rules 1-5)?"""
    return entry_problem(store.mm, store.geo, store.alloc, d, word, offset) is None


