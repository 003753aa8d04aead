"""The text report of a run: one table row per figure, then the scenarios that need more."""

from __future__ import annotations

from maru_shm import format_size


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
                if "all_core_limit_set" in row:
                    lines.append(
                        f"datapath  {format_size(row['page_bytes'])} pages vs the all-core copy limit "
                        f"(set {row['all_core_limit_set']['gbps']:.2f}, get {row['all_core_limit_get']['gbps']:.2f} "
                        f"GB/s): set x{row['set_vs_all_core']:.2f}, get x{row['get_vs_all_core']:.2f}, "
                        f"full-pool set x{row['set_full_vs_all_core']:.2f}")
                if "busy" in row:
                    lines += _render_threads(row)
        elif r["scenario"] == "lookup":
            for case in ("all_hits", "first_miss"):
                lines.append(f"lookup    batch_exists x128 ({case.replace('_', ' ')}): {r[case + '_maru'] * 1e6:.1f} us "
                             f"vs HiCacheFile {r[case + '_file'] * 1e6:.1f} us -> x{r[case + '_ratio']:.1f}")
        elif r["scenario"] == "hybrid":
            pb = sorted(r["page_bytes"].values())
            lines.append(f"hybrid    {len(pb)} pools, pages {format_size(pb[0])}-{format_size(pb[-1])} "
                         f"(x{r['size_spread']:.0f}) at {r['churn']}x {format_size(r['pool_bytes'])}: live/file (min over churn) "
                         f"{r['ours']:.4f} vs fixed {format_size(r['fixed_slot_bytes'])} slots {r['fixed_slots']:.4f}, "
                         f"power-of-two classes {r['pow2_classes']:.4f}, Maru 1 MiB chunks {r['maru_1m']:.4f}; "
                         f"goal >= {r['goal']} "
                         f"{'met' if r['met'] else 'MISSED'}")
            lines.append(f"hybrid    payload still usable as hits (whole restorable prefixes) / file, mean over churn: "
                         f"{r['usable']:.4f} vs fixed slots "
                         f"{r['fixed_slots_usable']:.4f}, power-of-two classes {r['pow2_classes_usable']:.4f} (FIFO); "
                         f"goal >= 0.90 {'met' if r['usable'] >= 0.90 else 'MISSED'}")
        elif r["scenario"] == "tier2":
            lines += render_tier2(r)
        elif r["scenario"] == "eviction":
            lines += render_eviction(r)
        elif r["scenario"] == "prefixtree":
            lines += render_prefixtree(r)
        elif r["scenario"] == "scaling":
            lines += render_scaling(r)
        elif r["scenario"] == "e2e":
            lines += render_e2e(r)
        elif r["scenario"] == "mixshift":
            lines += render_mixshift(r)
        elif r["scenario"] == "serving":
            lines += render_serving(r)
        elif r["scenario"] == "serving-kill":
            lines += render_serving_kill(r)
    return "\n".join(lines)


def render_mixshift(r: dict) -> list[str]:
    a, b = (format_size(n) for n in r["value_sizes"])
    lines = [f"mixshift  {b} values start on a {format_size(r['pool_bytes'])} pool full of {a} ones, asked in turn "
             f"(Zipf, {r['measured_requests']:,} requests measured): hit ratio {b} / {a}"]
    for name, what in (("default", "default"), ("no_moves", "no slab moves"), ("lru", "exact LRU")):
        x = r[name]
        share = x.get("b_slab_share", x.get("b_byte_share"))
        lines.append(f"mixshift  {what:14} {x['b_hit_ratio']:.3f} / {x['a_hit_ratio']:.3f}; {b} share of the "
                     f"pool {share:.3f}" + (f", {x['slab_moves']:,} slab moves" if "slab_moves" in x else ""))
    return lines


def _met(m) -> str:
    return "n/a" if m is None else ("met" if m else "MISSED")

def _render_threads(row: dict) -> list[str]:
    """The copy engine vs one copy thread, idle and beside one busy process per core."""
    b, size = row["busy"], format_size(row["page_bytes"])
    out = [f"datapath  {size} pages, copy engine vs one copy thread (idle): set x{row['set_vs_one_thread']:.2f} "
           f"({row['set']['gbps']:.2f} vs {row['one_set']['gbps']:.2f} GB/s), get x{row['get_vs_one_thread']:.2f} "
           f"({row['get']['gbps']:.2f} vs {row['one_get']['gbps']:.2f} GB/s); batches threaded / alone: idle "
           f"{'/'.join(map(str, row['engine_batches']['idle']))}, busy {'/'.join(map(str, row['engine_batches']['busy']))}"]
    for op in ("set", "get"):
        out.append(
            f"datapath  {size} pages, batch_{op}_v1 with one busy process per core: {b[op]['gbps']:.2f} GB/s; "
            f"one copy thread {b['one_' + op]['gbps']:.2f} -> x{b[op + '_vs_one_thread']:.2f} (goal >= 0.9); "
            f"all-core limit {b['all_core_limit_' + op]['gbps']:.2f} -> x{b[op + '_vs_all_core']:.2f}; "
            f"one-thread limit {b['memmove_' + op]['gbps']:.2f}; HiCacheFile {b['file_' + op]['pages_per_s']:,.0f} "
            f"pages/s -> x{b[op + '_vs_file']:.1f}")
    return out


