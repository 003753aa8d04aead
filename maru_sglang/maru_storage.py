"""MaruStorage: SGLang HiCache L3 backend on a maru_shm pool, loaded with `--hicache-storage-backend dynamic`.

A drop-in for Maru's `maru_sglang.maru_storage.MaruStorage` (same module path,
class name and `maru_*` keys) with no server: every SGLang process maps the
same pool file and moves pages directly between its host pool and the file.

- The page size in bytes comes from the registered host pool and becomes an
  exact-fit size class of the pool, so no byte of the file is padding.
- The pool is attached once every host pool is registered (SGLang's
  on_host_pools_registered(), or the first call that needs it), so that a pool
  this instance creates fits its smallest page (maru_sglang.sharedpool).
- Pages are copied piece by piece (K and V, or every layer, as
  `get_page_buffer_meta` describes them) straight between host memory and
  the mapping: no concatenation buffer.
- A page is loaded only if its stored length equals the expected page bytes
  exactly, and only from the same model, ranks and KV format.
- Batch calls never raise into SGLang's storage threads: failures are logged
  once per cause and reported as False.
- The pool heals: truncated, removed (`maru-shm destroy --force`) or re-created
  under the server, it is detached and reopened with backoff, and calls answer
  misses meanwhile (maru_sglang.sharedpool).
- The host's idle OpenMP workers sleep instead of spinning while the pool's processes
  oversubscribe the cores (maru_sglang.openmpwait): schedulers that share cores
  otherwise lose them to each other's spinning; one alone gains from the spin.
- Hybrid models (Mamba, SWA, DSA, DeepSeek-V4 compressed pools) use the v2
  calls; their logic lives in maru_sglang.hybrid, these methods delegate.
- Calls go one way: this adapter calls the parts it builds (LocalTier, HybridPools,
  TwoTiers, SecondTier), which are given what they use and never call it.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo, PoolTransfer, PoolTransferResult)

from maru_shm import Store, StoreError, format_size, pool_processes

from .config import MaruConfig
from .hybrid import HybridPools
from .tiers.local import LocalTier
from .namespace import KeySpace, kv_format_fingerprint, namespace_for
from .openmpwait import manage_idle_workers
from .pages import host_indices_fit
from .sharedpool import SharedPool
from .sync import public_calls
from .tiers.second import SecondTier
from .tiers.twotiers import TwoTiers

logger = logging.getLogger("maru_sglang")

POOL_COUNTS_EVERY_S = 1.0  # how stale get_stats' pool-wide eviction count may be
SUPPORTED_LAYOUTS = ("page_first_direct", "page_first", "page_head", "layer_first", "page_first_kv_split")


@public_calls
class MaruStorage(HiCacheStorage):
    """HiCacheStorage over one shared maru_shm pool file. Every public method is a boundary (sync.py): an
    exception that ends it, at any bytecode, leaves no mutex of the backend held."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.config = MaruConfig.from_extra_config(storage_config.extra_config if storage_config else None)
        self.is_writer = bool(storage_config.is_storage_writer) if storage_config else True
        self.mem_pool_host = None
        self._logged: dict = {}  # the causes logged (setdefault: one atomic step, no lock)
        store = lambda: self.store  # the parts below are given the store (reopened if lost), never this adapter
        self.keyspace = KeySpace(store, self.log_once)  # whose pages these are, and the clear() nonce
        # the store, attached once the page sizes are known, and reopened (the namespace adopted) if lost
        self.pool = SharedPool(self.config, on_reattach=self.keyspace.adopt)
        self.local = LocalTier(store, self.keyspace, self.is_writer, self.uses_pieces, self.log_once)  # KV pages
        # extra host pools of hybrid models (v2 API); a v2 call's KV transfer goes to the KV pages' tier
        self.hybrid = HybridPools(self.local, store, self.keyspace, storage_config, self.is_writer,
                                  self.pool.declare, self.log_once)
        self.tier2: SecondTier | None = None  # Mooncake Store behind the pool (maru_tier2), once pools are known
        self.tiers: TwoTiers | None = None
        self._counts_cache: tuple[float, dict] = (float("-inf"), {})  # (monotonic time read, Store.counts())
        # the scheduler's spinning OpenMP workers would take the cores it shares with the pool's other processes
        manage_idle_workers(self.config.openmp_wait, self._live_processes)

    def _live_processes(self) -> int | None:
        """Processes attached to the pool, this one included; None while it is not attached."""
        store = self.pool.current()
        return None if store is None else sum(1 for p in pool_processes(store) if p["alive"])

    @property
    def page_bytes(self) -> int | None:
        """Bytes of one KV page; None before register_mem_pool_host()."""
        return self.local.page_bytes

    @property
    def pieces_per_page(self) -> int:
        return self.local.pieces_per_page

    # ------------------------------------------------------------ setup
    @property
    def store(self) -> Store:
        """The pool, attached on first use: on_host_pools_registered(), once every page size is known.
        Raises PoolDetachedError (a StoreError) while a lost pool is reopened."""
        store = self.pool.current()
        return store if store is not None else self._attach()

    def _attach(self) -> Store:
        """A pool this instance creates gets age stamps for a plain model, the count CLOCK for a hybrid one (v2
        pools registered): each the rule that meets its model's goals (DESIGN.md section 8)."""
        if self.page_bytes is None:
            raise RuntimeError("MaruStorage used before register_mem_pool_host()")
        return self.pool.attach([(self.page_bytes, "MaruStorage"), *self.hybrid.pages()],
                                "count" if self.hybrid.pools else "age")

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Derive the page size from the host pool (an exact-fit class once the pool is attached), fix the
        namespace."""
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        page_size = int(getattr(mem_pool_host, "page_size", 1))
        if getattr(mem_pool_host, "kv_buffer", True) is None:
            # a logical anchor (DeepSeek-V4): KV pages are empty markers, the data comes through the v2 pools
            self._register_logical_anchor(mem_pool_host)
            return
        try:
            # one logical page: with DCP, SGLang's indices and get_page_buffer_meta count the widened page
            logical = int(getattr(mem_pool_host, "logical_page_size", page_size))
            sample = torch.arange(logical, dtype=torch.int64)
            ptrs, sizes = mem_pool_host.get_page_buffer_meta(sample)
        except Exception as e:  # the pool says which layouts it supports
            raise ValueError(
                f"MaruStorage: host pool {type(mem_pool_host).__name__} with layout {layout!r} cannot describe its "
                f"pages for zero-copy I/O ({e}); use --hicache-mem-layout with one of: "
                f"{', '.join(SUPPORTED_LAYOUTS)}") from e
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError(f"MaruStorage: host pool returned no page pieces for layout {layout!r}")
        page_bytes = int(sum(sizes))
        derived = int(mem_pool_host.get_size_per_token()) * page_size
        if page_bytes != derived:
            logger.info("maru: page pieces sum to %d bytes (size_per_token x page_size = %d); using the pieces",
                        page_bytes, derived)
        if self.config.chunk_size_bytes is not None and self.config.chunk_size_bytes != page_bytes:
            if self.config.chunk_size_bytes < page_bytes:
                raise ValueError(f"MaruStorage: maru_chunk_size_bytes={self.config.chunk_size_bytes} is smaller "
                                 f"than one page ({page_bytes} bytes)")
            logger.warning("maru: maru_chunk_size_bytes=%d ignored: pages are stored in an exact %d-byte class",
                           self.config.chunk_size_bytes, page_bytes)
        self.pool.declare(page_bytes, "MaruStorage")
        self.local.bind(mem_pool_host, page_bytes, len(ptrs))
        # v1 stores the pieces in get_page_buffer_meta order, legacy the flat get_data_page tensor; for
        # layer_first MHA these orders differ (K0 V0 K1 V1.. vs K0 K1.. V0 V1..), so they get separate keys.
        io = "pieces" if self.uses_pieces else "flat"
        fp = kv_format_fingerprint(mem_pool_host, page_bytes, len(ptrs), io=io)
        self.keyspace.set_base(f"{namespace_for(self.storage_config)}|fmt-{fp}")
        logger.info("maru: page size %s (%d pieces per page, layout %s), namespace %s",
                    format_size(page_bytes), len(ptrs), layout, self.keyspace.base)

    def _register_logical_anchor(self, mem_pool_host) -> None:
        """KV anchor without a KV tensor of its own (DeepSeek-V4's LogicalHostPool): KV pages are empty values.

        SGLang still writes and looks up one object per KV page (HiCacheFile writes an empty file per page
        via get_data_page, which is empty here); the page data lives in the side pools registered through v2.
        """
        self.local.bind(mem_pool_host, 0, 0)
        fp = kv_format_fingerprint(mem_pool_host, 0, 0, io="pieces" if self.uses_pieces else "flat")
        self.keyspace.set_base(f"{namespace_for(self.storage_config)}|fmt-{fp}")
        logger.info("maru: logical KV anchor %s (page of %d tokens, no KV bytes); namespace %s",
                    type(mem_pool_host).__name__, int(getattr(mem_pool_host, "page_size", 1)), self.keyspace.base)

    @property
    def uses_pieces(self) -> bool:
        """interface_v1: SGLang moves pages as get_page_buffer_meta pieces (else as flat page tensors)."""
        extra = (self.storage_config.extra_config or {}) if self.storage_config else {}
        return bool(extra.get("interface_v1", 0))

    # ------------------------------------------------------------ helpers
    def _digests(self, keys: List[str]):
        return self.keyspace.digests(keys)

    def log_once(self, what: str, exc: BaseException) -> None:
        """Log a failure once per cause: the storage threads call us in a loop, and never see us raise.
        A store failure that shows the pool lost is not logged here: SharedPool detaches and logs it once."""
        if isinstance(exc, StoreError) and self.pool.failed(exc):
            return
        cause, mine = (what, type(exc).__name__, str(exc)[:200]), object()
        if self._logged.setdefault(cause, mine) is not mine:
            return
        logger.error("maru: %s failed: %s: %s (further identical failures are not logged)",
                     what, type(exc).__name__, exc)

    # ------------------------------------------------------------ v1 interface
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Length of the leading run of keys present in the pool (then in the second tier, if any). The pool's
        copies of the prefix keys (pages the host holds) are marked used where the eviction policy says so."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if prefix:
            self.local.mark_prefix(prefix)
        local = self.local_exists(keys)
        return self.tiers.exists(keys, local) if self.tiers is not None else local

    def local_exists(self, keys: List[str]) -> int:
        """The pool's leading run alone (the second tier not asked)."""
        return self.local.exists(keys)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Load pages into the host pool; True only where the stored value is exactly one page."""
        if not host_indices_fit(self.mem_pool_host, host_indices, len(keys), partial(self.log_once, "batch_get_v1")):
            return [False] * len(keys)
        res = self.local_get_v1(keys, host_indices)
        return self.tiers.fill(keys, host_indices, res) if self.tiers is not None and keys else res

    def local_get_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        return self.local.get_v1(keys, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from the host pool (and the second tier); keys already present are skipped (True)."""
        if not host_indices_fit(self.mem_pool_host, host_indices, len(keys), partial(self.log_once, "batch_set_v1")):
            return [False] * len(keys)
        res = self.local_set_v1(keys, host_indices)
        if self.tiers is not None and keys and self.is_writer:
            return self.tiers.write_through(keys, host_indices, res)
        return res

    def local_set_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        return self.local.set_v1(keys, host_indices)

    # ------------------------------------------------------------ v2 interface (hybrid models: maru_sglang.hybrid)
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """One extra pool (Mamba, SWA, indexer, DeepSeek-V4 compressed KV...): own page size, class and keys."""
        spec = self.hybrid.describe(host_pool, host_pool_name)  # raises for a pool it cannot serve
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.hybrid.register(spec)
        if self.tier2 is not None and not spec.is_kv:
            self.tier2.register_v2(host_pool, spec.name)

    def on_host_pools_registered(self) -> None:
        """Every host pool is known: attach the pool (created for the smallest page), then the second tier."""
        self._attach()
        logger.info("maru: host pools registered: kv %s; v2 pools: %s", format_size(self.page_bytes or 0),
                    self.hybrid.summary())
        self._start_tier2()

    def _start_tier2(self) -> None:
        """Attach the second tier in the background (maru_tier2): SGLang starts on the pool alone."""
        if self.config.tier2 is None or self.tier2 is not None:
            return
        if not self.uses_pieces:
            raise ValueError("MaruStorage: maru_tier2 needs zero-copy page I/O: add \"interface_v1\": 1 to the "
                             "extra config")
        self.tier2 = SecondTier(self.config.tier2, self.config.tier2_retry_s, self.log_once)
        for spec in self.hybrid.pools.values():
            self.tier2.register_v2(spec.host_pool, spec.name)
        self.tier2.start(self.storage_config, self.mem_pool_host, self.keyspace.tier_tag(self.hybrid.tags()),
                         status=(self.config.path, self.config.instance_id, self.config.mode, self.store.slot))
        self.tiers = TwoTiers(self.local, self.hybrid, self.tier2, self.is_writer, self.log_once)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        local = self.hybrid.batch_exists_v2(keys, pool_transfers)
        return self.tiers.exists_v2(keys, pool_transfers, local) if self.tiers is not None else local

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        res = self.hybrid.batch_io_v2(transfers, write=False)
        return self.tiers.fill_v2(transfers, res) if self.tiers is not None else res

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        res = self.hybrid.batch_io_v2(transfers, write=True)
        if self.tiers is None:
            return res
        return self.tiers.write_through_v2(self.hybrid.written_by_this_rank(transfers), res)

    # ------------------------------------------------------------ legacy interface
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Load one flat page into `target_location` (exact length required); the tensor or None."""
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Legacy batch load into flat page tensors; counted in get_stats() exactly as batch_get_v1."""
        return self.local.get_flat(keys, target_locations)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Legacy batch store of flat page tensors: pages present are skipped, as in batch_set_v1, and the
        call is counted in get_stats() exactly as batch_set_v1."""
        return self.local.set_flat(keys, values)

    def exists(self, key: str) -> bool:
        try:
            return self.store.batch_exists(digests=self._digests([key]))[0]
        except Exception as e:
            self.log_once("exists", e)
            return False

    # ------------------------------------------------------------ housekeeping
    def clear(self) -> None:
        """Retire this instance's namespace: its pages become unreachable at once, eviction reclaims them."""
        if self.keyspace.base is None:
            return
        self.keyspace.clear()
        logger.info("maru: cleared namespace %s", self.keyspace.base)

    def close(self) -> None:
        """Detach from the pool (the pool and other instances' pages stay) and from the second tier."""
        if self.tier2 is not None:
            self.tier2.close()
        self.pool.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def get_stats(self):
        """SGLang StorageMetrics (drained per call) with a `maru` dict: hits, misses, bytes, pool evictions.

        SGLang calls this on its scheduler thread once per step, so it reads counters only: the pool-wide
        figures that scan the pool (entries, utilization) are `maru-shm inspect`'s."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        m = StorageMetrics()
        try:  # called from the scheduler loop: never raise into it
            m.maru = self._figures(m)
        except Exception as e:
            self.log_once("get_stats", e)
            m.maru = {}
        return m

    def _figures(self, m) -> dict:
        mine = self.local.drain(m)
        pool = self._pool_counts()
        mine.update({"evictions": pool.get("evictions", 0), "page_bytes": self.page_bytes,
                     "pools": self.hybrid.stats(), "pool": self.pool.stats()})
        if self.tier2 is not None:
            mine["tier2"] = self.tier2.stats()
        return mine

    def _pool_counts(self) -> dict:
        """The pool-wide counters, read at most every POOL_COUNTS_EVERY_S: get_stats runs once per scheduler
        loop, and a loop that waits on a prefetch turns thousands of times a second (SGLang's on_idle)."""
        now = time.monotonic()
        read_at, counts = self._counts_cache
        if now - read_at < POOL_COUNTS_EVERY_S:
            return counts
        try:
            store = self.pool.store  # None before the pool is attached and after close()
            counts = store.counts() if store is not None else {}
        except Exception as e:
            self.log_once("get_stats", e)
            counts = {}
        self._counts_cache = (now, counts)
        return counts
