"""Opening and mapping the one file that is the pool, and creating it through creation.py.

Regular files (normally under /dev/shm) are built as a new file and published (creation.py); DAX character
devices are used at their own size, read from sysfs, with 2 MiB alignment. The locks of both live in the
pool's lock file (lockfile.py). Exactly one of several racing creators creates or formats the pool: whoever
holds the INIT lock and finds no pool, or an unfinished one.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time

from .. import crashpoints as _cp
from ..locking.access import check_mode, check_owner
from ..errors import (LockFileError, NotAPoolError, PermissionDeniedError, SizeMismatchError, StoreError,
                      TruncatedPoolError, VersionError)
from .creation import build_pool, format_pool, free_space
from ..format.layout import (FLAG_DEVICE, HEADER_READY_END, LOCK_BOOT_OFF, LOCK_IDENTITY, LOCK_IDENTITY_OFF,
                             LOCK_INIT, MAGIC, POOL_UUID_OFF, STATE_OFF, STATE_READY, SUPERBLOCK_SIZE, U32)
from ..format.geometry import Geometry
from ..locking.lockfile import (boot_id, fit_to_pool, identity, lock_file_path, missing_error, name_pool, names_pool,
                                open_lock_file, remove_unused, serves, still_at)
from ..locking.ofd import ofd_unlock, take_lock
from ..sizes import format_size

DAX_ALIGN = 2 << 20


def dax_size(path: str, sysfs_root: str = "/sys") -> int:
    """Size in bytes of a /dev/daxN.M device, from /sys/bus/dax/devices/daxN.M/size."""
    name = os.path.basename(path)
    for candidate in (f"{sysfs_root}/bus/dax/devices/{name}/size", f"{sysfs_root}/class/dax/{name}/size"):
        try:
            with open(candidate) as f:
                return int(f.read().strip(), 0)
        except (OSError, ValueError):
            continue
    raise StoreError(f"cannot read the size of DAX device {path} from sysfs ({sysfs_root}/bus/dax/devices/{name}/size)")


def is_device_path(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


class PoolFile:
    """An open, mapped pool file: fd, lock fd, mmap, geometry.

    The lock fd is the pool's lock file (lockfile.py), never a description the mapping holds: the kernel
    drops an OFD lock with the last reference to its description, and a mapping (this process's, or a
    fork()ed child's copy of it) holds one too.
    """

    def __init__(self, fd: int, lock_fd: int, mm: mmap.mmap, geo: Geometry, path: str, is_device: bool,
                 created: bool):
        self.fd, self.lock_fd, self.mm, self.geo = fd, lock_fd, mm, geo
        self.path, self.is_device, self.created = path, is_device, created

    def close(self, unmap: bool = True) -> None:
        """Unmap (unless not `unmap`) and close the descriptors. Idempotent: a number is forgotten before it
        is closed, so a second close (after one an exception cut short) never closes a descriptor reused since."""
        try:
            if unmap:
                self.mm.close()
        finally:
            try:
                lock_fd, self.lock_fd = self.lock_fd, -1
                if lock_fd != -1:
                    os.close(lock_fd)
            finally:
                fd, self.fd = self.fd, -1
                if fd != -1:
                    os.close(fd)


_MISSING_HINT = "; create it with Store.open(path, size=..., create=True) or `maru-shm create`"


def open_existing(path: str, flags: int, missing_hint: str = "") -> int:
    """os.open of an existing pool, turning OS errors into StoreError subclasses that name the problem.

    O_NONBLOCK: opening a FIFO read-only would wait for a writer forever; the caller refuses anything
    that is neither a regular file nor a character device right after (O_NONBLOCK changes nothing for
    the reads and mappings of those).
    """
    try:
        return os.open(path, flags | os.O_NONBLOCK)
    except OSError as e:
        _raise_open_error(path, e, missing_hint)


_EMPTY_PATH = "the pool path is empty; give a file path such as /dev/shm/maru_shm"


def _raise_open_error(path: str, e: OSError, missing_hint: str):
    if not path:
        raise StoreError(_EMPTY_PATH) from None
    if e.errno == errno.ENOENT:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise StoreError(f"cannot open {path}: directory {parent} does not exist") from None
        raise StoreError(f"{path} does not exist{missing_hint}") from None
    if e.errno == errno.ELOOP or os.path.islink(path):  # O_NOFOLLOW met a symlink (even one swapped in late)
        raise PermissionDeniedError(f"{path} is a symlink; open the pool by its real path") from None
    if e.errno in (errno.EACCES, errno.EPERM):
        raise PermissionDeniedError(f"cannot open {path}: {e.strerror}") from None
    raise StoreError(f"cannot open {path}: {e.strerror}") from None


def open_pool_file(path: str, *, size: int | None, create: bool, mode: int, timeout: float,
                   allow_foreign_owner: bool, plan_kwargs: dict) -> PoolFile:
    """Open (and if asked, create and initialise) the pool at `path` and map it.

    Creation is one protocol across the lock file and the pool file (creation.py): a pool file never exists
    without its lock file, and INIT, held on the lock file, decides who creates or formats, and that the lock
    file is the one the pool was made with. A look that a racing creator or `destroy` made stale (a file
    removed or replaced before INIT was ours) starts again, within `timeout`.
    """
    if not path:
        raise StoreError(_EMPTY_PATH)
    if os.path.islink(path):
        raise PermissionDeniedError(f"{path} is a symlink; open the pool by its real path")
    if create:
        check_mode(mode)
    is_device = is_device_path(path)
    if is_device:
        dax_size(path)  # a character device that is not DAX (/dev/null) is refused before its lock file is made
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _open_once(path, size, create, mode, deadline, timeout, allow_foreign_owner, plan_kwargs,
                              is_device)
        except _Stale as e:
            if time.monotonic() > deadline:
                raise StoreError(f"{e} while it was being opened, for {timeout:g} s; retry") from None
        time.sleep(0.005)


class _Stale(Exception):
    """The pool file or the lock file was removed or replaced between the look and INIT: look again."""


def _open_once(path: str, size: int | None, create: bool, mode: int, deadline: float, timeout: float,
               allow_foreign_owner: bool, plan_kwargs: dict, is_device: bool) -> PoolFile:
    lock_path = lock_file_path(path, is_device)
    fd, created, lock_fd, lock_made, ok = -1, False, -1, False, False
    try:
        fd = _open_if_there(path)
        if fd != -1:  # the pool's own rules first: what is refused is named as the pool
            st = _checked(fd, path, is_device, allow_foreign_owner, mode)
        elif not create:
            open_existing(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, missing_hint=_MISSING_HINT)
        try:
            lock_fd, lock_made = open_lock_file(path, is_device, mode, allow_foreign_owner=allow_foreign_owner,
                                                create=create)
        except LockFileError:
            _refuse_without_lock_file(fd, path)
            raise
        if _cp.ARMED is not None and lock_made:
            _cp.hit("create.lock_file")
        if fd != -1:
            fit_to_pool(lock_fd, path, is_device, st)
        while True:
            take_lock(lock_fd, LOCK_INIT, timeout, f"another process to initialise {path} (lock INIT)")
            if _cp.ARMED is not None:
                _cp.hit_lock("INIT")
            try:
                if not still_at(lock_fd, lock_path):
                    raise _Stale(f"the lock file {lock_path} of {path} was removed or replaced")
                if fd != -1 and not (is_device or still_at(fd, path)):
                    raise _Stale(f"{path} was removed or replaced")
                if fd == -1:
                    fd = _open_if_there(path)  # a creator published it while this one waited for INIT
                    if fd != -1:
                        fit_to_pool(lock_fd, path, is_device, _checked(fd, path, is_device, allow_foreign_owner,
                                                                       mode))
                if fd == -1:
                    try:
                        fd, geo = build_pool(path, lock_fd, size, mode, plan_kwargs,
                                             lambda st: fit_to_pool(lock_fd, path, is_device, st))
                    except FileExistsError:
                        raise _Stale(f"a file appeared at {path}") from None
                    except OSError as e:
                        _raise_open_error(path, e, "")
                    created = True
                else:
                    geo = _initialise_or_read(fd, lock_fd, path, is_device, size, create, plan_kwargs)
                break
            except _NotReady as e:
                if time.monotonic() > deadline:
                    raise NotAPoolError(str(e)) from None
            finally:
                ofd_unlock(lock_fd, LOCK_INIT)
            time.sleep(0.005)  # an empty file: a creator of another version may be between making it and INIT
        if not is_device:
            ensure_backed(fd, path, geo.file_size)
        mm = mmap.mmap(fd, geo.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # The header may have been rewritten by a racing creator between read and map: re-read.
        geo2 = Geometry.read(mm, geo.file_size)
        if geo2 != geo:
            mm.close()
            raise StoreError(f"{path} changed while it was being opened; retry")
        ok = True
        return PoolFile(fd, lock_fd, mm, geo, path, is_device, created)
    finally:
        if not ok:
            try:
                if lock_made:  # what this opener made and could not make a pool's: never another's
                    remove_unused(lock_fd, path, is_device)
            finally:
                if lock_fd != -1:
                    os.close(lock_fd)
                if fd != -1:
                    os.close(fd)


def _open_if_there(path: str) -> int:
    """The pool file opened read-write, or -1 where there is none yet."""
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return -1
    except OSError as e:
        _raise_open_error(path, e, "")


def _checked(fd: int, path: str, is_device: bool, allow_foreign_owner: bool, mode: int) -> os.stat_result:
    """The pool file's stat, once it is a regular file or the DAX device looked at, passing the owner rule."""
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode) != is_device or not (is_device or stat.S_ISREG(st.st_mode)):
        raise NotAPoolError(f"{path} is neither a regular file nor a DAX device" if not stat.S_ISCHR(st.st_mode)
                            else f"{path} changed while it was being opened; retry")
    check_owner(st, path, allow_foreign_owner, mode)
    return st


