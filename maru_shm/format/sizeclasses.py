"""Size classes: fine geometric classes for any value, plus exact-fit classes declared at run time.

Part of the file format: creation writes the planned geometric classes into the class table, and a
pool's geometry (geometry.Geometry) counts them, so this math sits below layout.py and imports nothing
of the package.

Eight classes per doubling keep the internal waste of an arbitrary value
below 9 % (about 4.5 % on average); a page size known at run time (a KV page
from the SGLang host pool) gets a class of exactly its size, so its waste is 0.
"""

from __future__ import annotations

import functools
import math

MAX_BLOCKS_PER_SLAB = 256  # a slab's bitmap holds 256 bits (format.BITMAP_BYTES = 32)
KIND_GEOMETRIC = 1  # class entry kind of a geometric class (layout.py re-exports it with the other kinds)

CLASSES_PER_DOUBLING = 8
ALIGN = 64


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def geometric_sizes(granule: int, max_value: int) -> list[int]:
    """Block sizes from `granule` up to `max_value` (inclusive), 8 per doubling, 64-byte aligned."""
    sizes: list[int] = []
    i = 0
    while True:
        s = _round_up(math.ceil(granule * 2 ** (i / CLASSES_PER_DOUBLING)), ALIGN)
        if s >= max_value:
            sizes.append(max_value)
            return sizes
        if not sizes or s > sizes[-1]:
            sizes.append(s)
        i += 1


# Exact-fit slabs (KV pages) are at least this large, or 1/64 of the data area in a smaller pool:
# a batch of 128 pages then fills one or a few slabs instead of formatting one slab per few pages
# (measured: per-slab bookkeeping was a quarter of a 128 KiB batch's overhead with 2 MiB slabs).
EXACT_MIN_SLAB = 16 << 20
EXACT_SLAB_SHARE = 64


def slab_shape(block_size: int, unit_size: int, max_units: int = 64, min_bytes: int = 0) -> tuple[int, int]:
    """(units per slab, blocks per slab) for a class: the smallest slab that wastes <= 1 %.

    Blocks per slab are capped by the slab bitmap (256). When no k up to
    `max_units` gets under 1 %, the k with the least tail waste wins.
    `min_bytes` sets a floor on the slab size: exact-fit classes (KV pages)
    use `exact_slab_floor` so a batch of pages formats few slabs; geometric
    classes use the smallest slab, since each class in use keeps one slab
    half filled. The floor never asks for more blocks than a bitmap holds
    (a slab of 256 blocks is large enough: more would only be waste).
    """
    min_bytes = min(min_bytes, MAX_BLOCKS_PER_SLAB * block_size)
    min_units = max(1, -(-block_size // unit_size), -(-min_bytes // unit_size))
    best = None
    for k in range(min_units, max(min_units, max_units) + 1):
        n = min(k * unit_size // block_size, MAX_BLOCKS_PER_SLAB)
        if n == 0:
            continue
        waste = (k * unit_size - n * block_size) / (k * unit_size)
        if waste <= 0.01:
            return k, n
        if best is None or waste < best[0] - 1e-12:
            best = (waste, k, n)
        if n == MAX_BLOCKS_PER_SLAB:
            break
    assert best is not None
    return best[1], best[2]


def exact_slab_floor(data_bytes: int) -> int:
    """Minimum bytes of an exact-fit slab in a data area of `data_bytes`: EXACT_MIN_SLAB, or
    1/EXACT_SLAB_SHARE of the area in a small pool (a slab move there must not take a quarter of it)."""
    return min(EXACT_MIN_SLAB, data_bytes // EXACT_SLAB_SHARE)


@functools.lru_cache(maxsize=16)
def planned_geometric(granule: int, unit_size: int, max_value: int) -> tuple:
    """(kind, units per slab, block size, blocks per slab) of every geometric class, as creation writes
    them (poolfile._write_header): the only valid contents of geometric class entries."""
    out = []
    for block in geometric_sizes(granule, max_value):
        k, bps = slab_shape(block, unit_size)
        out.append((KIND_GEOMETRIC, k, block, bps))
    return tuple(out)
