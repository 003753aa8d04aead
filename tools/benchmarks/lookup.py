"""lookup: batch_exists of 128 keys (all hits, first miss) through MaruStorage, vs HiCacheFile."""

from __future__ import annotations

from .hostpool import lookup
from .registry import figure, scenario


NAME = "lookup"


@scenario(NAME)
def bench_lookup(args) -> dict:
    r = lookup(args.repeat)
    figs = []
    for case in ("all_hits", "first_miss"):
        figs.append(figure(f"batch_exists x128 ({case.replace('_', ' ')}), seconds", r[f"{case}_maru"],
                           r[f"{case}_file"], "HiCacheFile", unit="s", spread=r.get(f"{case}_maru_spread"),
                           peer_spread=r.get(f"{case}_file_spread"), better="lower",
                           goal="<= 0.1 x HiCacheFile (10 x faster)", met=r[f"{case}_ratio"] >= 10))
    return {"scenario": "lookup", **r, "figures": figs}
