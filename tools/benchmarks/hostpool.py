"""Data-path and lookup scenarios of `maru-shm bench`, on real SGLang host pools.

Each figure of MaruStorage is measured next to two peers in the same run:
  limit       torch copies of exactly the same K and V pieces between the same
              host pool and a /dev/shm mapping (index_select / index_copy_ of
              the pages, the fastest copy torch offers), and
  HiCacheFile SGLang's own file backend on /dev/shm, driven the way SGLang's
              cache controller drives a backend without interface_v1
              (get_data_page -> batch_set; batch_get -> set_from_flat_data_page).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import time

from maru_shm import remove_pool

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
FULL_POOL = 1 << 30  # the pool kept full for the steady-state set figure


def _page_keys(tag: str, n: int) -> list[str]:
    """Keys as SGLang makes them: hex SHA-256 page-chain hashes."""
    import hashlib
    out, prev = [], tag.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def _median(xs):
    return statistics.median(xs), min(xs), max(xs)


def _storage_config(extra: dict | None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="meta-llama/Llama-3.1-8B-Instruct", extra_config=extra)


def maru_extra(path: str, size, **maru) -> dict:
    """The extra config that makes SGLang's dynamic factory load MaruStorage on `path`, zero-copy."""
    return {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
            "interface_v1": 1, "maru_path": path, "maru_pool_size": size, **maru}


