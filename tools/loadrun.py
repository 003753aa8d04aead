"""One load run of SGLang's benchmark client against a deployment, and the greedy-token check after it.

`run_load` empties every cache level first (each scheduler's device and host caches, and the L3, until the
L3 reads empty), reads SGLang's counters and the L3's before and after the client, and keeps the client's
own figures. Tokens from L3 are SGLang's count, `sglang:cached_tokens_total{cache_source="storage"}` from
/metrics (per server: the tokenizer process counts for all of a server's DP ranks), next to the sum the
client saw in each reply's cached_tokens_details. Pages prefetched from and backed up to L3 come from
`sglang:prefetch_pgs` and `sglang:backup_pgs`, labelled by DP rank where SGLang exports them (0.5.23 shows
rank 0's only with --dp-size 2, and none for HiCacheFile). CPU seconds per server process name
(tools/procgroup.py) say where the cores went during the client's run.

`greedy_check` sends a fixed subset of the run's prompts one at a time, greedy, to the last scheduler after
flushing device and host caches (their KV then comes from L3), then again with the L3 emptied (recompute):
the tokens must be the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import benchclient, procgroup

WARM_TEXT = " ".join(["hi"] * 72)  # a short prompt (over four 16-token pages) every tokenizer can read


@dataclass
class Workload:
    name: str  # "gsp" or "mooncake"
    args: list[str]  # the client's dataset arguments
    output_len: int
    seed: int = 1
    rate: float | None = None
    concurrency: int | None = None
    trace: str | None = None  # mooncake: the trace file replayed
    rounds: int = 1
    meta: dict = field(default_factory=dict)


def _metric_by(texts: list[str], name: str, label: str, **labels) -> dict:
    """Per server i (and per `label` value within it): the metric's sum."""
    out = {}
    for i, text in enumerate(texts):
        for value in sorted(set(benchclient.label_values(text, name, label))) or [None]:
            key = f"{i}" if value is None else f"{i}/{label}={value}"
            out[key] = benchclient.metric_sum(text, name, **labels, **({label: value} if value else {}))
    return out


def counters(deployment) -> dict:
    texts = deployment.metrics()
    cached = {src: [benchclient.metric_sum(t, "sglang:cached_tokens_total", cache_source=src) for t in texts]
              for src in ("storage", "host", "device")}
    return {"cached": cached, "prefetch_pages": _metric_by(texts, "sglang:prefetch_pgs_sum", "dp_rank"),
            "backup_pages": _metric_by(texts, "sglang:backup_pgs_sum", "dp_rank")}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def empty_l3(deployment, l3, timeout: float = 60) -> int | None:
    """Clear the L3 until it reads empty (Mooncake keeps an object for a lease after a read, so one clear
    may leave some); returns what was left at the deadline (0: empty; None: not countable, see
    tools/l3backends.py). Device and host caches are flushed first: a backup in flight would write into
    the emptied store."""
    deployment.flush()
    if l3.name == "none":
        return 0
    deadline = time.monotonic() + timeout
    while True:
        deployment.clear_l3()
        left = l3.left_after_clear()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def warm(deployment, output_len: int = 1) -> None:
    """Every scheduler's one-time costs paid before measuring (first kernels, SGLang's page-hash extension,
    the backend's first write and read): one short prompt computed by the first scheduler, then read by
    each other one after the flush."""
    first = deployment.servers[0]
    first.generate(WARM_TEXT, output_len)
    deployment.flush()
    if deployment.topology == "pair":
        deployment.servers[1].generate(WARM_TEXT, output_len)
    else:  # the DP controller sends the next request to the next rank
        for _ in range(deployment.schedulers - 1):
            first.generate(WARM_TEXT, output_len)


def run_load(deployment, l3, workload: Workload, model_dir: str, work_dir: str, tag: str) -> tuple[dict, object]:
    """One measured run after emptying every cache: (figures, the benchclient.ClientRun). Per request, in
    the order the client made them: its TTFT and its tokens from L3 (which requests lost a prefix race)."""
    left = empty_l3(deployment, l3)
    before_l3, before = l3.counters(), counters(deployment)
    cpu_before = [procgroup.group_cpu(s.proc.pid) for s in deployment.servers]
    run = benchclient.run(deployment.url, model_dir, workload.args, work_dir, tag=tag, seed=workload.seed,
                          rate=workload.rate, concurrency=workload.concurrency)
    cpu = [procgroup.delta(procgroup.group_cpu(s.proc.pid), b) for s, b in zip(deployment.servers, cpu_before)]
    after, after_l3 = counters(deployment), l3.counters()
    r = run.result
    storage = [a - b for a, b in zip(after["cached"]["storage"], before["cached"]["storage"])]
    fig = {
        "completed": r["completed"], "failed": run.failed, "duration_s": r["duration"],
        "ttft_mean_ms": r["mean_ttft_ms"], "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
        "request_throughput": r["request_throughput"], "input_throughput": r["input_throughput"],
        "input_tokens": r["total_input_tokens"], "hit_rate_pct": (r.get("cache_report") or {}).get("cache_hit_rate_pct"),
        "storage_tokens": sum(storage), "storage_tokens_by_server": storage,
        "device_tokens": sum(a - b for a, b in zip(after["cached"]["device"], before["cached"]["device"])),
        "host_tokens": sum(a - b for a, b in zip(after["cached"]["host"], before["cached"]["host"])),
        "client_storage_tokens": run.storage_tokens(),
        "prefetch_pages": _delta(after["prefetch_pages"], before["prefetch_pages"]),
        "backup_pages": _delta(after["backup_pages"], before["backup_pages"]),
        "ttfts_ms": [round(t * 1000, 1) for t in r.get("ttfts", [])],
        "storage_per_request": [int((d or {}).get("storage") or 0) for d in r.get("cached_tokens_details", [])],
        "cpu_by_process": cpu,
        "evictions": None if after_l3["evictions"] is None else after_l3["evictions"] - before_l3["evictions"],
        "l3_entries": after_l3["entries"], "l3_bytes": after_l3["bytes"], "l3_left_before": left,
    }
    return fig, run


def subset(prompts: list[str], n: int, key_chars: int = 256) -> list[str]:
    """The first `n` prompts that differ in their first `key_chars` characters: one per shared-prefix group
    (generated-shared-prefix) or per session (mooncake)."""
    out, seen = [], set()
    for p in prompts:
        if p[:key_chars] not in seen:
            seen.add(p[:key_chars])
            out.append(p)
        if len(out) == n:
            break
    return out


def greedy_check(deployment, l3, prompts: list[str], output_len: int) -> dict:
    """Tokens of `prompts` with their prefixes from L3, and recomputed with the L3 emptied."""
    reader = deployment.servers[-1]

    def send():
        deployment.flush()
        return [reader.generate(p, output_len) for p in prompts]

    from_l3 = send() if l3.name != "none" else None
    left = empty_l3(deployment, l3) if l3.name != "none" else 0
    recompute = send()
    out = {"prompts": len(prompts), "recompute_tokens": [r.tokens for r in recompute], "l3_left": left,
           "recompute_storage": [int(r.cached.get("storage", 0)) for r in recompute]}
    if from_l3 is not None:
        out.update(l3_tokens=[r.tokens for r in from_l3], l3_storage=[int(r.cached.get("storage", 0)) for r in from_l3],
                   same=[a.tokens == b.tokens for a, b in zip(from_l3, recompute)])
    return out
