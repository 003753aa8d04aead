"""Corrupt-file fuzzing harness for test_corrupt.py (plain functions, no pytest).

A small valid pool is built once (`template()`): a few dozen self-verifying values (conftest.make_value)
of sizes spread over several geometric classes and one exact-fit class, some overwritten and deleted
so block metas carry counters and stale digests. Each case copies that image, applies a list of
mutations (`apply`), writes it to a fresh /dev/shm file and runs `scenario` on it in a child process
of its own (`run_case`: a helper interpreter forks one child per case, see CaseRunner): a crash of
the child (a signal, e.g. SIGSEGV from a raw copy outside the mapping) or a hang (past CASE_TIMEOUT)
is reported to the test, which turns it into a failure.

The scenario touches every public entry point on the damaged file: Store.open, get, get_into,
get_pieces, batch_get_into, batch_get_pieces, batch_exists, leading_hits, exists, length_of, stats,
PoolView + inspect.report, put / batch_put / put_pieces / delete / declare_size, check(),
check(repair=True), check() again, and a round trip on the repaired pool. It records:

- `bad`: every finding that is a bug whatever the corruption was: an exception that is not a
  StoreError (or a StoreError without a message), a LockTimeout (one process alone can only time
  out on itself: a self-deadlock), an operation slower than OP_BOUND, a read returning bytes that
  are not a value of the key (unless the corruption hit that key's own bytes: see `tainted_keys`),
  a repair that neither raised nor left check() clean, a repaired pool that cannot store and return
  a value.
- facts the parent compares with what the mutations should have caused (`expectations`): did open
  fail, and did the first check() report problems.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
import traceback
import zlib

import numpy as np

from maru_shm import LockTimeout, Store, StoreError, remove_pool
from maru_shm.format.layout import (CHECKSUM_OFF, CLASS_CAP, CLASS_ENTRY, CLASS_LOCK_BASE, CLASS_STRUCT, ENTRY_SIZE,
                                    ENTRY_STRUCT, FREE, KIND_UNUSED, LIVE, LOCK_CLASSTAB, LOCK_IDS, LOCK_POOL,
                                    LOCK_RECORD, META_SIZE, META_STRUCT, PROC_ENTRY, SHARD_HEADER, SHARD_LOCK_BASE,
                                    SLAB_ENTRY, SLAB_HEAD, STATE_OFF, SUPERBLOCK_SIZE, UNIT_FREE, UNIT_HEAD,
                                    UNIT_TAIL, length_sound)
from maru_shm.format.geometry import Geometry
from maru_shm.index import key_digest
from maru_shm.checks.view import PoolView
from maru_shm.checks.figures import report

from ..conftest import check_value, make_value, write_pool_image

LOCK_TIMEOUT = 0.2
OP_BOUND = 3.0        # no single operation on a 2 MiB pool may take longer (generous: CI is loaded)
CASE_TIMEOUT = 30.0   # the whole scenario, in the child

# ---------------------------------------------------------------- the template pool

GEOMETRY = dict(granule=1024, unit_size=16 << 10, max_value="64K", index_shards=4, index_slots=64,
                proc_slots=8)
POOL_SIZE = "2M"
EXACT = 3000  # one exact-fit class
KEYS = [f"k{i}" for i in range(36)]
ABSENT = [f"absent{i}" for i in range(8)]


def _size_of(i: int) -> int:
    # tiny, a granule, a few granules, multi-unit, the exact class, ... spread over several classes
    return [40, 900, 2000, 3000, 4000, 8000, 16_000, 30_000, 3000, 1500, 700, 60_000][i % 12]


class Template:
    """The template image and what the fuzzer needs to know about it."""

    def __init__(self, image: bytes, geo: Geometry, values: dict, blocks: dict):
        self.image = image
        self.geo = geo
        self.values = values    # key -> value bytes stored in the template
        self.blocks = blocks    # key -> (data offset, length)
        g = geo
        self.size = len(image)
        self.regions = {
            "superblock": (0, SUPERBLOCK_SIZE, 8),
            "locks": (g.off_locks, LOCK_IDS * LOCK_RECORD.size, LOCK_RECORD.size),
            "classes": (g.off_classes, CLASS_CAP * CLASS_ENTRY, CLASS_ENTRY),
            "procs": (g.off_procs, g.proc_slots * PROC_ENTRY, PROC_ENTRY),
            "slabs": (g.off_slabs, g.n_units * SLAB_ENTRY, SLAB_ENTRY),
            "shards": (g.off_shards, g.index_shards * SHARD_HEADER, SHARD_HEADER),
            "index": (g.off_index, g.index_slots * ENTRY_SIZE, ENTRY_SIZE),
            "blockmeta": (g.off_blockmeta, g.n_granules * META_SIZE, META_SIZE),
            "data": (g.off_data, g.data_bytes, g.granule),
        }
        # records worth hitting more often than the rest of their region
        hot = {name: [] for name in self.regions}
        hot["superblock"] = list(range(0, STATE_OFF // 8 + 2))
        taken = [LOCK_CLASSTAB, LOCK_POOL] + [CLASS_LOCK_BASE + c for c in range(g.n_geo_classes + 2)] + \
            [SHARD_LOCK_BASE + s for s in range(g.index_shards)] + [0, 1]
        hot["locks"] = sorted(set(taken))
        units = slab_states(image, g)
        classes = sorted({int(c) for c, st in zip(slab_cls(image, g), units) if st == UNIT_HEAD})
        hot["classes"] = classes + [g.n_geo_classes, g.n_geo_classes + 1]
        hot["procs"] = [0, 1]
        hot["slabs"] = [u for u in range(g.n_units) if units[u] != UNIT_FREE] + [g.n_units - 1]
        hot["shards"] = list(range(g.index_shards))
        words = index_words(image, g)
        hot["index"] = [i for i in range(g.index_slots) if words[i]]
        mw = meta_words(image, g)
        hot["blockmeta"] = [i for i in range(g.n_granules) if mw[i] & 3]
        hot["data"] = sorted({off // g.granule for off, _ in blocks.values()})
        self.hot = hot
        starts = sorted({off for off, _ in blocks.values()})
        self.interesting = sorted({
            0, 1, 2, 3, 4, 7, 8, 15, 16, 255, 256, 1023, 1024, 4096,
            g.n_units - 1, g.n_units, g.n_units + 1, g.class_cap - 1, g.class_cap, g.proc_slots, g.proc_slots + 1,
            g.shard_slots - 1, g.shard_slots, g.index_shards, g.n_granules - 1, g.n_granules,
            g.granule, g.unit_size, g.unit_size - 1, g.data_bytes - 1, g.data_bytes, g.data_bytes - g.granule,
            g.data_bytes + g.granule, g.file_size, g.off_data, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
            *starts[:6], *[s + g.granule for s in starts[:3]],
        })


def slab_states(image, g):
    return np.frombuffer(image, dtype="<u4", count=g.n_units * 16, offset=g.off_slabs)[0::16]


def slab_cls(image, g):
    return np.frombuffer(image, dtype="<u4", count=g.n_units * 16, offset=g.off_slabs)[1::16]


def index_words(image, g):
    return np.frombuffer(image, dtype="<u8", count=g.index_slots * 4, offset=g.off_index)[2::4]


def meta_words(image, g):
    return np.frombuffer(image, dtype="<u8", count=g.n_granules * 4, offset=g.off_blockmeta)[0::4]


_TEMPLATE: Template | None = None


def template() -> Template:
    """Build the template pool once per process (deterministic contents; uuid and time differ)."""
    global _TEMPLATE
    if _TEMPLATE is not None:
        return _TEMPLATE
    path = f"/dev/shm/maru-fuzz-template-{os.getpid()}"
    remove_pool(path)
    try:
        values = {}
        with Store.open(path, POOL_SIZE, create=True, **GEOMETRY) as s:
            s.declare_size(EXACT)
            for i, k in enumerate(KEYS):  # version 0 of everything, then overwrite and delete some
                assert s.put(k, make_value(k, 0, _size_of(i)))
            for i, k in enumerate(KEYS[::5]):
                s.delete(k)
            for i, k in enumerate(KEYS):
                if i % 5 == 0 or i % 3 == 0:
                    v = make_value(k, 1, _size_of(i + 1))
                    assert s.put(k, v)
            for i, k in enumerate(KEYS):
                if i % 7 == 6:
                    s.delete(k)
            for k in KEYS:
                v = s.get(k)
                if v is not None:
                    assert check_value(k, v)
                    values[k] = v
            rep = s.check()
            assert rep.ok, rep.problems
            blocks = {}
            for k in values:
                found = s._reader.lookup(key_digest(k))
                blocks[k] = (found[0], found[2])
        with open(path, "rb") as f:
            image = f.read()
    finally:
        remove_pool(path)
    geo = Geometry.read(image, len(image))
    _TEMPLATE = Template(image, geo, values, blocks)
    return _TEMPLATE


# ---------------------------------------------------------------- mutations

def apply(image: bytes, mutations) -> bytearray:
    """The template image with each mutation applied in order.

    ("xor", off, mask8) | ("u8"/"u16"/"u32"/"u64", off, value) | ("copy", src, dst, n)
    | ("forge", field_off, width, value): write a superblock field and fix the checksum
    | ("truncate", length) | ("grow", extra_bytes)
    """
    b = bytearray(image)
    for m in mutations:
        kind = m[0]
        if kind == "xor":
            _, off, mask = m
            if off < len(b):
                b[off] ^= mask
        elif kind in ("u8", "u16", "u32", "u64"):
            _, off, value = m
            n = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}[kind]
            if off + n <= len(b):
                b[off:off + n] = (value % (1 << (8 * n))).to_bytes(n, "little")
        elif kind == "copy":
            _, src, dst, n = m
            if src + n <= len(b) and dst + n <= len(b):
                b[dst:dst + n] = bytes(b[src:src + n])
        elif kind == "forge":
            _, off, n, value = m
            if len(b) >= SUPERBLOCK_SIZE:
                b[off:off + n] = (value % (1 << (8 * n))).to_bytes(n, "little")
                b[CHECKSUM_OFF:CHECKSUM_OFF + 4] = zlib.crc32(bytes(b[:CHECKSUM_OFF])).to_bytes(4, "little")
        elif kind == "truncate":
            del b[m[1]:]
        elif kind == "grow":
            b.extend(bytes(m[1]))
        else:
            raise ValueError(m)
    return b


# ---------------------------------------------------------------- what a corruption must cause

def changed_ranges(t: Template, img) -> np.ndarray:
    """Byte positions (within the template's length) where img differs from the template."""
    n = min(len(img), t.size) // 8 * 8
    a = np.frombuffer(t.image, dtype="<u8", count=n // 8)
    b = np.frombuffer(img, dtype="<u8", count=n // 8)
    words = np.flatnonzero(a != b)  # compare 8 bytes at a time, then look inside the words that differ
    pos = (words[:, None] * 8 + np.arange(8)).ravel()
    ab, bb = np.frombuffer(t.image, dtype=np.uint8), np.frombuffer(img, dtype=np.uint8)
    tail = np.arange(n, min(len(img), t.size))  # the last < 8 bytes
    pos = np.concatenate((pos, tail))
    return pos[ab[pos] != bb[pos]]


def tainted_keys(t: Template, img) -> set:
    """Keys whose stored representation the corruption touched, so a read may legitimately return wrong
    bytes for them (the format has no payload checksum): their data bytes, their meta length changed to
    one that agrees with its check (the meta flags: one bit flipped never does), or a meta elsewhere now
    claiming their digest with state LIVE (a forged block)."""
    g = t.geo
    diff = changed_ranges(t, img)
    out = set()
    if not diff.size or len(img) < t.size:
        return out
    for k, (off, length) in t.blocks.items():
        lo = g.off_data + off
        if ((diff >= lo) & (diff < lo + length)).any():
            out.add(k)
        m = g.off_blockmeta + (off // g.granule) * META_SIZE
        new_length, new_flags = META_STRUCT.unpack_from(img, m)[2::3]
        if new_length != length and length_sound(new_length, new_flags):
            out.add(k)
    # only a meta record the corruption changed can newly claim a key's digest
    lo, hi = g.off_blockmeta, g.off_blockmeta + g.n_granules * META_SIZE
    changed = {(int(p) - lo) // META_SIZE for p in diff[(diff >= lo) & (diff < hi)]}
    owners = {key_digest(k): off // g.granule for k, (off, _) in t.blocks.items()}
    names = {key_digest(k): k for k in t.blocks}
    for gi in changed:
        word, d = META_STRUCT.unpack_from(img, lo + gi * META_SIZE)[:2]
        if word & 3 == LIVE and d in owners and owners[d] != gi:
            out.add(names[d])
    return out


def expectations(t: Template, img) -> dict:
    """What the mutated image must cause: {"open_fails": bool, "detect": [reasons], "clean": bool}.

    "detect": structural damage the first check() must report (empty: no such damage).
    "clean": nothing but benign bytes changed, so the first check() must report nothing.
    """
    g = t.geo
    if len(img) < t.size:
        return {"open_fails": True, "detect": [], "clean": False}
    diff = changed_ranges(t, img)
    if diff.size and diff[0] < STATE_OFF + 4:
        try:  # a header rewritten with a valid checksum ("forge"): what does its geometry say?
            geo = Geometry.read(bytes(img[:SUPERBLOCK_SIZE]), len(img))
        except StoreError:
            return {"open_fails": True, "detect": [], "clean": False}
        if geo.__class__(**{**geo.__dict__, "created_ns": g.created_ns, "pool_uuid": g.pool_uuid,
                            "flags": g.flags}) != g:
            return {"open_fails": None, "detect": [], "clean": False}  # another valid layout: anything goes
        diff = diff[diff >= STATE_OFF + 4]  # only identity fields changed: judge the rest as usual
    detect, unsure = [], []
    old, new = t.image, bytes(img)

    def region_of(pos):
        for name, (lo, size, rec) in t.regions.items():
            if lo <= pos < lo + size:
                return name, (pos - lo) // rec, (pos - lo) % rec
        return None, 0, 0

    touched: dict = {}
    for pos in diff.tolist():
        name, idx, field = region_of(int(pos))
        touched.setdefault((name, idx), set()).add(field)
    for (name, idx), fields in touched.items():
        why = _judge(t, old, new, name, idx, fields)
        if why is True:
            detect.append(f"{name}[{idx}] fields {sorted(fields)}")
        elif why is None:
            unsure.append(f"{name}[{idx}]")
    return {"open_fails": False, "detect": detect, "clean": not detect and not unsure}


def _u32(buf, off):
    return struct.unpack_from("<I", buf, off)[0]


def _judge(t: Template, old: bytes, new: bytes, name, idx, fields):
    """True: check() must report this change; False: benign (check() must stay quiet); None: either."""
    g = t.geo
    if name is None or name == "data":
        return False  # padding, the unused tail of the superblock page, or payload bytes
    if name == "superblock":
        return False  # past the state word (earlier changes make open fail): counters, hints, unused
    if name == "procs":
        return False  # opening reaps slots without a live owner and claims slot 0 afresh
    if name == "locks":
        lock_id = idx
        taken = lock_id in (LOCK_CLASSTAB, LOCK_POOL) or SHARD_LOCK_BASE <= lock_id < SHARD_LOCK_BASE + g.index_shards
        if CLASS_LOCK_BASE <= lock_id < CLASS_LOCK_BASE + CLASS_CAP:
            c = lock_id - CLASS_LOCK_BASE
            kind = _u32(old, g.off_classes + c * CLASS_ENTRY)
            taken = kind != KIND_UNUSED
        dirty = _u32(new, g.off_locks + lock_id * 8)
        if taken and dirty:
            return True
        return False if not dirty or not taken else None
    if name == "classes":
        o = g.off_classes + idx * CLASS_ENTRY
        a, b = CLASS_STRUCT.unpack_from(old, o), CLASS_STRUCT.unpack_from(new, o)
        if a[7] != b[7] and a[:7] == b[:7]:
            return False  # declared_ns only
        if a[:7] == b[:7] and old[o + 40:o + 64] != new[o + 40:o + 64]:
            return False  # reserved bytes
        if a[0] == KIND_UNUSED:
            return None
        return True
    if name == "slabs":
        o = g.off_slabs + idx * SLAB_ENTRY
        a, b = SLAB_HEAD.unpack_from(old, o), SLAB_HEAD.unpack_from(new, o)
        if a[0] == UNIT_HEAD:
            bps = CLASS_STRUCT.unpack_from(old, g.off_classes + a[1] * CLASS_ENTRY)[3]
            mask = (1 << bps) - 1
            bm = [int.from_bytes(x[o + 32:o + 64], "little") & mask for x in (old, new)]
            # ref bit, reserved bytes and bitmap bits past the slab's blocks mean nothing; in_partial is a flag
            return a != b or bm[0] != bm[1] or bool(old[o + 25]) != bool(new[o + 25])
        if a[0] == UNIT_TAIL:
            return True if a[:2] != b[:2] else False
        return True if a[0] != b[0] else False  # a FREE unit's other fields are stale leftovers
    if name == "shards":
        return True if fields & {0, 1, 2, 3} else False
    if name == "index":
        o = g.off_index + idx * ENTRY_SIZE
        a, b = ENTRY_STRUCT.unpack_from(old, o), ENTRY_STRUCT.unpack_from(new, o)
        if a[1] == 0 and b[1] == 0:
            return False  # an empty slot's leftover bytes
        return True
    if name == "blockmeta":
        o = g.off_blockmeta + idx * META_SIZE
        a, b = META_STRUCT.unpack_from(old, o), META_STRUCT.unpack_from(new, o)
        if a[0] & 3 == FREE:
            return True if b[0] & 3 != FREE else False  # a FREE meta's counter and leftovers are free to vary
        if a[0] != b[0] or a[1] != b[1]:
            return True
        if not length_sound(b[2], b[5]):
            return True  # a length its check refutes
        if a[3] != b[3]:
            return None  # owner: names a dead slot (reported) or this checking process (legitimate)
        if a[2] != b[2]:
            return None  # a length that agrees with its changed check: reported only past the block size
        return False  # ref bit, pinned bit
    return None


# ---------------------------------------------------------------- the scenario, in a child

class Recorder:
    def __init__(self, tainted):
        self.bad: list[str] = []
        self.errors: list[tuple] = []
        self.tainted = tainted

    def op(self, name, fn, *args, **kw):
        """Run one operation; (True, result) or (False, exception). Anything but a StoreError is bad."""
        t0 = time.monotonic()
        try:
            return True, fn(*args, **kw)
        except StoreError as e:
            self.errors.append((name, type(e).__name__, str(e)))
            if not str(e).strip():
                self.bad.append(f"{name}: {type(e).__name__} with an empty message")
            if isinstance(e, LockTimeout):
                self.bad.append(f"{name}: LockTimeout in a single process (it waited on itself): {e}")
            return False, e
        except Exception as e:
            self.bad.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}")
            return False, e
        finally:
            dt = time.monotonic() - t0
            if dt > OP_BOUND:
                self.bad.append(f"{name}: took {dt:.2f}s")

    def read(self, where, key, data, strict=True):
        if data is None or check_value(key, data):
            return
        if key in self.tainted or not strict:
            return
        self.bad.append(f"{where}({key!r}): returned {len(data)} bytes that are not a value of the key")


def scenario(path: str, tainted: set) -> dict:
    t = template()
    rec = Recorder(tainted)
    out = {"opened": False, "open_error": None, "check1": None, "check_repair": None, "check2": None}

    ok, v = rec.op("PoolView.open", PoolView.open, path)
    if ok:
        rec.op("inspect.report", report, v)
        rec.op("PoolView.close", v.close)

    ok, s = rec.op("Store.open", Store.open, path, timeout=LOCK_TIMEOUT)
    if not ok:
        out["open_error"] = type(s).__name__
        out["bad"], out["errors"] = rec.bad, rec.errors
        return out
    out["opened"] = True
    keys = list(t.values) + [k for k in KEYS if k not in t.values] + ABSENT
    # -- reads of the damaged image: a value of the key or a miss, never anything else
    for k in keys:
        ok, data = rec.op("get", s.get, k)
        if ok:
            rec.read("get", k, data)
        buf = bytearray(70_000)
        ok, n = rec.op("get_into", s.get_into, k, buf)
        if ok and n is not None:
            rec.read("get_into", k, bytes(buf[:n]))
        rec.op("exists", s.exists, k)
        rec.op("length_of", s.length_of, k)
    for k, v in t.values.items():
        a, b = np.zeros(len(v) // 3, np.uint8), np.zeros(len(v) - len(v) // 3, np.uint8)
        ok, hit = rec.op("get_pieces", s.get_pieces, k, [(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)])
        if ok and hit:
            rec.read("get_pieces", k, a.tobytes() + b.tobytes())
    outs = [bytearray(70_000) for _ in keys]
    ok, res = rec.op("batch_get_into", s.batch_get_into, keys, outs)
    if ok:
        for k, o, n in zip(keys, outs, res):
            if n is not None:
                rec.read("batch_get_into", k, bytes(o[:n]))
    vals = list(t.values.items())
    arrs = [np.zeros(len(v), np.uint8) for _, v in vals]
    ok, res = rec.op("batch_get_pieces", s.batch_get_pieces, [k for k, _ in vals],
                     [[(a.ctypes.data, a.nbytes)] for a in arrs])
    if ok:
        for (k, _), a, hit in zip(vals, arrs, res):
            if hit:
                rec.read("batch_get_pieces", k, a.tobytes())
    ok, res = rec.op("batch_exists", s.batch_exists, keys)
    if ok:
        for k, e in zip(keys, res):
            if e and k in ABSENT:
                rec.bad.append(f"batch_exists({k!r}): True for a key never stored")
    rec.op("leading_hits", s.leading_hits, keys)
    rec.op("leading_hits", s.leading_hits, keys, 1500)
    rec.op("stats", s.stats)
    # -- what check() makes of the damage, before anything writes
    ok, r = rec.op("check", s.check)
    if ok:
        out["check1"] = list(r.problems)
    # -- writes on the damaged pool: they may fail (False or a StoreError), nothing else
    rec.op("declare_size", s.declare_size, 7000)
    for i, k in enumerate(["new-a", "new-b", "new-c"] + list(t.values)[:3]):
        rec.op("put", s.put, k, make_value(k, 7, [100, 3000, 7000, 20_000, 64_000, 1200][i]))
    rec.op("batch_put", s.batch_put, ["new-d", "new-e", list(t.values)[3]],
           [make_value(x, 8, 2000) for x in ["new-d", "new-e", list(t.values)[3]]], skip_existing=True)
    v = np.frombuffer(make_value("new-f", 9, 9000), np.uint8)
    rec.op("put_pieces", s.put_pieces, "new-f", [(v.ctypes.data, 4000), (v.ctypes.data + 4000, 5000)])
    for k in list(t.values)[4:7] + ["new-a", "absent0"]:
        rec.op("delete", s.delete, k)
    for i in range(0, 12, 2):  # enough to need eviction of slabs in a 1 MiB pool
        fill = [make_value(f"fill{j}", 1, 60_000) for j in (i, i + 1)]
        bufs = [np.frombuffer(x, np.uint8) for x in fill]
        rec.op("batch_put_pieces", s.batch_put_pieces, [f"fill{i}", f"fill{i + 1}"],
               [[(b.ctypes.data, len(b))] for b in bufs])
    for k in keys + ["new-b", "new-c", "new-d", "fill11"]:
        ok, data = rec.op("get", s.get, k)
        if ok:
            rec.read("get after writes", k, data)
    # -- repair, then the pool must be clean and usable (or repair says it cannot be)
    ok, r = rec.op("check(repair=True)", s.check, repair=True)
    if ok:
        out["check_repair"] = list(r.problems)
        ok, r2 = rec.op("check after repair", s.check)
        if ok:
            out["check2"] = list(r2.problems)
            if r2.problems:
                rec.bad.append(f"check() after check(repair=True) still finds: {r2.problems[:5]}")
            else:
                for i in range(4):
                    k = f"after-{i}"
                    val = make_value(k, 3, [500, 3000, 12_000, 50_000][i])
                    ok, put_ok = rec.op("put after repair", s.put, k, val)
                    if ok and not put_ok:
                        rec.bad.append(f"put({k!r}) after a clean repair returned False")
                    ok, data = rec.op("get after repair", s.get, k)
                    if ok and put_ok and data != val:
                        rec.bad.append(f"get({k!r}) after a clean repair returned "
                                       f"{None if data is None else len(data)} bytes, not the value put")
                ok, r3 = rec.op("check after use", s.check)
                if ok and r3.problems:
                    rec.bad.append(f"check() after using the repaired pool finds: {r3.problems[:5]}")
    rec.op("close", s.close)
    out["bad"], out["errors"] = rec.bad, rec.errors
    return out


# ---------------------------------------------------------------- one case, in a forked child

def run_forked(path: str, tainted: set) -> dict:
    """Run `scenario` on the pool file at `path` in a forked child; return its report.

    The report has "crash" (the child died by a signal or exited without a report) or "hang" (it
    outlived CASE_TIMEOUT and was killed) when the child could not finish.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller
        code = 0
        try:
            os.close(r)
            try:
                res = scenario(path, tainted)
            except BaseException:
                res = {"bad": [f"scenario raised: {traceback.format_exc()}"], "errors": []}
            data = pickle.dumps(res)
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + CASE_TIMEOUT
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(r)
        if hung:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if hung:
        return {"hang": f"no result within {CASE_TIMEOUT}s", "bad": [], "errors": []}
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not chunks:
        return {"crash": f"child exited with {code} (negative: killed by that signal)", "bad": [], "errors": []}
    return pickle.loads(b"".join(chunks))


# A pytest-xdist worker has imported torch and sglang while collecting the suite, which makes every
# fork of it cost ~20 ms. Cases therefore go to a helper interpreter that loads only maru_shm, numpy and
# this module, and forks one child per case there (~3 ms): every case still runs in its own process.

def _send(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(len(data).to_bytes(8, "little") + data)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    n = int.from_bytes(head, "little")
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def serve() -> None:
    """The helper's loop: requests (path, tainted) on stdin, reports on stdout."""
    import sys
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the reply channel
    template()
    _send(out, "ready")
    while True:
        try:
            path, tainted = _recv(inp)
        except EOFError:
            return
        _send(out, run_forked(path, tainted))


class CaseRunner:
    """Parent side: writes each case's file, has the helper run it, restarts the helper if it dies."""

    def __init__(self):
        self.proc = None

    def _start(self) -> None:
        import subprocess
        import sys
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.maru_shm.corrupt_harness import serve; serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=root)
        if self._reply(60) != "ready":
            raise RuntimeError("the fuzz helper interpreter did not start")

    def _reply(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        return _recv(self.proc.stdout)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, img, tainted: set, tag: str) -> dict:
        path = f"/dev/shm/maru-fuzz-{os.getpid()}-{tag}"
        write_pool_image(path, img)
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            _send(self.proc.stdin, (path, tainted))
            return self._reply(CASE_TIMEOUT + 30)
        except (EOFError, OSError, TimeoutError) as e:
            self.stop()
            return {"crash": f"the fuzz helper failed: {e!r}", "bad": [], "errors": []}
        finally:
            remove_pool(path)


_RUNNER = CaseRunner()


def run_case(img, tainted: set, tag: str) -> dict:
    """Run the scenario on image `img` in its own process; see run_forked for the report."""
    return _RUNNER.run(img, tainted, tag)
