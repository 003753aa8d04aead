"""An exception at any bytecode of a public call (FORMAT.md invariant 3; DESIGN.md section 9).

A trace hook raises KeyboardInterrupt at a random line event inside maru_shm (every module), as a SIGINT
or a signal handler's exception would between two bytecodes, while a seeded workload runs puts, gets,
deletes, scalar and vector batches, eviction (the pool is kept full) and close. After each interrupt:
no lock is held (seen from a description of our own), check() is clean once every domain a cut-short
section left dirty has had its next holder, no read returned a value that was not a committed one of its
key, and, once every key is deleted and the kept lists are dropped, no block is reserved or held.

Right after an interrupted call, before any other holder takes a lock, no block is an orphan (LIVE, owned
by no live process, named by no index entry): the call repaired every domain it left dirty. Bug: victims
an eviction had unpublished and not yet freed (block CLOCK, slab move) stayed orphans until the next holder
of their class lock, which a class nobody writes any more never gets; only `check --repair` freed them.
"""

from __future__ import annotations

import os
import random
import sys
import weakref

import pytest

import maru_shm
from maru_shm import Store, remove_pool
from maru_shm.copying import copyengine
from maru_shm.locking import locks
from maru_shm.allocator import blockclock
from maru_shm.format.layout import CLASS_LOCK_BASE, LOCK_IDS, LOCK_POOL, LOCK_RECORD, SHARD_LOCK_BASE

from ..conftest import a_lock_held_by_anyone, in_finalizer, interrupt_at_line, make_value, reserve, value_version

ROOT = os.path.dirname(maru_shm.__file__) + os.sep
SIZES = (3000, 9000, 20000)
KEYS = [f"k{i}" for i in range(40)]
PAGES = [f"page{i}" for i in range(24)]
FILL = [f"fill{i}" for i in range(90)]  # 20 KB or 6 KB each: with the rest, the pool is full


def _tracer(n: int | None, stage: list, in_close: bool):
    """A trace function raising KeyboardInterrupt at the n-th line event inside maru_shm (never, for None),
    counting those of the close (once the workload appends to `stage`) if `in_close`, else the others; and
    the counts so far, [before the close, in the close]. Python unsets a trace function that raises.
    Finalizers are not traced (conftest.in_finalizer)."""
    seen = [0, 0]

    def local(frame, event, arg):
        if event == "line":
            seen[bool(stage)] += 1
            if seen[1 if in_close else 0] == n:
                raise KeyboardInterrupt(f"{frame.f_code.co_filename[len(ROOT):]}:{frame.f_lineno} "
                                        f"({frame.f_code.co_name})")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(ROOT) and not in_finalizer(frame) else None
    return calls, seen


class _Model:
    """Per key, the versions a read may return besides a miss (eviction makes any key a miss)."""

    def __init__(self):
        self.may: dict[str, set[int]] = {}
        self.version = 0
        self.wrong: list[str] = []

    def value(self, key: str, size: int) -> bytes:
        self.version += 1
        self.may.setdefault(key, set()).add(self.version)  # before the put: an interrupted one may have landed
        return make_value(key, self.version, size)

    def stored(self, key: str, value: bytes) -> None:
        self.may[key] = {value_version(key, value)}

    def read(self, key: str, data) -> None:
        if data is None:
            return
        v = value_version(key, data)
        if v is None or v not in self.may.get(key, ()):
            self.wrong.append(f"{key}: read {'bytes of no value of the key' if v is None else f'version {v}'}, "
                              f"may be {sorted(self.may.get(key, ()))}")


