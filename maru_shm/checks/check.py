"""The consistency check of a live pool: read-only, one lock domain at a time (`maru-shm check`).

Writers keep working while it runs: it never holds more than one domain's lock (CLASSTAB, POOL, one
CLASS, one SHARD, PROC), each for one pass over that domain, and it takes them as *read* locks
(F_RDLCK on its own read-only description of the lock file): a writer's F_WRLCK conflicts with it
exactly as with another writer, but the check writes nothing, not even the lock records' dirty marks
(DESIGN.md section 1), so it runs on a read-only mapping (`PoolView`) and needs no process slot.

A fact that spans two domains (an index entry names a LIVE block; a LIVE block is indexed) is
judged under the lock that makes it stable: an entry's block under its SHARD lock (nothing frees or
reuses a published block without that lock), and a LIVE block that no entry seemed to name is
re-read under its digest's SHARD lock before it is reported as an orphan. On a quiet pool the
findings are those of the whole-pool check (`check.check_store`), which repair still uses.
"""

from __future__ import annotations

import os

import numpy as np

from ..allocator import Allocator
from .rules import CheckReport, bad_heads, block_starts, class_entry_problem
from ..errors import StoreError
from ..format.layout import (BITMAP_BYTES, CLASS_LOCK_BASE, CLS_NSLABS, CLS_PARTIAL, CLS_USED, FREE, FREE_FLOOR_OFF,
                             KIND_UNUSED, LIVE, LOCK_CLASSTAB, LOCK_IDS, LOCK_POOL, LOCK_PROC, LOCK_RECORD,
                             META_STRUCT, PROC_ENTRY, PROC_HEAD, RESERVED, SHARD_LOCK_BASE, SLAB_BITMAP, SLAB_HEAD,
                             SLAB_INPARTIAL, SLAB_NBLOCKS, SLAB_NEXT, SLAB_NFREE, SLAB_PREV, U32, UNIT_FREE,
                             UNIT_HEAD, UNIT_TAIL, length_sound)
from ..index import Index
from ..datapath.validity import entry_problem
from ..locking.ofd import carries_locks, ofd_unlock, take_lock
from ..locking.locks import lock_name


