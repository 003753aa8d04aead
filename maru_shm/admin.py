"""Administration of a pool as a whole: plan, check, repair, destroy. The CLI's only way in.

Each function takes a path and does one whole job, with the locks and rules it needs, so that no
client rebuilds a protocol (the magic, the PROC lock, the side lock of a DAX device) out of the
store's internals.
"""

from __future__ import annotations

import os
import stat

from .check import CheckReport, check_store
from .errors import NotAPoolError, PoolInUseError, StoreError
from .format import LOCK_PROC, MAGIC, SUPERBLOCK_SIZE, Geometry
from .livecheck import check_live
from .locks import ofd_unlock, take_lock
from .poolfile import is_device_path, open_side_lock
from .poolview import PoolView, processes
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
    """Remove the pool file at `path` (or zero a DAX device's superblock); return the live processes that
    were attached (only with `force`: without it, PoolInUseError names them and nothing is removed).

    PROC is held while deciding: attaching takes it, so nobody can attach between the look and the
    removal. A damaged pool whose processes cannot be read is destroyed only with `force`.
    """
    device = _pool_kind(path)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    lock_fd = fd
    try:
        if os.pread(fd, 8, 0) != MAGIC:
            raise NotAPoolError(f"{path} is not a maru-shm pool (wrong magic); refusing to destroy it")
        if device:  # the lock file under the rule an opener of the device's own mode applies
            lock_fd = open_side_lock(path, 0o660 if os.fstat(fd).st_mode & 0o020 else 0o600)
        take_lock(lock_fd, LOCK_PROC, timeout, f"the process-table lock of {path} (lock PROC)")
        try:
            alive = _live_processes(path, force)
            if alive and not force:
                who = ", ".join(f"pid {p['pid']} (slot {p['slot']})" for p in alive)
                raise PoolInUseError(f"refusing to destroy {path}: {len(alive)} live process(es) attached: {who}; "
                                     "stop them first or use --force", alive)
            if device:
                os.pwrite(fd, bytes(SUPERBLOCK_SIZE), 0)
                os.fsync(fd)
            else:
                os.unlink(path)
            return alive
        finally:
            ofd_unlock(lock_fd, LOCK_PROC)
    finally:
        if lock_fd != fd:
            os.close(lock_fd)
        os.close(fd)


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
            return [p for p in processes(view) if p["alive"]]
    except StoreError as e:
        if not force:
            raise type(e)(f"{e} (use --force to destroy a damaged pool)") from None
        return []
