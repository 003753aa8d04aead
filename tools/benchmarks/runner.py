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
  mixshift  a second value size starting on a pool full of the first (a
            second model beside a first): each size's hit ratio, vs the same
            store without slab moves between classes that hold slabs, and
            exact LRU.
  prefixtree  an SGLang-like conversation trace (shared system prompts, turns,
            Zipf returns) of 128 KiB page chains through MaruStorage, replayed
            directly and through per-instance host caches with sticky routing,
            at working sets 1.5x/3x/6x the pool: tokens served from L3 and
            usable payload, vs exact LRU, an unbounded pool and the plain CLOCK.
  scaling   1, 2, 4, 8 processes on one pool, 50/50 get/put of 128 KiB
            values: aggregate ops/s, p50/p99 latency, lock time, vs the same
            processes doing plain 128 KiB copies into/out of a shared mapping.
  tier2     two pool files as two nodes behind a real Mooncake Store on
            loopback: pages/s of a second-tier hit (with promotion), a local
            pool hit and HiCacheFile; write-through vs the pool alone. Skipped
            with the reason where mooncake cannot be imported.
  e2e       SGLang's real serving loop (two launch_server processes per
            backend): time to first token at 512, 2048 and 8192 tokens for
            recompute, an L3 hit from MaruStorage and one from HiCacheFile on
            /dev/shm. Takes several minutes on a CPU.
  serving   SGLang's own client (sglang.bench_serving) at load against 2
            schedulers on one L3 (SGLang's DP controller; two servers behind
            a round-robin forwarder) and 1, with 1 OpenMP thread per
            scheduler and torch's default: TTFT mean/p50/p99, throughput and
            tokens from L3 for no L3, HiCacheFile, MooncakeStore and
            MaruStorage at equal pool bytes, two pool sizes, two workloads
            (generated-shared-prefix; a cut of the Mooncake trace); a greedy
            subset's tokens from L3 vs recomputed. An hour or more on a CPU:
            narrow it with the --serving-* options.
  serving-kill  two servers on one pool under bench_serving's load, one
            SIGKILLed mid-run: the other keeps serving, the dead one's slot is
            reaped, a restarted one serves from the pool, tokens agree, the
            pool checks clean.
The machine is shared and noisy: timed figures are the median of --repeat
runs, with the spread (min-max) printed next to them. While it runs, a
progress line goes to stderr when stderr is a terminal (never with --json).
`--json` prints one object; every result carries `figures`: rows of ours,
spread, peer, ratio, goal and met. `--charts DIR` writes PNG charts
(tools/charts.py) from the same results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .. import argtypes
from . import (capacity, datapath, e2e, eviction, hybrid, lookup, mixed, mixshift, ops, prefixtree, scaling,
               serving_kill, serving_load, tier2)
from .registry import SCENARIOS, Progress
from .report import render

# Importing a scenario module registers it; this is the order `maru-shm bench` runs them in.
SCENARIO_MODULES = (capacity, mixed, ops, datapath, lookup, hybrid, eviction, mixshift, prefixtree,
                    scaling, tier2, e2e, serving_load, serving_kill)


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="maru-shm bench", description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only this scenario (repeatable)")
    p.add_argument("--pool-size", default="1G", help="pool size for capacity/mixed (default 1G)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions of timed figures (median reported)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--charts", metavar="DIR", help="also write PNG charts of the results into DIR (matplotlib)")
    p.add_argument("--charts-note", default="", help="text for every chart's footer (e.g. provisional)")
    g = p.add_argument_group("eviction")
    g.add_argument("--eviction-pools", default="256M,512M,1G", type=argtypes.sizes,
                   help="pool sizes, comma separated (default 256M,512M,1G)")
    g.add_argument("--eviction-keys", type=int, default=12_000, help="key population (default 12000)")
    g.add_argument("--eviction-requests", type=int, default=100_000, help="trace length (default 100000)")
    g = p.add_argument_group("prefixtree")
    g.add_argument("--prefixtree-seeds", default=[11, 12, 13], type=_seed_list,
                   help="seeds of the conversation trace, comma separated (default 11,12,13); the goals hold in "
                        "every seed's cells")
    g.add_argument("--prefixtree-shapes", type=_names, help="prefixtree: trace shapes, comma separated "
                   "(default every one: chat, sglang, rag)")
    g.add_argument("--prefixtree-scale", type=float, default=1.0,
                   help="prefixtree: each shape's requests times this (default 1; smaller for a quick A/B)")
    g.add_argument("--prefixtree-models", type=_names, help="prefixtree: plain, hybrid or both (default both)")
    g.add_argument("--prefixtree-ab", type=_names, help="prefixtree: rules of the default eviction to switch off, "
                   "each in a variant of its own, comma separated (prefixtree.VARIANTS; 'all': every one)")
    g = p.add_argument_group("e2e")
    g.add_argument("--e2e-lengths", default=[512, 2048, 8192], type=_int_list,
                   help="prompt lengths in tokens (default 512,2048,8192)")
    g.add_argument("--e2e-model", help="a model directory to serve (default: the demo's dummy-weight Llama)")
    g.add_argument("--e2e-device", default="cpu", help="cpu, or cuda with a GPU")
    g.add_argument("--e2e-dummy-weights", action="store_true",
                   help="serve --e2e-model's geometry with random weights (a config.json is enough)")
    add_serving_args(p)
    g = p.add_argument_group("scaling")
    g.add_argument("--processes", default="1,2,4,8", type=_int_list, help="process counts (default 1,2,4,8)")
    g.add_argument("--duration", type=float, default=1.0, help="seconds per round and process count (default 1)")
    return p

