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
- Keys. A pool page is stored under the digest of the backend's namespace
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
- The KV pool of a v2 call is the KV anchor, the LocalTier that owns the KV
  pages: its host pool and page describe the pool, and it moves the pages.
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
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from maru_shm import Store, format_size, prefixed_digests

from .tiers.local import LocalTier, LogOnce
from .namespace import KeySpace, kv_format_fingerprint, namespace_for
from .pages import page_pieces, store_pages
from .sync import Tally

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
    """What the backend knows about one registered pool."""

    name: str
    host_pool: Any
    page_size: int  # host slots per page: SGLang passes len(keys) * page_size host indices
    page_bytes: int
    pieces_per_page: int
    tp_sharded: bool
    tag: str  # the pool's part of a key: "<topology incl. pool name>|fmt-<byte format>/"
    is_kv: bool = False


class HybridPools:
    """The v2 pools of one backend: their specs, their figures, and the v2 calls over them.

    `kv` is the KV anchor (its host pool, page and page I/O: a v2 call's KV transfer goes to it); `store()`
    the pool's store, attached on first use; `keyspace` whose pages these are; `storage_config` SGLang's
    (model, ranks); `is_writer`: this rank stores pages shared by the TP ranks; `declare(page_bytes, what)`
    declares a pool's exact-fit class (SharedPool.declare); `log_once(what, error)` logs a failure once.
    """

    def __init__(self, kv: LocalTier, store: Callable[[], Store], keyspace: KeySpace, storage_config,
                 is_writer: bool, declare: Callable[[int, str], None], log_once: LogOnce):
        self.kv = kv
        self._store = store
        self.keyspace = keyspace
        self.storage_config = storage_config
        self.is_writer = is_writer
        self._declare = declare
        self._log_once = log_once
        self.pools: Dict[str, PoolSpec] = {}  # extra host pools of hybrid models, by name
        self._tally = Tally("the v2 pools' figures", self._fold)  # one record per transfer, folded into:
        self._stats: Dict[str, dict] = {}

    # ------------------------------------------------------------------ registration
    def describe(self, host_pool, name) -> PoolSpec:
        """Derive page size, pieces and key namespace of a v2 pool; its exact-fit class is declared now, or when
        the pool is attached.

        Raises ValueError with the reason when the pool's pages cannot be addressed piece by piece.
        """
        n = pool_name(name)
        if self.keyspace.base is None:
            raise RuntimeError("MaruStorage: register_mem_host_pool_v2() called before register_mem_pool_host()")
        if n == KV:
            if host_pool is not self.kv.host_pool:
                logger.warning("maru: v2 pool 'kv' (%s) is not the anchor registered with register_mem_pool_host "
                               "(%s); KV pages use the anchor", type(host_pool).__name__,
                               type(self.kv.host_pool).__name__)
            return self.spec(KV)
        ptrs, sizes = _page_meta(host_pool, n)
        page_bytes = int(sum(int(s) for s in sizes))
        self._declare(page_bytes, _what(host_pool, n))
        tp_sharded = n in TP_SHARDED_POOLS or not self.storage_config.is_mla_model
        topo = namespace_for(self.storage_config, pool_name=n, tp_sharded=True if n in TP_SHARDED_POOLS else None)
        # the piece sizes pin down how the bytes of one page are laid out (e.g. Mamba temporal vs conv split)
        fp = kv_format_fingerprint(host_pool, page_bytes, len(ptrs), io="pieces:" + ",".join(str(int(s)) for s in sizes))
        page_size = int(getattr(host_pool, "page_size", 1) or 1)
        spec = PoolSpec(n, host_pool, page_size, page_bytes, len(ptrs), tp_sharded, f"{topo}|fmt-{fp}/")
        logger.info("maru: v2 pool %s: page %s (%d slots, %d pieces)%s", n, format_size(page_bytes), page_size,
                    len(ptrs), ", per TP rank" if tp_sharded and self.storage_config.is_mla_model else "")
        return spec

    def register(self, spec: PoolSpec) -> None:
        if not spec.is_kv:
            self.pools[spec.name] = spec

    def pages(self) -> List[tuple]:
        """(page bytes, what) of every extra pool: the pool is sized for, and declares, each."""
        return [(s.page_bytes, _what(s.host_pool, s.name)) for s in self.pools.values()]

    def tags(self) -> List[str]:
        """Every extra pool's namespace (topology and byte format), for the second tier's tag."""
        return sorted(s.tag for s in self.pools.values())

    def written_by_this_rank(self, transfers) -> list:
        """The transfers whose pages this rank stores: on a non-writer MLA rank, only TP-sharded pools."""
        if self.is_writer:
            return list(transfers or [])
        return [t for t in transfers or [] if (s := self.spec(t.name)) is not None and s.tp_sharded]

    def summary(self) -> str:
        return ", ".join(f"{n} {format_size(s.page_bytes)}" for n, s in self.pools.items()) or "none"

    def spec(self, name) -> Optional[PoolSpec]:
        """The registered pool of this name; the KV pool is always the anchor (registered through v2 or not)."""
        n = pool_name(name)
        if n == KV:
            if self.keyspace.base is None:
                return None
            kv = self.kv
            return PoolSpec(KV, kv.host_pool, int(getattr(kv.host_pool, "page_size", 1) or 1), int(kv.page_bytes or 0),
                            int(kv.pieces_per_page), False, "", is_kv=True)
        return self.pools.get(n)

    # ------------------------------------------------------------------ keys
    def digests(self, spec: PoolSpec, keys: List[str]):
        """Store digests ((n, 16) uint8) of `keys` in pool `spec`: the one place v2 keys become store identities.

        KV pages use the key space's digests, so they are the very pages v1 / legacy calls store. A side
        pool's namespace is the backend's (model, ranks, KV format, clear() nonce) followed by the pool's own
        tag, so SGLang's hex page hashes keep the fast prefixed-digest path and clear() retires every pool
        at once.
        """
        if spec.is_kv:
            return self.keyspace.digests(keys)
        return prefixed_digests(self.keyspace.prefix() + spec.tag, keys)

    def store_digests(self, name, keys: List[str]):
        """Store digests of `keys` in the pool called `name` (for tools and tests: inspect, evict)."""
        spec = self.spec(name)
        if spec is None:
            raise KeyError(f"pool {pool_name(name)!r} is not registered")
        return self.digests(spec, keys)

    def _present(self, digests, page_bytes: int) -> List[bool]:
        """Per key: stored with exactly one page of bytes (anything else is not a page of this pool)."""
        r = self._store().resolve(digests)
        return (r.ok & (r.lengths == page_bytes)).tolist()

    def _leading(self, digests, page_bytes: int) -> int:
        return self._store().leading_hits(length=page_bytes, digests=digests) if len(digests) else 0

    def leading_stored(self, name, keys: List[str]) -> int:
        """How many of `keys`, from the first, pool `name` stores (0 for a pool not registered)."""
        spec = self.spec(name)
        return self._leading(self.digests(spec, keys), spec.page_bytes) if spec is not None else 0

    # ------------------------------------------------------------------ lookups
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None
                        ) -> PoolTransferResult:
        """SGLang 0.5.23 HiCacheFile.batch_exists_v2 semantics, field by field (see the module docstring)."""
        try:
            return self._exists_v2(list(keys), pool_transfers)
        except Exception as e:
            self._log_once("batch_exists_v2", e)
            return PoolTransferResult(0, {}, [])

    def _exists_v2(self, keys: List[str], pool_transfers) -> PoolTransferResult:
        kv_pages = self._leading(self.keyspace.digests(keys), self.kv.page_bytes) if keys else 0
        hit_count: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:  # as HiCacheFile: once nothing is restorable, later pools get no verdict
                break
            name, policy = transfer.name, transfer.hit_policy
            if policy == PoolHitPolicy.BLOCK_GROUPS:
                boundary = self._block_group_pages(transfer, len(keys))
                if boundary:
                    hit_count[name] = boundary
                continue  # never gates the KV hit: restorable stays as it is
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = self.leading_stored(name, keys[:kv_pages])
                pool_restorable = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                pool_restorable = self._trailing(self.spec(name), transfer, keys[:kv_pages])
                boundary = max(pool_restorable, default=0)
            else:
                raise ValueError(f"Unsupported pool hit policy: {policy}")
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hit_count, restorable)

    def _trailing(self, spec, transfer: PoolTransfer, kv_keys: List[str]) -> set:
        """TRAILING_PAGES: prefix lengths p whose last `len(transfer.keys)` pages before p are present."""
        trailing = max(1, len(transfer.keys) if transfer.keys else 1)
        have = self._present(self.digests(spec, kv_keys), spec.page_bytes) if spec else [False] * len(kv_keys)
        # run: present pages ending at page p; prefix p is restorable if pages [p - trailing, p) are present
        run, restorable = 0, set()
        for p in range(1, len(kv_keys) + 1):
            run = run + 1 if have[p - 1] else 0
            if run >= min(trailing, p):
                restorable.add(p)
        return restorable

    def _block_group_pages(self, transfer: PoolTransfer, span_pages: int) -> int:
        """BLOCK_GROUPS verdict: FULL pages covered by the leading complete key groups, from the span start.

        transfer.keys are the pool's own keys, `group_pages` per group; group g covers FULL pages
        [g * block_pages, (g + 1) * block_pages). A group counts only if every key of it is present, and
        only the leading run of complete groups counts. Capped at the queried span.
        """
        block, group = int(transfer.block_pages or 0), int(transfer.group_pages or 0)
        spec = self.spec(transfer.name)
        tkeys = list(transfer.keys or [])
        if block <= 0 or group <= 0:
            self._log_once("batch_exists_v2", ValueError(
                f"BLOCK_GROUPS transfer {pool_name(transfer.name)!r} without geometry "
                f"(block_pages={block}, group_pages={group})"))
            return 0
        if spec is None or not tkeys:
            return 0
        whole = len(tkeys) // group * group
        lead = self._leading(self.digests(spec, tkeys[:whole]), spec.page_bytes)
        return min(lead // group * block, span_pages)

    # ------------------------------------------------------------------ data path
    def batch_io_v2(self, transfers: List[PoolTransfer], write: bool) -> Dict[Any, List[bool]]:
        """One per-page success list per transfer, keyed by transfer.name (as HiCacheFile._batch_io_v2)."""
        what = "batch_set_v2" if write else "batch_get_v2"
        results: Dict[Any, List[bool]] = {}
        for transfer in transfers or []:
            keys = list(transfer.keys or [])
            try:
                results[transfer.name] = self._transfer(transfer, keys, write)
            except Exception as e:
                self._log_once(what, e)
                results[transfer.name] = [False] * len(keys)
        return results

    def _transfer(self, transfer: PoolTransfer, keys: List[str], write: bool) -> List[bool]:
        spec = self.spec(transfer.name)
        if spec is None:
            raise KeyError(f"pool {pool_name(transfer.name)!r} was never registered "
                           f"(register_mem_host_pool_v2); registered: {self.summary()}")
        hi = transfer.host_indices
        expected = len(keys) * spec.page_size
        if hi is None or hi.numel() != expected:
            raise ValueError(f"{spec.name} indices length mismatch: expected {expected}, "
                             f"got {hi.numel() if hi is not None else 0}")
        if not keys:
            return []
        if spec.is_kv:
            return self.kv.io_v2(keys, hi, write)
        if write:
            return self._set_pool(spec, keys, hi)
        return self._get_pool(spec, keys, hi)

    def promote_v2(self, transfers) -> int:
        """Store v2 pages another tier just loaded (those this rank stores); the number of pages the pool took."""
        res = self.batch_io_v2(self.written_by_this_rank(transfers), write=True)
        return sum(sum(r) for r in res.values())

    def _set_pool(self, spec: PoolSpec, keys, host_indices) -> List[bool]:
        n = len(keys)
        if not self.is_writer and not spec.tp_sharded:
            return [True] * n  # MLA: pages shared by the TP ranks are written by the storage writer rank
        t0 = time.perf_counter()
        res, written = store_pages(self._store(), keys, self.digests(spec, keys), _pieces(spec, host_indices, n),
                                   spec.page_bytes)
        self._account(spec, res, t0, read=False, written=written)
        return res

    def _get_pool(self, spec: PoolSpec, keys, host_indices) -> List[bool]:
        t0 = time.perf_counter()
        pieces = _pieces(spec, host_indices, len(keys))
        res = self._store().batch_get_pieces(keys, pieces, digests=self.digests(spec, keys))
        self._account(spec, res, t0, read=True)
        return res

    # ------------------------------------------------------------------ figures
    def _account(self, spec: PoolSpec, res: List[bool], t0: float, read: bool, written: int = 0) -> None:
        """Count one transfer, without waiting for anything (sync.Tally)."""
        self._tally.add((spec.name, spec.page_bytes, read, sum(res), len(res), written, time.perf_counter() - t0))

    def _fold(self, record: tuple) -> None:
        name, page, read, ok, n, written, seconds = record
        s = self._stats.setdefault(name, {"page_bytes": page, "hits": 0, "misses": 0, "bytes_read": 0, "sets": 0,
                                          "set_skipped": 0, "set_failed": 0, "bytes_written": 0, "seconds": 0.0})
        s["seconds"] += seconds
        if read:
            s["hits"] += ok
            s["misses"] += n - ok
            s["bytes_read"] += ok * page
        else:
            s["sets"] += written
            s["set_skipped"] += ok - written
            s["set_failed"] += n - ok
            s["bytes_written"] += written * page

    def stats(self) -> dict:
        return self._tally.read(lambda: {name: dict(s) for name, s in self._stats.items()})


def _what(host_pool, n: str) -> str:
    return f"MaruStorage: pool {n!r} ({type(host_pool).__name__}, layout {getattr(host_pool, 'layout', None)!r})"


def _page_meta(host_pool, n: str):
    """(pointers, sizes) of one page of a v2 pool, or ValueError saying why its pages are not addressable."""
    what = _what(host_pool, n)
    page_size = int(getattr(host_pool, "page_size", 1) or 1)
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
    return ptrs, sizes


def _pieces(spec: PoolSpec, host_indices, n: int) -> np.ndarray:
    return page_pieces(spec.host_pool, host_indices, n, spec.pieces_per_page, spec.page_bytes,
                       name=f"pool {spec.name!r}")
