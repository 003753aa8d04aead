"""SGLang 0.5.23's own HiCache storage stack on CPU, driving MaruStorage, for the backend's tests.

Built as a scheduler builds it: a real ServerArgs (device cpu, hierarchical cache, storage backend
`dynamic` with its extra config as a JSON string, layout page_first_direct, io backend direct) over a
model directory holding only a tiny Llama config.json, published as SGLang's runtime context; a CPU
MHATokenToKVPool and its paged allocator; then SGLang's own assembler, build_kv_only_stack, makes the
host pool group and the HybridCacheController, whose attach_storage_backend creates MaruStorage through
the `dynamic` factory and picks the page get/set functions itself. Its backup, prefetch, io and sync
threads are SGLang's, unchanged.

Patched, because they need CUDA and are not storage code:
- pool_host.common._cuda_host_register: registers the host pool's memory with the CUDA driver (page
  locking for DMA); without a GPU it is a no-op.
- the host pool's pin_memory: the legacy (flat page) get path allocates its dummy page with
  pin_memory=self.pin_memory, which asks the CUDA driver for page-locked memory; False on CPU.
- the torch.distributed groups (tp/attn/pp): none exist in one process; the controller's all-reduce
  over an empty group list is a no-op, and the ranks a scheduler would publish are stated with
  get_parallel().override (SGLang's own injection primitive).

Not built: UnifiedRadixCache, because importing it pulls SGLang's OpenAI server protocol (the `openai`
package, through managers.schedule_batch), which a storage test has no use for. So the two calls its
scheduler thread makes between the controller's threads are made here, with the controller's own
methods (`Scheduler.prefetch`): take the hit from prefetch_hit_queue, apply the prefetch threshold,
allocate host pages with allocate_storage_hit, hand the operation to the io thread through
prefetch_buffer, and drain ack_prefetch_queue until the request completes. The device <-> host copy
kernels (sgl_kernel) are missing on CPU, so pages to back up are taken from the host allocator that
write() uses and filled directly.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time

PAGE_SIZE = 16  # tokens per page (the tests'; the main job uses 1, as SGLang serves Llama)


class Geometry:
    """A Llama KV geometry: what a model's config.json says and the device KV pool is built with."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, name: str):
        self.layers, self.kv_heads, self.head_dim, self.name = layers, kv_heads, head_dim, name

    def config(self) -> dict:
        heads = max(self.kv_heads, 2)
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * self.head_dim,
                "intermediate_size": 2 * heads * self.head_dim, "num_attention_heads": heads,
                "num_key_value_heads": self.kv_heads, "num_hidden_layers": self.layers, "vocab_size": 1000,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
                "head_dim": self.head_dim}


TINY = Geometry(layers=2, kv_heads=2, head_dim=64, name="tiny-llama")
LLAMA_8B = Geometry(layers=32, kv_heads=8, head_dim=128, name="meta-llama/Llama-3.1-8B-Instruct")


def model_dir(root: str, geometry: Geometry = TINY) -> str:
    """A model directory SGLang's config loader accepts: its config.json and no weights."""
    path = os.path.join(root, geometry.name.replace("/", "--"))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(geometry.config(), f)
    return path


def extra_config(pool: str, *, v1: bool, size: str = "128M", page_size: int = PAGE_SIZE) -> dict:
    cfg = {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
           "maru_path": pool, "maru_pool_size": size,
           "prefetch_threshold": page_size}  # SGLang strips this before the backend sees the config
    if v1:
        cfg["interface_v1"] = 1
    return cfg


