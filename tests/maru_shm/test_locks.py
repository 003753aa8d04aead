"""Locks: timeouts against stopped or busy holders, and repair of what a killed holder left."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest

from maru_shm import LockTimeout, PoolInUseError, Store, StoreError
from maru_shm.locking import locks as locks_mod, ofd as ofd_mod
from maru_shm.format.layout import (CLASS_LOCK_BASE, LOCK_CLASSTAB, LOCK_INIT, LOCK_POOL,
                                    LOCK_PROC, LOCK_RECORD, SHARD_LOCK_BASE, SLAB_NFREE, SLAB_BITMAP, UNIT_FREE,
                                    UNIT_TAIL, U32, U64, CLS_PARTIAL, ENTRY_SIZE)
from maru_shm.index import key_digest
from maru_shm.locking.lockfile import lock_file_path

from ..conftest import a_lock_held_by_anyone, assert_clean, interrupt_at_line, reserve, value_version

TIMEOUT = 0.3
BOUND = TIMEOUT + 10.0  # generous: the machine is noisy; a LockTimeout must still come, not a hang


def descriptions_of(path) -> int:
    """How many of this process's descriptors are open on the pool file or its lock file. Counting only
    these keeps the test blind to descriptors of earlier tests' garbage, which any collection may close."""
    targets, n = {os.path.realpath(path), os.path.realpath(lock_file_path(path, False))}, 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in targets
        except OSError:  # the listing's own descriptor, gone once listed
            pass
    return n


def _hold_lock(path, lock_id, ready_fd, stop: bool):
    """Child: attach, take one lock, tell the parent, then SIGSTOP itself or just sit on the lock."""
    s = Store.open(path)
    s.locks.acquire(lock_id)
    os.write(ready_fd, b"1")
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(1)


def _hold_section(path, lock_id, ready_fd, damage):
    """Child: enter a lock's critical section (dirty set), damage its domain, tell the parent, wait to die."""
    s = Store.open(path)
    with s.locks.hold(lock_id):
        if damage is not None:
            damage(s)
        os.write(ready_fd, b"1")
        while True:
            time.sleep(1)


def _start(children, fn, path, lock_id, extra):
    """Fork fn(path, lock_id, ready_fd, extra) and wait until it is inside its lock."""
    r, w = os.pipe()
    pid = children.fork(fn, path, lock_id, w, extra)
    os.close(w)
    assert os.read(r, 1) == b"1", f"child failed before taking the lock:\n{children.error(pid)}"
    os.close(r)
    return pid


def _keys_in_other_shards(store, key, n=3):
    s = store.index.shard_of(key_digest(key))
    out = []
    i = 0
    while len(out) < n:
        k = f"other-{i}"
        if store.index.shard_of(key_digest(k)) != s:
            out.append(k)
        i += 1
    return out


def _timed(fn, *args):
    t0 = time.monotonic()
    with pytest.raises(LockTimeout) as exc:
        fn(*args)
    return time.monotonic() - t0, exc.value


# ---------------------------------------------------------------- timeouts

@pytest.mark.parametrize("stop", [True, False], ids=["sigstopped", "busy"])
def test_shard_lock_timeout_other_shards_usable(open_store, pool_path, children, make_value, check_value, stop):
    s = open_store("8M", timeout=TIMEOUT)
    assert s.put("victim", make_value("victim", 1))
    shard = s.index.shard_of(key_digest("victim"))
    pid = _start(children, _hold_lock, pool_path, SHARD_LOCK_BASE + shard, stop)

    elapsed, err = _timed(s.put, "victim", make_value("victim", 2))
    assert elapsed < BOUND
    assert "SHARD" in str(err)
    elapsed, _ = _timed(s.delete, "victim")
    assert elapsed < BOUND
    # reads take no lock: the committed value is still served
    assert s.get("victim") == make_value("victim", 1)
    for k in _keys_in_other_shards(s, "victim"):
        assert s.put(k, make_value(k, 1))
        assert check_value(k, s.get(k))
        assert s.delete(k)
    assert s.stats()["lock_timeouts"] >= 2

    children.kill(pid)
    assert s.put("victim", make_value("victim", 3))  # the kernel released the lock; dirty gets repaired
    assert s.get("victim") == make_value("victim", 3)
    assert_clean(s)


