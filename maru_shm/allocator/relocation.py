"""Mechanism: move the live values of slabs leaving their class into free blocks of the same class
(memcached's slab rescue), so that a slab move evicts only what does not fit (FORMAT.md section 8, DESIGN.md section 7).

An evicted value dooms its request (relations.py), and a window's values belong to many requests. So each
live value of the window is copied into a free block of its class elsewhere as a put would write it, and
its index entry is switched to the copy only if it still names the old block (`host.repoint_many`, under
the shard locks). Holding the CLASS locks of every class involved and POOL.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format import LIVE, META_REF_OFF, SLAB_NEXT, next_word, store_u64
from .blockmeta import BlockMetas
from .classtable import ClassInfo
from .relations import Relations
from .release import BlockRelease
from .slabtable import SlabTable, get32


class Relocator:
    def __init__(self, host, slabs: SlabTable, metas: BlockMetas, release: BlockRelease, relations: Relations):
        self.host, self.slabs, self.metas, self.release, self.relations = host, slabs, metas, release, relations

    def _partial_slabs(self, info: ClassInfo, leaving: set[int]) -> list[int]:
        """The class's partial slabs outside `leaving`, in list order; the walk stops at a damaged link."""
        slabs, out = self.slabs, []
        link = slabs.partial_head(info.cid)
        for _ in range(slabs.geo.n_units):  # bounded: a damaged list may loop
            if not link or not slabs.usable_partial(link - 1, info):
                break
            if link - 1 not in leaving:
                out.append(link - 1)
            link = get32(slabs.mm, slabs.geo.slab_entry(link - 1) + SLAB_NEXT)
        return out

    def room(self, info: ClassInfo, leaving: set[int]) -> int:
        """Free blocks of the class outside the slabs `leaving` (from the slabs' free counts: a hint)."""
        return sum(self.slabs.nfree(h) for h in self._partial_slabs(info, leaving))

    def relocate(self, info: ClassInfo, live: list, lengths: list, leaving: set[int]) -> np.ndarray:
        """Move live values (digest, offset, word) of the class out of the slabs `leaving`; the mask of those
        whose index entry now names the copy (the caller frees the old block with its slab). An entry a
        writer replaced or deleted meanwhile stays the writer's, and the copy is freed here. A length past
        the block is damage: that value is not copied."""
        moved = np.zeros(len(live), dtype=bool)
        which = [j for j, n in enumerate(lengths) if 0 <= n <= info.block]
        targets: list[int] = []
        for h in self._partial_slabs(info, leaving):
            if len(targets) >= len(which):
                break
            self.slabs.take_free(h, info, len(which) - len(targets), False, targets)
        which = which[:len(targets)]
        if not which:
            return moved
        values = [live[j] for j in which]
        words = self._copy(values, [int(lengths[j]) for j in which], targets)
        if _cp.ARMED is not None:
            _cp.hit("move.after_relocate")
        halves = np.frombuffer(b"".join(d for d, _, _ in values), dtype="<u8").reshape(-1, 2)
        switched = self.host.repoint_many(halves, np.array([o for _, o, _ in values], dtype=np.uint64),
                                          np.array([w for _, _, w in values], dtype=np.uint64),
                                          np.array(targets, dtype=np.uint64), np.array(words, dtype=np.uint64))
        lost = [(new, w) for new, w, ok in zip(targets, words, switched.tolist()) if not ok]  # a writer's entry won
        self.release.free_listed(info.cid, lost)
        moved[which] = switched
        return moved

    def _copy(self, values: list, lengths: list[int], targets: list[int]) -> list[int]:
        """Each value into its target as a put writes it: RESERVED by us, the bytes, the relation record,
        `ref`, then the word LIVE (still ours). The copies' words."""
        owner, metas, geo = self.host.owner, self.metas, self.slabs.geo
        words = []
        self.release.kept.track(targets)  # our call's ledger holds the copies until they are switched or freed
        data = np.frombuffer(self.slabs.mm, dtype=np.uint8, count=geo.data_bytes, offset=geo.off_data)
        try:
            for (d, old, _), length, new in zip(values, lengths, targets):
                metas.reserve(new, d, length, owner)
                data[new:new + length] = data[old:old + length]
                words.append(next_word(metas.word(metas.meta_off(new)), LIVE))
        finally:
            del data
        self._copy_records(values, targets, words)
        for (_, old, _), new, w in zip(values, targets, words):
            metas.mm[metas.meta_off(new) + META_REF_OFF] = metas.mm[metas.meta_off(old) + META_REF_OFF]
            store_u64(metas.mm, metas.meta_off(new), w)  # commit: LIVE, still ours
        return words

    def _copy_records(self, live: list, targets: list[int], words: list[int]) -> None:
        """Each copy takes its value's relation record (relations.py), for the copy's lifetime."""
        rel = self.relations
        if not rel.enabled:
            return
        old = np.array([o for _, o, _ in live], dtype=np.int64) >> self.metas.shift
        new = np.array(targets, dtype=np.int64) >> self.metas.shift
        rows = rel.records[old].copy()
        current = rows["tag"] == (np.array([w for _, _, w in live], dtype=np.uint64) & np.uint64(0xFFFF))
        rows["tag"] = np.array(words, dtype=np.uint64) & np.uint64(0xFFFF)
        rows["group"][~current] = 0  # a record of an earlier lifetime: the copy has none
        rel.records[new] = rows
