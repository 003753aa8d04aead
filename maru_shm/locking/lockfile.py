"""The lock file: every lock of a pool lives in it, where only those who may write the pool reach it.

An OFD lock needs only read access to its file. With the locks on the pool file, anyone who may read the
pool could take INIT or a section lock and block every writer, or a dead slot's SLOT lock and keep the
slot looking alive. So the locks of every pool, a regular file's or a DAX device's, live in a lock file
whose mode grants read and write to exactly the classes that may write the pool
(`access.lock_file_mode`): a user who may only read the pool cannot open it (BRIEF invariant 10).

Locks belong to an inode: processes locking two lock files of one pool would not exclude each other. So
the creator makes the lock file (before the pool), writes the pool's `pool_uuid` into it and the lock file's
identity (`st_dev`, `st_ino`) into the pool's header under INIT; an opener accepts only the very file
recorded there that names its pool (a copy has the bytes, never the identity), and no opener of a ready
pool makes a new one, except for a pool whose lock file was made in an earlier boot, when no process can
hold a lock on the lost one (FORMAT.md section 3, *The lock file*).
"""

from __future__ import annotations

import errno
import os
import stat
import uuid

from .access import check_lock_file_reach, check_owner, lock_file_mode
from ..errors import LockFileError, PermissionDeniedError, StoreError
from ..format.layout import (HEADER_READY_END, LOCK_FILE_HEAD, LOCK_FILE_MAGIC, LOCK_IDENTITY, LOCK_IDENTITY_OFF,
                             LOCK_INIT, MAGIC, POOL_UUID_OFF, STATE_OFF, STATE_READY, U32)
from .ofd import ofd_trylock, ofd_unlock

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO at the path must not block the open
_boot: bytes | None = None


def lock_file_path(path: str, is_device: bool) -> str:
    """A regular pool's lock file lies beside it (`.<name>.maru-lock`); a DAX device's is in /dev/shm."""
    if is_device:
        return f"/dev/shm/.maru_shm-{os.path.basename(path)}.lock"
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.maru-lock")


def open_lock_file(path: str, is_device: bool, mode: int, *, allow_foreign_owner: bool = False,
                   create: bool = False) -> tuple[int, bool]:
    """(descriptor, made) of the pool's lock file, opened read-write under the opener's owner rule (a
    symlink, anything but a regular file, or a file of a user this opener would not share the pool with is
    refused). `create` makes it (O_EXCL, `lock_file_mode(mode)` whatever the umask) if there is none."""
    lock = lock_file_path(path, is_device)
    made = False
    try:
        if create:
            try:
                fd, made = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, lock_file_mode(mode)), True
            except FileExistsError:
                fd = os.open(lock, os.O_RDWR | _FLAGS)
        else:
            fd = os.open(lock, os.O_RDWR | _FLAGS)
    except FileNotFoundError:
        if create:
            raise StoreError(f"cannot create the lock file {lock} of {path}: its directory does not exist") from None
        raise missing_error(path, is_device, "is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(lock):
            raise PermissionDeniedError(f"lock file {lock} of {path} is a symlink; refusing it") from None
        raise PermissionDeniedError(f"cannot open the lock file {lock} of {path}: {e.strerror}") from None
    try:
        if made:
            os.fchmod(fd, lock_file_mode(mode))  # the umask must not narrow a group pool's lock file
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionDeniedError(f"lock file {lock} of {path} is not a regular file; refusing it")
        check_owner(st, f"lock file {lock} of {path}", allow_foreign_owner, mode)
    except BaseException:
        try:
            if made:
                remove_unused(fd, path, is_device)
        finally:
            os.close(fd)
        raise
    return fd, made


def remove_unused(fd: int, path: str, is_device: bool) -> None:
    """Remove the lock file `fd` is open on, which this process made for a pool it failed to create: only
    holding INIT (no opener is then between taking INIT and using it; one that took it first keeps the file,
    and a waiter finds it gone and starts again), only while it is still at its path and names no ready pool
    at `path` (FORMAT.md section 2, *Creation*)."""
    if not ofd_trylock(fd, LOCK_INIT):
        return  # a creator holds INIT on it: the file is in use
    try:
        lock = lock_file_path(path, is_device)
        if still_at(fd, lock) and not _names_the_ready_pool_at(fd, path):
            os.unlink(lock)
    finally:
        ofd_unlock(fd, LOCK_INIT)


def _names_the_ready_pool_at(fd: int, path: str) -> bool:
    try:
        pool = os.open(path, os.O_RDONLY | _FLAGS)
    except OSError:
        return False
    try:
        head = os.pread(pool, HEADER_READY_END, 0)
    finally:
        os.close(pool)
    return (len(head) == HEADER_READY_END and head[:8] == MAGIC
            and U32.unpack_from(head, STATE_OFF)[0] == STATE_READY
            and names_pool(fd, head[POOL_UUID_OFF:POOL_UUID_OFF + 16]))


_STUCK = ("processes attached to the pool may still hold their locks on the lost one, and an opener locking "
          "another file would not exclude them; stop every process using {path}, then destroy it "
          "(maru-shm destroy --force {path}) and create it again")


def fit_to_pool(fd: int, path: str, is_device: bool, pool_st: os.stat_result) -> None:
    """Give the lock file the reach the pool's mode calls for if it is ours (the pool's owner may have
    changed the pool's mode since), then refuse it if users who may not write the pool can still lock it."""
    lock = lock_file_path(path, is_device)
    st = os.fstat(fd)
    want = lock_file_mode(stat.S_IMODE(pool_st.st_mode))
    if st.st_uid == os.geteuid() and (stat.S_IMODE(st.st_mode) != want or (want & 0o070 and st.st_gid != pool_st.st_gid)):
        try:
            if want & 0o070 and st.st_gid != pool_st.st_gid:
                os.fchown(fd, -1, pool_st.st_gid)
            os.fchmod(fd, want)
        except OSError:
            os.fchmod(fd, 0o600)  # the pool's group cannot be given: writers of the group are refused, readers too
        st = os.fstat(fd)
    check_lock_file_reach(st, pool_st, lock, path)


def open_for_reading(path: str, is_device: bool, head: bytes) -> int | None:
    """A read-only descriptor of the pool's lock file for F_OFD_GETLK (liveness), or None where this user
    cannot open it or it is not the lock file of the pool whose header is `head`: then nobody's liveness is
    known."""
    try:
        fd = os.open(lock_file_path(path, is_device), os.O_RDONLY | _FLAGS)
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode) and serves(fd, head):
        return fd
    os.close(fd)
    return None


