"""Real SGLang host pools on CPU and MaruStorage made by SGLang's own backend factory.

Shared by conftest.py (fixtures) and by the children that the multi-process
tests spawn, so it must import nothing from pytest and must be importable by
module name (tests/maru_sglang is on sys.path; conftest.py makes sure of it).
SGLang is imported lazily, inside the functions.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import uuid

LLAMA_8B = dict(layer_num=32, head_num=8, head_dim=128)  # Llama-3.1-8B: 128 KiB of K+V per token in bf16
MLA_GEOMETRY = dict(kv_lora_rank=512, qk_rope_head_dim=64, layer_num=8)  # DeepSeek-style latent, fewer layers
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
DEEPSEEK = "deepseek-ai/DeepSeek-V3"


def shm_path(tag: str = "t") -> str:
    """A fresh pool path under /dev/shm (the caller removes it)."""
    return f"/dev/shm/maru_pytest_{tag}_{os.getpid()}_{uuid.uuid4().hex[:10]}"


def extra_config(pool: str, size="64M", *, v1: bool = True, **maru) -> dict:
    extra = {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
             "maru_path": pool, "maru_pool_size": size, "maru_eager_map": False}
    if v1:
        extra["interface_v1"] = 1
    extra.update(maru)
    return extra


def make_mha_host(layout: str = "page_first_direct", page_size: int = 1, pages: int = 16, *, dtype: str = "bfloat16",
                  layer_num: int = LLAMA_8B["layer_num"], head_num: int = LLAMA_8B["head_num"],
                  head_dim: int = LLAMA_8B["head_dim"]):
    """A real MHATokenToKVPoolHost (CPU, unpinned) mirroring a real CPU MHATokenToKVPool."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    torch_dtype = getattr(torch, dtype)
    device_pool = MHATokenToKVPool(size=page_size, page_size=page_size, dtype=torch_dtype, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=layer_num - 1,
                                   enable_alt_stream=False, layer_num=layer_num, head_num=head_num,
                                   head_dim=head_dim)
    return MHATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device="cpu", allocator_type="default", device_capacity_tokens=0,
                                host_token_capacity=pages * page_size, start_layer=0, end_layer=layer_num - 1)


def make_mla_host(layout: str = "page_first_direct", page_size: int = 1, pages: int = 16, *, dtype: str = "bfloat16",
                  layer_num: int = MLA_GEOMETRY["layer_num"], kv_lora_rank: int = MLA_GEOMETRY["kv_lora_rank"],
                  qk_rope_head_dim: int = MLA_GEOMETRY["qk_rope_head_dim"], dcp_size: int = 1, dcp_rank: int = 0):
    """A real MLATokenToKVPoolHost (CPU, unpinned) mirroring a real CPU MLATokenToKVPool.

    page_size is the logical (DCP-widened) page, as SGLang passes it. The pool gets at least layer_num
    pages: SGLang 0.5.23 builds page_first_direct's per-layer views as kv_buffer[layer] (its dim 0 is the
    page), which fails with fewer pages than layers; real pools have far more.
    """
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    torch_dtype = getattr(torch, dtype)
    phys = page_size // dcp_size
    pages = max(pages, layer_num)
    device_pool = MLATokenToKVPool(size=phys, page_size=phys, dtype=torch_dtype, kv_lora_rank=kv_lora_rank,
                                   qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=layer_num - 1)
    return MLATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device="cpu", allocator_type="default",
                                override_kv_cache_dim=device_pool.kv_cache_dim, dcp_size=dcp_size, dcp_rank=dcp_rank,
                                device_capacity_tokens=0, host_token_capacity=pages * phys, start_layer=0,
                                end_layer=layer_num - 1, target_layer_num=layer_num)


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model: str | None = None,
                   **kw):
    """The HiCacheStorageConfig SGLang's cache controller would build for this rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=model or (DEEPSEEK if mla else LLAMA),
                                extra_config=extra, **kw)


def create_backend(host, cfg):
    """What HiCacheController.attach_storage_backend does: factory, then register_mem_pool_host."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def make_instance(pool: str, *, kind: str = "mha", layout: str = "page_first_direct", page_size: int = 1,
                  pages: int = 16, dtype: str = "bfloat16", size="64M", v1: bool = True, tp_rank: int = 0,
                  tp_size: int = 1, model: str | None = None, maru: dict | None = None, host_kw: dict | None = None):
    """(host pool, MaruStorage) for one SGLang rank."""
    if kind == "mha":
        host = make_mha_host(layout, page_size, pages, dtype=dtype, **(host_kw or {}))
    else:
        host = make_mla_host(layout, page_size, pages, dtype=dtype, **(host_kw or {}))
    cfg = storage_config(extra_config(pool, size, v1=v1, **(maru or {})), mla=(kind == "mla"), tp_rank=tp_rank,
                         tp_size=tp_size, model=model)
    return host, create_backend(host, cfg)


