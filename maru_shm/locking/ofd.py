"""OFD record locks on a pool's lock file: one fcntl per run of consecutive lock ids.

An OFD lock (`F_OFD_SETLK`) belongs to an open file description, so the kernel drops it when its holder
dies, whatever the holder was doing. The calls here take, release and probe such locks, all or none per
run of ids; locks.py builds the lock table (dirty records, threads, lock order) on them. A fork()ed child
must not keep copies of the descriptions that carry them (`carries_locks`).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import struct
import weakref

from ..format.layout import LOCK_BASE
from .lockwait import acquire as wait_acquire

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64/aarch64
# Whatever holds open descriptions that may carry this process's OFD locks (`lock_fds()`): a LockTable,
# the live check's read locks. A fork()ed child drops its copies of them (_drop_lock_descriptions_in_child).
_CARRIERS: "weakref.WeakSet" = weakref.WeakSet()
_F_RDLCK, _F_WRLCK, _F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK


def carries_locks(carrier) -> None:
    """Register an object whose `lock_fds()` names open descriptions that may carry our OFD locks."""
    _CARRIERS.add(carrier)


def _drop_lock_descriptions_in_child() -> None:
    """After fork(), in the child: its copy of every description that may carry the parent's OFD locks is
    replaced by /dev/null. An OFD lock belongs to its description, which lives while any process holds a
    descriptor of it: a child holding copies would keep the parent's locks and SLOT (so its liveness) after
    the parent died. The numbers stay open, so the child's close() finds what it expects, and the parent's
    descriptors are not touched."""
    fds = [fd for carrier in list(_CARRIERS) for fd in carrier.lock_fds()]
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in fds:
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_drop_lock_descriptions_in_child)


def flock_bytes(kind: int, lock_id: int, n: int = 1) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, LOCK_BASE + lock_id, n, 0)


def ofd_trylock(fd: int, lock_id: int, n: int = 1, *, shared: bool = False) -> bool:
    """Take OFD locks lock_id .. lock_id+n-1 without waiting, all or none (one fcntl call); `shared` takes
    read locks (F_RDLCK), which exclude only write locks.

    False if another description holds any of them in a conflicting mode.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock_bytes(_F_RDLCK if shared else _F_WRLCK, lock_id, n))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def ofd_unlock(fd: int, lock_id: int, n: int = 1) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock_bytes(_F_UNLCK, lock_id, n))


def take_lock(fd: int, lock_id: int, timeout: float, what, *, shared: bool = False) -> None:
    """Take one OFD lock on `fd`, waiting at most `timeout` seconds (lockwait: one backoff, LockTimeout),
    for a caller without a LockTable (opening a pool, destroying one, the live check)."""
    wait_acquire(functools.partial(ofd_trylock, fd, lock_id, shared=shared), timeout, what)


def is_span(ids) -> bool:
    """Are these sorted distinct ids consecutive (one run, its records one slice)?"""
    return bool(ids) and ids[-1] - ids[0] + 1 == len(ids)


def id_runs(ids) -> list[tuple[int, int]]:
    """Sorted distinct lock ids as (first, count) runs of consecutive ids."""
    if is_span(ids):  # a dense batch's whole range (dense_range): no pass over the ids
        return [(ids[0], len(ids))]
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(a, n) for a, n in runs]


def ofd_is_held(fd: int, lock_id: int) -> bool:
    """True if some other open file description holds the lock (does not take it)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, flock_bytes(_F_WRLCK, lock_id))
    return _FLOCK.unpack(res)[0] != _F_UNLCK


def dense_range(ids) -> list[int]:
    """The ids sorted and distinct, or every id from the first to the last if they are at least half of that range.

    A batch that touches most index shards then takes (and releases) them with one
    fcntl call each way, and marks their records with one slice; the few ids in between
    that it did not need are held for as long (a dirty one is repaired, as any).
    """
    if len(ids) == 1:
        return ids
    ids = sorted(set(ids))
    if len(ids) > 2 and 2 * len(ids) >= ids[-1] - ids[0] + 1:
        return list(range(ids[0], ids[-1] + 1))
    return ids
