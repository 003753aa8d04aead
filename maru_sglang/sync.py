"""How the backend's threads share state: mutexes that no exception leaves held and no wait holds forever.

Invariant 9 for the backend's own locks: an exception raised at any bytecode of a call SGLang makes
(KeyboardInterrupt, a signal handler's) leaves no mutex held. `with lock:` alone does not keep it: the
exception may land after the acquire and before the block (or after the block and before the release),
and the next call then waits forever. The rule is maru_shm's (locks.py, guard.py), for the backend's threads:

- A thread names a mutex in its list before it takes it, and forgets it only after giving it back: at
  every bytecode the list names every mutex the thread may hold. A Mutex knows its owner (the RLock under
  it records the owner in the same C call that takes it), so a name in the list that the thread does not
  own is simply dropped.
- A section (`with mutex:`) gives its mutex back on every exception that reaches it. The exceptions that
  land where it cannot (between the acquire and the block, at the first bytecode of `__exit__`) are the
  boundary's: every method SGLang calls (`public_calls`) and every thread the backend starts (`boundary`)
  gives back, however it ends, each mutex its thread took during it. So a section never spans a boundary.
- Every wait has a bound: a mutex is waited for at most its `timeout` (MutexTimeout, which a call answers
  as a miss). Sections are short; the longest (attaching the pool) is one Store.open.
- Figures a storage thread adds on every call need no mutex (`Tally`): it appends a record to a deque
  (one C call, atomic under the GIL), and the reader folds them.

The store's thread guards (maru_shm/locking/guard.py) are another family: a store call that fails gives back the
guards of its thread, never the backend's mutexes, which the attaching section holds across Store.open.
"""

from __future__ import annotations

import collections
import functools
import inspect
import threading
from typing import Callable, Iterator, TypeVar

WAIT_S = 30.0  # the longest wait for a mutex; a section lasts microseconds, attaching one Store.open
FOLD_AT = 1024  # records waiting in a Tally that the thread adding one folds itself, if nobody is folding
T = TypeVar("T")


class _Held(threading.local):
    """Per thread, `held`: the mutexes it may hold (always present: a missing attribute costs microseconds)."""

    def __init__(self) -> None:
        self.held: list = []


_local = _Held()


class MutexTimeout(TimeoutError):
    """A mutex of the backend stayed busy for its whole bound; the call answers a miss."""


class Mutex:
    """A thread mutex of the backend, used as `with mutex:`; acquire and release as threading.Lock's, but
    bounded, not re-entrant, and given back by the boundary an exception ends."""

    __slots__ = ("what", "timeout", "_lock", "__weakref__")

    def __init__(self, what: str, timeout: float = WAIT_S):
        self.what = what
        self.timeout = timeout
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the mutex; False if not `blocking` and it is busy (or this thread holds it). Raises
        MutexTimeout past `timeout` seconds (the mutex's own bound when negative)."""
        lock = self._lock
        if lock._is_owned():
            if not blocking:
                return False
            raise RuntimeError(f"{self.what}: already held by this thread")
        bound = self.timeout if timeout < 0 else timeout
        held = _local.held
        held.append(self)  # named before it is taken
        if lock.acquire(True, bound) if blocking else lock.acquire(False):
            return True
        held.remove(self)
        if not blocking:
            return False
        raise MutexTimeout(f"timed out after {bound:g} s waiting for {self.what}")

    def release(self) -> None:
        """Give the mutex back (nothing, if this thread does not hold it)."""
        lock = self._lock
        while lock._is_owned():
            lock.release()
        held = _local.held
        if self in held:
            held.remove(self)

    def __enter__(self) -> "Mutex":
        self.acquire(True, self.timeout)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Mutex {self.what}>"


def _release_since(before: tuple) -> None:
    """Give back every mutex the calling thread took beyond `before` (those it held when the boundary began)."""
    held = _local.held
    for m in list(held):
        if m not in before:
            lock = m._lock
            while lock._is_owned():
                lock.release()
    held[:] = [m for m in held if m in before]


def boundary(fn):
    """A call SGLang makes, or the body of a thread: each mutex its thread took during it is given back when
    it ends, whichever bytecode an exception met. A nested boundary (a call making another, a finalizer the
    collector runs inside a section) leaves the mutexes of the outer one alone."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        before = tuple(_local.held)
        try:
            return fn(*args, **kwargs)
        finally:
            if len(_local.held) != len(before):
                _release_since(before)
    call.is_boundary = True
    return call


def public_calls(cls):
    """Class decorator: every public method defined in the class body is a `boundary`."""
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(fn):
            setattr(cls, name, boundary(fn))
    return cls


def _taken(records: collections.deque) -> Iterator:
    """Every record appended to `records` so far, each given to one taker only (popleft is atomic under the
    GIL): storage threads append their figures without a lock, the reader folds them."""
    while True:
        try:
            yield records.popleft()
        except IndexError:
            return


class Tally:
    """Figures that SGLang's storage threads add to on every call without waiting for anything: `add` appends
    a record (atomic under the GIL); `read(fn)` folds every record added so far through `fold` and returns
    fn(), under the tally's mutex. SGLang reads the figures only with storage metrics on, so a thread that
    finds FOLD_AT records waiting folds them itself, if no other thread is folding: the records stay
    bounded, and no storage thread waits."""

    __slots__ = ("_records", "_mutex", "_fold")

    def __init__(self, what: str, fold: Callable[[tuple], None]):
        self._records: collections.deque = collections.deque()
        self._mutex = Mutex(what)
        self._fold = fold

    def add(self, record: tuple) -> None:
        self._records.append(record)
        if len(self._records) >= FOLD_AT and self._mutex.acquire(blocking=False):
            try:
                self._fold_all()
            finally:
                self._mutex.release()

    def read(self, fn: Callable[[], T]) -> T:
        with self._mutex:
            self._fold_all()
            return fn()

    def _fold_all(self) -> None:
        for record in _taken(self._records):
            self._fold(record)

