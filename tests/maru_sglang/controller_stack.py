"""SGLang 0.5.23's own HiCache storage stack on CPU, driving MaruStorage: for tests and the main job.

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
import sys
import threading
import time

PAGE_SIZE = 16  # tokens per page
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
         "head_dim": 64}


def model_dir(root: str) -> str:
    """A model directory SGLang's config loader accepts, with no weights."""
    path = os.path.join(root, "tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA, f)
    return path


def extra_config(pool: str, *, v1: bool, size: str = "128M") -> dict:
    cfg = {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
           "maru_path": pool, "maru_pool_size": size,
           "prefetch_threshold": PAGE_SIZE}  # SGLang strips this before the backend sees the config
    if v1:
        cfg["interface_v1"] = 1
    return cfg


class Stack:
    """One SGLang process's storage stack: the controller, its host pool group, its storage backend."""

    def __init__(self, pool: str, models: str, *, v1: bool, tokens: int = PAGE_SIZE * 64):
        import torch
        from sglang.srt import runtime_context
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.pool_host import common as pool_host_common
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.server_args import ServerArgs

        pool_host_common._cuda_host_register = lambda *args, **kwargs: None  # CUDA page locking (see above)
        self.server_args = ServerArgs(
            model_path=model_dir(models), device="cpu", enable_hierarchical_cache=True, page_size=PAGE_SIZE,
            hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(
                extra_config(pool, v1=v1)), hicache_mem_layout="page_first_direct", hicache_io_backend="direct",
            hicache_size=1, skip_tokenizer_init=True)
        runtime_context.publish(self.server_args, role="scheduler")
        self._ranks = runtime_context.get_parallel().override(
            tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, pp_rank=0,
            pp_size=1, attn_dcp_rank=0, attn_dcp_size=1)
        self._ranks.__enter__()
        kv = MHATokenToKVPool(size=tokens, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=2, head_dim=64,
                              layer_num=2, device="cpu", enable_memory_saver=False)
        allocator = PagedTokenToKVPoolAllocator(tokens, PAGE_SIZE, torch.bfloat16, "cpu", kv, need_sort=False)
        params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=4096, device="cpu", enable_memory_saver=False),
            token_to_kv_pool_allocator=allocator, page_size=PAGE_SIZE, tree_components=(ComponentType.FULL,))
        extra, self.prefetch_threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
            self.server_args.hicache_storage_backend_extra_config)
        self.group, self.ctrl = build_kv_only_stack(
            params=params, kv_pool=kv, full_layer_mapping={i: i for i in range(kv.layer_num)},
            load_cache_event=threading.Event(), storage_backend=self.server_args.hicache_storage_backend,
            use_mla=False, prefetch_threshold=self.prefetch_threshold, model_name="tiny-llama",
            storage_backend_extra_config=extra, enable_storage_metrics=True)
        self.backend = self.ctrl.storage_backend
        self.host = self.group.anchor_entry.host_pool
        self.host.pin_memory = False  # the legacy path's dummy flat page asks CUDA for pinned memory (see above)

    # ------------------------------------------------------------------ host pages
    def alloc(self, n_tokens: int):
        return self.group.alloc(n_tokens)

    def fill(self, host_indices, seed: int) -> None:
        """Random bytes in the host pages `host_indices` (what a device -> host write would leave there)."""
        import torch
        gen = torch.Generator().manual_seed(seed)
        for addr, size in zip(*self.host.get_page_buffer_meta(host_indices)):
            data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
            ctypes.memmove(addr, data.data_ptr(), size)

    def page_digests(self, host_indices) -> list[str]:
        """SHA-256 of every page's bytes, in the pool's own piece order."""
        ptrs, sizes = self.host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // (len(host_indices) // PAGE_SIZE)
        out = []
        for i in range(0, len(ptrs), per):
            h = hashlib.sha256()
            for p, n in zip(ptrs[i:i + per], sizes[i:i + per]):
                h.update(ctypes.string_at(p, n))
            out.append(h.hexdigest())
        return out

    # ------------------------------------------------------------------ the controller's storage paths
    def backup(self, host_indices, tokens: list[int], last_hash: str | None = None) -> tuple[list[str], int]:
        """write_storage -> backup thread -> MaruStorage; (page hashes, tokens the ack reports stored)."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        hashes = get_storage_hash_str(tokens, last_hash, page_size=PAGE_SIZE)  # what the radix tree computes
        op_id = self.ctrl.write_storage(host_indices, tokens, hash_value=hashes)
        op = self.ctrl.ack_backup_queue.get(timeout=60)
        assert op.id == op_id
        return hashes, op.completed_tokens

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
        return {k: value(f"sglang:{k}") for k in ("prefetch_pgs_count", "prefetch_pgs_sum", "backup_pgs_count",
                                                  "backup_pgs_sum", "prefetch_bandwidth_count",
                                                  "backup_bandwidth_count")}

    def close(self) -> None:
        self.ctrl.storage_stop_event.set()
        self.backend.close()


_COLLECTOR = None


def tokens_of(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * PAGE_SIZE))


# ---------------------------------------------------------------------- the two processes of the tests
def writer(pool: str, models: str, v1: bool) -> dict:
    """Instance A: a parent prompt of 8 pages, then a child node of 4 more chained to it, backed up through
    the controller; reports every page's digest and what SGLang's metrics collector saw."""
    st = Stack(pool, models, v1=v1)
    parent, child = tokens_of(1000, 8), tokens_of(5000, 4)
    idx = st.alloc(len(parent) + len(child))
    st.fill(idx, seed=1)
    p_idx, c_idx = idx[:len(parent)], idx[len(parent):]
    p_hashes, p_done = st.backup(p_idx, parent)
    c_hashes, c_done = st.backup(c_idx, child, last_hash=p_hashes[-1])
    out = {"parent_done": p_done, "child_done": c_done, "parent_digests": st.page_digests(p_idx),
           "child_digests": st.page_digests(c_idx), "metrics": st.metrics(),
           "page_bytes": st.backend.page_bytes, "uses_pieces": st.backend.uses_pieces,
           "controller": type(st.ctrl).__name__, "backend": type(st.backend).__name__}
    st.close()
    return out


def reader(pool: str, models: str, v1: bool) -> dict:
    """Instance B: prefetches what A stored (the parent, the chain through the child), a longer prompt, a
    prompt nobody wrote; reads its metrics; clears the namespace and asks again."""
    st = Stack(pool, models, v1=v1)
    parent, child = tokens_of(1000, 8), tokens_of(5000, 4)
    out = {}
    hit, done, idx = st.prefetch("parent", parent)
    out["parent"] = {"hit": hit, "loaded": done, "digests": st.page_digests(idx[:done]) if done else []}
    hit, done, idx = st.prefetch("chain", parent + child)
    out["chain"] = {"hit": hit, "loaded": done, "digests": st.page_digests(idx[:done]) if done else []}
    hit, done, _ = st.prefetch("longer", parent + tokens_of(9000, 4))
    out["longer"] = {"hit": hit, "loaded": done}
    hit, done, _ = st.prefetch("nobody", tokens_of(20000, 6))
    out["miss"] = {"hit": hit, "loaded": done}
    out["metrics"] = st.metrics()
    out["cleared"] = st.ctrl.clear_storage_backend()
    hit, done, _ = st.prefetch("after-clear", parent)
    out["after_clear"] = {"hit": hit, "loaded": done}
    st.close()
    return out


def main() -> None:
    role, pool, models, v1 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "v1"
    result = (writer if role == "writer" else reader)(pool, models, v1)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # SGLang's storage threads are not daemons of ours to join


if __name__ == "__main__":
    main()
