"""PNG charts of `maru-shm bench --json` results, drawn with matplotlib (Agg, no display).

    python -m tools.benchmarks.charts results.json DIR     (or: maru-shm bench --charts DIR)

Writes, for the scenarios present in the results:
  scaling.png      aggregate ops/s and p99 latency vs processes, ours vs the
                   copy limit (plain 128 KiB copies by the same processes);
  utilization.png  live payload / file for capacity, mixed and hybrid, ours
                   vs the peers (Maru 1 MiB chunks, fixed slots, power-of-two
                   classes);
  eviction.png     hit ratio vs pool size, ours vs exact LRU (data area bytes;
                   our live bytes) and the textbook policies at our live bytes;
  serving.png      TTFT under SGLang's own client per L3 backend (bars: mean,
                   whiskers: min-max of the runs, dots: p99), one panel per
                   workload, grouped by deployment and thread setting.
Every chart carries the machine line (cores, load average) of the run.
"""

from __future__ import annotations

import json
import os
import sys

from maru_shm import format_size

OURS, PEER, PEER2, PEER3 = "#1f6feb", "#999999", "#d97706", "#6b7280"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _by_scenario(doc: dict) -> dict:
    return {r["scenario"]: r for r in doc.get("results", [])}


def _footer(fig, doc: dict, note: str = "") -> None:
    m = doc.get("machine", {})
    load = m.get("loadavg_at_end")
    text = f"{m.get('cores', m.get('cpus', '?'))} cores, load {load[0]:.1f}" if load else f"{m.get('cpus', '?')} CPUs"
    text += f", {m.get('time', '')}" + (f" - {note}" if note else "")
    fig.text(0.01, 0.01, text, fontsize=7, color="#555555")


def _size(n: float) -> str:
    """Sizes in titles and axis labels: three significant digits ('128 KiB', '4.38 KiB')."""
    return format_size(n, style="short")