def test_class_lock_timeout_other_classes_usable(open_store, pool_path, children, make_value):
    s = open_store("8M", timeout=TIMEOUT)
    small, big = 5000, 100_000
    cid = s.alloc.class_for(small).cid
    assert s.alloc.class_for(big).cid != cid
    pid = _start(children, _hold_lock, pool_path, CLASS_LOCK_BASE + cid, True)
    elapsed, err = _timed(s.put, "small", make_value("small", 1, small))
    assert elapsed < BOUND and "CLASS" in str(err)
    assert s.put("big", make_value("big", 1, big))
    assert s.get("big") == make_value("big", 1, big)
    children.kill(pid)
    assert s.put("small", make_value("small", 1, small))
    assert_clean(s)


def test_init_lock_timeout_on_open(open_store, pool_path, children):
    open_store("8M").close()
    pid = _start(children, _hold_lock, pool_path, LOCK_INIT, True)
    t0 = time.monotonic()
    with pytest.raises(LockTimeout):
        Store.open(pool_path, timeout=TIMEOUT)
    assert time.monotonic() - t0 < BOUND
    children.kill(pid)
    with Store.open(pool_path, timeout=TIMEOUT) as s:
        assert_clean(s)


def _wait_for_a_held_lock(wait, path, store):
    """One of the store's timed lock waits, each against a lock another process holds."""
    from maru_shm import check_pool, destroy_pool
    if wait == "open":  # poolfile: INIT, while a creator formats
        Store.open(path, timeout=TIMEOUT)
    elif wait == "section":  # locks.LockTable: a section lock of a put
        store.put("victim", b"x" * 100)
    elif wait == "check":  # checks/check.py: a shared lock of the live check
        check_pool(path, timeout=TIMEOUT)
    else:  # admin: PROC, while destroy decides
        destroy_pool(path, timeout=TIMEOUT)


@pytest.mark.parametrize("wait, lock", [("open", "INIT"), ("section", "SHARD"), ("check", "CLASSTAB"),
                                        ("destroy", "PROC")])
def test_every_lock_wait_times_out_with_lock_timeout(open_store, pool_path, children, wait, lock):
    """One wait (lockwait): every timed wait for a lock ends in LockTimeout naming the lock, never another
    error and never a hang."""
    s = open_store("8M", timeout=TIMEOUT)
    lock_id = {"INIT": LOCK_INIT, "PROC": LOCK_PROC, "CLASSTAB": LOCK_CLASSTAB,
               "SHARD": SHARD_LOCK_BASE + s.index.shard_of(key_digest("victim"))}[lock]
    pid = _start(children, _hold_lock, pool_path, lock_id, True)
    t0 = time.monotonic()
    with pytest.raises(LockTimeout, match=lock):
        _wait_for_a_held_lock(wait, pool_path, s)
    assert time.monotonic() - t0 < BOUND
    children.kill(pid)
    if wait == "destroy":  # the lock is free: destroy decides, and finds this test's store attached
        with pytest.raises(PoolInUseError):
            _wait_for_a_held_lock(wait, pool_path, s)
    else:
        _wait_for_a_held_lock(wait, pool_path, s)


def test_threads_of_one_process_exclude_each_other(open_store):
    """OFD locks do not exclude threads sharing a descriptor; each thread's own lock-file description must."""
    s = open_store("4M")
    held, release = threading.Event(), threading.Event()

    def holder():
        with s.locks.hold(LOCK_POOL):
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        t0 = time.monotonic()
        with pytest.raises(LockTimeout):
            s.locks.acquire(LOCK_POOL, timeout=TIMEOUT)
        assert time.monotonic() - t0 < BOUND
        assert s.locks.acquire(LOCK_POOL, blocking=False) is None
    finally:
        release.set()
        t.join()
    assert s.locks.acquire(LOCK_POOL, timeout=TIMEOUT) is False  # clean: released normally
    s.locks.release(LOCK_POOL)


