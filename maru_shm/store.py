"""The public Store: one mapped pool file shared by every process that opens it.

A Store is an attachment of this process to a pool: it holds the mapping, a
process-table slot (and that slot's lock, which proves it alive), and the
per-process counters. Reads take no lock; writes take one class lock to
reserve blocks and one shard lock per index shard to publish them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import time
import weakref
from contextlib import nullcontext
from typing import Iterable, Sequence

import numpy as np

from . import crashpoints as _cp
from . import faultguard
from .allocator import Allocator
from .allocator.slabs import SMALL_BATCH
from .errors import PoolClosedError, PoolDamagedError, StoreError, ValueTooLargeError
from .fence import CallFence
from .format import (COUNTER_NAMES, COUNTERS, FLAG_PINNED, LIVE, LOCK_PROC, META_FLAGS_OFF, META_STRUCT, N_COUNTERS,
                     PROC_COUNTERS_OFF, PROC_ENTRY, PROC_HEAD, RETIRED_OFF, SHARD_LOCK_BASE, STATE_OFF, SLOT_LOCK_BASE, U16, U64, Geometry, next_word,
                     store_u64)
from .index import Index, digest_array, key_digest
from .pieces import Pieces, PieceTable, piece_lengths
from .resolve import leading_present, resolve
from .locks import LockTable, dense_range, ofd_is_held, ofd_trylock, ofd_unlock
from .poolfile import PoolFile, ensure_backed, open_pool_file, regrow_truncated
from .sizes import parse_size

MAX_TIMEOUT = 86400.0  # s: the longest lock wait Store.open accepts
CLOSE_WAIT = 30.0
PIN_LIMIT = 64  # values one Store may pin (Store.pin)  # s close() waits for calls in flight (each is bounded by its lock timeouts)

_COUNTER_POS = {name: i for i, name in enumerate(COUNTER_NAMES)}

# Stores open in this process. A child made by fork() inherits them with the parent's process slot,
# SLOT lock and lock descriptions (an OFD lock is shared by every copy of its descriptor), and its
# kept blocks: using one there would act as the parent. The child marks them forked: every call
# raises PoolClosedError, and close() only drops the child's copies of the mapping and descriptors.
_OPEN_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _forget_stores_in_child() -> None:
    for store in list(_OPEN_STORES):
        store._forked = True


os.register_at_fork(after_in_child=_forget_stores_in_child)



def _entry(method):
    """A public call: refused once the store is closed, damaged or inherited across fork(); counted in the
    call fence while it runs, so that close() waits for it before unmapping."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._forked or not self._fence.enter():  # (a forked child never touches the fence: its lock may be held)
            self._check_open()
            raise PoolClosedError("store is closed")
        try:
            self._check_intact()
            result = method(self, *args, **kwargs)
            if self._faults.faults:  # a page vanished under this call: what it read or wrote is not to be trusted
                self._check_intact()
            return result
        finally:
            self._fence.leave()
    return call


