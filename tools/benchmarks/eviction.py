"""Eviction scenario of `maru-shm bench`: hit ratio of a Zipf get-or-put trace vs exact LRU.

A seeded trace of requests over a fixed key population, key popularity Zipf
(alpha 0.9, rank k drawn with probability proportional to 1 / k^alpha, ranks
shuffled over the keys so popularity and size are independent). Every key has
one fixed size, drawn once, uniform 50-512 KiB (the `mixed` scenario's sizes).
Each request is a get; on a miss the value is put (get-or-put, as a KV cache
tier is used). The same trace runs against a real Store and against exact LRU
simulators (an OrderedDict with a byte capacity):

  LRU file bytes  capacity = the pool's data area (`data_bytes`): the bytes
                  the file gives the data, what the goal compares with;
  LRU live bytes  capacity = the live payload the store actually held, mean
                  over the measured half: the eviction policy alone, the
                  space lost to size classes and slabs taken out;
  LRU classes     capacity = data area, each value charged its size-class
                  block: how much of the gap is rounding to classes.

and, to place the store's policy between the textbook ones, per-object CLOCK
(second chance) and random eviction with the live-bytes capacity.

Hit ratios are counted over the second half of the trace (the first half
warms the cache), the same requests for every contestant.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from maru_shm import format_size, remove_pool
from maru_shm.format.layout import LIVE, META_REF_OFF

from .registry import figure, progress_of, scenario

ALPHA = 0.9
SIZE_LO, SIZE_HI = 50 << 10, 512 << 10
GOAL_PP = 2.0  # percentage points below exact LRU with the file's data bytes


def zipf_trace(n_keys: int, n_requests: int, alpha: float = ALPHA, seed: int = 5) -> np.ndarray:
    """Key ids (0 .. n_keys-1) of n_requests requests, popularity Zipf(alpha) over shuffled ranks."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** alpha
    p /= p.sum()
    ranks = rng.choice(n_keys, size=n_requests, p=p)
    return rng.permutation(n_keys)[ranks]


def key_sizes(n_keys: int, lo: int = SIZE_LO, hi: int = SIZE_HI, seed: int = 6) -> np.ndarray:
    """One fixed size per key, uniform in [lo, hi]."""
    return np.random.default_rng(seed).integers(lo, hi + 1, size=n_keys)


