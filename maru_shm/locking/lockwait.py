"""Waiting for a lock: try, back off, give up at a deadline with the one error, LockTimeout.

Every timed lock wait of the store goes through `acquire` (or `wait_for`, after a first try of its
own), as filelock's BaseFileLock.acquire does: try the lock; if it is busy and time is left, wait and try
again; past the deadline raise. Critical sections last tens of microseconds and the shortest sleep Linux
grants is ~60 us (timer slack), so a waiter first yields the CPU a few times (the holder may be waiting
for it), then sleeps, doubling from 20 us up to 1 ms.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from ..errors import LockTimeout

YIELDS = 16  # sched_yield rounds before a waiter starts sleeping
FIRST_SLEEP = 20e-6
LONGEST_SLEEP = 1e-3
MAX_TIMEOUT = 86400.0  # s: the longest lock wait a Store accepts


def acquire(try_lock: Callable[[], bool], timeout: float, what, *, blocking: bool = True,
            deadline: float | None = None) -> bool:
    """Take a lock with `try_lock()` (True when taken, False when busy), waiting at most `timeout` seconds
    (or until the monotonic `deadline`, for a wait shared by several locks).

    Returns False only when not `blocking` and the lock is busy. Raises LockTimeout naming `what` (a string,
    or a function returning one, called only on a timeout).
    """
    if try_lock():
        return True
    if not blocking:
        return False
    wait_for(try_lock, time.monotonic() + timeout if deadline is None else deadline, timeout, what)
    return True


def wait_for(try_lock: Callable[[], bool], deadline: float, timeout: float, what) -> None:
    """The waiting half of `acquire`, for a caller that made its first try itself (a hot path)."""
    delay = FIRST_SLEEP
    yields = YIELDS
    while not try_lock():
        if yields:
            yields -= 1
            os.sched_yield()
            continue
        now = time.monotonic()
        if now >= deadline:
            raise LockTimeout(f"timed out after {timeout:.3g}s waiting for {what() if callable(what) else what}")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, LONGEST_SLEEP)


def check_timeout(timeout) -> float:
    """A lock wait limit: a positive, finite number of seconds, at most a day (NaN or inf would wait forever)."""
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}") from None
    if not (0 < t <= MAX_TIMEOUT):  # also false for NaN
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT:g}] seconds, got {timeout!r}")
    return t
