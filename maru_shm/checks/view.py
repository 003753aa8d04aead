"""A read-only look at a pool: mapped PROT_READ, never attached, nothing taken.

`PoolView` is what every figure about a pool reads (figures.py) and what the repair reads through. It
opens the pool O_RDONLY and maps it PROT_READ, so the kernel itself guarantees it cannot write; it takes
no process slot, reaps nothing and takes no lock. Process liveness is read with F_OFD_GETLK on the pool's
lock file, which works on a read-only descriptor and takes nothing; a user who may only read the pool
cannot open the lock file, and sees liveness as unknown (None).
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from ..mapping import faultguard
from ..errors import NotAPoolError, PoolDamagedError, StoreError
from ..format.layout import FLAG_DEVICE, HEADER_READY_END, SLOT_LOCK_BASE, SUPERBLOCK_SIZE
from ..format.geometry import Geometry
from ..locking.ofd import ofd_is_held
from ..locking.lockfile import open_for_reading
from ..mapping.poolfile import dax_size, open_existing


class PoolView:
    """A read-only look at a pool: what the figures read (figures.py), and nothing that can write.

    `PoolView.open(path)` maps a pool without attaching to it. `PoolView.of(store)`
    wraps an attached Store (sharing its mapping; closing the view does not
    close the store).

    A page of the mapping that cannot be read (the file was truncated under the view, or its tmpfs is
    full) would deliver SIGBUS and kill the process, an `inspect` or a `watch` as much as a server: the
    mapping is registered with faultguard, which reads such a page as zeros, and every figure read over
    one is refused (`check_intact`, PoolDamagedError).
    """

    def __init__(self, mm, geo: Geometry, path: str, lock_fd: int | None, *, self_slot: int = -1,
                 is_device: bool = False, fds: tuple = (), faults=None):
        self.mm, self.geo, self.path, self.lock_fd = mm, geo, path, lock_fd
        self.self_slot, self.is_device = self_slot, is_device
        self._fds = fds  # descriptors this view owns (closed with it)
        self._owns_map = bool(fds)
        self.ino = os.fstat(fds[0]).st_ino if fds else None
        self.dev = os.fstat(fds[0]).st_dev if fds else None
        self.faults = faults  # the faultguard record of the mapping (a store's, for a view of a store)
        if self._owns_map:
            self.faults = faultguard.register(_address_of(mm), geo.file_size)

    @classmethod
    def of(cls, store) -> "PoolView":
        return cls(store.mm, store.geo, store.path, store.locks.fd, self_slot=store.slot,
                   is_device=bool(store.geo.flags & FLAG_DEVICE), faults=store._att.faults)

    def check_intact(self) -> None:
        """Raise PoolDamagedError if a page of the mapping could not be read since it was mapped: what was
        read from it since then may be zeros, not the pool."""
        if self.faults is not None and self.faults.faults:
            raise PoolDamagedError(f"a page of {self.path} could not be read (the file was truncated, or its file "
                                   "system is full): figures read from this view are void; open it again")

    @classmethod
    def open(cls, path) -> "PoolView":
        """Map the pool at `path` read-only; raise a StoreError subclass naming the problem."""
        path = os.fspath(path)
        fd = open_existing(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fds = [fd]
        mm = None
        try:
            st = os.fstat(fd)
            is_device = stat.S_ISCHR(st.st_mode)
            if is_device:
                size = dax_size(path)
            elif stat.S_ISREG(st.st_mode):
                size = st.st_size
            else:
                raise NotAPoolError(f"{path} is neither a regular file nor a DAX device; not a maru-shm pool")
            head = os.pread(fd, HEADER_READY_END, 0) if size >= HEADER_READY_END else b""
            geo = Geometry.read(head, size)
            mm = mmap.mmap(fd, geo.file_size, mmap.MAP_SHARED, mmap.PROT_READ)
            if Geometry.read(mm, geo.file_size) != geo:
                raise StoreError(f"{path} changed while it was being opened; retry")
            lock_fd = open_for_reading(path, is_device, bytes(mm[:SUPERBLOCK_SIZE]))  # None: liveness unknown
            if lock_fd is not None:
                fds.append(lock_fd)
            return cls(mm, geo, path, lock_fd, is_device=is_device, fds=tuple(fds))
        except BaseException:
            if mm is not None:
                mm.close()
            for f in fds:
                os.close(f)
            raise

    def replaced(self) -> bool:
        """True if `path` no longer names the file this view maps (destroyed, or recreated)."""
        if self.ino is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_ino, st.st_dev) != (self.ino, self.dev)

    @property
    def sees_locks(self) -> bool:
        """Can this view tell who holds a lock? Not where its user may not open the pool's lock file (a user
        who may only read the pool) or the lock file is gone: then liveness is unknown."""
        return self.lock_fd is not None

    def held(self, lock_id: int) -> bool | None:
        """Does some process hold this lock right now (F_OFD_GETLK: takes nothing)? None: unknown."""
        if self.lock_fd is None:
            return None
        return ofd_is_held(self.lock_fd, lock_id)

    def slot_alive(self, slot: int) -> bool | None:
        """Is the process of this slot alive (its SLOT lock held)? None: unknown (`sees_locks`)."""
        return True if slot == self.self_slot else self.held(SLOT_LOCK_BASE + slot)

    def close(self) -> None:
        if self._owns_map and self.mm is not None:
            faultguard.unregister(self.faults)
            self.mm.close()
        self.mm = None
        for f in self._fds:
            os.close(f)
        self._fds = ()

    def __enter__(self) -> "PoolView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_view(src) -> PoolView:
    """`src` as a view: itself if it is one, else a view of an attached Store."""
    return src if isinstance(src, PoolView) else PoolView.of(src)


def _address_of(mm) -> int:
    """Address of a mapping, read-only ones too (ctypes.from_buffer needs a writable one); no export is
    left behind, so the mapping can still be closed."""
    first = np.frombuffer(mm, dtype=np.uint8, count=1)
    try:
        return first.ctypes.data
    finally:
        del first
