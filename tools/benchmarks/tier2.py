"""tier2: pages/s of a prefix hit in the node's own pool, in the second tier (Mooncake Store on loopback), and
in HiCacheFile, in one run.

Two pool files stand for two nodes, each with its own MaruStorage and host pool, and a real mooncake_master
and storage process on 127.0.0.1. Node A writes every round's 128 pages (128 KiB, Llama-3.1-8B, page_size 1)
through to the tier. Each round, node B then loads a batch three ways, back to back:
  tier hit    batch_get_v1 of pages its pool lacks: Mooncake -> host pool, then promotion into the pool
              (what a prefix prefilled on another node costs);
  local hit   batch_get_v1 of the same pages again, now from its own pool;
  HiCacheFile SGLang's own file backend on /dev/shm, the same pages.
Writes are measured too: node A's batch_set_v1 with write-through, against a node without a tier.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from .hostpool import BATCH, _host_pool, _median, _page_keys, _storage_config, maru_extra
from .registry import figure, progress_of, scenario

NAME = "tier2"


@scenario(NAME)
def bench_tier2(args) -> dict:
    from ..mooncake_local import unavailable

    why = unavailable()
    if why is not None:
        return {"scenario": NAME, "skipped": why, "figures": []}
    r = tier2_reads(args.repeat, progress_of(args))
    figs = [
        figure("batch_get_v1 128 KiB pages, pages/s: second-tier hit (Mooncake, loopback tcp) vs local pool hit",
               r["tier_get"]["pages_per_s"], r["local_get"]["pages_per_s"], "local pool hit", unit="pages/s",
               spread=r["tier_get"]["spread"], peer_spread=r["local_get"]["spread"]),
        figure("batch_get_v1 128 KiB pages, pages/s: second-tier hit vs HiCacheFile", r["tier_get"]["pages_per_s"],
               r["file_get"]["pages_per_s"], "HiCacheFile", unit="pages/s", spread=r["tier_get"]["spread"],
               peer_spread=r["file_get"]["spread"]),
        figure("batch_get_v1 128 KiB pages, pages/s: local pool hit vs HiCacheFile", r["local_get"]["pages_per_s"],
               r["file_get"]["pages_per_s"], "HiCacheFile", unit="pages/s", spread=r["local_get"]["spread"],
               peer_spread=r["file_get"]["spread"]),
        figure("batch_set_v1 128 KiB pages, pages/s: pool + write-through vs pool alone",
               r["tier_set"]["pages_per_s"], r["local_set"]["pages_per_s"], "pool alone (no tier)", unit="pages/s",
               spread=r["tier_set"]["spread"], peer_spread=r["local_set"]["spread"]),
    ]
    return {"scenario": NAME, **r, "figures": figs}


def _rate(xs: list) -> dict:
    med, lo, hi = _median(xs)
    return {"seconds": med, "pages_per_s": BATCH / med, "spread": [BATCH / hi, BATCH / lo]}


def tier2_reads(repeat: int, progress=lambda frac, note="": None) -> dict:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from ..mooncake_local import MooncakeCluster

    rounds = repeat + 1  # the first round warms up, not counted
    work = tempfile.mkdtemp(dir="/dev/shm", prefix="maru-bench-tier2-")
    cluster = MooncakeCluster(work, segment=max(256 << 20, 2 * rounds * BATCH * (128 << 10)))
    made, t = [], {k: [] for k in ("tier_get", "local_get", "file_get", "tier_set", "local_set")}
    src = torch.arange(0, BATCH, dtype=torch.int64)
    dst = torch.arange(BATCH, 2 * BATCH, dtype=torch.int64)
    try:
        progress(0.0, "starting mooncake_master")
        cluster.start()

        def node(tag, tier=True):
            host = _host_pool(1, 2 * BATCH)
            tiered = {"maru_tier2": cluster.settings, "maru_tier2_retry_s": 0.2} if tier else {}
            extra = maru_extra(os.path.join(work, tag), 1 << 30, **tiered)
            b = StorageBackendFactory.create_backend("dynamic", _storage_config(extra), host)
            b.register_mem_pool_host(host)
            b.on_host_pools_registered()
            made.append(b)
            return host, b

        _, a = node("node-a")
        _, alone = node("node-alone", tier=False)
        host_b, b = node("node-b")
        for x in (a, b):
            deadline = time.monotonic() + 60
            while not x.tier2.attached:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second tier did not attach within 60 s")
                time.sleep(0.05)
        hfile = HiCacheFile(_storage_config({"file_storage_path": os.path.join(work, "file")}),
                            file_path=os.path.join(work, "file"))
        hfile.register_mem_pool_host(host_b)
        for rnd in range(rounds):
            progress(rnd / rounds, f"round {rnd + 1}/{rounds}")
            rows = _round(a, alone, b, hfile, host_b, src, dst, rnd)
            if rnd:
                for k, v in rows.items():
                    t[k].append(v)
        stats = b.get_stats().maru["tier2"]
    finally:
        for x in made:
            x.close()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {k: _rate(v) for k, v in t.items()}
    out.update(batch=BATCH, page_bytes=128 << 10, transport="tcp, loopback", tier2_stats=stats)
    out["tier_vs_local"] = out["local_get"]["seconds"] / out["tier_get"]["seconds"]
    out["tier_vs_file"] = out["file_get"]["seconds"] / out["tier_get"]["seconds"]
    out["local_vs_file"] = out["file_get"]["seconds"] / out["local_get"]["seconds"]
    out["write_through_cost"] = out["tier_set"]["seconds"] / out["local_set"]["seconds"]
    return out


def _round(a, alone, b, hfile, host_b, src, dst, rnd: int) -> dict:
    keys = _page_keys(f"tier2-{rnd}", BATCH)
    rows = {}
    t0 = time.perf_counter()
    ok = a.batch_set_v1(keys, src)
    rows["tier_set"] = time.perf_counter() - t0
    assert all(ok), "node A's write failed"
    t0 = time.perf_counter()
    ok = alone.batch_set_v1(_page_keys(f"alone-{rnd}", BATCH), src)
    rows["local_set"] = time.perf_counter() - t0
    assert all(ok)
    assert b.local_exists(keys) == 0
    t0 = time.perf_counter()
    ok = b.batch_get_v1(keys, dst)
    rows["tier_get"] = time.perf_counter() - t0
    assert all(ok), "node B's second-tier read failed"
    t0 = time.perf_counter()
    ok = b.batch_get_v1(keys, dst)
    rows["local_get"] = time.perf_counter() - t0
    assert all(ok) and b.local_exists(keys) == BATCH
    data = [host_b.get_data_page(int(i)) for i in src]
    assert hfile.batch_set(keys, data)
    t0 = time.perf_counter()
    got = hfile.batch_get(keys, [host_b.get_dummy_flat_data_page() for _ in range(BATCH)])
    for i in range(BATCH):
        host_b.set_from_flat_data_page(int(dst[i]), got[i])
    rows["file_get"] = time.perf_counter() - t0
    return rows
