"""Opening, creating and mapping the one file that is the pool.

Regular files (normally under /dev/shm) are created with O_EXCL and sized with
ftruncate; DAX character devices are used at their own size, read from
sysfs, with 2 MiB alignment and the locks on a side file. Exactly one of
several racing creators initialises the pool: whoever holds the INIT lock
and finds the file uninitialised.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time

from . import crashpoints as _cp
from .errors import (NotAPoolError, PermissionDeniedError, SizeMismatchError, StoreError, TruncatedPoolError)
from .format import (CLASS_STRUCT, LOCK_INIT, MAGIC, STATE_OFF, STATE_READY, SUPERBLOCK_SIZE, U32, FLAG_DEVICE, FLAG_RELATIONS,
                     Geometry)
from .locks import ofd_unlock, take_lock
from .sizeclasses import planned_geometric
from .sizes import format_size

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


def side_lock_path(path: str) -> str:
    """Where a DAX device keeps its locks: a regular file in /dev/shm named after the device."""
    return f"/dev/shm/.maru_shm-{os.path.basename(path)}.lock"


class PoolFile:
    """An open, mapped pool file: fd, lock fd, mmap, geometry.

    The lock fd is a description of its own (the pool file reopened, or a DAX device's side lock file),
    never the one the mapping holds: the kernel drops an OFD lock with the last reference to its
    description, and a mapping (this process's, or a fork()ed child's copy of it) holds one too.
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


def is_private(mode: int) -> bool:
    """A private opener (no group bits in its mode) trusts only a pool that no one else can write."""
    return not mode & 0o070


def check_owner(st: os.stat_result, path: str, allow_foreign_owner: bool, mode: int = 0o600) -> None:
    """Who may attach (docs/FORMAT.md section 12).

    A private opener (mode 0600): only a file it owns that neither its group nor others may write.
    A group opener (0660/0640): the file's owner; or a member of the file's group when the file is in
    group mode (group read-write, nothing for others). allow_foreign_owner=True accepts anything the
    kernel lets us open.
    """
    euid = os.geteuid()
    if allow_foreign_owner:
        return
    fmode = stat.S_IMODE(st.st_mode)
    override = "pass allow_foreign_owner=True to override"
    if is_private(mode):
        if st.st_uid != euid:
            raise PermissionDeniedError(
                f"{path} is owned by uid {st.st_uid}, not by this user ({euid}), and this opener asked for a "
                f"private pool (mode {mode:04o}); refusing to share memory with another user (open it with "
                f"mode=0o660 to join a group-mode pool, or {override})")
        if fmode & 0o022:
            raise PermissionDeniedError(
                f"{path} is writable by {'others' if fmode & 0o002 else 'its group'} (mode {fmode:04o}) but this "
                f"opener asked for a private pool (mode {mode:04o}); open it with mode=0o660 to share it with "
                f"the group, or chmod 0600 it ({override})")
        return
    if st.st_uid == euid and not fmode & 0o002:
        return
    if fmode & 0o007:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid} and open to every user (mode {fmode:04o}): anyone could have "
            f"written it; refusing to attach (make it 0660, or {override})")
    if fmode & 0o060 != 0o060:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({euid}), and is not in group mode "
            f"(mode {fmode:04o}, not 0660); refusing to share memory with another user ({override})")
    if st.st_gid not in {os.getegid(), *os.getgroups()}:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid} and shared with group {st.st_gid} (mode {fmode:04o}), which "
            f"this user ({euid}) is not in; refusing to attach ({override})")


def check_mode(mode: int) -> None:
    """Creation modes: owner read-write, optionally group bits (0660 to share, 0640 for read-only
    inspection by the group); never bits for others, execute or special bits."""
    if mode & ~0o660 or mode & 0o600 != 0o600:
        raise PermissionDeniedError(
            f"mode {mode:04o} is not a pool mode: use 0600 (this user only) or 0660 (shared with the file's "
            "group); a pool open to every user could be written by anyone")


