"""`maru-shm bench`: every figure next to the figure it competes with, measured in the same run.

Scenarios (all by default; pick with --only):
  capacity  Llama-3.1-8B pages (131072 B) filling a pool: share of the file
            holding live payload, vs Maru's fixed 1 MiB chunks (computed).
  mixed     uniform 50-512 KiB payloads written at 3x the pool size: live
            payload / file at the end, vs fixed 512 KiB slots and power-of-two
            classes simulated on the same sequence.
  ops       put/get operations per second for 4 KiB and 128 KiB values vs a
            plain memmove of the same bytes into a /dev/shm mapping.
  hybrid    DeepSeek-V4-like requests (compressed KV at ratios 1/2/4/128, c4
            indexer, SWA window, KV markers) through MaruStorage's v2 API at 3x
            the pool size: live payload / file, vs fixed slots of the largest
            page and power-of-two classes simulated on the same sequence.
  eviction  a seeded Zipf(0.9) get-or-put trace over keys of 50-512 KiB at
            three pool sizes: hit ratio vs exact LRU given the pool's data
            bytes (and given the live bytes the store held), same trace.
  scaling   1, 2, 4, 8 processes on one pool, 50/50 get/put of 128 KiB
            values: aggregate ops/s, p50/p99 latency, lock time, vs the same
            processes doing plain 128 KiB copies into/out of a shared mapping.
The machine is shared and noisy: timed figures are the median of --repeat
runs, with the spread (min-max) printed next to them. While it runs, a
progress line goes to stderr when stderr is a terminal (never with --json).
`--json` prints one object; every result carries `figures`: rows of ours,
spread, peer, ratio, goal and met. `--charts DIR` writes PNG charts
(tools/charts.py) from the same results.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import time

from maru_shm import Store, format_size

SCENARIOS = {}


class Progress:
    """One status line on stderr, redrawn in place with \\r; silent unless enabled (a terminal, no --json)."""

    def __init__(self, names: list[str], enabled: bool, stream=None):
        self.names, self.enabled = names, enabled
        self.stream = stream or sys.stderr
        self.i, self.t0, self._last = 0, time.monotonic(), 0.0

    def start(self, i: int) -> None:
        self.i = i
        self._last = 0.0
        self.update(0.0, force=True)

    def update(self, frac: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        n = len(self.names)
        overall = (self.i + max(0.0, min(1.0, frac))) / n
        bar = "#" * int(overall * 20)
        line = (f"bench [{bar:<20}] {overall * 100:3.0f}%  {self.i + 1}/{n} {self.names[self.i]}"
                f"{': ' + note if note else ''}  {now - self.t0:.0f}s")
        self.stream.write("\r" + line[:150] + "\x1b[K")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _progress(args):
    """The scenario's progress callback: progress(fraction of this scenario, note)."""
    p = getattr(args, "progress", None)
    return p.update if p is not None else (lambda frac, note="": None)


def figure(name: str, ours, peer=None, peer_name: str | None = None, *, unit: str = "", spread=None,
           peer_spread=None, goal: str | None = None, met: bool | None = None, better: str = "higher",
           **extra) -> dict:
    """One machine-readable row: ours (a median if timed) and its spread, the peer, their ratio, the goal.

    `ratio` is always ours / peer; `better` says which way wins ("higher" or "lower", e.g. a latency).
    """
    ratio = ours / peer if peer not in (None, 0) and ours is not None else None
    return {"name": name, "unit": unit, "ours": ours, "spread": list(spread) if spread is not None else None,
            "peer": peer, "peer_name": peer_name,
            "peer_spread": list(peer_spread) if peer_spread is not None else None,
            "ratio": ratio, "better": better, "goal": goal, "met": met, **extra}


def scenario(name):
    def deco(fn):
        SCENARIOS[name] = fn
        return fn
    return deco


def _pool_path(tag: str) -> str:
    return os.path.join("/dev/shm", f"maru-bench-{os.getpid()}-{tag}")


def _median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