def _refuse_without_lock_file(fd: int, path: str) -> None:
    """An opener without create=True found no lock file: say first what is wrong with the pool itself, if
    anything (not a ready pool; a ready pool of another format version, whose version field never changes,
    so it is read without INIT). A ready pool of ours without its lock file is the caller's LockFileError."""
    head = os.pread(fd, STATE_OFF + 4, 0)
    if len(head) < STATE_OFF + 4 or head[:8] != MAGIC or U32.unpack_from(head, STATE_OFF)[0] != STATE_READY:
        raise _unready(path, head)
    try:
        Geometry.read(head, 1 << 62)
    except VersionError:
        raise
    except StoreError:
        pass


class _NotReady(Exception):
    pass


def _unready(path: str, head: bytes) -> NotAPoolError:
    """Why a file that is not a ready pool cannot be opened without create=True."""
    if not head:
        return NotAPoolError(f"{path} is an empty file, not an initialised maru-shm pool; open it with create=True "
                             "and a size to make it one")
    if head[:8] == MAGIC:
        return NotAPoolError(f"{path} is a maru-shm pool whose creator died while formatting it; open it with "
                             "create=True (as MaruStorage does) to format it again")
    return NotAPoolError(f"{path} is not a maru-shm pool (wrong magic); refusing to touch it")


