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
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device_pool = make_mha_device(page_size, page_size, dtype=dtype, layer_num=layer_num, head_num=head_num,
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
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    phys = page_size // dcp_size
    pages = max(pages, layer_num)
    device_pool = make_mla_device(phys, phys, dtype=dtype, layer_num=layer_num, kv_lora_rank=kv_lora_rank,
                                  qk_rope_head_dim=qk_rope_head_dim)
    return MLATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device="cpu", allocator_type="default",
                                override_kv_cache_dim=device_pool.kv_cache_dim, dcp_size=dcp_size, dcp_rank=dcp_rank,
                                device_capacity_tokens=0, host_token_capacity=pages * phys, start_layer=0,
                                end_layer=layer_num - 1, target_layer_num=layer_num)


def make_mha_device(page_size: int, tokens: int, *, dtype: str = "bfloat16", layer_num: int = LLAMA_8B["layer_num"],
                    head_num: int = LLAMA_8B["head_num"], head_dim: int = LLAMA_8B["head_dim"]):
    """A real CPU MHATokenToKVPool of `tokens` tokens."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=tokens, page_size=page_size, dtype=getattr(torch, dtype), device="cpu",
                            enable_memory_saver=False, start_layer=0, end_layer=layer_num - 1, enable_alt_stream=False,
                            layer_num=layer_num, head_num=head_num, head_dim=head_dim)


def make_mla_device(page_size: int, tokens: int, *, dtype: str = "bfloat16", layer_num: int = MLA_GEOMETRY["layer_num"],
                    kv_lora_rank: int = MLA_GEOMETRY["kv_lora_rank"],
                    qk_rope_head_dim: int = MLA_GEOMETRY["qk_rope_head_dim"]):
    """A real CPU MLATokenToKVPool of `tokens` tokens."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=tokens, page_size=page_size, dtype=getattr(torch, dtype), kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, device="cpu",
                            enable_memory_saver=False, start_layer=0, end_layer=layer_num - 1)


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


def in_child(target, *args, timeout: float = 300):
    """Run target(*args, q) in a spawned process; (what it put on q, its exit code). It must put one dict."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, q), daemon=True)
    child.start()
    try:
        got = q.get(timeout=timeout)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    return got, child.exitcode


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


# --------------------------------------------------------------------------- hybrid models (HiCache v2 API)
# Every pool below is a real SGLang host pool built over a real SGLang device pool on CPU:
# MHATokenToKVPool / MLATokenToKVPool, MambaPool (Mamba2 state shapes), DeepSeekV4SingleKVPool (the V4
# compressed KV and SWA pools) and LogicalHostPool (DeepSeek-V4's KV anchor, which holds no tensor).
MAMBA_SHAPE = dict(intermediate_size=64, n_groups=1, num_heads=2, head_dim=16, state_size=16, conv_kernel=4)


def make_mamba_host(slots: int = 8, *, layers: int = 2, layout: str = "page_first_direct", tp_size: int = 1,
                    side_state: bool = False):
    """A real MambaPoolHost (page_size 1: one state per slot) over a real CPU MambaPool.

    side_state=True adds one slot side-state buffer (SGLang's extra_checkpoint_buffers, e.g. a PLE state
    registered with MambaPool.register_slot_state): SGLang's get_page_buffer_meta refuses such a pool.
    """
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    shape = Mamba2StateShape.create(tp_world_size=tp_size, **MAMBA_SHAPE)
    ids = list(range(layers))
    device = MambaPool(size=slots, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=ids),
                       mamba_layer_ids=ids, device="cpu")
    info = device.get_device_pool_infos()[0].buffer_info
    if side_state:
        extra = torch.zeros((info.temporal.shape[1], 8), dtype=torch.float32)
        info = MambaStateBufferInfo(temporal=info.temporal, conv=info.conv, extra_checkpoint_buffers=(extra,))
    return MambaPoolHost(info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


def make_v4_host(name: str, ratio: int, *, page_size: int = 256, pages: int = 8, layers: int = 2,
                 layout: str = "page_first_direct"):
    """A real DeepSeekV4PagedHostPool over a real CPU DeepSeekV4SingleKVPool.

    ratio 1/2/4/128: a compressed KV pool (c1..c128) whose rows are page_size / ratio compressed tokens of
    one FULL page (KV-derived sidecar: host indices are the FULL logical ones, slot_page_size = page_size).
    name "swa": the sliding-window pool, with its own page of page_size tokens (pass ratio=1).
    """
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    rows = page_size // ratio
    device = DeepSeekV4SingleKVPool(size=rows * 2, page_size=rows, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448,
                                    qk_rope_head_dim=64, layer_num=layers, device="cpu", enable_memory_saver=False)
    return DeepSeekV4PagedHostPool(pool_name=name, device_buffers=device.kv_buffer,
                                   item_bytes=device.bytes_per_page_padded, num_host_pages=pages,
                                   slot_page_size=page_size, layout=layout, device="cpu", pin_memory=False)


def make_v4_device(page_size: int = 256, pages: int = 8, *, layers: int = 2, swa_page_size: int = 128):
    """A real CPU DeepSeekV4TokenToKVPool (compressed c4 / c128 KV, SWA): DeepSeek-V4's device pool.

    Its constructor reads the execution config a scheduler publishes; a context made from a ServerArgs
    over a config-only model directory (sglang_stack.py) is active while it runs, and the process's
    own context is left as it was (runtime_context.use_context).
    """
    import tempfile

    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import create_context, get_parallel, use_context
    from sglang.srt.server_args import ServerArgs

    from sglang_stack import model_dir  # by name, as this module is imported (tests/maru_sglang on sys.path)

    tokens = page_size * pages
    with tempfile.TemporaryDirectory() as models:
        ctx = create_context(ServerArgs(model_path=model_dir(models), device="cpu", skip_tokenizer_init=True),
                             role="scheduler")
        with use_context(ctx), get_parallel().override(**ONE_RANK):
            return DeepSeekV4TokenToKVPool(
                max_num_reqs=4, swa_size=tokens, c4_size=tokens, c128_size=tokens, c4_state_pool_size=8,
                c128_state_pool_size=8, page_size=page_size, swa_page_size=swa_page_size, dtype=torch.float8_e4m3fn,
                c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
                qk_rope_head_dim=64, indexer_head_dim=128, layer_num=layers, device="cpu", enable_memory_saver=False,
                compression_ratios=[(4, 128)[i % 2] for i in range(layers)])


def make_logical_anchor(page_size: int = 256, pages: int = 8, layout: str = "page_first_direct"):
    """DeepSeek-V4's KV anchor: page-aligned logical slots, no KV tensor (kv_buffer None)."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    return LogicalHostPool(pages * page_size, page_size, layout=layout)


