"""File format: geometry planning, superblock round trip, validation of what an opener finds."""

from __future__ import annotations

import os
import stat
import struct
import time
import zlib

import pytest

from maru_shm import (CorruptPoolError, remove_pool, NotAPoolError, PermissionDeniedError, SizeMismatchError, Store,
                      StoreError, TruncatedPoolError, VersionError)
from maru_shm.format.layout import (CHECKSUM_OFF, CLASS_CAP, CLASS_ENTRY, ENTRY_SIZE, LOCK_IDS, LOCK_RECORD, MAGIC,
                                    META_SIZE, PROC_ENTRY, SHARD_HEADER, SLAB_ENTRY, STATE_OFF, STATE_READY,
                                    SUPERBLOCK_SIZE, U32, VERSION, granule_for, shard_limit)
from maru_shm.format.geometry import Geometry

MiB = 1 << 20
GiB = 1 << 30


def regions(g: Geometry):
    """(name, start, size) of every region, in file order."""
    return [
        ("superblock", 0, SUPERBLOCK_SIZE),
        ("locks", g.off_locks, LOCK_IDS * LOCK_RECORD.size),
        ("classes", g.off_classes, CLASS_CAP * CLASS_ENTRY),
        ("procs", g.off_procs, g.proc_slots * PROC_ENTRY),
        ("slabs", g.off_slabs, g.n_units * SLAB_ENTRY),
        ("shards", g.off_shards, g.index_shards * SHARD_HEADER),
        ("index", g.off_index, g.index_slots * ENTRY_SIZE),
        ("blockmeta", g.off_blockmeta, g.n_granules * META_SIZE),
        ("data", g.off_data, g.data_bytes),
    ]


# ---------------------------------------------------------------- geometry planning

@pytest.mark.parametrize("size,kw", [
    (2 * MiB, {}),
    (16 * MiB, {}),
    (100 * MiB + 12345, {}),
    (1 * GiB, {}),
    (64 * GiB, {}),
    (256 * MiB, dict(granule=512, unit_size=128 << 10)),
    (256 * MiB, dict(unit_size=2 * MiB, granule=8192, index_shards=8, proc_slots=2048)),
    (512 * MiB, dict(data_align=2 * MiB)),  # DAX alignment
    (300 * MiB, dict(index_slots=1 << 20, max_value=8 * GiB)),
])
def test_plan_regions_disjoint_aligned_and_inside_file(size, kw):
    g = Geometry.plan(size, **kw)
    g.validate()
    end = 0
    for name, start, length in regions(g):
        assert start >= end, f"{name} at {start} overlaps the previous region ending at {end}"
        assert start % 4096 == 0, f"{name} not page aligned"
        end = start + length
    assert end <= size, "regions extend past the file"
    assert g.file_size == size
    align = kw.get("data_align", g.unit_size)
    assert g.off_data % align == 0 and g.off_data % g.unit_size == 0
    assert g.data_bytes == g.n_units * g.unit_size
    assert g.n_granules == g.data_bytes // g.granule
    assert g.index_shards & (g.index_shards - 1) == 0 and g.shard_slots & (g.shard_slots - 1) == 0
    assert g.granule <= g.max_value <= g.data_bytes
    if size >= 256 * MiB:  # headers are small (block metas: 32 B per granule): the data area is nearly all
        room = size - g.index_slots * ENTRY_SIZE
        assert g.data_bytes >= 0.97 * room * g.granule / (g.granule + META_SIZE)


def test_plan_uses_the_space_it_has():
    """No extra unit would have fit: the tail after the data area is less than a unit plus its header."""
    for size in (8 * MiB, 333 * MiB, 1 * GiB):
        g = Geometry.plan(size)
        per_unit = g.unit_size + SLAB_ENTRY + g.unit_size // g.granule * META_SIZE
        slack = size - (g.off_data + g.data_bytes)
        # alignment of the data area may cost up to one unit; the index may double once
        assert slack < 2 * per_unit + g.index_slots * ENTRY_SIZE, (size, slack)