def _initialise_or_read(fd: int, lock_fd: int, path: str, is_device: bool, size: int | None, create: bool,
                        plan_kwargs: dict) -> Geometry:
    """Holding INIT: read a ready pool, or initialise an empty/unfinished one if `create`.

    A creator formats while holding INIT, so a header of ours that is not READY, seen under INIT, was
    left by a creator that died (or failed) while formatting: the next create=True opener formats it
    again. A regular file is formatted only if it is empty or such a header; a DAX device (never empty)
    also when its first page is all zero. Anything else is someone's data and is refused.
    """
    actual = dax_size(path) if is_device else os.fstat(fd).st_size
    head = os.pread(fd, min(actual, SUPERBLOCK_SIZE), 0) if actual else b""
    ready = len(head) >= HEADER_READY_END and head[:8] == MAGIC and U32.unpack_from(head, STATE_OFF)[0] == STATE_READY
    if ready:
        geo = Geometry.read(head, actual)
        if size is not None and size != geo.file_size and not is_device:
            raise SizeMismatchError(
                f"{path} is an existing pool of {geo.file_size} bytes, but size={size} was asked for; "
                "omit size to open it as it is, or destroy and recreate it")
        _match_lock_file(fd, lock_fd, path, is_device, head, create)
        return geo
    unfinished = head[:8] == MAGIC
    formattable = actual == 0 or unfinished or (is_device and not any(head))
    if not create:
        error = _unready(path, head)
        raise _NotReady(str(error)) if actual == 0 else error
    if not formattable:
        what = "is not empty" if not any(head) else "is not a maru-shm pool (wrong magic)"
        raise NotAPoolError(f"{path} exists and {what}; refusing to overwrite it (only an empty file or a "
                            "pool whose creator died while formatting it is formatted)")
    if is_device:
        file_size = actual
        plan_kwargs = dict(plan_kwargs, data_align=DAX_ALIGN, flags=FLAG_DEVICE | plan_kwargs.get("flags", 0))
    elif size is None:
        raise StoreError(f"creating {path} needs a size (e.g. size='4G')")
    else:
        file_size = size
    return format_pool(fd, path, lock_fd, file_size, is_device, plan_kwargs)