class LRU:
    """Exact LRU over a byte capacity: `access(key, cost)` is a get-or-put, True on a hit.

    A miss inserts the key at the most-recent end and evicts from the least-recent
    end until the charged bytes fit; a key costing more than the capacity is not kept.
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.used = 0
        self.items: OrderedDict = OrderedDict()

    def access(self, key, cost: int) -> bool:
        items = self.items
        if key in items:
            items.move_to_end(key)
            return True
        if cost > self.capacity:
            return False
        items[key] = cost
        self.used += cost
        while self.used > self.capacity:
            _, c = items.popitem(last=False)
            self.used -= c
        return False


def lru_hits(trace, costs, capacity: int, warm: int) -> tuple[int, int]:
    """(hits, requests) of exact LRU on trace[warm:], the cache warmed by trace[:warm]."""
    lru = LRU(capacity)
    costs = costs.tolist() if hasattr(costs, "tolist") else list(costs)
    tr = trace.tolist() if hasattr(trace, "tolist") else list(trace)
    access = lru.access
    for k in tr[:warm]:
        access(k, costs[k])
    hits = 0
    for k in tr[warm:]:
        hits += access(k, costs[k])
    return hits, len(tr) - warm


def clock_hits(trace, costs, capacity: int, warm: int) -> tuple[int, int]:
    """(hits, requests) of per-object CLOCK (second chance, FIFO ring) on trace[warm:]."""
    from collections import deque
    costs = costs.tolist() if hasattr(costs, "tolist") else list(costs)
    ring, ref, used, hits = deque(), {}, 0, 0
    for i, k in enumerate(trace.tolist() if hasattr(trace, "tolist") else trace):
        if k in ref:
            ref[k] = 1
            hits += i >= warm
            continue
        if costs[k] > capacity:
            continue
        ref[k] = 0
        ring.append(k)
        used += costs[k]
        while used > capacity:
            v = ring.popleft()
            if ref[v]:
                ref[v] = 0
                ring.append(v)
            else:
                del ref[v]
                used -= costs[v]
    return hits, len(trace) - warm


def random_hits(trace, costs, capacity: int, warm: int, seed: int = 1) -> tuple[int, int]:
    """(hits, requests) of random eviction (a uniformly chosen resident value goes) on trace[warm:]."""
    import random
    rnd = random.Random(seed)
    costs = costs.tolist() if hasattr(costs, "tolist") else list(costs)
    items, pos, used, hits = [], {}, 0, 0
    for i, k in enumerate(trace.tolist() if hasattr(trace, "tolist") else trace):
        if k in pos:
            hits += i >= warm
            continue
        if costs[k] > capacity:
            continue
        pos[k] = len(items)
        items.append(k)
        used += costs[k]
        while used > capacity:
            j = rnd.randrange(len(items))
            v, last = items[j], items.pop()
            if j < len(items):
                items[j] = last
                pos[last] = j
            del pos[v]
            used -= costs[v]
    return hits, len(trace) - warm


class _WindowObserver:
    """Watches the store's slab-CLOCK evictions from this process, without changing them.

    Wraps the allocator's `_evict_for` / `_evict_window` on the Store instance (not the
    class) and only reads the pool: per eviction window, how many slabs it emptied, how
    many of those had their CLOCK bit set (recently used: only the slab that starts a
    window is checked), and how many LIVE values went with them, and how many of those
    had been hit since they were written (block `ref`). If the allocator's internals
    change shape, it stays off and reports nothing.
    """

    FIELDS = ("evictions", "window_units", "slabs", "slabs_referenced", "values", "values_hit")

    def __init__(self, store):
        self.a = store.alloc
        self.mm = store.mm
        self.n = dict.fromkeys(self.FIELDS, 0)
        mover = getattr(self.a, "mover", None)
        self.on = mover is not None and all(hasattr(mover, f) for f in ("evict_for", "evict_window")) \
            and all(hasattr(self.a, f) for f in ("slabs", "meta_off", "classes"))
        if self.on:
            self._for, self._window = mover.evict_for, mover.evict_window
            mover.evict_for, mover.evict_window = self._evict_for, self._evict_window

    def close(self) -> None:
        if self.on:
            del self.a.mover.evict_for, self.a.mover.evict_window
            self.on = False

    def _evict_for(self, info, *rest):
        self.n["evictions"] += 1
        self.n["window_units"] += info.k
        return self._for(info, *rest)

    def _evict_window(self, w0, k, my_cid, *rest):
        a, mm = self.a, self.mm
        slabs = refd = values = hit = 0
        for h in a.slabs.heads_in(w0, k):
            c = int(a.slabs.clsfield[h])
            ci = a.classes[c] if c < len(a.classes) else None
            if ci is None:
                continue
            slabs += 1
            refd += a.slabs.referenced(h, ci.k, clear=False)
            for i in range(ci.bps):
                m = a.meta_off(h * a.geo.unit_size + i * ci.block)
                if mm[m] & 3 == LIVE:
                    values += 1
                    hit += mm[m + META_REF_OFF] != 0
        ok = self._window(w0, k, my_cid, *rest)
        if ok:
            for f, v in zip(self.FIELDS[2:], (slabs, refd, values, hit)):
                self.n[f] += v
        return ok

    def summary(self) -> dict | None:
        n = self.n
        if not n["evictions"]:
            return None
        return {**n, "mean_window_bytes": n["window_units"] / n["evictions"] * self.a.geo.unit_size,
                "slabs_per_window": n["slabs"] / n["evictions"],
                "referenced_share": n["slabs_referenced"] / max(1, n["slabs"]),
                "values_per_window": n["values"] / n["evictions"],
                "values_hit_share": n["values_hit"] / max(1, n["values"])}


def run_store(trace, sizes, pool_bytes: int, warm: int, path: str, progress=None, samples: int = 16) -> dict:
    """Get-or-put of the trace against a fresh Store of pool_bytes; hits counted over trace[warm:]."""
    from maru_shm import Store
    from maru_shm import pool_report as report

    sizes_l = sizes.tolist()
    tr = trace.tolist()
    keys = [f"z{k}" for k in range(len(sizes_l))]
    blob = memoryview(os.urandom(int(max(sizes_l))))
    out = bytearray(int(max(sizes_l)))
    every = max(1, (len(tr) - warm) // samples)
    live, held = [], []
    hits = hit_bytes = put_fail = 0
    try:
        with Store.open(path, size=pool_bytes, create=True, populate=True) as s:
            data_bytes = s.geo.data_bytes
            block_of = {}
            get_into, put = s.get_into, s.put
            obs = _WindowObserver(s)
            try:
                for i, k in enumerate(tr):
                    if get_into(keys[k], out) is None:
                        if not put(keys[k], blob[:sizes_l[k]]):
                            put_fail += 1
                    elif i >= warm:
                        hits += 1
                        hit_bytes += sizes_l[k]
                    if i >= warm and (i - warm) % every == every - 1:
                        st = s.stats()
                        live.append(st["live_bytes"])
                        held.append(st["live_blocks"])
                    if progress is not None and i % 2048 == 0:
                        progress(i / len(tr))
            finally:
                obs.close()
            if not live:
                st = s.stats()
                live.append(st["live_bytes"])
                held.append(st["live_blocks"])
            for n in set(sizes_l):
                block_of[n] = s.alloc.class_for(n).block
            rep = report(s)
            st = s.stats()
            ok = s.check().ok
    finally:
        remove_pool(path)
    sp = rep["space"]
    return {"hits": hits, "requests": len(tr) - warm, "hit_bytes": hit_bytes, "put_failures": put_fail,
            "data_bytes": data_bytes, "file_bytes": st["file_bytes"], "live_bytes_mean": float(np.mean(live)),
            "live_values_mean": float(np.mean(held)), "live_bytes_final": st["live_bytes"],
            "allocated_bytes_final": sp["allocated_bytes"], "free_units_final": sp["free_units"],
            "slab_bytes_final": sp["slab_units"] * st["unit_size"],
            "unit_size": st["unit_size"], "evictions": st["evictions"], "slab_moves": st["slab_moves"],
            "check_ok": ok, "windows": obs.summary(), "block_of": block_of}


def eviction(pool_sizes, n_keys: int = 12_000, n_requests: int = 100_000, alpha: float = ALPHA, seed: int = 5,
             progress=None, path_prefix: str | None = None) -> dict:
    """Run the trace at every pool size; ours vs exact LRU (file bytes, live bytes, class-rounded)."""
    trace = zipf_trace(n_keys, n_requests, alpha, seed)
    sizes = key_sizes(n_keys, seed=seed + 1)
    warm = n_requests // 2
    working_set = int(sizes.sum())
    prefix = path_prefix or os.path.join("/dev/shm", f"maru-bench-{os.getpid()}-evict")
    points = []
    for j, pool in enumerate(pool_sizes):
        def sub(f, note="store", j=j):
            if progress is not None:
                progress((j + f) / len(pool_sizes), f"{pool >> 20} MiB pool ({j + 1}/{len(pool_sizes)}): {note}")
        ours = run_store(trace, sizes, int(pool), warm, f"{prefix}-{j}", lambda f: sub(0.8 * f))
        sub(0.8, "LRU, CLOCK and random simulators")
        block_of = ours.pop("block_of")
        rounded = np.array([block_of[int(n)] for n in sizes.tolist()], dtype=np.int64)
        lru_file = lru_hits(trace, sizes, ours["data_bytes"], warm)
        lru_live = lru_hits(trace, sizes, int(ours["live_bytes_mean"]), warm)
        lru_cls = lru_hits(trace, rounded, ours["data_bytes"], warm)
        live_cap = int(ours["live_bytes_mean"])
        clk = clock_hits(trace, sizes, live_cap, warm)
        rnd = random_hits(trace, sizes, live_cap, warm, seed)
        hr = ours["hits"] / ours["requests"]
        h_file = lru_file[0] / lru_file[1]
        h_live = lru_live[0] / lru_live[1]
        h_cls = lru_cls[0] / lru_cls[1]
        h_clk, h_rnd = clk[0] / clk[1], rnd[0] / rnd[1]
        data = ours["data_bytes"]
        points.append({
            "pool_bytes": int(pool), "cache_fraction": ours["data_bytes"] / working_set,
            "ours": hr, "lru_file_bytes": h_file, "lru_live_bytes": h_live, "lru_class_rounded": h_cls,
            "gap_pp": 100 * (h_file - hr), "gap_policy_pp": 100 * (h_live - hr),
            "gap_space_pp": 100 * (h_file - h_live), "gap_rounding_pp": 100 * (h_file - h_cls),
            "clock_live_bytes": h_clk, "random_live_bytes": h_rnd,
            # where ours sits between random eviction (0) and exact LRU (1), at the same live bytes
            "policy_position": (hr - h_rnd) / (h_live - h_rnd) if h_live != h_rnd else float("nan"),
            "ratio": hr / h_file if h_file else float("nan"),
            "goal_pp": GOAL_PP, "met": 100 * (h_file - hr) <= GOAL_PP,
            "live_over_data": ours["live_bytes_mean"] / ours["data_bytes"],
            # the data area at the end: live payload, class rounding, free blocks in slabs, free units
            "space_final": {"live": ours["live_bytes_final"] / data,
                            "rounding": (ours["allocated_bytes_final"] - ours["live_bytes_final"]) / data,
                            "free_in_slabs": (ours["slab_bytes_final"] - ours["allocated_bytes_final"]) / data,
                            "free_units": ours["free_units_final"] * ours["unit_size"] / data},
            **ours,
        })
    return {"alpha": alpha, "keys": n_keys, "requests": n_requests, "measured_requests": n_requests - warm,
            "seed": seed, "size_range": [SIZE_LO, SIZE_HI], "working_set_bytes": working_set, "points": points,
            "goal_pp": GOAL_PP, "met": all(p["met"] for p in points)}


NAME = "eviction"


@scenario(NAME)
def bench_eviction(args) -> dict:
    r = eviction(args.eviction_pools, n_keys=args.eviction_keys, n_requests=args.eviction_requests,
                 progress=progress_of(args))
    figs = []
    for p in r["points"]:
        tag = f"hit ratio, {format_size(p['pool_bytes'])} pool ({p['cache_fraction'] * 100:.1f} % of the key set)"
        figs.append(figure(tag, p["ours"], p["lru_file_bytes"], "exact LRU, capacity = data area bytes",
                           goal=f"within {p['goal_pp']} pp", met=p["met"], diff_pp=-p["gap_pp"]))
        figs.append(figure(tag, p["ours"], p["lru_live_bytes"], "exact LRU, capacity = our live bytes",
                           diff_pp=-p["gap_policy_pp"]))
    return {"scenario": "eviction", **r, "figures": figs}