@pytest.mark.parametrize("size", [16 * MiB, 256 * MiB, 4 * GiB])
@pytest.mark.parametrize("value", [1, 300, 1024, 1152, 3000, 8192, 131072])
def test_a_pool_planned_for_a_value_size_holds_such_values_densely(size, value):
    """A value at or above the granule gets an exact-fit block of its own size, and the index holds a data area
    full of such values with every shard below its load limit (four standard deviations of hash imbalance)."""
    g = Geometry.plan(size, value_size=value)
    g.validate()
    assert g.granule == granule_for(value) and g.unit_size <= 256 * g.granule
    assert g.granule <= value or g.granule == 512
    assert g.shortfalls(value) == []
    mean = g.data_bytes // max(value, g.granule) / g.index_shards  # a value takes one block, a granule at least
    assert shard_limit(g.shard_slots) >= mean + 4 * mean ** 0.5
    default = Geometry.plan(size)
    assert g.index_slots >= default.index_slots and g.granule <= default.granule
    assert g.data_bytes >= 0.75 * size


def test_a_pool_planned_without_a_value_size_names_what_small_values_lack():
    g = Geometry.plan(256 * MiB)
    assert (g.granule, g.unit_size) == (4096, 256 << 10)
    assert g.shortfalls(128 << 10) == []
    granule, index = g.shortfalls(1024)
    assert "1024-byte value takes a whole granule" in granule and "index would evict first" in index
    assert granule_for(None) == granule_for(1 << 20) == 4096 and granule_for(1) == 512


@pytest.mark.parametrize("size,kw", [
    (64 << 10, {}),  # cannot hold one unit plus header
    (64 * MiB, dict(value_size=0)),
    (64 * MiB, dict(value_size=1.5)),
    (64 * MiB, dict(granule=3000)),
    (64 * MiB, dict(granule=256)),
    (64 * MiB, dict(unit_size=4096 * 512)),  # unit > 256 granules
    (64 * MiB, dict(unit_size=3 << 20)),
    (64 * MiB, dict(index_shards=24)),
    (64 * MiB, dict(index_shards=1024)),
    (64 * MiB, dict(proc_slots=0)),
    (64 * MiB, dict(max_value=1024)),
])
def test_plan_rejects_impossible_shapes(size, kw):
    with pytest.raises(ValueError):
        Geometry.plan(size, **kw)


def test_superblock_round_trip():
    g = Geometry.plan(1 * GiB, flags=1)
    sb = g.pack_superblock()
    assert len(sb) == CHECKSUM_OFF + 4
    assert sb[:8] == MAGIC and U32.unpack_from(sb, 8)[0] == VERSION
    buf = bytearray(SUPERBLOCK_SIZE)
    buf[:len(sb)] = sb
    U32.pack_into(buf, STATE_OFF, STATE_READY)
    assert Geometry.read(buf, g.file_size) == g
    # the immutable part is exactly what the checksum covers
    assert zlib.crc32(bytes(buf[:CHECKSUM_OFF])) == U32.unpack_from(buf, CHECKSUM_OFF)[0]


def test_superblock_read_rejects_bad_headers():
    g = Geometry.plan(64 * MiB)
    good = bytearray(SUPERBLOCK_SIZE)
    good[:CHECKSUM_OFF + 4] = g.pack_superblock()
    U32.pack_into(good, STATE_OFF, STATE_READY)

    with pytest.raises(NotAPoolError):
        Geometry.read(good, 100)  # smaller than a header
    bad = bytearray(good)
    bad[:8] = b"NOTAPOOL"
    with pytest.raises(NotAPoolError):
        Geometry.read(bad, g.file_size)
    bad = bytearray(good)
    U32.pack_into(bad, 8, VERSION + 1)
    with pytest.raises(VersionError):
        Geometry.read(bad, g.file_size)
    bad = bytearray(good)
    bad[144] ^= 0xFF  # created_ns
    with pytest.raises(CorruptPoolError):
        Geometry.read(bad, g.file_size)
    bad = bytearray(good)
    U32.pack_into(bad, STATE_OFF, 0)
    with pytest.raises(NotAPoolError):
        Geometry.read(bad, g.file_size)
    with pytest.raises(TruncatedPoolError):
        Geometry.read(good, g.file_size - 1)