def test_put_that_times_out_leaves_no_block_behind(open_store, pool_path, children, make_value):
    """FORMAT.md invariant 3: a put that fails on a lock must not leave its block allocated (nor owned) forever."""
    keeper = open_store("8M", timeout=TIMEOUT)  # slot 0, stays attached
    writer = open_store(path=pool_path, create=False, timeout=TIMEOUT)
    shard = writer.index.shard_of(key_digest("k"))
    pid = _start(children, _hold_lock, pool_path, SHARD_LOCK_BASE + shard, True)
    with pytest.raises(LockTimeout):
        writer.put("k", make_value("k", 1, 20_000))
    assert keeper.stats()["live_blocks"] == 0  # the writer settled its block when the put failed
    children.kill(pid)
    assert writer.put("k", make_value("k", 2, 20_000))
    writer.close()
    assert keeper.get("k") == make_value("k", 2, 20_000)
    assert keeper.delete("k")
    assert_clean(keeper)
    assert keeper.stats()["live_blocks"] == 0


def test_close_settles_blocks_it_still_owns(open_store, pool_path, make_value):
    """What a failed put may leave owned at close is settled then, as reaping settles a dead slot."""
    keeper = open_store("8M")
    writer = open_store(path=pool_path, create=False)
    info = writer.alloc.class_for(20_000)
    offs = reserve(writer, info, ["x", "y"], 20_000)
    assert len(offs) == 2
    writer.close()
    assert_clean(keeper)
    assert keeper.stats()["live_blocks"] == 0
    # the slot is reused by the next process: nothing may look owned by it
    again = open_store(path=pool_path, create=False)
    assert again.slot == 1
    assert again._reaper.owned_blocks(again.slot) == []


# ---------------------------------------------------------------- dirty records and repair

def test_repair_runs_in_next_holder_after_sigkill(open_store, pool_path, children):
    s = open_store("4M")
    lock_id = SHARD_LOCK_BASE + 3
    pid = _start(children, _hold_section, pool_path, lock_id, None)
    rec = s.geo.off_locks + lock_id * LOCK_RECORD.size
    assert LOCK_RECORD.unpack_from(s.mm, rec)[0] != 0  # dirty while inside
    assert children.kill(pid) == -signal.SIGKILL
    calls = []
    with s.locks.hold(lock_id, repair=lambda: calls.append(1)) as dirty:
        assert dirty is True
    assert calls == [1]
    with s.locks.hold(lock_id, repair=lambda: calls.append(2)) as dirty:
        assert dirty is False
    assert calls == [1]
    assert LOCK_RECORD.unpack_from(s.mm, rec)[0] == 0


def test_exception_inside_section_leaves_it_dirty(open_store):
    s = open_store("4M")
    with pytest.raises(ZeroDivisionError):
        with s.locks.hold(LOCK_POOL):
            1 / 0
    calls = []
    with s.locks.hold(LOCK_POOL, repair=lambda: calls.append(1)):
        pass
    assert calls == [1]


def _fill(s, make_value, prefix, n, size):
    keys = [f"{prefix}{i}" for i in range(n)]
    assert all(s.batch_put(keys, [make_value(k, 1, size) for k in keys]))
    return keys


def _damage_class(cid):
    def damage(s):
        # wreck every derived field of the class: bitmaps say free, counts and partial list are garbage
        for h in s.alloc.slabs.class_slabs(cid):
            so = s.geo.slab_entry(h)
            s.mm[so + SLAB_BITMAP:so + SLAB_BITMAP + 32] = bytes(32)
            U32.pack_into(s.mm, so + SLAB_NFREE, 9999)
        U32.pack_into(s.mm, s.geo.class_entry(cid) + CLS_PARTIAL, 0)
    return damage


