"""Who may read whose pages: key namespaces per model, rank and KV format.

MHA pages are sharded by TP rank, so their keys carry model, TP rank/size,
PP rank/size, attention-CP rank/size. MLA pages are replicated over TP
ranks and share one key per page (per DCP shard when DCP is on). Every key
also carries a fingerprint of the bytes' format — dtype, layout, heads, head
dims, layers, page size and bytes — so two configurations sharing one pool can
never load each other's pages (SGLang issue #33268: bf16 and fp8 runs reused
each other's pages).
"""

from __future__ import annotations

import hashlib
import json

_FORMAT_ATTRS = (
    "layout", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
    "kv_cache_dim", "page_size", "logical_page_size", "start_layer", "end_layer",
)


def kv_format_fingerprint(host_pool, page_bytes: int, pieces_per_page: int, io: str) -> str:
    """Short digest of everything that decides the byte layout of one stored page."""
    desc = {"class": type(host_pool).__name__, "dtype": str(getattr(host_pool, "dtype", "")),
            "page_bytes": int(page_bytes), "pieces": int(pieces_per_page), "io": io}
    for attr in _FORMAT_ATTRS:
        v = getattr(host_pool, attr, None)
        if isinstance(v, (int, str, float, bool)):
            desc[attr] = v
    blob = json.dumps(desc, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def namespace_for(storage_config, *, pool_name: str = "kv", tp_sharded: bool | None = None) -> str:
    """Topology part of a key namespace, following HiCacheFile's suffix rules."""
    c = storage_config
    model = "-".join((c.model_name or "").split("/"))
    parts = [model]
    if c.pp_size > 1:
        parts.append(f"pp{c.pp_rank}of{c.pp_size}")
    if c.attn_cp_size > 1:
        parts.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
    sharded = (not c.is_mla_model) if tp_sharded is None else tp_sharded
    if sharded:
        parts.append(f"tp{c.tp_rank}of{c.tp_size}")
    if getattr(c, "dcp_size", 1) > 1:
        parts.append(f"tp{c.tp_size}dcp{c.dcp_rank}of{c.dcp_size}page{c.logical_page_size}")
    parts.append(pool_name)
    return "|".join(parts)