class ReadLocks:
    """Shared (F_RDLCK) OFD locks on a private read-only description of the lock file: they exclude
    writers as their own locks do, never write a lock record, and report a record left dirty."""

    def __init__(self, lock_fd: int, mm, off_records: int, timeout: float):
        self.fd = os.open(f"/proc/self/fd/{lock_fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.mm, self.off_records, self.timeout = mm, off_records, timeout
        carries_locks(self)

    def lock_fds(self) -> list[int]:
        return [] if self.fd < 0 else [self.fd]

    def acquire(self, lock_id: int) -> bool:
        """Take the lock shared; True if its last holder left its section dirty (died in it)."""
        take_lock(self.fd, lock_id, self.timeout, f"lock {lock_name(lock_id)} (check)", shared=True)
        if lock_id >= LOCK_IDS:
            return False
        return LOCK_RECORD.unpack_from(self.mm, self.off_records + lock_id * LOCK_RECORD.size)[0] != 0

    def release(self, lock_id: int) -> None:
        ofd_unlock(self.fd, lock_id)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        os.close(fd)


class NoLocks:
    """For a caller that holds every lock already (repair), or a view that cannot see the pool's locks (its
    user may only read the pool): then the check takes no lock, and says so (`CheckReport.unlocked`)."""

    def acquire(self, lock_id: int) -> bool:
        return False

    def release(self, lock_id: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Pool:
    """What the check reads: geometry, mapping, allocator and index views, liveness of slots.

    Also the AllocatorHost of its read-only Allocator: the check only reads through it (no lock, no
    count, no index change), so the writing half of the interface refuses.
    """

    locks = None
    owner = 0  # the check owns no block

    def __init__(self, view):
        self.mm, self.geo = view.mm, view.geo
        self.view = view
        self.alloc = Allocator(self)
        self.index = Index(view.mm, view.geo)

    def slot_alive(self, owner_plus1: int) -> bool:
        """Unknown liveness (a view that cannot see locks) counts as alive: nothing is called reapable."""
        return 0 < owner_plus1 <= self.geo.proc_slots and self.view.slot_alive(owner_plus1 - 1) is not False

    def count(self, **counters: int) -> None:
        pass  # a read-only check has no process slot to count in

    def indexed_many(self, blocks):
        raise StoreError("internal error: the read-only check asked to settle blocks")

    def unpublish_many(self, halves, offsets, words):
        raise StoreError("internal error: the read-only check asked to unpublish blocks")

    def release_views(self) -> None:
        self.alloc.release_views()
        self.index.release_views()


class _Domain:
    """`with _Domain(locks, id, report):` holds one lock shared and reports it if it was left dirty."""

    def __init__(self, locks: ReadLocks, lock_id: int, report: CheckReport):
        self.locks, self.lock_id, self.report = locks, lock_id, report

    def __enter__(self):
        if self.locks.acquire(self.lock_id):
            self.report.problem(f"lock {lock_name(self.lock_id)}: left dirty by a process that died holding it")

    def __exit__(self, *exc):
        self.locks.release(self.lock_id)


def check_live(view, *, timeout: float = 10.0, progress=None) -> CheckReport:
    """Check the pool mapped by `view` (a PoolView) while others use it; never writes to it."""
    pool = _Pool(view)
    locks = NoLocks() if view.lock_fd is None else ReadLocks(view.lock_fd, view.mm, view.geo.off_locks, timeout)
    try:
        report = check_domains(pool, locks, progress)
        report.unlocked = view.lock_fd is None
    finally:
        locks.close()
        pool.release_views()
    view.check_intact()  # a check of zeros read for a lost page is no check
    return report


def check_domains(pool, locks, progress=None) -> CheckReport:
    """Every rule of FORMAT.md, domain by domain, each under its lock from `locks` (NoLocks when the caller
    holds them all, as repair does). `pool` offers mm, geo, alloc, index and slot_alive(owner + 1)."""
    report = CheckReport()
    with _Domain(locks, LOCK_CLASSTAB, report):
        classes = _check_class_table(pool, report)
    with _Domain(locks, LOCK_POOL, report):
        _check_units(pool, report)
    candidates = []
    for n, c in enumerate(classes):
        with _Domain(locks, CLASS_LOCK_BASE + c, report):
            candidates += _check_class(pool, c, report)
        if progress:
            progress(n + 1, len(classes))
    named: set = set()
    for s in range(pool.geo.index_shards):
        with _Domain(locks, SHARD_LOCK_BASE + s, report):
            _check_shard(pool, s, report, named)
    _report_orphans(pool, locks, report, candidates, named)
    with _Domain(locks, LOCK_PROC, report):
        _check_processes(pool, report)
    return report


def _check_class_table(pool, report) -> list[int]:
    """CLASSTAB held: every entry as creation or declare wrote it; returns the classes with an entry."""
    g, alloc = pool.geo, pool.alloc
    alloc.invalidate_classes()
    alloc.refresh_classes()
    for cid in range(g.class_cap):
        why = class_entry_problem(pool, cid)
        if why:
            report.problem(why)
    return [c for c in range(g.class_cap)
            if c < g.n_geo_classes or U32.unpack_from(pool.mm, alloc.geo.class_entry(c))[0] != KIND_UNUSED]


def _check_units(pool, report) -> None:
    """POOL held (slabs are formatted, moved and freed under it): the unit table, the free floor, and
    block metas in use where no block starts."""
    g, alloc, mm = pool.geo, pool.alloc, pool.mm
    covered = np.full(g.n_units, -1, dtype=np.int64)
    for h in np.flatnonzero(alloc.states == UNIT_HEAD).tolist():
        c = int(alloc.clsfield[h])
        info = alloc.classes[c] if c < len(alloc.classes) else None
        if info is None:
            report.problem(f"slab at unit {h}: unknown size class {c}")
            continue
        if not g.slab_fits(h, info.k):
            report.problem(f"slab at unit {h}: {info.k} units run past the data area")
            continue
        if (covered[h:h + info.k] >= 0).any():
            report.problem(f"slab at unit {h}: overlaps another slab")
            continue
        covered[h:h + info.k] = h
        for t in range(h + 1, h + info.k):
            st, head = SLAB_HEAD.unpack_from(mm, alloc.geo.slab_entry(t))[:2]  # state, and the head of a TAIL
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
    starts = block_starts(pool)
    words = alloc.meta_words.copy()
    for gi in np.flatnonzero(((words & np.uint64(3)) != 0) & ~starts).tolist()[:50]:
        report.problem(f"block meta of granule {gi}: in use but no block starts there")


def _slabs_of(pool, c: int) -> list[int]:
    """Heads of class c's slabs that are usable (not among rules.bad_heads, which _check_units reports)."""
    alloc = pool.alloc
    bad = {h for h, _ in bad_heads(pool)}
    return [h for h in np.flatnonzero((alloc.states == UNIT_HEAD) & (alloc.clsfield == c)).tolist() if h not in bad]


def _check_class(pool, c: int, report) -> list[tuple]:
    """CLASS c held (its slabs, blocks, counts and partial list change only under it): check them; return
    the LIVE blocks owned by no live process, (offset, word, digest), for the orphan pass."""
    alloc, mm = pool.alloc, pool.mm
    info = alloc.classes[c] if c < len(alloc.classes) else None
    co = alloc.geo.class_entry(c)
    if info is None:
        return []
    heads = _slabs_of(pool, c)
    if not heads:
        if U32.unpack_from(mm, co + CLS_PARTIAL)[0]:
            report.problem(f"class {c}: partial list not empty but the class has no slabs")
        if U32.unpack_from(mm, co + CLS_NSLABS)[0] or U32.unpack_from(mm, co + CLS_USED)[0]:
            report.problem(f"class {c}: slab/used counts {U32.unpack_from(mm, co + CLS_NSLABS)[0]}/"
                           f"{U32.unpack_from(mm, co + CLS_USED)[0]} but the class has no slabs")
        return []
    unowned, used_total, partial_expected = [], 0, set()
    for h in heads:
        used = _check_slab(pool, h, info, report, unowned)
        if used < info.bps:
            partial_expected.add(h)
        used_total += used
    if U32.unpack_from(mm, co + CLS_NSLABS)[0] != len(heads):
        report.problem(f"class {c}: slab count {U32.unpack_from(mm, co + CLS_NSLABS)[0]}, found {len(heads)}")
    if U32.unpack_from(mm, co + CLS_USED)[0] != used_total:
        report.problem(f"class {c}: used count {U32.unpack_from(mm, co + CLS_USED)[0]}, found {used_total}")
    _check_partial_list(pool, c, heads, partial_expected, report)
    return unowned


def _check_slab(pool, h: int, info, report, unowned: list) -> int:
    """One slab of a held class: bitmap against metas, free count, partial flag; returns blocks in use."""
    g, alloc, mm = pool.geo, pool.alloc, pool.mm
    s = alloc.geo.slab_entry(h)
    bm = bytes(mm[s + SLAB_BITMAP:s + SLAB_BITMAP + BITMAP_BYTES])
    used = 0
    for i in range(info.bps):
        off = g.block_offset(h, i, info.block)
        word, d, length, owner, _, flags = META_STRUCT.unpack_from(mm, alloc.meta_off(off))
        state = word & 3
        bit = bool(bm[i >> 3] & (1 << (i & 7)))
        report.checked_blocks += 1
        if state == 3:
            report.problem(f"block at data offset {off}: invalid state")
        if bit != (state != FREE):
            report.problem(f"slab {h} block {i}: bitmap says {'used' if bit else 'free'}, meta says "
                           f"{['FREE', 'RESERVED', 'LIVE', '?'][state]}")
        if state == FREE:
            continue
        used += 1
        if not length_sound(length, flags):
            report.problem(f"block at data offset {off}: length {length} disagrees with its check")
        elif length > info.block:
            report.problem(f"block at data offset {off}: length {length} exceeds block size {info.block}")
        if owner and not pool.slot_alive(owner):  # the reaper frees it if unpublished, else disowns it
            report.reapable(f"block at data offset {off}: owned by exited process slot {owner - 1}")
        elif state == LIVE and not owner:
            unowned.append((off, word, d))
        elif state == RESERVED and not owner:
            report.problem(f"block at data offset {off}: reserved by no process")
    if U32.unpack_from(mm, s + SLAB_NBLOCKS)[0] != info.bps:
        report.problem(f"slab {h}: block count {U32.unpack_from(mm, s + SLAB_NBLOCKS)[0]}, class has {info.bps}")
    if U32.unpack_from(mm, s + SLAB_NFREE)[0] != info.bps - used:
        report.problem(f"slab {h}: free count {U32.unpack_from(mm, s + SLAB_NFREE)[0]}, "
                       f"bitmap/metas say {info.bps - used}")
    if bool(mm[s + SLAB_INPARTIAL]) != (used < info.bps):
        report.problem(f"slab {h}: partial-list flag disagrees with its free blocks")
    return used


def _check_partial_list(pool, c: int, heads: list[int], expected: set, report) -> None:
    g, alloc, mm = pool.geo, pool.alloc, pool.mm
    co = alloc.geo.class_entry(c)
    walked, cur, prev = set(), U32.unpack_from(mm, co + CLS_PARTIAL)[0], 0
    for _ in range(g.n_units + 1):
        if cur == 0:
            break
        if not 0 < cur <= g.n_units or (cur - 1) in walked:
            report.problem(f"class {c}: partial list broken at link {cur}")
            break
        if U32.unpack_from(mm, alloc.geo.slab_entry(cur - 1) + SLAB_PREV)[0] != prev:
            report.problem(f"class {c}: partial list back link of slab {cur - 1} is not {prev}")
        walked.add(cur - 1)
        prev, cur = cur, U32.unpack_from(mm, alloc.geo.slab_entry(cur - 1) + SLAB_NEXT)[0]
    if walked != expected:
        report.problem(f"class {c}: partial list has {len(walked)} slabs, {len(expected)} have free blocks")
    for h in heads:
        s = alloc.geo.slab_entry(h)
        if h not in walked and (U32.unpack_from(mm, s + SLAB_NEXT)[0] or U32.unpack_from(mm, s + SLAB_PREV)[0]):
            report.problem(f"slab {h}: not on the partial list but linked")


def _check_shard(pool, s: int, report, named: set) -> None:
    """SHARD s held: its entries are reachable, unique and name LIVE blocks holding their committed value
    (a published block is neither freed nor reused without this lock, so its meta is stable here)."""
    g, alloc, idx, mm = pool.geo, pool.alloc, pool.index, pool.mm
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
        problem = entry_problem(mm, g, alloc, d, word, offset)
        if problem:
            report.problem(f"{where}: {problem}")
            continue
        if (offset, word) in named:
            report.problem(f"{where}: block at {offset} referenced twice")
        named.add((offset, word))


def _report_orphans(pool, locks, report, candidates, named) -> None:
    """A LIVE block owned by no live process that no entry named: re-read under its digest's SHARD lock
    (it may have been published, claimed or freed since its class was checked) before calling it an orphan."""
    alloc, idx, mm = pool.alloc, pool.index, pool.mm
    for off, word, d in candidates:
        if (off, word) in named:
            continue
        s = idx.shard_of(d)
        with _Domain(locks, SHARD_LOCK_BASE + s, CheckReport()):
            mword, md, _, owner, _, _ = META_STRUCT.unpack_from(mm, alloc.meta_off(off))
            if mword != word or md != d or owner or idx.find(d) == (word, off):
                continue
        report.problem(f"block at data offset {off}: live but not indexed and owned by no live process (orphan)")


def _check_processes(pool, report) -> None:
    g, mm = pool.geo, pool.mm
    for slot in range(g.proc_slots):
        state, pid = PROC_HEAD.unpack_from(mm, g.off_procs + slot * PROC_ENTRY)[:2]
        if state not in (0, 1):
            report.problem(f"process slot {slot}: invalid state {state}")
        elif state == 1 and not pool.slot_alive(slot + 1):
            report.reapable(f"process slot {slot}: process {pid} exited without detaching")