def render_tier2(r: dict) -> list[str]:
    if r.get("skipped"):
        return [f"tier2     skipped: {r['skipped']}"]
    g = {k: r[k]["pages_per_s"] for k in ("tier_get", "local_get", "file_get", "tier_set", "local_set")}
    return [f"tier2     {format_size(r['page_bytes'])} pages x{r['batch']}, batch_get_v1: second-tier hit "
            f"({r['transport']}, promotion included) {g['tier_get']:,.0f} pages/s, local pool hit "
            f"{g['local_get']:,.0f} pages/s (x{1 / r['tier_vs_local']:.1f} the tier), HiCacheFile "
            f"{g['file_get']:,.0f} pages/s (tier x{r['tier_vs_file']:.2f}, local x{r['local_vs_file']:.1f})",
            f"tier2     batch_set_v1 with write-through {g['tier_set']:,.0f} pages/s vs the pool alone "
            f"{g['local_set']:,.0f} pages/s (x{1 / r['write_through_cost']:.2f})"]


def render_e2e(r: dict) -> list[str]:
    if r.get("skipped"):
        return [f"e2e       skipped: {r['skipped']}"]
    out = [f"e2e       SGLang launch_server x2 per backend, {r['model']}; TTFT median over the run's prompts"]
    for n, row in r["lengths"].items():
        out.append(f"e2e       {n:>6} tokens: recompute {row['recompute_s'] * 1e3:,.0f} ms, L3 hit MaruStorage "
                   f"{row['maru_hit_s'] * 1e3:,.0f} ms (x{row['recompute_s'] / row['maru_hit_s']:.2f}), HiCacheFile "
                   f"{row['file_hit_s'] * 1e3:,.0f} ms (x{row['recompute_s'] / row['file_hit_s']:.2f}); pages from "
                   f"L3 {row['maru_pages']} / {row['file_pages']} of {row['full_pages']}")
    return out


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

def _paired(row: dict, name: str) -> str:
    """Median [min-max] of the per-round ratios (ours and the peer timed back to back in each round)."""
    p = row.get(f"{name}_paired")
    return "n/a" if p is None else f"{p['median']:.2f} [{p['spread'][0]:.2f}-{p['spread'][1]:.2f}]"


def render_prefixtree(r: dict) -> list[str]:
    """Per shape and model: the summary over its cells, then one line per cell (seed, replay, size)."""
    from .prefixtree import goals
    out = []
    for sh, x in r["shapes"].items():
        for name, s in x["summary"].items():
            ab = "".join(f"; without {v}: x{a['mean']:.3f} (worst x{a['min']:.3f})" for v, a in s["ab"].items())
            ul = "n/a" if s["usable_live_min"] is None else f"{s['usable_live_min']:.3f}"
            bel = f", Belady / LRU x{s['belady_vs_lru']['mean']:.3f}" if "belady_vs_lru" in s else ""
            below = "".join(f"; {n} of {j} judged cells below {g:.3f} ({what})" for what, _, g, n, j in goals(name, s)
                            if n is not None)
            out.append(f"prefixtree {sh} {name} ({s['cells']} cells): ours / plain CLOCK x{s['vs_clock']['mean']:.3f} "
                       f"(worst x{s['vs_clock']['min']:.3f}), ours / LRU x{s['vs_lru']['mean']:.3f} (worst "
                       f"x{s['vs_lru']['min']:.3f}), plain CLOCK / LRU x{s['clock_vs_lru']['mean']:.3f}{bel}; lowest "
                       f"usable/live (direct) {ul}, usable/file {s['usable_file_min']:.3f}{below}; base / variant{ab}")
        for seed, models in x["by_seed"].items():
            for m in models.values():
                out += _prefixtree_cells(m)
    return out


def _prefixtree_cells(m: dict) -> list[str]:
    out = [f"prefixtree {m['shape']} {m['model']} seed {m['seed']}: {m['requests']} requests, {m['pages']} pages "
           f"({format_size(m['working_set_bytes'])} working set), {m['sessions']} sessions"]
    for run in m["runs"].values():
        o = run["ours"]
        tokens = " / ".join(f"{k} {run[k]['tokens']:,}" for k in run if isinstance(run[k], dict))
        out.append(f"  {run['replay']:<6} {run['ratio']:g}x ({format_size(run['pool_bytes'])}): tokens {tokens}; "
                   f"usable/live {o['usable_live']:.3f}, usable/file {o['usable_file']:.3f}")
    return out


def _ms(med: dict, spread: dict, key: str) -> str:
    if key not in med:
        return "-"
    lo, hi = spread[key]
    return f"{med[key]:,.0f} [{lo:,.0f}-{hi:,.0f}]"


