"""The shared pool as the near tier: the KV pages of the registered host pool, moved with one store call a batch.

It owns every KV page I/O: the v1 calls (the host pool's pieces), the legacy calls (flat page tensors),
and the KV transfer of a v2 call (either, as interface_v1 says). MaruStorage (the SGLang adapter), the
hybrid pools (maru_sglang.hybrid) and TwoTiers (which adds a second tier behind this one) call it; it
calls none of them. It counts what SGLang's calls moved, for get_stats(); a promotion (pages another tier
just loaded, stored here) is counted by the caller, not as a set.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, List

import numpy as np
import torch

from maru_shm import Store

from ..namespace import KeySpace
from ..pages import check_host_indices, page_pieces, store_pages
from ..sync import Tally

LogOnce = Callable[[str, BaseException], None]
PER_CALL_KEPT = 10_000  # per-call figures kept for SGLang's StorageMetrics until drain() reads them


class LocalTier:
    """KV page I/O against the pool: leading run, load, store (skipping pages present), promotion; counted.

    `store()` is the pool's store (attached on first use, reopened if lost); `uses_pieces`: SGLang moves
    pages as get_page_buffer_meta pieces (interface_v1), else as flat page tensors."""

    def __init__(self, store: Callable[[], Store], keyspace: KeySpace, is_writer: bool, uses_pieces: bool,
                 log_once: LogOnce):
        self._store = store
        self.keyspace = keyspace
        self.is_writer = is_writer
        self.uses_pieces = uses_pieces
        self._log_once = log_once
        self.host_pool = None
        self.page_bytes: int | None = None
        self.pieces_per_page = 0
        self._tally = Tally("LocalTier's figures", self._fold)  # one record per call, folded into these:
        self.stats = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "sets": 0, "set_skipped": 0,
                      "set_failed": 0}
        self._per_call = {name: collections.deque(maxlen=PER_CALL_KEPT) for name in
                          ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")}

    def bind(self, host_pool, page_bytes: int, pieces_per_page: int) -> None:
        """The registered KV host pool and its page: `pieces_per_page` pieces, `page_bytes` in all."""
        self.host_pool, self.page_bytes, self.pieces_per_page = host_pool, page_bytes, pieces_per_page

    def _pieces(self, host_indices, n: int) -> np.ndarray:
        return page_pieces(self.host_pool, host_indices, n, self.pieces_per_page, name="host pool")

    # ------------------------------------------------------------ v1
    def exists(self, keys: List[str]) -> int:
        """Length of the leading run of keys stored as whole pages."""
        try:
            if not keys:
                return 0
            store = self._store()
            # a prefix query usually misses at once, or hits throughout: probe the first key alone first
            if store.length_of(digest=self.keyspace.digest(keys[0])) != self.page_bytes:
                return 0
            if len(keys) == 1:
                return 1
            return store.leading_hits(length=self.page_bytes, digests=self.keyspace.digests(keys))
        except Exception as e:
            self._log_once("batch_exists", e)
            return 0

    def mark_prefix(self, keys: List[str]) -> None:
        """Mark the stored copies of a lookup's prefix keys used, if the pool's policy has the prefix mark: the
        host serves these pages, and L3 keeps them for when it no longer does."""
        try:
            store = self._store()
            if store.policy.prefix_mark:
                store.touch(self.keyspace.digests(keys))
        except Exception as e:
            self._log_once("batch_exists", e)

    def get_v1(self, keys: List[str], host_indices) -> List[bool]:
        if not keys:
            return []
        try:
            t0 = time.perf_counter()
            pieces = self._pieces(host_indices, len(keys))
            res = self._store().batch_get_pieces(keys, pieces, digests=self.keyspace.digests(keys))
            self.account(res, t0, read=True)
            return res
        except Exception as e:
            self._log_once("batch_get_v1", e)
            return [False] * len(keys)

    def set_v1(self, keys: List[str], host_indices) -> List[bool]:
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)  # MLA: one writer rank stores the shared pages
        try:
            t0 = time.perf_counter()
            pieces = self._pieces(host_indices, len(keys))
            res, written = store_pages(self._store(), keys, self.keyspace.digests(keys), pieces, self.page_bytes)
            self.account(res, t0, read=False, written=written)
            return res
        except Exception as e:
            self._log_once("batch_set_v1", e)
            return [False] * len(keys)

    def promote_v1(self, keys: List[str], host_indices) -> int:
        """Store pages another tier just loaded into the host pool; the number of pages written."""
        try:
            pieces = self._pieces(host_indices, len(keys))
            return store_pages(self._store(), keys, self.keyspace.digests(keys), pieces, self.page_bytes)[1]
        except Exception as e:
            self._log_once("promoting pages from the second tier", e)
            return 0

    # ------------------------------------------------------------ legacy (flat page tensors)
    def get_flat(self, keys: List[str], targets) -> List[torch.Tensor | None]:
        """Load pages into flat page tensors (exact length required); each tensor, or None where it missed."""
        if not keys:
            return []
        if targets is None or any(t is None for t in targets):
            return [None] * len(keys)
        try:
            t0 = time.perf_counter()
            pieces = [_flat_piece(t) for t in targets]
            res = self._store().batch_get_pieces(keys, pieces, digests=self.keyspace.digests(keys))
            self.account(res, t0, read=True)
            return [t if ok else None for t, ok in zip(targets, res)]
        except Exception as e:
            self._log_once("batch_get", e)
            return [None] * len(keys)

    def set_flat(self, keys: List[str], values) -> bool:
        """Store flat page tensors, skipping pages present; True when every page is stored."""
        if not keys or not self.is_writer:
            return True
        if values is None or any(v is None for v in values):
            return False
        try:
            t0 = time.perf_counter()
            values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
            pieces = np.array([_flat_piece(v) for v in values], dtype=np.int64)  # (n, 1, 2)
            sizes = set(pieces[:, 0, 1].tolist())
            if len(sizes) != 1:
                raise ValueError(f"legacy pages of different sizes in one batch: {sorted(sizes)}")
            res, written = store_pages(self._store(), keys, self.keyspace.digests(keys), pieces, sizes.pop())
            self.account(res, t0, read=False, written=written)
            return all(res)
        except Exception as e:
            self._log_once("batch_set", e)
            return False

    # ------------------------------------------------------------ v2 (hybrid models)
    def io_v2(self, keys: List[str], host_indices, write: bool) -> List[bool]:
        """The KV transfer of a v2 call: the KV pages themselves, under the keys v1 and legacy calls use, moved
        as those calls move them (pieces with interface_v1, else one flat page tensor a key)."""
        if self.uses_pieces:
            return self.set_v1(keys, host_indices) if write else self.get_v1(keys, host_indices)
        host, ps = self.host_pool, int(getattr(self.host_pool, "page_size", 1) or 1)
        check_host_indices(host, host_indices, len(keys))
        out = []
        for i, key in enumerate(keys):
            at = int(host_indices[i * ps].item())
            if write:
                out.append(self.set_flat([key], [host.get_data_page(at, flat=True)]))
            else:
                page = self.get_flat([key], [host.get_dummy_flat_data_page()])[0]
                if page is not None:
                    host.set_from_flat_data_page(at, page)
                out.append(page is not None)
        return out

    # ------------------------------------------------------------ counts
    def account(self, res: List[bool], t0: float, read: bool, written: int = 0) -> None:
        """Count one call of SGLang's (v1 or legacy) that began at perf_counter() `t0`, without waiting for
        anything (sync.Tally)."""
        ok = sum(res)
        dt = max(time.perf_counter() - t0, 1e-9)
        gb = (ok if read else written) * (self.page_bytes or 0) / 1e9
        self._tally.add((read, ok, len(res), written, gb / dt))

    def _fold(self, record: tuple) -> None:
        read, ok, n, written, bw = record
        s, page, per_call = self.stats, self.page_bytes or 0, self._per_call
        if read:
            s["hits"] += ok
            s["misses"] += n - ok
            s["bytes_read"] += ok * page
            per_call["prefetch_pgs"].append(ok)
            per_call["prefetch_bandwidth"].append(bw)
        else:
            s["sets"] += written
            s["set_skipped"] += ok - written
            s["set_failed"] += n - ok
            s["bytes_written"] += written * page
            per_call["backup_pgs"].append(ok)
            per_call["backup_bandwidth"].append(bw)

    def drain(self, metrics) -> dict:
        """Move the per-call figures into SGLang's StorageMetrics `metrics`; the running totals."""
        def move() -> dict:
            for name, figures in self._per_call.items():
                getattr(metrics, name).extend(figures)
                figures.clear()
            return dict(self.stats)
        return self._tally.read(move)


def _flat_piece(t: torch.Tensor) -> list:
    """A flat page tensor as one piece, [[address, nbytes]]."""
    if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("legacy MaruStorage I/O needs contiguous CPU tensors")
    return [(t.data_ptr(), t.numel() * t.element_size())]