def add_serving_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving, serving-kill")
    g.add_argument("--serving-topologies", type=_names, help="dp, pair, one (default all)")
    g.add_argument("--serving-threads", type=_names, help="1 (OMP_NUM_THREADS=1 per scheduler), default "
                   "(torch's own) (default both)")
    g.add_argument("--serving-backends", type=_names, help="none, file, mooncake, maru (default all); maru-spin, maru-sleep: "
                   "MaruStorage with maru_openmp_wait: spin or sleep, the A/B of maru_sglang.openmpwait's auto "
                   "(torch's default threads only)")
    g.add_argument("--serving-workloads", type=_names, help="gsp, mooncake (default both)")
    g.add_argument("--serving-pools", default="1G,96M", type=argtypes.sizes,
                   help="budgets of the bounded L3s (maru, mooncake), comma separated (default 1G,96M: one holds "
                        "the default workloads, one forces eviction)")
    g.add_argument("--serving-repeat", type=int, default=3,
                   help="serving: runs per cell, medians and min-max reported (default 3; a run takes about a minute "
                        "on a CPU)")
    g.add_argument("--serving-rounds", type=int, default=1,
                   help="serving: run the whole plan this many times over, the L3s taking turns, each cell's runs "
                        "pooled (default 1)")
    g.add_argument("--serving-seeds", type=_seed_list, help="client seeds, comma separated (default 1)")
    g.add_argument("--serving-gsp", default=[3, 6, 2048, 128], type=_gsp_shape,
                   help="generated-shared-prefix: groups,prompts per group,system prompt len,question len "
                        "(default 3,6,2048,128)")
    g.add_argument("--serving-trace", help="the Mooncake trace to cut (default shared/traces/mooncake_synthetic."
                   "jsonl beside the checkout)")
    g.add_argument("--serving-trace-cut", default=[6, 4, 12], type=_trace_cut,
                   help="sessions,records per session,max hash ids per record of the cut (default 6,4,12)")
    g.add_argument("--serving-mooncake-rounds", type=int, default=2, help="rounds per session (default 2)")
    g.add_argument("--serving-output-len", type=int, default=4, help="output tokens per request (default 4)")
    g.add_argument("--serving-rate", type=float, default=2.0, help="requests/s (gsp: Poisson; mooncake: the cut's "
                   "spacing) (default 2)")
    g.add_argument("--serving-concurrency", type=int, default=4, help="client's --max-concurrency (default 4)")
    g.add_argument("--serving-check-prompts", type=int, default=3, help="greedy subset size (default 3)")
    g.add_argument("--serving-model", help="a model directory with its tokenizer (default: the demo's dummy-weight "
                   "Llama and an offline tokenizer)")
    g.add_argument("--serving-device", default="cpu", help="cpu, or cuda with a GPU")
    g.add_argument("--serving-dummy-weights", action="store_true", help="serve --serving-model with random weights")
    g.add_argument("--serving-kill-after", type=float, default=0.35,
                   help="serving-kill: share of the requests routed before the SIGKILL (default 0.35)")
    g.add_argument("--serving-keep", action="store_true", help="keep the work directory (logs, client output)")


def _gsp_shape(text: str) -> list[int]:
    xs = _ints(text)
    if len(xs) != 4 or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected groups,per group,system len,question len: {text!r}")
    return xs


def _trace_cut(text: str) -> list[int]:
    xs = _ints(text)
    if len(xs) != 3 or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected sessions,records per session,max hash ids: {text!r}")
    return xs


def _ints(text: str) -> list[int]:
    """Comma-separated integers, in the order given."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None

def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]

def _seed_list(text: str) -> list[int]:
    xs = _ints(text)
    if not xs:
        raise argparse.ArgumentTypeError("no seed given")
    return list(dict.fromkeys(xs))

def _int_list(text: str) -> list[int]:
    xs = _ints(text)
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"process counts must be >= 1: {text!r}")
    return sorted(set(xs))

def main(args=None) -> int:
    if args is None or isinstance(args, list):
        args = build_parser().parse_args(args)
    from maru_shm import parse_size
    args.pool_size = parse_size(args.pool_size)
    names = list(dict.fromkeys(args.only or [m.NAME for m in SCENARIO_MODULES]))
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
