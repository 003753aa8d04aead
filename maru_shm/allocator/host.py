"""What the allocator needs from the layer above it, declared: the allocator never sees the Store.

Evicting a published block means unpublishing it (the index side, under SHARD locks); freeing a LIVE
block in a repair means asking whether it is still indexed; reaping asks whether an owner is alive.
Those answers live above the allocator (the index is its sibling, not its child), so they come in
through this interface: the store implements it for real, the read-only checks with what a reader may
do, and tests with what they need.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class AllocatorHost(Protocol):
    geo: object  # format.Geometry of the pool
    mm: object   # the mapping
    locks: object  # locks.LockTable (or a stand-in that takes no lock, for a holder of every lock)
    owner: int  # this process's owner id in block metas (slot + 1)

    def count(self, **counters: int) -> None:
        """Add to this process's counters (names in format.COUNTER_NAMES)."""

    def slot_alive(self, owner_plus1: int) -> bool:
        """Is the process whose owner id (slot + 1) this is alive?"""

    def indexed_many(self, blocks: Sequence[tuple[bytes, int, int, int]]) -> list[bool]:
        """Per (digest, offset, word, disown): is that block the published value of its digest? (SHARD locks;
        clears the owner `disown` of an indexed block while it is pinned)."""

    def unpublish_many(self, halves: np.ndarray, offsets: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Remove the index entries naming these blocks; the mask of entries removed (SHARD locks)."""