def _workload(s: Store, rng: random.Random, model: _Model, close: bool, stage: list) -> None:
    for _ in range(rng.randint(3, 6)):
        op = rng.choice(("put", "put", "batch", "pages", "get", "batch_get", "delete", "skip"))
        if op == "put":
            key = rng.choice(KEYS)
            v = model.value(key, rng.choice(SIZES))
            if s.put(key, v):
                model.stored(key, v)
        elif op in ("batch", "skip"):
            keys = rng.sample(KEYS, rng.randint(2, 5))
            values = [model.value(k, rng.choice(SIZES)) for k in keys]
            res = s.batch_put(keys, values, skip_existing=op == "skip")
            for k, v, ok in zip(keys, values, res):
                if ok and op == "batch":
                    model.stored(k, v)
        elif op == "pages":  # more than SMALL_BATCH keys of one size: the vector path
            keys = rng.sample(PAGES, 12)
            values = [model.value(k, 4096) for k in keys]
            for k, v, ok in zip(keys, values, s.batch_put(keys, values)):
                if ok:
                    model.stored(k, v)
        elif op == "get":
            key = rng.choice(KEYS + PAGES)
            model.read(key, s.get(key))
        elif op == "batch_get":
            keys = rng.sample(KEYS + PAGES, 10)
            outs = [bytearray(20000) for _ in keys]
            for k, buf, n in zip(keys, outs, s.batch_get_into(keys, outs)):
                model.read(k, None if n is None else buf[:n])
        else:
            key = rng.choice(KEYS + PAGES)
            if s.delete(key):
                model.may[key] = set()
    if close:
        stage.append("close")
        s.close()


def _repair_dirty_domains(s: Store) -> None:
    """Be the next holder of every lock whose record a cut-short section left dirty: it repairs that lock's
    domain first (FORMAT.md section 9), as any writer would."""
    for lock_id in range(LOCK_IDS):
        if LOCK_RECORD.unpack_from(s.mm, s.geo.off_locks + lock_id * LOCK_RECORD.size)[0] == 0:
            continue
        if lock_id >= SHARD_LOCK_BASE:
            section = s.locks.hold(lock_id, repair=s._publisher.shard_repair(lock_id - SHARD_LOCK_BASE))
        elif lock_id >= CLASS_LOCK_BASE:
            section = s.alloc.locks.class_lock(lock_id - CLASS_LOCK_BASE)
        elif lock_id == LOCK_POOL:
            section = s.alloc.locks.pool_lock()
        else:
            section = s.locks.hold(lock_id)
        with section:
            pass


def _open(path: str) -> Store:
    return Store.open(path, "2M", create=True, unit_size=64 << 10, max_value="64K", copy_threads=1, timeout=5.0)


def _interrupt_runs(path: str, runs: int, seed: int) -> dict:
    """`runs` workloads, each with one KeyboardInterrupt at a random line event of maru_shm; the checks of
    the module docstring after each. Figures for RELIABILITY.md."""
    rng = random.Random(seed)
    model = _Model()
    s = _open(path)
    figures = {"interrupts": 0, "in_close": 0, "orphans": 0}
    events, close_events = [], []  # line events of the last workloads and closes that ran to their end
    outer = sys.gettrace()
    try:
        for run in range(runs + 1):
            size = rng.choice((20000, 6000))  # a fill of the other size moves slabs between classes
            s.batch_put(FILL, [model.value(k, size) for k in FILL])  # the workload's puts evict
            close = run == 0 or rng.random() < 0.2
            work = random.Random(rng.random())
            # Run 0 counts the line events of a workload and of a close; each later run is interrupted at a
            # random one of the workload's, or, in half the runs that close, of the close's.
            where, stage = "nowhere", []
            in_close = close and rng.random() < 0.5
            n = None if run == 0 else rng.randint(1, rng.choice(close_events if in_close else events))
            tracer, seen = _tracer(n, stage, in_close)
            sys.settrace(tracer)
            try:
                _workload(s, work, model, close, stage)
            except KeyboardInterrupt as e:
                where = str(e)
                figures["interrupts"] += 1
                figures["in_close"] += bool(stage)
            finally:
                sys.settrace(outer)
            if where == "nowhere":
                events, close_events = events[-15:] + [seen[0]], close_events[-15:] + [seen[1]] * close
            assert not model.wrong, (where, model.wrong)
            held = a_lock_held_by_anyone(path)
            assert held is None, f"after the interrupt at {where}: lock {held} is still held"
            if close:
                s.close()  # a close an exception cut short finishes when called again
                s = _open(path)
                assert s.stats()["processes"] == 1, where
            report = s.check()  # before anyone else takes a lock: nothing but the cut call itself repaired
            orphans = [p for p in report.problems if "(orphan)" in p]
            figures["orphans"] += len(orphans)
            assert not orphans, f"after the interrupt at {where}: {orphans[:3]}"
            if not close:  # the cut call was the next holder of every lock it left dirty
                assert report.ok and s.locks.marked_by_this_process() == [], (where, report.problems)
            _repair_dirty_domains(s)  # a close cut short leaves its marks to the next holders
            report = s.check()
            assert report.ok, (where, report.problems)
            for k in KEYS + PAGES + FILL:
                model.read(k, s.get(k))
                s.delete(k)
                model.may[k] = set()
            assert not model.wrong, (where, model.wrong)
            s.alloc.free_kept()
            st = s.stats()
            assert (st["reserved_blocks"], st["held_blocks"], st["live_blocks"]) == (0, 0, 0), \
                f"after the interrupt at {where}: {st['reserved_blocks']} reserved, {st['held_blocks']} held, " \
                f"{st['live_blocks']} live blocks with every key deleted and the kept lists dropped"
        figures.update(evictions=st["evictions"], slab_moves=st["slab_moves"])
    finally:
        sys.settrace(outer)
        s.close()
    return figures


