"""serving-kill: one of two servers on one pool SIGKILLed under SGLang's own client's load.

Two servers (`pair`, one OpenMP thread each) on one MaruStorage pool, `sglang.bench_serving` driving the
generated-shared-prefix load through the round-robin forwarder. When --serving-kill-after of the requests
have been routed, server A's whole process group is SIGKILLed: a crash, not a shutdown. The forwarder
finds A gone at its next connection and sends everything to B; the requests A was serving fail. Then:
1. B keeps serving: every request routed to it after the kill completes, with cached tokens;
2. A's slot is reaped: right after the kill the pool lists A's scheduler as a dead process (unless B has
   reaped it already); once A is restarted (an attach reaps) no dead process is left and a live
   `check` is clean;
3. the restarted server serves from the pool: the greedy subset, sent to it after the load with device
   and host caches flushed, loads its prefixes from L3;
4. tokens: the subset's tokens from L3 equal those recomputed with the pool emptied, and every reply of
   the load that completed equals the same request's reply in a reference run of the same load (same
   seed, pool emptied, no kill) on the same servers;
5. after both servers stop, an attach (which reaps their slots, as any next opener does) and `check` find
   the pool clean.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time

from ..procgroup import state
from .registry import figure, progress_of, scenario

NAME = "serving-kill"


def _scheduler_pids(pool: str, server) -> list[int]:
    """Pids of the pool's attached processes that belong to `server` (its process group)."""
    from maru_shm import PoolView, pool_report
    with PoolView.open(pool) as view:
        procs = pool_report(view)["processes"]
    out = []
    for p in procs:
        try:
            if os.getpgid(p["pid"]) == server.proc.pid:
                out.append(p["pid"])
        except ProcessLookupError:
            pass
    return out


def _pool_processes(pool: str) -> list[dict]:
    from maru_shm import PoolView, pool_report
    with PoolView.open(pool) as view:
        return [{"pid": p["pid"], "alive": p["alive"], "slot": p["slot"]} for p in pool_report(view)["processes"]]


def _pids(procs: list[dict]) -> set[int]:
    return {p["pid"] for p in procs}


def _watch_slots(pool: str, pids: list[int], timeout: float = 30) -> list[dict]:
    """From the kill on, every change of the killed schedulers' process states and of their pool slots
    (alive / dead / reaped), until every one has exited and its slot reads dead or reaped."""
    t0, seen, out = time.monotonic(), None, []
    while True:
        listed = {p["pid"]: p["alive"] for p in _pool_processes(pool)}
        now = [(pid, state(pid), "reaped" if pid not in listed else ("alive" if listed[pid] else "dead"))
               for pid in pids]
        if now != seen:
            out.append({"t_s": round(time.monotonic() - t0, 2), "pids": now})
            seen = now
        done = all(st in ("Z", "gone") and slot != "alive" for _, st, slot in now)
        if done or time.monotonic() - t0 > timeout:
            return out
        time.sleep(0.05)


def _cached(server) -> dict:
    from ..benchclient import metric_sum
    text = server.get("/metrics")
    return {src: metric_sum(text, "sglang:cached_tokens_total", cache_source=src) for src in ("storage", "host", "device")}


