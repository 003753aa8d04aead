"""A torch-native stand-in for `sgl_kernel` on a CPU without AMX, put on PYTHONPATH by tools/sglang_cpu.py.

The registry's sglang-kernel wheel holds CUDA kernels only. In CPU mode (SGLANG_USE_CPU_ENGINE=1) SGLang
0.5.23 imports these names from `sgl_kernel` at module level; every other CPU op sits behind
`cpu_has_amx_support()`, which takes torch-native paths when the CPU has no AMX. Two ops are called on
the serving path and are implemented here with the meaning of SGLang's triton kernels of the same
name; the speculative-decoding ones are imported but only called with speculative decoding, so they
raise, naming themselves, rather than pretend.
"""

from __future__ import annotations

import ctypes

import torch

MARU_CPU_STAND_IN = True  # tools/sglang_cpu.py patches SGLang only when this module is the one imported


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """Row req_pool_indices[i] of req_to_token gets, in [start_offset[i], end_offset[i]), the next
    end - start entries of out_cache_loc (SGLang's `assign_req_to_token_pool` triton kernel)."""
    starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """In every buffer (base pointer data_ptrs[b], slot size strides[b] bytes) copy slot src_loc[i] to
    slot tgt_loc[i] (SGLang's `copy_all_layer_kv_cache_tiled`); sources are read before any write."""
    if tgt_loc.numel() == 0:
        return
    src, tgt = src_loc.to(torch.int64), tgt_loc.to(torch.int64)
    slots = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        rows[tgt] = rows[src]  # advanced indexing gathers first, so overlapping slots are safe


def _speculative_only(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU implementation here (speculative decoding is "
                                  f"not supported by tools/sglang_cpu.py)")
    op.__name__ = name
    return op


for _name in ("rotate_input_ids_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
              "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu"):
    globals()[_name] = _speculative_only(_name)
del _name
