"""Slab allocator over the pool's data area: size classes, slabs, bitmaps, free lists, eviction.

memcached's design, moved into one shared file: the data area is cut into
units, a run of units formatted for one size class is a slab, each slab has a
bitmap of its blocks and sits on its class's partial list while it has free
ones, and slabs go back to the shared pool of units when emptied or evicted,
so no class can calcify. One module per concept; facade.py lists them.
"""

from .classtable import ClassInfo
from .facade import Allocator
from .host import AllocatorHost

__all__ = ["Allocator", "AllocatorHost", "ClassInfo"]
