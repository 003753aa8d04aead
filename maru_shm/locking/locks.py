"""Crash-safe, sharded, timed locks: OFD record locks (ofd.py) plus a dirty record per lock.

The kernel drops a dead holder's OFD lock but cannot say *what* the holder left half done, so each lock
has a record in the pool (`dirty`): set on entry, cleared on a clean exit. The next holder that finds it
set repairs that lock's domain first (LMDB's stale reader check, applied to every critical section).

OFD locks do not exclude threads sharing one description, so each thread
takes section locks on a description of its own (the lock file reopened
through /proc/self/fd): threads of one process then exclude each other
exactly as processes do, and a batch of locks costs one fcntl per run of
consecutive ids, with no per-id thread lock to take and release.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
import weakref

import numpy as np

from .. import crashpoints as _cp
from ..errors import LockTimeout
from .lockwait import wait_for
from ..format.layout import (CLASS_LOCK_BASE, LOCK_CLASSTAB, LOCK_COL_DIRTY, LOCK_COL_OP, LOCK_IDS, LOCK_INIT,
                             LOCK_POOL, LOCK_PROC, LOCK_RECORD, SHARD_LOCK_BASE, SLOT_LOCK_BASE)
from .guard import guard
from .ofd import carries_locks, id_runs, is_span, ofd_trylock, ofd_unlock

_NONE: frozenset = frozenset()


def lock_name(lock_id: int) -> str:
    """Readable name of a lock id, for errors and `inspect`."""
    fixed = {LOCK_INIT: "INIT", LOCK_PROC: "PROC", LOCK_CLASSTAB: "CLASSTAB", LOCK_POOL: "POOL"}
    if lock_id in fixed:
        return fixed[lock_id]
    if lock_id >= SLOT_LOCK_BASE:
        return f"SLOT[{lock_id - SLOT_LOCK_BASE}]"
    if lock_id >= SHARD_LOCK_BASE:
        return f"SHARD[{lock_id - SHARD_LOCK_BASE}]"
    if lock_id >= CLASS_LOCK_BASE:
        return f"CLASS[{lock_id - CLASS_LOCK_BASE}]"
    return f"LOCK[{lock_id}]"


class _ThreadLocks:
    """One thread's lock-file description and the lock ids it holds (dropped with the thread)."""

    __slots__ = ("fd", "held", "__weakref__")

    def __init__(self, fd: int):
        self.fd = fd
        self.held: set[int] = set()


def _forget_thread_fd(table_ref, fd: int) -> None:
    table = table_ref()
    if table is not None:
        table._forget_fd(fd)


