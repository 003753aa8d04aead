"""Read-only figures about a pool, computed from the shared file without taking locks.

Used by Store.stats() and by the `maru-shm inspect` / `watch` commands. Every function takes either an
attached Store or a `PoolView` (view.py).

Everything here is a snapshot: writers may move on while it is taken, so
counts can be off by the few operations in flight, and a lock record may be
seen dirty for an instant while its holder is inside its section (a dirty
record is only reported when its lock is not held, checked twice).
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np

from ..format.layout import (CLASS_LOCK_BASE, CLASS_STRUCT, COUNTERS, COUNTER_NAMES, ENTRY_COL_DIGEST, ENTRY_SIZE,
                             ENTRY_WORD_OFF, FLAG_AGE, FLAG_DEVICE, HEALS_OFF, KIND_EXACT, LIVE, LOCK_CLASSTAB,
                             LOCK_COL_DIRTY, LOCK_IDS, LOCK_INIT, LOCK_POOL, LOCK_PROC, LOCK_RECORD, META_LENGTH_OFF,
                             META_OWNER_OFF, META_SIZE, PROC_COUNTERS_OFF, PROC_ENTRY, PROC_HEAD, PROC_LAYOUT,
                             RESERVED, RETIRED_OFF, SHARD_LOCK_BASE, SLAB_CLS, SLAB_ENTRY, SLAB_STATE, SLOT_LOCK_BASE,
                             UNIT_FREE, UNIT_HEAD, VERSION)
from ..format.geometry import Geometry
from ..locking.locks import lock_name
from .view import PoolView, as_view

#: Version of the `report()` layout (the `maru-shm inspect --json` object).
REPORT_SCHEMA = 2  # 2: a process's `alive` may be None (unknown), and `repair.locks_seen`
#: A shard is kept at or below this load by eviction (docs/FORMAT.md section 7).
SHARD_LOAD_LIMIT = 7 / 8


def _intact(figure):
    """The figure's value, only if no page of the view's mapping was lost while it was read."""
    @functools.wraps(figure)
    def read(src, *args, **kwargs):
        out = figure(src, *args, **kwargs)
        as_view(src).check_intact()
        return out
    return read


def _column(mm, off: int, count: int, stride: int, dtype: str) -> np.ndarray:
    """A copy of one field of a table of `count` records (so no view outlives the call)."""
    view = np.ndarray((count,), dtype=dtype, buffer=mm, offset=off, strides=(stride,))
    try:
        return view.copy()
    finally:
        del view


class _Snapshot:
    """The arrays the figures need, each copied from the mapping once."""

    def __init__(self, v: PoolView):
        g = v.geo
        self.v, self.g = v, g
        self._meta = None
        self.states = _column(v.mm, g.off_slabs + SLAB_STATE, g.n_units, SLAB_ENTRY, "<u4")
        self.clsfield = _column(v.mm, g.off_slabs + SLAB_CLS, g.n_units, SLAB_ENTRY, "<u4")
        self.classes = _read_classes(v.mm, g)

    @property
    def meta(self):
        """(words, lengths, owners) of every block meta."""
        if self._meta is None:
            g = self.g
            self._meta = (_column(self.v.mm, g.off_blockmeta, g.n_granules, META_SIZE, "<u8"),
                          _column(self.v.mm, g.off_blockmeta + META_LENGTH_OFF, g.n_granules, META_SIZE, "<u4"),
                          _column(self.v.mm, g.off_blockmeta + META_OWNER_OFF, g.n_granules, META_SIZE, "<u2"))
        return self._meta


def _read_classes(mm, g: Geometry) -> dict[int, dict]:
    """Class entries of a usable shape (Geometry.class_fits), by id."""
    out = {}
    for cid in range(g.class_cap):
        kind, k, block, bps, _partial, _nslabs, _used, declared_ns = CLASS_STRUCT.unpack_from(
            mm, g.class_entry(cid))
        if g.class_fits(kind, k, block, bps):
            out[cid] = {"kind": kind, "k": k, "block": block, "bps": bps, "declared_ns": declared_ns}
    return out


def _index_shape(v: PoolView) -> dict:
    g = v.geo
    n = g.index_slots
    words = _column(v.mm, g.off_index + ENTRY_WORD_OFF, n, ENTRY_SIZE, "<u8")
    # the digest's second u64 half: the home slot's hash
    homes = _column(v.mm, g.off_index + (ENTRY_COL_DIGEST + 1) * 8, n, ENTRY_SIZE, "<u8")
    used = words != 0
    pos = np.arange(n, dtype=np.int64) % g.shard_slots
    home = (homes & np.uint64(g.shard_slots - 1)).astype(np.int64)
    d = ((pos - home) % g.shard_slots)[used]
    entries = int(used.sum())
    return {
        "entries": entries,
        "index_slots": n,
        "index_shards": g.index_shards,
        "load_factor": entries / n if n else 0.0,
        "max_shard_load": float(used.reshape(g.index_shards, g.shard_slots).sum(axis=1).max() / g.shard_slots),
        "probe_mean": float(d.mean() + 1) if entries else 0.0,
        "probe_max": int(d.max() + 1) if entries else 0,
    }


@_intact
def index_shape(src) -> dict:
    """Entries, capacity, load factor and probe lengths of the index."""
    return _index_shape(as_view(src))


def _class_rows(snap: _Snapshot) -> list[dict]:
    g = snap.g
    words, lengths, owners = snap.meta
    rows = []
    heads_all = snap.states == UNIT_HEAD
    for cid, info in sorted(snap.classes.items()):
        heads = np.flatnonzero(heads_all & (snap.clsfield == cid)).astype(np.int64)
        heads = heads[g.slab_fits(heads, info["k"])]
        if heads.size == 0:
            continue
        offs = g.block_offset(heads[:, None], np.arange(info["bps"], dtype=np.int64)[None, :], info["block"]).ravel()
        starts = offs // g.granule
        st = words[starts] & np.uint64(3)
        owned = owners[starts] != 0
        lv = (st == LIVE) & ~owned  # published values (an owned LIVE block is in flight or kept for reuse)
        n_live = int(lv.sum())
        n_res = int((st == RESERVED).sum())
        n_held = int(((st == LIVE) & owned).sum())
        live_bytes = int(lengths[starts][lv].sum())
        rows.append({
            "class": cid, "kind": "exact" if info["kind"] == KIND_EXACT else "geometric",
            "block_size": info["block"], "slab_units": info["k"], "blocks_per_slab": info["bps"],
            "slabs": int(heads.size), "blocks": int(starts.size),
            "used": n_live + n_res + n_held, "live": n_live, "reserved": n_res, "held": n_held,
            "free": int((st == 0).sum()),
            "live_bytes": live_bytes,
            "fragmentation": 1 - live_bytes / (n_live * info["block"]) if n_live else 0.0,
        })
    return rows


@_intact
def class_table(src) -> list[dict]:
    """Per size class in use: slabs, blocks used/free, live payload, internal fragmentation."""
    return _class_rows(_Snapshot(as_view(src)))


_BOOT_NS: int | None = None


def _boot_ns() -> int:
    global _BOOT_NS
    if _BOOT_NS is None:
        _BOOT_NS = 0
        try:
            with open("/proc/stat", "rb") as f:
                for line in f:
                    if line.startswith(b"btime "):
                        _BOOT_NS = int(line.split()[1]) * 10**9
                        break
        except (OSError, ValueError):
            pass
    return _BOOT_NS


def _started_ns(start_ticks: int) -> int | None:
    """Wall-clock start time of a process from its start time in clock ticks since boot."""
    boot = _boot_ns()
    if not boot or not start_ticks:
        return None
    return boot + start_ticks * 10**9 // os.sysconf("SC_CLK_TCK")


def _processes(v: PoolView) -> list[dict]:
    g = v.geo
    out = []
    for slot in range(g.proc_slots):
        o = g.off_procs + slot * PROC_ENTRY
        state, pid, ticks, attach_ns, uid = PROC_HEAD.unpack_from(v.mm, o)
        if state == 0:
            continue
        counters = dict(zip(COUNTER_NAMES, COUNTERS.unpack_from(v.mm, o + PROC_COUNTERS_OFF)))
        out.append({"slot": slot, "pid": pid, "uid": uid, "alive": v.slot_alive(slot),
                    "self": slot == v.self_slot, "start_ticks": ticks, "started_ns": _started_ns(ticks),
                    "attach_ns": attach_ns, "counters": counters})
    return out


@_intact
def processes(src) -> list[dict]:
    """Claimed process-table slots: pid, start time, attach time, alive (its SLOT lock is held; None where
    the view cannot see locks), counters."""
    return _processes(as_view(src))


def _lock_domain(lock_id: int) -> tuple[str, int | None]:
    if lock_id >= SLOT_LOCK_BASE:
        return "slot", lock_id - SLOT_LOCK_BASE
    if lock_id >= SHARD_LOCK_BASE:
        return "shard", lock_id - SHARD_LOCK_BASE
    if lock_id >= CLASS_LOCK_BASE:
        return "class", lock_id - CLASS_LOCK_BASE
    return {LOCK_INIT: "init", LOCK_PROC: "proc", LOCK_CLASSTAB: "classtab", LOCK_POOL: "pool"}.get(
        lock_id, "other"), None


def _dirty_locks(v: PoolView) -> list[dict]:
    g = v.geo
    rec = np.ndarray((LOCK_IDS, LOCK_RECORD.size // 4), dtype="<u4", buffer=v.mm, offset=g.off_locks)
    try:
        marked = np.flatnonzero(rec[:, LOCK_COL_DIRTY]).tolist()
    finally:
        del rec
    out = []
    for lock_id in marked:
        if v.held(lock_id):
            continue  # a holder is inside its section right now
        holder, op = LOCK_RECORD.unpack_from(v.mm, g.off_locks + lock_id * LOCK_RECORD.size)
        if holder == 0 or v.held(lock_id):
            continue  # released cleanly meanwhile, or taken again
        domain, index = _lock_domain(lock_id)
        out.append({"lock": lock_name(lock_id), "id": lock_id, "domain": domain, "index": index,
                    "holder_slot": holder - 1 if holder != 0xFFFFFFFF else None, "op": op})
    return out


@_intact
def dirty_locks(src) -> list[dict]:
    """Locks whose last holder died inside its critical section (repaired at next use)."""
    return _dirty_locks(as_view(src))


def _counters(v: PoolView, procs: list[dict]) -> dict:
    return _totals(v, [[p["counters"][name] for name in COUNTER_NAMES] for p in procs])


def _totals(v: PoolView, per_slot: list) -> dict:
    """The retired totals plus each claimed slot's counters (lists in COUNTER_NAMES order), and `heals`."""
    total = list(COUNTERS.unpack_from(v.mm, RETIRED_OFF))
    for values in per_slot:
        for i, x in enumerate(values):
            total[i] += x
    out = dict(zip(COUNTER_NAMES, (t & (2**64 - 1) for t in total)))
    out["heals"] = int(np.frombuffer(v.mm, dtype="<u8", count=1, offset=HEALS_OFF)[0])  # one 8-byte load
    return out