def open_side_lock(path: str, mode: int, allow_foreign_owner: bool = False) -> int:
    """The lock file of a DAX device: created with the pool's mode, and held to the pool's owner rules.

    Whoever can write it can hold INIT or PROC forever, so a lock file that is a symlink, not a regular
    file, or owned by a user this opener would not share the pool with is refused (FORMAT.md section 12).
    """
    lock_path = side_lock_path(path)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if os.path.islink(lock_path):
            raise PermissionDeniedError(f"lock file {lock_path} of {path} is a symlink; refusing it") from None
        raise PermissionDeniedError(f"cannot open the lock file {lock_path} of {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionDeniedError(f"lock file {lock_path} of {path} is not a regular file; refusing it")
        check_owner(st, f"lock file {lock_path} of {path}", allow_foreign_owner, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_fd(path: str, create: bool, mode: int) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode), True
        except FileExistsError:
            pass
        except OSError as e:
            _raise_open_error(path, e, "")
    return open_existing(path, flags, missing_hint="; create it with Store.open(path, size=..., create=True) "
                                                   "or `maru-shm create`"), False


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


def _raise_open_error(path: str, e: OSError, missing_hint: str):
    if not path:
        raise StoreError("the pool path is empty; give a file path such as /dev/shm/maru_shm") from None
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
    """Open (and if asked, create and initialise) the pool at `path` and map it."""
    if os.path.islink(path):
        raise PermissionDeniedError(f"{path} is a symlink; open the pool by its real path")
    if create:
        check_mode(mode)
    fd, created = _open_fd(path, create, mode)
    lock_fd = fd
    ok = False
    try:
        st = os.fstat(fd)
        is_device = stat.S_ISCHR(st.st_mode)
        if not is_device and not stat.S_ISREG(st.st_mode):
            raise NotAPoolError(f"{path} is neither a regular file nor a DAX device")
        if is_device:
            dax_size(path)  # a character device that is not DAX (/dev/null) is refused before its lock file is made
        check_owner(st, path, allow_foreign_owner, mode)
        lock_fd = open_side_lock(path, mode, allow_foreign_owner) if is_device else \
            os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)  # see PoolFile
        if created and mode & 0o077:
            os.fchmod(fd, mode)  # umask must not narrow a requested group mode
        deadline = time.monotonic() + timeout
        while True:
            take_lock(lock_fd, LOCK_INIT, timeout, f"another process to initialise {path} (lock INIT)")
            if _cp.ARMED is not None:
                _cp.hit_lock("INIT")
            try:
                geo = _initialise_or_read(fd, path, is_device, size, create, plan_kwargs)
                break
            except _NotReady as e:
                if time.monotonic() > deadline:
                    raise NotAPoolError(str(e)) from None
            finally:
                ofd_unlock(lock_fd, LOCK_INIT)
            time.sleep(0.005)  # a creator may be between O_EXCL and taking INIT
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
            if created and not is_device_path(path) and os.fstat(fd).st_size == 0:
                os.unlink(path)  # we made this empty file and could not make it a pool
            if lock_fd != fd:
                os.close(lock_fd)
            os.close(fd)


class _NotReady(Exception):
    pass


def _initialise_or_read(fd: int, path: str, is_device: bool, size: int | None, create: bool,
                        plan_kwargs: dict) -> Geometry:
    """Holding INIT: read a ready pool, or initialise an empty/unfinished one if `create`.

    A creator formats while holding INIT, so a header of ours that is not READY, seen under INIT, was
    left by a creator that died (or failed) while formatting: the next create=True opener formats it
    again. A regular file is formatted only if it is empty or such a header; a DAX device (never empty)
    also when its first page is all zero. Anything else is someone's data and is refused.
    """
    actual = dax_size(path) if is_device else os.fstat(fd).st_size
    head = os.pread(fd, min(actual, SUPERBLOCK_SIZE), 0) if actual else b""
    ready = len(head) >= STATE_OFF + 4 and head[:8] == MAGIC and U32.unpack_from(head, STATE_OFF)[0] == STATE_READY
    if ready:
        geo = Geometry.read(head, actual)
        if size is not None and size != geo.file_size and not is_device:
            raise SizeMismatchError(
                f"{path} is an existing pool of {geo.file_size} bytes, but size={size} was asked for; "
                "omit size to open it as it is, or destroy and recreate it")
        return geo
    unfinished = head[:8] == MAGIC
    formattable = actual == 0 or unfinished or (is_device and not any(head))
    if not create:
        if actual == 0:
            raise _NotReady(f"{path} is an empty file, not an initialised maru-shm pool; open it with "
                            "create=True and a size to make it one")
        if unfinished:
            raise NotAPoolError(f"{path} is a maru-shm pool whose creator died while formatting it; open it "
                                "with create=True (as MaruStorage does) to format it again")
        raise NotAPoolError(f"{path} is not a maru-shm pool (wrong magic); refusing to touch it")
    if not formattable:
        what = "is not empty" if not any(head) else "is not a maru-shm pool (wrong magic)"
        raise NotAPoolError(f"{path} exists and {what}; refusing to overwrite it (only an empty file or a "
                            "pool whose creator died while formatting it is formatted)")
    if is_device:
        file_size = actual
        plan_kwargs = dict(plan_kwargs, data_align=DAX_ALIGN, flags=FLAG_DEVICE | FLAG_RELATIONS)
    else:
        if size is None:
            raise StoreError(f"creating {path} needs a size (e.g. size='4G')")
        file_size = size
        check_space(fd, path, file_size)
    try:
        geo = Geometry.plan(file_size, **plan_kwargs)
    except ValueError as e:
        raise StoreError(f"cannot create a pool at {path}: {e}") from None
    if not is_device:
        _size_regular_file(fd, path, file_size)
    _write_header(fd, geo, is_device)
    return geo