def fill_random_pages(host, n_pages: int, seed: int) -> None:
    """Random bytes in pages [0, n_pages) of any pool, written through its own get_page_buffer_meta."""
    import random

    rnd = random.Random(seed)
    ptrs, sizes = host.get_page_buffer_meta(slot_indices(host, 0, n_pages))
    for p, n in zip(ptrs, sizes):
        ctypes.memmove(p, rnd.randbytes(n), n)


def pool_page_bytes(host, indices, n: int) -> list[bytes]:
    """Raw bytes of n pages at `indices` of any pool, through its own get_page_buffer_meta."""
    ptrs, sizes = host.get_page_buffer_meta(indices)
    per = len(ptrs) // n
    return [b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
            for i in range(n)]


def zero_pool_pages(host, indices, n: int) -> None:
    ptrs, sizes = host.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes):
        ctypes.memset(p, 0, s)


def slot_indices(host, first_page: int, n_pages: int):
    """Host indices of n_pages pages of any pool (its page_size slots each), starting at page first_page."""
    import torch

    ps = int(getattr(host, "page_size", 1) or 1)
    return torch.arange(first_page * ps, (first_page + n_pages) * ps, dtype=torch.int64)


def attach_hybrid(backend, anchor, pools: dict):
    """What HybridCacheController.attach_storage_backend does after the factory: the anchor through
    register_mem_pool_host, every HostPoolGroup entry (the KV anchor included) through
    register_mem_host_pool_v2, then on_host_pools_registered()."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    for name, host in pools.items():
        backend.register_mem_host_pool_v2(host, PoolName(name))
    backend.on_host_pools_registered()
    return backend


def create_hybrid_maru(pool: str, anchor, pools: dict, *, mla: bool, size="64M", tp_rank: int = 0,
                       tp_size: int = 1, model: str | None = None, maru: dict | None = None):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = storage_config(extra_config(pool, size, **(maru or {})), mla=mla, tp_rank=tp_rank, tp_size=tp_size,
                         model=model)
    return attach_hybrid(StorageBackendFactory.create_backend("dynamic", cfg, anchor), anchor, pools)


def create_hybrid_file(directory: str, anchor, pools: dict, *, mla: bool, tp_rank: int = 0, tp_size: int = 1,
                       model: str | None = None):
    """SGLang's own HiCacheFile ("file" backend, made by the same factory) on `directory`, same pools."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    os.makedirs(directory, exist_ok=True)
    cfg = storage_config({"file_storage_path": directory}, mla=mla, tp_rank=tp_rank, tp_size=tp_size, model=model)
    return attach_hybrid(StorageBackendFactory.create_backend("file", cfg, anchor), anchor, pools)


