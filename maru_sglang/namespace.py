"""Who may read whose pages: key namespaces per model, rank and KV format, and the clear() nonce.

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
import os
import time

from maru_shm import StoreError, prefixed_digest, prefixed_digests

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


NONCE_BYTES = 16
NONCE_REFRESH_S = 0.05  # a process re-reads the clear() nonce at most this often


class KeySpace:
    """The namespace one MaruStorage reads and writes pages in, and the clear() nonce that retires it.

    `base` (topology and KV format, fixed when the host pool is registered) plus the nonce stored in the
    pool under `record` make the prefix of every page key. clear() draws a new nonce: every page of the
    old one becomes unreachable at once, and eviction reclaims it. The record is pinned (Store.pin): if a
    full pool evicted it, a process that never saw the nonce could not find any page of the namespace.
    """

    def __init__(self, store_of, log_once):
        self._store_of = store_of  # the pool, attached on first use (MaruStorage.store)
        self._log_once = log_once
        self.base: str | None = None
        self._cache: tuple[float, str] | None = None
        self._nonce: bytes | None = None  # the nonce last read (restored if its record is evicted)

    def set_base(self, base: str) -> None:
        self.base = base
        self._cache = None

    @property
    def store(self):
        return self._store_of()

    @property
    def record(self) -> str:
        return f"__maru_ns__/{self.base}"

    def prefix(self) -> str:
        """Namespace prefix incl. the current clear() nonce (re-read at most every NONCE_REFRESH_S)."""
        if self.base is None:
            raise RuntimeError("MaruStorage used before register_mem_pool_host()")
        now = time.monotonic()
        cached = self._cache
        if cached is not None and now - cached[0] < NONCE_REFRESH_S:
            return cached[1]
        return self._load(self.store, now)

    def adopt(self, store) -> None:
        """A reopened pool (SharedPool healed): the nonce read or restored there before any call uses it."""
        self._cache = None
        if self.base is not None:
            self._load(store, time.monotonic())

    def _load(self, store, now: float) -> str:
        nonce = store.get(self.record)
        if nonce is None or len(nonce) != NONCE_BYTES:
            # Never written, or lost. Restore the nonce this process last saw rather than drawing a new one:
            # losing this record must not hide every page of the namespace. Only clear() changes the nonce.
            # The first writer wins (skip_existing), so processes that disagree converge on one record.
            known = self._nonce if self._nonce is not None else os.urandom(NONCE_BYTES)
            store.batch_put([self.record], [known], skip_existing=True)
            self._pin(store)
            nonce = store.get(self.record) or known
        self._nonce = nonce
        prefix = f"{self.base}|{nonce.hex()}/"
        self._cache = (now, prefix)
        return prefix

    def tier_tag(self, pool_tags=()) -> str:
        """The second tier's namespace: a digest of the base and the extra pools' namespaces, not the nonce.

        clear() stays local (it never empties the shared tier), so the tag must not change with it.
        """
        if self.base is None:
            raise RuntimeError("MaruStorage used before register_mem_pool_host()")
        blob = "\n".join([self.base, *pool_tags]).encode()
        return "maru-" + hashlib.sha256(blob).hexdigest()[:20]

    def digests(self, keys):
        """Store digests of this namespace's keys, (n, 16) uint8: the fast path for SGLang's SHA-256 page hashes."""
        return prefixed_digests(self.prefix(), keys)

    def digest(self, key: str) -> bytes:
        return prefixed_digest(self.prefix(), key)

    def clear(self) -> None:
        """Retire the namespace: a new nonce, written and pinned."""
        self._nonce = os.urandom(NONCE_BYTES)
        self.store.put(self.record, self._nonce)
        self._pin(self.store)
        self._cache = None

    def _pin(self, store) -> None:
        try:
            store.pin(self.record)
        except StoreError as e:
            self._log_once("pinning the namespace record", e)
