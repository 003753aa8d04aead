"""Hybrid scenario of `maru-shm bench`: DeepSeek-V4-like pages of several sizes through MaruStorage's v2 path.

One request of a DeepSeek-V4-like model stores, per 256-token FULL page, a page
in every compressed KV pool (ratios 1, 2, 4 and 128: 256, 128, 64 and 2 rows of
584 bytes per layer, padded by SGLang to 576-byte multiples), a page of the c4
indexer, an empty KV marker (the logical anchor), and at the end of the request
one sliding-window page. Page sizes therefore differ by 2x to 87x within one
request: the mixed-size case the exact-fit size classes are for.

Everything goes through the real code: SGLang's own host pools
(DeepSeekV4PagedHostPool over DeepSeekV4SingleKVPool / DeepSeekV4IndexerPool,
LogicalHostPool as the KV anchor, all on CPU) and MaruStorage made by SGLang's
backend factory, registered like HybridCacheController does, written with
batch_set_v1 (KV markers) and batch_set_v2 (one PoolTransfer per pool).
Requests are written until CHURN x the pool size has gone in; the figures are
the share of the file holding live payload (lowest value over the second half of
the churn) and the share holding payload still usable as hits (mean over the
second half: whole restorable requests, as batch_exists_v2 answers), next to
fixed slots of the largest page and power-of-two classes (>= 4 KiB) simulated
on the same sequence of values.
"""

from __future__ import annotations

import os
import random

from maru_shm import remove_pool

from .hostpool import maru_extra
from .registry import figure, scenario

PAGE = 256  # tokens per FULL page (DeepSeek-V4 serves with page_size 256)
SWA_PAGE = 128
LAYERS = 12  # per compressed pool: equal counts, so page sizes differ by the compression ratio
HOST_PAGES = 32  # longest request, in FULL pages
CHURN = 6  # bytes written, in pool sizes; the figures are taken over the second half
RATIOS = {"deepseek_v4_c1": 1, "deepseek_v4_c2": 2, "deepseek_v4_c4": 4, "deepseek_v4_c128": 128}


def _v4_pool(name: str, rows: int, slot_page: int, pages: int, layers: int = LAYERS):
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    dev = DeepSeekV4SingleKVPool(size=rows * 2, page_size=rows, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448,
                                 qk_rope_head_dim=64, layer_num=layers, device="cpu", enable_memory_saver=False)
    return DeepSeekV4PagedHostPool(pool_name=name, device_buffers=dev.kv_buffer, item_bytes=dev.bytes_per_page_padded,
                                   num_host_pages=pages, slot_page_size=slot_page, layout="page_first_direct",
                                   device="cpu", pin_memory=False)


def _indexer_pool(pages: int, layers: int = LAYERS):
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    rows = PAGE // 4
    dev = DeepSeekV4IndexerPool(size=rows * 2, page_size=rows, dtype=torch.bfloat16, index_head_dim=128,
                                layer_num=layers, device="cpu", enable_memory_saver=False, use_fp4_indexer=False)
    bufs = dev.index_k_with_scale_buffer
    return DeepSeekV4PagedHostPool(pool_name="deepseek_v4_c4_indexer", device_buffers=bufs,
                                   item_bytes=bufs[0].shape[1] * bufs[0].element_size(), num_host_pages=pages,
                                   slot_page_size=PAGE, layout="page_first_direct", device="cpu", pin_memory=False)


def _fill(host, pages: int, rnd: random.Random) -> None:
    import ctypes

    import torch
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(pages * host.page_size, dtype=torch.int64))
    for p, n in zip(ptrs, sizes):
        ctypes.memmove(p, rnd.randbytes(n), n)


def _simulate_slots(items, capacity, slot_of, sample_at=()) -> tuple[float, float]:
    """FIFO cache whose values occupy slot_of(size) bytes: (live payload at the end, payload of whole requests
    averaged over the points `sample_at` (item counts; the end if none)) / capacity.

    items: (request number, size) in write order. A request is usable only while all its values are present
    (the KV markers go first, so a request FIFO has started to evict is never a hit any more).
    """
    from collections import deque
    live, used, q = 0, 0, deque()
    missing: dict[int, int] = {}
    points, whole = set(sample_at) or {len(items)}, []
    for k, (req, sz) in enumerate(items, 1):
        occ = slot_of(sz)
        q.append((req, sz, occ))
        live += sz
        used += occ
        while used > capacity:
            r0, s0, o0 = q.popleft()
            live -= s0
            used -= o0
            missing[r0] = missing.get(r0, 0) + 1
        if k in points:
            whole.append(sum(sz for r, sz, _ in q if r not in missing))
    return live / capacity, sum(whole) / len(whole) / capacity


def _usable(backend, chains, query, page_bytes: dict) -> int:
    """Payload SGLang can still use: the pages of each request's restorable prefix (an orphan page, whose KV
    marker or sibling pages were evicted, is live payload but never a hit)."""
    per_page = sum(b for name, b in page_bytes.items() if name != "swa")
    total = 0
    for c in chains:
        r = backend.batch_exists_v2(c, query)
        total += r.kv_hit_pages * per_page + (page_bytes["swa"] if r.kv_hit_pages else 0)
    return total


