"""On-file layout of a pool, exactly as docs/FORMAT.md describes it.

Everything that knows a byte offset inside the header lives here, so the
format has one home: structs for each record, the geometry planner that lays
out the regions for a given file size, and superblock validation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
import time
import zlib

import numpy as np

from .sizeclasses import KIND_GEOMETRIC, MAX_BLOCKS_PER_SLAB, geometric_sizes
from .errors import CorruptPoolError, NotAPoolError, TruncatedPoolError, VersionError
from .records import field_column, field_off, field_size, record, record_struct


# --- records -------------------------------------------------------------
# Each mapped record is declared once, below, as a numpy structured dtype listing every field in file
# order, reserved bytes included (records.py: the offsets follow from the sizes, no field is placed by
# hand). Every offset, size, struct and column used anywhere is derived from these declarations.

MAGIC = b"MARUSHM\0"
VERSION = 2  # 2: the locks live in the pool's lock file (section 3); a block's flags hold its length check
COUNTER_NAMES = (
    "puts", "put_failures", "hits", "misses", "evictions", "evicted_bytes",
    "slab_moves", "lock_timeouts", "repairs", "bytes_written", "bytes_read",
    "orphans_freed",
)
N_COUNTERS = len(COUNTER_NAMES)
RETIRED_SLOTS = 16  # retired counters in the superblock (N_COUNTERS used, the rest zero)

SUPERBLOCK_LAYOUT = record(
    4096,
    # immutable, covered by the checksum
    ("magic", "S8"), ("version", "<u4"), ("flags", "<u4"), ("file_size", "<u8"), ("granule", "<u4"),
    ("unit_size", "<u4"), ("n_units", "<u4"), ("n_geo_classes", "<u4"), ("class_cap", "<u4"),
    ("proc_slots", "<u4"), ("index_shards", "<u4"), ("shard_slots", "<u4"), ("max_value", "<u8"),
    ("n_granules", "<u8"), ("off_locks", "<u8"), ("off_classes", "<u8"), ("off_procs", "<u8"),
    ("off_slabs", "<u8"), ("off_shards", "<u8"), ("off_index", "<u8"), ("off_blockmeta", "<u8"),
    ("off_data", "<u8"), ("data_bytes", "<u8"), ("created_ns", "<u8"), ("pool_uuid", "S16"),
    ("reserved_immutable", "V84"), ("checksum", "<u4"),
    # mutable
    ("state", "<u4"),
    ("slab_hand", "<u4"),        # hint, no lock: where the slab CLOCK resumes
    ("classes_version", "<u4"),  # CLASSTAB: bumped when an exact-fit class is declared
    ("reserved_268", "V4"),
    ("retired", "<u8", (RETIRED_SLOTS,)),  # PROC: counters of processes that detached or were reaped
    ("demand_epoch", "<u4"),     # hint, no lock: class demand counters halve once per epoch
    ("reserved_404", "V4"),
    ("demand_acc", "<u8"),       # hint, no lock: bytes allocated since the epoch began
    ("free_floor", "<u4"),       # hint, POOL: no unit below it is FREE: where the search for free units starts
    ("age_tick", "<u4"),         # hint, no lock: the age clock of a pool with FLAG_AGE (section 6)
    ("heals", "<u8"),            # PROC: processes that attached after losing their previous pool
    ("lock_boot", "S16"),        # INIT: boot id of the boot in which the lock file was made to name this pool
    ("lock_dev", "<u8"),         # INIT: st_dev and st_ino of the lock file this pool was made (or adopted) with
    ("lock_ino", "<u8"),
    ("reserved_tail", "V3632"),
)
SUPERBLOCK_SIZE = SUPERBLOCK_LAYOUT.itemsize
CHECKSUM_OFF = field_off(SUPERBLOCK_LAYOUT, "checksum")
STATE_OFF = field_off(SUPERBLOCK_LAYOUT, "state")
HEADER_READY_END = STATE_OFF + field_size(SUPERBLOCK_LAYOUT, "state")  # the immutable part and the state word
SLAB_HAND_OFF = field_off(SUPERBLOCK_LAYOUT, "slab_hand")
CLASSES_VERSION_OFF = field_off(SUPERBLOCK_LAYOUT, "classes_version")
RETIRED_OFF = field_off(SUPERBLOCK_LAYOUT, "retired")
DEMAND_EPOCH_OFF = field_off(SUPERBLOCK_LAYOUT, "demand_epoch")
DEMAND_ACC_OFF = field_off(SUPERBLOCK_LAYOUT, "demand_acc")
FREE_FLOOR_OFF = field_off(SUPERBLOCK_LAYOUT, "free_floor")
AGE_TICK_OFF = field_off(SUPERBLOCK_LAYOUT, "age_tick")
HEALS_OFF = field_off(SUPERBLOCK_LAYOUT, "heals")
LOCK_BOOT_OFF = field_off(SUPERBLOCK_LAYOUT, "lock_boot")
LOCK_IDENTITY_OFF = field_off(SUPERBLOCK_LAYOUT, "lock_dev")
LOCK_IDENTITY = record_struct(SUPERBLOCK_LAYOUT, "lock_dev", "lock_ino")  # (0, 0): not recorded (an older pool)
POOL_UUID_OFF = field_off(SUPERBLOCK_LAYOUT, "pool_uuid")  # read raw by whoever matches a lock file to its pool
STATE_READY = 2

FLAG_DEVICE = 1
# Pools made by versions with relation records: their region (16 B a granule, then 32 KiB, each page-aligned)
# lies unused between the block metas and the data. No new pool sets it.
FLAG_RETIRED = 2
RETIRED_PER_GRANULE, RETIRED_FIXED = 16, 32 << 10
FLAG_AGE = 4  # a block's meta `ref` is an age stamp, not a count (section 6)

# --- locks ---------------------------------------------------------------
# Every lock is one byte at LOCK_BASE + id of the pool's lock file, which starts with LOCK_FILE_HEAD:
# LOCK_FILE_MAGIC, then the pool_uuid of the pool it serves (written under INIT by the creator).
LOCK_FILE_MAGIC = b"MARULOCK"
LOCK_FILE_HEAD = struct.Struct("<8s16s")
LOCK_BASE = 1 << 40
LOCK_IDS = 2048
LOCK_INIT, LOCK_PROC, LOCK_CLASSTAB, LOCK_POOL = 0, 1, 2, 3
CLASS_LOCK_BASE = 16
SHARD_LOCK_BASE = 512
SLOT_LOCK_BASE = 2048
LOCK_LAYOUT = record(8, ("dirty", "<u4"), ("op", "<u4"))
LOCK_RECORD = record_struct(LOCK_LAYOUT, "dirty", "op")
LOCK_COL_DIRTY = field_column(LOCK_LAYOUT, "dirty", 4)  # in a view of the records as u32 rows
LOCK_COL_OP = field_column(LOCK_LAYOUT, "op", 4)

# --- class table ---------------------------------------------------------
CLASS_CAP = 256
CLASS_LAYOUT = record(
    64, ("kind", "<u4"), ("slab_units", "<u4"), ("block_size", "<u8"), ("blocks_per_slab", "<u4"),
    ("partial_head", "<u4"), ("nslabs", "<u4"), ("used_blocks", "<u4"), ("declared_ns", "<u8"),
    ("hand", "<u8"),          # block CLOCK hand
    ("demand", "<u8"),        # decayed demand
    ("demand_epoch", "<u4"),  # the epoch of `demand`
    ("reserved_60", "V4"),
)
CLASS_ENTRY = CLASS_LAYOUT.itemsize
CLASS_STRUCT = record_struct(CLASS_LAYOUT, "kind", "declared_ns")
CLS_KIND, CLS_K, CLS_BLOCK, CLS_BPS = (field_off(CLASS_LAYOUT, f)
                                       for f in ("kind", "slab_units", "block_size", "blocks_per_slab"))
CLS_PARTIAL, CLS_NSLABS, CLS_USED, CLS_DECLARED = (field_off(CLASS_LAYOUT, f)
                                                   for f in ("partial_head", "nslabs", "used_blocks", "declared_ns"))
CLS_HAND, CLS_DEMAND, CLS_DEMAND_EPOCH = (field_off(CLASS_LAYOUT, f) for f in ("hand", "demand", "demand_epoch"))
KIND_UNUSED, KIND_EXACT = 0, 2
KIND_GEOMETRIC = KIND_GEOMETRIC  # defined with the size classes (sizeclasses.py), a kind like the others

# --- process table -------------------------------------------------------
PROC_LAYOUT = record(
    128, ("state", "<u4"), ("pid", "<u4"), ("start_ticks", "<u8"), ("attach_ns", "<u8"), ("uid", "<u4"),
    ("reserved_28", "V4"), ("counters", "<u8", (N_COUNTERS,)),
)
PROC_ENTRY = PROC_LAYOUT.itemsize
PROC_HEAD = record_struct(PROC_LAYOUT, "state", "uid")
PROC_COUNTERS_OFF = field_off(PROC_LAYOUT, "counters")
COUNTERS = record_struct(PROC_LAYOUT, "counters", "counters")
COUNTER_SIZE = COUNTERS.size // N_COUNTERS

# --- slab table ----------------------------------------------------------
SLAB_LAYOUT = record(
    64, ("state", "<u4"), ("cls", "<u4"), ("next", "<u4"), ("prev", "<u4"), ("nfree", "<u4"), ("nblocks", "<u4"),
    ("ref", "u1"), ("in_partial", "u1"), ("reserved_26", "V6"), ("bitmap", "V%d" % (MAX_BLOCKS_PER_SLAB // 8)),
)
SLAB_ENTRY = SLAB_LAYOUT.itemsize
SLAB_HEAD = record_struct(SLAB_LAYOUT, "state", "nblocks")
SLAB_STATE, SLAB_CLS, SLAB_NEXT, SLAB_PREV, SLAB_NFREE, SLAB_NBLOCKS = (
    field_off(SLAB_LAYOUT, f) for f in ("state", "cls", "next", "prev", "nfree", "nblocks"))
SLAB_REF, SLAB_INPARTIAL, SLAB_BITMAP = (field_off(SLAB_LAYOUT, f) for f in ("ref", "in_partial", "bitmap"))
BITMAP_BYTES = field_size(SLAB_LAYOUT, "bitmap")
UNIT_FREE, UNIT_HEAD, UNIT_TAIL = 0, 1, 2

# --- index ---------------------------------------------------------------
SHARD_LAYOUT = record(16, ("count", "<u4"), ("hand", "<u4"), ("reserved_8", "V8"))
SHARD_HEADER = SHARD_LAYOUT.itemsize
SHARD_STRUCT = record_struct(SHARD_LAYOUT, "count", "hand")
SHARD_COUNT_OFF = field_off(SHARD_LAYOUT, "count")
ENTRY_LAYOUT = record(32, ("digest", "S16"), ("word", "<u8"), ("offset", "<u8"))
ENTRY_SIZE = ENTRY_LAYOUT.itemsize
ENTRY_STRUCT = record_struct(ENTRY_LAYOUT, "digest", "offset")
ENTRY_WORD_OFF, ENTRY_OFFSET_OFF = field_off(ENTRY_LAYOUT, "word"), field_off(ENTRY_LAYOUT, "offset")
# the index as rows of u64 (numpy batch passes): columns of the digest halves, the word and the offset
ENTRY_COL_DIGEST, ENTRY_COL_WORD, ENTRY_COL_OFFSET = (field_column(ENTRY_LAYOUT, f, 8)
                                                      for f in ("digest", "word", "offset"))
ENTRY_COLS = ENTRY_SIZE // 8


def shard_limit(shard_slots: int) -> int:
    """Most entries a shard holds (7/8 of its slots): a writer at the limit evicts a cold entry first."""
    return shard_slots * 7 // 8


def index_slots_for(entries: int, index_shards: int) -> int:
    """Index slots (before rounding up to a power of two) that hold `entries` keys below every shard's load
    limit: keys spread over the shards by hash, so each shard gets its mean plus four standard deviations."""
    mean = entries / index_shards
    need = math.ceil(mean + 4 * math.sqrt(mean))
    return index_shards * -(-need * 8 // 7)


# --- creation defaults ---------------------------------------------------
DEFAULT_GRANULE = 4096
MIN_GRANULE = 512
DEFAULT_UNIT = 256 << 10
DEFAULT_ENTRY_BYTES = 16 << 10  # index slots per data byte when no value size is given (section 7)


def granule_for(value_size: int | None) -> int:
    """The granule of a pool whose smallest value is `value_size` bytes: 4 KiB, or the largest power of two not
    above a smaller value (512 B at least). A value below the granule takes a whole granule; at or above it,
    an exact-fit class of its own size holds it without padding."""
    if value_size is None or value_size >= DEFAULT_GRANULE:
        return DEFAULT_GRANULE
    return max(MIN_GRANULE, 1 << (max(1, value_size).bit_length() - 1))

# --- block meta ----------------------------------------------------------
META_LAYOUT = record(32, ("word", "<u8"), ("digest", "S16"), ("length", "<u4"), ("owner", "<u2"), ("ref", "u1"),
                      ("flags", "u1"))
META_SIZE = META_LAYOUT.itemsize
META_STRUCT = record_struct(META_LAYOUT, "word", "flags")
META_DIGEST_OFF, META_LENGTH_OFF, META_OWNER_OFF, META_REF_OFF, META_FLAGS_OFF = (
    field_off(META_LAYOUT, f) for f in ("digest", "length", "owner", "ref", "flags"))
# Block metas as rows of u64 (numpy batch passes): the word, the digest halves, and the tail (length, owner,
# ref and flags: the last u64), each field of the tail at its bit shift in it.
META_COL_WORD, META_COL_DIGEST = field_column(META_LAYOUT, "word", 8), field_column(META_LAYOUT, "digest", 8)
META_COL_TAIL = META_LENGTH_OFF // 8
META_COLS = META_SIZE // 8
assert META_LENGTH_OFF % 8 == 0 and META_FLAGS_OFF + 1 == META_SIZE == (META_COL_TAIL + 1) * 8
META_TAIL_OWNER_SHIFT, META_TAIL_REF_SHIFT, META_TAIL_FLAGS_SHIFT = (
    (off - META_LENGTH_OFF) * 8 for off in (META_OWNER_OFF, META_REF_OFF, META_FLAGS_OFF))
META_TAIL_LENGTH_MASK = (1 << 8 * field_size(META_LAYOUT, "length")) - 1
FLAG_PINNED = 1  # meta flags bit 0: eviction and slab moves leave this lifetime alone (Store.pin)
# Meta `ref`: the block CLOCK's count. A hit or a touch raises it by one up to REF_MAX, the hand lowers it by
# one as it passes: a value hit again before the hand comes back outlives one hit once. In a pool with FLAG_AGE
# it is an age stamp instead: the low byte of `age_tick` at the last write or hit.
REF_MAX = 2
AGE_TICKS = 64  # a pool with FLAG_AGE: `age_tick` advances once per data_bytes / AGE_TICKS bytes allocated
AGE_CLAMP = 128  # ... and a stamp is never more than this many ticks old (section 6)
FREE, RESERVED, LIVE = 0, 1, 2

# Meta flags bits 1-7 hold the length check, 3 x length mod 125: any one or two flipped bits of the
# 39 (length and check) make the pair disagree, and every reader and check takes the block as damage.
# Two bits of the length change it by +-2^i +-2^j, never a multiple of 125 for i, j < 32 (2 has order
# 100 mod 125, and -1 = 2^50); a bit of each matches only if 3 = +-2^(j-i) mod 125 for a check bit
# j < 7, and 3 = 2^7, -3 = 2^57; a changed check alone differs from the unchanged one it must equal.
LENGTH_CHECK_MUL, LENGTH_CHECK_MOD, LENGTH_CHECK_SHIFT = 3, 125, 1
LENGTH_CHECK_BITS = 0x7F << LENGTH_CHECK_SHIFT  # the flags bits that hold it


def length_check(length):
    """The check of a length (an int, or a numpy u64 array of them): flags >> LENGTH_CHECK_SHIFT holds it."""
    return length * LENGTH_CHECK_MUL % LENGTH_CHECK_MOD


def length_flags(length):
    """The flags byte of a new lifetime holding `length` bytes (not pinned): its length check."""
    return length_check(length) << LENGTH_CHECK_SHIFT


def length_sound(length: int, flags: int) -> bool:
    """Does a meta's length agree with the check in its flags byte?"""
    return flags >> LENGTH_CHECK_SHIFT == length_check(length)

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
U16 = struct.Struct("<H")