def _resign(buf: bytearray) -> None:
    U32.pack_into(buf, CHECKSUM_OFF, zlib.crc32(bytes(buf[:CHECKSUM_OFF])))


@pytest.mark.parametrize("field_off,value", [
    (24, 3000),        # granule not a power of two
    (32, 1 << 30),     # n_units far beyond the file
    (48, 3),           # index_shards not a power of two
    (72, 0),           # off_locks overlapping the superblock
    (128, 8192),       # off_data overlapping the header regions
    (136, 12345),      # data_bytes inconsistent with n_units
])
def test_geometry_that_passes_the_checksum_is_still_validated(field_off, value):
    """A header with a valid checksum but impossible geometry is a CorruptPoolError, never a crash later."""
    g = Geometry.plan(64 * MiB)
    buf = bytearray(SUPERBLOCK_SIZE)
    buf[:CHECKSUM_OFF + 4] = g.pack_superblock()
    U32.pack_into(buf, STATE_OFF, STATE_READY)
    fmt = "<Q" if field_off >= 56 else "<I"
    struct.pack_into(fmt, buf, field_off, value)
    _resign(buf)
    with pytest.raises(CorruptPoolError):
        Geometry.read(buf, g.file_size)


# ---------------------------------------------------------------- opening existing files

def _patch(path: str, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def test_a_pool_made_with_relation_records_opens_and_evicts_as_any_other(pool_path, monkeypatch):
    """Pools made by versions with relation records carry flag bit 1 and their region between the block metas and
    the data (FORMAT.md section 1): this version opens them, leaves the region alone and evicts as usual."""
    from maru_shm.mapping import poolfile
    from maru_shm.format.layout import FLAG_RETIRED
    plan = Geometry.plan
    monkeypatch.setattr(poolfile.Geometry, "plan", staticmethod(
        lambda size, **kw: plan(size, **dict(kw, flags=kw.get("flags", 0) | FLAG_RETIRED))))
    with Store.open(pool_path, "16M", create=True) as s:
        g = s.geo
    monkeypatch.undo()
    metas_end = g.off_blockmeta + g.n_granules * META_SIZE
    assert g.flags & FLAG_RETIRED and g.off_data - metas_end >= g.n_granules * 16 + 32768
    assert not Geometry.plan(16 * MiB).flags & FLAG_RETIRED  # no new pool has the region
    with Store.open(pool_path) as s:
        value = os.urandom(64 << 10)
        for i in range(400):  # 25 MiB through a 16 MiB pool
            assert s.put(f"k{i}", value)
        assert s.stats()["evictions"] > 0 and s.get("k399") == value
        assert s.check().ok


@pytest.fixture
def closed_pool(pool_path):
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("k", b"v" * 100)
    return pool_path


def test_reopen_sees_the_same_pool(closed_pool):
    with Store.open(closed_pool) as s:
        assert not s.created
        assert s.get("k") == b"v" * 100
    with Store.open(closed_pool, "8M", create=True) as s:  # create=True on a ready pool just opens it
        assert not s.created
        assert s.get("k") == b"v" * 100


def test_wrong_magic_is_not_a_pool(closed_pool):
    _patch(closed_pool, 0, b"NOTAPOOL")
    with pytest.raises(NotAPoolError):
        Store.open(closed_pool)
    with pytest.raises(NotAPoolError):  # and create=True refuses to overwrite it
        Store.open(closed_pool, "8M", create=True)


def test_foreign_file_is_not_a_pool(pool_path):
    with open(pool_path, "wb") as f:
        f.write(os.urandom(1 << 20))
    with pytest.raises(NotAPoolError):
        Store.open(pool_path, "1M", create=True)
    assert os.path.getsize(pool_path) == 1 << 20  # untouched


def test_wrong_version(closed_pool):
    _patch(closed_pool, 8, U32.pack(VERSION + 1))
    with pytest.raises(VersionError):
        Store.open(closed_pool)


def test_bad_checksum(closed_pool):
    with open(closed_pool, "rb") as f:
        f.seek(160)
        byte = f.read(1)[0]
    _patch(closed_pool, 160, bytes([byte ^ 0xFF]))  # inside pool_uuid, covered by the checksum (always a change)
    with pytest.raises(CorruptPoolError):
        Store.open(closed_pool)


def test_truncated_file(closed_pool):
    os.truncate(closed_pool, os.path.getsize(closed_pool) - (1 << 20))
    with pytest.raises(TruncatedPoolError):
        Store.open(closed_pool)
    with pytest.raises(TruncatedPoolError):
        Store.open(closed_pool, create=True)


def test_size_mismatch_on_reopen(closed_pool):
    with pytest.raises(SizeMismatchError):
        Store.open(closed_pool, "16M")
    with pytest.raises(SizeMismatchError):
        Store.open(closed_pool, "16M", create=True)


def test_missing_file_without_create(pool_path):
    with pytest.raises(StoreError):
        Store.open(pool_path)
    assert not os.path.exists(pool_path)


def test_every_error_is_a_store_error():
    for cls in (NotAPoolError, VersionError, CorruptPoolError, TruncatedPoolError, SizeMismatchError,
                PermissionDeniedError):
        assert issubclass(cls, StoreError)


# ---------------------------------------------------------------- permissions

def test_symlink_refused(closed_pool):
    link = closed_pool + ".link"
    os.symlink(closed_pool, link)
    with pytest.raises(PermissionDeniedError):
        Store.open(link)
    with pytest.raises(PermissionDeniedError):
        Store.open(link, "8M", create=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_foreign_owner_refused_unless_allowed(closed_pool):
    os.chown(closed_pool, 4242, -1)
    with pytest.raises(PermissionDeniedError):
        Store.open(closed_pool)
    with Store.open(closed_pool, allow_foreign_owner=True) as s:
        assert s.get("k") == b"v" * 100


def test_group_mode_honoured_despite_umask(pool_path):
    old = os.umask(0o027)  # would narrow 0o660 to 0o640
    try:
        with Store.open(pool_path, "4M", create=True, mode=0o660):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o660


# ---------------------------------------------------------------- racing creators

def _racing_creator(path, size, go_fd, out_fd):
    os.read(go_fd, 1)  # barrier: the parent releases every child at once
    s = Store.open(path, size, create=True)
    os.write(out_fd, bytes([1 if s.created else 0]) + s.geo.pool_uuid)
    s.close()


@pytest.mark.parametrize("n", [2, 4])
def test_racing_creators_make_one_pool(pool_path, children, n):
    for attempt in range(5):
        path = f"{pool_path}-{attempt}"
        try:
            go_r, go_w = os.pipe()
            out_r, out_w = os.pipe()
            pids = [children.fork(_racing_creator, path, "8M", go_r, out_w) for _ in range(n)]
            os.close(out_w)
            time.sleep(0.05)
            os.write(go_w, b"x" * n)
            for pid in pids:
                children.wait_ok(pid)
            raw = b""
            while chunk := os.read(out_r, 4096):
                raw += chunk
            for fd in (go_r, go_w, out_r):
                os.close(fd)
            results = [raw[i:i + 17] for i in range(0, len(raw), 17)]
            assert len(results) == n
            assert sum(r[0] for r in results) == 1, "exactly one process must report created"
            assert len({r[1:] for r in results}) == 1, "every process must see the same pool"
            with Store.open(path) as s:
                assert s.geo.pool_uuid == results[0][1:]
                assert s.check().ok
        finally:
            remove_pool(path)


# ---------------------------------------------------------------- unfinished files

def test_empty_file_is_initialised_by_create(pool_path):
    open(pool_path, "wb").close()
    with pytest.raises(NotAPoolError):
        Store.open(pool_path, timeout=0.2)  # waits briefly for a creator, then gives up
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.geo.file_size == 8 << 20
        assert s.put("k", b"v")


def test_creator_that_died_midway_is_redone(closed_pool):
    """magic written, state never set to ready (creator killed): create=True initialises it again."""
    _patch(closed_pool, STATE_OFF, U32.pack(0))
    with pytest.raises(NotAPoolError):
        Store.open(closed_pool, timeout=0.2)
    with Store.open(closed_pool, "8M", create=True) as s:
        assert s.get("k") is None  # a fresh pool
        assert s.put("k", b"w")
        assert s.check().ok


# ---------------------------------------------------------------- word stores

def _flip_words(path, off, a, b, go_fd):
    from maru_shm.format.layout import store_u64
    import mmap as _mmap
    fd = os.open(path, os.O_RDWR)
    mm = _mmap.mmap(fd, 4096)
    os.write(go_fd, b"1")
    while True:
        store_u64(mm, off, a)
        store_u64(mm, off, b)


def test_word_store_is_never_seen_torn_by_another_process(pool_path, children):
    """Lock-free readers (and lock holders reading a lock-free commit) must see the old or the new word.

    struct.pack_into zero-fills before writing, which another process can observe as 0 (= FREE):
    every block meta / index word goes through format.store_u64 instead.
    """
    from maru_shm.format.layout import U64, store_u64
    import mmap as _mmap
    with open(pool_path, "wb") as f:
        f.write(bytes(4096))
    a, b = (0x0102030405060708 << 2) | 1, (0x0102030405060709 << 2) | 2  # RESERVED -> LIVE, as a commit
    fd = os.open(pool_path, os.O_RDWR)
    mm = _mmap.mmap(fd, 4096)
    store_u64(mm, 64, a)
    r, w = os.pipe()
    pid = children.fork(_flip_words, pool_path, 64, a, b, w)
    assert os.read(r, 1) == b"1"
    seen = set()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        for _ in range(1000):
            seen.add(U64.unpack_from(mm, 64)[0])
    children.kill(pid)
    mm.close()
    for x in (fd, r, w):
        os.close(x)
    assert seen <= {a, b}, sorted(hex(x) for x in seen - {a, b})[:5]


# ---------------------------------------------------------------- what create=True may format

def test_create_refuses_a_file_that_is_not_empty_even_if_it_starts_with_zeros(pool_path):
    """A sparse file or a disk image whose first 4 KiB are zero is somebody's data, not a pool to format."""
    data = bytes(8192) + b"user data" * 100
    with open(pool_path, "wb") as f:
        f.write(data)
    os.chmod(pool_path, 0o600)
    with pytest.raises(NotAPoolError, match="not empty"):
        Store.open(pool_path, "4M", create=True)
    with open(pool_path, "rb") as f:
        assert f.read() == data  # untouched


def test_create_formats_an_empty_file(pool_path):
    open(pool_path, "wb").close()
    os.chmod(pool_path, 0o600)
    with Store.open(pool_path, "4M", create=True) as s:
        assert s.put("k", b"v") and s.get("k") == b"v"


def test_open_without_create_names_a_dead_creators_unfinished_pool(pool_path):
    with open(pool_path, "wb") as f:
        f.write(b"MARUSHM\0" + bytes(100))
    os.chmod(pool_path, 0o600)
    with pytest.raises(NotAPoolError, match="creator died.*create=True"):
        Store.open(pool_path, timeout=0.2)
    with Store.open(pool_path, "4M", create=True) as s:  # under INIT nobody is formatting it: format again
        assert s.put("k", b"v")


@pytest.mark.parametrize("size", ["100T", "100000T"])
def test_a_size_no_file_system_here_can_back_is_refused_quickly(pool_path, size):
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="free"):
        Store.open(pool_path, size, create=True)
    assert time.monotonic() - t0 < 10
    assert not os.path.exists(pool_path)  # nothing left behind to break later opens


def test_planning_an_absurd_size_does_not_spin():
    t0 = time.monotonic()
    g = Geometry.plan(100000 << 40)
    assert g.n_units > 0 and time.monotonic() - t0 < 1
    for size in (4 << 20, 5 << 20, 123_456_789, 1 << 30):  # the search finds the largest unit count that fits
        g = Geometry.plan(size)
        assert g.off_data + g.n_units * g.unit_size <= size
        assert size - (g.off_data + g.n_units * g.unit_size) < 2 * g.unit_size + (64 << 10)  # nearly all used


def test_creating_a_pool_larger_than_its_tmpfs_fails_cleanly(small_tmpfs):
    """Run in a child: if creation ever left unbacked pages, the first put would die with SIGBUS."""
    import subprocess
    import sys
    path = str(small_tmpfs / "pool")
    code = ("import sys\nfrom maru_shm import Store, StoreError\n"
            "try:\n    s = Store.open(sys.argv[1], '64M', create=True)\nexcept StoreError as e:\n"
            "    print('refused:', e)\nelse:\n    s.put('k', bytes(1 << 20)); print('opened')\n")
    p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("refused:") and "free" in p.stdout and "64.0 MiB" in p.stdout, p.stdout
    assert not os.path.exists(path)
    with Store.open(path, "8M", create=True) as s:  # a size that fits is created and fully backed
        assert os.stat(path).st_blocks * 512 >= s.geo.file_size
        assert s.put("k", bytes(1 << 20))


# Every field of every mapped record at the offset (and of the size) docs/FORMAT.md gives it, reserved bytes
# included: the records are declared once in format/layout.py, with offsets that follow from the field sizes, so
# this table is what keeps an edit there from moving a field silently. (record, size, [(field, offset,
# bytes)]), FORMAT.md sections 2, 3, 4, 5, 6, 7 and 10.
FORMAT_TABLES = [
    ("SUPERBLOCK_LAYOUT", 4096, [
        ("magic", 0, 8), ("version", 8, 4), ("flags", 12, 4), ("file_size", 16, 8), ("granule", 24, 4),
        ("unit_size", 28, 4), ("n_units", 32, 4), ("n_geo_classes", 36, 4), ("class_cap", 40, 4),
        ("proc_slots", 44, 4), ("index_shards", 48, 4), ("shard_slots", 52, 4), ("max_value", 56, 8),
        ("n_granules", 64, 8), ("off_locks", 72, 8), ("off_classes", 80, 8), ("off_procs", 88, 8),
        ("off_slabs", 96, 8), ("off_shards", 104, 8), ("off_index", 112, 8), ("off_blockmeta", 120, 8),
        ("off_data", 128, 8), ("data_bytes", 136, 8), ("created_ns", 144, 8), ("pool_uuid", 152, 16),
        ("reserved_immutable", 168, 84), ("checksum", 252, 4), ("state", 256, 4), ("slab_hand", 260, 4),
        ("classes_version", 264, 4), ("reserved_268", 268, 4), ("retired", 272, 128), ("demand_epoch", 400, 4),
        ("reserved_404", 404, 4), ("demand_acc", 408, 8), ("free_floor", 416, 4), ("age_tick", 420, 4),
        ("heals", 424, 8), ("lock_boot", 432, 16), ("lock_dev", 448, 8), ("lock_ino", 456, 8),
        ("reserved_tail", 464, 3632)]),
    ("LOCK_LAYOUT", 8, [("dirty", 0, 4), ("op", 4, 4)]),
    ("CLASS_LAYOUT", 64, [
        ("kind", 0, 4), ("slab_units", 4, 4), ("block_size", 8, 8), ("blocks_per_slab", 16, 4),
        ("partial_head", 20, 4), ("nslabs", 24, 4), ("used_blocks", 28, 4), ("declared_ns", 32, 8), ("hand", 40, 8),
        ("demand", 48, 8), ("demand_epoch", 56, 4), ("reserved_60", 60, 4)]),
    ("SLAB_LAYOUT", 64, [
        ("state", 0, 4), ("cls", 4, 4), ("next", 8, 4), ("prev", 12, 4), ("nfree", 16, 4), ("nblocks", 20, 4),
        ("ref", 24, 1), ("in_partial", 25, 1), ("reserved_26", 26, 6), ("bitmap", 32, 32)]),
    ("META_LAYOUT", 32, [
        ("word", 0, 8), ("digest", 8, 16), ("length", 24, 4), ("owner", 28, 2), ("ref", 30, 1), ("flags", 31, 1)]),
    ("SHARD_LAYOUT", 16, [("count", 0, 4), ("hand", 4, 4), ("reserved_8", 8, 8)]),
    ("ENTRY_LAYOUT", 32, [("digest", 0, 16), ("word", 16, 8), ("offset", 24, 8)]),
    ("PROC_LAYOUT", 128, [
        ("state", 0, 4), ("pid", 4, 4), ("start_ticks", 8, 8), ("attach_ns", 16, 8), ("uid", 24, 4),
        ("reserved_28", 28, 4), ("counters", 32, 96)]),
]


@pytest.mark.parametrize("record,size,fields", FORMAT_TABLES, ids=[t[0] for t in FORMAT_TABLES])
def test_every_field_of_a_record_sits_where_format_md_puts_it(record, size, fields):
    from maru_shm.format import layout as F
    from maru_shm.format.records import field_off, field_size
    layout = getattr(F, record)
    assert layout.itemsize == size
    assert list(layout.names) == [f for f, _, _ in fields], "a field added, removed or reordered"
    for name, off, nbytes in fields:
        assert (field_off(layout, name), field_size(layout, name)) == (off, nbytes), name
    assert fields[-1][1] + fields[-1][2] == size and all(  # every byte belongs to one field
        a[1] + a[2] == b[1] for a, b in zip(fields, fields[1:]))


def test_the_constants_and_structs_every_reader_uses_follow_the_declarations():
    """A sample of the derived names, at FORMAT.md's values, and each struct covering its fields."""
    from maru_shm.format import layout as F
    assert (F.CHECKSUM_OFF, F.STATE_OFF, F.SLAB_HAND_OFF, F.CLASSES_VERSION_OFF, F.RETIRED_OFF, F.DEMAND_EPOCH_OFF,
            F.DEMAND_ACC_OFF, F.FREE_FLOOR_OFF, F.AGE_TICK_OFF, F.HEALS_OFF) == (
        252, 256, 260, 264, 272, 400, 408, 416, 420, 424)
    assert (F.CLS_KIND, F.CLS_K, F.CLS_BLOCK, F.CLS_BPS, F.CLS_PARTIAL, F.CLS_NSLABS, F.CLS_USED, F.CLS_DECLARED,
            F.CLS_HAND, F.CLS_DEMAND, F.CLS_DEMAND_EPOCH) == (
        0, 4, 8, 16, 20, 24, 28, 32, 40, 48, 56)
    assert (F.SLAB_STATE, F.SLAB_CLS, F.SLAB_NEXT, F.SLAB_PREV, F.SLAB_NFREE, F.SLAB_NBLOCKS, F.SLAB_REF,
            F.SLAB_INPARTIAL, F.SLAB_BITMAP, F.BITMAP_BYTES) == (0, 4, 8, 12, 16, 20, 24, 25, 32, 32)
    assert (F.META_DIGEST_OFF, F.META_LENGTH_OFF, F.META_OWNER_OFF, F.META_REF_OFF, F.META_FLAGS_OFF) == (
        8, 24, 28, 30, 31)
    assert (F.META_COL_WORD, F.META_COL_DIGEST, F.META_COL_TAIL, F.META_TAIL_OWNER_SHIFT, F.META_TAIL_REF_SHIFT,
            F.META_TAIL_FLAGS_SHIFT) == (0, 1, 3, 32, 48, 56)
    assert (F.ENTRY_WORD_OFF, F.ENTRY_OFFSET_OFF, F.ENTRY_COL_DIGEST, F.ENTRY_COL_WORD, F.ENTRY_COL_OFFSET) == (
        16, 24, 0, 2, 3)
    assert (F.PROC_COUNTERS_OFF, F.COUNTER_SIZE, F.LOCK_COL_DIRTY, F.LOCK_COL_OP, F.SHARD_COUNT_OFF) == (32, 8, 0, 1, 0)
    assert F.HEADER_READY_END == 260
    formats = {"SUPERBLOCK": "<8sIIQIIIIIIIIQQQQQQQQQQQQ16s", "LOCK_RECORD": "<II", "CLASS_STRUCT": "<IIQIIIIQ",
               "PROC_HEAD": "<IIQQI", "COUNTERS": "<12Q", "SLAB_HEAD": "<IIIIII", "SHARD_STRUCT": "<II",
               "ENTRY_STRUCT": "<16sQQ", "META_STRUCT": "<Q16sIHBB"}
    assert {name: getattr(F, name).format for name in formats} == formats