def chart_scaling(r: dict, doc: dict, path: str, note: str = "") -> str:
    plt = _plt()
    pts = r["points"]
    n = [p["processes"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((a, "ops_s", "aggregate ops/s"), (b, "p99_us", "p99 latency (us)")):
        for prefix, colour, name in (("", OURS, "maru-shm get/put"), ("copy_", PEER, "copy limit (memmove)")):
            med = [p[prefix + key]["median"] for p in pts]
            lo = [p[prefix + key]["median"] - p[prefix + key]["spread"][0] for p in pts]
            hi = [p[prefix + key]["spread"][1] - p[prefix + key]["median"] for p in pts]
            ax.errorbar(n, med, yerr=[lo, hi], marker="o", color=colour, capsize=3, label=name)
        if key == "ops_s" and pts and pts[0]["processes"] == 1:
            one = pts[0]["ops_s"]["median"]
            ax.plot(n, [one * min(k, r["cores"]) for k in n], ls=":", color=OURS, alpha=0.6,
                    label="maru-shm, linear up to the cores")
            if all("copy_cores_busy" in p for p in pts):
                c1 = pts[0]["copy_cores_busy"]["median"]
                ax.plot(n, [one * p["copy_cores_busy"]["median"] / c1 for p in pts], ls="--", color=PEER2,
                        alpha=0.7, label="maru-shm x CPU the machine gave (copy rounds)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("processes")
        ax.set_ylabel(label)
        ax.axvline(r["cores"], color="#cccccc", ls="--", lw=1)
        ax.grid(alpha=0.3)
    a.set_ylim(bottom=0)
    b.set_yscale("log")
    a.legend(fontsize=8)
    a.set_title(f"{_size(r['value_bytes'])} values, 50/50 get/put, shared keys (dashed: cores)", fontsize=9)
    b.set_title("median and min-max over rounds", fontsize=9)
    _footer(fig, doc, note)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chart_utilization(res: dict, doc: dict, path: str, note: str = "") -> str | None:
    plt = _plt()
    groups = []  # (label, [(name, value, colour)])
    if "capacity" in res:
        r = res["capacity"]
        groups.append((f"capacity\n{_size(r['value_bytes'])} pages",
                       [("maru-shm", r["ours"], OURS), ("Maru 1 MiB chunks", r["peer"], PEER)]))
    if "mixed" in res:
        r = res["mixed"]
        bars = [("maru-shm", r["ours"], OURS)]
        if "maru_1m" in r:
            bars.append(("Maru 1 MiB chunks", r["maru_1m"], PEER))
        bars += [("fixed slots", r["fixed_512k"], PEER3), ("power-of-two classes", r["pow2_classes"], PEER2)]
        groups.append(("mixed\n50-512 KiB", bars))
    if "hybrid" in res:
        r = res["hybrid"]
        bars = [("maru-shm", r["ours"], OURS)]
        if "maru_1m" in r:
            bars.append(("Maru 1 MiB chunks", r["maru_1m"], PEER))
        bars += [("fixed slots", r["fixed_slots"], PEER3), ("power-of-two classes", r["pow2_classes"], PEER2)]
        groups.append(("hybrid\nDeepSeek-V4-like", bars))
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.2
    seen = set()
    for gi, (label, bars) in enumerate(groups):
        x0 = gi - width * (len(bars) - 1) / 2
        for bi, (name, v, colour) in enumerate(bars):
            ax.bar(x0 + bi * width, v, width * 0.95, color=colour, label=None if name in seen else name)
            ax.text(x0 + bi * width, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
            seen.add(name)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylim(0, 1.22)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("live payload / file")
    ax.axhline(1.0, color="#cccccc", lw=1)
    ax.legend(fontsize=8, loc="upper center", ncols=4, frameon=False)
    ax.set_title("share of the file holding live payload (peers simulated on the same values)", fontsize=9)
    _footer(fig, doc, note)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chart_eviction(r: dict, doc: dict, path: str, note: str = "") -> str:
    plt = _plt()
    pts = r["points"]
    x = [p["pool_bytes"] for p in pts]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = (("ours", "maru-shm (slab CLOCK)", OURS, "o", "-"),
              ("lru_file_bytes", "exact LRU, data area bytes (goal: within 2 pp)", "#000000", "s", "-"),
              ("lru_live_bytes", "exact LRU, our live bytes", PEER2, "^", "--"),
              ("clock_live_bytes", "per-object CLOCK, our live bytes", PEER3, "v", ":"),
              ("random_live_bytes", "random eviction, our live bytes", PEER, "x", ":"))
    for key, label, colour, marker, ls in series:
        ax.plot(x, [p[key] for p in pts], marker=marker, ls=ls, color=colour, label=label)
    for p in pts:
        ax.annotate(f"{-p['gap_pp']:+.1f} pp", (p["pool_bytes"], p["ours"]), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8, color=OURS)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{_size(v)}\n{p['cache_fraction'] * 100:.0f} %" for v, p in zip(x, pts)])
    ax.set_xlabel("pool size (share of the key set's bytes)")
    ax.set_ylabel("hit ratio")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Zipf({r['alpha']}) get-or-put, {r['keys']:,} keys of {_size(r['size_range'][0])}-"
                 f"{_size(r['size_range'][1])}, {r['requests']:,} requests", fontsize=9)
    _footer(fig, doc, note)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SERVING_COLOURS = {"maru": OURS, "file": PEER2, "mooncake": PEER3, "none": PEER}


def chart_serving(r: dict, doc: dict, path: str, note: str = "") -> str | None:
    """TTFT per L3 backend: for each workload, bars per backend label within each (deployment, threads)."""
    plt = _plt()
    cells = r.get("cells") or []
    panels = list(dict.fromkeys((c["workload"], c["seed"]) for c in cells))
    if not panels:
        return None
    labels = list(dict.fromkeys(c["label"] for c in cells))
    budget = {c["label"]: c["budget"] for c in cells}
    largest = max([b for b in budget.values() if b] or [0])
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (wl, seed) in zip(axes[:, 0], panels):
        mine = [c for c in cells if c["workload"] == wl and c["seed"] == seed]
        groups = list(dict.fromkeys((c["topology"], c["threads"]) for c in mine))
        width = 0.8 / max(1, len(labels))
        for li, label in enumerate(labels):
            xs, ys, lo, hi, p99 = [], [], [], [], []
            for gi, g in enumerate(groups):
                c = next((c for c in mine if (c["topology"], c["threads"]) == g and c["label"] == label), None)
                if c is None or "ttft_mean_ms" not in c["median"]:
                    continue
                m, (a, b) = c["median"]["ttft_mean_ms"], c["spread"]["ttft_mean_ms"]
                xs.append(gi - 0.4 + width * (li + 0.5))
                ys.append(m)
                lo.append(m - a)
                hi.append(b - m)
                p99.append(c["median"].get("ttft_p99_ms"))
            backend = label.split()[0]
            ax.bar(xs, ys, width * 0.9, yerr=[lo, hi], capsize=2, color=SERVING_COLOURS.get(backend, PEER),
                   hatch="//" if budget[label] and budget[label] < largest else None, label=label, alpha=0.9)
            ax.plot(xs, p99, ls="", marker="o", ms=3, color="#000000")
        ax.set_xticks(range(len(groups)), [f"{t} threads={th}" for t, th in groups])
        ax.set_ylabel("TTFT (ms)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{wl} seed {seed}: TTFT mean per L3 (bars, min-max whiskers), p99 (dots); hatched: the "
                     f"smaller pool", fontsize=9)
        ax.legend(fontsize=7, ncols=min(6, len(labels)))
    _footer(fig, doc, note)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_charts(doc: dict, out_dir: str, note: str = "") -> list[str]:
    """Write every chart the results allow into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    res = _by_scenario(doc)
    paths = []
    if "scaling" in res and res["scaling"].get("points"):
        paths.append(chart_scaling(res["scaling"], doc, os.path.join(out_dir, "scaling.png"), note))
    u = chart_utilization(res, doc, os.path.join(out_dir, "utilization.png"), note)
    if u:
        paths.append(u)
    if "eviction" in res and res["eviction"].get("points"):
        paths.append(chart_eviction(res["eviction"], doc, os.path.join(out_dir, "eviction.png"), note))
    if "serving" in res and res["serving"].get("cells"):
        sv = chart_serving(res["serving"], doc, os.path.join(out_dir, "serving.png"), note)
        if sv:
            paths.append(sv)
    return paths


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m tools.benchmarks.charts", description=__doc__.splitlines()[0])
    p.add_argument("results", help="JSON written by `maru-shm bench --json` ('-' for stdin)")
    p.add_argument("out_dir", help="directory for the PNG files")
    p.add_argument("--note", default="", help="text added to every chart's footer (e.g. 'provisional')")
    a = p.parse_args(argv)
    doc = json.load(sys.stdin if a.results == "-" else open(a.results))
    paths = render_charts(doc, a.out_dir, a.note)
    for path in paths:
        print(path)
    return 0 if paths else 1


if __name__ == "__main__":
    sys.exit(main())
