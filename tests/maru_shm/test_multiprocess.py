"""Many processes on one pool: a shared pool across xdist workers, a SIGKILL storm, readers racing writers.

Every value is self-verifying (see conftest.make_value), so any read, by any process, at any time,
can be checked on its own: a wrong, torn, shifted or foreign value is counted as a wrong read.

(a) `test_shared_pool_mixed_workload` is parametrized once per xdist worker, and conftest orders the
    collection so every worker starts one instance first: all workers of one run work on ONE pool file
    (named after `testrun_uid`) at the same time. Without xdist it forks 4 processes itself.
(b) `test_sigkill_storm`: workers are SIGKILLed every 20-200 ms and respawned; afterwards repair, check,
    verify every indexed value.
(c) `test_readers_racing_writers`: readers of a few hot keys that writers overwrite, delete and evict.
(d) `test_every_crash_point_is_recovered`: a process dies at each crash point of FORMAT.md section 9.
Also: threads sharing one Store, and check() of a pool in use (no false orphans: an unpublishing
writer owns the block until it frees it).

Soak knobs: MARU_SHM_STORM_SECONDS (default 4) and MARU_SHM_STORM_POOL (default 16M) lengthen or
tighten the storm, e.g. `MARU_SHM_STORM_SECONDS=60 MARU_SHM_STORM_POOL=6M pytest -k storm`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import signal
import time
import traceback

import numpy as np
import pytest

from maru_shm import Store, remove_pool
from maru_shm.index import key_digest

from ..conftest import (HEADER_SIZE, assert_clean, check_value, make_value, read_notes as _notes,
                        reserve as reserve_blocks, write_note as _note)

# ---------------------------------------------------------------- a results board shared across fork

CTRL, OPS, WRONG, ERRORS, HITS = 0, 1, 2, 3, 4
FIELDS = 5


class Board:
    """Anonymous shared memory, one row per worker (row 0: control). Each row has one writer."""

    def __init__(self, rows: int):
        self.mm = mmap.mmap(-1, rows * FIELDS * 8)
        self.a = np.frombuffer(self.mm, dtype=np.int64).reshape(rows, FIELDS)

    def stop(self) -> None:
        self.a[0, CTRL] = 1

    @property
    def stopping(self) -> bool:
        return bool(self.a[0, CTRL])

    def total(self, field: int) -> int:
        return int(self.a[1:, field].sum())


# ---------------------------------------------------------------- the mixed workload

def _value_size(rng: random.Random) -> int | None:
    r = rng.random()
    if r < 0.05:
        return rng.randint(100_000, 300_000)  # a few large classes too
    if r < 0.10:
        return rng.randint(HEADER_SIZE, 200)  # and tiny ones
    return None  # derived from key and version: 32 B .. 64 KiB


def _verify(errdir, row, key, data, where) -> bool:
    if data is None:
        return False
    if check_value(key, data):
        row[HITS] += 1
        return True
    row[WRONG] += 1
    _note(errdir, "wrong", f"{where}: wrong bytes for {key!r}: {len(data)} bytes, head {bytes(data[:48]).hex()}")
    return False


def mixed_workload(store: Store, row, rng: random.Random, keys, n_ops: int, errdir: str, board=None) -> None:
    """Random put/get/delete/overwrite/batch operations over a shared key space; every read verified."""
    version = rng.getrandbits(40) << 20
    buf = bytearray(320_000)
    for _ in range(n_ops):
        if board is not None and board.stopping:
            return
        version += 1
        k = rng.choice(keys)
        op = rng.random()
        try:
            if op < 0.25:
                store.put(k, make_value(k, version, _value_size(rng)))
            elif op < 0.45:
                _verify(errdir, row, k, store.get(k), "get")
            elif op < 0.55:
                n = store.get_into(k, buf)
                if n is not None:
                    _verify(errdir, row, k, memoryview(buf)[:n], "get_into")
            elif op < 0.62:
                store.delete(k)
            elif op < 0.72:
                ks = rng.sample(keys, 6)
                vs = [make_value(x, version, _value_size(rng)) for x in ks]
                res = store.batch_put(ks, vs, skip_existing=rng.random() < 0.3)
                assert len(res) == 6
            elif op < 0.84:
                ks = rng.sample(keys, 6)
                outs = [bytearray(320_000) for _ in ks]
                for x, o, n in zip(ks, outs, store.batch_get_into(ks, outs)):
                    if n is not None:
                        _verify(errdir, row, x, memoryview(o)[:n], "batch_get_into")
            elif op < 0.90:
                n = store.length_of(k)
                if n is not None:
                    a, b = np.empty(n // 3, np.uint8), np.empty(n - n // 3, np.uint8)
                    if store.get_pieces(k, [(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)]):
                        _verify(errdir, row, k, a.tobytes() + b.tobytes(), "get_pieces")
            elif op < 0.95:
                store.batch_exists(rng.sample(keys, 16))
            else:
                a = np.frombuffer(make_value(k, version, _value_size(rng)), np.uint8)
                cut = a.nbytes // 2
                store.put_pieces(k, [(a.ctypes.data, cut), (a.ctypes.data + cut, a.nbytes - cut)])
        except Exception:
            row[ERRORS] += 1
            _note(errdir, "error", traceback.format_exc())
        row[OPS] += 1


SHARED_SIZE = "64M"
SHARED_KEYS = [f"shared-{i}" for i in range(1500)]
SHARED_OPS = 2500


def _shared_child(path, board, r, seed, errdir):
    with Store.open(path, SHARED_SIZE, create=True, timeout=20) as s:
        mixed_workload(s, board.a[r], random.Random(seed), SHARED_KEYS, SHARED_OPS, errdir)


def _final_verification(store: Store, keys) -> None:
    assert_clean(store)
    digests = {key_digest(k) for k in keys}
    found = 0
    for k in keys:
        v = store.get(k)
        if v is not None:
            assert check_value(k, v), k
            found += 1
    assert found == store.stats()["entries"]
    for sh in range(store.geo.index_shards):
        for _, d, _, _ in store.index.entries(sh):
            assert d in digests  # nothing indexed that nobody wrote


def _xdist_workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


# one instance per worker (at most 64: the pool has 128 process slots)
SHARED_INSTANCES = list(range(min(_xdist_workers(), 64))) if _xdist_workers() >= 2 else ["alone"]


@pytest.mark.parametrize("instance", SHARED_INSTANCES)
def test_shared_pool_mixed_workload(instance, testrun_uid, tmp_path_factory, tmp_path, children, pool_path):
    errdir = str(tmp_path)
    if instance == "alone":
        # not under xdist (or one worker): be the 4 processes ourselves
        board = Board(5)
        pids = [children.fork(_shared_child, pool_path, board, r, 1000 + r, errdir) for r in range(1, 5)]
        for pid in pids:
            children.wait_ok(pid, timeout=300)
        assert board.total(WRONG) == 0, _notes(errdir)
        assert board.total(ERRORS) == 0, _notes(errdir)
        assert board.total(OPS) == 4 * SHARED_OPS and board.total(HITS) > 0
        with Store.open(pool_path) as s:
            assert s.stats()["processes"] == 1
            _final_verification(s, SHARED_KEYS)
        return

    # one instance per xdist worker, all on the same file
    path = f"/dev/shm/maru-test-shared-{testrun_uid}"
    lock = open(tmp_path_factory.getbasetemp().parent / f"shared-{testrun_uid}.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # serialise open against the last one's unlink
        try:
            store = Store.open(path, SHARED_SIZE, create=True, timeout=20)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            # soft barrier: give the other workers a moment to attach (they start this test first)
            deadline = time.monotonic() + 5
            peak = 1
            while time.monotonic() < deadline:
                peak = max(peak, store.stats()["processes"])
                if peak >= len(SHARED_INSTANCES):
                    break
                time.sleep(0.01)
            board = Board(2)
            mixed_workload(store, board.a[1], random.Random(int(testrun_uid[:8], 16) + instance), SHARED_KEYS,
                           SHARED_OPS, errdir)
            print(f"\nshared pool: instance {instance} saw {peak} processes attached at once")
            assert board.total(WRONG) == 0, _notes(errdir)
            assert board.total(ERRORS) == 0, _notes(errdir)
            assert board.total(HITS) > 0
        finally:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                last = store.stats()["processes"] == 1
                if last:  # everyone else is done: the pool is quiescent, check all of it
                    _final_verification(store, SHARED_KEYS)
            finally:
                store.close()
                if last:
                    remove_pool(path)
                fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        lock.close()


# ---------------------------------------------------------------- (b) SIGKILL storm

STORM_KEYS = [f"storm-{i}" for i in range(300)]
STORM_SECONDS = float(os.environ.get("MARU_SHM_STORM_SECONDS", "4"))  # raise it for a soak run


def _storm_worker(path, board, r, seed, errdir):
    s = Store.open(path, timeout=20)
    mixed_workload(s, board.a[r], random.Random(seed), STORM_KEYS, 10**9, errdir, board=board)
    s.close()


def test_sigkill_storm(pool_path, children, tmp_path, record_property):
    errdir = str(tmp_path)
    rng = random.Random(99)
    max_spawns = max(400, int(STORM_SECONDS * 20))
    board = Board(max_spawns + 1)
    # The observer stays attached through the storm: it sees the dead only through its own repair.
    observer = Store.open(pool_path, os.environ.get("MARU_SHM_STORM_POOL", "16M"), create=True, timeout=20)
    try:
        live: dict[int, int] = {}
        spawned = 0

        def spawn():
            nonlocal spawned
            spawned += 1
            live[children.fork(_storm_worker, pool_path, board, spawned, rng.getrandbits(32), errdir)] = spawned

        for _ in range(3):
            spawn()
        kills = 0
        end = time.monotonic() + STORM_SECONDS
        while (time.monotonic() < end or kills < 10) and spawned < max_spawns:
            time.sleep(rng.uniform(0.02, 0.2))
            victim = rng.choice(list(live))
            os.kill(victim, signal.SIGKILL)
            code = children.wait(victim)
            r = live.pop(victim)
            assert code == -signal.SIGKILL, f"worker {r} exited with {code}:\n{children.error(victim)}"
            kills += 1
            spawn()
        # a last victim is not replaced: nobody attaches after it, so only repair can reap it
        time.sleep(rng.uniform(0.02, 0.2))
        victim = rng.choice(list(live))
        os.kill(victim, signal.SIGKILL)
        assert children.wait(victim) == -signal.SIGKILL
        live.pop(victim)
        kills += 1
        board.stop()
        for pid in list(live):
            children.wait_ok(pid, timeout=120)
        ops = board.total(OPS)
        record_property("storm_kills", kills)
        record_property("storm_ops", ops)
        print(f"\nSIGKILL storm: {kills} kills, {ops} operations, {board.total(HITS)} verified reads")
        assert board.total(WRONG) == 0, _notes(errdir)
        assert board.total(ERRORS) == 0, _notes(errdir)
        assert kills >= 10 and ops > 0

        # Before any repair, a storm may only have left what FORMAT.md section 9 leaves to lazy repair:
        # dead slots (reaped here), dirty locks with damage inside their own domain, orphans.
        observer.reap_dead()
        unexpected = _unexpected_problems(observer, observer.check().problems)
        assert not unexpected, unexpected
        report = observer.check(repair=True)
        assert report.ok, report.problems
        report = observer.check()
        assert report.ok, report.problems
        st = observer.stats()
        assert st["processes"] == 1, "only the observer is alive"
        _final_verification(observer, STORM_KEYS)
        # and the pool still works for everyone
        assert observer.put("after", make_value("after", 1, 50_000))
        assert check_value("after", observer.get("after"))
    finally:
        observer.close()


def _unexpected_problems(store, problems):
    """check() findings that no crash point of FORMAT.md section 9 explains."""
    import re
    dirty = {m.group(1) for p in problems if (m := re.match(r"lock (\S+): left dirty", p))}
    out = []
    for p in problems:
        if re.match(r"lock \S+: left dirty", p) or p.endswith("(orphan)"):
            continue
        if (m := re.match(r"class (\d+):", p)) and f"CLASS[{m.group(1)}]" in dirty:
            continue
        if (m := re.match(r"slab (\d+)", p)) and f"CLASS[{int(store.alloc.clsfield[int(m.group(1))])}]" in dirty:
            continue
        if (m := re.match(r"index shard (\d+)", p)) and f"SHARD[{m.group(1)}]" in dirty:
            continue
        if re.match(r"unit \d+", p) and "POOL" in dirty:
            continue
        out.append(p)
    return out


# ---------------------------------------------------------------- (c) readers racing writers

HOT = [f"hot-{i}" for i in range(4)]
RACE_OPS = 2500


def _racing_writer(path, board, r, seed, errdir, n_ops):
    rng = random.Random(seed)
    row = board.a[r]
    version = seed << 24
    with Store.open(path, timeout=20) as s:
        for n in range(n_ops):
            version += 1
            k = rng.choice(HOT)
            try:
                op = rng.random()
                if op < 0.6:  # overwrite, mostly with the same size so blocks of one class get reused
                    size = 24_000 if rng.random() < 0.8 else rng.randint(HEADER_SIZE, 90_000)
                    s.put(k, make_value(k, version, size))
                elif op < 0.75:
                    s.delete(k)
                else:  # filler of many sizes: slab eviction recycles the hot keys' units for other classes
                    f = f"fill-{seed}-{n}"
                    s.put(f, make_value(f, version, rng.randint(HEADER_SIZE, 400_000)))
            except Exception:
                row[ERRORS] += 1
                _note(errdir, "error", traceback.format_exc())
            row[OPS] += 1


def _racing_reader(path, board, r, seed, errdir):
    rng = random.Random(seed)
    row = board.a[r]
    buf = bytearray(100_000)
    with Store.open(path, timeout=20) as s:
        while not board.stopping:
            k = rng.choice(HOT)
            try:
                op = rng.random()
                if op < 0.4:
                    _verify(errdir, row, k, s.get(k), "get")
                elif op < 0.7:
                    n = s.get_into(k, buf)
                    if n is not None:
                        _verify(errdir, row, k, memoryview(buf)[:n], "get_into")
                elif op < 0.85:
                    n = s.length_of(k)
                    if n is not None:
                        a = np.empty(n, np.uint8)
                        h = n // 2
                        if s.get_pieces(k, [(a.ctypes.data, h), (a.ctypes.data + h, n - h)]):
                            _verify(errdir, row, k, a.tobytes(), "get_pieces")
                else:
                    outs = [bytearray(100_000) for _ in HOT]
                    for x, o, n in zip(HOT, outs, s.batch_get_into(HOT, outs)):
                        if n is not None:
                            _verify(errdir, row, x, memoryview(o)[:n], "batch_get_into")
            except Exception:
                row[ERRORS] += 1
                _note(errdir, "error", traceback.format_exc())
            row[OPS] += 1


def test_readers_racing_writers(pool_path, children, tmp_path, record_property):
    errdir = str(tmp_path)
    with Store.open(pool_path, "8M", create=True) as s:
        for k in HOT:
            s.put(k, make_value(k, 0, 24_000))
    board = Board(5)
    writers = [children.fork(_racing_writer, pool_path, board, r, r, errdir, RACE_OPS) for r in (1, 2)]
    readers = [children.fork(_racing_reader, pool_path, board, r, r, errdir) for r in (3, 4)]
    for pid in writers:
        children.wait_ok(pid, timeout=240)
    board.stop()
    for pid in readers:
        children.wait_ok(pid, timeout=60)
    reads = int(board.a[3:, HITS].sum())
    record_property("racing_verified_reads", reads)
    print(f"\nreaders racing writers: {reads} verified reads, {int(board.a[3:, OPS].sum())} read operations")
    assert board.total(WRONG) == 0, _notes(errdir)
    assert board.total(ERRORS) == 0, _notes(errdir)
    assert reads > 0
    with Store.open(pool_path) as s:
        assert s.stats()["evictions"] > 0  # the filler really recycled blocks under the readers
        _final_verification(s, HOT + [f"fill-{w}-{n}" for w in (1, 2) for n in range(RACE_OPS)])


# ---------------------------------------------------------------- threads sharing one attachment

def test_threads_share_one_store(open_store, tmp_path):
    """Threads of one process share one Store (one proc slot, one lock descriptor): same guarantees."""
    import threading
    errdir = str(tmp_path)
    s = open_store("32M", timeout=20)
    board = Board(5)
    keys = [f"thread-{i}" for i in range(400)]
    threads = [threading.Thread(target=mixed_workload, args=(s, board.a[r], random.Random(r), keys, 1500, errdir))
               for r in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert board.total(WRONG) == 0, _notes(errdir)
    assert board.total(ERRORS) == 0, _notes(errdir)
    assert board.total(OPS) == 4 * 1500 and board.total(HITS) > 0
    _final_verification(s, keys)


# ---------------------------------------------------------------- (d) each crash point of FORMAT.md section 9

def _die_at_every_crash_point(path, ready_fd):
    import ctypes
    from maru_shm.format.layout import LIVE, SHARD_LOCK_BASE, U64
    s = Store.open(path)
    info = s.alloc.class_for(9000)

    def reserve(key):
        [off] = reserve_blocks(s, info, [key], 9000)
        v = make_value(key, 1, 9000)
        ctypes.memmove(s._att.data + off, v, len(v))
        return off

    def commit(off):
        m = s.alloc.meta_off(off)
        w = U64.unpack_from(s.mm, m)[0]
        live = (((w >> 2) + 1) << 2) | LIVE
        U64.pack_into(s.mm, m, live)
        return live

    reserve("reserved")                          # after reserving, before commit
    commit(reserve("committed"))                 # after commit, before publish
    off = reserve("published")                   # after publish, before clearing owner
    live = commit(off)
    d = key_digest("published")
    with s.locks.hold(SHARD_LOCK_BASE + s.index.shard_of(d)):
        s.index.put(s.index.shard_of(d), d, live, off)
    assert s.put("orphan", make_value("orphan", 1, 9000))  # after unpublish, before free
    d = key_digest("orphan")
    with s.locks.hold(SHARD_LOCK_BASE + s.index.shard_of(d)):
        assert s.index.remove(s.index.shard_of(d), d) is not None
    os.write(ready_fd, b"1")
    while True:
        time.sleep(1)


def test_every_crash_point_is_recovered(pool_path, children):
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("bystander", make_value("bystander", 1, 9000))
    r, w = os.pipe()
    pid = children.fork(_die_at_every_crash_point, pool_path, w)
    os.close(w)
    assert os.read(r, 1) == b"1", children.error(pid)
    os.close(r)
    children.kill(pid)
    with Store.open(pool_path) as s:  # attaching reaps the dead slot
        st = s.stats()
        assert st["processes"] == 1
        assert s.get("published") == make_value("published", 1, 9000)  # published: kept, owner cleared
        assert s.get("bystander") == make_value("bystander", 1, 9000)  # nothing else lost
        for k in ("reserved", "committed", "orphan"):
            assert s.get(k) is None
        assert s._reaper.owned_blocks(0) == [] and all(s._reaper.owned_blocks(p) == [] for p in range(4))
        problems = s.check().problems  # the orphan is left to repair (or slab eviction)
        assert len(problems) == 1 and "orphan" in problems[0], problems
        assert s.check(repair=True).ok
        assert_clean(s)
        st = s.stats()
        assert st["live_blocks"] == st["entries"] == 2


# ---------------------------------------------------------------- check() on a pool in use

def _busy_writer(path, board, r):
    with Store.open(path, timeout=20) as s:
        i = 0
        while not board.stopping:
            s.put(f"w{i % 50}", make_value(f"w{i % 50}", i, 5000))
            if i % 3 == 0:
                s.delete(f"w{(i * 7) % 50}")
            board.a[r, OPS] += 1
            i += 1


def test_check_of_a_pool_in_use_reports_no_false_problems(pool_path, children):
    board = Board(2)
    with Store.open(pool_path, "16M", create=True, timeout=20) as s:
        pid = children.fork(_busy_writer, pool_path, board, 1)
        try:
            deadline = time.monotonic() + 10
            while board.a[1, OPS] < 100 and time.monotonic() < deadline:
                time.sleep(0.01)
            problems = []
            checks = 0
            while not problems and checks < 200 and time.monotonic() < deadline:
                problems = s.check().problems
                checks += 1
        finally:
            board.stop()
            children.wait_ok(pid)
        if board.a[1, OPS] < 100:
            pytest.skip("the writer never got going (machine too busy)")
        other = [p for p in problems if "orphan" not in p]
        if other:  # anything but the known false orphans is a real failure, not the expected one
            raise RuntimeError(f"check() of a pool in use: {other}")
        assert problems == [], f"after {checks} checks: {problems}"


# ---------------------------------------------------------------- repairs ask the index under the shard lock

def _slow_backward_shift(path, da, hole, ready_fd, class_lock, fake_holder):
    """Delete `da` (the head of a two-entry cluster) as a backward shift that pauses after its first
    store (the hole emptied, the next entry not yet moved into it) until a repair is under way."""
    from maru_shm.format.layout import LOCK_RECORD, SHARD_LOCK_BASE, store_u64
    s = Store.open(path, timeout=20)
    sh = s.index.shard_of(da)
    s.locks.acquire(SHARD_LOCK_BASE + sh)
    word, off = s.index.find(da)
    s._publisher.claim_for_free(off, word)
    e = s.index.entry_off(sh, hole)
    store_u64(s.mm, e + 16, 0)  # first store of the shift: a lock-free probe for the next key stops here
    os.write(ready_fd, b"1")
    rec = s.geo.off_locks + class_lock * LOCK_RECORD.size
    deadline = time.monotonic() + 15
    while LOCK_RECORD.unpack_from(s.mm, rec)[0] == fake_holder and time.monotonic() < deadline:
        time.sleep(0.001)  # until the other process is inside the class lock, repairing
    time.sleep(0.3)  # a lock-free repair would have decided by now
    store_u64(s.mm, e + 16, word)
    assert s.index.remove(sh, da) == (word, off)  # the whole shift, properly
    s.locks.release(SHARD_LOCK_BASE + sh)
    s.alloc.free_blocks([(off, word)])
    s.close()


def test_class_repair_waits_for_a_backward_shift_in_progress(pool_path, children):
    """Class repair keeps a LIVE block only if the index points at it. Asked without the shard lock
    while another process is shifting that shard's entries back, the index can answer "not indexed"
    for a published block, and the repair frees it: the key is lost. Asked under the lock, it waits."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, LOCK_RECORD
    with Store.open(pool_path, "8M", create=True, timeout=20) as s:
        seen, i = {}, 0
        while True:  # two keys with the same shard and home slot: b sits right after a
            d = key_digest(f"k{i}")
            where = (s.index.shard_of(d), s.index.home_of(d))
            if where in seen:
                a, b = seen[where], f"k{i}"
                break
            seen[where] = f"k{i}"
            i += 1
        va, vb = make_value(a, 1, 5000), make_value(b, 1, 5000)
        assert s.put(a, va) and s.put(b, vb)
        cid = s.alloc.class_for(5000).cid
        r, w = os.pipe()
        fake = 0xFFFF  # a dead holder left the class lock dirty (as a crash inside allocate would)
        LOCK_RECORD.pack_into(s.mm, s.geo.off_locks + (CLASS_LOCK_BASE + cid) * LOCK_RECORD.size, fake, 0)
        pid = children.fork(_slow_backward_shift, pool_path, key_digest(a), where[1], w,
                            CLASS_LOCK_BASE + cid, fake)
        os.close(w)
        assert os.read(r, 1) == b"1", children.error(pid)
        os.close(r)
        assert s.get(b) is None  # a lock-free lookup of b misses right now: the hole stops the probe
        assert s.put("other", make_value("other", 1, 5000))  # takes the dirty class lock: class repair
        children.wait_ok(pid)
        assert s.get(a) is None
        assert s.get(b) == vb, "class repair freed a published block during another process's shift"
        assert_clean(s)
