"""Who in this process holds each block it owns: a kept list, or a call in flight (its ledger).

Kept blocks (owned by this process and unindexed: an overwrite's old block, one of ours that lost its
publication, a spare a single-key put reserved) serve the process's next allocations of a class, so most
puts take no class lock: no reader reaches them, no other process frees them, and the bitmap and counts
already say "used". At most KEEP_MAX blocks and KEEP_BYTES bytes per class (one at least): an idle process
holds back little. A call that may own blocks notes each in its ledger *before* its owner is written, so
at every bytecode each block this process owns is held by a kept list or an open ledger (DESIGN.md
section 9).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import crashpoints as _cp
from ..locking.guard import guard
from .blockmeta import BlockMetas, digest_bytes
from .classtable import ClassInfo
from .slabtable import SlabTable

KEEP_MAX = 16
KEEP_BYTES = 4 << 20
SPARE_BYTES = 64 << 10


def keep_limit(info: ClassInfo) -> int:
    """Blocks of a class a process keeps for reuse (KEEP_MAX, KEEP_BYTES, at least one)."""
    return max(1, min(KEEP_MAX, KEEP_BYTES // info.block))


def spare_limit(info: ClassInfo) -> int:
    """Blocks of a class a single-key put may hold beside its own: one class lock then serves that many
    more puts. Small classes only (SPARE_BYTES), where the lock costs more than the copy."""
    return min(KEEP_MAX, SPARE_BYTES // info.block)


class Ledger(list):
    """The offsets of the blocks one call took, in order; open until the call ends. `indexed`: those the index
    may name (claimed from it, or handed to it under their shard locks); the others it cannot."""

    __slots__ = ("open", "indexed")

    def __init__(self) -> None:
        super().__init__()
        self.indexed: set[int] = set()
        self.open = True


class KeptBlocks:
    def __init__(self, metas: BlockMetas, slabs: SlabTable):
        self.metas, self.slabs = metas, slabs
        self.lists: dict[int, list[tuple[int, int]]] = {}  # class id -> (offset, word) kept for reuse
        self.holders: dict[int, Ledger] = {}  # offset -> ledger of the call that last took the block
        self.strays = Ledger()  # blocks a failed settling left to close() (it stays open)
        self._local = threading.local()  # .ledger: the calling thread's call's
        self._guard = guard()  # threads of this process share the lists and the holders

    # ---------------------------------------------------------------- the calls' ledgers
    def begin(self) -> None:
        """A call that may own blocks starts its ledger (such calls never nest). A ledger still open here was
        left by a call whose `end` an exception cut short: it is closed first."""
        stale = getattr(self._local, "ledger", None)
        if stale is not None and stale.open:
            self.end()
        self._local.ledger = Ledger()

    def end(self) -> None:
        """The calling thread's call is over: close its ledger and forget its holds. Closed first: should
        an exception cut this short, what it still names counts as held by no one."""
        mine = getattr(self._local, "ledger", None)
        if mine is None:
            return
        mine.open = False
        with self._guard:
            holders = self.holders
            for off in mine:
                if holders.get(off) is mine:
                    del holders[off]
        self._local.ledger = None

    def track(self, offsets, indexed: bool = False) -> None:
        """Before these blocks become ours (their owner written): the calling thread's call, if it keeps a
        ledger, holds them (`indexed`: claimed from the index, which may still name them)."""
        if indexed:
            self.may_index(offsets)
        with self._guard:
            self._hold(offsets)

    def _hold(self, offsets) -> None:
        """Guard held: the calling thread's open call holds these blocks (before they become ours or leave a list)."""
        mine = getattr(self._local, "ledger", None)
        if mine is not None and mine.open:
            mine.extend(offsets)
            for off in offsets:
                self.holders[off] = mine

    def may_index(self, offsets) -> None:
        """Shard locks held, before blocks of the calling thread's call are published: the index may name
        them from here on (settling one then asks the index)."""
        mine = getattr(self._local, "ledger", None)
        if mine is not None and mine.open:
            mine.indexed.update(offsets)

    def held_by_call(self) -> tuple[list[int], set[int]]:
        """The blocks the calling thread's call still holds (its ledger, less what another holder took
        since), and those of them that no index entry can name."""
        mine = getattr(self._local, "ledger", None)
        if mine is None:
            return [], set()
        with self._guard:
            held = [off for off in dict.fromkeys(mine) if self.holders.get(off) is mine]
        return held, set(held) - mine.indexed

    def held_elsewhere(self, off: int) -> bool:
        """Does a kept list, or an open ledger other than the calling thread's, hold the block at `off`?"""
        mine = getattr(self._local, "ledger", None)
        with self._guard:
            h = self.holders.get(off)
            return (h is not None and h is not mine and h.open) or any(
                o == off for lst in self.lists.values() for o, _ in lst)

    def to_strays(self, offsets) -> None:
        """The calling thread's call could not settle these: they stay held, by `strays`, for close()."""
        mine = getattr(self._local, "ledger", None)
        with self._guard:
            for off in offsets:
                if self.holders.get(off) is mine:
                    self.holders[off] = self.strays
                    self.strays.append(off)

    def untracked(self, owned_now) -> list[int]:
        """The blocks this process owns (`owned_now()`, offsets) that no kept list and no open ledger holds: leaked.
        Read under the guard, which `track` waits for before any block becomes ours."""
        with self._guard:
            owned = owned_now()
            kept = {o for lst in self.lists.values() for o, _ in lst}
            return [off for off in owned if off not in kept and not (off in self.holders and self.holders[off].open)]

    def count(self, cid: int) -> int:
        return len(self.lists.get(cid, ()))

    def ours(self, cid: int, off: int, word: int, owner: int) -> bool:
        """Is `off` a block start of a slab of class cid whose meta still has this word and owner?"""
        loc = self.slabs.block_index(off)
        if loc is None or loc[1].cid != cid:
            return False
        mword, _, length, mowner, _, _ = self.metas.read(off)
        return mword == word and mowner == owner and length <= loc[1].block

    def offer(self, info: ClassInfo, items: list, owner: int) -> list:
        """Keep what fits under the limit of the blocks still ours with that word; return the rest (to free).
        A block this batch published and then evicted is not ours any more, nor is a non-block offset."""
        room = keep_limit(info) - len(self.lists.get(info.cid, ()))
        if room <= 0:
            return items
        keeping, rest = [], []
        for off, word in items:
            if len(keeping) < room and self.ours(info.cid, off, word, owner):
                keeping.append((off, word))
            else:
                rest.append((off, word))
        with self._guard:
            self.lists.setdefault(info.cid, []).extend(keeping)
        return rest

    def take_all(self) -> list[tuple[int, int]]:
        """Empty every list: the (offset, word) pairs it held, for the caller to free (its call holds them)."""
        with self._guard:
            items = [item for lst in self.lists.values() for item in lst]
            self._hold([off for off, _ in items])
            self.lists.clear()
        return items

    def give_back(self, cid: int, offsets: list[int]) -> None:
        """Spares (RESERVED blocks of ours, no value yet) join the list."""
        with self._guard:
            self.lists.setdefault(cid, []).extend(
                (off, self.metas.word(self.metas.meta_off(off))) for off in offsets)

    def reuse(self, info: ClassInfo, digests: np.ndarray, lengths: np.ndarray, owner: int, ref: int) -> list[int]:
        """Re-reserve kept blocks for the first values of a batch, without a lock (FORMAT.md section 8, put step
        6). A block whose word or owner is not what was kept (the pool was cleared) is dropped and left alone.
        No demand is counted: the class does not grow. `ref`: the eviction policy's value for a new lifetime."""
        m = len(lengths)
        with self._guard:
            lst = self.lists.get(info.cid)
            if not lst:
                return []
            take = lst[-m:]
            self._hold([off for off, _ in take])
            del lst[-m:]
        out: list[int] = []
        for off, word in take:
            if not self.ours(info.cid, off, word, owner):
                continue
            j = len(out)
            self.metas.re_reserve(self.metas.meta_off(off), word, digest_bytes(digests[j]), int(lengths[j]), owner,
                                  ref, _crash_mid_reuse)
            out.append(off)
        return out


def _crash_mid_reuse() -> None:
    if _cp.ARMED is not None:
        _cp.hit("alloc.mid_reuse")