class LockTable:
    """All locks of one attached pool, for one process (shared by its threads).

    `fd` is the attachment's description of the lock file: it carries the SLOT
    lock that proves this process alive. Section locks (INIT, PROC, CLASSTAB,
    POOL, CLASS, SHARD) are taken on the calling thread's own description
    (`_thread_fd`), opened on first use and closed when the thread ends or by `close`. A thread never
    takes a lock it already holds (one description would simply hold it twice,
    and the inner release would drop it): that raises RuntimeError.
    """

    def __init__(self, fd: int, mm, off_records: int, timeout: float):
        self.fd = fd
        self.mm = mm
        self.off_records = off_records
        self.timeout = timeout
        self.slot_plus1 = 0  # set once this process has a proc slot
        self.all_held_by = 0  # thread ident of a caller holding every lock (check), which must take none again
        self._local = threading.local()
        self._fds: list[int] = []  # every thread's description, closed by close()
        self._guard = guard()
        self._closed = False
        self._recs = None  # numpy view of the lock records (batch paths), made on first use
        self.timeouts = 0
        carries_locks(self)

    def lock_fds(self) -> list[int]:
        """The attachment's description (SLOT) and every thread's, until close()."""
        return [] if self._closed else [self.fd, *self._fds]

    def _thread_fd(self):
        """(description, ids held) of the calling thread."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            with self._guard:
                if self._closed:
                    raise OSError(errno.EBADF, "lock table is closed")
                fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
                self._fds.append(fd)
            mine = self._local.mine = _ThreadLocks(fd)
            # The thread's local state goes when the thread ends: so does its description (a thread that
            # died holding a lock leaves it dirty, like a dead process; the next holder repairs).
            # The finalizer must not hold the table: a long-lived thread would keep every table (and its
            # mapping's objects) it ever used alive, one per Store.open/close cycle.
            weakref.finalize(mine, _forget_thread_fd, weakref.ref(self), fd).atexit = False
        return mine.fd, mine.held

    def _forget_fd(self, fd: int) -> None:
        """Close a finished thread's description, unless `close` already has (its number may be reused)."""
        with self._guard:
            if fd not in self._fds:
                return
            self._fds.remove(fd)
        try:
            os.close(fd)
        except OSError:
            pass

    def close(self) -> None:
        """Close every thread's description (their locks, none held by now, go with them)."""
        with self._guard:
            self._closed = True
            fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _not_held(self, held: set, ids) -> None:
        again = held.intersection(ids)
        if again:
            raise RuntimeError(f"lock {lock_name(min(again))} is already held by this thread")

    def acquire(self, lock_id: int, *, blocking: bool = True, timeout: float | None = None) -> bool | None:
        """Take the lock; return True if its previous holder left it dirty, None if not blocking and busy.

        Raises LockTimeout when a blocking wait exceeds the timeout. Whatever raises in here (a timeout,
        KeyboardInterrupt) leaves the lock not held.
        """
        fd, held = self._thread_fd()
        if lock_id in held:
            self._not_held(held, (lock_id,))
        return self._take(fd, held, lock_id, blocking, timeout)

    def _take(self, fd: int, held: set, lock_id: int, blocking: bool, timeout: float | None) -> bool | None:
        """acquire, for a lock this thread does not hold. `held` names the lock before the fcntl that takes
        it, so it names every lock the thread's description may hold at every bytecode; on any exception the
        lock is given back (unlocking a lock not taken is harmless) and its record left as it is."""
        try:
            held.add(lock_id)
            timeout = self.timeout if timeout is None else timeout
            if self._take_ofd(fd, lock_id, 1, time.monotonic() + timeout, timeout, blocking):
                return self._mark(lock_id)
            held.discard(lock_id)
            return None
        except BaseException:
            self._drop(fd, held, [lock_id])
            raise

    def _drop(self, fd: int, held: set, ids) -> None:
        """Unlock sorted ids on this thread's description and forget them, records untouched: a marked
        record stays dirty (its next holder repairs: extra work, never a wrong repair), a clean one stays
        clean (a section that finished, or a take cut short before it marked). Unlocking an id not held is
        a no-op, so this is safe after an exception anywhere in a take or a release."""
        for first, n in id_runs(ids):
            ofd_unlock(fd, first, n)
        held.difference_update(ids)

    def _take_ofd(self, fd: int, lock_id: int, n: int, deadline: float, timeout: float,
                  blocking: bool = True) -> bool:
        """OFD-lock ids lock_id .. lock_id+n-1 (all or none per attempt), waiting until `deadline` (lockwait)."""
        if ofd_trylock(fd, lock_id, n):
            return True
        if not blocking:
            return False
        try:
            wait_for(functools.partial(ofd_trylock, fd, lock_id, n), deadline, timeout,
                     lambda: self._waited_for(lock_id))
        except LockTimeout:
            self.timeouts += 1
            raise
        return True

    def _mark(self, lock_id: int) -> bool:
        """Just acquired: note whether the last holder left the section dirty, then mark it ours."""
        holder = 0
        if lock_id < LOCK_IDS:
            off = self.off_records + lock_id * LOCK_RECORD.size
            holder, _ = LOCK_RECORD.unpack_from(self.mm, off)
            LOCK_RECORD.pack_into(self.mm, off, self.slot_plus1 or 0xFFFFFFFF, 0)
        if _cp.ARMED is not None:
            _cp.hit_lock(lock_name(lock_id).partition("[")[0])
        return holder != 0

    def release(self, lock_id: int, *, clean: bool = True) -> None:
        """Release; with clean=False the dirty mark stays so the next holder repairs.

        The record is cleared before the unlock (the next holder must not see our mark) and `held`
        forgets the lock only after it (it names every lock the description may hold); an exception in
        between still unlocks.
        """
        fd, held = self._thread_fd()
        try:
            if clean and lock_id < LOCK_IDS:
                LOCK_RECORD.pack_into(self.mm, self.off_records + lock_id * LOCK_RECORD.size, 0, 0)
            ofd_unlock(fd, lock_id)
            held.discard(lock_id)
        except BaseException:
            self._drop(fd, held, [lock_id])
            raise

    def acquire_many(self, lock_ids, timeout: float | None = None, *, ordered: bool = False) -> list[int]:
        """Take several locks of one family in ascending id order; return the ids left dirty.

        Runs of consecutive ids are taken with one fcntl call each (all or none),
        so a batch touching most index shards pays a handful of system calls,
        not two per shard (one, if it asks for a whole range: `dense_range`). Ascending order is the lock order between ids of a
        family, so two batch holders never deadlock. All or nothing: on a
        timeout every lock already taken is released (clean: nothing was done
        under them yet) and LockTimeout propagates. `ordered`: the ids are already
        distinct and ascending.
        """
        ids = lock_ids if ordered else sorted(set(lock_ids))
        if ids and (ids[0] < 0 or ids[-1] >= LOCK_IDS):
            raise ValueError("acquire_many takes lock ids that have records")
        if len(ids) == 1:  # the common single-key case: no numpy over the records
            return ids if self.acquire(ids[0], timeout=timeout) else []
        fd, held = self._thread_fd()
        self._not_held(held, ids)
        return self._take_many(fd, held, ids, timeout)

    def _take_many(self, fd: int, held: set, ids: list[int], timeout: float | None) -> list[int]:
        """acquire_many, for sorted ids (more than one) this thread does not hold; as `_take`, `held` names
        them all before the first fcntl and every exception gives back all of them."""
        try:
            held.update(ids)
            timeout = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + timeout
            for first, n in id_runs(ids):
                self._take_ofd(fd, first, n, deadline, timeout)
            return self._mark_many(ids)
        except BaseException:
            self._drop(fd, held, ids)
            raise

    def _mark_many(self, ids: list[int]) -> list[int]:
        """_mark for a batch: the ids left dirty, then every record marked ours."""
        recs = self._records()
        if is_span(ids):  # slices, not gathers
            a, b = ids[0], ids[-1] + 1
            dirty = (np.flatnonzero(recs[a:b, 0]) + a).tolist()
            recs[a:b] = (self.slot_plus1 or 0xFFFFFFFF, 0)
        else:
            idx = np.asarray(ids, dtype=np.int64)
            dirty = idx[recs[idx, LOCK_COL_DIRTY] != 0].tolist()
            recs[idx, LOCK_COL_DIRTY] = self.slot_plus1 or 0xFFFFFFFF
            recs[idx, LOCK_COL_OP] = 0
        if _cp.ARMED is not None:
            _cp.hit_lock(lock_name(ids[0]).partition("[")[0])
        return dirty

    def _records(self) -> np.ndarray:
        """All lock records as an (ids, 2) u32 array of (dirty, op) over the mapping (batch paths)."""
        recs = self._recs
        if recs is None:
            recs = self._recs = np.ndarray((LOCK_IDS, LOCK_RECORD.size // 4), dtype="<u4", buffer=self.mm,
                                           offset=self.off_records)
        return recs

    def release_views(self) -> None:
        """Drop the numpy view of the records so the mapping can be closed."""
        self._recs = None

    def release_many(self, lock_ids, *, clean: bool = True, ordered: bool = False) -> None:
        """Release locks taken by acquire_many; with clean=False their dirty marks stay."""
        ids = lock_ids if ordered else sorted(set(lock_ids))
        if len(ids) == 1:
            self.release(ids[0], clean=clean)
            return
        fd, held = self._thread_fd()
        try:
            if clean:
                if is_span(ids):
                    self._records()[ids[0]:ids[-1] + 1, LOCK_COL_DIRTY] = 0
                else:
                    self._records()[np.asarray(ids, dtype=np.int64), LOCK_COL_DIRTY] = 0
            for first, n in id_runs(ids):
                ofd_unlock(fd, first, n)
            held.difference_update(ids)
        except BaseException:
            self._drop(fd, held, ids)
            raise

    def marked_by_this_process(self) -> list[int]:
        """Ids whose record carries this process's mark: held now by one of its threads, or left dirty by a
        section of it that did not finish."""
        recs = self._records()
        return np.flatnonzero(recs[:, LOCK_COL_DIRTY] == (self.slot_plus1 or 0xFFFFFFFF)).tolist()

    def held_now(self) -> frozenset:
        """The lock ids the calling thread holds (or is taking or releasing) now: a public call's entry
        notes them, and `release_stranded` gives back the others if an exception ends the call."""
        mine = getattr(self._local, "mine", None)
        return frozenset(mine.held) if mine is not None and mine.held else _NONE

    def release_stranded(self, before: frozenset) -> None:
        """Give back what the calling thread holds beyond `before`, leaving the records (dirty ones get
        repaired), and end a `holds_all` the call began.

        The sections give back their locks on every exception, except one that lands before their own
        code can run: at the first bytecode of a `__exit__` or of a release, or in check()'s `finally`
        (KeyboardInterrupt, an exception from a signal handler). The public call it ends runs this on
        its way out (calls.py `public_call`), so no lock outlives the call and the thread can take it again.
        """
        if not before and self.all_held_by == threading.get_ident():
            self.all_held_by = 0
        mine = getattr(self._local, "mine", None)
        if mine is None or self._closed or mine.held <= before:
            return
        self._drop(mine.fd, mine.held, sorted(mine.held - before))

    def hold_many(self, lock_ids, repair_for=None, timeout: float | None = None) -> "_HeldMany":
        """Context manager over acquire_many: `repair_for(id)` runs for each id left dirty, then release_many.

        An exception inside the block leaves every dirty mark set, as a crash would.
        """
        return _HeldMany(self, lock_ids, repair_for, timeout)

    def holds_all(self) -> bool:
        """Does the calling thread hold every lock (check(repair=True))? Then it must not take one again:
        locks are not re-entrant."""
        return self.all_held_by == threading.get_ident()

    def hold(self, lock_id: int, repair=None, timeout: float | None = None) -> "_Held":
        """Context manager: acquire, run `repair()` if the last holder died inside, release.

        An exception inside the block leaves the dirty mark set, as a crash would.
        """
        return _Held(self, lock_id, repair, timeout)

    def _waited_for(self, lock_id: int) -> str:
        """What a timed-out wait waited for, for its LockTimeout."""
        holder = 0
        if lock_id < LOCK_IDS:
            holder, _ = LOCK_RECORD.unpack_from(self.mm, self.off_records + lock_id * LOCK_RECORD.size)
        who = f" (held by process slot {holder - 1})" if 0 < holder < 0xFFFFFFFF else ""
        return (f"lock {lock_name(lock_id)}{who}; a holder may be stopped or very slow; raise the timeout or "
                "inspect the pool")


class _Held:
    """One critical section of LockTable.hold (a class, not a generator: it sits on every write path)."""

    __slots__ = ("table", "lock_id", "repair", "timeout")

    def __init__(self, table: LockTable, lock_id: int, repair, timeout):
        self.table, self.lock_id, self.repair, self.timeout = table, lock_id, repair, timeout

    def __enter__(self) -> bool:
        # Taken inside the try, so that an exception between the fcntl and the `with` body (which
        # `__exit__` would not see) gives the lock back; checked outside it, so that a lock this thread
        # already held is never given back here.
        table, lock_id = self.table, self.lock_id
        fd, held = table._thread_fd()
        if lock_id in held:
            table._not_held(held, (lock_id,))
        try:
            dirty = table._take(fd, held, lock_id, True, self.timeout)
            if dirty and self.repair is not None:
                self.repair()
            return dirty
        except BaseException:
            table._drop(fd, held, [lock_id])
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.table.release(self.lock_id, clean=exc_type is None)
        return False


class _HeldMany:
    """The critical section of LockTable.hold_many: several locks of one family, taken together."""

    __slots__ = ("table", "lock_ids", "repair_for", "timeout")

    def __init__(self, table: LockTable, lock_ids, repair_for, timeout):
        self.table, self.repair_for, self.timeout = table, repair_for, timeout
        self.lock_ids = lock_ids if len(lock_ids) == 1 else sorted(set(lock_ids))  # (acquire_many takes one id alone)

    def __enter__(self) -> list[int]:
        ids, table = self.lock_ids, self.table
        if ids and (ids[0] < 0 or ids[-1] >= LOCK_IDS):
            raise ValueError("hold_many takes lock ids that have records")
        fd, held = table._thread_fd()
        table._not_held(held, ids)
        try:  # as _Held.__enter__
            if len(ids) == 1:
                dirty = ids if table._take(fd, held, ids[0], True, self.timeout) else []
            else:
                dirty = table._take_many(fd, held, ids, self.timeout)
            if dirty and self.repair_for is not None:
                for i in dirty:
                    self.repair_for(i)
            return dirty
        except BaseException:
            table._drop(fd, held, ids)
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.table.release_many(self.lock_ids, clean=exc_type is None, ordered=True)
        return False