def test_an_interrupt_at_any_line_of_a_public_call_leaks_no_lock_and_no_block(pool_path):
    figures = _interrupt_runs(pool_path, runs=300, seed=37)
    assert figures["interrupts"] > 250 and figures["in_close"] > 5, figures
    assert figures["evictions"] > 0, figures


@pytest.mark.slow
def test_interrupts_long_run(pool_path):
    """At least 5 000 interrupts (about nine runs in ten are interrupted), 0 orphans right after each."""
    runs = int(os.environ.get("MARU_INTERRUPT_RUNS", "5600"))
    figures = _interrupt_runs(pool_path, runs=runs, seed=int(os.environ.get("MARU_INTERRUPT_SEED", "38")))
    print(figures)
    assert figures["interrupts"] > runs * 0.8 and figures["orphans"] == 0, figures


BIG = [f"big{i}" for i in range(6)]  # 6 x 512 KiB: a batch the copy engine shares with its workers


def test_an_interrupt_in_a_threaded_batch_leaves_no_worker_copying(pool_path, monkeypatch):
    """The caller of a batch that the copy engine shares with worker threads is interrupted at a random line
    event of maru_shm (the workers run on): when the call raises, no worker still copies into the batch's
    blocks (they are given back next, and another writer may take them), no lock is held, and after every
    key is deleted nothing is reserved or held; no read returns bytes of another value."""
    rng, model, outer = random.Random(39), _Model(), sys.gettrace()
    s = Store.open(pool_path, "32M", create=True, max_value="1M", copy_threads=3, timeout=5.0)
    s._engine.cores.free = lambda: s._engine.threads  # every core idle: the threaded path is the one under test
    monkeypatch.setattr(copyengine, "BACKOFF", 0)  # and workers a loaded machine leaves unscheduled keep it so
    outs = [bytearray(512 << 10) for _ in BIG]

    def work():
        values = [model.value(k, 512 << 10) for k in BIG]
        for k, v, ok in zip(BIG, values, s.batch_put(BIG, values)):
            if ok:
                model.stored(k, v)
        for k, buf, n in zip(BIG, outs, s.batch_get_into(BIG, outs)):
            model.read(k, None if n is None else buf[:n])
    interrupts, events = 0, []
    try:
        for run in range(121):
            n = None if run == 0 else rng.randint(1, max(events))
            tracer, seen = _tracer(n, [], False)
            where = "nowhere"
            sys.settrace(tracer)
            try:
                work()
                events = events[-5:] + [seen[0]]
            except KeyboardInterrupt as e:
                where, interrupts = str(e), interrupts + 1
            finally:
                sys.settrace(outer)
            assert s._engine.in_flight() == 0, f"a worker still copies after the interrupt at {where}"
            assert not model.wrong, (where, model.wrong)
            assert a_lock_held_by_anyone(pool_path) is None, where
        _repair_dirty_domains(s)
        assert s.check().ok
        for k in BIG:
            model.read(k, s.get(k))
            s.delete(k)
        assert not model.wrong, model.wrong
        s.alloc.free_kept()
        st = s.stats()
        assert (st["reserved_blocks"], st["held_blocks"], st["live_blocks"]) == (0, 0, 0), st
        assert interrupts > 100 and s._engine.batches_threaded > 20, (interrupts, s._engine.batches_threaded)
    finally:
        sys.settrace(outer)
        s.close()