def _match_lock_file(fd: int, lock_fd: int, path: str, is_device: bool, head: bytes, create: bool) -> None:
    """Holding INIT on a ready pool: the lock file must be the very file the pool was made with (its identity
    recorded in the header, its contents naming the pool), else an opener would lock another file than the
    pool's processes. A pool made before identities were recorded gets its lock file's now. One made in an
    earlier boot is adopted by an opener with `create` (no process of that boot lives to hold a lock on the
    lost one)."""
    if serves(lock_fd, head):
        if LOCK_IDENTITY.unpack_from(head, LOCK_IDENTITY_OFF) == (0, 0):
            os.pwrite(fd, LOCK_IDENTITY.pack(*identity(lock_fd)), LOCK_IDENTITY_OFF)
        return
    now = boot_id()
    if create and any(now) and head[LOCK_BOOT_OFF:LOCK_BOOT_OFF + 16] != now:
        name_pool(lock_fd, head[POOL_UUID_OFF:POOL_UUID_OFF + 16])
        os.pwrite(fd, LOCK_IDENTITY.pack(*identity(lock_fd)), LOCK_IDENTITY_OFF)
        os.pwrite(fd, now, LOCK_BOOT_OFF)  # last: an adoption cut short is done again
        return
    if names_pool(lock_fd, head[POOL_UUID_OFF:POOL_UUID_OFF + 16]):
        raise missing_error(path, is_device, "is not the file the pool was made with, though it has its bytes (a "
                            "copy or a restore of it)")
    raise missing_error(path, is_device, "was removed or replaced while the pool may be in use"
                        if create else "is not the one the pool was made with")


def ensure_backed(fd: int, path: str, file_size: int) -> None:
    """Every page of an existing pool file must be allocated before it is mapped: a sparse pool (made by
    `truncate -s`, or by a version that did not allocate) on a file system that fills up would deliver
    SIGBUS at the first store to a hole. Allocate the holes now, or refuse the pool."""
    if os.fstat(fd).st_blocks * 512 >= file_size:
        return
    try:
        os.posix_fallocate(fd, 0, file_size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # a file system without fallocate: nothing can be reserved ahead
        raise StoreError(
            f"{path} is a pool of {format_size(file_size)} whose memory is not all allocated, and allocating it "
            f"failed ({e.strerror}; {format_size(free_space(fd))} free on its file system): using it could kill "
            "this process with SIGBUS; make room, or destroy it and create a smaller pool") from None


def regrow_truncated(fd: int, path: str, size: int, file_size: int) -> TruncatedPoolError:
    """Someone shrank an attached pool's file to `size`: grow it back to `file_size` and mark it for re-format.

    Every process still mapping it would take SIGBUS at its next touch of a page past the new end; grown
    back (allocated if the file system has room, else sparse), those pages read as zeros. Its contents
    are gone, so the header becomes magic without READY: "our own unfinished header", which the next create=True
    opener formats again (section 2) and every attached process sees as a changed header. Only syscalls
    here: nothing touches the mapping.
    """
    try:
        try:
            os.posix_fallocate(fd, 0, file_size)
        except OSError:
            os.ftruncate(fd, file_size)
        if os.pread(fd, 8, 0) != MAGIC:
            os.pwrite(fd, MAGIC, 0)
        # not READY: a partial truncation left a header that still looks whole
        os.pwrite(fd, bytes(HEADER_READY_END - STATE_OFF), STATE_OFF)
        grown = "grown back to its size, to be formatted again by the next create=True opener"
    except OSError as e:
        grown = f"could not be grown back ({e.strerror})"
    return TruncatedPoolError(
        f"{path} was truncated to {size} bytes under this process (the pool is {file_size} bytes): its contents "
        f"are gone and it was {grown}; close this store and open the pool again")


__all__ = ["PoolFile", "open_pool_file", "dax_size", "SUPERBLOCK_SIZE"]