def _start_ticks(pid: int) -> int:
    """Process start time in clock ticks (field 22 of /proc/<pid>/stat), 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _buffer_address(buf, writable: bool) -> tuple[int, int, object]:
    """(address, nbytes, keepalive) of a C-contiguous buffer; anything else is refused.

    Never a silent copy: reshaping a non-contiguous array (a column slice, Fortran order) makes one, and a
    value loaded into it would be lost while the call reported a hit.
    """
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as e:
            raise TypeError(f"expected a C-contiguous buffer (bytes, bytearray, memoryview, numpy array): {e}") from None
    if not arr.flags.c_contiguous:
        raise TypeError("buffer must be C-contiguous (not a strided slice or a Fortran-order array); "
                        "pass np.ascontiguousarray(...) and copy back")
    if writable and not arr.flags.writeable:
        raise TypeError("destination buffer is read-only")
    arr = arr.reshape(-1).view(np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


def check_timeout(timeout) -> float:
    """A lock wait limit: a positive, finite number of seconds, at most a day (NaN or inf would wait forever)."""
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}") from None
    if not (0 < t <= MAX_TIMEOUT):  # also false for NaN
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT:g}] seconds, got {timeout!r}")
    return t


def _check_fits(info, length: int) -> None:
    """Never copy past a block: it would overwrite its neighbours."""
    if length > info.block:
        raise StoreError(f"internal error: class {info.cid} ({info.block}-byte blocks) chosen for a {length}-byte value")


class Store:
    """A maru-shm pool attached to this process. Use `Store.open(...)`."""

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str, size=None, create: bool = False, *, mode: int = 0o600, timeout: float = 2.0,
             allow_foreign_owner: bool = False, granule: int = 4096, unit_size: int = 256 << 10,
             max_value="64M", index_slots: int | None = None, index_shards: int = 64,
             proc_slots: int = 128, populate: bool = False) -> "Store":
        """Open the pool at `path`, creating it with `size` bytes if `create` and it does not exist.

        Creation knobs (ignored for an existing pool, whose geometry is read
        from its header): granule (smallest block), unit_size (slab unit),
        max_value, index_slots, index_shards, proc_slots.

        populate=True backs the whole pool with memory now (fallocate on a
        regular file) and pre-faults this process's mapping, so the first write
        to each page does not pay for a page fault; it costs the full pool size
        in RAM up front, which is what a KV-cache tier wants anyway.
        """
        timeout = check_timeout(timeout)
        if index_slots is not None and (type(index_slots) is not int or index_slots < 1):
            raise ValueError(f"index_slots must be a positive integer (or None to size it from the pool), "
                             f"got {index_slots!r}")
        size_b = parse_size(size) if size is not None else None
        plan = dict(granule=granule, unit_size=unit_size, max_value=parse_size(max_value),
                    index_slots=index_slots, index_shards=index_shards, proc_slots=proc_slots)
        pf = open_pool_file(os.fspath(path), size=size_b, create=create, mode=mode, timeout=timeout,
                            allow_foreign_owner=allow_foreign_owner, plan_kwargs=plan)
        try:
            store = cls(pf, timeout)
        except BaseException:
            pf.close()
            raise
        if populate:
            store.populate()
        return store

    @_entry
    def populate(self) -> None:
        """Allocate the pool's memory and pre-fault this process's page tables (contents unchanged)."""
        if not self._pf.is_device:
            ensure_backed(self._pf.fd, self.path, self.geo.file_size)
        try:
            self.mm.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14+); never changes contents
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: a kernel without it (faults happen on first touch instead)
                raise StoreError(f"cannot pre-fault {self.path}: {e.strerror}") from None

    def __init__(self, pf: PoolFile, timeout: float):
        self._pf = pf
        self.path = pf.path
        self.mm = pf.mm
        self.geo: Geometry = pf.geo
        self.created = pf.created
        self.locks = LockTable(pf.lock_fd, pf.mm, pf.geo.off_locks, timeout)
        self.index = Index(pf.mm, pf.geo)
        self._anchor = ctypes.c_char.from_buffer(pf.mm)
        self._faults = faultguard.register(ctypes.addressof(self._anchor), pf.geo.file_size)
        self._data = ctypes.addressof(self._anchor) + pf.geo.off_data
        self._counters = [0] * N_COUNTERS
        self._closed = False
        self._forked = False
        self._pins: set[bytes] = set()  # digests of the keys this Store pinned (PIN_LIMIT)
        self._fence = CallFence()
        self._damage: StoreError | None = None
        self._header = bytes(pf.mm[:STATE_OFF + 4])  # immutable superblock + READY: what _check_intact expects
        self.slot = -1
        self.alloc = Allocator(self)
        try:
            self._attach()
            self.reap_dead()
        except BaseException:
            # Leave nothing behind: the slot, and the buffer exports that would make closing the map fail
            # (BufferError) and hide the real error.
            try:
                self._detach()
            finally:
                faultguard.unregister(self._faults)
                self._release_exports()
                self.locks.close()
            raise
        _OPEN_STORES.add(self)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<maru_shm.Store {self.path!r} slot={self.slot} {'closed' if self._closed else 'open'}>"

    @property
    def timeout(self) -> float:
        return self.locks.timeout

    @property
    def data_address(self) -> int:
        """Address of the data area in this process (for benchmarks comparing raw copies)."""
        return self._data

    def close(self) -> None:
        """Detach: publish counters, free the process slot, unmap. Idempotent.

        Waits for calls in flight in other threads (CLOSE_WAIT s at most): the mapping is never unmapped
        under a copy. A call that outlives the wait keeps the mapping alive (it is left to the process's
        exit) rather than faulting.
        """
        if self._closed:
            return
        self._closed = True
        _OPEN_STORES.discard(self)
        if self._forked:  # a forked child's slot, locks and fence are its parent's: drop our copies only
            self._release_all()
            return
        if not self._fence.shut_and_wait(CLOSE_WAIT):
            return
        try:
            if self._damage is None:
                self._detach()
            elif self.slot >= 0:  # never write into a damaged mapping: give up the slot's lock only
                ofd_unlock(self.locks.fd, SLOT_LOCK_BASE + self.slot)
                self.slot = -1
        finally:
            self._release_all()

    def _release_all(self) -> None:
        faultguard.unregister(self._faults)
        try:
            self._release_exports()
            self.locks.close()
        finally:
            self._pf.close()

    def _release_exports(self) -> None:
        """Drop every view of the mapping (numpy arrays, the ctypes anchor): mmap.close() refuses while any lives."""
        self.alloc.release_views()
        self.index.release_views()
        self.locks.release_views()
        del self._anchor

    def _check_open(self) -> None:
        if self._closed or self._forked:
            raise PoolClosedError("store is closed" if self._closed else
                                  "store was opened before fork() by the parent process; open the pool again "
                                  "in this process (the slot, locks and kept blocks are the parent's)")

    def _check_intact(self) -> None:
        """Refuse to go on with a mapping that lost pages or whose header changed under us.

        A page of a shared mapping past the end of its file (the pool was truncated) or on a full tmpfs
        delivers SIGBUS; faultguard absorbs it inside our mapping (zero page, counted), and this check
        turns the count into PoolDamagedError. The header check catches a pool that was overwritten or
        re-created by someone else. A shrunk file is grown back and marked for re-format (FORMAT.md
        section 13), so that the next create=True opener formats it again.
        """
        if self._damage is not None:
            raise self._damage
        if self._faults.faults or self.mm[:STATE_OFF + 4] != self._header:
            self._damage = self._diagnose()
            raise self._damage

    def _diagnose(self) -> PoolDamagedError:
        if not self._pf.is_device:
            size = os.fstat(self._pf.fd).st_size
            if size < self.geo.file_size:
                return regrow_truncated(self._pf.fd, self.path, size, self.geo.file_size)
        if self._faults.faults:
            return PoolDamagedError(
                f"a page of {self.path} could not be backed under this process (SIGBUS absorbed: its file system "
                "is full, or the file was truncated and grown again): the pool is damaged; close this store")
        return PoolDamagedError(
            f"the header of {self.path} changed under this process (the pool was overwritten or re-created): its "
            "contents are gone; close this store and open the pool again")

    # ---------------------------------------------------------------- process table
    def _slot_off(self, slot: int) -> int:
        return self.geo.off_procs + slot * PROC_ENTRY

    def _attach(self) -> None:
        for attempt in range(2):
            with self.locks.hold(LOCK_PROC):
                for slot in range(self.geo.proc_slots):
                    state = PROC_HEAD.unpack_from(self.mm, self._slot_off(slot))[0]
                    if state != 0:
                        continue
                    if not ofd_trylock(self.locks.fd, SLOT_LOCK_BASE + slot):
                        continue  # being reaped right now
                    pid = os.getpid()
                    o = self._slot_off(slot)
                    self.mm[o:o + PROC_ENTRY] = bytes(PROC_ENTRY)
                    PROC_HEAD.pack_into(self.mm, o, 1, pid, _start_ticks(pid), time.time_ns(), os.geteuid())
                    self.slot = slot
                    self.locks.slot_plus1 = slot + 1
                    if _cp.ARMED is not None:
                        _cp.hit_lock("SLOT")
                    return
            # Every slot is claimed: some claimants may be dead (reaping is lazy). Reap, then look again.
            if attempt or not self.reap_dead():
                break
        raise StoreError(f"process table of {self.path} is full ({self.geo.proc_slots} slots); "
                         "detach idle processes or recreate the pool with more proc_slots")

    def _detach(self) -> None:
        if self.slot < 0:
            return
        self.flush_counters()
        try:
            # Settle blocks still owned by this slot (a put that raised midway), as a reaper would for a
            # dead slot: once the slot is free, nobody would ever settle them. If this fails, the slot
            # stays claimed without its SLOT lock, so the next reaper settles them.
            self.alloc.resolve_owned(self._owned_blocks(self.slot), self.slot + 1)
            with self.locks.hold(LOCK_PROC):
                self._retire_slot(self.slot)
        finally:
            ofd_unlock(self.locks.fd, SLOT_LOCK_BASE + self.slot)
            self.slot = -1

    def _retire_slot(self, slot: int) -> None:
        """PROC held: add a slot's counters to the retired totals and free the slot."""
        o = self._slot_off(slot)
        mine = COUNTERS.unpack_from(self.mm, o + PROC_COUNTERS_OFF)
        total = COUNTERS.unpack_from(self.mm, RETIRED_OFF)
        COUNTERS.pack_into(self.mm, RETIRED_OFF, *[(a + b) & (2**64 - 1) for a, b in zip(total, mine)])
        self.mm[o:o + PROC_ENTRY] = bytes(PROC_ENTRY)

    def slot_alive(self, owner_plus1: int) -> bool:
        """Is the process in slot owner_plus1 - 1 alive? Its SLOT lock is held exactly while it lives."""
        slot = owner_plus1 - 1
        if slot == self.slot:
            return True
        if not 0 <= slot < self.geo.proc_slots:
            return False
        return ofd_is_held(self.locks.fd, SLOT_LOCK_BASE + slot)

    @_entry
    def reap_dead(self, under_pressure: bool = False) -> int:
        """Reclaim the slots and unpublished blocks of processes that died; returns slots reaped."""
        reaped = 0
        for slot in range(self.geo.proc_slots):
            if slot == self.slot or PROC_HEAD.unpack_from(self.mm, self._slot_off(slot))[0] == 0:
                continue
            if not ofd_trylock(self.locks.fd, SLOT_LOCK_BASE + slot):
                continue  # alive (or being reaped by someone else)
            try:
                if _cp.ARMED is not None:
                    _cp.hit_lock("SLOT")
                if PROC_HEAD.unpack_from(self.mm, self._slot_off(slot))[0] == 0:
                    continue
                self._reap_slot(slot)
                reaped += 1
            finally:
                ofd_unlock(self.locks.fd, SLOT_LOCK_BASE + slot)
        return reaped

    def _reap_slot(self, slot: int) -> None:
        self.alloc.resolve_owned(self._owned_blocks(slot), slot + 1)
        with self.locks.hold(LOCK_PROC):
            self._retire_slot(slot)
        self.count(repairs=1)

    def _owned_blocks(self, slot: int) -> list[int]:
        """Data offsets of the blocks whose meta names `slot` as owner."""
        owners = np.ndarray((self.geo.n_granules,), dtype="<u2", buffer=self.mm,
                            offset=self.geo.off_blockmeta + 28, strides=(32,))
        try:
            granules = np.flatnonzero(owners == slot + 1)
        finally:
            del owners
        blocks = []
        for g in granules.tolist():
            # a block starts in this granule; recover its exact offset from its slab
            h, info = self.alloc.head_of(g * self.geo.granule)
            if info is None:
                continue
            rel = g * self.geo.granule - h * self.geo.unit_size
            i = -(-rel // info.block)
            off = h * self.geo.unit_size + i * info.block
            if off // self.geo.granule == g:
                blocks.append(off)
        return blocks

    # ---------------------------------------------------------------- hooks used by the allocator
    def count(self, **kw) -> None:
        c = self._counters
        for name, v in kw.items():
            c[_COUNTER_POS[name]] += v

    def flush_counters(self) -> None:
        if self.slot >= 0:
            c = self._counters
            c[_COUNTER_POS["lock_timeouts"]] = self.locks.timeouts
            COUNTERS.pack_into(self.mm, self._slot_off(self.slot) + PROC_COUNTERS_OFF,
                               *[v & (2**64 - 1) for v in c])

    def _shard_repair(self, shard: int):
        def repair():
            self.index.rebuild(shard, self._entry_valid, salvage=self._entry_salvage)
            self.count(repairs=1)
        return repair

    def _entry_salvage(self, d: bytes, word: int, offset: int) -> int:
        """Shard repair, for an entry whose word does not match its block: the word to restore, 0 to drop it.

        An overwrite stores the new offset, then the new word. A publisher that dies between the two
        leaves the new block's offset with the old block's word: the old block is already claimed (its
        owner is the publisher, so reaping frees it) and the new block is LIVE, holds d and still names
        its publisher as owner (cleared only after publication). That block is restored into the entry,
        completing the publication; dropping the entry would lose the key (old and new value both).
        Nothing can have freed and reused the block in between: every path that frees a LIVE block
        either consults this shard under its lock (so this repair runs first) or holds a claim on it.
        """
        if not 0 <= offset < self.geo.data_bytes:
            return 0
        loc = self.alloc.block_index(offset)
        if loc is None:
            return 0
        mword, md, length, owner, _ = META_STRUCT.unpack_from(self.mm, self.alloc.meta_off(offset))
        if mword & 3 != LIVE or md != d or not owner or length > loc[1].block:
            return 0
        return mword

    def _entry_valid(self, d: bytes, word: int, offset: int) -> bool:
        if not 0 <= offset < self.geo.data_bytes:
            return False
        m = self.alloc.meta_off(offset)
        return U64.unpack_from(self.mm, m)[0] == word and bytes(self.mm[m + 8:m + 24]) == d

    def unpublish(self, d: bytes, offset: int, word: int) -> bool:
        """Remove the index entry of d if it names this block; True if it did."""
        s = self.index.shard_of(d)
        with self.locks.hold(SHARD_LOCK_BASE + s, repair=self._shard_repair(s)):
            return self.index.remove(s, d, offset=offset, word=word) is not None

    def unpublish_many(self, halves: np.ndarray, offsets: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Remove the index entries of a batch of digests ((n, 2) u64 halves) that name these blocks
        (offset, word), in one round of their shard locks (taken together, ascending); the mask of
        entries removed. A few blocks go one by one (a crash point after each), more in one
        `Index.remove_many` pass."""
        index = self.index
        shards = (halves[:, 0] & index.smask_u).astype(np.int64)
        with self.locks.hold_many(dense_range((shards + SHARD_LOCK_BASE).tolist()),
                                  repair_for=self._repair_shard_lock):
            if len(offsets) > SMALL_BATCH:
                out = index.remove_many(halves, offsets, words)
                if out.any() and _cp.ARMED is not None:
                    _cp.hit("evict.mid")  # after unpublishing the victims
                return out
            out = np.zeros(len(offsets), dtype=bool)
            for k, (s, off, word) in enumerate(zip(shards.tolist(), offsets.tolist(), words.tolist())):
                out[k] = index.remove(s, halves[k].tobytes(), offset=off, word=word) is not None
                if out[k] and _cp.ARMED is not None:
                    _cp.hit("evict.mid")  # after unpublishing a block of the victim window
            return out

    def indexed_at(self, d: bytes, offset: int, word: int, disown: int = 0) -> bool:
        """Is the block (offset, word) the published value of d? See indexed_many."""
        return self.indexed_many([(d, offset, word, disown)])[0]

    def indexed_many(self, blocks) -> list[bool]:
        """Per (digest, offset, word, disown): is that block the published value of its digest?

        Repairs and reaping ask this before freeing a LIVE block, so it is answered under the digest's
        SHARD lock (one acquisition per shard; a dirty shard is repaired first): a lock-free probe can
        miss an entry that another process's backward-shift delete is moving, or read a torn entry
        that shard repair would restore, and the caller would free a published block. A "not indexed"
        answer stays true after the lock is released (only a block's owner publishes it, and these
        blocks are unowned or owned by a dead process); an indexed block can only be unpublished by
        a process that claims it first. While the lock pins an indexed block, its owner is cleared if
        it is still `disown` (nonzero): reaping a dead publisher's block must not wipe the claim of a
        live process that unpublishes it just after.

        Lock order: callers hold CLASS (and maybe POOL) locks, and SHARD comes after them. A caller
        holding every lock (check(repair=True)) is answered without taking any.
        """
        out = [False] * len(blocks)
        by_shard: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            by_shard.setdefault(self.index.shard_of(b[0]), []).append(i)
        holds_all = self.locks.holds_all()
        mm, meta_off = self.mm, self.alloc.meta_off
        for s, idxs in by_shard.items():
            section = nullcontext() if holds_all else self.locks.hold(SHARD_LOCK_BASE + s,
                                                                     repair=self._shard_repair(s))
            with section:
                for i in idxs:
                    d, offset, word, disown = blocks[i]
                    if self.index.find(d) != (word, offset):
                        continue
                    out[i] = True
                    if disown:
                        m = meta_off(offset)
                        if U16.unpack_from(mm, m + 28)[0] == disown:
                            U16.pack_into(mm, m + 28, 0)
        return out

    # ---------------------------------------------------------------- sizes
    @_entry
    def declare_size(self, nbytes: int) -> int:
        """Give values of exactly `nbytes` an exact-fit size class (e.g. a KV page); returns its class id."""
        return self.alloc.declare_exact(int(nbytes)).cid

    @property
    def max_value(self) -> int:
        return self.geo.max_value

    # ---------------------------------------------------------------- read path (lock-free)
    def _lookup(self, d: bytes):
        """(offset, word, length, meta offset) of the committed value of d, or None."""
        found = self.index.find(d)
        if found is None:
            return None
        word, offset = found
        if not 0 <= offset < self.geo.data_bytes:
            return None
        m = self.geo.off_blockmeta + (offset // self.geo.granule) * 32
        w1 = U64.unpack_from(self.mm, m)[0]
        if w1 != word or w1 & 3 != LIVE or self.mm[m + 8:m + 24] != d:
            return None
        length = int.from_bytes(self.mm[m + 24:m + 28], "little")
        if offset + length > self.geo.data_bytes:
            return None
        return offset, w1, length, m

    def _copy_out(self, found, pieces: Pieces) -> bool:
        offset, w1, length, m = found
        loc = self.alloc.block_index(offset)
        if loc is None or length > loc[1].block:
            return False  # not a block start of a formatted slab, or a length overrunning it: never copy
        src = self._data + offset
        for addr, n in pieces:
            ctypes.memmove(addr, src, n)
            src += n
        if U64.unpack_from(self.mm, m)[0] != w1:
            return False
        self.mm[m + 30] = 1
        self.mm[self.geo.off_slabs + (offset // self.geo.unit_size) * 64 + 24] = 1
        return True

    def get_pieces(self, key, pieces: Pieces) -> bool:
        """Load the value of `key` into destination pieces whose total length must equal it exactly.

        Raw pointers, as for put_pieces: a bogus address crashes the process. Use get_into() for buffers.
        """
        return self.batch_get_pieces([key], [pieces])[0]

    @_entry
    def batch_get_pieces(self, keys: Sequence, pieces_list: Sequence[Pieces], *, digests=None) -> list[bool]:
        """Load many values into destination pieces; per key True only if the stored length matches exactly.

        `pieces_list` is one list of (address, nbytes) per key, or an (n, k, 2) array
        (see maru_shm.pieces). `digests` (an (n, 16) array or list of 16-byte digests)
        replaces hashing `keys`.
        """
        darr = self._digest_batch(keys, digests)
        n = len(darr)
        if len(pieces_list) != n:
            raise ValueError(f"{len(pieces_list)} destinations for {n} keys")
        res = resolve(self, darr)
        if n <= SMALL_BATCH:
            out = self._get_scalar(res, pieces_list.tolist() if isinstance(pieces_list, np.ndarray) else pieces_list)
            hits = sum(out)
            nbytes = sum([length for length, o in zip(res.lengths.tolist(), out) if o])
        else:
            ok = self._get_vector(res, PieceTable.of(pieces_list, n))
            out = ok.tolist()
            hits = out.count(True)
            nbytes = int(res.lengths.sum()) if hits == n else int(res.lengths[ok].sum())
        self.count(hits=hits, misses=n - hits, bytes_read=nbytes)
        self.flush_counters()
        return out

    def _get_scalar(self, res, pieces_list) -> list[bool]:
        """Copy out a few values key by key (no numpy call per key: cheaper below SMALL_BATCH keys)."""
        oks, offs, words, lens = res.ok.tolist(), res.offsets.tolist(), res.words.tolist(), res.lengths.tolist()
        out = []
        mm, data, memmove = self.mm, self._data, ctypes.memmove
        meta, gran, slabs, unit = self.geo.off_blockmeta, self.geo.granule, self.geo.off_slabs, self.geo.unit_size
        for i, pieces in enumerate(pieces_list):
            ok = oks[i]
            if ok:
                if piece_lengths([pieces])[0] != lens[i]:
                    ok = False
                else:
                    off = offs[i]
                    src = data + off
                    for addr, n in pieces:
                        memmove(addr, src, n)
                        src += n
                    m = meta + (off // gran) * 32
                    ok = U64.unpack_from(mm, m)[0] == words[i]  # unchanged across the copy: not torn
                    if ok:
                        mm[m + 30] = 1
                        mm[slabs + (off // unit) * 64 + 24] = 1
            out.append(ok)
        return out

    def _get_vector(self, res, table: PieceTable) -> np.ndarray:
        """Copy out a batch: one flat loop over every piece of the values found with the right length, then
        one pass re-reading their block words (a word changed since the lookup means the block was reused
        during the copy: that key's bytes may be torn, and it reports False) and marking the rest used."""
        ok = res.ok & (res.lengths == table.lengths)
        rows = np.flatnonzero(ok)
        if rows.size:
            offs = res.offsets[rows]
            memmove = ctypes.memmove
            for dst, src, nb in zip(*table.gather(rows, self._data + offs)):
                memmove(dst, src, nb)
            gidx = offs >> (self.geo.granule.bit_length() - 1)
            still = self.alloc.meta_words[gidx] == res.words[rows]
            ok[rows] = still
            self.alloc.meta_refs[gidx[still]] = 1
            self.alloc.unit_refs[offs[still] // self.geo.unit_size] = 1
        return ok

    @_entry
    def resolve(self, digests, full: bool = True):
        """Vectorised lock-free lookup of a batch of digests: ok mask, offsets, words, lengths (see resolve.py).

        full=False skips the block-start checks a copy needs: enough to ask "present, and how long?".
        """
        return resolve(self, digest_array(digests), full=full)

    @_entry
    def home_hits(self, digests) -> np.ndarray:
        """Cheap, lock-free hint for a batch: True where an entry for the digest sits in its home slot.

        No probe, no validation: a key displaced from its home slot reads False, and
        True is only "maybe present" (confirm with `resolve`). Writers use it to skip
        the full lookup of keys that are almost surely new.
        """
        halves = digest_array(digests).view("<u8")
        e = self.index.table[self.index.home_slots(halves[:, 0], halves[:, 1])]
        return (e[:, 0] == halves[:, 0]) & (e[:, 1] == halves[:, 1]) & (e[:, 2] != 0)

    def _digest_batch(self, keys, digests) -> np.ndarray:
        if digests is not None:
            return digest_array(digests)
        return digest_array([key_digest(k) for k in keys])

    def get_into(self, key, out) -> int | None:
        """Copy the value into writable buffer `out`; its length, or None on a miss or if `out` is too small."""
        return self.batch_get_into([key], [out])[0]

    @_entry
    def batch_get_into(self, keys: Sequence, outs: Sequence) -> list[int | None]:
        keys, outs = list(keys), list(outs)
        if len(keys) != len(outs):
            raise ValueError(f"{len(outs)} destination buffers for {len(keys)} keys")
        res: list[int | None] = []
        hits = misses = nbytes = 0
        for key, out in zip(keys, outs):
            addr, cap, keep = _buffer_address(out, writable=True)
            r = None
            for _ in range(3):  # a concurrent overwrite may move the key: retry briefly
                found = self._lookup(key_digest(key))
                if found is None or found[2] > cap:
                    break
                if self._copy_out(found, [(addr, found[2])]):
                    r = found[2]
                    break
            del keep
            if r is None:
                misses += 1
            else:
                hits += 1
                nbytes += r
            res.append(r)
        self.count(hits=hits, misses=misses, bytes_read=nbytes)
        self.flush_counters()
        return res

    @_entry
    def get(self, key) -> bytes | None:
        """The value of `key`, or None."""
        d = key_digest(key)
        for _ in range(3):  # a concurrent overwrite may move the key: retry briefly
            found = self._lookup(d)
            if found is None:
                break
            buf = bytearray(found[2])
            addr, _, keep = _buffer_address(buf, writable=True)
            if self._copy_out(found, [(addr, found[2])]):
                del keep
                self.count(hits=1, bytes_read=found[2])
                self.flush_counters()
                return bytes(buf)
            del keep
        self.count(misses=1)
        self.flush_counters()
        return None

    @_entry
    def exists(self, key) -> bool:
        return self._lookup(key_digest(key)) is not None

    @_entry
    def batch_exists(self, keys: Iterable = (), *, digests=None) -> list[bool]:
        """Per key: is a committed value present? One vectorised pass, no locks."""
        return resolve(self, self._digest_batch(list(keys), digests), full=False).ok.tolist()

    @_entry
    def leading_hits(self, keys: Iterable = (), length: int | None = None, *, digests=None) -> int:
        """How many keys from the start are present (with exactly `length` bytes, if given).

        No locks; one fused pass over the home slots for a batch (resolve.leading_present).
        A caller that expects most prefixes to miss at once asks `length_of` for the
        first key before hashing the rest (MaruStorage.batch_exists does).
        """
        darr = self._digest_batch(list(keys), digests)
        if len(darr) == 1:
            found = self._lookup(darr[0].tobytes())
            return int(found is not None and (length is None or found[2] == length))
        return leading_present(self, darr, length)

    @_entry
    def length_of(self, key=None, *, digest: bytes | None = None) -> int | None:
        """Stored length of `key` (or of the value under a 16-byte `digest`), or None."""
        found = self._lookup(key_digest(key) if digest is None else bytes(digest))
        return None if found is None else found[2]

    # ---------------------------------------------------------------- write path
    def put(self, key, value) -> bool:
        """Store `value` (any contiguous buffer) under `key`; True once committed and visible.

        Raises ValueTooLargeError if no size class holds the value.
        """
        addr, n, keep = _buffer_address(value, writable=False)
        if n > self.geo.max_value:
            raise ValueTooLargeError(f"value of {n} bytes exceeds the pool's largest class ({self.geo.max_value})")
        ok = self.batch_put_pieces([key], [[(addr, n)]])[0]
        del keep
        return ok

    def put_pieces(self, key, pieces: Pieces) -> bool:
        """Store one value gathered from source pieces (address, nbytes) without an intermediate buffer.

        The addresses are raw pointers into this process's memory and cannot be checked: a bogus one
        crashes the process (SIGSEGV), as any memcpy would. Use put() for Python buffers.
        """
        return self.batch_put_pieces([key], [pieces])[0]

    def batch_put(self, keys: Sequence, values: Sequence, skip_existing: bool = False) -> list[bool]:
        keeps = [_buffer_address(v, writable=False) for v in values]
        res = self.batch_put_pieces(keys, [[(a, n)] for a, n, _ in keeps], skip_existing=skip_existing)
        del keeps
        return res

    @_entry
    def batch_put_pieces(self, keys: Sequence, pieces_list: Sequence[Pieces],
                         skip_existing: bool = False, *, digests=None, assume_absent: bool = False) -> list[bool]:
        """Store many values; per key True once committed and visible (or already present with skip_existing).

        With skip_existing the check is atomic: a key that another process
        publishes first, even while this call copies, keeps its value.
        assume_absent (with skip_existing) drops the lookup before the copy, for a caller that knows
        the keys are almost surely new: a present key is then still kept, by the check under its shard
        lock at publication, at the cost of one wasted copy.
        `digests` (an (n, 16) array or list of 16-byte digests) replaces hashing `keys`.
        """
        mine: dict[int, int] = {}  # offset -> word of each block this call owns and has not published
        try:
            return self._put_many(keys, pieces_list, skip_existing, mine, digests, assume_absent)
        except BaseException:
            self._settle(mine)  # e.g. LockTimeout on a shard lock after the copy: don't leak the blocks
            raise

    def _settle(self, mine: dict[int, int]) -> None:
        """A put raised midway: free the blocks it reserved or committed but did not publish (best effort)."""
        owner = self.slot + 1
        to_free = []
        for off, word in mine.items():
            m = self.alloc.meta_off(off)
            if U64.unpack_from(self.mm, m)[0] == word and U16.unpack_from(self.mm, m + 28)[0] == owner:
                to_free.append((off, word))  # still this lifetime and still ours: free it (word re-checked)
        try:
            self.alloc.free_blocks(to_free)
        except StoreError:
            pass  # still owned by this slot: close() or a reaper settles them

    def _put_many(self, keys: Sequence, pieces_list: Sequence[Pieces], skip_existing: bool,
                  mine: dict[int, int], digests=None, assume_absent: bool = False) -> list[bool]:
        """Reserve (class locks), copy and commit (no lock), publish (the batch's shard locks, taken together).

        Per-key Python is the cost on small pages, so every step that can be is
        one numpy operation over the batch: bounds checks, the commit of all
        block words (each an aligned 8-byte store, FORMAT.md section 8), the
        disown of all published blocks.
        """
        armed = _cp.ARMED  # crash-point hooks below cost one local test when unset
        darr = self._digest_batch(keys, digests)
        n = len(darr)
        if len(pieces_list) != n:
            raise ValueError(f"{len(pieces_list)} values for {n} keys")
        small = n <= SMALL_BATCH
        if small and isinstance(pieces_list, np.ndarray):
            pieces_list = pieces_list.tolist()  # the scalar path copies from Python ints
        table = None if small else PieceTable.of(pieces_list, n)
        lengths = piece_lengths(pieces_list) if small else table.lengths.tolist()
        halves = darr.view("<u8")
        res = [False] * n
        present = resolve(self, darr, full=False).ok.tolist() if skip_existing and not assume_absent else None
        groups: dict[int, tuple] = {}
        max_value = self.geo.max_value
        if not small and present is None and min(lengths) == max(lengths):  # a batch of pages: one class
            info = self.alloc.class_for(lengths[0]) if lengths[0] <= max_value else None
            if info is not None:
                _check_fits(info, lengths[0])
                groups[info.cid] = (info, list(range(n)))
        else:
            class_of: dict[int, object] = {}  # one class lookup per distinct length
            for i in range(n):
                if present is not None and present[i]:
                    res[i] = True
                    continue
                length = lengths[i]
                info = class_of.get(length, False)
                if info is False:
                    info = class_of[length] = self.alloc.class_for(length) if length <= max_value else None
                if info is not None:
                    _check_fits(info, length)
                    groups.setdefault(info.cid, (info, []))[1].append(i)
        owner = self.slot + 1
        lens_u = np.asarray(lengths, dtype=np.uint64)
        placed_i: list[int] = []
        placed_off: list[int] = []
        for info, idxs in groups.values():
            offs = self.alloc.allocate(info, halves[idxs], lens_u[idxs], owner)
            if len(offs) < len(idxs) and self.reap_dead(under_pressure=True):
                rest = idxs[len(offs):]
                offs += self.alloc.allocate(info, halves[rest], lens_u[rest], owner)
            placed_i += idxs[:len(offs)]
            placed_off += offs
            if armed is not None:
                _cp.hit("put.after_alloc")
        published: list[bool] = []
        to_free: list[tuple[int, int]] = []
        evicted = evicted_bytes = 0
        if placed_off:
            words = self.alloc.meta_words
            data_bytes, gran, mm = self.geo.data_bytes, self.geo.granule, self.mm
            data, memmove = self._data, ctypes.memmove
            if small:
                if min(placed_off) < 0 or max(off + lengths[i] for i, off in zip(placed_i, placed_off)) > data_bytes:
                    raise StoreError("internal error: block outside the data area")
                gidx = [off // gran for off in placed_off]
                reserved = [U64.unpack_from(mm, self.alloc.off_meta + gi * 32)[0] for gi in gidx]
                mine.update(zip(placed_off, reserved))
                # copy, without locks
                for i, off in zip(placed_i, placed_off):
                    dst = data + off
                    for addr, nb in pieces_list[i]:
                        memmove(dst, addr, nb)
                        dst += nb
                        if armed is not None:
                            _cp.hit("put.mid_copy")
            else:
                offs_a = np.array(placed_off, dtype=np.int64)
                if offs_a.min() < 0 or int((offs_a + table.lengths[placed_i]).max()) > data_bytes:
                    raise StoreError("internal error: block outside the data area")
                gidx = offs_a // gran
                reserved = words[gidx]
                mine.update(zip(placed_off, reserved.tolist()))
                # Everything the commit and the index insert need that the copy does not change is computed
                # now, while the caches still hold it: the batch's copy is larger than they are.
                live = (((reserved >> 2) + 1) << 2) | LIVE
                # placed_i is in key order when one class took every key (groups list a class's keys in order)
                ph = halves if len(groups) == 1 and len(placed_i) == n else halves[placed_i]
                shard_arr = (ph[:, 0] & self.index.smask_u).astype(np.int64)
                plan = (shard_arr, ph, offs_a.astype(np.uint64), self.index.home_plan(shard_arr, ph))
                # copy, without locks: one flat loop over every piece, as a plain copy would do
                dsts, srcs, nbs = table.scatter(placed_i, data + offs_a)
                if armed is None:
                    for dst, addr, nb in zip(dsts, srcs, nbs):
                        memmove(dst, addr, nb)
                else:
                    for dst, addr, nb in zip(dsts, srcs, nbs):
                        memmove(dst, addr, nb)
                        _cp.hit("put.mid_copy")
            # commit every copied block: RESERVED -> LIVE with the next sequence, one 8-byte store each
            if small:
                lives = [next_word(w, LIVE) for w in reserved]
                for gi, w in zip(gidx, lives):
                    store_u64(mm, self.alloc.off_meta + gi * 32, w)  # one 8-byte store each
                live = lives
            else:
                words[gidx] = live
                lives = live.tolist()
            mine.update(zip(placed_off, lives))
            if armed is not None:
                _cp.hit("put.before_index")
            published, to_free, evicted, evicted_bytes = self._publish(
                darr, placed_i, placed_off, gidx, live, lives, skip_existing, mine, res,
                None if small else plan)
        if not all(published):
            to_free += [(off, w) for off, w, p in zip(placed_off, lives, published) if not p]
            # still owned by us until freed: a crash here is reaped
        if armed is not None:
            _cp.hit("put.before_free")
        if to_free:
            self.alloc.free_blocks(to_free, keep=self.slot + 1)  # ours kept for our next puts of the class
        ok = sum(res)
        if len(placed_i) == n and all(published):  # the common case: every value placed and published
            written = sum(lengths)
        else:
            written = sum([lengths[i] for i, p in zip(placed_i, published) if p])
        self.count(puts=ok, put_failures=n - ok, evictions=evicted, evicted_bytes=evicted_bytes,
                   bytes_written=written)
        self.flush_counters()
        return res

    def _publish(self, darr, placed_i, placed_off, gidx, live, lives, skip_existing, mine, res, plan=None):
        """Index every committed block of a batch under all its shard locks at once (ascending, see locks.py).

        `plan` (batches): (shards, digest halves, offsets, Index.home_plan) of the placed keys, computed
        before the copy. Returns (published flags, blocks to free, evictions, evicted bytes).
        """
        mm, index, data_end = self.mm, self.index, self.geo.data_bytes
        small = plan is None
        if small:
            shards = [index.shard_of(darr[i].tobytes()) for i in placed_i]
            order = sorted(range(len(placed_i)), key=shards.__getitem__)
        else:
            shard_arr, ph, offs_u, home = plan
            shards = shard_arr.tolist()
            order = None  # ascending shard order, needed only if some key takes the scalar path
        npl = len(placed_i)
        published = [False] * npl
        to_free: list[tuple[int, int]] = []
        evicted = evicted_bytes = 0
        claim = self._claim_for_free
        with self.locks.hold_many(dense_range([SHARD_LOCK_BASE + s for s in shards]),
                                  repair_for=self._repair_shard_lock):
            if small:  # not freed under us (we are alive: never); every key by the scalar path
                slow = {k for k, gi in enumerate(gidx)
                        if U64.unpack_from(mm, self.alloc.off_meta + gi * 32)[0] == lives[k]}
                for k in slow:
                    del mine[placed_off[k]]  # from here on, close() or a reaper settles it, never _settle
            else:
                still = self.alloc.meta_words[gidx] == live
                if still.all():  # the common case: the batch as planned
                    cand = None
                    if len(mine) == npl:  # mine holds exactly this batch's blocks
                        mine.clear()
                    else:
                        for off in placed_off:
                            del mine[off]
                    fast = index.insert_absent(shard_arr, ph, live, offs_u, plan=home)
                else:
                    cand = np.flatnonzero(still)
                    for k in cand.tolist():
                        del mine[placed_off[k]]
                    fast = index.insert_absent(shard_arr[cand], ph[cand], live[cand], offs_u[cand],
                                               plan=(home[0][cand], home[1][cand]))
                if cand is None and fast.all():
                    published = [True] * npl
                    if npl == len(res):
                        res[:] = published
                    else:
                        for i in placed_i:
                            res[i] = True
                    slow = ()
                else:
                    if cand is None:
                        cand = np.arange(npl)
                    for k in cand[fast].tolist():
                        res[placed_i[k]] = published[k] = True
                    slow = set(cand[~fast].tolist())
            if slow and order is None:
                order = np.argsort(shard_arr, kind="stable").tolist()
            for k in ([k for k in order if k in slow] if slow else ()):
                i, off, s = placed_i[k], placed_off[k], shards[k]
                d = darr[i].tobytes()
                if skip_existing:
                    cur = index.find(d)
                    if cur is not None and self._entry_valid(d, cur[0], cur[1]):
                        res[i] = True  # someone published it first: theirs stays, ours is spare
                        continue
                rebuilt = False
                for _ in range(2 * index.slots):  # bounded, whatever the shard says
                    if not index.is_full(s):
                        break
                    victim = index.clock_victim(s, self.alloc.is_referenced, self.alloc.is_pinned)
                    if victim is None or index.find(victim[0]) != victim[1:]:
                        # A count above the entries present, or an entry its own probe cannot reach
                        # (damage: removing it would fail, forever): rebuild the shard, once.
                        if rebuilt:
                            break
                        self._shard_repair(s)()
                        rebuilt = True
                        continue
                    vd, vword, voff = victim
                    claim(voff, vword)
                    index.remove(s, vd)
                    to_free.append((voff, vword))
                    evicted += 1
                    if 0 <= voff < data_end:
                        m = self.alloc.meta_off(voff)
                        evicted_bytes += int.from_bytes(mm[m + 24:m + 28], "little")
                old = index.put(s, d, lives[k], off, on_replace=lambda w, o: claim(o, w))
                if old is not None:
                    to_free.append((old[1], old[0]))
                res[i] = published[k] = True
            # Disown what we published now, while the shard locks pin it: nobody can unpublish and
            # free it before we release them. Done after the locks (check, then clear), a replace +
            # free + re-reservation by another process could slip in between and we would wipe
            # *their* owner, making their in-flight block evictable under them.
            # A block this batch published and then replaced (a key named twice) is not disowned: it is
            # unindexed and waits in to_free, owned by us, so that a death before the free leaves it to the
            # reaper; disowned, it would be an orphan (LIVE, unowned, unindexed) that only repair frees.
            if to_free:
                replaced = {off for off, _ in to_free}
                published_now = [p and off not in replaced for p, off in zip(published, placed_off)]
            else:
                published_now = published
            if _cp.ARMED is not None:
                _cp.hit("put.before_disown")
            if small:
                for k, gi in enumerate(gidx):
                    if published_now[k]:
                        U16.pack_into(mm, self.alloc.off_meta + gi * 32 + 28, 0)
            elif all(published_now):
                self.alloc.meta_owners[gidx] = 0
            else:
                pub = np.flatnonzero(np.array(published_now, dtype=bool))
                if len(pub):
                    self.alloc.meta_owners[gidx[pub]] = 0
        return published, to_free, evicted, evicted_bytes

    def _repair_shard_lock(self, lock_id: int) -> None:
        self._shard_repair(lock_id - SHARD_LOCK_BASE)()

    def _claim_for_free(self, offset: int, word: int) -> None:
        """SHARD lock held, entry about to be removed: mark its block ours until we free it.

        Between unpublishing (shard lock) and freeing (class lock) the block is then
        owned by a live process, not an orphan; if we die there, reaping frees it.
        """
        if 0 <= offset < self.geo.data_bytes:
            m = self.alloc.meta_off(offset)
            if U64.unpack_from(self.mm, m)[0] == word:
                self.mm[m + 28:m + 30] = (self.slot + 1).to_bytes(2, "little")

    @_entry
    def pin(self, key) -> bool:
        """Keep the committed value of `key` out of eviction and slab moves; True if it is present.

        For the few small records a client cannot lose (MaruStorage's namespace nonce): values of at
        most one granule, of at most PIN_LIMIT keys per Store, so pins cannot fill a pool. The pin belongs
        to the value's block lifetime: an overwrite or delete of the key ends it (pin the new value).
        """
        d = key_digest(key)
        if d not in self._pins and len(self._pins) >= PIN_LIMIT:
            raise StoreError(f"this Store has pinned {PIN_LIMIT} keys already (the limit: pins are for a "
                             "few records a client cannot lose)")
        s = self.index.shard_of(d)
        with self.locks.hold(SHARD_LOCK_BASE + s, repair=self._shard_repair(s)):
            found = self._lookup(d)  # under the shard lock a published block cannot be freed or reused
            if found is None:
                return False
            offset, _, length, m = found
            if length > self.geo.granule:
                raise ValueTooLargeError(f"only values of at most {self.geo.granule} bytes can be pinned "
                                         f"({length} bytes under {key!r})")
            self.mm[m + META_FLAGS_OFF] = self.mm[m + META_FLAGS_OFF] | FLAG_PINNED
        self._pins.add(d)
        return True

    @_entry
    def delete(self, key) -> bool:
        """Remove `key`; True if it was present."""
        d = key_digest(key)
        s = self.index.shard_of(d)
        with self.locks.hold(SHARD_LOCK_BASE + s, repair=self._shard_repair(s)):
            cur = self.index.find(d)
            if cur is not None:
                self._claim_for_free(cur[1], cur[0])
            removed = self.index.remove(s, d)
        if removed is None:
            return False
        if _cp.ARMED is not None:
            _cp.hit("delete.before_free")
        self.alloc.free_blocks([(removed[1], removed[0])])
        return True

    # ---------------------------------------------------------------- inspection
    @_entry
    def check(self, repair: bool = False):
        """Full consistency check (see maru_shm.check); with repair=True fix what can be fixed."""
        from .check import check_store
        return check_store(self, repair=repair)

    @_entry
    def stats(self) -> dict:
        """Pool-wide figures: entries, live bytes, capacity, counters of all processes, index shape."""
        self.flush_counters()
        from .inspect import pool_stats
        return pool_stats(self)