def render_serving(r: dict) -> list[str]:
    if r.get("skipped") and not r.get("cells"):
        return [f"serving   skipped: {r['skipped']}"]
    out = [f"serving   sglang.bench_serving against SGLang servers, {r['model']}; medians of {r['repeat']} run(s) "
           f"x {r.get('rounds', 1)} round(s) [min-max]"]
    if r.get("skipped"):
        out.append(f"serving   left out: {'; '.join(r['skipped'])}")
    for w in r["workloads"]:
        shape = (f"{w['groups']} groups x {w['per_group']}, system {w['system_len']}, question {w['question_len']}"
                 if w["name"] == "gsp" else f"{w['records']} records of {w['sessions']} sessions, {w['unique_blocks']} "
                 f"unique hash ids, {w['rounds']} round(s) each")
        out.append(f"serving   workload {w['name']} seed {w['seed']}: {shape}")
    groups: dict = {}
    for c in r["cells"]:
        groups.setdefault((c["topology"], c["threads"], c["workload"], c["seed"]), []).append(c)
    head = (f"  {'L3':<13} {'TTFT mean ms':>20} {'p50 ms':>20} {'p99 ms':>20} {'req/s':>6} {'in tok/s':>8} "
            f"{'L3 tok':>7} {'client':>7} {'hit %':>6} {'evict':>6} {'greedy':>7} {'diff':>5}")
    for (topo, threads, wl, seed), cells in groups.items():
        n = cells[0]["schedulers"]
        out.append(f"serving   {topo} ({n} scheduler{'s' if n > 1 else ''}), threads {threads}, {wl} seed {seed}:")
        out.append(head)
        for c in cells:
            m, sp, ch = c["median"], c["spread"], c["check"]
            greedy = (f"{sum(ch['same'])}/{len(ch['same'])}" if "same" in ch
                      else "ref" if c["backend"] == "none" else "-")
            diff = "-" if c.get("texts_differ_from_none") is None else str(c["texts_differ_from_none"])
            ev = "-" if m.get("evictions") is None else f"{m['evictions']:,.0f}"
            out.append(f"  {c['label']:<13} {_ms(m, sp, 'ttft_mean_ms'):>20} {_ms(m, sp, 'ttft_p50_ms'):>20} "
                       f"{_ms(m, sp, 'ttft_p99_ms'):>20} {m['request_throughput']:>6.2f} {m['input_throughput']:>8,.0f} "
                       f"{m['storage_tokens']:>7,.0f} {m['client_storage_tokens']:>7,.0f} {m.get('hit_rate_pct', 0):>6.1f} "
                       f"{ev:>6} {greedy:>7} {diff:>5}")
    out.append("serving   L3 tok: SGLang's cached_tokens_total{cache_source=storage} over the run; client: the sum "
               "of the replies' cached_tokens_details; evict: the L3's evictions (maru values, mooncake keys; "
               "HiCacheFile never evicts); greedy: subset prompts whose tokens from L3 equal the recomputed ones; "
               "diff: load replies differing from L3 none's")
    for f in r["figures"]:
        if "default threads / 1 thread" in f["name"]:
            out.append(f"serving   {f['name']}: x{f['ours']:.2f} vs x{f['peer']:.2f}; goal {f['goal']} {_met(f['met'])}")
        elif f["met"] is False and f.get("chance") is not None:
            out.append(f"serving   MISSED {f['name']}: {f['ours']:,.4g} vs {f['peer']:,.4g} (x{f['ratio']:.3f}); "
                       f"runs of one distribution are this far apart with p = {f['chance']:.2f}")
    return out


def render_serving_kill(r: dict) -> list[str]:
    if r.get("skipped"):
        return [f"serving-kill skipped: {r['skipped']}"]
    ld = r["load"]
    return [
        f"serving-kill two servers on one pool, {r['model']}; {r['requests']} requests, server A SIGKILLed after "
        f"{r['killed_after_routed']} were routed",
        f"serving-kill load: {ld['completed']} completed, {ld['failed']} failed (concurrency {r['concurrency']}); "
        f"survivor after the kill: {r['b_routed_after_kill']} requests, cached tokens {r['b_cached_after_kill']}",
        f"serving-kill pool after the kill: A's scheduler(s) {r['a_pids']} listed dead {r['dead_listed_after_kill']}, "
        f"reaped by the survivor before the restart {r['reaped_before_restart'] or 'none'}; the check's reapable: "
        f"{len(r['reapable_after_kill'])} item(s); after the kill (s: pid, state, slot) "
        f"{[(x['t_s'], x['pids']) for x in r['kill_timeline']]}",
        f"serving-kill after the restart: dead or A's processes left {r['dead_after_restart'] or 'none'}, live check "
        f"{'clean' if not r['live_check_after_restart'] else r['live_check_after_restart']}",
        f"serving-kill restarted server, tokens from L3 per subset prompt {r['restarted_storage']}; subset tokens = "
        f"recomputed: {r['restarted_same_as_recompute']} (restarted), {r['check']['same']} (survivor)",
        f"serving-kill completed load replies differing from a reference run: {r['replies_differing']} of "
        f"{r['replies_compared']}; at the end {r['stats_at_end']}, check "
        f"{'clean' if r['check_at_end']['ok'] else r['check_at_end']['problems']}",
    ]