def test_the_tracers_never_interrupt_a_finalizer():
    """The garbage collector may run a finalizer of maru_shm (a finished thread's lock description) at any
    allocation of a traced call: the tracers of these tests and of test_locks.py neither count nor
    interrupt its lines. Bug: they raised there, and on CPython 3.11 that crashed the process (an xdist
    worker "not properly terminated", in test_an_interrupt_at_each_line_of_a_put_then_close_detaches)."""
    class Thing:
        pass
    outer, seen_locks, results = sys.gettrace(), [0], []
    tracers = {"_tracer": _tracer(1, [], False),
               "interrupt_at_line": (interrupt_at_line(1, (locks.__file__,), seen_locks), seen_locks)}
    for name, (tracer, seen) in tracers.items():
        thing = Thing()
        finalizer = weakref.finalize(thing, locks._forget_thread_fd, weakref.ref(Thing()), -1)  # table gone
        interrupted = None
        sys.settrace(tracer)
        try:
            finalizer()
        except KeyboardInterrupt as e:
            interrupted = str(e)
        finally:
            sys.settrace(outer)
        results.append((name, finalizer.alive, interrupted, sum(seen)))
    assert results == [("_tracer", False, None, 0), ("interrupt_at_line", False, None, 0)], results


def test_check_reports_blocks_this_process_owns_but_holds_nowhere(open_store, pool_path):
    """Blocks a live process owns are in flight to everyone else; only that process knows whether something
    in it still holds them. Its check() reports those nothing holds, check(repair=True) settles them, and
    another attachment's check, like `maru-shm check`, cannot tell them from blocks in flight."""
    s = open_store("8M")
    other = open_store(path=pool_path, create=False)
    assert s.put("k", make_value("k", 1, 9000))  # its block is published; its spares are kept: both held
    assert s.check().ok
    leaked = reserve(s, s.alloc.class_for(9000), ["a", "b"], 9000)  # past every ledger, as a cut call would
    report = s.check()
    assert [p for p in report.problems if "held by nothing" in p and f"data offset {min(leaked)}" in p], \
        report.problems
    assert len(report.problems) == 1, report.problems
    assert other.check().ok
    s.check(repair=True)
    assert s.check().ok
    s.alloc.free_kept()
    st = s.stats()
    assert (st["reserved_blocks"], st["held_blocks"], st["live_blocks"]) == (0, 0, 1)
    assert s.get("k") == make_value("k", 1, 9000)


def test_an_interrupt_at_each_line_of_a_put_then_close_detaches(pool_path):
    """An interrupt at each line event of one put in turn (the public call's entry and exit included), then
    close(): the next opener finds no other process attached, and nothing reserved or held. Bug: an interrupt
    on the line that counted the call out of the close fence left it counted in, and close() waited its
    full 30 s, then returned without detaching."""
    value = make_value("k", 1, 9000)
    with _open(pool_path) as s:
        tracer, seen = _tracer(None, [], False)
        sys.settrace(tracer)
        try:
            s.put("k", value)
        finally:
            sys.settrace(None)
        s.delete("k")
    for n in range(1, seen[0] + 1):
        s = _open(pool_path)
        sys.settrace(_tracer(n, [], False)[0])
        try:
            s.put("k", value)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        s.close()
        with _open(pool_path) as again:
            assert again.stats()["processes"] == 1, n
            assert again.get("k") in (None, value), n
            again.delete("k")
            st = again.stats()
            assert (st["reserved_blocks"], st["held_blocks"], st["live_blocks"]) == (0, 0, 0), n


def _full_of_one_class(path: str) -> Store:
    """A fresh pool whose every unit holds 6 KB values (the last put evicted within the class)."""
    remove_pool(path)
    s = _open(path)
    i = 0
    while s.stats()["evictions"] == 0:
        keys = [f"full{j}" for j in range(i, i + 10)]
        s.batch_put(keys, [make_value(k, 1, 6000) for k in keys])
        i += 10
    return s