def kill_under_load(args, progress=lambda frac, note="": None) -> dict:
    import dataclasses
    from maru_shm import Store, check_pool
    from .. import benchclient
    from ..deployment import Deployment
    from ..l3backends import L3
    from ..loadrun import empty_l3, greedy_check, subset, warm
    from .serving_load import model_spec, workloads

    work = tempfile.mkdtemp(prefix="maru-bench-serving-kill-")
    out: dict = {}
    try:
        base, model, what = model_spec(args, work)
        w = workloads(_only_gsp(args), work)[0][0]
        n_requests = w.meta["groups"] * w.meta["per_group"]
        kill_at = max(1, math.ceil(args.serving_kill_after * n_requests))
        with L3("maru", args.serving_pools[0], work, "kill") as l3:
            spec = dataclasses.replace(base, **l3.spec_fields())
            progress(0.05, "starting two servers")
            with Deployment("pair", "1", spec, work, "kill") as dep:
                warm(dep)
                empty_l3(dep, l3)
                a, b = dep.servers
                a_pids = _scheduler_pids(l3.pool, a)
                progress(0.2, "load")
                client = benchclient.start(dep.url, model, w.args, work, tag="kill", seed=w.seed, rate=w.rate,
                                           concurrency=w.concurrency)
                try:
                    while sum(dep.forwarder.routed.values()) < kill_at:
                        if not client.running():
                            raise RuntimeError(f"the client ended before {kill_at} requests were routed")
                        time.sleep(0.05)
                    b_routed, b_cached = dep.forwarder.routed[b.url], _cached(b)
                    dep.kill(0)
                    out["killed_after_routed"] = sum(dep.forwarder.routed.values())
                    out["kill_timeline"] = _watch_slots(l3.pool, a_pids)
                    out["after_kill"] = _pool_processes(l3.pool)
                    out["reapable_after_kill"] = check_pool(l3.pool).to_reap
                    run = client.finish()
                finally:
                    client.kill()
                b_after = _cached(b)
                out["b_routed_after_kill"] = dep.forwarder.routed[b.url] - b_routed
                out["b_cached_after_kill"] = {k: b_after[k] - b_cached[k] for k in b_after}
                out["refused"] = dict(dep.forwarder.refused)
                out["load"] = {"completed": run.result["completed"], "failed": run.failed,
                               "ttft_mean_ms": run.result["mean_ttft_ms"], "storage_tokens": run.storage_tokens()}
                listed = {p["pid"]: p["alive"] for p in out["after_kill"]}
                out["dead_listed_after_kill"] = [pid for pid in a_pids if listed.get(pid, False) is False]
                out["reaped_before_restart"] = [pid for pid in a_pids if pid not in _pids(_pool_processes(l3.pool))]
                progress(0.55, "restarting the killed server")
                fresh = dep.restart(0)
                procs = _pool_processes(l3.pool)
                out["a_pids"], out["after_restart"] = a_pids, procs
                out["dead_after_restart"] = [p["pid"] for p in procs if p["alive"] is False or p["pid"] in a_pids]
                live = check_pool(l3.pool)
                out["live_check_after_restart"] = live.problems + live.to_reap
                prompts = subset(benchclient.gsp_prompts(run), args.serving_check_prompts)
                dep.flush()
                replies = [fresh.generate(p, w.output_len) for p in prompts]
                out["restarted_storage"] = [int(r.cached.get("storage", 0)) for r in replies]
                check = greedy_check(dep, l3, prompts, w.output_len)  # on B: from L3, then recomputed
                out["restarted_same_as_recompute"] = [r.tokens == t for r, t in zip(replies, check["recompute_tokens"])]
                out["check"] = check
                progress(0.75, "reference run")
                empty_l3(dep, l3)
                ref = benchclient.run(dep.url, model, w.args, work, tag="kill-ref", seed=w.seed, rate=w.rate,
                                      concurrency=w.concurrency)
                errors = run.result.get("errors", [])
                out["replies_compared"] = sum(1 for e in errors if not e)
                out["replies_differing"] = sum(1 for x, y, e in zip(run.texts, ref.texts, errors) if not e and x != y)
            with Store.open(l3.pool) as store:  # an operator's next opener: reaps the stopped servers' slots
                out["stats_at_end"] = {k: store.stats()[k] for k in ("entries", "evictions", "processes")}
            report = check_pool(l3.pool)
            out["check_at_end"] = {"ok": report.ok, "problems": report.problems}
    finally:
        if not getattr(args, "serving_keep", False):
            shutil.rmtree(work, ignore_errors=True)
    out["model"], out["requests"], out["kill_at"], out["concurrency"] = what, n_requests, kill_at, w.concurrency
    return out


def _only_gsp(args):
    """The run's arguments with one workload: generated-shared-prefix at the first seed."""
    import argparse
    seeds = getattr(args, "serving_seeds", None) or [1]
    return argparse.Namespace(**{**vars(args), "serving_workloads": ["gsp"], "serving_seeds": seeds[:1]})


@scenario(NAME)
def bench_serving_kill(args) -> dict:
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        return {"scenario": NAME, "skipped": "sglang is not installed", "figures": []}
    r = kill_under_load(args, progress_of(args))
    same = r["check"]["same"] + r["restarted_same_as_recompute"]
    figs = [
        figure("serving-kill: failed requests (those the killed server was serving)", r["load"]["failed"],
               r["concurrency"], "client concurrency", goal="<= concurrency", met=r["load"]["failed"] <= r["concurrency"],
               b_routed_after_kill=r["b_routed_after_kill"]),
        figure("serving-kill: survivor's cached tokens after the kill", sum(r["b_cached_after_kill"].values()),
               goal="> 0", met=sum(r["b_cached_after_kill"].values()) > 0),
        figure("serving-kill: dead processes left in the pool after the restart", len(r["dead_after_restart"]),
               goal="0", met=not r["dead_after_restart"] and not r["live_check_after_restart"]),
        figure("serving-kill: restarted server, greedy subset prompts with tokens from L3",
               sum(1 for s in r["restarted_storage"] if s > 0), len(r["restarted_storage"]), "prompts", goal="all",
               met=all(s > 0 for s in r["restarted_storage"])),
        figure("serving-kill: greedy subset tokens equal to recomputed", sum(same), len(same), "prompts",
               goal="all", met=all(same)),
        figure("serving-kill: completed load replies differing from the reference run", r["replies_differing"],
               r["replies_compared"], "compared", goal="0", met=r["replies_differing"] == 0),
        figure("serving-kill: check after both servers stop", 0 if r["check_at_end"]["ok"] else 1, goal="clean",
               met=r["check_at_end"]["ok"]),
    ]
    return {"scenario": NAME, **r, "figures": figs}