ONE_RANK = dict(tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, pp_rank=0,
                pp_size=1, attn_dcp_rank=0, attn_dcp_size=1)


def hybrid_controller(device_pool, group, backend: str, extra: dict, *, model: str):
    """SGLang's own HybridCacheController over a real HostPoolGroup, constructed as its stack assembler
    (hybrid_pool_assembler) constructs one: a paged allocator over the device pool, one rank (no
    torch.distributed group: the controller's all-reduces then run over none; the ranks a scheduler would
    publish are stated with get_parallel().override). Its own attach_storage_backend creates the backend
    with SGLang's factory, registers every pool of the group (register_mem_host_pool_v2), picks the page
    get/set functions and starts its storage threads; detach_storage_backend() stops them and closes the
    backend. The device pool only has to match the anchor's kind: the controller reads its type (MLA or
    DeepSeek-V4: one writer rank), device and layer count."""
    import threading

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.runtime_context import get_parallel

    ps = group.anchor_entry.host_pool.page_size
    allocator = PagedTokenToKVPoolAllocator(device_pool.size, ps, device_pool.dtype, "cpu", device_pool,
                                            need_sort=False)
    with get_parallel().override(**ONE_RANK):
        return HybridCacheController(allocator, group, ps, None, threading.Event(), io_backend="direct",
                                     storage_backend=backend, prefetch_threshold=ps, model_name=model,
                                     storage_backend_extra_config=dict(extra))


def host_pool_group(anchor, pools: dict):
    """A real HostPoolGroup: the anchor entry named kv, then one entry per pool."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    entries = [PoolEntry(name=PoolName.KV, host_pool=anchor, device_pool=None, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    entries += [PoolEntry(name=PoolName(n), host_pool=h, device_pool=None, layer_mapper=lambda i: i)
                for n, h in pools.items()]
    return HostPoolGroup(entries)


def make_dsa_indexer_host(anchor, *, layers: int = 2):
    """A real DSAIndexerPoolHost (the DSA indexer keys riding on MLA KV pages) over a real CPU DSATokenToKVPool.

    DSATokenToKVPool reads the attention-DCP width from SGLang's runtime context, which a scheduler
    publishes; get_parallel().override (SGLang's own test injection primitive) states it here instead.
    """
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.runtime_context import get_parallel

    ps = anchor.page_size
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, attn_tp_size=1, attn_tp_rank=0):
        device = DSATokenToKVPool(size=ps * 2, page_size=ps, kv_lora_rank=MLA_GEOMETRY["kv_lora_rank"],
                                  dtype=torch.bfloat16, qk_rope_head_dim=MLA_GEOMETRY["qk_rope_head_dim"],
                                  layer_num=layers, device="cpu", index_head_dim=128, enable_memory_saver=False,
                                  kv_cache_dim=MLA_GEOMETRY["kv_lora_rank"] + MLA_GEOMETRY["qk_rope_head_dim"])
        return DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), anchor, pin_memory=False, device="cpu")


def delete_digest(store, digest) -> bool:
    """Store.delete for a key known only by its digest (MaruStorage keys pages by namespaced digests, and
    Store.delete hashes a key itself): the same steps, shard lock, index removal, block freed."""
    from maru_shm.format.layout import SHARD_LOCK_BASE

    d = bytes(memoryview(digest).cast("B")) if not isinstance(digest, bytes) else digest
    s = store.index.shard_of(d)
    with store.locks.hold(SHARD_LOCK_BASE + s, repair=store._publisher.shard_repair(s)):
        removed = store.index.remove(s, d)
    if removed is None:
        return False
    store.alloc.free_blocks([(removed[1], removed[0])])
    return True


def digests_present(store, digests) -> list[bool]:
    return store.resolve(digests).ok.tolist()
