"""The allocator's locks, each paired with the repair its next holder runs if a holder died inside.

CLASS[c] guards class c's slabs, bitmaps, counts and block lifetimes; POOL guards unit states and the
free floor. Lock order (locks.py): CLASSTAB, CLASS by id, POOL, SHARD by id.
"""

from __future__ import annotations

from ..format.layout import CLASS_LOCK_BASE, LOCK_POOL


class AllocatorLocks:
    def __init__(self, locks):
        self.locks = locks
        self.repair_class = None  # (cid) -> fixes: set once the repairer exists
        self.repair_pool = None   # () -> fixes

    def class_lock(self, cid: int):
        return self.locks.hold(CLASS_LOCK_BASE + cid, repair=lambda: self.repair_class(cid))

    def pool_lock(self):
        return self.locks.hold(LOCK_POOL, repair=self.repair_pool)

    def try_class(self, cid: int):
        """Take CLASS[cid] without waiting: None if busy, else True if it was left dirty (repair it)."""
        return self.locks.acquire(CLASS_LOCK_BASE + cid, blocking=False)

    def release_class(self, cid: int, clean: bool = True) -> None:
        """Give back a try_class lock; clean=False keeps its dirty mark (the section did not finish)."""
        self.locks.release(CLASS_LOCK_BASE + cid, clean=clean)
