"""datapath: batch_set_v1 / batch_get_v1 of 128 pages through MaruStorage on SGLang's host pool, vs the copy
limit (plain copies of the same pages) and vs HiCacheFile."""

from __future__ import annotations

from .hostpool import datapath
from .registry import figure, progress_of, scenario


NAME = "datapath"


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
    return {"scenario": "datapath", "rows": rows, "figures": figs}
