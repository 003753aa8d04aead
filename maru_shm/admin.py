"""Administration of a pool as a whole: plan, check, repair, destroy. The CLI's only way in.

Each function takes a path and does one whole job, with the locks and rules it needs, so that no
client rebuilds a protocol (the magic, the PROC lock, the pool's lock file) out of the
store's internals.
"""

from __future__ import annotations

import os
import stat

from .checks.repair import CheckReport, check_store
from .errors import NotAPoolError, PoolInUseError, StoreError
from .format.layout import LOCK_INIT, LOCK_PROC, MAGIC, POOL_UUID_OFF, SUPERBLOCK_SIZE
from .format.geometry import Geometry
from .checks.check import check_live
from .mapping.creation import remove_leftovers
from .locking.lockfile import lock_file_path, missing_error, names_pool, open_lock_file, serves, still_at
from .locking.ofd import take_lock
from .mapping.poolfile import is_device_path
from .checks.view import PoolView
from .checks.figures import processes
from .sizes import parse_size
from .store import Store


def plan_pool(size, **knobs) -> Geometry:
    """The layout a pool of `size` would get with these creation knobs (Store.open's); ValueError if none."""
    knobs = dict(knobs)
    for k in ("max_value", "value_size"):
        if knobs.get(k) is not None:
            knobs[k] = parse_size(knobs[k])
    return Geometry.plan(parse_size(size), **knobs)


def check_pool(path: str, *, timeout: float = 10.0, progress=None) -> CheckReport:
    """Check the pool at `path` while others use it: a read-only mapping, shared locks one domain at a
    time, no process slot. It never writes, and writers keep working while it runs."""
    with PoolView.open(path) as view:
        return check_live(view, timeout=timeout, progress=progress)


def repair_pool(path: str, *, timeout: float = 10.0, progress=None) -> CheckReport:
    """Attach to the pool at `path` (a group pool too), hold every lock, rebuild derived state and report
    what is still wrong."""
    store = Store.open(path, timeout=timeout, mode=0o660)
    try:
        return check_store(store, repair=True, progress=progress)
    finally:
        store.close()


def destroy_pool(path: str, *, force: bool = False, timeout: float = 10.0) -> list[dict]:
    """Remove the pool file at `path` (or zero a DAX device's superblock) and then its lock file; return the
    live processes that were attached (only with `force`: without it, PoolInUseError names them and nothing
    is removed).

    INIT and PROC are held while deciding: opening takes INIT and attaching PROC, so nobody formats or
    attaches between the look and the removal. A damaged pool whose processes cannot be read, or one whose
    lock file is missing or not its own (nobody's liveness can be known), is destroyed only with `force`.
    """
    device = _pool_kind(path)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    lock_fd = None
    try:
        head = os.pread(fd, SUPERBLOCK_SIZE, 0)
        if head[:8] != MAGIC:
            raise NotAPoolError(f"{path} is not a maru-shm pool (wrong magic); refusing to destroy it")
        lock_fd = _own_lock_file(path, device, fd, head, force)
        if lock_fd is not None:
            take_lock(lock_fd, LOCK_INIT, timeout, f"another process to initialise {path} (lock INIT)")
            take_lock(lock_fd, LOCK_PROC, timeout, f"the process-table lock of {path} (lock PROC)")
        alive = _live_processes(path, force)
        if alive and not force:
            who = ", ".join(f"pid {p['pid']} (slot {p['slot']})" for p in alive)
            raise PoolInUseError(f"refusing to destroy {path}: {len(alive)} live process(es) attached: {who}; "
                                 "stop them first or use --force", alive)
        if device:
            os.pwrite(fd, bytes(SUPERBLOCK_SIZE), 0)
            os.fsync(fd)
        elif still_at(fd, path):
            os.unlink(path)
            remove_leftovers(path)  # what creators killed while building left
        else:
            raise StoreError(f"{path} was replaced while it was being destroyed; nothing removed")
        # The lock file goes last: a crash in between leaves a lock file without a pool, which the next
        # creator uses; never a pool without its lock file.
        lock = lock_file_path(path, device)
        if lock_fd is None or still_at(lock_fd, lock):
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
        return alive
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # with INIT and PROC
        os.close(fd)


def _own_lock_file(path: str, device: bool, fd: int, head: bytes, force: bool) -> int | None:
    """The pool's lock file, opened through the checked opener under the rule an opener of the pool's own mode
    applies; None (with `force` only) where it is missing or not the pool's."""
    try:
        lock_fd, _ = open_lock_file(path, device, 0o660 if os.fstat(fd).st_mode & 0o020 else 0o600)
    except StoreError as e:
        if not force:
            raise type(e)(f"{e} (destroy --force removes the pool and its lock file)") from None
        return None
    if serves(lock_fd, head):
        return lock_fd
    copy = names_pool(lock_fd, head[POOL_UUID_OFF:POOL_UUID_OFF + 16])
    os.close(lock_fd)
    if not force:
        raise missing_error(path, device, "is not the file the pool was made with, though it has its bytes (a copy "
                            "or a restore of it)" if copy else "is not the one the pool was made with")
    return None


def remove_pool(path: str) -> None:
    """Remove a regular pool file and its lock file, whatever they hold and whoever maps them: for a scratch
    pool its maker throws away (tests, benchmarks). An operator's way is `destroy_pool`."""
    if is_device_path(path):
        raise StoreError(f"{path} is a device; destroy_pool zeroes a DAX pool's superblock")
    for p in (path, lock_file_path(path, False)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    remove_leftovers(path)


is_device = is_device_path  # (path) -> is it a DAX character device, whose pool destroy_pool wipes instead of removing


def _pool_kind(path: str) -> bool:
    """True for a DAX device, False for a regular file; anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StoreError(f"{path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symlink; give the pool's real path")
    if not stat.S_ISCHR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        raise NotAPoolError(f"{path} is neither a regular file nor a DAX device; not a maru-shm pool")
    return stat.S_ISCHR(st.st_mode)


def _live_processes(path: str, force: bool) -> list[dict]:
    try:
        with PoolView.open(path) as view:
            return [p for p in processes(view) if p["alive"] is not False]  # unknown liveness counts as alive
    except StoreError as e:
        if not force:
            raise type(e)(f"{e} (use --force to destroy a damaged pool)") from None
        return []