def test_killed_class_holder_is_repaired_before_reuse(open_store, pool_path, children, make_value, check_value):
    s = open_store("16M")
    size = 9000
    keys = _fill(s, make_value, "a", 40, size)
    cid = s.alloc.class_for(size).cid
    pid = _start(children, _hold_section, pool_path, CLASS_LOCK_BASE + cid, _damage_class(cid))
    children.kill(pid)
    # Without repair the zeroed bitmaps would hand out blocks that hold live values.
    new = _fill(s, make_value, "b", 40, size)
    for k in keys + new:
        assert check_value(k, s.get(k)), k
    assert_clean(s)


def _damage_shard(key):
    def damage(s):
        # a backward shift cut short: the entry of `key` copied into the next empty slot of its cluster
        idx = s.index
        d = key_digest(key)
        shard = idx.shard_of(d)
        found, pos = idx._find_pos(shard, d)
        assert found is not None
        for step in range(1, idx.slots):
            p = (pos + step) & idx.mask
            dst = idx.entry_off(shard, p)
            if U64.unpack_from(s.mm, dst + 16)[0] == 0:
                src = idx.entry_off(shard, pos)
                s.mm[dst:dst + ENTRY_SIZE] = s.mm[src:src + ENTRY_SIZE]
                return
        raise AssertionError("shard has no empty slot")
    return damage


def test_killed_shard_holder_is_repaired_before_reuse(open_store, pool_path, children, make_value, check_value):
    s = open_store("16M")
    keys = _fill(s, make_value, "k", 50, 5000)
    shard = s.index.shard_of(key_digest(keys[0]))
    pid = _start(children, _hold_section, pool_path, SHARD_LOCK_BASE + shard, _damage_shard(keys[0]))
    children.kill(pid)
    problems = s.check().problems  # a duplicate entry, as a crash mid-shift leaves it
    assert any("duplicate" in p for p in problems), problems
    assert s.delete(keys[0])  # next holder repairs, then deletes: the key must be gone for good
    assert s.get(keys[0]) is None and not s.exists(keys[0])
    for k in keys[1:]:
        assert check_value(k, s.get(k)), k
    assert_clean(s)


def _damage_pool(s):
    # slab formatting cut short: every TAIL entry lost
    for u in range(s.geo.n_units):
        o = s.geo.slab_entry(u)
        if U32.unpack_from(s.mm, o)[0] == UNIT_TAIL:
            U32.pack_into(s.mm, o, UNIT_FREE)


def test_killed_pool_holder_is_repaired_before_reuse(open_store, pool_path, children, make_value, check_value):
    s = open_store("32M")
    classes = [c for c in s.alloc.classes if c is not None]
    # a class whose slabs span several units, so there are TAIL entries to lose, and a one-unit class
    multi = next(c for c in classes if c.k > 1)
    single = next(c for c in classes if c.k == 1 and c.block != multi.block)
    keys = _fill(s, make_value, "t", 3 * multi.bps, multi.block)
    pid = _start(children, _hold_section, pool_path, LOCK_POOL, _damage_pool)
    children.kill(pid)
    problems = s.check().problems
    assert any("tail" in p for p in problems), problems
    # needs new slabs: takes POOL and repairs first; else it would format slabs over the lost tails
    other = _fill(s, make_value, "u", 4 * single.bps, single.block)
    for k in keys + other:
        assert check_value(k, s.get(k)), k
    assert_clean(s)


def _attach_and_die(path, lock_id, ready_fd, extra):
    s = Store.open(path)
    assert s.put("dying", b"d" * 5000)
    info = s.alloc.class_for(9000)
    reserve(s, info, ["never-published"], 9000)  # reserved, never committed
    os.write(ready_fd, b"1")
    while True:
        time.sleep(1)


