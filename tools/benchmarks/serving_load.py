"""serving: SGLang's own client (`python -m sglang.bench_serving`, unmodified) at load against several
schedulers on one L3, every L3 side by side in one run.

For each deployment (tools/deployment.py: `dp`, SGLang's DP controller with 2 schedulers; `pair`, two
servers behind a round-robin forwarder; `one`, the 1-scheduler reference), each thread setting (`1`
OpenMP thread per scheduler, or torch's `default`) and each L3 (tools/l3backends.py: none, HiCacheFile,
SGLang's MooncakeStore with a real master, MaruStorage; the bounded ones at every --serving-pools size),
servers are started fresh, warmed, and run every workload and seed --serving-repeat times, each run
after every cache level is emptied. With --serving-rounds N the whole plan runs N times over, the L3s' order
forward and backward by turns (`rotated`): a slow spell of a shared machine, or the wake of the L3 before,
falls on all of them; each cell pools its rounds' runs.
Workloads: generated-shared-prefix, and a cut of the Mooncake synthetic trace replayed by the client's
`mooncake` dataset (tools/tracecut.py). After a workload's runs (in round 0) a fixed greedy subset of its
prompts is answered from L3 and recomputed: the tokens must agree.

On a CPU the model is the demo's dummy-weight Llama with an offline tokenizer (tools/wordtokenizer.py);
`--serving-model DIR --serving-device cuda` serves a real model with its own tokenizer.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

from .registry import figure, progress_of, scenario

NAME = "serving"
TRACE = os.path.join("shared", "traces", "mooncake_synthetic.jsonl")
MEASURES = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "request_throughput", "input_throughput",
            "storage_tokens", "client_storage_tokens", "hit_rate_pct", "duration_s")


def default_trace() -> str | None:
    """shared/traces/mooncake_synthetic.jsonl beside the checkout or a level above it (a worktree's)."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    for up in (os.path.dirname(root), os.path.dirname(os.path.dirname(root))):
        if os.path.exists(os.path.join(up, TRACE)):
            return os.path.join(up, TRACE)
    return None


def model_spec(args, work: str):
    """(ServerSpec base, model directory, what it is) for the run's model."""
    from ..serving import DEMO_MODEL, ServerSpec
    from .. import wordtokenizer
    model = getattr(args, "serving_model", None)
    device = getattr(args, "serving_device", None) or "cpu"
    dummy = model is None or getattr(args, "serving_dummy_weights", False)
    if model is None:
        model = DEMO_MODEL.write(work)
        wordtokenizer.write(model, DEMO_MODEL.vocab)
        what = DEMO_MODEL.describe() + ", offline WordLevel tokenizer"
    else:
        what = f"{model} on {device}" + (", dummy weights" if dummy else "")
    return ServerSpec(model_path=model, device=device, dummy_weights=dummy, text=True, metrics=True), model, what


def workloads(args, work: str) -> tuple[list, list[str]]:
    """The Workload list, and why any asked for was left out."""
    from .. import benchclient, tracecut
    from ..loadrun import Workload
    names = getattr(args, "serving_workloads", None) or ["gsp", "mooncake"]
    out_len = args.serving_output_len
    seeds = getattr(args, "serving_seeds", None) or [1]
    out, skipped = [], []
    for name in names:
        if name == "gsp":
            g, per, sys_len, q_len = args.serving_gsp
            for seed in seeds:
                out.append(Workload("gsp", benchclient.gsp_args(g, per, sys_len, q_len, out_len), out_len, seed,
                                    args.serving_rate, args.serving_concurrency,
                                    meta={"groups": g, "per_group": per, "system_len": sys_len,
                                          "question_len": q_len}))
        elif name == "mooncake":
            src = getattr(args, "serving_trace", None) or default_trace()
            if src is None or not os.path.exists(src):
                skipped.append(f"mooncake: no trace at {src or TRACE} (--serving-trace PATH)")
                continue
            sessions, per, blocks = args.serving_trace_cut
            trace = os.path.join(work, "mooncake-cut.jsonl")
            kept = tracecut.write_cut(src, trace, sessions=sessions, per_session=per, max_blocks=blocks,
                                      rate=args.serving_rate, output_len=out_len)
            rounds = args.serving_mooncake_rounds
            for seed in seeds:
                out.append(Workload("mooncake", benchclient.mooncake_args(trace, rounds, out_len, kept["records"]),
                                    out_len, seed, None, args.serving_concurrency, trace, rounds,
                                    meta={**kept, "rounds": rounds, "source": os.path.abspath(src)}))
        else:
            raise ValueError(f"unknown workload {name!r} (gsp, mooncake)")
    return out, skipped


def _median_of(runs: list[dict]) -> tuple[dict, dict]:
    med, spread = {}, {}
    for k in MEASURES + ("evictions",):
        xs = [r[k] for r in runs if r.get(k) is not None]
        if xs:
            med[k], spread[k] = statistics.median(xs), [min(xs), max(xs)]
    return med, spread


def _prompts(w, run, model: str, work: str) -> list[str]:
    from .. import benchclient
    if w.name == "gsp":
        return benchclient.gsp_prompts(run)
    return benchclient.mooncake_prompts(w.trace, w.rounds, model, os.path.join(work, "home-prompts"))


def cells_of_deployment(dep, l3, ws, args, model: str, work: str, tag: str, repeat: int, tick,
                        prompts_cache: dict, rnd: int = 0) -> list[dict]:
    """Every workload's runs on one started deployment: one cell per workload and seed. `prompts_cache`
    keeps each workload's greedy subset from one deployment to the next; the greedy check runs in round 0."""
    from ..loadrun import greedy_check, run_load, subset
    cells = []
    for w in ws:
        runs, texts, last = [], [], None
        for i in range(repeat):
            fig, last = run_load(dep, l3, w, model, work, f"{tag}-{w.name}-s{w.seed}-r{i}")
            runs.append({**fig, "round": rnd})
            texts.append(last.texts)
            tick()
        key = (w.name, w.trace, w.rounds, w.seed)
        if key not in prompts_cache:
            prompts_cache[key] = subset(_prompts(w, last, model, work), args.serving_check_prompts)
        check = greedy_check(dep, l3, prompts_cache[key], w.output_len) if rnd == 0 else None
        cells.append({"topology": dep.topology, "threads": dep.threads, "workload": w.name, "seed": w.seed,
                      "backend": l3.name, "budget": l3.budget, "label": l3.label, "schedulers": dep.schedulers,
                      "runs": runs, "check": check, "texts": texts[-1]})
    return cells


def pooled(cells: list[dict]) -> list[dict]:
    """One cell per (topology, threads, workload, seed, backend, budget), its rounds' runs pooled, with their
    medians and spread."""
    out: dict = {}
    for c in cells:
        key = (c["topology"], c["threads"], c["workload"], c["seed"], c["backend"], c["budget"])
        if key not in out:
            out[key] = c
            continue
        into = out[key]
        into["runs"] = into["runs"] + c["runs"]
        into["check"], into["texts"] = into["check"] or c["check"], c["texts"]
    for c in out.values():
        c["median"], c["spread"] = _median_of(c["runs"])
        c["check"] = c["check"] or {"prompts": 0}  # round 0's deployment failed: no greedy figure
    return list(out.values())


def plan(args) -> list[tuple]:
    """(topology, threads, backend, budget) in the order they run."""
    from ..l3backends import BOUNDED, WAIT_ARMS
    out = []
    for topology in getattr(args, "serving_topologies", None) or ["dp", "pair", "one"]:
        for threads in getattr(args, "serving_threads", None) or ["1", "default"]:
            for backend in getattr(args, "serving_backends", None) or ["none", "file", "mooncake", "maru"]:
                if backend in WAIT_ARMS and threads == "1":
                    continue  # with one thread there is no OpenMP worker to wait: it would be maru again
                for budget in (args.serving_pools if backend in BOUNDED else [None]):
                    out.append((topology, threads, backend, budget))
    return out


def rotated(steps: list[tuple], rnd: int) -> list[tuple]:
    """Round `rnd`'s order within each deployment and thread setting: the L3s' order runs forward in even
    rounds and backward in odd ones, rotating one place every two rounds. Two rounds already swap the
    first and the last L3's places and the runs before them (the middle one's, the previous setting's
    last), so neither always runs right after the same one."""
    groups: dict = {}
    for s in steps:
        groups.setdefault(s[:2], []).append(s)
    out = []
    for g in groups.values():
        k = (rnd // 2) % len(g)
        order = g[k:] + g[:k]
        out += order[::-1] if rnd % 2 else order
    return out


@scenario(NAME)
def bench_serving(args) -> dict:
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        return {"scenario": NAME, "skipped": "sglang is not installed", "figures": []}
    import dataclasses
    from ..deployment import Deployment
    from ..l3backends import L3
    from ..loadrun import warm
    progress = progress_of(args)
    repeat = max(1, args.serving_repeat)
    rounds = max(1, getattr(args, "serving_rounds", 1) or 1)
    work = tempfile.mkdtemp(prefix="maru-bench-serving-")
    cells, skipped, prompts_cache = [], [], {}
    try:
        base, model, what = model_spec(args, work)
        ws, skipped = workloads(args, work)
        steps = plan(args)
        total, done = max(1, rounds * len(steps) * len(ws) * repeat), 0
        for n, (rnd, (topology, threads, backend, budget)) in enumerate((r, s) for r in range(rounds)
                                                                         for s in rotated(steps, r)):
            tag = f"{topology}-{threads}-{backend}-{budget or 0}" + (f"-round{rnd}" if rounds > 1 else "")
            progress(done / total, f"{tag}: starting")
            first = done

            def tick():
                nonlocal done
                done += 1
                progress(done / total, tag)
            try:
                if backend == "mooncake":
                    from ..mooncake_local import unavailable
                    if unavailable():
                        raise RuntimeError(unavailable())
                with L3(backend, budget, work, f"{n}") as l3:
                    spec = dataclasses.replace(base, **l3.spec_fields())
                    with Deployment(topology, threads, spec, work, tag) as dep:
                        warm(dep)
                        cells += cells_of_deployment(dep, l3, ws, args, model, work, tag, repeat, tick,
                                                     prompts_cache, rnd)
            except Exception as e:  # one cell's failure (a server that would not start) is reported, not fatal
                lines = str(e).strip().splitlines() or [type(e).__name__]
                skipped.append(f"{tag}: {type(e).__name__}: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else ""))
                done = first + len(ws) * repeat
    finally:
        if not getattr(args, "serving_keep", False):
            shutil.rmtree(work, ignore_errors=True)
    cells = pooled(cells)
    _compare_texts(cells)
    return {"scenario": NAME, "model": what, "repeat": repeat, "rounds": rounds, "skipped": skipped or None,
            "workloads": [{"name": w.name, "seed": w.seed, **w.meta} for w in ws],
            "cells": [{k: v for k, v in c.items() if k != "texts"} for c in cells], "figures": figures(cells)}


def _compare_texts(cells: list[dict]) -> None:
    """Per cell: how many of the load's replies differ from those of L3 `none` in the same deployment (the
    same prompts in the same order). Batching differs from run to run, so this is reported, not a goal."""
    ref = {(c["topology"], c["threads"], c["workload"], c["seed"]): c["texts"] for c in cells if c["backend"] == "none"}
    for c in cells:
        r = ref.get((c["topology"], c["threads"], c["workload"], c["seed"]))
        c["texts_differ_from_none"] = (None if r is None or c["backend"] == "none"
                                       else sum(a != b for a, b in zip(c["texts"], r)))


def _group(cells: list[dict]) -> dict:
    out: dict = {}
    for c in cells:
        out.setdefault((c["topology"], c["threads"], c["workload"], c["seed"]), []).append(c)
    return out


def _runs_of(cell: dict, key: str) -> list[float]:
    return [r[key] for r in cell["runs"] if r.get(key) is not None]


def figures(cells: list[dict]) -> list[dict]:
    """MaruStorage against HiCacheFile, MooncakeStore and its wait arms (at its own budget) in every group, the
    contention ratio against HiCacheFile's, and the greedy tokens of every L3. A comparison's `chance` is how
    often runs drawn from one distribution would be as far apart (tools/benchmarks/stats.py)."""
    from ..l3backends import WAIT_ARMS
    from .stats import worse_by_chance
    figs = []
    for (topo, threads, wl, seed), group in _group(cells).items():
        where = f"serving {topo} threads={threads} {wl} seed {seed}"
        for c in (c for c in group if c["backend"] == "maru"):
            peers = [p for p in group if p["backend"] == "file"
                     or (p["backend"] in ("mooncake", *WAIT_ARMS) and p["budget"] == c["budget"])]
            for p in peers:
                m, q = c["median"], p["median"]
                for key, label, better in (("ttft_mean_ms", "TTFT mean", "lower"), ("ttft_p99_ms", "TTFT p99", "lower"),
                                           ("request_throughput", "requests/s", "higher"),
                                           ("storage_tokens", "tokens from L3", "higher")):
                    ours, peer = m.get(key), q.get(key)
                    met = None if ours is None or peer is None else (ours <= peer if better == "lower" else ours >= peer)
                    chance = worse_by_chance(_runs_of(c, key), _runs_of(p, key), better)
                    figs.append(figure(f"{where}: {label}, {c['label']} vs {p['label']}", ours, peer, p["label"],
                                       unit="ms" if key.endswith("_ms") else "", better=better,
                                       spread=c["spread"].get(key), peer_spread=p["spread"].get(key),
                                       goal=f"{'<=' if better == 'lower' else '>='} {p['label']}", met=met,
                                       chance=chance))
        for c in group:
            same = c["check"].get("same")
            if same is not None:
                figs.append(figure(f"{where}: greedy subset, {c['label']}: tokens from L3 = recomputed",
                                   sum(same), len(same), "prompts", goal="all", met=all(same)))
    figs += _contention(cells)
    return figs


def _contention(cells: list[dict]) -> list[dict]:
    """TTFT mean with torch's default threads over that with 1 thread, MaruStorage's against HiCacheFile's,
    per deployment and workload (issue #49: within 10 %). A wait arm's one-thread run is maru's."""
    by = {(c["topology"], c["threads"], c["workload"], c["seed"], c["label"]): c["median"].get("ttft_mean_ms")
          for c in cells}
    figs = []
    for (topo, threads, wl, seed, label), _ in by.items():
        if threads != "default" or not label.startswith("maru"):
            continue
        ours = (by.get((topo, "default", wl, seed, label)),
                by.get((topo, "1", wl, seed, "maru" + label[len(label.split()[0]):])))
        peer = (by.get((topo, "default", wl, seed, "file")), by.get((topo, "1", wl, seed, "file")))
        if None in ours or None in peer or not ours[1] or not peer[1]:
            continue
        r_ours, r_peer = ours[0] / ours[1], peer[0] / peer[1]
        figs.append(figure(f"serving {topo} {wl} seed {seed}: TTFT mean, default threads / 1 thread, {label} vs file",
                           r_ours, r_peer, "file", unit="x", better="lower", goal="<= 1.10 x file's",
                           met=r_ours <= 1.10 * r_peer))
    return figs