@_intact
def counters(src) -> dict:
    """Pool-wide counters: retired totals plus every claimed slot's own, and the pool's `heals`. It reads the
    slots' counters alone (no liveness probe, no scan of the pool), so a serving loop may ask on every step:
    SGLang calls the backend's get_stats() once per scheduler step."""
    v = as_view(src)
    g = v.geo
    table = np.ndarray((g.proc_slots,), dtype=PROC_LAYOUT, buffer=v.mm, offset=g.off_procs)
    try:
        claimed = table["counters"][table["state"] != 0].tolist()  # a copy: no view outlives the call
    finally:
        del table
    return _totals(v, claimed)


def _space(snap: _Snapshot) -> dict:
    g = snap.g
    words, lengths, owners = snap.meta
    st = words & np.uint64(3)
    owned = owners != 0
    live = (st == LIVE) & ~owned  # published values
    live_bytes = int(lengths[live].sum())
    return {
        "units": g.n_units,
        "free_units": int((snap.states == UNIT_FREE).sum()),
        "slabs": int((snap.states == UNIT_HEAD).sum()),
        "live_blocks": int(live.sum()),
        "reserved_blocks": int((st == RESERVED).sum()),
        "held_blocks": int(((st == LIVE) & owned).sum()),  # committed, owned: in flight or kept for reuse
        "live_bytes": live_bytes,
        "utilization": live_bytes / g.file_size,
        "data_utilization": live_bytes / g.data_bytes,
    }