def test_check_repair_reaps_a_killed_process(open_store, pool_path, children):
    s = open_store("8M")
    pid = _start(children, _attach_and_die, pool_path, 0, None)
    children.kill(pid)
    assert s.stats()["processes"] == 2  # reaping is lazy: nobody attached or ran short of space yet
    found = s.check()
    assert found.ok, found.problems  # what an exited process left is the next opener's, not damage
    assert any("exited without detaching" in p for p in found.to_reap), found.to_reap
    assert any("owned by exited process" in p for p in found.to_reap), found.to_reap
    report = s.check(repair=True)
    assert report.ok, report.problems
    assert s.check().ok and not s.check().to_reap
    st = s.stats()
    assert st["processes"] == 1
    assert st["live_blocks"] == 1 and s.get("dying") == b"d" * 5000  # its published value stays


def _attach_only(path, lock_id, ready_fd, extra):
    Store.open(path)
    os.write(ready_fd, b"1")
    while True:
        time.sleep(1)


def test_full_process_table_of_dead_processes_is_reaped_on_attach(open_store, pool_path, children):
    open_store("4M", proc_slots=2).close()
    pids = [_start(children, _attach_only, pool_path, 0, None) for _ in range(2)]
    fds = descriptions_of(pool_path)
    with pytest.raises(StoreError, match="process table"):
        Store.open(pool_path)  # both slots taken by live processes: a clear error, nothing leaked
    assert descriptions_of(pool_path) == fds
    for pid in pids:
        children.kill(pid)
    s = open_store(path=pool_path, create=False)  # both holders died: their slots must be reclaimed
    assert s.stats()["processes"] == 1
    assert_clean(s)


# ---------------------------------------------------------------- several shard locks taken together
def _shard_ids(*shards):
    return [SHARD_LOCK_BASE + s for s in shards]


def test_hold_many_takes_runs_and_excludes_other_processes(open_store, pool_path, children):
    """A batch holds shards 1-3 and 7: another process times out on each of them, gets shard 5 at once."""
    s = open_store()
    held = _shard_ids(3, 1, 2, 7)
    with s.locks.hold_many(held) as dirty:
        assert dirty == []
        other = Store.open(pool_path, timeout=TIMEOUT)
        try:
            for lock_id in held:
                with pytest.raises(LockTimeout):
                    other.locks.acquire(lock_id)
            assert other.locks.acquire(SHARD_LOCK_BASE + 5) is False
            other.locks.release(SHARD_LOCK_BASE + 5)
            # a range overlapping the held ones is refused as a whole, and leaves nothing held
            with pytest.raises(LockTimeout):
                other.locks.acquire_many(_shard_ids(4, 5, 6, 7))
            assert other.locks.acquire(SHARD_LOCK_BASE + 4) is False
            other.locks.release(SHARD_LOCK_BASE + 4)
        finally:
            other.close()
        recs = [LOCK_RECORD.unpack_from(s.mm, s.geo.off_locks + i * LOCK_RECORD.size)[0] for i in held]
        assert recs == [s.slot + 1] * 4  # every held lock marked: a crash here leaves all of them dirty
    recs = [LOCK_RECORD.unpack_from(s.mm, s.geo.off_locks + i * LOCK_RECORD.size)[0] for i in held]
    assert recs == [0] * 4


def test_hold_many_repairs_each_dirty_lock_and_leaves_all_dirty_on_error(open_store):
    s = open_store()
    ids = _shard_ids(0, 1, 2)
    with pytest.raises(RuntimeError):
        with s.locks.hold_many(ids):
            raise RuntimeError("boom")  # as a crash would: every dirty mark stays
    repaired = []
    with s.locks.hold_many(_shard_ids(2, 1, 0, 9), repair_for=repaired.append) as dirty:
        assert dirty == ids
    assert repaired == ids
    with s.locks.hold_many(ids, repair_for=repaired.append) as dirty:
        assert dirty == []