@scenario("capacity")
def bench_capacity(args) -> dict:
    page = 131072
    size = args.pool_size
    path = _pool_path("cap")
    try:
        with Store.open(path, size=size, create=True) as s:
            s.declare_size(page)
            buf = os.urandom(page)
            n = int(size // page * 1.1)
            keys = [f"page-{i}" for i in range(n)]
            for i in range(0, n, 128):
                s.batch_put(keys[i:i + 128], [buf] * len(keys[i:i + 128]))
                _progress(args)(i / n)
            st = s.stats()
            assert s.check().ok
        maru_fixed = page / (1 << 20)
        met = st["utilization"] >= 0.97
        return {"scenario": "capacity", "pool_bytes": size, "value_bytes": page, "ours": st["utilization"],
                "peer": maru_fixed, "peer_name": "Maru fixed 1 MiB chunk", "goal": 0.97,
                "met": met, "entries": st["entries"], "evictions": st["evictions"],
                "figures": [figure("live payload / file", st["utilization"], maru_fixed, "Maru fixed 1 MiB chunk",
                                   goal=">= 0.97", met=met)]}
    finally:
        if os.path.exists(path):
            os.unlink(path)


MARU_CHUNK = 1 << 20  # Maru's fixed chunk: a value takes whole 1 MiB chunks


def _simulate_slots(sizes, capacity, slot_of):
    """Live payload / capacity at the end of a FIFO cache whose items occupy slot_of(size) bytes."""
    live, used, q = 0, 0, []
    for sz in sizes:
        occ = slot_of(sz)
        q.append((sz, occ))
        live += sz
        used += occ
        while used > capacity:
            s0, o0 = q.pop(0)
            live -= s0
            used -= o0
    return live / capacity


@scenario("mixed")
def bench_mixed(args) -> dict:
    size = args.pool_size
    rnd = random.Random(7)
    lo, hi = 50 << 10, 512 << 10
    total, sizes = 0, []
    while total < 3 * size:
        n = rnd.randint(lo, hi)
        sizes.append(n)
        total += n
    blob = os.urandom(hi)
    path = _pool_path("mixed")
    samples = []
    try:
        with Store.open(path, size=size, create=True) as s:
            for i in range(0, len(sizes), 64):
                chunk = sizes[i:i + 64]
                s.batch_put([f"m{i + j}" for j in range(len(chunk))], [memoryview(blob)[:n] for n in chunk])
                if i > len(sizes) // 2 and (i // 64) % 8 == 0:
                    samples.append(s.stats()["utilization"])
                _progress(args)(i / len(sizes))
            st = s.stats()
            assert s.check().ok
    finally:
        if os.path.exists(path):
            os.unlink(path)
    pow2 = _simulate_slots(sizes, size, lambda n: 1 << (n - 1).bit_length())
    fixed = _simulate_slots(sizes, size, lambda n: hi)
    maru_1m = _simulate_slots(sizes, size, lambda n: -(-n // MARU_CHUNK) * MARU_CHUNK)
    ours = min(samples + [st["utilization"]])
    met = ours >= 0.90
    return {"scenario": "mixed", "pool_bytes": size, "written_bytes": total, "ours": ours,
            "ours_final": st["utilization"], "fixed_512k": fixed, "pow2_classes": pow2, "maru_1m": maru_1m,
            "goal": 0.90, "met": met, "evictions": st["evictions"],
            "figures": [figure("live payload / file (min over churn)", ours, fixed, "fixed 512 KiB slots",
                               goal=">= 0.90", met=met),
                        figure("live payload / file (min over churn)", ours, pow2, "power-of-two classes"),
                        figure("live payload / file (min over churn)", ours, maru_1m, "Maru fixed 1 MiB chunks")]}


@scenario("ops")
def bench_ops(args) -> dict:
    out = {"scenario": "ops", "rows": [], "figures": []}
    path = _pool_path("ops")
    nkeys = 256
    try:
        with Store.open(path, size=max(args.pool_size, 256 << 20), create=True, populate=True) as s:
            for vsize in (4096, 131072):
                s.declare_size(vsize)
                vals = [os.urandom(vsize) for _ in range(8)]
                outbuf = bytearray(vsize)
                # plain copy of the same bytes into a /dev/shm mapping, same count
                fd, tmp = tempfile.mkstemp(dir="/dev/shm")
                os.ftruncate(fd, nkeys * vsize)
                mm = mmap.mmap(fd, nkeys * vsize)
                base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                src = [ctypes.c_char_p(v) for v in vals]
                dst_out = (ctypes.c_char * vsize).from_buffer(outbuf)
                put_r, get_r, cp_r = [], [], []
                for rep in range(args.repeat):
                    keys = [f"v{vsize}-{rep}-{i}" for i in range(nkeys)]
                    t = time.perf_counter()
                    for i, k in enumerate(keys):
                        s.put(k, vals[i & 7])
                    put_r.append(nkeys / (time.perf_counter() - t))
                    t = time.perf_counter()
                    for k in keys:
                        s.get_into(k, outbuf)
                    get_r.append(nkeys / (time.perf_counter() - t))
                    t = time.perf_counter()
                    for i in range(nkeys):
                        ctypes.memmove(base + i * vsize, src[i & 7], vsize)
                        ctypes.memmove(dst_out, base + i * vsize, vsize)
                    cp_r.append(nkeys / (time.perf_counter() - t))
                del dst_out, src
                mm.close()
                os.close(fd)
                os.unlink(tmp)
                p, g, c = _median_spread(put_r), _median_spread(get_r), _median_spread(cp_r)
                out["rows"].append({"value_bytes": vsize, "put_ops": p[0], "put_spread": p[1:], "get_ops": g[0],
                                    "get_spread": g[1:], "copy_roundtrip_ops": c[0], "copy_spread": c[1:],
                                    "put_ratio": p[0] / (2 * c[0]), "get_ratio": g[0] / (2 * c[0])})
                one_way = (2 * c[0], [2 * c[1], 2 * c[2]])
                out["figures"] += [
                    figure(f"put {vsize} B, ops/s", p[0], one_way[0], "plain copy one way", unit="ops/s",
                           spread=p[1:], peer_spread=one_way[1]),
                    figure(f"get {vsize} B, ops/s", g[0], one_way[0], "plain copy one way", unit="ops/s",
                           spread=g[1:], peer_spread=one_way[1])]
                _progress(args)(0.5 if vsize == 4096 else 1.0)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out


def _paired(row: dict, name: str) -> str:
    """Median [min-max] of the per-round ratios (ours and the peer timed back to back in each round)."""
    p = row.get(f"{name}_paired")
    return "n/a" if p is None else f"{p['median']:.2f} [{p['spread'][0]:.2f}-{p['spread'][1]:.2f}]"


@scenario("datapath")
def bench_datapath(args) -> dict:
    from .bench_sglang import datapath
    rows, figs = [], []
    for j, ps in enumerate((1, 16)):
        _progress(args)(j / 2, f"{ps}-token pages")
        row = datapath(ps, args.repeat)
        rows.append(row)
        lim_goal = 0.7 if ps == 1 else 0.85
        for op in ("set", "get"):
            ours, lim, fil = row[op], row[f"limit_{op}"], row[f"file_{op}"]
            figs.append(figure(f"batch_{op}_v1 {row['page_bytes']} B pages, GB/s", ours["gbps"], lim["gbps"],
                               "copy limit", unit="GB/s", spread=ours["spread_gbps"], peer_spread=lim["spread_gbps"],
                               goal=f">= {lim_goal} x limit", met=row[f"{op}_vs_limit"] >= lim_goal))
            cold = row[f"cold_limit_{op}"]
            figs.append(figure(f"batch_{op}_v1 {row['page_bytes']} B pages, GB/s", ours["gbps"], cold["gbps"],
                               "copy limit, destination rotating over a pool-sized mapping", unit="GB/s",
                               spread=ours["spread_gbps"], peer_spread=cold["spread_gbps"],
                               goal=f">= {lim_goal} x limit", met=row[f"{op}_vs_cold_limit"] >= lim_goal))
            figs.append(figure(f"batch_{op}_v1 {row['page_bytes']} B pages, pages/s", ours["pages_per_s"],
                               fil["pages_per_s"], "HiCacheFile", unit="pages/s", goal=">= 5 x HiCacheFile",
                               met=row[f"{op}_vs_file"] >= 5))
        full, cold = row["set_full"], row["cold_limit_set"]
        figs.append(figure(f"batch_set_v1 {row['page_bytes']} B pages into a full pool (each batch evicts), GB/s",
                           full["gbps"], cold["gbps"], "copy limit, destination rotating over a pool-sized mapping",
                           unit="GB/s", spread=full["spread_gbps"], peer_spread=cold["spread_gbps"],
                           goal=f">= {lim_goal} x limit", met=row["set_full_vs_cold_limit"] >= lim_goal))
    return {"scenario": "datapath", "rows": rows, "figures": figs}


@scenario("lookup")
def bench_lookup(args) -> dict:
    from .bench_sglang import lookup
    r = lookup(args.repeat)
    figs = []
    for case in ("all_hits", "first_miss"):
        figs.append(figure(f"batch_exists x128 ({case.replace('_', ' ')}), seconds", r[f"{case}_maru"],
                           r[f"{case}_file"], "HiCacheFile", unit="s", spread=r.get(f"{case}_maru_spread"),
                           peer_spread=r.get(f"{case}_file_spread"), better="lower",
                           goal="<= 0.1 x HiCacheFile (10 x faster)", met=r[f"{case}_ratio"] >= 10))
    return {"scenario": "lookup", **r, "figures": figs}


@scenario("hybrid")
def bench_hybrid(args) -> dict:
    from .bench_hybrid import hybrid
    r = hybrid(args.pool_size)
    name = "live payload / file (min over churn)"
    figs = [figure(name, r["ours"], r["fixed_slots"], f"fixed {r['fixed_slot_bytes']} B slots", goal=">= 0.90",
                   met=r["met"]),
            figure(name, r["ours"], r["pow2_classes"], "power-of-two classes")]
    if "maru_1m" in r:
        figs.append(figure(name, r["ours"], r["maru_1m"], "Maru fixed 1 MiB chunks"))
    figs.append(figure("usable payload / file (whole restorable requests)", r["usable_final"],
                       r["pow2_classes_usable"], "power-of-two classes (FIFO)"))
    return {"scenario": "hybrid", **r, "figures": figs}


@scenario("eviction")
def bench_eviction(args) -> dict:
    from .bench_eviction import eviction
    r = eviction(args.eviction_pools, n_keys=args.eviction_keys, n_requests=args.eviction_requests,
                 progress=_progress(args))
    figs = []
    for p in r["points"]:
        tag = f"hit ratio, {format_size(p['pool_bytes'])} pool ({p['cache_fraction'] * 100:.1f} % of the key set)"
        figs.append(figure(tag, p["ours"], p["lru_file_bytes"], "exact LRU, capacity = data area bytes",
                           goal=f"within {p['goal_pp']} pp", met=p["met"], diff_pp=-p["gap_pp"]))
        figs.append(figure(tag, p["ours"], p["lru_live_bytes"], "exact LRU, capacity = our live bytes",
                           diff_pp=-p["gap_policy_pp"]))
    return {"scenario": "eviction", **r, "figures": figs}


@scenario("scaling")
def bench_scaling(args) -> dict:
    from .bench_scaling import scaling
    r = scaling(args.processes, duration=args.duration, repeat=args.repeat, progress=_progress(args))
    figs = []
    for p in r["points"]:
        n = p["processes"]
        figs.append(figure(f"{n} processes, aggregate ops/s", p["ops_s"]["median"], p["copy_ops_s"]["median"],
                           "plain 128 KiB copies, same processes", unit="ops/s", spread=p["ops_s"]["spread"],
                           peer_spread=p["copy_ops_s"]["spread"]))
        for q in ("p50", "p99"):
            figs.append(figure(f"{n} processes, {q} latency", p[f"{q}_us"]["median"], p[f"copy_{q}_us"]["median"],
                               "plain 128 KiB copies, same processes", unit="us", spread=p[f"{q}_us"]["spread"],
                               peer_spread=p[f"copy_{q}_us"]["spread"], better="lower"))
        figs.append(figure(f"{n} processes, lock wait per op", p["lock_wait_us_per_op"]["median"], unit="us",
                           spread=p["lock_wait_us_per_op"]["spread"], better="lower",
                           share_of_time=p["lock_wait_share"]["median"]))
    sc, nc = r["scales"], r["no_collapse"]
    if sc:
        figs.append(figure(f"speedup at {sc['at_processes']} processes (largest count <= cores) over 1", sc["speedup"],
                           sc["copy_speedup"], "copy limit speedup", goal=f">= {sc['goal']:.2g}", met=sc["met"]))
    if nc:
        figs.append(figure(f"ops/s at {nc['at_processes']} processes / peak", nc["of_peak"], nc["copy_of_peak"],
                           "copy limit, same", goal=">= 0.8", met=nc["met"]))
    return {"scenario": "scaling", **r, "figures": figs}


def render(results: list[dict]) -> str:
    lines = []
    for r in results:
        if r["scenario"] == "capacity":
            lines.append(f"capacity  {format_size(r['value_bytes'])} pages in {format_size(r['pool_bytes'])}: "
                         f"live/file {r['ours']:.4f} vs {r['peer_name']} {r['peer']:.4f} "
                         f"(x{r['ours'] / r['peer']:.2f}); goal >= {r['goal']} {'met' if r['met'] else 'MISSED'}")
        elif r["scenario"] == "mixed":
            lines.append(f"mixed     50-512 KiB at 3x {format_size(r['pool_bytes'])}: live/file (min over churn) "
                         f"{r['ours']:.4f} vs fixed 512 KiB slots {r['fixed_512k']:.4f}, power-of-two classes "
                         f"{r['pow2_classes']:.4f}, Maru 1 MiB chunks {r['maru_1m']:.4f}; goal >= {r['goal']} "
                         f"{'met' if r['met'] else 'MISSED'}")
        elif r["scenario"] == "ops":
            for row in r["rows"]:
                lines.append(
                    f"ops       {format_size(row['value_bytes'])}: put {row['put_ops']:,.0f}/s "
                    f"[{row['put_spread'][0]:,.0f}-{row['put_spread'][1]:,.0f}], get {row['get_ops']:,.0f}/s "
                    f"[{row['get_spread'][0]:,.0f}-{row['get_spread'][1]:,.0f}]; plain copy one way "
                    f"{2 * row['copy_roundtrip_ops']:,.0f}/s; put/copy {row['put_ratio']:.3f}, "
                    f"get/copy {row['get_ratio']:.3f}")
        elif r["scenario"] == "datapath":
            for row in r["rows"]:
                for op in ("set", "get"):
                    ours, lim, fil = row[op], row[f"limit_{op}"], row[f"file_{op}"]
                    lines.append(
                        f"datapath  {format_size(row['page_bytes'])} pages, batch_{op}_v1: {ours['gbps']:.2f} GB/s "
                        f"{ours['pages_per_s']:,.0f} pages/s [{ours['spread_gbps'][0]:.2f}-{ours['spread_gbps'][1]:.2f}]; "
                        f"copy limit {lim['gbps']:.2f} GB/s -> x{row[f'{op}_vs_limit']:.2f} (rotating "
                        f"destination {row[f'cold_limit_{op}']['gbps']:.2f} GB/s -> x{row[f'{op}_vs_cold_limit']:.2f}, "
                        f"per round x{_paired(row, f'{op}_vs_cold_limit')}); "
                        f"HiCacheFile "
                        f"{fil['pages_per_s']:,.0f} pages/s -> x{row[f'{op}_vs_file']:.1f}")
                full = row["set_full"]
                lines.append(
                    f"datapath  {format_size(row['page_bytes'])} pages, batch_set_v1 into a full pool (each batch "
                    f"evicts): {full['gbps']:.2f} GB/s [{full['spread_gbps'][0]:.2f}-{full['spread_gbps'][1]:.2f}]; "
                    f"x{row['set_full_vs_limit']:.2f} of the copy limit (rotating x{row['set_full_vs_cold_limit']:.2f}, "
                    f"per round x{_paired(row, 'set_full_vs_cold_limit')})")
        elif r["scenario"] == "lookup":
            for case in ("all_hits", "first_miss"):
                lines.append(f"lookup    batch_exists x128 ({case.replace('_', ' ')}): {r[case + '_maru'] * 1e6:.1f} us "
                             f"vs HiCacheFile {r[case + '_file'] * 1e6:.1f} us -> x{r[case + '_ratio']:.1f}")
        elif r["scenario"] == "hybrid":
            pb = sorted(r["page_bytes"].values())
            lines.append(f"hybrid    {len(pb)} pools, pages {format_size(pb[0])}-{format_size(pb[-1])} "
                         f"(x{r['size_spread']:.0f}) at 3x {format_size(r['pool_bytes'])}: live/file (min over churn) "
                         f"{r['ours']:.4f} vs fixed {format_size(r['fixed_slot_bytes'])} slots {r['fixed_slots']:.4f}, "
                         f"power-of-two classes {r['pow2_classes']:.4f}, Maru 1 MiB chunks {r['maru_1m']:.4f}; "
                         f"goal >= {r['goal']} "
                         f"{'met' if r['met'] else 'MISSED'}")
            lines.append(f"hybrid    payload still usable as hits (whole restorable prefixes) / file: "
                         f"{r['usable_final']:.4f} vs fixed slots {r['fixed_slots_usable']:.4f}, power-of-two classes "
                         f"{r['pow2_classes_usable']:.4f} (FIFO)")
        elif r["scenario"] == "eviction":
            lines += render_eviction(r)
        elif r["scenario"] == "scaling":
            lines += render_scaling(r)
    return "\n".join(lines)


def _met(m) -> str:
    return "n/a" if m is None else ("met" if m else "MISSED")


def render_eviction(r: dict) -> list[str]:
    lo, hi = r["size_range"]
    lines = [f"eviction  Zipf({r['alpha']}) get-or-put, {r['keys']:,} keys of {format_size(lo)}-{format_size(hi)} "
             f"({format_size(r['working_set_bytes'])} in all), {r['requests']:,} requests, hit ratio over the last "
             f"{r['measured_requests']:,}"]
    for p in r["points"]:
        lines.append(
            f"eviction  {format_size(p['pool_bytes'])} pool ({p['cache_fraction'] * 100:.1f} % of the key set): "
            f"ours {p['ours']:.4f} vs exact LRU with the data area's bytes {p['lru_file_bytes']:.4f} "
            f"(x{p['ratio']:.3f}, {-p['gap_pp']:+.1f} pp); goal within {p['goal_pp']:g} pp {_met(p['met'])}")
        lines.append(
            f"            same live bytes as ours ({p['live_over_data']:.3f} of the data area): exact LRU "
            f"{p['lru_live_bytes']:.4f} ({-p['gap_policy_pp']:+.1f} pp, the policy), per-object CLOCK "
            f"{p['clock_live_bytes']:.4f}, random {p['random_live_bytes']:.4f}; ours sits "
            f"{p['policy_position'] * 100:.0f} % of the way from random to LRU")
        sf = p["space_final"]
        lines.append(
            f"            space ({p['gap_space_pp']:.1f} pp): LRU charged our class blocks {p['lru_class_rounded']:.4f} "
            f"({-p['gap_rounding_pp']:+.1f} pp); data area at the end: live {sf['live']:.3f}, class rounding "
            f"{sf['rounding']:.3f}, free blocks in slabs {sf['free_in_slabs']:.3f}, free units {sf['free_units']:.3f}")
        w = p.get("windows")
        if w:
            lines.append(
                f"            slab CLOCK: {w['evictions']:,} windows of {format_size(w['mean_window_bytes'])} on "
                f"average, {w['slabs_per_window']:.1f} slabs and {w['values_per_window']:.1f} values each; "
                f"{w['referenced_share'] * 100:.0f} % of the slabs evicted had their CLOCK bit set, "
                f"{w['values_hit_share'] * 100:.0f} % of the values evicted had been hit")
    return lines


def render_scaling(r: dict) -> list[str]:
    lines = [f"scaling   {format_size(r['value_bytes'])} values, 50/50 get_into/put on {r['keys']} shared keys, "
             f"{r['cores']} cores, {r['duration_s']:g} s per round, {r['repeat']} rounds (median [min-max])"]
    base = r["points"][0]["ops_s"]["median"] if r["points"] else 0
    cbase = r["points"][0]["copy_ops_s"]["median"] if r["points"] else 0
    pbase = r["points"][0]["ops_per_cpu_s"]["median"] if r["points"] else 0
    for p in r["points"]:
        o, c = p["ops_s"], p["copy_ops_s"]
        lines.append(
            f"scaling   {p['processes']} proc: {o['median']:,.0f} ops/s [{o['spread'][0]:,.0f}-{o['spread'][1]:,.0f}] "
            f"(x{o['median'] / base:.2f} of 1) vs copy limit {c['median']:,.0f} (x{c['median'] / cbase:.2f} of 1) "
            f"-> x{p['ratio']:.3f}; p50 {p['p50_us']['median']:,.0f} us p99 {p['p99_us']['median']:,.0f} us "
            f"(copy {p['copy_p50_us']['median']:,.0f}/{p['copy_p99_us']['median']:,.0f}); get p99 "
            f"{p['get_p99_us']['median']:,.0f}, put p99 {p['put_p99_us']['median']:,.0f} us")
        lines.append(
            f"            locks {p['lock_us_per_op']['median']:.1f} us/op ({p['lock_share']['median'] * 100:.0f} % "
            f"of the time), of which waiting {p['lock_wait_us_per_op']['median']:.1f} us/op "
            f"({p['lock_wait_share']['median'] * 100:.0f} %); {p['acquires_waited']['median'] * 100:.1f} % of "
            f"acquisitions found the lock taken")
        lines.append(
            f"            CPU: cores busy {p['cores_busy']['median']:.2f} (copy rounds "
            f"{p['copy_cores_busy']['median']:.2f}); {p['ops_per_cpu_s']['median']:,.0f} ops per CPU-second "
            f"(x{p['ops_per_cpu_s']['median'] / pbase:.2f} of 1 process)")
    sc, nc = r.get("scales"), r.get("no_collapse")
    if sc:
        cs = f" (copy limit x{sc['copy_speedup']:.2f})" if sc.get("copy_speedup") else ""
        if sc.get("cpu_speedup"):
            cs += f"; CPU the machine gave (copy rounds' CPU time) x{sc['cpu_speedup']:.2f}"
            if sc.get("speedup_of_cpu_gain") is not None:
                cs += f", ours used {sc['speedup_of_cpu_gain'] * 100:.0f} % of that gain"
        lines.append(f"scaling   scales to the core count: x{sc['speedup']:.2f} at {sc['at_processes']} processes "
                     f"over 1{cs}; goal >= x{sc['goal']:.2g} {_met(sc['met'])}")
    else:
        lines.append("scaling   scales to the core count: n/a (one core or no 1-process point)")
    if nc:
        cc = f" (copy limit {nc['copy_of_peak']:.2f})" if nc.get("copy_of_peak") is not None else ""
        lines.append(f"scaling   does not collapse: {nc['at_processes']} processes at {nc['of_peak']:.2f} of the peak"
                     f"{cc}; goal >= {nc['goal']} {_met(nc['met'])}")
    return lines


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="maru-shm bench", description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only this scenario (repeatable)")
    p.add_argument("--pool-size", default="1G", help="pool size for capacity/mixed (default 1G)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions of timed figures (median reported)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--charts", metavar="DIR", help="also write PNG charts of the results into DIR (matplotlib)")
    p.add_argument("--charts-note", default="", help="text for every chart's footer (e.g. provisional)")
    g = p.add_argument_group("eviction")
    g.add_argument("--eviction-pools", default="256M,512M,1G", type=_size_list,
                   help="pool sizes, comma separated (default 256M,512M,1G)")
    g.add_argument("--eviction-keys", type=int, default=12_000, help="key population (default 12000)")
    g.add_argument("--eviction-requests", type=int, default=100_000, help="trace length (default 100000)")
    g = p.add_argument_group("scaling")
    g.add_argument("--processes", default="1,2,4,8", type=_int_list, help="process counts (default 1,2,4,8)")
    g.add_argument("--duration", type=float, default=1.0, help="seconds per round and process count (default 1)")
    return p


def _size_list(text: str) -> list[int]:
    from maru_shm import parse_size
    try:
        return [parse_size(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"process counts must be >= 1: {text!r}")
    return sorted(set(xs))


def main(args=None) -> int:
    if args is None or isinstance(args, list):
        args = build_parser().parse_args(args)
    from maru_shm import parse_size
    args.pool_size = parse_size(args.pool_size)
    names = list(dict.fromkeys(args.only or list(SCENARIOS)))
    progress = Progress(names, enabled=not args.json and _is_tty(sys.stderr))
    args.progress = progress
    results = []
    try:
        for i, name in enumerate(names):
            progress.start(i)
            results.append(SCENARIOS[name](args))
    finally:
        progress.done()
    doc = {"machine": machine(), "results": results}
    if args.json:
        print(json.dumps(doc, indent=2, default=float))
    else:
        print(render(results))
    if args.charts:
        from .charts import render_charts
        for path in render_charts(doc, args.charts, args.charts_note):
            print(f"chart: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def machine() -> dict:
    import platform
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "cores": cores, "loadavg_at_end": load, "python": platform.python_version(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


if __name__ == "__main__":
    sys.exit(main())