def serves(fd: int, head: bytes) -> bool:
    """Is this the lock file of the pool whose superblock is `head`: the file recorded in it (a pool made
    before identities were recorded has none: then its contents alone), naming its pool?"""
    recorded = LOCK_IDENTITY.unpack_from(head, LOCK_IDENTITY_OFF)
    named = names_pool(fd, head[POOL_UUID_OFF:POOL_UUID_OFF + 16])
    return named and (recorded == (0, 0) or identity(fd) == recorded)


def identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of the file `fd` is open on. While any process is attached to a pool, its lock file
    is open, so no other file of that file system, a copy included, can have these numbers."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def names_pool(fd: int, pool_uuid: bytes) -> bool:
    """Do this lock file's contents name the pool with this uuid (made or adopted for it, or a copy of such)?"""
    try:
        return os.pread(fd, LOCK_FILE_HEAD.size, 0) == LOCK_FILE_HEAD.pack(LOCK_FILE_MAGIC, pool_uuid)
    except OSError:
        return False


def name_pool(fd: int, pool_uuid: bytes) -> None:
    """Make this the pool's lock file (holding INIT: its creator, or the adopter of a lock file of an earlier
    boot)."""
    os.pwrite(fd, LOCK_FILE_HEAD.pack(LOCK_FILE_MAGIC, pool_uuid), 0)


def still_at(fd: int, path: str) -> bool:
    """Does `path` still name the file `fd` is open on (not removed, not replaced)?"""
    try:
        st, mine = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def boot_id() -> bytes:
    """This boot's id (16 bytes), or zeros where the kernel does not say: no process of another boot lives."""
    global _boot
    if _boot is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot = uuid.UUID(f.read().strip()).bytes
        except (OSError, ValueError):
            _boot = bytes(16)
    return _boot


def missing_error(path: str, is_device: bool, why: str) -> LockFileError:
    """The error for a ready pool whose lock file is not the one its processes lock."""
    return LockFileError(f"the lock file {lock_file_path(path, is_device)} of {path} {why}: "
                         f"{_STUCK.format(path=path)}")