@_intact
def pool_stats(src) -> dict:
    """Pool-wide figures as one flat dict (what Store.stats() returns)."""
    v = as_view(src)
    g = v.geo
    snap = _Snapshot(v)
    sp = _space(snap)
    procs = _processes(v)
    c = _counters(v, procs)
    s = {
        "path": v.path,
        "file_bytes": g.file_size,
        "data_bytes": g.data_bytes,
        "header_bytes": g.off_data,
        "granule": g.granule,
        "unit_size": g.unit_size,
        "units": g.n_units,
        "free_units": sp["free_units"],
        "slabs": sp["slabs"],
        "max_value": g.max_value,
        "live_blocks": sp["live_blocks"],
        "held_blocks": sp["held_blocks"],
        "reserved_blocks": sp["reserved_blocks"],
        "live_bytes": sp["live_bytes"],
        "utilization": sp["utilization"],
        "data_utilization": sp["data_utilization"],
    }
    s.update(_index_shape(v))
    s.update(c)
    lookups = c["hits"] + c["misses"]
    s["hit_ratio"] = c["hits"] / lookups if lookups else 0.0
    s["processes"] = len(procs)
    return s


@_intact
def report(src) -> dict:
    """Everything `maru-shm inspect` shows, as one JSON-ready dict (keys documented in docs/CLI.md)."""
    v = as_view(src)
    g = v.geo
    taken = time.time_ns()
    snap = _Snapshot(v)
    classes = _class_rows(snap)
    space = _space(snap)
    allocated = sum(r["used"] * r["block_size"] for r in classes)
    live_block_bytes = sum(r["live"] * r["block_size"] for r in classes)
    space.update({
        "slab_units": sum(r["slabs"] * r["slab_units"] for r in classes),
        "allocated_bytes": allocated,
        "fragmentation": 1 - space["live_bytes"] / live_block_bytes if live_block_bytes else 0.0,
    })
    procs = _processes(v)
    c = _counters(v, procs)
    lookups = c["hits"] + c["misses"]
    c["hit_ratio"] = c["hits"] / lookups if lookups else 0.0
    dirty = _dirty_locks(v)
    index = _index_shape(v)
    index["shard_slots"] = g.shard_slots
    index["max_entries"] = g.index_shards * (g.shard_slots * 7 // 8)
    return {
        "schema": REPORT_SCHEMA,
        "path": v.path,
        "taken_ns": taken,
        "format": {
            "version": VERSION,
            "flags": g.flags,
            "device": bool(g.flags & FLAG_DEVICE),
            "eviction": "age" if g.flags & FLAG_AGE else "count",
            "pool_uuid": g.pool_uuid.hex(),
            "created_ns": g.created_ns,
        },
        "geometry": {
            "file_bytes": g.file_size,
            "header_bytes": g.off_data,
            "data_bytes": g.data_bytes,
            "granule": g.granule,
            "unit_size": g.unit_size,
            "units": g.n_units,
            "max_value": g.max_value,
            "geometric_classes": g.n_geo_classes,
            "class_cap": g.class_cap,
            "proc_slots": g.proc_slots,
            "index_shards": g.index_shards,
            "shard_slots": g.shard_slots,
            "block_metas": g.n_granules,
            "offsets": {
                "locks": g.off_locks, "classes": g.off_classes, "procs": g.off_procs, "slabs": g.off_slabs,
                "shards": g.off_shards, "index": g.off_index, "blockmeta": g.off_blockmeta, "data": g.off_data,
            },
        },
        "space": space,
        "classes": classes,
        "index": index,
        "processes": procs,
        "repair": {
            "dirty_locks": dirty,
            "shards": sorted(d["index"] for d in dirty if d["domain"] == "shard"),
            "classes": sorted(d["index"] for d in dirty if d["domain"] == "class"),
            "pool": any(d["domain"] == "pool" for d in dirty),
            "dead_processes": [p["slot"] for p in procs if p["alive"] is False],
            "locks_seen": v.sees_locks,
        },
        "counters": c,
    }


__all__ = ["PoolView", "report", "pool_stats", "class_table", "processes", "dirty_locks", "index_shape",
           "counters", "REPORT_SCHEMA", "SHARD_LOAD_LIMIT"]