def test_an_interrupt_at_each_line_of_a_block_clock_eviction_leaves_no_orphan(pool_path):
    """A put into a full class evicts within it (allocator/blockclock.py): its victims are unpublished, then
    freed. An interrupt at each line event of that module in turn: right after it, before any other holder
    takes a lock, check() finds no orphan and no lock left dirty, and the class serves puts. Bug: an
    interrupt between the unpublish and the free (line events 66-72 of 79 here) left the victim LIVE, unowned
    and unindexed under a dirty class lock, for a next holder that a class nobody writes any more never
    gets: one orphan each."""
    s = _full_of_one_class(pool_path)
    seen = [0]
    sys.settrace(interrupt_at_line(None, (blockclock.__file__,), seen))
    try:
        assert s.put("new", make_value("new", 1, 6000))
    finally:
        sys.settrace(None)
        s.close()
    assert seen[0] > 20
    for n in range(1, seen[0] + 1):
        s = _full_of_one_class(pool_path)
        try:
            sys.settrace(interrupt_at_line(n, (blockclock.__file__,)))
            try:
                s.put("new", make_value("new", 1, 6000))
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            report = s.check()
            assert not [p for p in report.problems if "(orphan)" in p], (n, report.problems[:3])
            assert report.ok and s.locks.marked_by_this_process() == [], (n, report.problems[:3])
            assert s.put("after", make_value("after", 1, 6000)), n
        finally:
            s.close()


def measure(runs: int, seed: int) -> dict:
    """RELIABILITY.md's figures: the workload (no close) `runs` times, one interrupt each and no repair in
    between; then the runs that ended with a lock held, the blocks check() found orphaned right after an
    interrupt, and, with every key deleted and the kept lists dropped, the blocks still reserved, held or
    live (orphans). Public calls only, so that it measures older code too; a
    thread mutex left held shows as a hang (SIGALRM after 20 s without a finished run)."""
    import signal
    import uuid

    class Hang(Exception):
        pass

    def alarm(*_):
        raise Hang()
    signal.signal(signal.SIGALRM, alarm)
    path = f"/dev/shm/maru-measure-{uuid.uuid4().hex[:8]}"
    rng, model, outer = random.Random(seed), _Model(), sys.gettrace()
    s = Store.open(path, "2M", create=True, unit_size=64 << 10, max_value="64K", copy_threads=1, timeout=0.5)
    out = {"interrupts": 0, "runs_ending_with_a_lock_held": 0, "wrong_reads": 0, "hang": None}
    events: list[int] = []
    orphaned: set[str] = set()  # blocks check() found orphaned right after an interrupted run
    try:
        for run in range(runs + 1):
            signal.alarm(20)
            s.batch_put(FILL, [model.value(k, rng.choice((20000, 6000))) for k in FILL])
            work, n = random.Random(rng.random()), None if run == 0 else rng.randint(1, rng.choice(events))
            tracer, seen = _tracer(n, [], False)
            sys.settrace(tracer)
            try:
                _workload(s, work, model, False, [])
                events = events[-15:] + [seen[0]]
            except KeyboardInterrupt:
                out["interrupts"] += 1
                orphaned.update(p.split(":")[0] for p in s.check().problems if "(orphan)" in p)
            finally:
                sys.settrace(outer)
            out["runs_ending_with_a_lock_held"] += a_lock_held_by_anyone(path) is not None
        signal.alarm(60)
        for k in KEYS + PAGES + FILL:
            s.delete(k)
        s.alloc.free_kept()
        st = s.stats()
        out.update(reserved_after=st["reserved_blocks"], held_after=st["held_blocks"], wrong_reads=len(model.wrong),
                   orphans_after=st["live_blocks"], orphans_seen=len(orphaned))  # (no key left: live is orphaned)
        signal.alarm(0)
        s.close()
        remove_pool(path)
    except Hang:
        out["hang"] = f"run {run}, after {out['interrupts']} interrupts"
    return out


if __name__ == "__main__":  # PYTHONPATH=. python -m tests.maru_shm.test_interrupts RUNS SEED
    print(measure(int(sys.argv[1]), int(sys.argv[2])), flush=True)
    os._exit(0)  # a hung run's thread mutex is still held
