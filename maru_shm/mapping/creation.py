"""Creating a pool: one protocol across its two files, the lock file and the pool file (FORMAT.md section 2,
*Creation*; BRIEF invariant 12).

INIT, held on the lock file, serialises creation. A creator that finds no file at the pool's path builds the
pool whole as an unnamed file in its directory (O_TMPFILE; where the file system has none, under a
temporary name `.<name>.maru-new-<32 hex>`) and gives it the path with a link or rename that never
replaces a file, so the path names nothing or a ready pool. The lock file comes first, and only the process
that made it removes it, holding INIT, while it names no ready pool (lockfile.remove_unused). What a
creator killed at any step leaves (a lock file naming no pool; a named temporary file) the next holder of
INIT uses or removes. A DAX device, which has no name to publish, and a file already at the path (empty,
or an unfinished header of ours) are formatted in place under INIT.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re

from .. import crashpoints as _cp
from ..errors import StoreError
from ..format.layout import (CLASS_STRUCT, LOCK_BOOT_OFF, LOCK_IDENTITY, LOCK_IDENTITY_OFF, MAGIC, STATE_OFF,
                             STATE_READY, U32)
from ..format.geometry import Geometry
from ..locking.lockfile import boot_id, identity, name_pool
from ..format.sizeclasses import planned_geometric
from ..sizes import format_size

_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _temp_prefix(path: str) -> tuple[str, str]:
    folder, name = os.path.split(os.path.abspath(path))
    return folder, f".{name}.maru-new-"


def remove_leftovers(path: str) -> None:
    """Holding INIT: remove the named temporary files that creators of the pool at `path` killed while
    building left behind. Only a holder of INIT builds one, so none of them is in use."""
    folder, prefix = _temp_prefix(path)
    temp = re.compile(re.escape(prefix) + "[0-9a-f]{32}")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if temp.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass  # another user's (a sticky directory), or gone already


def build_pool(path: str, lock_fd: int, size: int | None, mode: int, plan_kwargs: dict, fit) -> tuple[int, Geometry]:
    """Holding INIT, with no file at `path`: build a ready pool of `size` bytes as a new file and give it the
    path. Returns its descriptor and geometry. `fit(stat)` fits the lock file to the new pool's mode before
    anything is written. FileExistsError: a file appeared at `path` meanwhile (made outside this protocol);
    nothing of this call is left."""
    if size is None:
        raise StoreError(f"creating {path} needs a size (e.g. size='4G')")
    remove_leftovers(path)
    fd, temp = _new_file(path, mode)
    try:
        try:
            if mode & 0o077:
                os.fchmod(fd, mode)  # umask must not narrow a requested group mode
            fit(os.fstat(fd))
            geo = format_pool(fd, path, lock_fd, size, False, plan_kwargs)
            if _cp.ARMED is not None:
                _cp.hit("create.before_publish")
            _publish(fd, temp, path)
        finally:
            if temp is not None:
                _unlink_quietly(temp)  # published: the name is gone already (or, after a link, a second name)
        if _cp.ARMED is not None:
            _cp.hit("create.published")
    except BaseException:
        os.close(fd)
        raise
    return fd, geo


_UNNAMED = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")  # (tests turn it off)


def _new_file(path: str, mode: int) -> tuple[int, str | None]:
    """A new file in the pool's directory: unnamed (O_TMPFILE), so that a creator killed while building leaves
    nothing, and (descriptor, None); where the file system has no unnamed files, (descriptor, its temporary
    name)."""
    folder, prefix = _temp_prefix(path)
    if _UNNAMED:
        try:
            return os.open(folder, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, mode), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    temp = os.path.join(folder, prefix + os.urandom(16).hex())
    return os.open(temp, _TEMP_FLAGS, mode), temp


_libc = ctypes.CDLL(None, use_errno=True)
_libc.linkat.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
_AT_FDCWD, _RENAME_NOREPLACE, _AT_SYMLINK_FOLLOW = -100, 1, 0x400


def _publish(fd: int, temp: str | None, path: str) -> None:
    """Give the new pool (`fd`, unnamed; or its temporary name) the name `path`, never replacing a file there
    (FileExistsError). os.link would link /proc's symlink itself, not the file it names: linkat does."""
    if temp is None:
        _check(_libc.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(path),
                            _AT_SYMLINK_FOLLOW), path)
        return
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(temp), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else: not on this file system
            raise OSError(err, os.strerror(err), path)
    os.link(temp, path)  # also never replaces; the temporary name is removed next


def _check(result: int, path: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)  # FileExistsError for EEXIST


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def format_pool(fd: int, path: str, lock_fd: int, file_size: int, is_device: bool, plan_kwargs: dict) -> Geometry:
    """Holding INIT: lay out a pool of `file_size` bytes in `fd` (a new temporary file, an empty or
    unfinished file at the path, a DAX device), name it in the lock file, then write its header, READY last."""
    if not is_device:
        check_space(fd, path, file_size)
    try:
        geo = Geometry.plan(file_size, **plan_kwargs)
    except ValueError as e:
        raise StoreError(f"cannot create a pool at {path}: {e}") from None
    name_pool(lock_fd, geo.pool_uuid)  # before READY: a ready pool always has its lock file
    if not is_device:
        _size_regular_file(fd, path, file_size)
    _write_header(fd, geo, is_device, identity(lock_fd))
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
        raise StoreError(f"cannot create a pool of {format_size(file_size)} at {path}: its file system has "
                         f"{format_size(have)} free; give a smaller size or make room (a tmpfs such as /dev/shm "
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
            raise StoreError(f"cannot create a pool of {format_size(file_size)} at {path}: its file system ran "
                             f"out of space ({format_size(free_space(fd))} free); give a smaller size or make "
                             "room") from None
        raise StoreError(f"cannot allocate {format_size(file_size)} for {path}: {e.strerror}") from None


def _write_header(fd: int, geo: Geometry, is_device: bool, lock_identity: tuple[int, int]) -> None:
    """Zero the header regions, write magic first, then the superblock, class table and the lock file's
    boot and identity, state=READY last.

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
        mm[LOCK_BOOT_OFF:LOCK_BOOT_OFF + 16] = boot_id()
        LOCK_IDENTITY.pack_into(mm, LOCK_IDENTITY_OFF, *lock_identity)
        U32.pack_into(mm, STATE_OFF, STATE_READY)
        if is_device:
            mm.flush()
    finally:
        mm.close()