def _host_pool(page_size: int, pages: int, heads: int = 8, head_dim: int = 128, layers: int = 32):
    """A real host pool of `pages` pages; by default Llama-3.1-8B's KV geometry (128 KiB a token)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    dev = MHATokenToKVPool(size=16, page_size=page_size, dtype=torch.bfloat16, head_num=heads, head_dim=head_dim,
                           layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=layers - 1, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, "page_first_direct",
                                pin_memory=False, device="cpu", allocator_type="default", device_capacity_tokens=0,
                                host_token_capacity=(pages + 1) * page_size, start_layer=0, end_layer=layers - 1)
    raw = host.kv_buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(3)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return host


class _Limit:
    """Plain copies of the same K and V pieces between the host pool and a /dev/shm mapping.

    Two ways, both timed, the faster one is the limit: torch `copy_` of each
    piece (views over the host buffer and the mapping), and ctypes.memmove of
    each piece. No index, no locks, no validation: just the bytes.
    """

    def __init__(self, host, nbytes: int, span: int | None = None):
        """`nbytes`: one batch. `span` (default: two batches): the mapping. With a span as large as the
        pool, each store goes to the next batch-sized region (wrapping), as the pool's writes go to
        fresh blocks, so the destination is not still in the CPU caches from the round before."""
        import ctypes
        import torch
        self.host = host
        self.batch = nbytes
        nbytes = span or 2 * nbytes
        self.cursor = 0
        self.rotate = span is not None
        self.fd, self.path = tempfile.mkstemp(dir="/dev/shm", prefix="maru-bench-limit-")
        os.ftruncate(self.fd, nbytes)
        self.mm = mmap.mmap(self.fd, nbytes)
        try:
            self.mm.madvise(23)  # populate, as the pool is
        except OSError:
            pass
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.host_flat = host.kv_buffer.view(-1).view(torch.uint8)
        self.host_base = host.kv_buffer.data_ptr()
        self.memmove = ctypes.memmove

    def _advance(self):
        """Before a store: move to the next region when rotating (loads then read what it wrote)."""
        if self.rotate:
            self.cursor = (self.cursor + self.batch) % (len(self.mm) - len(self.mm) % self.batch)

    def _views(self, indices):
        ptrs, sizes = self.host.get_page_buffer_meta(indices)
        out, o = [], self.cursor
        for p, n in zip(ptrs, sizes):
            out.append((self.host_flat[p - self.host_base:p - self.host_base + n], self.buf[o:o + n], p, o, n))
            o += n
        return out

    def store_torch(self, indices):
        self._advance()
        for h, d, _, _, _ in self._views(indices):
            d.copy_(h)

    def load_torch(self, indices):
        for h, d, _, _, _ in self._views(indices):
            h.copy_(d)

    def store_memmove(self, indices):
        self._advance()
        ptrs, sizes = self.host.get_page_buffer_meta(indices)
        o = self.base + self.cursor
        for p, n in zip(ptrs, sizes):
            self.memmove(o, p, n)
            o += n

    def load_memmove(self, indices):
        ptrs, sizes = self.host.get_page_buffer_meta(indices)
        o = self.base + self.cursor
        for p, n in zip(ptrs, sizes):
            self.memmove(p, o, n)
            o += n

    def _all_core_plan(self):
        """One contiguous range of the host buffer and one of the mapping, the batch's size, cut into one
        slice per core (the all-core limit copies the same number of bytes, but in one run per core)."""
        if getattr(self, "_pool", None) is None:
            from concurrent.futures import ThreadPoolExecutor
            cores = len(os.sched_getaffinity(0))
            self._pool = ThreadPoolExecutor(max_workers=cores)
            step = -(-self.batch // cores)
            self._slices = [(o, min(step, self.batch - o)) for o in range(0, self.batch, step)]
        return self._slices

    def _all_cores(self, dst_base: int, src_base: int) -> None:
        memmove = self.memmove  # releases the GIL: the slices copy in parallel
        list(self._pool.map(lambda s: memmove(dst_base + s[0], src_base + s[0], s[1]), self._all_core_plan()))

    def store_all_cores(self, indices):
        self._all_core_plan()
        self._advance()
        self._all_cores(self.base + self.cursor, self.host_base)

    def load_all_cores(self, indices):
        self._all_core_plan()
        self._all_cores(self.host_base, self.base + self.cursor)

    def close(self):
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown()
        del self.buf, self.host_flat
        self.mm.close()
        os.close(self.fd)
        os.unlink(self.path)


class BusyCores:
    """One process per core spinning beside the benchmark while the context is open (SGLang's own threads
    and other servers on a GPU node: the copy engine must not fall below one thread then)."""

    def __enter__(self):
        import subprocess
        import sys
        n = len(os.sched_getaffinity(0))
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        time.sleep(0.5)  # they are running, and the copy engine's reading of idle cores has seen them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def datapath(page_size: int, repeat: int, pool: str | None = None) -> dict:
    """batch_set_v1 / batch_get_v1 of 128 pages vs the copy limit and HiCacheFile, on idle cores and again
    with one busy process per core."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = _host_pool(page_size, 2 * BATCH)
    page_bytes = host.get_size_per_token() * page_size
    src = torch.arange(0, BATCH * page_size, dtype=torch.int64)
    dst = torch.arange(BATCH * page_size, 2 * BATCH * page_size, dtype=torch.int64)
    pool = pool or f"/dev/shm/maru-bench-dp-{os.getpid()}"
    remove_pool(pool)
    # room for every round's pages without eviction: two backends, idle and busy, and slack
    pool_bytes = max(1 << 30, 5 * (repeat + 1) * BATCH * page_bytes)
    extra = maru_extra(pool, pool_bytes)
    maru = StorageBackendFactory.create_backend("dynamic", _storage_config(extra), host)
    maru.register_mem_pool_host(host)
    # the same pool through a second backend that copies on the calling thread alone (maru_copy_threads=1)
    one = StorageBackendFactory.create_backend("dynamic", _storage_config(dict(extra, maru_copy_threads=1)), host)
    one.register_mem_pool_host(host)
    # The steady state of a long-running server: a pool already full, where every batch evicts as many
    # pages as it writes (block CLOCK eviction within the page class).
    full_path = f"{pool}-full"
    full = StorageBackendFactory.create_backend(
        "dynamic", _storage_config(dict(extra, maru_path=full_path, maru_pool_size=FULL_POOL)), host)
    full.register_mem_pool_host(host)
    for b in range(FULL_POOL // (BATCH * page_bytes) + 2):
        assert all(full.batch_set_v1(_page_keys(f"fill-{page_size}-{b}", BATCH), src)), "filling the full pool"
    assert full.store.stats()["evictions"] > 0
    file_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="maru-bench-hicachefile-")
    hfile = HiCacheFile(_storage_config({"file_storage_path": file_dir}), file_path=file_dir)
    hfile.register_mem_pool_host(host)
    limit = _Limit(host, BATCH * page_bytes)
    caches = _ColdCaches()
    # the same copies with the destination rotating over a pool-sized mapping, as ours (fresh blocks)
    # (a span of 256 MiB or four batches is far beyond any CPU cache, and bounds the memory it takes)
    cold = _Limit(host, BATCH * page_bytes, span=min(pool_bytes, max(4 * BATCH * page_bytes, 256 << 20)))
    names = ("set", "set_full", "get", "one_set", "one_get", "limit_set", "limit_get", "torch_set", "torch_get",
             "memmove_set", "memmove_get", "cold_limit_set", "cold_limit_get", "all_core_limit_set",
             "all_core_limit_get", "file_set", "file_get")
    t = {k: [] for k in names}
    busy = {k: [] for k in names}
    try:
        engine, threaded = maru.store._engine, {}
        for phase, into in (("idle", t), ("busy", busy)):
            before = (engine.batches_threaded, engine.batches_alone)
            with (BusyCores() if phase == "busy" else contextlib.nullcontext()):
                for rep in range(repeat + 1):  # first round warms up, not counted
                    rows = _timed_round(maru, one, full, hfile, limit, cold, host, src, dst, page_size,
                                        f"{phase}-{rep}", caches, flip=bool(rep % 2))
                    if rep:
                        for name, dt in rows:
                            into[name].append(dt)
                        for op in ("set", "get"):
                            into[f"limit_{op}"].append(min(into[f"torch_{op}"][-1], into[f"memmove_{op}"][-1]))
            threaded[phase] = [engine.batches_threaded - before[0], engine.batches_alone - before[1]]
    finally:
        limit.close()
        cold.close()
        maru.close()
        one.close()
        full.close()
        shutil.rmtree(file_dir, ignore_errors=True)
        for path in (pool, full_path):
            remove_pool(path)
    out = _summary(t, page_size, page_bytes)
    out["busy"] = _summary(busy, page_size, page_bytes)
    out["engine_batches"] = threaded  # phase -> [threaded, alone], warm-up rounds included
    return out


