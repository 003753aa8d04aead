"""datapath: batch_set_v1 / batch_get_v1 of 128 pages through MaruStorage on SGLang's host pool, vs the copy
limits (plain copies of the same pages, one thread; one contiguous copy of the same bytes on every core)
and vs HiCacheFile."""

from __future__ import annotations

from .hostpool import datapath
from .registry import figure, progress_of, scenario


NAME = "datapath"
# Goals against the all-core limit (BENCHMARKS.md, "The data path"): (128 KiB pages, 2 MiB pages)
ALL_CORE_GOALS = {"get": (0.8, 0.9), "set": (0.7, 0.9), "set_full": (0.6, 0.6)}


@scenario(NAME)
def bench_datapath(args) -> dict:
    rows, figs = [], []
    for j, ps in enumerate((1, 16)):
        progress_of(args)(j / 2, f"{ps}-token pages")
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
        figs += _all_core_figures(row, 0 if ps == 1 else 1)
        figs += _thread_figures(row)
    return {"scenario": "datapath", "rows": rows, "figures": figs}


def _thread_figures(row: dict) -> list[dict]:
    """The copy engine against the calling thread alone, on idle cores and beside one busy process per core
    (the goal: busy cores cost at most 10 % against one thread), and the busy run's own limits."""
    figs = []
    busy = row["busy"]
    for op in ("set", "get"):
        label = f"batch_{op}_v1 {row['page_bytes']} B pages"
        figs.append(figure(f"{label}, GB/s, copy engine vs one copy thread (idle cores)", row[op]["gbps"],
                           row[f"one_{op}"]["gbps"], "same store, maru_copy_threads=1", unit="GB/s",
                           spread=row[op]["spread_gbps"], peer_spread=row[f"one_{op}"]["spread_gbps"]))
        figs.append(figure(f"{label}, GB/s, one busy process per core: copy engine vs one copy thread",
                           busy[op]["gbps"], busy[f"one_{op}"]["gbps"], "same store, maru_copy_threads=1",
                           unit="GB/s", spread=busy[op]["spread_gbps"], peer_spread=busy[f"one_{op}"]["spread_gbps"],
                           goal=">= 0.9 x one thread", met=busy[f"{op}_vs_one_thread"] >= 0.9))
        for peer, what in (("all_core_limit", "all-core copy limit"), ("memmove", "one-thread copy limit"),
                           ("file", "HiCacheFile")):
            figs.append(figure(f"{label}, GB/s, one busy process per core", busy[op]["gbps"],
                               busy[f"{peer}_{op}"]["gbps"], f"{what}, same busy run", unit="GB/s",
                               spread=busy[op]["spread_gbps"], peer_spread=busy[f"{peer}_{op}"]["spread_gbps"]))
    return figs


def _all_core_figures(row: dict, size_class: int) -> list[dict]:
    """Ours against one contiguous copy of the same bytes split over every core (the machine's bandwidth)."""
    figs = []
    for op, goals in ALL_CORE_GOALS.items():
        ours = row[op]
        peer = row["all_core_limit_set" if op == "set_full" else f"all_core_limit_{op}"]
        goal = goals[size_class]
        what = "into a full pool (each batch evicts)" if op == "set_full" else ""
        figs.append(figure(f"batch_{'set' if op == 'set_full' else op}_v1 {row['page_bytes']} B pages {what}, GB/s"
                           .replace("  ", " "), ours["gbps"], peer["gbps"], "all-core copy limit", unit="GB/s",
                           spread=ours["spread_gbps"], peer_spread=peer["spread_gbps"], goal=f">= {goal} x all-core",
                           met=row[f"{op}_vs_all_core"] >= goal))
    return figs
