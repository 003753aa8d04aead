"""The backend's mutexes (maru_sglang/sync.py): no exception leaves one held, no wait on one is unbounded, and
the backend has no lock or wait outside that rule. The whole backend under the injector: test_sglang_interrupts.py."""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import threading

import pytest

from maru_sglang import sync
from maru_sglang.sync import Mutex, MutexTimeout, boundary

from ..conftest import held_by_another_thread, interrupt_at_line

HERE = os.path.abspath(__file__)
PACKAGE = pathlib.Path(sync.__file__).parent


def _free_elsewhere(lock) -> bool:
    """Can another thread take `lock` now? (It gives it back at once.)"""
    got = []

    def take():
        if lock.acquire(blocking=False):
            got.append(True)
            lock.release()
    t = threading.Thread(target=take)
    t.start()
    t.join()
    return bool(got)


def _interrupt_each_line(fn, lock, files: tuple) -> tuple[int, list]:
    """Run fn() once per line event inside `files`, interrupted there; (interrupts, where `lock` was left held)."""
    outer, interrupts, stranded = sys.gettrace(), 0, []
    for n in range(1, 200):
        seen = [0]
        tracer = interrupt_at_line(n, files, seen)
        sys.settrace(tracer)
        try:
            fn()
        except KeyboardInterrupt as e:
            interrupts += 1
            if not _free_elsewhere(lock):
                stranded.append(str(e))
                lock.release()
            continue
        finally:
            sys.settrace(outer)
        return interrupts, stranded
    raise AssertionError("fn() did not finish uninterrupted within 200 line events")


def test_the_injector_strands_a_plain_lock_held_by_with():
    """The defect the rule is for: `with lock:` leaves a threading.Lock held when the exception lands between
    the block and the release."""
    lock = threading.Lock()

    def section():
        with lock:
            x = 1
        return x

    interrupts, stranded = _interrupt_each_line(section, lock, (HERE,))
    assert interrupts >= 3 and stranded, (interrupts, stranded)


def test_an_interrupt_at_any_line_of_a_section_in_a_boundary_leaves_its_mutex_free():
    m = Mutex("test")

    @boundary
    def call():
        with m:
            x = [1]
            x.append(2)
        return x

    interrupts, stranded = _interrupt_each_line(call, m._lock, (HERE, sync.__file__))
    assert interrupts >= 10 and not stranded, (interrupts, stranded)
    assert call() == [1, 2]  # the interrupted thread takes it again: no "already held by this thread"
    assert sync._local.held == []


def test_a_nested_boundary_leaves_the_outer_sections_mutex_alone():
    """A call that makes another public call, or a finalizer the collector runs inside a section: the inner
    boundary gives back only what it took."""
    m, other = Mutex("outer"), Mutex("inner")

    @boundary
    def inner():
        other.acquire()  # left held: the inner boundary gives it back

    @boundary
    def outer():
        with m:
            inner()
            assert m._lock._is_owned() and not other._lock._is_owned()
        return True

    assert outer() and _free_elsewhere(m._lock) and _free_elsewhere(other._lock)


def test_a_busy_mutex_is_waited_for_within_its_bound():
    m = Mutex("the test's mutex", timeout=0.05)
    with held_by_another_thread(m):
        with pytest.raises(MutexTimeout, match="the test's mutex"):
            with m:
                pass
        assert m.acquire(blocking=False) is False
        assert sync._local.held == []
    with m:
        assert m.acquire(blocking=False) is False  # not re-entrant, as threading.Lock
        with pytest.raises(RuntimeError, match="already held by this thread"):
            m.acquire()


def test_a_tally_counts_every_record_stays_bounded_without_a_reader_and_never_waits_for_one():
    totals = {"n": 0}
    tally = sync.Tally("test figures", lambda r: totals.__setitem__("n", totals["n"] + r[0]))
    threads = [threading.Thread(target=lambda: [tally.add((1,)) for _ in range(5000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tally._records) < sync.FOLD_AT  # folded by the adding threads: SGLang may never read
    assert tally.read(lambda: totals["n"]) == 20000
    reading, done = threading.Event(), threading.Event()

    def slow_reader():
        tally.read(lambda: (reading.set(), done.wait(30)))
    t = threading.Thread(target=slow_reader)
    t.start()
    try:
        assert reading.wait(30)
        for _ in range(3 * sync.FOLD_AT):
            tally.add((1,))  # returns at once while the reader holds the tally
        assert len(tally._records) == 3 * sync.FOLD_AT
    finally:
        done.set()
        t.join()
    assert tally.read(lambda: totals["n"]) == 20000 + 3 * sync.FOLD_AT


# --------------------------------------------------------------------------- the rule's reach, read from the source
LOCK_TYPES = {"Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore", "Barrier"}
WAITS = {"wait", "acquire", "join", "get"}  # untimed when called without an argument


def test_the_backend_has_no_lock_but_a_mutex_and_no_untimed_wait():
    """Every lock of maru_sglang is a sync.Mutex (one rule, in one module), and every wait has a bound: a
    `.wait()`, `.acquire()`, `.join()` or `.get()` without arguments would wait forever."""
    bad = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, where = node.func.attr, f"{path.name}:{node.lineno}"
            if name in LOCK_TYPES and path.name != "sync.py":
                bad.append(f"{where}: {ast.unparse(node)} (use sync.Mutex)")
            elif name in WAITS and not node.args and not node.keywords:
                bad.append(f"{where}: {ast.unparse(node)} waits without a bound")
    assert not bad, "\n".join(bad)


def test_every_public_method_of_the_backend_is_a_boundary():
    pytest.importorskip("sglang", exc_type=ImportError, reason="sglang cannot be imported")
    from maru_sglang.maru_storage import MaruStorage

    public = [n for n, f in vars(MaruStorage).items() if not n.startswith("_") and callable(f)]
    assert {"batch_get_v1", "batch_set_v2", "get", "clear", "close", "get_stats"} <= set(public)
    assert [n for n in public if not getattr(getattr(MaruStorage, n), "is_boundary", False)] == []
