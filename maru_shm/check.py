"""Whole-pool consistency check and repair (`Store.check`, `maru-shm check`).

The check holds every class, pool and shard lock (in the documented order) so
it sees a quiescent pool, then verifies each rule of docs/FORMAT.md. Repair
re-runs every domain repair, which rebuilds derived state from the two
sources of truth (slab HEAD entries and block metas) and frees what no live
process or index entry owns.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from .format import (CLASS_LOCK_BASE, CLS_NSLABS, CLS_PARTIAL, CLS_USED, FREE, LIVE, LOCK_CLASSTAB,
                     LOCK_POOL, META_STRUCT, PROC_ENTRY, PROC_HEAD, RESERVED,
                     SHARD_LOCK_BASE, SLAB_BITMAP, SLAB_INPARTIAL, SLAB_NEXT, SLAB_NFREE, UNIT_FREE, UNIT_HEAD,
                     UNIT_TAIL, U32, store_u64)
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
    """Verify the whole pool; with repair=True rebuild it first and report what is still wrong."""
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
    classes = [c.cid for c in alloc.classes if c is not None]
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


def _repair_all(store, classes) -> int:
    alloc, g = store.alloc, store.geo
    fixes = alloc.repair_pool()
    # granules that are not block starts must be FREE
    starts = _block_starts(store)
    words = np.ndarray((g.n_granules,), dtype="<u8", buffer=store.mm, offset=g.off_blockmeta, strides=(32,))
    try:
        bad = np.flatnonzero(((words & np.uint64(3)) != 0) & ~starts)
        for gi in bad.tolist():
            w = int(words[gi])
            store_u64(store.mm, g.off_blockmeta + gi * 32, (((w >> 2) + 1) << 2) | FREE)
            fixes += 1
    finally:
        del words
    for s in range(g.index_shards):
        kept, dropped = store.index.rebuild(s, store._entry_valid, salvage=store._entry_salvage)
        fixes += dropped
    for c in classes:
        fixes += alloc.repair_class(c)
    return fixes


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
        walked, cur = set(), U32.unpack_from(mm, co + CLS_PARTIAL)[0]
        for _ in range(g.n_units + 1):
            if cur == 0:
                break
            if not 0 < cur <= g.n_units or (cur - 1) in walked:
                report.problem(f"class {c}: partial list broken at link {cur}")
                break
            walked.add(cur - 1)
            cur = U32.unpack_from(mm, alloc._slab(cur - 1) + SLAB_NEXT)[0]
        if walked != partial_expected:
            report.problem(f"class {c}: partial list has {len(walked)} slabs, {len(partial_expected)} have free blocks")
    for c in range(g.class_cap):
        info = alloc.classes[c]
        if info is not None and c not in class_slabs and U32.unpack_from(mm, alloc._cls_off(c) + CLS_PARTIAL)[0]:
            report.problem(f"class {c}: partial list not empty but the class has no slabs")

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
