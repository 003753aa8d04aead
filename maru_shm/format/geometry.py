"""Where each region of a pool lies in its file: the geometry planner, the superblock, its validation.

A Geometry is the superblock's immutable part (docs/FORMAT.md section 1): plan() lays the regions out for a
file size, read() parses and checks a superblock, validate() cross-checks the counts and offsets so that
later arithmetic cannot leave the mapping.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

from ..errors import CorruptPoolError, NotAPoolError, TruncatedPoolError, VersionError
from .layout import (CHECKSUM_OFF, CLASS_CAP, CLASS_ENTRY, DEFAULT_ENTRY_BYTES, DEFAULT_UNIT, ENTRY_SIZE,
                     FLAG_RETIRED, HEADER_READY_END, KIND_EXACT, LOCK_IDS, LOCK_RECORD, MAGIC, META_SIZE, MIN_GRANULE,
                     PROC_ENTRY, RETIRED_FIXED, RETIRED_PER_GRANULE, SHARD_HEADER, SHARD_LOCK_BASE, SLAB_ENTRY,
                     STATE_OFF, STATE_READY, SUPERBLOCK, SUPERBLOCK_FIELDS, SUPERBLOCK_SIZE, U32, VERSION,
                     granule_for, index_slots_for, shard_limit)
from .sizeclasses import KIND_GEOMETRIC, MAX_BLOCKS_PER_SLAB, geometric_sizes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _geometric_count(granule: int, max_value: int) -> int:
    return len(geometric_sizes(granule, max_value))


def _region_layout(proc_slots: int, n_units: int, index_shards: int, shard_slots: int, n_granules: int,
                   data_align: int, retired: bool) -> tuple:
    """The one home of the region layout (section 1): offsets of locks, classes, process table, slab table,
    shard headers, index, block metas and data, each region page-aligned, the data `data_align`-aligned.
    With `retired` (FLAG_RETIRED) the retired region sits between the block metas and the data."""
    page = 4096
    off_classes = _align(SUPERBLOCK_SIZE + LOCK_IDS * LOCK_RECORD.size, page)
    off_procs = _align(off_classes + CLASS_CAP * CLASS_ENTRY, page)
    off_slabs = _align(off_procs + proc_slots * PROC_ENTRY, page)
    off_shards = _align(off_slabs + n_units * SLAB_ENTRY, page)
    off_index = _align(off_shards + index_shards * SHARD_HEADER, page)
    off_meta = _align(off_index + index_shards * shard_slots * ENTRY_SIZE, page)
    end = off_meta + n_granules * META_SIZE
    if retired:
        end = _align(_align(end, page) + n_granules * RETIRED_PER_GRANULE, page) + RETIRED_FIXED
    off_data = _align(end, data_align)
    return (SUPERBLOCK_SIZE, off_classes, off_procs, off_slabs, off_shards, off_index, off_meta, off_data)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Immutable layout of one pool; the superblock's immutable part."""

    file_size: int
    granule: int
    unit_size: int
    n_units: int
    n_geo_classes: int
    class_cap: int
    proc_slots: int
    index_shards: int
    shard_slots: int
    max_value: int
    n_granules: int
    off_locks: int
    off_classes: int
    off_procs: int
    off_slabs: int
    off_shards: int
    off_index: int
    off_blockmeta: int
    off_data: int
    data_bytes: int
    created_ns: int
    pool_uuid: bytes
    flags: int = 0

    @property
    def index_slots(self) -> int:
        return self.index_shards * self.shard_slots

    @property
    def granule_shift(self) -> int:
        """log2 of the granule (a power of two, Geometry.plan): a data offset >> it is its granule's index."""
        return self.granule.bit_length() - 1

    def unit_offset(self, unit):
        """Data offset where unit `unit` (an int or an array) starts: a slab's first block, when it is a HEAD."""
        return unit * self.unit_size

    def block_offset(self, head, i, block):
        """Data offset of block `i` of the slab at unit `head`, whose blocks are `block` bytes (ints or arrays)."""
        return head * self.unit_size + i * block

    def meta_of(self, offset: int) -> int:
        """File offset of the block meta of the granule holding data offset `offset`."""
        return self.off_blockmeta + (offset // self.granule) * META_SIZE

    def slab_of(self, offset: int) -> int:
        """File offset of the slab table entry of the unit holding data offset `offset`."""
        return self.off_slabs + (offset // self.unit_size) * SLAB_ENTRY

    def slab_entry(self, unit: int) -> int:
        """File offset of the slab table entry of unit `unit`."""
        return self.off_slabs + unit * SLAB_ENTRY

    def slab_fits(self, head, k: int):
        """Does a slab of k units at unit `head` (an int, or an array of heads) end inside the data area?

        A HEAD entry is read from the file, so one whose slab runs past the end is damage: every reader of
        slab heads skips it (check() reports it, `check --repair` drops it); none follows its blocks out of
        the block metas.
        """
        return head + k <= self.n_units

    def class_fits(self, kind: int, k: int, block: int, bps: int) -> bool:
        """Is a class entry of this shape usable in this pool (section 4)? One read from the file that is not is
        damage: no reader allocates from it or counts its slabs."""
        return (kind in (KIND_GEOMETRIC, KIND_EXACT) and 0 < k <= self.n_units and 0 < block <= k * self.unit_size
                and 0 < bps <= MAX_BLOCKS_PER_SLAB and bps * block <= k * self.unit_size and block >= self.granule)

    def class_entry(self, cid: int) -> int:
        """File offset of class table entry `cid`."""
        return self.off_classes + cid * CLASS_ENTRY

    def slot_of(self, slot: int) -> int:
        """File offset of process table entry `slot`."""
        return self.off_procs + slot * PROC_ENTRY

    @staticmethod
    def plan(file_size: int, *, granule: int | None = None, unit_size: int | None = None,
             max_value: int = 64 << 20, index_slots: int | None = None,
             index_shards: int = 64, proc_slots: int = 128, data_align: int | None = None,
             flags: int = 0, n_geo_classes: int | None = None,
             value_size: int | None = None) -> "Geometry":
        """Lay out a pool of `file_size` bytes; raise ValueError if it cannot hold one unit.

        value_size: the smallest value the pool is for (a KV page). Unless given explicitly, the granule
        comes from it (granule_for) and the index holds a data area full of such values (index_slots_for),
        so the data area fills before any index shard does. Without it: 4 KiB granules, one index slot per
        16 KiB of data. The unit defaults to 256 KiB, or 256 granules when that is less.
        """
        if value_size is not None and (type(value_size) is not int or value_size < 1):
            raise ValueError(f"value_size must be a positive number of bytes, got {value_size!r}")
        if granule is None:
            granule = granule_for(value_size)
        if unit_size is None:
            unit_size = min(DEFAULT_UNIT, granule * MAX_BLOCKS_PER_SLAB)
        if not _is_pow2(granule) or granule < MIN_GRANULE:
            raise ValueError(f"granule must be a power of two >= 512, got {granule}")
        if not _is_pow2(unit_size) or unit_size < granule or unit_size > granule * MAX_BLOCKS_PER_SLAB:
            raise ValueError(
                f"unit_size must be a power of two between granule and 256 x granule, got {unit_size}")
        if not _is_pow2(index_shards) or index_shards > SHARD_LOCK_BASE * 2 - SHARD_LOCK_BASE:
            raise ValueError(f"index_shards must be a power of two <= 512, got {index_shards}")
        if not 1 <= proc_slots <= LOCK_IDS:
            raise ValueError(f"proc_slots must be in 1..{LOCK_IDS}, got {proc_slots}")
        if max_value < granule:
            raise ValueError("max_value must be at least one granule")
        if n_geo_classes is None:
            n_geo_classes = len(geometric_sizes(granule, max_value))
        if n_geo_classes > CLASS_CAP - 8:
            raise ValueError("max_value / granule span too wide for the class table")
        data_align = data_align or unit_size

        def layout(n_units: int, slots: int):
            shard_slots = max(16, slots // index_shards)
            n_granules = n_units * unit_size // granule
            offs = _region_layout(proc_slots, n_units, index_shards, shard_slots, n_granules, data_align,
                                  bool(flags & FLAG_RETIRED))
            return shard_slots, offs[4], offs[5], offs[6], n_granules, offs[7]

        def slots_for(n_units: int) -> int:
            data = n_units * unit_size
            want = index_slots if index_slots else max(index_shards * 64, data // DEFAULT_ENTRY_BYTES)
            if value_size is not None and not index_slots:  # a value takes one block, a granule at least
                want = max(want, index_slots_for(data // max(value_size, granule), index_shards))
            p = 1
            while p < want:
                p <<= 1
            return p

        def fits(n_units: int) -> bool:
            return layout(n_units, slots_for(n_units))[5] + n_units * unit_size <= file_size

        # Largest n_units whose layout fits: the per-unit cost bounds it from above, and fits() is monotone,
        # so a binary search finds it in O(log n) layouts whatever the size.
        per_unit = unit_size + SLAB_ENTRY + unit_size // granule * META_SIZE
        lo, hi = 0, max(0, file_size // per_unit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        n_units = lo
        if n_units <= 0:
            raise ValueError(f"a pool of {file_size} bytes cannot hold one {unit_size}-byte unit plus its header")
        if max_value > n_units * unit_size:
            max_value = n_units * unit_size
            n_geo_classes = len(geometric_sizes(granule, max_value))
        shard_slots, off_shards, off_index, off_meta, n_granules, off_data = layout(n_units, slots_for(n_units))
        off_locks, off_classes, off_procs, off_slabs = _region_layout(
            proc_slots, n_units, index_shards, shard_slots, n_granules, data_align, bool(flags & FLAG_RETIRED))[:4]
        return Geometry(
            file_size=file_size, granule=granule, unit_size=unit_size, n_units=n_units,
            n_geo_classes=n_geo_classes, class_cap=CLASS_CAP, proc_slots=proc_slots,
            index_shards=index_shards, shard_slots=shard_slots, max_value=max_value,
            n_granules=n_granules, off_locks=off_locks, off_classes=off_classes,
            off_procs=off_procs, off_slabs=off_slabs, off_shards=off_shards, off_index=off_index,
            off_blockmeta=off_meta, off_data=off_data, data_bytes=n_units * unit_size,
            created_ns=time.time_ns(), pool_uuid=os.urandom(16), flags=flags,
        )

    # -- superblock -------------------------------------------------------
    def pack_superblock(self) -> bytes:
        """Immutable part of the superblock, checksum included."""
        values = [MAGIC, VERSION] + [getattr(self, f) for f in SUPERBLOCK_FIELDS[2:]]
        body = SUPERBLOCK.pack(*values).ljust(CHECKSUM_OFF, b"\0")
        return body + U32.pack(zlib.crc32(body))

    @staticmethod
    def read(buf, actual_size: int) -> "Geometry":
        """Parse and validate the superblock in `buf`; raise a StoreError subclass if wrong."""
        if actual_size < SUPERBLOCK_SIZE:
            raise NotAPoolError(f"file is {actual_size} bytes, smaller than a pool header; not a maru-shm pool")
        raw = bytes(buf[:HEADER_READY_END])
        if raw[:8] != MAGIC:
            raise NotAPoolError("not a maru-shm pool (wrong magic); refusing to touch it")
        vals = dict(zip(SUPERBLOCK_FIELDS, SUPERBLOCK.unpack_from(raw, 0)))
        if vals["version"] != VERSION:
            raise VersionError(
                f"pool format version {vals['version']}, this maru_shm reads version {VERSION}: use a matching "
                "maru_shm, or re-create the pool (maru-shm destroy --force PATH, then create it)")
        (stored,) = U32.unpack_from(raw, CHECKSUM_OFF)
        if zlib.crc32(raw[:CHECKSUM_OFF]) != stored:
            raise CorruptPoolError("pool header checksum mismatch: the header is damaged; recreate the pool")
        (state,) = U32.unpack_from(raw, STATE_OFF)
        if state != STATE_READY:
            raise NotAPoolError("pool is not initialised (its creator did not finish); recreate it")
        vals.pop("magic")
        vals.pop("version")
        geo = Geometry(**vals)
        geo.validate()
        if actual_size < geo.file_size:
            raise TruncatedPoolError(
                f"file is {actual_size} bytes but the pool was created with {geo.file_size}: "
                "it was truncated; recreate the pool")
        return geo

    def _region_offsets(self) -> tuple:
        return (self.off_locks, self.off_classes, self.off_procs, self.off_slabs, self.off_shards,
                self.off_index, self.off_blockmeta, self.off_data)

    def _planned_offsets(self, data_align: int) -> tuple:
        """Where plan() puts the regions for these counts (data aligned to data_align: the unit, or 2 MiB on
        DAX). A header re-signed with a valid checksum cannot move a region without changing a count."""
        return _region_layout(self.proc_slots, self.n_units, self.index_shards, self.shard_slots, self.n_granules,
                              data_align, bool(self.flags & FLAG_RETIRED))


    def shortfalls(self, value_size: int) -> list[str]:
        """What keeps this pool from holding values of `value_size` bytes densely (empty: nothing), for a
        process whose values are smaller than the ones the pool was created for."""
        out = []
        if self.granule > granule_for(value_size):
            out.append(f"its granule is {self.granule} bytes, so a {value_size}-byte value takes a whole granule")
        fit = self.data_bytes // max(value_size, self.granule)  # a value takes one block, a granule at least
        if self.index_slots < index_slots_for(fit, self.index_shards):
            out.append(f"its index holds {shard_limit(self.shard_slots) * self.index_shards} entries, and "
                       f"{fit} such values fit its data area: the index would evict first")
        return out

    def validate(self) -> None:
        """Cross-check the geometry so later arithmetic cannot leave the mapping."""
        problems = []
        if not _is_pow2(self.granule) or not _is_pow2(self.unit_size) or self.unit_size < self.granule:
            problems.append("granule/unit size")
        if self.unit_size > self.granule * MAX_BLOCKS_PER_SLAB:
            problems.append("unit larger than 256 granules")
        if not _is_pow2(self.index_shards) or not _is_pow2(self.shard_slots):
            problems.append("index shape")
        if self.granule <= 0 or self.n_granules != self.n_units * self.unit_size // self.granule:
            problems.append("granule count")
        if self.data_bytes != self.n_units * self.unit_size:
            problems.append("data size")
        if not 0 < self.n_geo_classes <= self.class_cap == CLASS_CAP:
            problems.append("class table")
        if not self.granule <= self.max_value <= self.data_bytes:
            problems.append("largest value")
        elif _is_pow2(self.granule) and self.n_geo_classes != _geometric_count(self.granule, self.max_value):
            problems.append("geometric class count")
        if not 0 < self.proc_slots <= LOCK_IDS:
            problems.append("process table")
        if self.index_shards > SHARD_LOCK_BASE:
            problems.append("shard count")
        order = [
            (self.off_locks, LOCK_IDS * LOCK_RECORD.size), (self.off_classes, CLASS_CAP * CLASS_ENTRY),
            (self.off_procs, self.proc_slots * PROC_ENTRY), (self.off_slabs, self.n_units * SLAB_ENTRY),
            (self.off_shards, self.index_shards * SHARD_HEADER),
            (self.off_index, self.index_slots * ENTRY_SIZE),
            (self.off_blockmeta, self.n_granules * META_SIZE),
        ]
        order.append((self.off_data, self.data_bytes))
        end = SUPERBLOCK_SIZE
        for off, size in order:
            if off < end:
                problems.append(f"region at {off} overlaps")
            end = off + size
        if end > self.file_size:
            problems.append("regions extend past the file size")
        if not problems and self._region_offsets() not in (self._planned_offsets(self.unit_size),
                                                           self._planned_offsets(2 << 20)):
            problems.append("regions not where the counts put them")
        if problems:
            raise CorruptPoolError("pool geometry is inconsistent (" + ", ".join(problems) + "); recreate the pool")
