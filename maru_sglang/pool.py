"""The pool one MaruStorage attaches to: opened once every page size is known, created for the smallest.

SGLang creates the backend before it registers any host pool, so the page sizes are unknown then. A pool
created that early would have 4 KiB granules and one index slot per 16 KiB: a 1 KiB page would take a 4 KiB
block, and the index would evict while the file was mostly free. Created for the smallest page
(Store.open's value_size), every page gets an exact-fit block and the data area fills before the index.
A pool created by another instance keeps its geometry; an instance whose pages it cannot hold densely says
so once, naming the key that sizes the pool for them.
"""

from __future__ import annotations

import logging
import threading

from maru_shm import PoolClosedError, SizeMismatchError, Store, StoreError, format_size

from .config import MaruConfig

logger = logging.getLogger("maru_sglang")


class SharedPool:
    """The attachment of one MaruStorage: `store` is None until attach(); every page size is declared."""

    def __init__(self, config: MaruConfig):
        self.config = config
        self.store: Store | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._warned: set[int] = set()

    def attach(self, pages: list) -> Store:
        """The store, opened on the first call: created (if absent) for the smallest of `pages`, (bytes, what)
        of every registered pool, and maru_min_page_bytes; then an exact-fit class for each page."""
        with self._lock:
            if self.store is None:
                if self._closed:
                    raise PoolClosedError("MaruStorage is closed")
                # a logical anchor's empty KV pages (0 bytes) are markers beside the pages of its v2 pools
                pages = [(n, what) for n, what in pages if n > 0]
                sizes = [n for n, _ in pages] + [self.config.min_page_bytes] * bool(self.config.min_page_bytes)
                self.store = self._open(min(sizes, default=None))
                for n, what in pages:
                    self._declare(n, what)
            return self.store

    def declare(self, page_bytes: int, what: str) -> None:
        """A page size of a pool registered now: declared at once if the store is open, else by attach()."""
        with self._lock:
            if self.store is not None and page_bytes > 0:
                self._declare(page_bytes, what)

    def close(self) -> Store | None:
        """No attach from now on; the store to close, if one was opened."""
        with self._lock:
            self._closed = True
            store, self.store = self.store, None
        return store

    def _declare(self, page_bytes: int, what: str) -> None:
        """An exact-fit class for the page; a clear error for a page the pool cannot hold, and one warning
        when the pool was created for larger values (by another instance, or before a later pool registered)."""
        store, path = self.store, self.config.path
        if page_bytes > store.max_value:
            raise ValueError(f"{what}: a page is {page_bytes} bytes but pool {path} holds values of at most "
                             f"{store.max_value} bytes; use a larger maru_pool_size")
        if page_bytes >= store.geo.granule:
            store.declare_size(page_bytes)
        short = store.geo.shortfalls(page_bytes)
        if short and page_bytes not in self._warned:
            self._warned.add(page_bytes)
            logger.warning(
                "maru: pool %s was created for larger values and cannot hold %d-byte pages densely: %s. Set "
                "maru_min_page_bytes=%d on every instance sharing the pool and re-create it (maru-shm destroy %s), "
                "or create it ahead with `maru-shm create %s --size ... --value-size %d`", path, page_bytes,
                "; ".join(short), page_bytes, path, path, page_bytes)

    def _open(self, value_size: int | None) -> Store:
        c = self.config
        try:
            # create=True also attaches to a ready pool, and formats again one whose creator died mid-format
            try:
                store = Store.open(c.path, size=c.pool_size, create=True, timeout=c.timeout_s, mode=c.mode,
                                   copy_threads=c.copy_threads, value_size=value_size)
            except SizeMismatchError:
                store = Store.open(c.path, create=True, timeout=c.timeout_s, mode=c.mode, copy_threads=c.copy_threads,
                                   value_size=value_size)
        except StoreError as e:
            raise RuntimeError(f"MaruStorage: cannot open pool {c.path}: {e}") from e
        if store.geo.file_size != c.pool_size and not store.created:
            logger.info("maru: using existing pool %s of %s (maru_pool_size applies only when creating)",
                        c.path, format_size(store.geo.file_size))
        if c.eager_map:
            store.populate()  # Maru's eager map: the whole pool is backed and mapped up front
        logger.info("maru: attached to %s (%s, %s granule, %d index slots, instance %s, slot %d)", c.path,
                    format_size(store.geo.file_size), format_size(store.geo.granule), store.geo.index_slots,
                    c.instance_id, store.slot)
        return store
