"""The pool one MaruStorage attaches to: opened once every page size is known, created for the smallest,
and opened again when it is lost.

SGLang creates the backend before it registers any host pool, so the page sizes are unknown then. A pool
created that early would have 4 KiB granules and one index slot per 16 KiB: a 1 KiB page would take a 4 KiB
block, and the index would evict while the file was mostly free. Created for the smallest page
(Store.open's value_size), every page gets an exact-fit block and the data area fills before the index.
A pool created by another instance keeps its geometry; an instance whose pages it cannot hold densely says
so once, naming the key that sizes the pool for them.

Healing (docs/DESIGN.md section 10). An operator may truncate, remove (`maru-shm destroy --force`) or re-create
the pool under a running server. The pool is lost when the store says so (`Store.lost()`: damage a call
met, or the path removed or naming another file), asked after a call failed with a StoreError, and on the
calls' path at most once per `maru_heal_retry_s` (one stat). Then:
- the store is detached at once, and closed by the thread that found the loss (close waits only for calls
  still inside it); the file now at the path is never touched through it;
- every call answers a miss (PoolDetachedError, which MaruStorage does not log) until the pool is reopened;
- a daemon thread reopens the path after `maru_heal_retry_s`, doubling the wait after each failure up to
  HEAL_MAX_WAIT_S: it attaches to a new pool, formats a truncated one again, or creates a removed one, sized
  as before (the smallest page); the first failure of each cause is logged;
- before any call reaches the new pool, every page size is declared there again and `on_reattach(store)`
  runs (MaruStorage's key space reads or restores its nonce there);
- the heal is counted in this process (`stats()`) and in the new pool (`Store.count_heal`, `heals` in
  `maru-shm inspect`): a new pool's counters start at 0, so the process that healed records itself there.
Each loss and each heal is logged once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Optional

from maru_shm import PoolClosedError, SizeMismatchError, Store, StoreError, format_size

from .config import MaruConfig
from .sync import Mutex, boundary

logger = logging.getLogger("maru_sglang")

HEAL_MAX_WAIT_S = 30.0  # the longest wait between two attempts to reopen a lost pool


class PoolDetachedError(PoolClosedError):
    """The pool was lost and is being reopened: the call answers a miss."""


class SharedPool:
    """The attachment of one MaruStorage: `store` is None until attach() and while a lost pool is reopened;
    every page size is declared."""

    def __init__(self, config: MaruConfig, on_reattach: Optional[Callable[[Store], None]] = None):
        self.config = config
        self.store: Store | None = None
        self._closed = False
        self._lock = Mutex("the pool's attachment")
        self._warned: set[int] = set()
        self._pages: dict[int, str] = {}  # every page size declared: declared again in a reopened pool
        self._value_size: int | None = None  # what a pool this instance creates is sized for
        self._eviction = "count"  # the ref rule of a pool this instance creates (Store.open's eviction)
        self._on_reattach = on_reattach
        self._lost: str | None = None  # why the pool is detached; None while attached (or not yet attached)
        self._next_check = 0.0  # monotonic time of the next path check on the calls' path
        self._stop = threading.Event()  # close(): the healing thread stops
        self._healer: threading.Thread | None = None
        self._counts = {"losses": 0, "heals": 0, "reopen_failures": 0}

    def attach(self, pages: list, eviction: str = "count") -> Store:
        """The store, opened on the first call: created (if absent) for the smallest of `pages`, (bytes, what)
        of every registered pool, and maru_min_page_bytes, with the ref rule `eviction`; then an exact-fit class
        for each page."""
        with self._lock:
            if self.store is None:
                if self._closed:
                    raise PoolClosedError("MaruStorage is closed")
                if self._lost is not None:
                    raise self._detached()
                # a logical anchor's empty KV pages (0 bytes) are markers beside the pages of its v2 pools
                pages = [(n, what) for n, what in pages if n > 0]
                sizes = [n for n, _ in pages] + [self.config.min_page_bytes] * bool(self.config.min_page_bytes)
                self._value_size, self._eviction = min(sizes, default=None), eviction
                self.store = self._open(self._value_size)
                self._next_check = time.monotonic() + self.config.heal_retry_s
                for n, what in pages:
                    self._pages.setdefault(n, what)
                    self._declare(self.store, n, what)
            return self.store

    def declare(self, page_bytes: int, what: str) -> None:
        """A page size of a pool registered now: declared at once if the store is open, else by attach()."""
        with self._lock:
            if page_bytes > 0:
                self._pages.setdefault(page_bytes, what)
                if self.store is not None:
                    self._declare(self.store, page_bytes, what)

    def current(self) -> Store | None:
        """The store for a call; None before the first attach (the caller attaches). Raises PoolDetachedError
        while a lost pool is reopened. Asks whether the pool is lost at most once per maru_heal_retry_s."""
        store = self.store
        if store is None or self._closed:
            if self._closed:
                raise PoolClosedError("MaruStorage is closed")
            if self._lost is not None:
                self._keep_healing()
                raise self._detached()
            return None
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.config.heal_retry_s
            if self._check(store):
                raise self._detached()
        return store

    def failed(self, exc: StoreError) -> bool:
        """After a call failed with `exc`: is the failure the pool's loss, logged once here (the call answers
        a miss)? So while detached; when the store says it is lost now (it is detached here); and for a
        PoolClosedError after a loss: a call that took the store just before this instance closed it."""
        store = self.store
        if store is None or self._closed:
            return self._lost is not None
        if isinstance(exc, PoolClosedError) and self._counts["losses"]:
            return True
        return self._check(store)

    def close(self) -> None:
        """No attach from now on, and no reopening; the store closed. A close that an exception cut short
        finishes when called again (the store is forgotten only once it is closed)."""
        self._stop.set()
        with self._lock:
            self._closed, self._lost = True, None
        store = self.store
        if store is not None:
            store.close()
            self.store = None

    def stats(self) -> dict:
        """state (attached, detached, closed, not attached), losses, heals, reopen_failures: this process's."""
        with self._lock:
            out = dict(self._counts)
            state = ("closed" if self._closed else "detached" if self._lost is not None
                     else "attached" if self.store is not None else "not attached")
        return dict(out, state=state)

    # ------------------------------------------------------------ healing
    def _detached(self) -> PoolDetachedError:
        return PoolDetachedError(f"pool {self.config.path} is detached ({self._lost}); reopening it")

    def _check(self, store: Store) -> bool:
        why = store.lost()
        if why is None:
            return False
        self._detach(store, why)
        return True

    def _detach(self, store: Store, why: StoreError) -> None:
        """Detach `store` (unless another thread did), close it, and start reopening the pool."""
        with self._lock:
            if self.store is not store:
                return
            self._lost = str(why)
            self.store = None
            self._counts["losses"] += 1
        logger.warning("maru: pool %s lost (%s); detached: calls answer misses until it is reopened, first try in "
                       "%.3g s", self.config.path, why, self.config.heal_retry_s)
        try:
            store.close()
        except Exception as e:  # a mapping still exported somewhere: the process's exit unmaps it
            logger.warning("maru: closing the lost pool %s: %s: %s", self.config.path, type(e).__name__, e)
        self._keep_healing()

    def _keep_healing(self) -> None:
        """Start the thread that reopens a lost pool, unless it runs. The calls ask too, while the pool is
        detached: an exception may have ended the one that detached it before it started the thread."""
        with self._lock:
            healer = self._healer
            if self._lost is None or self._closed or (healer is not None and healer.is_alive()):
                return
            self._healer = threading.Thread(target=self._heal, name="maru-heal", daemon=True)
            self._healer.start()

    @boundary
    def _heal(self) -> None:
        """Reopen the pool with backoff until it is attached again, or close() stops it."""
        wait, t0, seen = self.config.heal_retry_s, time.monotonic(), set()
        while not self._stop.wait(wait):
            store = None
            try:
                store = self._open(self._value_size)
                with self._lock:
                    pages = list(self._pages.items())
                for n, what in pages:
                    self._declare(store, n, what)
                if self._on_reattach is not None:
                    self._on_reattach(store)
            except Exception as e:
                with self._lock:
                    self._counts["reopen_failures"] += 1
                if store is not None:
                    with contextlib.suppress(Exception):
                        store.close()
                wait = min(wait * 2, max(HEAL_MAX_WAIT_S, self.config.heal_retry_s))
                if str(e) not in seen:  # each cause once: the loop retries it for as long as it lasts
                    seen.add(str(e))
                    logger.warning("maru: reopening pool %s failed: %s: %s; retrying, waits doubling up to %g s",
                                   self.config.path, type(e).__name__, e, wait)
                continue
            self._publish(store, time.monotonic() - t0)
            return

    def _publish(self, store: Store, took: float) -> None:
        with self._lock:
            stale = self._closed or self.store is not None  # closed meanwhile, or a second healer was first
            if not stale:
                self.store, self._lost = store, None
                self._next_check = time.monotonic() + self.config.heal_retry_s
                self._counts["heals"] += 1
            heals = self._counts["heals"]
        if stale:
            store.close()
            return
        try:
            store.count_heal()
        except StoreError as e:  # lost again already: the next call finds it
            logger.warning("maru: counting the heal in pool %s: %s", self.config.path, e)
        logger.info("maru: pool %s healed after %.1f s: %s (heal %d of this instance)", self.config.path, took,
                    "created it" if store.created else "opened it again", heals)

    # ------------------------------------------------------------ opening
    def _declare(self, store: Store, page_bytes: int, what: str) -> None:
        """An exact-fit class for the page; a clear error for a page the pool cannot hold, and one warning
        when the pool was created for larger values (by another instance, or before a later pool registered)."""
        path = self.config.path
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
                                   copy_threads=c.copy_threads, value_size=value_size, eviction=self._eviction)
            except SizeMismatchError:
                store = Store.open(c.path, create=True, timeout=c.timeout_s, mode=c.mode, copy_threads=c.copy_threads,
                                   value_size=value_size, eviction=self._eviction)
        except StoreError as e:
            raise RuntimeError(f"MaruStorage: cannot open pool {c.path}: {e}") from e
        if store.geo.file_size != c.pool_size and not store.created:
            logger.info("maru: using existing pool %s of %s (maru_pool_size applies only when creating)",
                        c.path, format_size(store.geo.file_size))
        if c.eager_map:
            try:
                store.populate()  # Maru's eager map: the whole pool is backed and mapped up front
            except BaseException:
                store.close()
                raise
        logger.info("maru: attached to %s (%s, %s granule, %d index slots, %s eviction, instance %s, slot %d)",
                    c.path, format_size(store.geo.file_size), format_size(store.geo.granule), store.geo.index_slots,
                    "age-stamp" if store.policy.age else "count CLOCK", c.instance_id, store.slot)
        return store
