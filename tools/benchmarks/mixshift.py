"""mixshift: a size class whose demand appears in a full pool, as when a second model starts beside a first.

Family A (128 KiB values) fills the pool by get-or-put over Zipf(0.9) keys; then A and B (384 KiB values,
another size class) are asked in turn, each Zipf(0.9) over its own keys. Hit ratios per family over the
second half of the shift, the same requests for every contestant:

  default     the store as it ships;
  no moves    the default with the slab move rule switched off (`retention`, as --prefixtree-ab does):
              a class that has a slab evicts within itself;
  exact LRU   over the pool's data-area bytes.

It is the family on which the slab move rule (allocator/demand.py) is measured: the prefix-tree family's
mix of classes never changes.
"""

from __future__ import annotations

import os

import numpy as np

from maru_shm import eviction_settings, format_size, pool_report, remove_pool

from .eviction import LRU, zipf_trace
from .registry import figure, pool_path, progress_of, scenario

NAME = "mixshift"
A_SIZE, B_SIZE = 128 << 10, 384 << 10


def shift_trace(n_a: int, n_b: int, fill: int, shift: int, seed: int = 5) -> np.ndarray:
    """Key ids: `fill` requests of A (ids < n_a), then `shift` requests alternating A and B (ids >= n_a)."""
    a = zipf_trace(n_a, fill + shift // 2, seed=seed)
    b = n_a + zipf_trace(n_b, shift - shift // 2, seed=seed + 1)
    tail = np.empty(shift, dtype=np.int64)
    tail[0::2], tail[1::2] = a[fill:], b
    return np.concatenate([a[:fill], tail])


def _count(hit: bool, is_b: bool, counts: list) -> None:
    counts[2 * is_b] += hit
    counts[2 * is_b + 1] += 1


def _slab_share(classes: list[dict], size: int) -> float:
    """Share of the slab units held by the classes whose blocks take `size`-byte values (pool_report's
    "classes" rows): the pool holds only two value sizes, so blocks of at least the larger are its."""
    units = [(r["block_size"] >= size, r["slabs"] * r["slab_units"]) for r in classes]
    return sum(u for big, u in units if big) / max(1, sum(u for _, u in units))


def run_store(trace, n_a: int, pool_bytes: int, measure_from: int, path: str, progress=None) -> dict:
    """Get-or-put of the trace against a fresh Store; per-family hits over trace[measure_from:]."""
    from maru_shm import Store

    sizes = [A_SIZE, B_SIZE]
    blob = memoryview(os.urandom(B_SIZE))
    out = bytearray(B_SIZE)
    counts = [0, 0, 0, 0]  # A hits, A asks, B hits, B asks
    tr = trace.tolist()
    try:
        with Store.open(path, size=pool_bytes, create=True, populate=True) as s:
            for i, k in enumerate(tr):
                is_b = k >= n_a
                key = f"{'b' if is_b else 'a'}{k}"
                hit = s.get_into(key, out) is not None
                if not hit:
                    s.put(key, blob[:sizes[is_b]])
                if i >= measure_from:
                    _count(hit, is_b, counts)
                if progress is not None and i % 4096 == 0:
                    progress(i / len(tr))
            share_b = _slab_share(pool_report(s)["classes"], B_SIZE)
            st, data_bytes, ok = s.stats(), s.geo.data_bytes, s.check().ok
    finally:
        remove_pool(path)
    return {"a_hit_ratio": counts[0] / max(1, counts[1]), "b_hit_ratio": counts[2] / max(1, counts[3]),
            "b_slab_share": share_b, "slab_moves": st["slab_moves"], "evictions": st["evictions"],
            "data_bytes": data_bytes, "check_ok": ok}


def run_lru(trace, n_a: int, capacity: int, measure_from: int) -> dict:
    lru, counts = LRU(capacity), [0, 0, 0, 0]
    for i, k in enumerate(trace.tolist()):
        is_b = k >= n_a
        hit = lru.access(k, B_SIZE if is_b else A_SIZE)
        if i >= measure_from:
            _count(hit, is_b, counts)
    b_bytes = sum(c for key, c in lru.items.items() if key >= n_a)
    return {"a_hit_ratio": counts[0] / max(1, counts[1]), "b_hit_ratio": counts[2] / max(1, counts[3]),
            "b_byte_share": b_bytes / max(1, lru.used)}


def mixshift(pool_bytes: int = 256 << 20, n_a: int = 4000, n_b: int = 1400, fill: int = 20_000,
             shift: int = 40_000, seed: int = 5, progress=None, path_prefix: str | None = None) -> dict:
    trace = shift_trace(n_a, n_b, fill, shift, seed)
    measure_from = fill + shift // 2
    prefix = path_prefix or pool_path(NAME)
    step = progress or (lambda f, note="": None)
    default = run_store(trace, n_a, pool_bytes, measure_from, f"{prefix}-default",
                        lambda f: step(0.45 * f, "default"))
    with eviction_settings(retention=False):
        no_moves = run_store(trace, n_a, pool_bytes, measure_from, f"{prefix}-nomoves",
                             lambda f: step(0.45 + 0.45 * f, "no moves"))
    step(0.9, "exact LRU")
    lru = run_lru(trace, n_a, default["data_bytes"], measure_from)
    return {"pool_bytes": pool_bytes, "value_sizes": [A_SIZE, B_SIZE], "keys": [n_a, n_b], "fill": fill,
            "shift": shift, "measured_requests": len(trace) - measure_from, "seed": seed,
            "default": default, "no_moves": no_moves, "lru": lru}


@scenario(NAME)
def bench_mixshift(args) -> dict:
    r = mixshift(progress=progress_of(args))
    figs = []
    for fam, size in (("b", B_SIZE), ("a", A_SIZE)):
        tag = (f"hit ratio of the {'new' if fam == 'b' else 'first'} class ({format_size(size)} values), "
               f"{format_size(r['pool_bytes'])} pool, after the shift")
        figs.append(figure(tag, r["default"][f"{fam}_hit_ratio"], r["no_moves"][f"{fam}_hit_ratio"],
                           "no slab moves between classes that hold slabs"))
        figs.append(figure(tag, r["default"][f"{fam}_hit_ratio"], r["lru"][f"{fam}_hit_ratio"],
                           "exact LRU, data-area bytes"))
    return {"scenario": NAME, **r, "figures": figs}
