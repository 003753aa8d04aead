"""Read-only figures about a pool, computed from the shared file without taking locks.

Used by Store.stats() and the `maru-shm inspect` command. Everything here is
a snapshot: writers may move on while it is taken, so counts can be off by
the few operations in flight.
"""

from __future__ import annotations

import numpy as np

from .format import (CLASS_ENTRY, CLASS_STRUCT, COUNTER_NAMES, COUNTERS, ENTRY_SIZE, KIND_EXACT, LIVE,
                     LOCK_IDS, LOCK_RECORD, PROC_COUNTERS_OFF, PROC_ENTRY, PROC_HEAD, RESERVED, RETIRED_OFF,
                     SHARD_LOCK_BASE, SLOT_LOCK_BASE, UNIT_HEAD)
from .locks import lock_name, ofd_is_held


def _meta_arrays(store):
    g = store.geo
    words = np.ndarray((g.n_granules,), dtype="<u8", buffer=store.mm, offset=g.off_blockmeta, strides=(32,)).copy()
    lengths = np.ndarray((g.n_granules,), dtype="<u4", buffer=store.mm, offset=g.off_blockmeta + 24,
                         strides=(32,)).copy()
    return words, lengths


def index_shape(store) -> dict:
    """Entries, capacity, load factor and probe lengths of the index."""
    g = store.geo
    n = g.index_slots
    words = np.ndarray((n,), dtype="<u8", buffer=store.mm, offset=g.off_index + 16, strides=(ENTRY_SIZE,)).copy()
    homes = np.ndarray((n,), dtype="<u8", buffer=store.mm, offset=g.off_index + 8, strides=(ENTRY_SIZE,)).copy()
    used = words != 0
    pos = np.arange(n, dtype=np.int64) % g.shard_slots
    home = (homes & np.uint64(g.shard_slots - 1)).astype(np.int64)
    dist = (pos - home) % g.shard_slots
    d = dist[used]
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


def class_table(store) -> list[dict]:
    """Per size class in use: slabs, blocks used/free, live payload, internal fragmentation."""
    g, alloc = store.geo, store.alloc
    alloc.refresh_classes()
    words, lengths = _meta_arrays(store)
    live = (words & 3) == LIVE
    rows = []
    for info in alloc.classes:
        if info is None:
            continue
        heads = alloc.class_slabs(info.cid)
        if not heads:
            continue
        starts = []
        for h in heads:
            starts.extend((h * g.unit_size + i * info.block) // g.granule for i in range(info.bps))
        starts = np.array(starts, dtype=np.int64)
        lv = live[starts]
        st = words[starts] & 3
        live_bytes = int(lengths[starts][lv].sum())
        n_live = int(lv.sum())
        rows.append({
            "class": info.cid, "kind": "exact" if info.kind == KIND_EXACT else "geometric",
            "block_size": info.block, "slab_units": info.k, "slabs": len(heads),
            "blocks": len(heads) * info.bps, "live": n_live, "reserved": int((st == RESERVED).sum()),
            "free": int((st == 0).sum()), "live_bytes": live_bytes,
            "fragmentation": 1 - live_bytes / (n_live * info.block) if n_live else 0.0,
        })
    return rows


def processes(store) -> list[dict]:
    g = store.geo
    out = []
    for slot in range(g.proc_slots):
        o = g.off_procs + slot * PROC_ENTRY
        state, pid, ticks, attach_ns, uid = PROC_HEAD.unpack_from(store.mm, o)
        if state == 0:
            continue
        alive = slot == store.slot or ofd_is_held(store.locks.fd, SLOT_LOCK_BASE + slot)
        counters = dict(zip(COUNTER_NAMES, COUNTERS.unpack_from(store.mm, o + PROC_COUNTERS_OFF)))
        out.append({"slot": slot, "pid": pid, "start_ticks": ticks, "attach_ns": attach_ns, "uid": uid,
                    "alive": bool(alive), "self": slot == store.slot, "counters": counters})
    return out


def dirty_locks(store) -> list[dict]:
    """Locks whose last holder died inside its critical section (repaired at next use)."""
    g = store.geo
    rec = np.ndarray((LOCK_IDS, 2), dtype="<u4", buffer=store.mm, offset=g.off_locks).copy()
    out = []
    for lock_id in np.flatnonzero(rec[:, 0]).tolist():
        held = ofd_is_held(store.locks.fd, lock_id)
        if not held:
            out.append({"lock": lock_name(lock_id), "holder_slot": int(rec[lock_id, 0]) - 1})
    return out


def counters(store) -> dict:
    total = list(COUNTERS.unpack_from(store.mm, RETIRED_OFF))
    for p in processes(store):
        for i, name in enumerate(COUNTER_NAMES):
            total[i] += p["counters"][name]
    return dict(zip(COUNTER_NAMES, total))


def pool_stats(store) -> dict:
    g = store.geo
    words, lengths = _meta_arrays(store)
    live = (words & 3) == LIVE
    live_bytes = int(lengths[live].sum())
    c = counters(store)
    heads = int((store.alloc.states == UNIT_HEAD).sum())
    free_units = int((store.alloc.states == 0).sum())
    s = {
        "path": store.path,
        "file_bytes": g.file_size,
        "data_bytes": g.data_bytes,
        "header_bytes": g.off_data,
        "granule": g.granule,
        "unit_size": g.unit_size,
        "units": g.n_units,
        "free_units": free_units,
        "slabs": heads,
        "max_value": g.max_value,
        "live_blocks": int(live.sum()),
        "live_bytes": live_bytes,
        "utilization": live_bytes / g.file_size,
        "data_utilization": live_bytes / g.data_bytes,
    }
    s.update(index_shape(store))
    s.update(c)
    lookups = c["hits"] + c["misses"]
    s["hit_ratio"] = c["hits"] / lookups if lookups else 0.0
    s["processes"] = len(processes(store))
    return s


__all__ = ["pool_stats", "class_table", "processes", "dirty_locks", "index_shape", "counters",
           "CLASS_ENTRY", "CLASS_STRUCT", "SHARD_LOCK_BASE"]
