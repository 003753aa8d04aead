"""This process's mapping of one pool, and the views every part of the store reads it through.

An Attachment owns the open PoolFile (descriptors, mapping), the lock table, the index and allocator
views, the fault-guard registration of the mapping and the header snapshot that proves the mapping still
shows the pool it attached to. Parts of the store (process table, read path, write path, publisher) hold
an Attachment and nothing else of each other's state.
"""

from __future__ import annotations

import ctypes
import errno
import os

from . import faultguard
from ..errors import PoolDamagedError, StoreError
from ..format.layout import HEADER_READY_END
from ..format.geometry import Geometry
from ..index import Index
from ..locking.locks import LockTable
from .poolfile import PoolFile, ensure_backed, regrow_truncated


class Attachment:
    """The mapped pool: `mm`, `geo`, `locks`, `index`, `alloc` (set by the Store), `data` (address) and
    `data_view` (memoryview) of the data area."""

    def __init__(self, pf: PoolFile, timeout: float):
        self.pf = pf
        self.path = pf.path
        self.mm = pf.mm
        self.geo: Geometry = pf.geo
        self.locks = LockTable(pf.lock_fd, pf.mm, pf.geo.off_locks, timeout)
        self.index = Index(pf.mm, pf.geo)
        self.alloc = None  # the Allocator: built by the Store, which provides its host
        self._anchor = ctypes.c_char.from_buffer(pf.mm)
        self.faults = faultguard.register(ctypes.addressof(self._anchor), pf.geo.file_size)
        self.data = ctypes.addressof(self._anchor) + pf.geo.off_data  # address of data offset 0
        # the data area as bytes: a small value is copied by slice assignment, without a ctypes call
        self.data_view = memoryview(pf.mm)[pf.geo.off_data:pf.geo.off_data + pf.geo.data_bytes]
        self.header = bytes(pf.mm[:HEADER_READY_END])  # immutable superblock + READY: what check_intact expects
        self.damage: StoreError | None = None
        st = os.fstat(pf.fd)
        self.identity = (st.st_dev, st.st_ino)  # the file mapped: what `path` must still name (lost())
        self.released = False  # release() has begun: nothing may be written through the mapping any more

    def populate(self) -> None:
        """Allocate the pool's memory and pre-fault this process's page tables (contents unchanged)."""
        if not self.pf.is_device:
            ensure_backed(self.pf.fd, self.path, self.geo.file_size)
        try:
            self.mm.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14+); never changes contents
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel without it (faults happen on first touch instead)
                raise StoreError(f"cannot pre-fault {self.path}: {e.strerror}") from None

    # ---------------------------------------------------------------- damage
    def check_intact(self) -> None:
        """Refuse to go on with a mapping that lost pages or whose header changed under us.

        A page of a shared mapping past the end of its file (the pool was truncated) or on a full tmpfs
        delivers SIGBUS; faultguard absorbs it inside our mapping (zero page, counted), and this check
        turns the count into PoolDamagedError. The header check catches a pool that was overwritten or
        re-created by someone else. A shrunk file is grown back and marked for re-format (FORMAT.md
        section 2), so that the next create=True opener formats it again.
        """
        if self.damage is not None:
            raise self.damage
        if self.faults.faults or self.mm[:HEADER_READY_END] != self.header:
            self.damage = self._diagnose()
            raise self.damage

    def _diagnose(self) -> PoolDamagedError:
        if not self.pf.is_device:
            size = os.fstat(self.pf.fd).st_size
            if size < self.geo.file_size:
                return regrow_truncated(self.pf.fd, self.path, size, self.geo.file_size)
        if self.faults.faults:
            return PoolDamagedError(
                f"a page of {self.path} could not be backed under this process (SIGBUS absorbed: its file system "
                "is full, or the file was truncated and grown again): the pool is damaged; close this store")
        return PoolDamagedError(
            f"the header of {self.path} changed under this process (the pool was overwritten or re-created): its "
            "contents are gone; close this store and open the pool again")

    def lost(self) -> StoreError | None:
        """Why this mapping no longer shows the pool at `path`, or None: the damage check_intact found, or
        `path` removed or naming another file (`maru-shm destroy`, or re-created by someone else). Such a
        mapping still works, on a file no new opener finds. One stat; nothing mapped is read."""
        if self.damage is not None:
            return self.damage
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self.identity:
                return None
        except OSError:
            pass
        return PoolDamagedError(f"{self.path} was removed or replaced under this process: this store maps a file "
                                "no new opener finds; close it and open the pool again")

    # ---------------------------------------------------------------- teardown
    def release(self, close_file: bool = True) -> None:
        """Unregister the guard, drop every view, close the lock table and the file (unmapping it).
        Idempotent: a release that an exception cut short finishes when called again."""
        self.released = True
        faultguard.unregister(self.faults)
        views_gone = False
        try:
            self.release_views()
            self.locks.close()
            views_gone = True
        finally:
            if close_file:  # the descriptors whatever happened; the mapping only once no view of ours is left
                self.pf.close(unmap=views_gone)

    def release_views(self) -> None:
        """Drop every view of the mapping (numpy arrays, the ctypes anchor): mmap.close() refuses while any lives."""
        if self.alloc is not None:
            self.alloc.release_views()
        self.index.release_views()
        self.locks.release_views()
        self._anchor = None
        view, self.data_view = self.data_view, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                pass  # a slice of it still lives (held by a traceback): the mapping's close reports that
