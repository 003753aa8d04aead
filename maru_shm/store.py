"""The public Store: one mapped pool file shared by every process that opens it.

A Store is an attachment of this process to a pool: it holds the mapping, a
process-table slot (and that slot's lock, which proves it alive), and the
per-process counters. Reads take no lock; writes take one class lock to
reserve blocks and one shard lock per index shard to publish them.

This module is the facade: it checks arguments, guards every call (calls.py) and hands the work to the
store's parts, each owning its own state: the attachment (mapping/), the process table, reaper and
counters (processes/), the read path, write path and publisher (datapath/).
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

from . import crashpoints as _cp
from .allocator import Allocator
from .allocator.policy import flags_for as eviction_flags
from .calls import OPEN_STORES, public_call
from .checks.figures import counters as pool_counters, pool_stats
from .checks.repair import check_store
from .copying.copyengine import CopyEngine, check_threads
from .copying.pieces import Pieces, buffer_address, writable_bytes
from .datapath.publish import Publisher
from .datapath.readpath import ReadPath
from .datapath.resolve import leading_present, resolve
from .datapath.writepath import WritePath
from .errors import StoreError, ValueTooLargeError
from .index import digest_array, key_digest
from .locking.guard import release_stranded as release_stranded_guards
from .locking.lockwait import check_timeout
from .mapping.attachment import Attachment
from .mapping.fence import CallFence
from .mapping.poolfile import PoolFile, open_pool_file
from .processes.counters import Counters
from .processes.proctable import ProcessTable
from .processes.reaper import Reaper
from .sizes import parse_size

CLOSE_WAIT = 30.0  # s close() waits for calls in flight (each is bounded by its lock timeouts)
PIN_LIMIT = 64  # values one Store may pin (Store.pin)


class AllocatorServices:
    """The store's side of allocator.host.AllocatorHost: what the allocator may ask of the layer above."""

    def __init__(self, att: Attachment, procs: ProcessTable, counters: Counters, publisher: Publisher):
        self.geo, self.mm, self.locks = att.geo, att.mm, att.locks
        self.count = counters.count
        self.slot_alive = procs.alive
        self.indexed_many = publisher.indexed_many
        self.unpublish_many = publisher.unpublish_many
        self._procs = procs

    @property
    def owner(self) -> int:
        return self._procs.owner