def test_hold_many_waits_for_threads_of_its_own_process(open_store):
    """OFD locks do not exclude threads: each thread's own description must, for ranges too."""
    s = open_store()
    inside = threading.Event()
    release = threading.Event()
    order = []

    def single():
        with s.locks.hold(SHARD_LOCK_BASE + 6):
            inside.set()
            release.wait(5)
            order.append("single")

    t = threading.Thread(target=single)
    t.start()
    assert inside.wait(5)
    threading.Timer(0.2, release.set).start()
    with s.locks.hold_many(_shard_ids(5, 6, 7)):
        order.append("many")
    t.join()
    assert order == ["single", "many"]


def test_killed_batch_publisher_leaves_every_shard_repaired(open_store, pool_path, children, make_value,
                                                            check_value):
    """A process killed inside a hold_many section leaves several shards dirty; the next holders repair
    each of them and every value put before survives."""
    s = open_store("32M")
    keys = [f"pre-{i}" for i in range(200)]
    assert all(s.batch_put(keys, [make_value(k, 1, 3000) for k in keys]))
    shards = sorted({s.index.shard_of(key_digest(k)) for k in keys})[:5]

    def damage(st):
        # a shard count bumped before its entries were written (the next put would evict to make room),
        # and half-written entries of an interrupted vectorised insert: digest and offset, word still 0
        for sh in shards:
            U32.pack_into(st.mm, st.index.off_hdr + sh * 16, st.index.slots)
            e = st.index.entry_off(sh, 0)
            if U64.unpack_from(st.mm, e + 16)[0] == 0:
                st.mm[e:e + 16] = os.urandom(16)
                U64.pack_into(st.mm, e + 24, 12345)

    def hold_all(path, lock_id, ready_fd, extra):
        st = Store.open(path)
        with st.locks.hold_many(_shard_ids(*shards)):
            damage(st)
            os.write(ready_fd, b"1")
            while True:
                time.sleep(1)

    pid = _start(children, hold_all, pool_path, None, None)
    os.kill(pid, signal.SIGKILL)
    children.wait(pid)
    for k in keys:
        assert value_version(k, s.get(k)) == 1, k
    more = [f"post-{i}" for i in range(200)]
    assert all(s.batch_put(more, [make_value(k, 2, 3000) for k in more]))
    for k in keys:
        assert value_version(k, s.get(k)) == 1, k
    for k in more:
        assert value_version(k, s.get(k)) == 2, k
    assert_clean(s)


def test_a_thread_never_takes_a_lock_it_holds(open_store):
    """One description would simply hold the lock twice and the inner release would drop it: refused."""
    s = open_store("4M")
    with s.locks.hold(LOCK_POOL):
        with pytest.raises(RuntimeError, match="already held"):
            s.locks.acquire(LOCK_POOL)
        with pytest.raises(RuntimeError, match="already held"):
            s.locks.acquire_many(_shard_ids(1, 2) + [LOCK_POOL])
    ids = _shard_ids(3, 4, 9)
    with s.locks.hold_many(ids):
        with pytest.raises(RuntimeError, match="already held"):
            s.locks.acquire(ids[1])
    assert s.locks.acquire(LOCK_POOL, timeout=TIMEOUT) is False  # all released cleanly
    s.locks.release(LOCK_POOL)


def test_close_closes_every_live_thread_description(open_store, pool_path, make_value):
    """Each thread that took a lock opened its own description of the lock file; close() closes those of
    threads still running."""
    before = descriptions_of(pool_path)
    s = Store.open(pool_path, "8M", create=True)
    done, leave = threading.Barrier(5), threading.Event()

    def worker(i):
        s.put(f"k{i}", make_value(f"k{i}", 1, 5000))
        done.wait(30)
        leave.wait(30)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in workers:
        t.start()
    try:
        done.wait(30)
        assert descriptions_of(pool_path) >= before + 5  # pool file and one description per thread
        s.close()
        assert descriptions_of(pool_path) == before
    finally:
        leave.set()
        for t in workers:
            t.join()
    gc.collect()  # the finished threads' state goes: nothing is closed twice
    assert descriptions_of(pool_path) == before