def fill_random(host, seed: int) -> None:
    """Random bytes everywhere in the host pool (bf16 views of these are often NaN: compare bytes only)."""
    import torch

    raw = host.kv_buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def _page_pieces(host, indices):
    ptrs, sizes = host.get_page_buffer_meta(indices)
    n = len(indices) // host.logical_page_size
    per = len(ptrs) // n
    return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(n)]


def page_bytes(host, indices) -> list[bytes]:
    """Raw bytes of each page at `indices`, read through the host pool's own piece pointers."""
    return [b"".join(ctypes.string_at(p, n) for p, n in pieces) for pieces in _page_pieces(host, indices)]


def zero_pages(host, indices) -> None:
    for pieces in _page_pieces(host, indices):
        for p, n in pieces:
            ctypes.memset(p, 0, n)


def digests(pages: list[bytes]) -> list[str]:
    return [hashlib.sha256(p).hexdigest() for p in pages]


def prompt_keys(n: int, salt: str = "") -> list[str]:
    """Hex SHA-256 page-chain hashes, like SGLang's."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{salt}page-{i}".encode()).digest()
        keys.append(prev.hex())
    return keys


def page_indices(host, first_page: int, n_pages: int):
    """Host indices of n_pages whole pages starting at page first_page (contiguous slots)."""
    import torch

    ps = host.logical_page_size
    return torch.arange(first_page * ps, (first_page + n_pages) * ps, dtype=torch.int64)


# --------------------------------------------------------------------------- the second process of the P2P test
def p2p_reader(pool: str, plan: dict, q) -> None:
    """Process 2: its own host pools and backends on the same pool file; reports what it saw through q."""
    import traceback

    out: dict = {"pid": os.getpid()}
    made = []
    try:
        def inst(**kw):
            host, backend = make_instance(pool, **kw)
            made.append(backend)
            return host, backend

        keys, n = plan["mha_keys"], len(plan["mha_keys"])
        host, reader = inst(kind="mha", pages=n + 8)
        out["slot"] = reader.store.slot
        out["mha_exists"] = reader.batch_exists(keys)
        dst = page_indices(host, 8, n)  # other host slots than the writer used
        out["mha_loaded"] = reader.batch_get_v1(keys, dst)
        out["mha_digests"] = digests(page_bytes(host, dst))

        out["strangers"] = {}
        for label, kw in (("tp_rank 1 of 2", dict(tp_rank=1, tp_size=2)),
                          ("another model", dict(model="Qwen/Qwen2.5-7B-Instruct")),
                          ("fp16 KV", dict(dtype="float16"))):
            h, other = inst(kind="mha", pages=n, **kw)
            out["strangers"][label] = (other.batch_exists(keys), sum(other.batch_get_v1(keys, page_indices(h, 0, n))))

        mkeys, m = plan["mla_keys"], len(plan["mla_keys"])
        mhost, rank1 = inst(kind="mla", pages=m + 8, tp_rank=1, tp_size=2)
        out["mla_rank1_is_writer"] = rank1.is_writer
        out["mla_exists"] = rank1.batch_exists(mkeys)
        mdst = page_indices(mhost, 8, m)
        out["mla_loaded"] = rank1.batch_get_v1(mkeys, mdst)
        out["mla_digests"] = digests(page_bytes(mhost, mdst))
        out["mla_rank1_sees_mha"] = rank1.batch_exists(keys)

        fresh = plan["nonwriter_keys"]
        out["nonwriter_set"] = rank1.batch_set_v1(fresh, page_indices(mhost, 0, len(fresh)))
        out["nonwriter_exists"] = rank1.batch_exists(fresh)
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        for b in made:
            try:
                b.close()
            except Exception:
                pass
        q.put(out)