def hybrid(pool_size: int, seed: int = 7, path: str | None = None) -> dict:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    rnd = random.Random(seed)
    anchor = LogicalHostPool(HOST_PAGES * PAGE, PAGE, layout="page_first_direct")
    pools = {name: _v4_pool(name, PAGE // r, PAGE, HOST_PAGES) for name, r in RATIOS.items()}
    pools["deepseek_v4_c4_indexer"] = _indexer_pool(HOST_PAGES)
    pools["swa"] = _v4_pool("swa", SWA_PAGE, SWA_PAGE, 2)
    for name, host in pools.items():
        _fill(host, HOST_PAGES if name != "swa" else 2, rnd)

    path = path or os.path.join("/dev/shm", f"maru-bench-{os.getpid()}-hybrid")
    extra = maru_extra(path, int(pool_size), maru_eager_map=False)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="deepseek-ai/DeepSeek-V4-like", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, anchor)
    try:
        backend.register_mem_pool_host(anchor)  # as HybridCacheController.attach_storage_backend
        backend.register_mem_host_pool_v2(anchor, PoolName.KV)
        for name, host in pools.items():
            backend.register_mem_host_pool_v2(host, PoolName(name))
        backend.on_host_pools_registered()
        page_bytes = {name: backend.hybrid.pools[name].page_bytes for name in pools}
        store = backend.store
        sizes: list[int] = []  # every value written, in order, for the simulated peers
        written = requests = failed = 0
        samples, usable, sample_at = [], [], []
        chains = []
        q = [PoolTransfer(name=PoolName(name)) for name in pools if name != "swa"]
        q.append(PoolTransfer(name=PoolName.SWA, keys=["w"], hit_policy=PoolHitPolicy.TRAILING_PAGES))
        while written < CHURN * pool_size:
            n = rnd.randint(4, HOST_PAGES)
            keys = [os.urandom(32).hex() for _ in range(n)]
            chains.append(keys)
            kv_idx = torch.arange(n * PAGE, dtype=torch.int64)
            failed += n - sum(backend.batch_set_v1(keys, kv_idx))
            sizes += [(requests, 0)] * n
            transfers = [PoolTransfer(name=PoolName(name), keys=keys, host_indices=kv_idx,
                                      indices_from_pool=PoolName.KV) for name in pools if name != "swa"]
            transfers.append(PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES,
                                          host_indices=torch.arange(SWA_PAGE, dtype=torch.int64)))
            res = backend.batch_set_v2(transfers)
            failed += sum(len(v) - sum(v) for v in res.values())  # only a request larger than the pool fails
            for t in transfers:
                sizes += [(requests, page_bytes[str(t.name)])] * len(t.keys)
                written += page_bytes[str(t.name)] * len(t.keys)
            requests += 1
            if written > CHURN / 2 * pool_size:
                samples.append(store.stats()["utilization"])
                usable.append(_usable(backend, chains, q, page_bytes))
                sample_at.append(len(sizes))
        st = store.stats()
        assert store.check().ok
        # the whole chain of the last request is still a hit: markers, every pool, the SWA window
        last = backend.batch_exists_v2(keys, q)
    finally:
        backend.close()
        remove_pool(path)
    largest = max(page_bytes.values())
    fixed, fixed_usable = _simulate_slots(sizes, pool_size, lambda b: largest, sample_at)
    pow2, pow2_usable = _simulate_slots(sizes, pool_size, lambda b: max(4096, 1 << max(b - 1, 0).bit_length()),
                                        sample_at)
    chunk = 1 << 20  # Maru: a value takes whole fixed 1 MiB chunks (an empty marker still one chunk)
    maru_1m, maru_1m_usable = _simulate_slots(sizes, pool_size, lambda b: max(1, -(-b // chunk)) * chunk,
                                              sample_at)
    ours = min(samples + [st["utilization"]])
    small = min(page_bytes.values())
    return {"pool_bytes": pool_size, "churn": CHURN, "written_bytes": written, "requests": requests, "pages": len(sizes),
            "page_bytes": page_bytes, "size_spread": largest / small, "ours": ours, "ours_final": st["utilization"],
            "fixed_slots": fixed, "fixed_slot_bytes": largest, "pow2_classes": pow2, "goal": 0.90,
            "fixed_slots_usable": fixed_usable, "pow2_classes_usable": pow2_usable,
            "maru_1m": maru_1m, "maru_1m_usable": maru_1m_usable,
            "live_mean": sum(samples) / len(samples), "met": ours >= 0.90, "usable": sum(usable) / len(usable) / st["file_bytes"],
            "evictions": st["evictions"], "slab_moves": st["slab_moves"], "put_failures": failed,
            "last_request_hit_pages": [last.kv_hit_pages, n]}


NAME = "hybrid"


@scenario(NAME)
def bench_hybrid(args) -> dict:
    r = hybrid(args.pool_size)
    name = "live payload / file (min over churn)"
    figs = [figure(name, r["ours"], r["fixed_slots"], f"fixed {r['fixed_slot_bytes']} B slots", goal=">= 0.90",
                   met=r["met"]),
            figure(name, r["ours"], r["pow2_classes"], "power-of-two classes")]
    if "maru_1m" in r:
        figs.append(figure(name, r["ours"], r["maru_1m"], "Maru fixed 1 MiB chunks"))
    usable = "usable payload / file (whole restorable requests, mean over the churn)"
    figs.append(figure(usable, r["usable"], r["pow2_classes_usable"], "power-of-two classes (FIFO)",
                       goal=">= 0.90", met=r["usable"] >= 0.90))
    return {"scenario": "hybrid", **r, "figures": figs}
