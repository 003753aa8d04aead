"""HiCache v2 storage API for hybrid models: every host pool gets its own key space and size class.

Models with more than one cache pool (Mamba / linear-attention state,
sliding-window KV, DSA indexer caches, DeepSeek-V4 compressed KV at several
ratios) reach L3 through SGLang's v2 storage API:
`register_mem_host_pool_v2(host_pool, name)` once per pool, then
`on_host_pools_registered()`, then `batch_exists_v2` / `batch_get_v2` /
`batch_set_v2` with one `PoolTransfer` per pool. Every pool has its own page
size, so one request stores pages of several sizes at once.

- Page size. Each pool's page is what its own `get_page_buffer_meta`
  describes for one page; the sum of the pieces becomes an exact-fit size
  class of the store. A pool that cannot describe its pages (a Mamba pool with
  slot side states, a layout without zero-copy support, a page larger than the
  pool's largest value) is refused at registration with the reason.
- Keys. A pool page is stored under the digest of MaruStorage's namespace
  (model, ranks, KV format, the clear() nonce) + the pool's own namespace
  (pool name, its topology, its byte format) + the page hash; KV pages under
  exactly the digests v1 uses (`pool_digests` is the one place). Pools never
  collide; Mamba state is keyed per TP rank even for MLA models
  (HiCacheFile._get_suffixed_key does the same); other pools of MLA models are
  shared by the TP ranks, like MLA KV.
- Hits. `batch_exists_v2` answers exactly what SGLang 0.5.23's own
  `HiCacheFile.batch_exists_v2` answers (hicache_storage.py): the KV prefix
  is the leading run of KV pages; each pool transfer, in order, keeps the
  prefix lengths it can restore (ALL_PAGES: every page up to there;
  TRAILING_PAGES: the last len(keys) pages before it) and reports its own
  boundary; the hit is the largest prefix length every pool can restore. A
  pool is only looked at for pages inside the KV prefix, so a page whose KV
  page was evicted never counts (an orphan). BLOCK_GROUPS, which HiCacheFile
  0.5.23 rejects, follows its docstring: the pool's verdict is the pages its
  leading complete key groups cover; it never gates the KV hit.
- A logical KV anchor (DeepSeek-V4's LogicalHostPool holds no KV tensor) stores
  an empty value per KV page, as HiCacheFile stores an empty file: it marks the
  page as backed up, and the KV prefix means the same thing for every model.

Nothing here raises into SGLang's storage threads: a failing call is logged
once per cause and reported as misses / False.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from enum import Enum
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)

from maru_shm import format_size
from maru_shm import prefixed_digests

from .namespace import kv_format_fingerprint, namespace_for
from .pages import page_pieces, store_pages

logger = logging.getLogger("maru_sglang")

KV = PoolName.KV.value
# Pools whose pages differ per TP rank even when the model's (MLA) KV is replicated over the TP ranks.
# SGLang 0.5.23: HiCacheFile._get_suffixed_key keys "*.mamba" with the TP suffix and every other pool
# with the model suffix; HybridCacheController.should_backup backs MAMBA up on every TP rank.
TP_SHARDED_POOLS = frozenset({PoolName.MAMBA.value})


def pool_name(name) -> str:
    """'mamba' for PoolName.MAMBA or 'mamba'."""
    return name.value if isinstance(name, Enum) else str(name)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """What MaruStorage knows about one registered pool."""

    name: str
    host_pool: Any
    page_size: int  # host slots per page: SGLang passes len(keys) * page_size host indices
    page_bytes: int
    pieces_per_page: int
    tp_sharded: bool
    tag: str  # the pool's part of a key: "<topology incl. pool name>|fmt-<byte format>/"
    is_kv: bool = False


# --------------------------------------------------------------------------- registration
def _uses_pieces(st) -> bool:
    extra = (st.storage_config.extra_config or {}) if st.storage_config else {}
    return bool(extra.get("interface_v1", 0))


def register_logical_anchor(st, mem_pool_host) -> None:
    """KV anchor without a KV tensor of its own (DeepSeek-V4's LogicalHostPool): KV pages are empty values.

    SGLang still writes and looks up one object per KV page (HiCacheFile writes an empty file per page via
    get_data_page, which is empty here); the page data lives in the side pools registered through v2.
    """
    st.page_bytes = 0
    st.pieces_per_page = 0
    io = "pieces" if _uses_pieces(st) else "flat"
    fp = kv_format_fingerprint(mem_pool_host, 0, 0, io=io)
    st._ns_base = f"{namespace_for(st.storage_config)}|fmt-{fp}"
    st._ns_cache = None
    logger.info("maru: logical KV anchor %s (page of %d tokens, no KV bytes); namespace %s",
                type(mem_pool_host).__name__, int(getattr(mem_pool_host, "page_size", 1)), st._ns_base)


def describe_pool(st, host_pool, name) -> PoolSpec:
    """Derive page size, pieces and key namespace of a v2 pool; declare its exact-fit class.

    Raises ValueError with the reason when the pool's pages cannot be addressed piece by piece.
    """
    n = pool_name(name)
    if st._ns_base is None:
        raise RuntimeError("MaruStorage: register_mem_host_pool_v2() called before register_mem_pool_host()")
    page_size = int(getattr(host_pool, "page_size", 1) or 1)
    if n == KV:
        if host_pool is not st.mem_pool_host:
            logger.warning("maru: v2 pool 'kv' (%s) is not the anchor registered with register_mem_pool_host "
                           "(%s); KV pages use the anchor", type(host_pool).__name__,
                           type(st.mem_pool_host).__name__)
        return _spec(st, KV)
    what = f"MaruStorage: pool {n!r} ({type(host_pool).__name__}, layout {getattr(host_pool, 'layout', None)!r})"
    sample_n = int(getattr(host_pool, "logical_page_size", page_size) or page_size)
    try:
        meta = host_pool.get_page_buffer_meta(torch.arange(sample_n, dtype=torch.int64))
    except Exception as e:  # e.g. MambaPoolHost with slot side states, or a layout without zero-copy support
        raise ValueError(f"{what} cannot describe its pages for zero-copy I/O: {type(e).__name__}: {e}") from e
    if meta is None:
        raise ValueError(f"{what} holds no page buffers (get_page_buffer_meta returned None): only the KV anchor "
                         f"may be a logical pool")
    ptrs, sizes = meta
    if not ptrs or len(ptrs) != len(sizes) or any(int(s) <= 0 for s in sizes) or any(int(p) == 0 for p in ptrs):
        raise ValueError(f"{what} described one page as {len(ptrs)} pointers and sizes {list(sizes)[:8]}: "
                         f"not addressable")
    page_bytes = int(sum(int(s) for s in sizes))
    if page_bytes > st.store.max_value:
        raise ValueError(f"{what}: a page is {page_bytes} bytes but pool {st.config.path} holds values of at most "
                         f"{st.store.max_value} bytes; use a larger maru_pool_size")
    if page_bytes >= st.store.geo.granule:
        st.store.declare_size(page_bytes)
    tp_sharded = n in TP_SHARDED_POOLS or not st.storage_config.is_mla_model
    topo = namespace_for(st.storage_config, pool_name=n, tp_sharded=True if n in TP_SHARDED_POOLS else None)
    # the piece sizes pin down how the bytes of one page are laid out (e.g. Mamba temporal vs conv split)
    fp = kv_format_fingerprint(host_pool, page_bytes, len(ptrs), io="pieces:" + ",".join(str(int(s)) for s in sizes))
    spec = PoolSpec(n, host_pool, page_size, page_bytes, len(ptrs), tp_sharded, f"{topo}|fmt-{fp}/")
    logger.info("maru: v2 pool %s: page %s (%d slots, %d pieces)%s", n, format_size(page_bytes), page_size,
                len(ptrs), ", per TP rank" if tp_sharded and st.storage_config.is_mla_model else "")
    return spec


def summary(st) -> str:
    pools = st._v2_pools
    return ", ".join(f"{n} {format_size(s.page_bytes)}" for n, s in pools.items()) or "none"


def _spec(st, name) -> Optional[PoolSpec]:
    """The registered pool of this name; the KV pool is always the anchor (registered through v2 or not)."""
    n = pool_name(name)
    if n == KV:
        if st._ns_base is None:
            return None
        host = st.mem_pool_host
        return PoolSpec(KV, host, int(getattr(host, "page_size", 1) or 1), int(st.page_bytes or 0),
                        int(st.pieces_per_page), False, "", is_kv=True)
    return st._v2_pools.get(n)


# --------------------------------------------------------------------------- keys
def pool_digests(st, spec: PoolSpec, keys: List[str]):
    """Store digests ((n, 16) uint8) of `keys` in pool `spec`: the one place v2 keys become store identities.

    KV pages use MaruStorage._digests, so they are the very pages v1 / legacy calls store. A side pool's
    namespace is MaruStorage's (model, ranks, KV format, clear() nonce) followed by the pool's own tag, so
    SGLang's hex page hashes keep the fast prefixed-digest path and clear() retires every pool at once.
    """
    if spec.is_kv:
        return st._digests(keys)
    return prefixed_digests(st._namespace() + spec.tag, keys)


def store_digests(st, name, keys: List[str]):
    """Store digests of `keys` in the pool called `name` (for tools and tests: inspect, evict)."""
    spec = _spec(st, name)
    if spec is None:
        raise KeyError(f"pool {pool_name(name)!r} is not registered")
    return pool_digests(st, spec, keys)


def _present(st, digests, page_bytes: int) -> List[bool]:
    """Per key: stored with exactly one page of bytes (anything else is not a page of this pool)."""
    r = st.store.resolve(digests)
    return (r.ok & (r.lengths == page_bytes)).tolist()


def _leading(st, digests, page_bytes: int) -> int:
    return st.store.leading_hits(length=page_bytes, digests=digests) if len(digests) else 0


def _pieces(spec: PoolSpec, host_indices, n: int) -> np.ndarray:
    return page_pieces(spec.host_pool, host_indices, n, spec.pieces_per_page, spec.page_bytes,
                       name=f"pool {spec.name!r}")


# --------------------------------------------------------------------------- lookups
def batch_exists_v2(st, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                    extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
    """SGLang 0.5.23 HiCacheFile.batch_exists_v2 semantics, field by field (see the module docstring)."""
    try:
        return _exists_v2(st, list(keys), pool_transfers)
    except Exception as e:
        st._log_once("batch_exists_v2", e)
        return PoolTransferResult(0, {}, [])


def _exists_v2(st, keys: List[str], pool_transfers) -> PoolTransferResult:
    kv_pages = _leading(st, st._digests(keys), st.page_bytes) if keys else 0
    hit_count: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in pool_transfers or []:
        if not restorable:  # as HiCacheFile: once nothing is restorable, later pools get no verdict
            break
        name, policy = transfer.name, transfer.hit_policy
        if policy == PoolHitPolicy.BLOCK_GROUPS:
            boundary = _block_group_pages(st, transfer, len(keys))
            if boundary:
                hit_count[name] = boundary
            continue  # never gates the KV hit: restorable stays as it is
        spec = _spec(st, name)
        if policy == PoolHitPolicy.ALL_PAGES:
            boundary = _leading(st, pool_digests(st, spec, keys[:kv_pages]), spec.page_bytes) if spec else 0
            pool_restorable = set(range(1, boundary + 1))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            trailing = max(1, len(transfer.keys) if transfer.keys else 1)
            have = _present(st, pool_digests(st, spec, keys[:kv_pages]), spec.page_bytes) if spec else \
                [False] * kv_pages
            # run[i]: present pages ending at page i; prefix p is restorable if pages [p - trailing, p) are present
            run, pool_restorable = 0, set()
            for p in range(1, kv_pages + 1):
                run = run + 1 if have[p - 1] else 0
                if run >= min(trailing, p):
                    pool_restorable.add(p)
            boundary = max(pool_restorable, default=0)
        else:
            raise ValueError(f"Unsupported pool hit policy: {policy}")
        if boundary:
            hit_count[name] = boundary
        restorable = [p for p in restorable if p in pool_restorable]
    final_pages = restorable[-1] if restorable else 0
    return PoolTransferResult(final_pages, hit_count, restorable)


def _block_group_pages(st, transfer: PoolTransfer, span_pages: int) -> int:
    """BLOCK_GROUPS verdict: FULL pages covered by the leading complete key groups, from the span start.

    transfer.keys are the pool's own keys, `group_pages` per group; group g covers FULL pages
    [g * block_pages, (g + 1) * block_pages). A group counts only if every key of it is present, and
    only the leading run of complete groups counts. Capped at the queried span.
    """
    block, group = int(transfer.block_pages or 0), int(transfer.group_pages or 0)
    spec = _spec(st, transfer.name)
    tkeys = list(transfer.keys or [])
    if block <= 0 or group <= 0:
        st._log_once("batch_exists_v2", ValueError(f"BLOCK_GROUPS transfer {pool_name(transfer.name)!r} without "
                                                   f"geometry (block_pages={block}, group_pages={group})"))
        return 0
    if spec is None or not tkeys:
        return 0
    whole = len(tkeys) // group * group
    lead = _leading(st, pool_digests(st, spec, tkeys[:whole]), spec.page_bytes)
    return min(lead // group * block, span_pages)


# --------------------------------------------------------------------------- data path
def batch_get_v2(st, transfers: List[PoolTransfer], extra_info=None) -> Dict[Any, List[bool]]:
    return _batch_io_v2(st, transfers, write=False)


def batch_set_v2(st, transfers: List[PoolTransfer], extra_info=None) -> Dict[Any, List[bool]]:
    return _batch_io_v2(st, transfers, write=True)


def _batch_io_v2(st, transfers: List[PoolTransfer], write: bool) -> Dict[Any, List[bool]]:
    """One per-page success list per transfer, keyed by transfer.name (as HiCacheFile._batch_io_v2)."""
    what = "batch_set_v2" if write else "batch_get_v2"
    results: Dict[Any, List[bool]] = {}
    for transfer in transfers or []:
        keys = list(transfer.keys or [])
        try:
            spec = _spec(st, transfer.name)
            if spec is None:
                raise KeyError(f"pool {pool_name(transfer.name)!r} was never registered "
                               f"(register_mem_host_pool_v2); registered: {summary(st)}")
            hi = transfer.host_indices
            expected = len(keys) * spec.page_size
            if hi is None or hi.numel() != expected:
                raise ValueError(f"{spec.name} indices length mismatch: expected {expected}, "
                                 f"got {hi.numel() if hi is not None else 0}")
            if not keys:
                results[transfer.name] = []
            elif spec.is_kv:
                results[transfer.name] = _kv_io(st, keys, hi, write)
            else:
                results[transfer.name] = (_set_pool if write else _get_pool)(st, spec, keys, hi)
        except Exception as e:
            st._log_once(what, e)
            results[transfer.name] = [False] * len(keys)
    return results


def _kv_io(st, keys, host_indices, write: bool) -> List[bool]:
    """A transfer named 'kv' moves the KV pages themselves, under the same keys as v1 / legacy calls."""
    if _uses_pieces(st):
        return st.batch_set_v1(keys, host_indices) if write else st.batch_get_v1(keys, host_indices)
    host, ps = st.mem_pool_host, int(getattr(st.mem_pool_host, "page_size", 1) or 1)
    out = []
    for i, key in enumerate(keys):
        at = int(host_indices[i * ps].item())
        if write:
            out.append(st.set(key, host.get_data_page(at, flat=True)))
        else:
            page = st.get(key, host.get_dummy_flat_data_page())
            if page is not None:
                host.set_from_flat_data_page(at, page)
            out.append(page is not None)
    return out


def _set_pool(st, spec: PoolSpec, keys, host_indices) -> List[bool]:
    n = len(keys)
    if not st.is_writer and not spec.tp_sharded:
        return [True] * n  # MLA: pages shared by the TP ranks are written by the storage writer rank
    t0 = time.perf_counter()
    pieces = _pieces(spec, host_indices, n)
    res, written = store_pages(st.store, keys, pool_digests(st, spec, keys), pieces, spec.page_bytes)
    _account(st, spec, res, t0, read=False, written=written)
    return res


def _get_pool(st, spec: PoolSpec, keys, host_indices) -> List[bool]:
    t0 = time.perf_counter()
    pieces = _pieces(spec, host_indices, len(keys))
    res = st.store.batch_get_pieces(keys, pieces, digests=pool_digests(st, spec, keys))
    _account(st, spec, res, t0, read=True)
    return res


def _account(st, spec: PoolSpec, res: List[bool], t0: float, read: bool, written: int = 0) -> None:
    ok = sum(res)
    with st._lock:
        s = st._v2_stats.setdefault(spec.name, {"page_bytes": spec.page_bytes, "hits": 0, "misses": 0,
                                                 "bytes_read": 0, "sets": 0, "set_skipped": 0, "set_failed": 0,
                                                 "bytes_written": 0, "seconds": 0.0})
        s["seconds"] += time.perf_counter() - t0
        if read:
            s["hits"] += ok
            s["misses"] += len(res) - ok
            s["bytes_read"] += ok * spec.page_bytes
        else:
            s["sets"] += written
            s["set_skipped"] += ok - written
            s["set_failed"] += len(res) - ok
            s["bytes_written"] += written * spec.page_bytes


def pool_stats(st) -> dict:
    with st._lock:
        return {name: dict(s) for name, s in st._v2_stats.items()}
