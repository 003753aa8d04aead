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

from .allocator.classes import planned_geometric
from .format import (CLASS_ENTRY, CLASS_LOCK_BASE, CLASS_STRUCT, CLASSES_VERSION_OFF, CLS_NSLABS, CLS_PARTIAL,
                     CLS_USED, FREE, FREE_FLOOR_OFF, KIND_EXACT, KIND_UNUSED, LIVE, LOCK_CLASSTAB, LOCK_POOL,
                     META_STRUCT, PROC_ENTRY, PROC_HEAD, RESERVED, SHARD_LOCK_BASE, SLAB_BITMAP, SLAB_INPARTIAL,
                     SLAB_NBLOCKS, SLAB_NEXT, SLAB_NFREE, SLAB_PREV, UNIT_FREE, UNIT_HEAD, UNIT_TAIL, U32, next_word, store_u64)
from .locks import lock_name


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
               if c < g.n_geo_classes or U32.unpack_from(store.mm, alloc._cls_off(c))[0] != KIND_UNUSED]
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
        _check(store, report, progress)
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
    kind, k, block, bps = CLASS_STRUCT.unpack_from(store.mm, alloc._cls_off(cid))[:4]
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
    alloc._classes_version = -1
    alloc.refresh_classes()
    fixes = 0
    for cid in range(g.class_cap):
        if _class_entry_problem(store, cid) is None:
            continue
        o = alloc._cls_off(cid)
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
        U32.pack_into(store.mm, alloc._slab(u), UNIT_FREE)
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
                                            salvage=store._entry_salvage)
        fixes += dropped
    for c in classes:
        fixes += alloc.repair_class(c)
    return fixes


def _readable(store, d: bytes, word: int, offset: int) -> bool:
    """Would a reader accept this index entry (docs/FORMAT.md section 8)? A LIVE block start of a usable
    slab whose meta has the entry's word and digest and a length within the block."""
    if word & 3 != LIVE or not store._entry_valid(d, word, offset):
        return False
    loc = store.alloc.block_index(offset)
    return loc is not None and U32.unpack_from(store.mm, store.alloc.meta_off(offset) + 24)[0] <= loc[1].block


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