def free_space(fd: int) -> int:
    """Bytes an unprivileged writer may still allocate on the file system holding fd."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def check_space(fd: int, path: str, file_size: int) -> None:
    """Refuse, before touching the file, a size its file system cannot back (a tmpfs smaller than the
    pool would otherwise deliver SIGBUS at the first write to an unbacked page)."""
    have = free_space(fd) + os.fstat(fd).st_blocks * 512  # blocks this file already holds are reusable
    if file_size > have:
        raise StoreError(f"cannot create a pool of {_human(file_size)} at {path}: its file system has "
                         f"{_human(have)} free; give a smaller size or make room (a tmpfs such as /dev/shm "
                         "can be remounted larger: mount -o remount,size=... /dev/shm)")


def _size_regular_file(fd: int, path: str, file_size: int) -> None:
    """Magic first, then every page of the file allocated (posix_fallocate), so that no later store to
    the mapping can meet an unbacked page. A creator killed in between leaves an empty file or our own
    unfinished header; ENOSPC truncates the file back to empty and is reported with the free space."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, MAGIC, 0)
    try:
        os.posix_fallocate(fd, 0, file_size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: size it sparse
            os.ftruncate(fd, file_size)
            return
        os.ftruncate(fd, 0)
        if e.errno == errno.ENOSPC:
            raise StoreError(f"cannot create a pool of {_human(file_size)} at {path}: its file system ran out of "
                             f"space ({_human(free_space(fd))} free); give a smaller size or make room") from None
        raise StoreError(f"cannot allocate {_human(file_size)} for {path}: {e.strerror}") from None


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
            f"{path} is a pool of {_human(file_size)} whose memory is not all allocated, and allocating it "
            f"failed ({e.strerror}; {_human(free_space(fd))} free on its file system): using it could kill "
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
        os.pwrite(fd, bytes(4), STATE_OFF)  # not READY: a partial truncation left a header that still looks whole
        grown = "grown back to its size, to be formatted again by the next create=True opener"
    except OSError as e:
        grown = f"could not be grown back ({e.strerror})"
    return TruncatedPoolError(
        f"{path} was truncated to {size} bytes under this process (the pool is {file_size} bytes): its contents "
        f"are gone and it was {grown}; close this store and open the pool again")


def _human(n: int) -> str:
    return format_size(n)


def _write_header(fd: int, geo: Geometry, is_device: bool) -> None:
    """Zero the header regions, write magic first, then the superblock and class table, state=READY last.

    Magic goes first so that a creator killed at any later instruction leaves "our own unfinished
    header" (magic, not ready), which the next create=True initialises again; with magic written
    late, a crash after the superblock body left a file that was neither zero nor ours, and every
    later open refused it as a foreign file.
    """
    mm = mmap.mmap(fd, geo.off_data, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        if is_device:  # a device is not zero-filled by ftruncate
            chunk = 1 << 20
            for off in range(0, geo.off_data, chunk):
                n = min(chunk, geo.off_data - off)
                mm[off:off + n] = bytes(n)
        mm[0:8] = MAGIC
        sb = geo.pack_superblock()
        mm[8:len(sb)] = sb[8:]
        if _cp.ARMED is not None:
            _cp.hit("init.mid_header")
        for cid, (kind, k, bsize, n) in enumerate(planned_geometric(geo.granule, geo.unit_size, geo.max_value)):
            CLASS_STRUCT.pack_into(mm, geo.class_entry(cid), kind, k, bsize, n, 0, 0, 0, 0)
        U32.pack_into(mm, STATE_OFF, STATE_READY)
        if is_device:
            mm.flush()
    finally:
        mm.close()


__all__ = ["PoolFile", "open_pool_file", "dax_size", "side_lock_path", "SUPERBLOCK_SIZE"]
