"""Every record of a pool file, declared once, exactly as docs/FORMAT.md describes it.

Everything that knows a byte offset inside a record lives here, so the format has one home: each record's
declaration (its offsets, structs and columns derived), the lock ids, the block meta word and its length
check. Where the records lie in the file is geometry.py's.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from .sizeclasses import KIND_GEOMETRIC, MAX_BLOCKS_PER_SLAB
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
# the immutable part of the superblock, magic to pool_uuid: what Geometry packs and reads
SUPERBLOCK = record_struct(SUPERBLOCK_LAYOUT, "magic", "pool_uuid")
SUPERBLOCK_FIELDS = SUPERBLOCK_LAYOUT.names[:SUPERBLOCK_LAYOUT.names.index("pool_uuid") + 1]
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
