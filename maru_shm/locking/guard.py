"""The store's thread mutexes, which an exception never leaves held (FORMAT.md invariant 3).

`with lock:` calls the lock's `__exit__` after the block, on a bytecode of its own: an exception raised
right there (KeyboardInterrupt, a signal handler's) leaves the lock held, and the next thread to take it
waits forever. So every thread mutex of the store is a `guard()`: a re-entrant lock, whose holder can tell
that it holds it. None is held across a public call's boundary, so a public call (or close) that an
exception ends gives back whatever guard its thread still holds (`release_stranded`). A fork()ed child
finds every guard free.
"""

from __future__ import annotations

import os
import threading
import weakref

_GUARDS: "weakref.WeakSet" = weakref.WeakSet()


def guard() -> threading.RLock:
    """A new thread mutex of the store (use as `with g:`)."""
    g = threading.RLock()
    _GUARDS.add(g)
    return g


def release_stranded() -> None:
    """Give back every guard the calling thread holds (an exception is ending the public call that took it)."""
    for g in list(_GUARDS):
        while g._is_owned():
            g.release()


def _free_in_child() -> None:
    """In a fork()ed child only the forking thread lives on: a guard another thread held stays free."""
    for g in list(_GUARDS):
        g._at_fork_reinit()


os.register_at_fork(after_in_child=_free_in_child)
