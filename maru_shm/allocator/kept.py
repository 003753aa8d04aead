"""Blocks a process keeps for its own next allocations of a class, so most puts take no class lock.

A kept block is owned by this process and unindexed: an overwrite's old block or one of ours that lost
its publication (LIVE), or a spare a single-key put reserved beside its own block (RESERVED, no digest,
length 0). No reader can reach it through the index, no other process frees or evicts a block a live
process owns, and its bitmap bit and the class counts already say "used". `close` and a reaper settle
kept blocks like any block a process still owns. At most KEEP_MAX blocks and KEEP_BYTES bytes per class
(at least one block), so an idle process holds back little of the pool; spares at most SPARE_BYTES.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..guard import guard
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


class KeptBlocks:
    def __init__(self, metas: BlockMetas, slabs: SlabTable):
        self.metas, self.slabs = metas, slabs
        self.lists: dict[int, list[tuple[int, int]]] = {}  # class id -> (offset, word) kept for reuse
        self._guard = guard()  # threads of this process share the lists

    def has(self, cid: int) -> bool:
        return bool(self.lists.get(cid))

    def count(self, cid: int) -> int:
        return len(self.lists.get(cid, ()))

    def ours(self, cid: int, off: int, word: int, owner: int) -> bool:
        """Is `off` a block start of a slab of class cid whose meta still has this word and owner?"""
        loc = self.slabs.block_index(off)
        if loc is None or loc[1].cid != cid:
            return False
        mword, _, length, mowner, _ = self.metas.read(off)
        return mword == word and mowner == owner and length <= loc[1].block

    def offer(self, info: ClassInfo, items: list, owner: int) -> list:
        """Keep what fits under the limit of the blocks still ours with that word; return the rest (to free).

        A block published by this batch and then evicted by it is not ours any more: freed. A block that is
        not a block start of the class is never kept (trust no offset).
        """
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
        """Empty every list: the (offset, word) pairs it held, for the caller to free."""
        with self._guard:
            items = [item for lst in self.lists.values() for item in lst]
            self.lists.clear()
        return items

    def give_back(self, cid: int, offsets: list[int]) -> None:
        """RESERVED blocks of ours join the list: reused blocks an allocation could not finish with, and spares."""
        with self._guard:
            self.lists.setdefault(cid, []).extend(
                (off, self.metas.word(self.metas.meta_off(off))) for off in offsets)

    def reuse(self, info: ClassInfo, digests: np.ndarray, lengths: np.ndarray, owner: int) -> list[int]:
        """Re-reserve kept blocks for the first values of a batch; no lock.

        The owner moves a kept block LIVE -> RESERVED itself, as it moves RESERVED -> LIVE at commit: the
        word first (the next sequence: a reader still holding the old word fails validation from then
        on), then digest, length, owner, ref. A block whose word or owner is not what was kept (the pool
        was cleared) is dropped from the list and left alone. No demand is counted: the class does not
        grow. FORMAT.md section 8, put step 6.
        """
        m = len(lengths)
        with self._guard:
            lst = self.lists.get(info.cid)
            if not lst:
                return []
            take = lst[-m:]
            del lst[-m:]
        out: list[int] = []
        for off, word in take:
            if not self.ours(info.cid, off, word, owner):
                continue
            j = len(out)
            self.metas.re_reserve(self.metas.meta_off(off), word, digest_bytes(digests[j]), int(lengths[j]), owner,
                                  _crash_mid_reuse)
            out.append(off)
        return out


def _crash_mid_reuse() -> None:
    if _cp.ARMED is not None:
        _cp.hit("alloc.mid_reuse")