def test_a_finished_thread_closes_its_description(open_store, pool_path, make_value):
    """Threads come and go (a server's worker pool): each one's description is closed when it ends, so
    the process does not collect descriptors, and the pool stays usable from the threads still alive."""
    s = open_store("8M")
    s.put("warm", make_value("warm", 1, 5000))
    before = descriptions_of(pool_path)
    for round_ in range(20):
        workers = [threading.Thread(target=lambda i=i: s.put(f"k{round_}-{i}", make_value(f"k{i}", 1, 5000)))
                   for i in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    gc.collect()
    assert descriptions_of(pool_path) == before
    assert len(s.locks._fds) == 1  # the main thread's
    assert s.get("k19-3") is not None
    assert s.check().ok


def test_open_close_cycles_leak_no_lock_table(pool_path):
    """A thread that outlives many Stores (SGLang's main thread) must not keep each one's LockTable alive."""
    import gc

    from maru_shm import Store
    from maru_shm.locking.locks import LockTable
    Store.open(pool_path, "4M", create=True).close()

    def tables() -> int:
        gc.collect()
        return sum(isinstance(o, LockTable) for o in gc.get_objects())

    before = tables()
    for i in range(300):
        with Store.open(pool_path) as s:
            s.put(f"k{i % 7}", b"v" * 100)  # takes section locks on this thread's own description
    assert tables() - before <= 1


# ---------------------------------------------------------------- exceptions at any bytecode (FORMAT.md invariant 3)

# The lock layer: the lock table and the OFD calls under it.
LOCK_LAYER = (locks_mod.__file__, ofd_mod.__file__)


def test_an_interrupt_at_any_line_of_the_lock_layer_leaves_no_lock_held(open_store, pool_path, make_value):
    """Ctrl-C (or a signal handler's exception) landing anywhere in the lock layer during puts and deletes:
    no lock stays held (another description can take every one), the same thread can put again (no
    'already held by this thread'), and the pool checks clean once the stores are closed. Bug: an
    interrupt between the fcntl and the bookkeeping, in a release, or between a section's acquire and its
    `with` body left the lock held: RuntimeError in this thread, LockTimeout in every other process."""
    s = open_store("16M", timeout=TIMEOUT)
    batch = [f"batch-{i}" for i in range(6)]  # several shards: hold_many with runs
    assert len({s.index.shard_of(key_digest(k)) for k in batch}) > 2
    values = [make_value(k, 1, 3000) for k in batch]
    solo = make_value("solo", 1, 5000)

    def work():
        s.put("solo", solo)
        s.batch_put(batch, values)
        s.delete("solo")
        s.batch_put(batch[:2], values[:2])

    interrupted, outer = [], sys.gettrace()
    for n in range(1, 20000):
        sys.settrace(interrupt_at_line(n, LOCK_LAYER))
        try:
            work()
        except KeyboardInterrupt as e:
            interrupted.append(str(e))
        else:
            break
        finally:
            sys.settrace(outer)
        where = a_lock_held_by_anyone(pool_path)
        assert where is None, f"after the interrupt at {interrupted[-1]}: lock {where} is still held"
        assert not s.locks.holds_all()
        assert s.put("solo", solo) and all(s.batch_put(batch, values)), interrupted[-1]
    else:
        pytest.fail("the workload never ran to its end")
    assert len(interrupted) > 100  # the workload ran to its end only after an interrupt at each of its lock-layer lines
    assert s.get("solo") is None and all(s.get(k) == v for k, v in zip(batch, values))
    s.close()
    with Store.open(pool_path, timeout=TIMEOUT) as again:  # blocks a cut put still owned were settled at close
        report = again.check()
        # a lock whose section was cut keeps its dirty mark until its next holder repairs it, by design
        assert [p for p in report.problems if "left dirty" not in p] == [], report.problems


def test_a_repair_cut_short_repairs_every_domain_before_its_mark_is_cleared(open_store, pool_path, monkeypatch):
    """Bug: check(repair=True) released every lock it held clean whatever ended it: an exception inside the
    repair (KeyboardInterrupt) cleared the dirty mark of a domain a dead holder had left, unrepaired. Now the
    marks stay when the locks are given back, and the cut call, before its exception leaves the store, is
    the next holder of each: the domain is repaired, then the mark cleared."""
    import maru_shm.checks.repair as check_mod

    s = open_store("4M")
    lock_id = SHARD_LOCK_BASE + 3
    rec = s.geo.off_locks + lock_id * LOCK_RECORD.size
    with pytest.raises(ZeroDivisionError):
        with s.locks.hold(lock_id):
            1 / 0  # the section's mark stays, as after a holder that died in it
    assert LOCK_RECORD.unpack_from(s.mm, rec)[0] != 0

    def interrupted(store, classes):
        raise KeyboardInterrupt("inside the repair")
    monkeypatch.setattr(check_mod, "_repair_all", interrupted)
    repaired = []
    real = s._publisher.repair_shard_lock
    monkeypatch.setattr(s._publisher, "repair_shard_lock", lambda i: (repaired.append(i), real(i)))
    with pytest.raises(KeyboardInterrupt):
        s.check(repair=True)
    assert a_lock_held_by_anyone(pool_path) is None and not s.locks.holds_all()
    assert lock_id in repaired
    assert LOCK_RECORD.unpack_from(s.mm, rec)[0] == 0 and s.locks.marked_by_this_process() == []


# ---------------------------------------------------------------- fork() (FORMAT.md invariant 4)

def _fork_inside_a_section(path, lock_id, ready_fd, extra):
    """Child: attach, open this thread's lock description (a put), enter a lock's section, fork a grandchild
    that never touches the store (it sleeps, as a multiprocessing worker would), report the grandchild's pid
    and wait inside the section to be killed."""
    s = Store.open(path)
    s.put("warm", b"w" * 3000)
    with s.locks.hold(lock_id):
        pid = os.fork()
        if pid == 0:
            while True:
                time.sleep(1)
        os.write(ready_fd, pid.to_bytes(4, "little"))
        while True:
            time.sleep(1)


def test_a_forked_child_keeps_no_lock_and_no_slot_of_its_dead_parent(pool_path, children):
    """A process killed inside a section while a fork()ed child of it lives on: the next process takes that
    lock and reaps the dead slot. Bug: the child's copies of the parent's lock descriptions (the SLOT lock's
    and each thread's; the pool's, which the mapping holds) kept every lock of the parent: LockTimeout on
    the dead parent's lock, and its slot shown alive."""
    key = "after"
    with Store.open(pool_path, "8M", create=True, timeout=TIMEOUT) as s:
        lock_id = SHARD_LOCK_BASE + s.index.shard_of(key_digest(key))
    r, w = os.pipe()
    parent = children.fork(_fork_inside_a_section, pool_path, lock_id, w, None)
    os.close(w)
    grandchild = int.from_bytes(os.read(r, 4), "little")
    os.close(r)
    assert grandchild, children.error(parent)
    try:
        assert children.kill(parent) == -signal.SIGKILL
        with Store.open(pool_path, timeout=TIMEOUT) as s:  # attaching reaps the dead slot
            assert s.put(key, b"v" * 3000) and s.get(key) == b"v" * 3000  # the dead parent's SHARD lock
            assert s.stats()["processes"] == 1
            assert a_lock_held_by_anyone(pool_path) is None
            assert_clean(s)
            os.kill(grandchild, 0)  # all this while the child lives
    finally:
        os.kill(grandchild, signal.SIGKILL)
