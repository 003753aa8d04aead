"""The CPU engine's stand-ins (tools/sglang_cpu.py, tools/sglang_cpu_path/sgl_kernel) against reference
copies written from the kernels' contracts, one token or one page at a time."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tools import sglang_cpu

PAGE, LAYERS, TOKENS, ITEM = 4, 3, 64, 10


def _stand_in():
    path = os.path.join(sglang_cpu.STAND_IN_PATH, "sgl_kernel", "__init__.py")
    spec = importlib.util.spec_from_file_location("maru_test_sgl_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pages(gen, n_pages):
    """Token indices of n_pages distinct random pages, page-aligned runs (what SGLang's allocator gives)."""
    pages = torch.randperm(TOKENS // PAGE, generator=gen)[:n_pages]
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages.tolist()])


def test_all_layer_device_to_host_page_first():
    gen = torch.Generator().manual_seed(1)
    dev = [torch.randn(TOKENS, 2, ITEM, generator=gen) for _ in range(2 * LAYERS)]  # K layers, then V layers
    host = [torch.zeros(TOKENS // PAGE, LAYERS, PAGE, 2, ITEM) for _ in range(2)]
    src, dst = _pages(gen, 5), _pages(gen, 5)
    sglang_cpu.transfer_kv_all_layer_direct_lf_pf(dev, host, src, dst, PAGE)
    for j in range(2):
        for layer in range(LAYERS):
            for i in range(0, len(src), PAGE):
                want = dev[j * LAYERS + layer][src[i:i + PAGE]]
                assert torch.equal(host[j][dst[i] // PAGE][layer], want)
    untouched = set(range(TOKENS // PAGE)) - {int(d) // PAGE for d in dst}
    assert all(not host[0][p].any() for p in untouched)


def test_one_layer_host_page_first_to_device():
    gen = torch.Generator().manual_seed(2)
    host = [torch.randn(TOKENS // PAGE, LAYERS, PAGE, 2, ITEM, generator=gen) for _ in range(2)]
    dev = [torch.zeros(TOKENS, 2, ITEM) for _ in range(2)]
    src, dst = _pages(gen, 6), _pages(gen, 6)
    sglang_cpu.transfer_kv_per_layer_direct_pf_lf(host, dev, src, dst, 1, PAGE)
    for j in range(2):
        for i in range(0, len(src), PAGE):
            assert torch.equal(dev[j][dst[i:i + PAGE]], host[j][src[i] // PAGE][1])
    assert not dev[0][[t for t in range(TOKENS) if t not in set(dst.tolist())]].any()


def test_layer_first_direct_copies_token_rows():
    gen = torch.Generator().manual_seed(3)
    src_layers = [torch.randn(TOKENS, 2, ITEM, generator=gen) for _ in range(2)]
    dst_layers = [torch.zeros(TOKENS, 2, ITEM) for _ in range(2)]
    src, dst = _pages(gen, 3), _pages(gen, 3)
    sglang_cpu.transfer_kv_direct(src_layers, dst_layers, src, dst, PAGE)
    for s, d in zip(src_layers, dst_layers):
        assert torch.equal(d[dst], s[src])


def test_assign_req_to_token_pool_fills_each_row_from_its_run_of_locations():
    k = _stand_in()
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    starts, ends = torch.tensor([0, 3, 5]), torch.tensor([2, 7, 5])
    locs = torch.arange(100, 106, dtype=torch.int64)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0, 3]), req_to_token, starts, ends, locs, 16)
    assert req_to_token[2, :2].tolist() == [100, 101]
    assert req_to_token[0, 3:7].tolist() == [102, 103, 104, 105]
    assert not req_to_token[3].any() and not req_to_token[1].any()


def test_copy_all_layer_kv_cache_reads_every_source_before_writing():
    k = _stand_in()
    bufs = [torch.arange(8 * 6, dtype=torch.uint8).view(8, 6).clone() for _ in range(2)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([6, 6], dtype=torch.int64)
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 1]))  # a swap
    for b, old in zip(bufs, before):
        assert torch.equal(b[1], old[2]) and torch.equal(b[2], old[1]) and torch.equal(b[0], old[0])


def test_speculative_ops_refuse_by_name():
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        _stand_in().verify_tree_greedy_cpu()


def test_the_plugin_acts_only_in_cpu_mode(monkeypatch):
    """Outside CPU mode (a GPU server with maru-shm installed) SGLang's plugin call changes nothing."""
    from sglang.srt.mem_cache.pool_host import mha
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    init = HostKVCache.__init__
    sglang_cpu.activate()
    assert HostKVCache.__init__ is init and not hasattr(mha, "transfer_kv_direct")


def test_in_cpu_mode_host_pools_are_unpinned_whether_pin_memory_comes_by_keyword_or_position(monkeypatch):
    """Patch 3 on SGLang's real HostKVCache: pin_memory=True becomes False where the platform cannot pin."""
    from sglang.srt.mem_cache.pool_host import base
    seen = []
    monkeypatch.setattr(base.HostKVCache, "__init__", lambda self, dtype, device_capacity_tokens, size_per_token,
                        start_layer, end_layer, host_to_device_ratio, host_size, page_size, layout, pin_memory,
                        device, **kw: seen.append(pin_memory))
    monkeypatch.setattr("sglang.srt.utils.common.is_pin_memory_available", lambda device=None: False)
    sglang_cpu._host_pools_unpinned()
    base.HostKVCache.__init__(object(), "bf16", 8, 4, 0, 1, 2.0, 0, 1, "layer_first", True, "cpu")
    base.HostKVCache.__init__(object(), "bf16", 8, 4, 0, 1, 2.0, 0, 1, "layer_first", device="cpu", pin_memory=True)
    assert seen == [False, False]
