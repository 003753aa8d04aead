"""Mechanism: evict blocks within a class, chosen by the class's block CLOCK (DESIGN.md section 7).

The hand (class entry `hand`) walks the class's blocks in address order. A LIVE, unowned, unpinned block
whose `ref` count is 0 is a victim; a count above 0 is lowered by one as the hand passes (a hit raises it,
up to REF_MAX).
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format import (CLS_HAND, LIVE, META_COL_DIGEST, META_COL_TAIL, META_COL_WORD, META_TAIL_LENGTH_MASK, REF_MAX,
                      U64)
from .blockmeta import SMALL_BATCH, BlockMetas
from .classtable import ClassInfo
from .release import BlockRelease
from .slabtable import SlabTable


class BlockClock:
    def __init__(self, host, slabs: SlabTable, metas: BlockMetas, release: BlockRelease):
        self.host, self.slabs, self.metas, self.release = host, slabs, metas, release

    def evict_blocks(self, info: ClassInfo, m: int) -> int:
        """CLASS[c] held: evict up to m blocks of the class chosen by its block CLOCK; returns blocks freed.
        The victims are unpublished in one round of their shard locks (CLASS -> SHARD is the lock order),
        then freed, word first: a reader that found the entry before it went fails its second word check.
        """
        heads = np.asarray(self.slabs.class_slabs(info.cid), dtype=np.int64)
        if m <= 0 or not len(heads):
            return 0
        ring, rows = self._sweep(info, heads, m)
        if not len(ring):
            return 0
        vheads, vindex = heads[ring // info.bps], ring % info.bps
        voffs = vheads * self.slabs.geo.unit_size + vindex * info.block
        vwords = rows[:, META_COL_WORD]
        lens = rows[:, META_COL_TAIL] & np.uint64(META_TAIL_LENGTH_MASK)
        gone = self.host.unpublish_many(rows[:, META_COL_DIGEST:META_COL_DIGEST + 2], voffs.astype(np.uint64), vwords)
        # Free what we unpublished, and orphans (LIVE, unowned, not indexed); a block whose word moved on,
        # or that another process claimed by unpublishing it first, is not ours to free.
        g = voffs >> self.metas.shift
        now = self.metas.meta_q[g]
        ours = np.flatnonzero((now[:, META_COL_WORD] == vwords) & (gone | (BlockMetas.columns(now)[0] == 0)))
        self._free_victims(info, vheads[ours], vindex[ours], voffs[ours], g[ours], len(voffs) > SMALL_BATCH)
        evicted = gone[ours]
        self.host.count(evictions=int(evicted.sum()), evicted_bytes=int(lens[ours][evicted].sum()),
                        orphans_freed=int((~evicted).sum()))
        return len(ours)

    def _sweep(self, info: ClassInfo, heads: np.ndarray, m: int):
        """Move the hand over at most REF_MAX + 1 passes of the class's blocks until m victims are found:
        (their ring positions, their meta rows). Each pass lowers the `ref` count of the candidates it passes
        by one, so the last takes every candidate still there. The ring is read in chunks from the hand (a few
        victims never read a large class whole); no chunk spans the end of a pass, so each pass re-reads the
        counts the one before lowered. Positions t in [0, (REF_MAX + 1) n): ring index (p + t) mod n.
        """
        mm, geo, bps = self.slabs.mm, self.slabs.geo, info.bps
        n = len(heads) * bps
        co = geo.class_entry(info.cid)
        (hand,) = U64.unpack_from(mm, co + CLS_HAND)
        j = int(np.searchsorted(heads, hand >> 8))
        p = j * bps + ((hand & 0xFF) if j < len(heads) and heads[j] == hand >> 8 and (hand & 0xFF) < bps else 0)
        p %= n
        chunk = max(4 * m, 512)
        picked, rows = [], []  # per chunk: ring positions, meta rows
        got = t = 0
        refs = self.metas.meta_refs
        while t < (REF_MAX + 1) * n and got < m:
            t1 = min(t + chunk, (t // n + 1) * n)
            ring = (p + np.arange(t, t1, dtype=np.int64)) % n
            g, q, eligible, ref = self._read(info, heads, ring)
            if t >= n and picked:
                eligible &= ~np.isin(ring, np.concatenate(picked))  # taken in an earlier pass already
            victims = np.flatnonzero(eligible & ~ref)[:m - got]
            got += len(victims)
            end = int(victims.max()) + 1 if got == m else len(ring)
            passed = eligible & ref  # second chances: lowered as the hand passes
            passed[victims] = False
            passed = g[:end][passed[:end]]
            r = refs[passed]
            refs[passed] = np.minimum(r, REF_MAX) - (r > 0)  # a damaged count above REF_MAX costs no extra pass
            if len(victims):
                picked.append(ring[victims])
                rows.append(q[victims])
            t += end
        pos = (p + t) % n
        U64.pack_into(mm, co + CLS_HAND, (int(heads[pos // bps]) << 8) | (pos % bps))
        if not got:
            return np.zeros(0, dtype=np.int64), None
        return np.concatenate(picked), np.concatenate(rows)

    def _granules(self, info: ClassInfo, heads: np.ndarray, ring: np.ndarray) -> np.ndarray:
        """Ring positions -> the granules where their blocks start."""
        bps = info.bps
        return (heads[ring // bps] * self.slabs.geo.unit_size + (ring % bps) * info.block) >> self.metas.shift

    def _read(self, info: ClassInfo, heads: np.ndarray, ring: np.ndarray):
        """Ring positions -> (granules, meta rows, eligible, ref set): a candidate is LIVE, unowned, unpinned."""
        g = self._granules(info, heads, ring)
        q = self.metas.meta_q[g]
        owner, ref, pinned = BlockMetas.columns(q)
        return g, q, ((q[:, META_COL_WORD] & np.uint64(3)) == LIVE) & (owner == 0) & ~pinned, ref

    def _free_victims(self, info: ClassInfo, heads, index, offs, g, batch: bool) -> None:
        """Free victims still ours: a batch at once (release.free_many), a few block by block in victim order
        (no numpy call per slab)."""
        if batch:
            if len(g):
                self.release.free_many(info, heads, index, g)
            return
        for h, i, off in zip(heads.tolist(), index.tolist(), offs.tolist()):
            self.release.free_block(h, info, i, off)
            if _cp.ARMED is not None:
                _cp.hit("evict.block_mid")

