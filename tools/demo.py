"""P2P sharing without a GPU: two SGLang instances, one maru_shm pool (the README's main job).

Instance 1 (its own process and real SGLang host pool) stores a prompt's KV
pages through MaruStorage.batch_set_v1. Instance 2 (another process, another
host pool) finds them with batch_exists and loads them with batch_get_v1, then
checks every byte. Instances with another TP rank, model or KV dtype look the
same keys up and must see none of them.

    python -m tools.demo [--pool /dev/shm/maru_shm_demo] [--pages 512] [--page-size 1]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import time

GEOMETRY = dict(layer_num=32, head_num=8, head_dim=128)  # Llama-3.1-8B


def extra_config(pool: str, size: str) -> dict:
    return {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
            "interface_v1": 1, "maru_path": pool, "maru_pool_size": size}


def make_instance(pool: str, size: str, *, pages: int, page_size: int, tp_rank: int = 0, tp_size: int = 1,
                  model: str = "meta-llama/Llama-3.1-8B-Instruct", dtype: str = "bfloat16"):
    """A real SGLang MHA host pool (CPU) and a MaruStorage made by SGLang's own backend factory."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    torch_dtype = getattr(torch, dtype)
    tokens = pages * page_size
    device_pool = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=torch_dtype, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=GEOMETRY["layer_num"] - 1,
                                   enable_alt_stream=False, **GEOMETRY)
    host = MHATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size,
                                "page_first_direct", pin_memory=False, device="cpu", allocator_type="default",
                                device_capacity_tokens=0, host_token_capacity=tokens + page_size,
                                start_layer=0, end_layer=GEOMETRY["layer_num"] - 1)
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=False, model_name=model, extra_config=extra_config(pool, size))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return host, backend


def prompt_keys(n: int) -> list[str]:
    """Page-chain hashes like SGLang's: each key hashes the previous one."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"token-page-{i}".encode()).digest()
        keys.append(prev.hex())
    return keys


def page_digests(host, indices) -> list[str]:
    """SHA-256 of each page's bytes, gathered from the host pool's own piece pointers."""
    import ctypes
    ptrs, sizes = host.get_page_buffer_meta(indices)
    per = len(ptrs) // (len(indices) // host.page_size)
    out = []
    for i in range(0, len(ptrs), per):
        h = hashlib.sha256()
        for p, n in zip(ptrs[i:i + per], sizes[i:i + per]):
            h.update(ctypes.string_at(p, n))
        out.append(h.hexdigest())
    return out


def writer(pool, size, pages, page_size, q):
    import torch
    host, backend = make_instance(pool, size, pages=pages, page_size=page_size)
    idx = host.alloc(pages * page_size)
    g = torch.Generator().manual_seed(1)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    keys = prompt_keys(pages)
    t = time.perf_counter()
    ok = 0
    for s in range(0, pages, 128):
        ok += sum(backend.batch_set_v1(keys[s:s + 128], idx[s * page_size:(s + 128) * page_size]))
    dt = time.perf_counter() - t
    q.put({"stored": ok, "seconds": dt, "bytes": ok * backend.page_bytes, "digests": page_digests(host, idx),
           "page_bytes": backend.page_bytes})
    backend.close()


def reader(pool, size, pages, page_size, q):
    host, backend = make_instance(pool, size, pages=pages, page_size=page_size)
    idx = host.alloc(pages * page_size)
    keys = prompt_keys(pages)
    hits = 0
    for s in range(0, pages, 128):
        n = backend.batch_exists(keys[s:s + 128])
        hits += n
        if n < len(keys[s:s + 128]):
            break
    t = time.perf_counter()
    loaded = 0
    for s in range(0, hits, 128):
        batch = keys[s:min(s + 128, hits)]
        loaded += sum(backend.batch_get_v1(batch, idx[s * page_size:(s + len(batch)) * page_size]))
    dt = time.perf_counter() - t
    q.put({"hits": hits, "loaded": loaded, "seconds": dt, "digests": page_digests(host, idx[:hits * page_size])})
    strangers = {}
    for label, kw in (("tp_rank=1 of 2", dict(tp_rank=1, tp_size=2)), ("another model", dict(model="Qwen/Qwen2.5-7B")),
                      ("fp16 KV", dict(dtype="float16"))):
        _, other = make_instance(pool, size, pages=1, page_size=page_size, **kw)
        strangers[label] = other.batch_exists(keys[:128])
        other.close()
    q.put({"strangers": strangers})
    backend.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="/dev/shm/maru_shm_demo")
    ap.add_argument("--size", default="512M")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the pool file afterwards")
    a = ap.parse_args(argv)
    if os.path.exists(a.pool):
        os.unlink(a.pool)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    print(f"pool {a.pool} ({a.size}); Llama-3.1-8B KV geometry, page_size {a.page_size}, {a.pages} pages")
    w = ctx.Process(target=writer, args=(a.pool, a.size, a.pages, a.page_size, q))
    w.start()
    wres = q.get(timeout=600)
    w.join()
    print(f"instance 1 (pid {w.pid}): stored {wres['stored']}/{a.pages} pages of {wres['page_bytes']} B "
          f"in {wres['seconds'] * 1e3:.1f} ms ({wres['bytes'] / wres['seconds'] / 1e9:.2f} GB/s)")
    r = ctx.Process(target=reader, args=(a.pool, a.size, a.pages, a.page_size, q))
    r.start()
    rres = q.get(timeout=600)
    sres = q.get(timeout=600)
    r.join()
    same = sum(x == y for x, y in zip(wres["digests"], rres["digests"]))
    gbps = rres["loaded"] * wres["page_bytes"] / max(rres["seconds"], 1e-9) / 1e9
    print(f"instance 2 (pid {r.pid}): batch_exists hits {rres['hits']}/{a.pages}, loaded {rres['loaded']} pages "
          f"in {rres['seconds'] * 1e3:.1f} ms ({gbps:.2f} GB/s), byte-identical {same}/{rres['loaded']}")
    for label, n in sres["strangers"].items():
        print(f"  instance with {label}: sees {n} of those pages")
    from maru_shm import Store, format_size
    with Store.open(a.pool) as s:
        st = s.stats()
        chk = s.check()
    print(f"pool: {st['entries']} entries, {format_size(st['live_bytes'])} live in a {format_size(st['file_bytes'])} "
          f"file ({st['utilization']:.1%}), {st['evictions']} evictions, check {'clean' if chk.ok else chk.problems}")
    if not a.keep:
        os.unlink(a.pool)
    ok = (wres["stored"] == a.pages and rres["hits"] == a.pages and same == a.pages and chk.ok
          and not any(sres["strangers"].values()))
    print("P2P sharing: OK" if ok else "P2P sharing: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