class Store:
    """A maru-shm pool attached to this process. Use `Store.open(...)`."""

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str, size=None, create: bool = False, *, mode: int = 0o600, timeout: float = 2.0,
             allow_foreign_owner: bool = False, granule: int | None = None, unit_size: int | None = None,
             max_value="64M", index_slots: int | None = None, index_shards: int = 64,
             proc_slots: int = 128, value_size=None, populate: bool = False,
             copy_threads: int | None = None, eviction: str = "count") -> "Store":
        """Open the pool at `path`, creating it with `size` bytes if `create` and it does not exist.

        Creation knobs (ignored for an existing pool, whose geometry is read from its header): granule
        (smallest block, default 4 KiB), unit_size (slab unit, default 256 KiB), max_value, index_slots,
        index_shards, proc_slots, and value_size: the smallest value the pool is for (a KV page), from which
        the granule and the index are sized unless given, so such values are stored without padding and fill
        the data area before the index (format.Geometry.plan; `geo.shortfalls(n)` checks an existing pool).

        populate=True backs the whole pool with memory now (fallocate on a regular file) and pre-faults this
        process's mapping, so no write pays a page fault; it costs the pool's size in RAM up front.

        copy_threads: threads that copy one batch (the caller's included), on cores that nothing but their
        copying keeps busy (idlecores.py); default: every core, at most 4; 1: the calling thread alone.

        eviction: the ref rule of a pool created now (FORMAT.md section 6), "count" (the CLOCK) or "age"
        (age stamps); an existing pool keeps its own, and `EvictionSettings.age` overrides this.
        """
        timeout = check_timeout(timeout)
        copy_threads = check_threads(copy_threads)
        if index_slots is not None and (type(index_slots) is not int or index_slots < 1):
            raise ValueError(f"index_slots must be a positive integer (or None to size it from the pool), "
                             f"got {index_slots!r}")
        size_b = parse_size(size) if size is not None else None
        plan = dict(granule=granule, unit_size=unit_size, max_value=parse_size(max_value),
                    index_slots=index_slots, index_shards=index_shards, proc_slots=proc_slots,
                    value_size=parse_size(value_size) if value_size is not None else None,
                    flags=eviction_flags(eviction))
        pf = open_pool_file(os.fspath(path), size=size_b, create=create, mode=mode, timeout=timeout,
                            allow_foreign_owner=allow_foreign_owner, plan_kwargs=plan)
        try:
            store = cls(pf, timeout, copy_threads)
        except BaseException:
            release_stranded_guards()
            pf.close()
            raise
        if populate:
            store.populate()
        return store

    def __init__(self, pf: PoolFile, timeout: float, copy_threads: int | None = None):
        self.created = pf.created
        self._closed = False
        self._forked = False
        self._pins: set[bytes] = set()  # digests of the keys this Store pinned (PIN_LIMIT)
        self._fence = CallFence()
        self._att = att = Attachment(pf, timeout)
        self._procs = ProcessTable(att)
        self._counters = Counters(self._procs, att.locks)
        self._publisher = Publisher(att, self._procs, self._counters)
        att.alloc = Allocator(AllocatorServices(att, self._procs, self._counters, self._publisher))
        self._kept = att.alloc.kept_blocks  # who in this process holds each block it owns
        self._reaper = Reaper(att, self._procs, self._counters)
        self._engine = CopyEngine(copy_threads)
        self._reader = ReadPath(att, self._engine, self._counters)
        self._writer = WritePath(att, self._engine, self._procs, self._counters, self._publisher, self._reaper.reap_dead)
        try:
            self._procs.attach(self._reaper.reap_dead)
            self._reaper.reap_dead()
        except BaseException:
            # Leave nothing behind: the slot, and the buffer exports that would make closing the map fail
            # (BufferError) and hide the real error. (The caller closes the PoolFile.)
            try:
                self._detach()
            finally:
                att.release(close_file=False)
            raise
        OPEN_STORES.add(self)

    # the attached pool, for the store's own modules and tools (read-only use)
    path = property(lambda self: self._att.path)
    mm = property(lambda self: self._att.mm)
    geo = property(lambda self: self._att.geo)
    locks = property(lambda self: self._att.locks)
    index = property(lambda self: self._att.index)
    alloc = property(lambda self: self._att.alloc)
    policy = property(lambda self: self._att.alloc.policy)  # the eviction decisions and their settings
    slot = property(lambda self: self._procs.slot)
    timeout = property(lambda self: self.locks.timeout)
    max_value = property(lambda self: self.geo.max_value)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<maru_shm.Store {self.path!r} slot={self.slot} {'closed' if self._closed else 'open'}>"

    @public_call
    def populate(self) -> None:
        """Allocate the pool's memory and pre-fault this process's page tables (contents unchanged)."""
        self._att.populate()

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Detach: publish counters, free the process slot, unmap. Idempotent; a close that an exception
        (KeyboardInterrupt) cut short finishes when called again. Waits for calls in flight in other
        threads (CLOSE_WAIT s at most): the mapping is never unmapped under a copy; a call that outlives
        the wait keeps the mapping alive (it is left to the process's exit) rather than faulting.
        """
        if self._closed:
            return
        try:
            self._close()
        except BaseException:
            release_stranded_guards()
            raise

    def _close(self) -> None:
        OPEN_STORES.discard(self)
        if self._forked:  # a forked child's slot and fence are its parent's: drop our copies only
            self._att.release()
            self._closed = True
            return
        if not self._fence.shut_and_wait(CLOSE_WAIT):
            self._closed = True
            return
        try:
            if self._att.released:
                pass  # a close cut short once its release began: a slot still claimed is left to the reaper
            elif self._att.damage is None:
                self._detach()
            else:  # never write into a damaged mapping: give up the slot's lock only
                self._procs.drop_slot_lock()
        finally:
            self._engine.close()
            self._att.release()
        self._closed = True

    def _detach(self) -> None:
        """Publish counters, settle the blocks our slot still owns (kept ones, any a failed settling left),
        retire the slot."""
        if self._procs.slot >= 0:
            self._counters.flush()
            self._procs.detach(self._reaper.settle)

    def lost(self) -> StoreError | None:
        """Why this store no longer serves the pool at its path, or None (Attachment.lost); one stat, no lock."""
        return self._att.lost()

    # ---------------------------------------------------------------- processes and counters
    @public_call
    def count_heal(self) -> None:
        """Count `heals` (FORMAT.md section 2): this process reopened this pool after losing its previous one."""
        self._procs.count_heal()

    @public_call
    def reap_dead(self) -> int:
        """Reclaim the slots and unpublished blocks of processes that died; returns slots reaped."""
        return self._reaper.reap_dead()

    def slot_alive(self, owner_plus1: int) -> bool:
        """Is the process whose owner id (slot + 1) this is alive? (Its SLOT lock is held while it lives.)
        The repair hands the store to the checks as their pool (checks/check.py check_domains), which ask it."""
        return self._procs.alive(owner_plus1)

    # ---------------------------------------------------------------- sizes
    @public_call
    def declare_size(self, nbytes: int) -> int:
        """Give values of exactly `nbytes` an exact-fit size class (e.g. a KV page); returns its class id."""
        return self.alloc.declare_exact(int(nbytes)).cid

    # ---------------------------------------------------------------- read path (lock-free)
    def get_pieces(self, key, pieces: Pieces) -> bool:
        """Load the value of `key` into destination pieces whose total length must equal it exactly.

        Raw pointers, as for put_pieces: a bogus address crashes the process. Use get_into() for buffers.
        """
        return self.batch_get_pieces([key], [pieces])[0]

    @public_call
    def batch_get_pieces(self, keys: Sequence, pieces_list: Sequence[Pieces], *, digests=None) -> list[bool]:
        """Load many values into destination pieces; per key True only if the stored length matches exactly.

        `pieces_list` is one list of (address, nbytes) per key, or an (n, k, 2) array
        (see maru_shm.copying.pieces). `digests` (an (n, 16) array or list of 16-byte digests)
        replaces hashing `keys`.
        """
        darr = _digest_batch(keys, digests)
        if len(pieces_list) != len(darr):
            raise ValueError(f"{len(pieces_list)} destinations for {len(darr)} keys")
        out = self._reader.get_batch(darr, pieces_list)
        self._counters.flush()
        return out

    @public_call
    def resolve(self, digests, full: bool = True):
        """Vectorised lock-free lookup of a batch of digests: ok mask, offsets, words, lengths (see resolve.py).

        full=False skips the block-start checks a copy needs: enough to ask "present, and how long?".
        """
        return resolve(self._att, digest_array(digests), full=full)

    @public_call
    def maybe_present(self, digests) -> np.ndarray:
        """Cheap, lock-free hint for a batch: False only where the digest's home slot is empty, which proves the
        key absent (backward-shift deletion keeps every entry's probe path from its home slot unbroken). True
        is "maybe present", also for a key displaced from its home slot: confirm with `resolve`. A writer that
        skips present keys asks this, so a present key never gets a block (nor makes room for one)."""
        halves = digest_array(digests).view("<u8")
        return self.index.home_entries(halves[:, 0], halves[:, 1])[:, 2] != 0

    @public_call
    def get_into(self, key, out) -> int | None:
        """Copy the value into writable buffer `out`; its length, or None on a miss or if `out` is too small."""
        view = writable_bytes(out)
        length = self._reader.get_one_into(key_digest(key), view)
        view.release()
        self._counters.count_get(length)
        return length

    @public_call
    def batch_get_into(self, keys: Sequence, outs: Sequence) -> list[int | None]:
        keys, outs = list(keys), list(outs)
        if len(keys) != len(outs):
            raise ValueError(f"{len(outs)} destination buffers for {len(keys)} keys")
        res: list[int | None] = []
        for key, out in zip(keys, outs):
            view = writable_bytes(out)
            res.append(self._reader.get_one_into(key_digest(key), view))
            view.release()
        hits = len(res) - res.count(None)
        self._counters.count(hits=hits, misses=len(res) - hits, bytes_read=sum([r for r in res if r]))
        self._counters.flush()
        return res

    @public_call
    def get(self, key) -> bytes | None:
        """The value of `key`, or None."""
        held: list[np.ndarray] = []

        def destination(n: int):
            held[:] = [np.empty(n, dtype=np.uint8)]
            return [(held[0].ctypes.data, n)]
        length = self._reader.get_one(key_digest(key), destination)
        self._counters.count_get(length)
        return None if length is None else held[0].tobytes()

    @public_call
    def exists(self, key) -> bool:
        return self._reader.lookup(key_digest(key)) is not None

    @public_call
    def batch_exists(self, keys: Iterable = (), *, digests=None) -> list[bool]:
        """Per key: is a committed value present? One vectorised pass, no locks."""
        return resolve(self._att, _digest_batch(list(keys), digests), full=False).ok.tolist()

    @public_call
    def leading_hits(self, keys: Iterable = (), length: int | None = None, *, digests=None) -> int:
        """How many keys from the start are present (with exactly `length` bytes, if given).

        No locks; one fused pass over the home slots for a batch (resolve.leading_present).
        A caller that expects most prefixes to miss at once asks `length_of` for the
        first key before hashing the rest (MaruStorage.batch_exists does).
        """
        darr = _digest_batch(list(keys), digests)
        if len(darr) == 1:
            hit = self._reader.lookup(darr[0].tobytes())
            return int(hit is not None and (length is None or hit.length == length))
        return leading_present(self._att, darr, length)

    @public_call
    def touch(self, digests, found=None) -> int:
        """Mark these digests' values used (the CLOCKs' ref counts) as a hit does, without copying; how many exist.
        `found`: `resolve(digests)`'s answer when the caller has one: no second lookup, its ok keys are marked."""
        return self._reader.touch(digest_array(digests), found)

    @public_call
    def length_of(self, key=None, *, digest: bytes | None = None) -> int | None:
        """Stored length of `key` (or of the value under a 16-byte `digest`), or None."""
        d = key_digest(key) if digest is None else bytes(digest)
        if len(d) != 16:
            raise ValueError(f"a digest is 16 bytes, got {len(d)}")
        hit = self._reader.lookup(d)
        return None if hit is None else hit.length

    # ---------------------------------------------------------------- write path
    def put(self, key, value) -> bool:
        """Store `value` (any contiguous buffer) under `key`; True once committed and visible.

        Raises ValueTooLargeError if no size class holds the value.
        """
        addr, n, keep = buffer_address(value, writable=False)
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
        keeps = [buffer_address(v, writable=False) for v in values]
        res = self.batch_put_pieces(keys, [[(a, n)] for a, n, _ in keeps], skip_existing=skip_existing)
        del keeps
        return res

    @public_call(owns_blocks=True)
    def batch_put_pieces(self, keys: Sequence, pieces_list: Sequence[Pieces],
                         skip_existing: bool = False, *, digests=None, assume_absent: bool = False,
                         written: list | None = None) -> list[bool]:
        """Store many values; per key True once committed and visible (or already present with skip_existing).

        With skip_existing the check is atomic: a key that another process
        publishes first, even while this call copies, keeps its value.
        assume_absent (with skip_existing) drops the lookup before the copy, for a caller that knows
        the keys are almost surely new: a present key is then still kept, by the check under its shard
        lock at publication, at the cost of one wasted copy.
        `digests` (an (n, 16) array or list of 16-byte digests) replaces hashing `keys`.
        `written`: a list this call appends how many values it published to (present keys skipped: not).
        """
        darr = digest_array(digests) if digests is not None else [key_digest(k) for k in keys]
        if len(pieces_list) != len(darr):
            raise ValueError(f"{len(pieces_list)} values for {len(darr)} keys")
        out = self._writer.put_batch(darr, pieces_list, skip_existing, assume_absent, written)
        self._counters.flush()
        return out

    @public_call
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
        if not self._publisher.pin(d, key):
            return False
        self._pins.add(d)
        return True

    @public_call(owns_blocks=True)
    def delete(self, key) -> bool:
        """Remove `key`; True if it was present."""
        removed = self._publisher.unpublish_key(key_digest(key))
        if removed is None:
            return False
        if _cp.ARMED is not None:
            _cp.hit("delete.before_free")
        self.alloc.free_blocks([(removed[1], removed[0])])
        return True

    # ---------------------------------------------------------------- inspection
    @public_call
    def check(self, repair: bool = False):
        """Full consistency check (see maru_shm.checks.repair); with repair=True fix what can be fixed."""
        return check_store(self, repair=repair)

    @public_call
    def counts(self) -> dict:
        """stats()'s counters alone (hits, misses, puts, evictions, ...): no scan, for every step of a loop."""
        self._counters.flush()
        return pool_counters(self)

    @public_call
    def stats(self) -> dict:
        """Pool-wide figures: entries, live bytes, capacity, counters of all processes, index shape."""
        self._counters.flush()
        return pool_stats(self)


def _digest_batch(keys, digests) -> np.ndarray:
    if digests is not None:
        return digest_array(digests)
    return digest_array([key_digest(k) for k in keys])
