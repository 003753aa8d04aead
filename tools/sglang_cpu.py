"""SGLang 0.5.23's real serving engine on a CPU without AMX and without a CUDA kernel wheel.

SGLang's own switch, SGLANG_USE_CPU_ENGINE=1, selects its CPU platform, whose ops fall back to torch
when the CPU lacks AMX. What still needs CUDA or sgl_kernel, and what stands in for it here:

1. `sgl_kernel` itself. The registry's wheel holds CUDA kernels only, and CPU mode imports a few names
   from it at module level. `sglang_cpu_path/sgl_kernel` is a torch-native stand-in for them (its
   docstring says which), put on PYTHONPATH so that every process SGLang spawns imports it.
2. The host pool's `direct` io backend ops (`transfer_kv_direct`, `transfer_kv_all_layer_direct_lf_pf`,
   `transfer_kv_per_layer_direct_pf_lf` in `pool_host/mha.py` and `mla.py`) are bound only on
   CUDA/ROCm/XPU; on CPU HiCache's first device -> host backup fails with NameError. They are bound
   here to torch versions with the meaning of sgl_kernel's (its tests' reference copies).
3. The host pool's `pin_memory` defaults to True, and SGLang's assembler never passes it, so on CPU the
   host pool asks the CUDA driver to register its memory (`pool_host.common._cuda_host_register`). Host
   pools are built here with pin_memory=False wherever the platform says pinning is unavailable, which
   is what SGLang's CPU platform says (`CpuSRTPlatform.is_pin_memory_available`).

Nothing else is patched: the scheduler, the radix cache, HiCache's controller, the model forward and
MaruStorage run as SGLang runs them. The patches apply in every SGLang process through SGLang's own
plugin group (`sglang.srt.plugins`, pyproject.toml), and only where the stand-in of 1 is the imported
`sgl_kernel` in CPU mode, so a GPU install with the real wheel is never touched.
"""

from __future__ import annotations

import os

import torch

STAND_IN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu_path")


def engine_env(env: dict | None = None) -> dict:
    """The environment an SGLang CPU engine (and every process it spawns) needs: CPU mode and the stand-in."""
    env = dict(os.environ if env is None else env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != STAND_IN_PATH]
    env["PYTHONPATH"] = os.pathsep.join([STAND_IN_PATH] + paths)
    return env


# ---------------------------------------------------------------- host pool io ops (patch 2)
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Token rows src_indices of each source buffer to rows dst_indices of its destination (layer-first)."""
    src_idx, dst_idx = src_indices.to(torch.int64).cpu(), dst_indices.to(torch.int64).cpu()
    for src, dst in zip(src_layers, dst_layers):
        _rows(dst)[dst_idx] = _rows(src)[src_idx].to(dst.device)


def _first_of_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    return indices.to(torch.int64).cpu().view(-1, page_size)[:, 0] // page_size


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """Device layer-first buffers (every K layer, then every V layer) into host page-first buffers [K, V]
    of shape (pages, layers, page_size, ...): dst[page of dst_indices][layer] = src[layer][src_indices]."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages = _first_of_pages(dst_indices, page_size)
    src_idx = src_indices.to(torch.int64).cpu()
    for j, dst in enumerate(dst_ptrs):
        view = dst.view(dst.shape[0], dst.shape[1], page_size, -1)
        for layer in range(layers):
            rows = _rows(src_ptrs[j * layers + layer])[src_idx]
            view[pages, layer] = rows.view(len(pages), page_size, -1).to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int,
                                       page_size: int) -> None:
    """One layer from host page-first buffers [K, V] into the device's layer buffers [K, V]:
    dst[dst_indices] = src[page of src_indices][layer_id]."""
    pages = _first_of_pages(src_indices, page_size)
    dst_idx = dst_indices.to(torch.int64).cpu()
    for src, dst in zip(src_ptrs, dst_ptrs):
        rows = src.view(src.shape[0], src.shape[1], page_size, -1)[pages, layer_id]
        _rows(dst)[dst_idx] = rows.reshape(len(dst_idx), -1).to(dst.device)


HOST_POOL_OPS = {"transfer_kv_direct": transfer_kv_direct,
                 "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
                 "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf}


def activate() -> None:
    """SGLang general plugin (`sglang.srt.plugins`): bind patch 2 in CPU mode with the stand-in, else nothing."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    try:
        import sgl_kernel
    except ImportError:
        return
    if not getattr(sgl_kernel, "MARU_CPU_STAND_IN", False):
        return
    from sglang.srt.mem_cache.pool_host import mha, mla
    for module in (mha, mla):
        for name, op in HOST_POOL_OPS.items():
            if not hasattr(module, name):
                setattr(module, name, op)
    _host_pools_unpinned()


def _host_pools_unpinned() -> None:
    """Patch 3: a host pool pins its memory only where the platform can pin."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    from sglang.srt.utils.common import is_pin_memory_available
    import inspect
    init = HostKVCache.__init__
    if getattr(init, "maru_unpinned", False):
        return
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):  # pin_memory comes by keyword or by position (mha_mxfp8.py)
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = bound.arguments["pin_memory"] and is_pin_memory_available()
        init(*bound.args, **bound.kwargs)
    __init__.maru_unpinned = True
    HostKVCache.__init__ = __init__
