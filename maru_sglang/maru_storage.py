"""MaruStorage: SGLang HiCache L3 backend on a maru_shm pool, loaded with `--hicache-storage-backend dynamic`.

A drop-in for Maru's `maru_sglang.maru_storage.MaruStorage` (same module path,
class name and `maru_*` keys) with no server: every SGLang process maps the
same pool file and moves pages directly between its host pool and the file.

- The page size in bytes comes from the registered host pool and becomes an
  exact-fit size class of the pool, so no byte of the file is padding (seed 000).
- Pages are copied piece by piece (K and V, or every layer, as
  `get_page_buffer_meta` describes them) straight between host memory and
  the mapping: no concatenation buffer.
- A page is loaded only if its stored length equals the expected page bytes
  exactly, and only from the same model, ranks and KV format.
- Batch calls never raise into SGLang's storage threads: failures are logged
  once per cause and reported as False.
- Hybrid models (Mamba, SWA, DSA, DeepSeek-V4 compressed pools) use the v2
  calls; their logic lives in maru_sglang.hybrid, these methods delegate.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo, PoolTransfer, PoolTransferResult)

from maru_shm import SizeMismatchError, Store, StoreError, format_size

from . import hybrid
from maru_shm import prefixed_digest, prefixed_digests

from .config import MaruConfig
from .namespace import kv_format_fingerprint, namespace_for
from .pages import page_pieces, store_pages

logger = logging.getLogger("maru_sglang")

SUPPORTED_LAYOUTS = ("page_first_direct", "page_first", "page_head", "layer_first", "page_first_kv_split")
NONCE_BYTES = 16


class MaruStorage(HiCacheStorage):
    """HiCacheStorage over one shared maru_shm pool file."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.config = MaruConfig.from_extra_config(storage_config.extra_config if storage_config else None)
        self.is_writer = bool(storage_config.is_storage_writer) if storage_config else True
        self.store = self._open_store()
        self.mem_pool_host = None
        self.page_bytes: int | None = None
        self.pieces_per_page = 0
        self._ns_base: str | None = None
        self._ns_cache: tuple[float, str] | None = None
        self._nonce: bytes | None = None  # the namespace nonce last read (restored if its record is evicted)
        self._logged: set = set()
        self._lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "sets": 0, "set_skipped": 0,
                       "set_failed": 0}
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self._v2_pools: dict[str, hybrid.PoolSpec] = {}  # extra host pools of hybrid models (v2 API)
        self._v2_stats: dict[str, dict] = {}

    # ------------------------------------------------------------ setup
    def _open_store(self) -> Store:
        c = self.config
        try:
            # create=True also attaches to a ready pool, and formats again one whose creator died mid-format
            try:
                store = Store.open(c.path, size=c.pool_size, create=True, timeout=c.timeout_s, mode=c.mode)
            except SizeMismatchError:
                store = Store.open(c.path, create=True, timeout=c.timeout_s, mode=c.mode)
        except StoreError as e:
            raise RuntimeError(f"MaruStorage: cannot open pool {c.path}: {e}") from e
        if store.geo.file_size != c.pool_size and not store.created:
            logger.info("maru: using existing pool %s of %s (maru_pool_size applies only when creating)",
                        c.path, format_size(store.geo.file_size))
        if c.eager_map:
            store.populate()  # Maru's eager map: the whole pool is backed and mapped up front
        logger.info("maru: attached to %s (%s, instance %s, slot %d)", c.path, format_size(store.geo.file_size),
                    c.instance_id, store.slot)
        return store

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Derive the page size from the host pool, declare it as an exact-fit class, fix the namespace."""
        super().register_mem_pool_host(mem_pool_host)
        layout = getattr(mem_pool_host, "layout", None)
        page_size = int(getattr(mem_pool_host, "page_size", 1))
        if getattr(mem_pool_host, "kv_buffer", True) is None:
            # a logical anchor (DeepSeek-V4): KV pages are empty markers, the data comes through the v2 pools
            hybrid.register_logical_anchor(self, mem_pool_host)
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
        if page_bytes > self.store.max_value:
            raise ValueError(f"MaruStorage: a page is {page_bytes} bytes but pool {self.config.path} holds values of "
                             f"at most {self.store.max_value} bytes; use a larger maru_pool_size")
        if page_bytes >= self.store.geo.granule:
            self.store.declare_size(page_bytes)
        else:  # below the smallest block: a fine geometric class holds it
            logger.info("maru: page of %d bytes is below the pool's %d-byte granule; no exact-fit class",
                        page_bytes, self.store.geo.granule)
        self.page_bytes = page_bytes
        self.pieces_per_page = len(ptrs)
        # v1 stores the pieces in get_page_buffer_meta order, legacy the flat get_data_page tensor; for
        # layer_first MHA these orders differ (K0 V0 K1 V1.. vs K0 K1.. V0 V1..), so they get separate keys.
        extra = (self.storage_config.extra_config or {}) if self.storage_config else {}
        io = "pieces" if bool(extra.get("interface_v1", 0)) else "flat"
        fp = kv_format_fingerprint(mem_pool_host, page_bytes, len(ptrs), io=io)
        self._ns_base = f"{namespace_for(self.storage_config)}|fmt-{fp}"
        self._ns_cache = None
        logger.info("maru: page size %s (%d pieces per page, layout %s), namespace %s",
                    format_size(page_bytes), len(ptrs), layout, self._ns_base)

    # ------------------------------------------------------------ namespace
    def _namespace(self) -> str:
        """Namespace prefix incl. the current clear() nonce (re-read at most every 50 ms)."""
        if self._ns_base is None:
            raise RuntimeError("MaruStorage used before register_mem_pool_host()")
        now = time.monotonic()
        cached = self._ns_cache
        if cached is not None and now - cached[0] < 0.05:
            return cached[1]
        rec = f"__maru_ns__/{self._ns_base}"
        nonce = self.store.get(rec)
        if nonce is None or len(nonce) != NONCE_BYTES:
            # Never written, or evicted (it is an ordinary small value and a full pool evicts). Restore
            # the nonce this process last saw rather than drawing a new one: an eviction of this record
            # must not hide every page of the namespace. Only clear() changes the nonce. The first
            # writer wins (skip_existing), so processes that disagree converge on one record.
            known = self._nonce if self._nonce is not None else os.urandom(NONCE_BYTES)
            self.store.batch_put([rec], [known], skip_existing=True)
            self._pin(rec)
            nonce = self.store.get(rec) or known
        self._nonce = nonce
        prefix = f"{self._ns_base}|{nonce.hex()}/"
        self._ns_cache = (now, prefix)
        return prefix

    def _pin(self, rec: str) -> None:
        """Keep the namespace record out of eviction: evicted, it would hide every page of the namespace
        from a process that never saw its nonce."""
        try:
            self.store.pin(rec)
        except StoreError as e:
            self._log_once("pinning the namespace record", e)

    def _keys(self, keys: List[str]) -> List[str]:
        ns = self._namespace()
        return [ns + k for k in keys]

    def _digests(self, keys: List[str]):
        """Store digests of this namespace's keys, (n, 16) uint8: the fast path for SGLang's SHA-256 page hashes."""
        return prefixed_digests(self._namespace(), keys)

    def _log_once(self, what: str, exc: BaseException) -> None:
        cause = (what, type(exc).__name__, str(exc)[:200])
        with self._lock:
            if cause in self._logged:
                return
            self._logged.add(cause)
        logger.error("maru: %s failed: %s: %s (further identical failures are not logged)",
                     what, type(exc).__name__, exc)

    def _pieces(self, host_indices, n: int) -> np.ndarray:
        return page_pieces(self.mem_pool_host, host_indices, n, self.pieces_per_page, name="host pool")

    # ------------------------------------------------------------ v1 interface
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Length of the leading run of keys present in the pool."""
        try:
            if not keys:
                return 0
            # a prefix query usually misses at once, or hits throughout: probe the first key alone first
            ns = self._namespace()
            if self.store.length_of(digest=prefixed_digest(ns, keys[0])) != self.page_bytes:
                return 0
            if len(keys) == 1:
                return 1
            return self.store.leading_hits(length=self.page_bytes, digests=prefixed_digests(ns, keys))
        except Exception as e:
            self._log_once("batch_exists", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Load pages into the host pool; True only where the stored value is exactly one page."""
        if not keys:
            return []
        try:
            t0 = time.perf_counter()
            pieces = self._pieces(host_indices, len(keys))
            res = self.store.batch_get_pieces(keys, pieces, digests=self._digests(keys))
            self._account(res, t0, read=True)
            return res
        except Exception as e:
            self._log_once("batch_get_v1", e)
            return [False] * len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from the host pool; keys already present are skipped (and reported True)."""
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)  # MLA: one writer rank stores the shared pages
        try:
            t0 = time.perf_counter()
            pieces = self._pieces(host_indices, len(keys))
            res, written = store_pages(self.store, keys, self._digests(keys), pieces, self.page_bytes)
            self._account(res, t0, read=False, written=written)
            return res
        except Exception as e:
            self._log_once("batch_set_v1", e)
            return [False] * len(keys)

    # ------------------------------------------------------------ v2 interface (hybrid models: maru_sglang.hybrid)
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """One extra pool (Mamba, SWA, indexer, DeepSeek-V4 compressed KV...): own page size, class and keys."""
        spec = hybrid.describe_pool(self, host_pool, host_pool_name)  # raises for a pool it cannot serve
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if not spec.is_kv:
            self._v2_pools[spec.name] = spec

    def on_host_pools_registered(self) -> None:
        logger.info("maru: host pools registered: kv %s; v2 pools: %s", format_size(self.page_bytes or 0),
                    hybrid.summary(self))

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        return hybrid.batch_exists_v2(self, keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return hybrid.batch_get_v2(self, transfers, extra_info)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        return hybrid.batch_set_v2(self, transfers, extra_info)

    def _account(self, res: List[bool], t0: float, read: bool, written: int = 0) -> None:
        ok = sum(res)
        dt = max(time.perf_counter() - t0, 1e-9)
        gb = (ok if read else written) * (self.page_bytes or 0) / 1e9
        with self._lock:
            if read:
                self._stats["hits"] += ok
                self._stats["misses"] += len(res) - ok
                self._stats["bytes_read"] += ok * (self.page_bytes or 0)
                self._prefetch_pgs.append(ok)
                self._prefetch_bw.append(gb / dt)
            else:
                self._stats["sets"] += written
                self._stats["set_skipped"] += ok - written
                self._stats["set_failed"] += len(res) - ok
                self._stats["bytes_written"] += written * (self.page_bytes or 0)
                self._backup_pgs.append(ok)
                self._backup_bw.append(gb / dt)

    # ------------------------------------------------------------ legacy interface
    def _tensor_piece(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("legacy MaruStorage I/O needs contiguous CPU tensors")
        return [(t.data_ptr(), t.numel() * t.element_size())]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Load one flat page into `target_location` (exact length required); the tensor or None."""
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Legacy batch load into flat page tensors; counted in get_stats() exactly as batch_get_v1."""
        if not keys:
            return []
        if target_locations is None or any(t is None for t in target_locations):
            return [None] * len(keys)
        try:
            t0 = time.perf_counter()
            pieces = [self._tensor_piece(t) for t in target_locations]
            res = self.store.batch_get_pieces(keys, pieces, digests=self._digests(keys))
            self._account(res, t0, read=True)
            return [t if ok else None for t, ok in zip(target_locations, res)]
        except Exception as e:
            self._log_once("batch_get", e)
            return [None] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Legacy batch store of flat page tensors: pages present are skipped, as in batch_set_v1, and the
        call is counted in get_stats() exactly as batch_set_v1."""
        if not keys or not self.is_writer:
            return True
        if values is None or any(v is None for v in values):
            return False
        try:
            t0 = time.perf_counter()
            values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
            pieces = np.array([self._tensor_piece(v) for v in values], dtype=np.int64)  # (n, 1, 2)
            sizes = set(pieces[:, 0, 1].tolist())
            if len(sizes) != 1:
                raise ValueError(f"legacy pages of different sizes in one batch: {sorted(sizes)}")
            res, written = store_pages(self.store, keys, self._digests(keys), pieces, sizes.pop())
            self._account(res, t0, read=False, written=written)
            return all(res)
        except Exception as e:
            self._log_once("batch_set", e)
            return False

    def exists(self, key: str) -> bool:
        try:
            return self.store.batch_exists(digests=self._digests([key]))[0]
        except Exception as e:
            self._log_once("exists", e)
            return False

    # ------------------------------------------------------------ housekeeping
    def clear(self) -> None:
        """Retire this instance's namespace: its pages become unreachable at once, eviction reclaims them."""
        if self._ns_base is None:
            return
        self._nonce = os.urandom(NONCE_BYTES)
        rec = f"__maru_ns__/{self._ns_base}"
        self.store.put(rec, self._nonce)
        self._pin(rec)
        self._ns_cache = None
        logger.info("maru: cleared namespace %s", self._ns_base)

    def close(self) -> None:
        """Detach from the pool (the pool and other instances' pages stay)."""
        store, self.store = self.store, None
        if store is not None:
            store.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def get_stats(self):
        """SGLang StorageMetrics (drained per call) with a `maru` dict: hits, misses, bytes, evictions."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            self._prefetch_pgs.clear()
            self._backup_pgs.clear()
            self._prefetch_bw.clear()
            self._backup_bw.clear()
            mine = dict(self._stats)
        try:  # called from the scheduler loop: never raise into it
            pool = self.store.stats() if self.store is not None else {}
        except Exception as e:
            self._log_once("get_stats", e)
            pool = {}
        mine.update({"evictions": pool.get("evictions", 0), "pool_entries": pool.get("entries", 0),
                     "pool_utilization": pool.get("utilization", 0.0), "page_bytes": self.page_bytes,
                     "pools": hybrid.pool_stats(self)})
        m.maru = mine
        return m