class _ColdCaches:
    """Every timed operation starts with the CPU caches holding none of its bytes.

    Without it, an operation's figure depends on where it runs in the round: the first one after
    HiCacheFile's reads its source from memory, the next ones partly from the last-level cache that the
    one before filled with the same pages (a 16 MiB batch fits in it). Reading a buffer larger than the
    cache before each operation puts every contestant in the same place: a batch that a GPU copy just
    put in host memory, or pages written to the pool long ago. (Read, not written: dirty lines left in
    the cache would be written back during the next operation and charge it for our flush.)
    """

    SIZE = 96 << 20  # above the last-level cache of the largest server sockets (AMD EPYC: 32 MiB per CCD)

    def __init__(self):
        import numpy as np
        self.buf = np.ones(self.SIZE // 8, dtype=np.uint64)

    def timed(self, fn) -> float:
        self.buf.sum()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _timed_round(maru, one, full, hfile, limit, cold, host, src, dst, page_size: int, rep: str,
                 caches: _ColdCaches, flip: bool) -> list:
    """One round: ours (set, get, set into the full pool; set and get on one thread), the copy limits and
    HiCacheFile, back to back, each from cold caches; `flip` swaps which of ours goes first (the two
    share one pool)."""
    rows = []
    timed = caches.timed

    def check(ok, what):
        assert all(ok), what

    for name, backend in ((("one_", one), ("", maru)) if flip else (("", maru), ("one_", one))):
        keys = _page_keys(f"{page_size}-{rep}-{name}", BATCH)
        rows.append((f"{name}set", timed(lambda: check(backend.batch_set_v1(keys, src), "batch_set_v1 failed"))))
        rows.append((f"{name}get", timed(lambda: check(backend.batch_get_v1(keys, dst), "batch_get_v1 failed"))))
    full_keys = _page_keys(f"{page_size}-{rep}-full", BATCH)
    rows.append(("set_full", timed(lambda: check(full.batch_set_v1(full_keys, src),
                                                 "batch_set_v1 into the full pool failed"))))
    for way in ("torch", "memmove"):
        rows.append((f"{way}_set", timed(lambda: getattr(limit, f"store_{way}")(src))))
        rows.append((f"{way}_get", timed(lambda: getattr(limit, f"load_{way}")(dst))))
    rows.append(("all_core_limit_set", timed(lambda: cold.store_all_cores(src))))
    rows.append(("all_core_limit_get", timed(lambda: cold.load_all_cores(dst))))
    rows.append(("cold_limit_set", timed(lambda: cold.store_memmove(src))))
    rows.append(("cold_limit_get", timed(lambda: cold.load_memmove(dst))))
    keys = _page_keys(f"{page_size}-{rep}", BATCH)

    def file_set():
        data = [host.get_data_page(int(src[i * page_size])) for i in range(BATCH)]
        assert hfile.batch_set(keys, data)

    def file_get():
        dummy = [host.get_dummy_flat_data_page() for _ in range(BATCH)]
        got = hfile.batch_get(keys, dummy)
        for i in range(BATCH):
            host.set_from_flat_data_page(int(dst[i * page_size]), got[i])
    rows.append(("file_set", timed(file_set)))
    rows.append(("file_get", timed(file_get)))
    return rows


def _summary(t: dict, page_size: int, page_bytes: int) -> dict:
    """Medians, spreads and the ratios the report prints, from the per-round times `t`."""
    nbytes = BATCH * page_bytes
    out = {"page_size": page_size, "page_bytes": page_bytes, "batch": BATCH}
    for name, xs in t.items():
        med, lo, hi = _median(xs)
        out[name] = {"seconds": med, "gbps": nbytes / med / 1e9, "pages_per_s": BATCH / med,
                     "spread_gbps": [nbytes / hi / 1e9, nbytes / lo / 1e9]}
    out["set_full_vs_limit"] = out["limit_set"]["seconds"] / out["set_full"]["seconds"]
    out["set_full_vs_cold_limit"] = out["cold_limit_set"]["seconds"] / out["set_full"]["seconds"]
    out["set_full_vs_all_core"] = out["all_core_limit_set"]["seconds"] / out["set_full"]["seconds"]
    for op in ("set", "get"):
        out[f"{op}_vs_limit"] = out[f"limit_{op}"]["seconds"] / out[op]["seconds"]
        out[f"{op}_vs_cold_limit"] = out[f"cold_limit_{op}"]["seconds"] / out[op]["seconds"]
        out[f"{op}_vs_file"] = out[f"file_{op}"]["seconds"] / out[op]["seconds"]
        out[f"{op}_vs_all_core"] = out[f"all_core_limit_{op}"]["seconds"] / out[op]["seconds"]
        out[f"{op}_vs_one_thread"] = out[f"one_{op}"]["seconds"] / out[op]["seconds"]
    # Per-round ratios: each round times ours and the limit back to back, so a slow phase of a shared
    # machine slows both; the median of these pairs moves less between runs than the ratio of medians.
    for name, ours, peer in (("set_vs_cold_limit", "set", "cold_limit_set"), ("get_vs_cold_limit", "get", "cold_limit_get"),
                             ("set_full_vs_cold_limit", "set_full", "cold_limit_set")):
        pairs = [p / o for p, o in zip(t[peer], t[ours])]
        med, lo, hi = _median(pairs)
        out[f"{name}_paired"] = {"median": med, "spread": [lo, hi]}
    return out


def lookup(repeat: int, pool: str | None = None) -> dict:
    """batch_exists of 128 keys (all hits; first-key miss) vs HiCacheFile."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = _host_pool(1, BATCH)
    src = __import__("torch").arange(0, BATCH, dtype=__import__("torch").int64)
    pool = pool or f"/dev/shm/maru-bench-lookup-{os.getpid()}"
    remove_pool(pool)
    maru = StorageBackendFactory.create_backend("dynamic", _storage_config(maru_extra(pool, "256M")), host)
    maru.register_mem_pool_host(host)
    file_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="maru-bench-hicachefile-")
    hfile = HiCacheFile(_storage_config({"file_storage_path": file_dir}), file_path=file_dir)
    keys = _page_keys("lookup", BATCH)
    miss_first = _page_keys("absent", 1) + keys[1:]
    try:
        assert all(maru.batch_set_v1(keys, src))
        assert hfile.batch_set(keys, [host.get_data_page(i) for i in range(BATCH)])
        res = {}
        for label, ks, want in (("all_hits", keys, BATCH), ("first_miss", miss_first, 0)):
            for name, backend in (("maru", maru), ("file", hfile)):
                xs = []
                for _ in range(repeat * 20):
                    t0 = time.perf_counter()
                    n = backend.batch_exists(ks)
                    xs.append(time.perf_counter() - t0)
                    assert n == want, (name, label, n)
                res[f"{label}_{name}"] = statistics.median(xs)
                res[f"{label}_{name}_spread"] = [min(xs), max(xs)]
            res[f"{label}_ratio"] = res[f"{label}_file"] / res[f"{label}_maru"]
        return res
    finally:
        maru.close()
        shutil.rmtree(file_dir, ignore_errors=True)
        remove_pool(pool)