def _check(store, report: CheckReport, progress) -> None:
    g, alloc, mm = store.geo, store.alloc, store.mm
    alloc._classes_version = -1  # re-read the table: a damaged entry does not bump classes_version
    alloc.refresh_classes()
    for cid in range(g.class_cap):
        why = _class_entry_problem(store, cid)
        if why:
            report.problem(why)
    covered = np.full(g.n_units, -1, dtype=np.int64)
    class_slabs: dict[int, list[int]] = {}
    for h in np.flatnonzero(alloc.states == UNIT_HEAD).tolist():
        c = int(alloc.clsfield[h])
        info = alloc.classes[c] if c < len(alloc.classes) else None
        if info is None:
            report.problem(f"slab at unit {h}: unknown size class {c}")
            continue
        if h + info.k > g.n_units:
            report.problem(f"slab at unit {h}: {info.k} units run past the data area")
            continue
        if (covered[h:h + info.k] >= 0).any():
            report.problem(f"slab at unit {h}: overlaps another slab")
            continue
        covered[h:h + info.k] = h
        class_slabs.setdefault(c, []).append(h)
        for t in range(h + 1, h + info.k):
            st, head = U32.unpack_from(mm, alloc._slab(t))[0], U32.unpack_from(mm, alloc._slab(t) + 4)[0]
            if st != UNIT_TAIL or head != h:
                report.problem(f"unit {t}: should be a tail of slab {h}")
    for t in np.flatnonzero((alloc.states == UNIT_TAIL) & (covered < 0)).tolist():
        report.problem(f"unit {t}: tail of no slab")
    for u in np.flatnonzero((alloc.states != UNIT_FREE) & (alloc.states != UNIT_HEAD)
                            & (alloc.states != UNIT_TAIL)).tolist():
        report.problem(f"unit {u}: invalid state {int(alloc.states[u])}")
    floor = U32.unpack_from(mm, FREE_FLOOR_OFF)[0]
    hidden = np.flatnonzero(alloc.states[:min(floor, g.n_units)] == UNIT_FREE)
    if hidden.size:
        report.problem(f"free_floor {floor} is above free unit {int(hidden[0])}: the search for free units "
                       "skips it (repair restarts the floor at 0)")

    # slabs and blocks
    starts = _block_starts(store)
    words = np.ndarray((g.n_granules,), dtype="<u8", buffer=mm, offset=g.off_blockmeta, strides=(32,)).copy()
    for gi in np.flatnonzero(((words & np.uint64(3)) != 0) & ~starts).tolist()[:50]:
        report.problem(f"block meta of granule {gi}: in use but no block starts there")
    live_blocks: dict[int, bytes] = {}
    done = 0
    total = sum(len(v) for v in class_slabs.values())
    for c, heads in class_slabs.items():
        info = alloc.classes[c]
        used_total = 0
        partial_expected = set()
        for h in heads:
            s = alloc._slab(h)
            bm = bytes(mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32])
            used = 0
            for i in range(info.bps):
                off = h * g.unit_size + i * info.block
                word, d, length, owner, _ = META_STRUCT.unpack_from(mm, alloc.meta_off(off))
                state = word & 3
                bit = bool(bm[i >> 3] & (1 << (i & 7)))
                report.checked_blocks += 1
                if state == 3:
                    report.problem(f"block at data offset {off}: invalid state")
                if bit != (state != FREE):
                    report.problem(f"slab {h} block {i}: bitmap says {'used' if bit else 'free'}, meta says "
                                   f"{['FREE', 'RESERVED', 'LIVE', '?'][state]}")
                if state != FREE:
                    used += 1
                    if length > info.block:
                        report.problem(f"block at data offset {off}: length {length} exceeds block size {info.block}")
                    if owner and not store.slot_alive(owner):
                        report.problem(f"block at data offset {off}: owned by dead process slot {owner - 1}")
                    if state == LIVE:
                        live_blocks[off] = (word, d, owner)
                    elif state == RESERVED and not owner:
                        report.problem(f"block at data offset {off}: reserved by no process")
            if U32.unpack_from(mm, s + SLAB_NBLOCKS)[0] != info.bps:
                report.problem(f"slab {h}: block count {U32.unpack_from(mm, s + SLAB_NBLOCKS)[0]}, class has {info.bps}")
            if U32.unpack_from(mm, s + SLAB_NFREE)[0] != info.bps - used:
                report.problem(f"slab {h}: free count {U32.unpack_from(mm, s + SLAB_NFREE)[0]}, "
                               f"bitmap/metas say {info.bps - used}")
            if used < info.bps:
                partial_expected.add(h)
            if bool(mm[s + SLAB_INPARTIAL]) != (used < info.bps):
                report.problem(f"slab {h}: partial-list flag disagrees with its free blocks")
            used_total += used
            done += 1
            if progress:
                progress(done, total)
        co = alloc._cls_off(c)
        if U32.unpack_from(mm, co + CLS_NSLABS)[0] != len(heads):
            report.problem(f"class {c}: slab count {U32.unpack_from(mm, co + CLS_NSLABS)[0]}, found {len(heads)}")
        if U32.unpack_from(mm, co + CLS_USED)[0] != used_total:
            report.problem(f"class {c}: used count {U32.unpack_from(mm, co + CLS_USED)[0]}, found {used_total}")
        walked, cur, prev = set(), U32.unpack_from(mm, co + CLS_PARTIAL)[0], 0
        for _ in range(g.n_units + 1):
            if cur == 0:
                break
            if not 0 < cur <= g.n_units or (cur - 1) in walked:
                report.problem(f"class {c}: partial list broken at link {cur}")
                break
            if U32.unpack_from(mm, alloc._slab(cur - 1) + SLAB_PREV)[0] != prev:
                report.problem(f"class {c}: partial list back link of slab {cur - 1} is not {prev}")
            walked.add(cur - 1)
            prev, cur = cur, U32.unpack_from(mm, alloc._slab(cur - 1) + SLAB_NEXT)[0]
        if walked != partial_expected:
            report.problem(f"class {c}: partial list has {len(walked)} slabs, {len(partial_expected)} have free blocks")
        for h in heads:
            s = alloc._slab(h)
            if h not in walked and (U32.unpack_from(mm, s + SLAB_NEXT)[0] or U32.unpack_from(mm, s + SLAB_PREV)[0]):
                report.problem(f"slab {h}: not on the partial list but linked")
    for c in range(g.class_cap):
        info = alloc.classes[c]
        if info is not None and c not in class_slabs:
            co = alloc._cls_off(c)
            if U32.unpack_from(mm, co + CLS_PARTIAL)[0]:
                report.problem(f"class {c}: partial list not empty but the class has no slabs")
            if U32.unpack_from(mm, co + CLS_NSLABS)[0] or U32.unpack_from(mm, co + CLS_USED)[0]:
                report.problem(f"class {c}: slab/used counts {U32.unpack_from(mm, co + CLS_NSLABS)[0]}/"
                               f"{U32.unpack_from(mm, co + CLS_USED)[0]} but the class has no slabs")

    # index
    idx = store.index
    referenced: dict[int, bytes] = {}
    for s in range(g.index_shards):
        entries = idx.entries(s)
        if len(entries) != idx.count(s):
            report.problem(f"index shard {s}: count {idx.count(s)}, {len(entries)} entries")
        if len(entries) > idx.limit:
            report.problem(f"index shard {s}: {len(entries)} entries over the load limit {idx.limit}")
        seen = set()
        occupied = {pos for pos, *_ in entries}
        for pos, d, word, offset in entries:
            report.checked_entries += 1
            where = f"index shard {s} slot {pos}"
            if idx.shard_of(d) != s:
                report.problem(f"{where}: key belongs to shard {idx.shard_of(d)}")
            home = idx.home_of(d)
            p = home
            for _ in range(idx.slots):
                if p == pos:
                    break
                if p not in occupied:
                    report.problem(f"{where}: unreachable (empty slot {p} between home {home} and entry)")
                    break
                p = (p + 1) & idx.mask
            if d in seen:
                report.problem(f"{where}: duplicate key digest")
            seen.add(d)
            if not 0 <= offset < g.data_bytes or alloc.block_index(offset) is None:
                report.problem(f"{where}: offset {offset} is not a block start in the data area")
                continue
            blk = live_blocks.get(offset)
            if blk is None or blk[0] != word or blk[1] != d:
                report.problem(f"{where}: block at {offset} does not hold this committed value")
                continue
            if offset in referenced:
                report.problem(f"{where}: block at {offset} referenced twice")
            referenced[offset] = d
    for off, (word, d, owner) in live_blocks.items():
        if off not in referenced and not (owner and store.slot_alive(owner)):
            report.problem(f"block at data offset {off}: live but not indexed and owned by no live process (orphan)")

    # process table and locks
    for slot in range(g.proc_slots):
        state = PROC_HEAD.unpack_from(mm, g.off_procs + slot * PROC_ENTRY)[0]
        if state not in (0, 1):
            report.problem(f"process slot {slot}: invalid state {state}")
        elif state == 1 and not store.slot_alive(slot + 1):
            report.problem(f"process slot {slot}: process {PROC_HEAD.unpack_from(mm, g.off_procs + slot * PROC_ENTRY)[1]}"
                           " is dead and not yet reaped")
    del words