class Stack:
    """One SGLang process's storage stack: the controller, its host pool group, its storage backend."""

    def __init__(self, pool: str, models: str, *, v1: bool, tokens: int = PAGE_SIZE * 64, page_size: int = PAGE_SIZE,
                 geometry: Geometry = TINY, size: str = "128M", dtype: str = "bfloat16", tp: tuple = (0, 1),
                 swa_layers: int = 0):
        """swa_layers > 0: a hybrid sliding-window model (the last swa_layers layers SWA), built by SGLang's
        build_hybrid_swa_stack, whose SWA host pool reaches MaruStorage through register_mem_host_pool_v2."""
        import torch
        from sglang.srt import runtime_context
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.pool_host import common as pool_host_common
        from sglang.srt.server_args import ServerArgs

        pool_host_common._cuda_host_register = lambda *args, **kwargs: None  # CUDA page locking (see above)
        self.page_size = page_size
        self.server_args = ServerArgs(
            model_path=model_dir(models, geometry), device="cpu", enable_hierarchical_cache=True,
            page_size=page_size, hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(
                extra_config(pool, v1=v1, size=size, page_size=page_size)), hicache_mem_layout="page_first_direct",
            hicache_io_backend="direct", hicache_size=1, skip_tokenizer_init=True)
        runtime_context.publish(self.server_args, role="scheduler")
        self._ranks = runtime_context.get_parallel().override(
            tp_rank=tp[0], tp_size=tp[1], attn_tp_rank=tp[0], attn_tp_size=tp[1], attn_cp_rank=0, attn_cp_size=1,
            moe_tp_rank=tp[0], moe_tp_size=tp[1], pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1)
        self._ranks.__enter__()
        extra, self.prefetch_threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
            self.server_args.hicache_storage_backend_extra_config)
        common = dict(load_cache_event=threading.Event(), storage_backend=self.server_args.hicache_storage_backend,
                      use_mla=False, prefetch_threshold=self.prefetch_threshold, model_name=geometry.name,
                      storage_backend_extra_config=extra, enable_storage_metrics=True)
        build = self._build_swa if swa_layers else self._build_kv_only
        self.group, self.ctrl = build(tokens, page_size, geometry, getattr(torch, dtype), swa_layers, common)
        self.backend = self.ctrl.storage_backend
        self.host = self.group.anchor_entry.host_pool
        self.host.pin_memory = False  # the legacy path's dummy flat page asks CUDA for pinned memory (see above)

    @staticmethod
    def _params(allocator, page_size: int, components):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        return CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=8192, device="cpu", enable_memory_saver=False),
            token_to_kv_pool_allocator=allocator, page_size=page_size, tree_components=components)

    def _build_kv_only(self, tokens, page_size, geometry, dtype, _, common):
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        kv = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=geometry.kv_heads,
                              head_dim=geometry.head_dim, layer_num=geometry.layers, device="cpu",
                              enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", kv, need_sort=False)
        return build_kv_only_stack(params=self._params(allocator, page_size, (ComponentType.FULL,)), kv_pool=kv,
                                   full_layer_mapping={i: i for i in range(kv.layer_num)}, **common)

    def _build_swa(self, tokens, page_size, geometry, dtype, swa_layers, common):
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (_swa_layer_mappings,
                                                                             build_hybrid_swa_stack)
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        full_ids = list(range(geometry.layers - swa_layers))
        kv = SWAKVPool(size=tokens, size_swa=tokens, page_size=page_size, dtype=dtype, head_num=geometry.kv_heads,
                       head_dim=geometry.head_dim, swa_attention_layer_ids=list(range(len(full_ids), geometry.layers)),
                       full_attention_layer_ids=full_ids, device="cpu", enable_memory_saver=False)
        allocator = SWATokenToKVPoolAllocator(tokens, tokens, page_size, dtype, "cpu", kv, need_sort=False)
        full_map, swa_map = _swa_layer_mappings(kv)
        params = self._params(allocator, page_size, (ComponentType.FULL, ComponentType.SWA))
        return build_hybrid_swa_stack(params=params, full_kv_pool=kv.full_kv_pool, swa_kv_pool=kv.swa_kv_pool,
                                      full_layer_mapping=full_map, swa_layer_mapping=swa_map,
                                      host_full_evict_fn=lambda n: 0, host_swa_evict_fn=lambda n: 0,
                                      device_swa_evict_fn=lambda n: 0, **common)

    # ------------------------------------------------------------------ host pages
    def alloc(self, n_tokens: int):
        return self.group.alloc(n_tokens)

    def fill(self, host_indices, seed: int, pool=None) -> None:
        """Random bytes in the host pages `host_indices` (what a device -> host write would leave there)."""
        import torch
        gen = torch.Generator().manual_seed(seed)
        for addr, size in zip(*(pool or self.host).get_page_buffer_meta(host_indices)):
            data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
            ctypes.memmove(addr, data.data_ptr(), size)

    def page_digests(self, host_indices) -> list[str]:
        """SHA-256 of every page's bytes, in the pool's own piece order."""
        ptrs, sizes = self.host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // (len(host_indices) // self.page_size)
        out = []
        for i in range(0, len(ptrs), per):
            h = hashlib.sha256()
            for p, n in zip(ptrs[i:i + per], sizes[i:i + per]):
                h.update(ctypes.string_at(p, n))
            out.append(h.hexdigest())
        return out

    # ------------------------------------------------------------------ the controller's storage paths
    def backup(self, host_indices, tokens: list[int], last_hash: str | None = None,
               swa_pages: int = 0) -> tuple[list[str], int]:
        """write_storage -> backup thread -> MaruStorage; (page hashes, tokens the ack reports stored).

        swa_pages > 0 (a hybrid SWA stack): also the SWA window of the last swa_pages pages, described as
        SGLang's SWA component describes it for a storage backup (keys of the node's trailing pages,
        TRAILING_PAGES), from SWA host pages filled like the KV ones.
        """
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        hashes = get_storage_hash_str(tokens, last_hash, page_size=self.page_size)  # what the radix tree computes
        extra = None
        if swa_pages:
            from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
            swa_idx = self.group.alloc(swa_pages * self.page_size, pool=PoolName.SWA)
            self.fill(swa_idx, seed=len(tokens), pool=self.group.get_pool(PoolName.SWA))
            extra = [PoolTransfer(name=PoolName.SWA, host_indices=swa_idx, keys=hashes[-swa_pages:],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        op_id = self.ctrl.write_storage(host_indices, tokens, hash_value=hashes, extra_pools=extra)
        op = self.ctrl.ack_backup_queue.get(timeout=60)
        assert op.id == op_id
        return hashes, op.completed_tokens

    def hit_query(self, rid: str, tokens: list[int], swa_pages: int = 0) -> tuple[int, dict]:
        """submit_prefetch -> the prefetch thread's hit query only: (hit tokens, each pool's verdict in pages).
        swa_pages > 0: with the SWA transfer SGLang's SWA component plans for a prefetch (placeholder keys,
        TRAILING_PAGES), so the hit is what batch_exists_v2 finds restorable in every pool."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.radix_cache import RadixKey
        transfers = [PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * swa_pages,
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)] if swa_pages else None
        self.ctrl.submit_prefetch(CacheRequestHandle(rid, 0), RadixKey(tokens), None, None, [], transfers)
        op = self.ctrl.prefetch_hit_queue.get(timeout=60)
        return op.storage_hit_count, {str(getattr(k, "value", k)): v for k, v in op.query_pool_hit_pages.items()}

    def prefetch(self, rid: str, tokens: list[int], last_hash: str | None = None):
        """submit_prefetch -> hit query (prefetch thread) -> [scheduler: threshold, host pages] -> io thread ->
        sync thread -> acks. Returns (hit tokens, tokens loaded, host indices)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.radix_cache import RadixKey
        ctrl = self.ctrl
        ctrl.submit_prefetch(CacheRequestHandle(rid, 0), RadixKey(tokens), last_hash, None, [], None)
        op = ctrl.prefetch_hit_queue.get(timeout=60)
        hit = op.storage_hit_count
        if op.is_terminated() or hit < self.prefetch_threshold:
            return hit, 0, None  # a miss, or below the threshold: the scheduler revokes it
        host_indices, _ = ctrl.allocate_storage_hit(op, hit, allow_partial=True, min_tokens=self.prefetch_threshold,
                                                    evict_host=lambda n: 0)
        op.host_indices = host_indices
        ctrl.prefetch_buffer.put(op)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ack = ctrl.ack_prefetch_queue.get(timeout=60)
            if ack.operation is not op:
                continue
            if ack.completed_tokens is not None:
                op.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                return hit, op.completed_tokens, host_indices
        raise TimeoutError(f"prefetch {rid} never completed")

    def metrics(self) -> dict:
        """The backend's get_stats() through SGLang's StorageMetricsCollector, read back from its registry."""
        from prometheus_client import REGISTRY
        from sglang.srt.observability.metrics_collector import StorageMetricsCollector
        labels = {"storage_backend": "maru", "pid": str(os.getpid())}
        global _COLLECTOR
        if _COLLECTOR is None:
            _COLLECTOR = StorageMetricsCollector(labels)
        _COLLECTOR.log_storage_metrics(self.backend.get_stats())
        value = lambda name: REGISTRY.get_sample_value(name, _COLLECTOR.labels) or 0.0  # noqa: E731
        return {f"{kind}_{what}_{part}": value(f"sglang:{kind}_{what}_{part}") for kind in ("prefetch", "backup")
                for what in ("pgs", "bandwidth") for part in ("count", "sum")}

    def close(self) -> None:
        self.ctrl.storage_stop_event.set()
        self.backend.close()


_COLLECTOR = None


def tokens_of(first: int, pages: int, page_size: int = PAGE_SIZE) -> list[int]:
    return list(range(first, first + pages * page_size))