def next_word(word: int, state: int) -> int:
    """The block meta word of the next lifetime: counter + 1 (wrapping at 62 bits: a damaged word may
    hold any value, and a word must stay a u64), then the new state."""
    return ((((word >> 2) + 1) << 2) & 0xFFFF_FFFF_FFFF_FFFC) | state


def next_words(words, state: int):
    """next_word over a uint64 array (the u64 arithmetic wraps as the mask does)."""
    return (((words >> np.uint64(2)) + np.uint64(1)) << np.uint64(2)) | np.uint64(state)


def store_u64(buf, off: int, value: int) -> None:
    """Store an aligned little-endian u64 as one 8-byte write (a block meta or index entry word).

    Never `U64.pack_into` for a word another process may read without our lock: struct zero-fills
    its target first and then writes byte by byte, so a concurrent reader can see 0 (= FREE, or an
    empty index slot) or a partial value. A slice assignment is one 8-byte memcpy, which x86-64
    performs as whole aligned stores: a reader sees the old word or the new one.
    """
    buf[off:off + 8] = value.to_bytes(8, "little")

SUPERBLOCK = record_struct(SUPERBLOCK_LAYOUT, "magic", "pool_uuid")
_SB_FIELDS = SUPERBLOCK_LAYOUT.names[:SUPERBLOCK_LAYOUT.names.index("pool_uuid") + 1]


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
        values = [MAGIC, VERSION] + [getattr(self, f) for f in _SB_FIELDS[2:]]
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
        vals = dict(zip(_SB_FIELDS, SUPERBLOCK.unpack_from(raw, 0)))
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
