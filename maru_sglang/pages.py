"""Pages of a host pool as the store sees them: piece tables, and the write of a batch that skips pages present.

Shared by the KV pages' tier (maru_sglang.tiers.local) and the v2 pools of hybrid
models (maru_sglang.hybrid): both describe a batch of pages with the host pool's
`get_page_buffer_meta` and move them with one store call.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np


def check_host_indices(host_pool, host_indices, n: int, name: str = "host pool") -> None:
    """Raise ValueError unless `host_indices` are n equal runs, one per page, each inside the host pool.

    A host pool turns an index into a pointer without a bound (`get_page_buffer_meta`): an index at or past
    its size, or below 0, would store bytes from outside its buffers as a page, or load a page past them.
    A page's pieces start at its first index, so that index is at most size - run as well. The bound is
    the pool's `logical_size` (the controller's index space; `size` where it has none); a pool that names
    neither is not checked. The message names no index, so that a caller repeating it is logged once.
    """
    size = getattr(host_pool, "logical_size", None)
    if size is None:
        size = getattr(host_pool, "size", None)
    if n == 0 or size is None:
        return
    idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices, dtype=np.int64).reshape(-1)
    if not idx.size or idx.size % n:
        raise ValueError(f"{name}: {idx.size} host indices for {n} pages")
    run = idx.size // n
    if idx.min() < 0 or idx.max() >= size or int(idx[::run].max()) > size - run:
        raise ValueError(f"{name}: host indices outside its {int(size)} slots (pages of {run})")


def host_indices_fit(host_pool, host_indices, n: int, refused) -> bool:
    """check_host_indices for a call that must not raise: False, and `refused(error)`, if the indices do not fit.
    The v1 calls ask it before anything moves, so that a refused call reaches neither the pool nor the second tier."""
    try:
        check_host_indices(host_pool, host_indices, n)
        return True
    except Exception as e:  # (a host_indices that is not an index array at all is refused the same way)
        refused(e)
        return False


def page_pieces(host_pool, host_indices, n: int, per: int, page_bytes: int | None = None,
                name: str = "host pool") -> np.ndarray:
    """(n, per, 2) int64 array of [address, nbytes] rows: the pieces of n pages, in the pool's order.

    Raises ValueError if the host indices are not n pages inside the pool (check_host_indices), or if
    the pool describes another number of pieces, or (with `page_bytes`) another number of bytes, than
    n pages of this pool have.
    """
    if per == 0:  # a logical anchor (DeepSeek-V4): every page is an empty value
        return np.zeros((n, 0, 2), dtype=np.int64)
    check_host_indices(host_pool, host_indices, n, name)
    meta = host_pool.get_page_buffer_meta(host_indices)
    if meta is None:
        raise ValueError(f"{name} returned no page pieces")
    ptrs, sizes = meta
    if len(ptrs) != per * n or len(sizes) != len(ptrs):
        raise ValueError(f"{name} described {len(ptrs)} pieces for {n} pages (expected {per} per page)")
    out = np.empty((n * per, 2), dtype=np.int64)
    out[:, 0] = ptrs
    out[:, 1] = sizes
    if page_bytes is not None and int(out[:, 1].sum()) != n * page_bytes:
        raise ValueError(f"{name} described {int(out[:, 1].sum())} bytes for {n} pages of {page_bytes}")
    return out.reshape(n, per, 2)


def mark_offered_again(store, digests: np.ndarray, found=None) -> None:
    """Stored pages a set offers again are marked used as a hit marks them (`Store.touch`; `found`: their
    lookup, whose ok keys are the stored ones), where the pool's eviction settings say so: a chain offered
    past a missing page has its gap filled by this call, and the pages after the gap serve hits again."""
    if store.policy.settings.offered_mark:
        store.touch(digests, found)


def store_pages(store, keys: List[str], digests: np.ndarray, pieces: np.ndarray,
                page_bytes: int) -> Tuple[List[bool], int]:
    """Write the pages not already stored with exactly `page_bytes` bytes; (per key ok, pages written).

    A page present is never written again (another instance wrote it first: same key, same bytes), and
    a key named twice in one call keeps its first copy, as SGLang's HiCacheFile does. Every key whose
    home slot holds an entry is looked up before the copy (`Store.maybe_present`; an empty home slot
    proves a key absent): a present page gets no block, so offering it again never makes room by
    evicting another value, whichever keys the index happens to have displaced; it is marked used
    (`mark_offered_again`). The pages written are
    checked again under their shard lock at publication (skip_existing, assume_absent): a page another
    process publishes meanwhile keeps its first copy.
    """
    n = len(keys)
    first = np.ones(n, dtype=bool)
    if len(set(keys)) != n:
        seen: set = set()
        for i, k in enumerate(keys):
            first[i] = k not in seen
            seen.add(k)
    present = ~first
    maybe = np.flatnonzero(store.maybe_present(digests) & first)
    if maybe.size:
        found = store.resolve(digests[maybe], full=False)
        found.ok &= found.lengths == page_bytes  # a value of another length is not this page
        present[maybe] = found.ok
        if found.ok.any():
            mark_offered_again(store, digests[maybe], found)
    todo = np.flatnonzero(~present)
    if not todo.size:
        return [True] * n, 0
    written: list = []  # a key another process published since the lookup is skipped at publication
    if todo.size == n:
        res = store.batch_put_pieces(keys, pieces, skip_existing=True, digests=digests, assume_absent=True,
                                     written=written)
        return res, sum(written)
    res = [True] * n
    sel = todo.tolist()
    put = store.batch_put_pieces([keys[i] for i in sel], pieces[todo], skip_existing=True, digests=digests[todo],
                                 assume_absent=True, written=written)
    for i, ok in zip(sel, put):
        res[i] = ok
    return res, sum(written)