"""Mechanism: evict blocks within a class, chosen by the class's block CLOCK (DESIGN.md sections 7 and 8).

The hand (class entry `hand`) walks the class's blocks in address order. A LIVE, unowned, unpinned block
whose `ref` count is 0 is a victim; a count above 0 is lowered by one as the hand passes (a hit raises it,
up to REF_MAX). Where the blocks carry relation records (relations.py), stranded values go first, then the
others segment by segment, deepest first: a request's pages in the class go together, and a chain loses its
tail before its head.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format import (CLS_HAND, LIVE, META_COL_DIGEST, META_COL_TAIL, META_COL_WORD, META_TAIL_LENGTH_MASK, REF_MAX,
                      U64)
from .blockmeta import SMALL_BATCH, BlockMetas
from .classtable import ClassInfo
from .relations import DEPTH_MAX, Relations
from .release import BlockRelease
from .slabtable import SlabTable


# Blocks one search for stranded values reads (whole slabs, at least one; 8192 pages of 128 KiB: 1 GiB). A
# larger class is searched in windows, each going on where this process's last one ended (its *lap*),
# reading 8 bytes of record a block and the metas only where a doom names the record.
STRANDED_SCAN = 8192


class BlockClock:
    def __init__(self, host, slabs: SlabTable, metas: BlockMetas, release: BlockRelease, relations: Relations):
        self.host, self.slabs, self.metas, self.release, self.relations = host, slabs, metas, release, relations
        # class id -> doom cursor at the start of this process's last lap over the whole class whose every
        # window took each stranded value it found: a doom strands only values written before it, so from
        # then on only newer dooms strand values there.
        self._searched_at: dict[int, int] = {}
        # class id -> (head unit of the last slab searched, doom cursor when the lap began): a lap under way.
        self._lap: dict[int, tuple[int, int]] = {}

    def evict_blocks(self, info: ClassInfo, m: int, stranded_only: bool = False) -> int:
        """CLASS[c] held: evict up to m blocks of the class chosen by its block CLOCK; returns blocks freed.
        stranded_only: only values a doom has stranded, in the class's next window of slabs (the hand stays).
        The victims are unpublished in one round of their shard locks (CLASS -> SHARD is the lock order),
        then freed, word first: a reader that found the entry before it went fails its second word check.
        """
        if stranded_only:
            since, cursor = self._searched_at.get(info.cid), self.relations.cursor()
            if not self.relations.doomed_any() or since == cursor or not self.relations.in_class(info.cid):
                return 0  # no doom was ever pushed, none since our last lap of this class, or no record in it
        heads = np.asarray(self.slabs.class_slabs(info.cid), dtype=np.int64)
        if m <= 0 or not len(heads):
            return 0
        if stranded_only:
            ring, rows, related = self._stranded_window(info, heads, m, since, cursor)
        else:
            ring, rows, related = self._sweep(info, heads, m)
        if not len(ring):
            return 0
        if related is not None:
            self.relations.doom(*related)
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
        (their ring positions, their meta rows, (records, stranded through the parent) of the related ones or
        None). Each pass lowers the `ref` count of the candidates it passes by one, so the last takes every
        candidate still there. The ring is read in chunks from the hand (a few victims never read a large
        class whole); no chunk spans the end of a pass, so each pass re-reads the counts the one before
        lowered. Positions t in [0, (REF_MAX + 1) n): ring index (p + t) mod n.
        """
        mm, geo, bps = self.slabs.mm, self.slabs.geo, info.bps
        n = len(heads) * bps
        co = geo.class_entry(info.cid)
        (hand,) = U64.unpack_from(mm, co + CLS_HAND)
        j = int(np.searchsorted(heads, hand >> 8))
        p = j * bps + ((hand & 0xFF) if j < len(heads) and heads[j] == hand >> 8 and (hand & 0xFF) < bps else 0)
        p %= n
        chunk = max(4 * m, 512)
        since = self._searched_at.get(info.cid)  # dooms before it stranded nothing left in the class
        picked, rows, related = [], [], []  # per chunk: ring positions, meta rows, (records, by parent)
        got = t = 0
        refs = self.metas.meta_refs
        while t < (REF_MAX + 1) * n and got < m:
            t1 = min(t + chunk, (t // n + 1) * n)
            ring = (p + np.arange(t, t1, dtype=np.int64)) % n
            g, q, eligible, ref = self._read(info, heads, ring)
            if t >= n and picked:
                eligible &= ~np.isin(ring, np.concatenate(picked))  # taken in an earlier pass already
            victims = self._choose(g, q, eligible, ref, m - got, related, since)
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
            return np.zeros(0, dtype=np.int64), None, None
        doomed = None
        if related:
            doomed = (np.concatenate([r for r, _ in related]), np.concatenate([b for _, b in related]))
        return np.concatenate(picked), np.concatenate(rows), doomed

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

    def _stranded_window(self, info: ClassInfo, heads: np.ndarray, m: int, since: int | None, cursor: int):
        """Up to m stranded values (by dooms from cursor `since` on, if given) in the class's next window of
        slabs, as _sweep returns them: a request's pages whose partner another class evicted are rarely near
        this class's hand. A window that yields fewer than m is done; the last one of a lap records the cursor
        its lap began at as `since`."""
        cid, per = info.cid, max(1, STRANDED_SCAN // info.bps)
        last, began = self._lap.get(cid, (-1, cursor))
        j = int(np.searchsorted(heads, last, side="right"))
        if j in (0, len(heads)):  # a lap begins at the first slab
            j, began = 0, cursor
        k = min(len(heads), j + per)
        out = self._stranded_in(info, heads, m, since, np.arange(j * info.bps, k * info.bps, dtype=np.int64))
        if len(out[0]) < m:
            if k == len(heads):
                self._searched_at[cid] = began
                self._lap.pop(cid, None)
            else:
                self._lap[cid] = (int(heads[k - 1]), began)
        return out

    def _stranded_in(self, info: ClassInfo, heads: np.ndarray, m: int, since: int | None, ring: np.ndarray):
        """Up to m stranded values among these ring positions (_stranded_window's result)."""
        # Records first (their first 8 bytes: group and parent): only a block whose group or parent a doom
        # names is read further.
        g = self._granules(info, heads, ring)
        ring = ring[self.relations.named(g, since)]
        if not len(ring):
            return np.zeros(0, dtype=np.int64), None, None
        g, q, eligible, _ = self._read(info, heads, ring)
        recs, valid = self.relations.of(g, q[:, META_COL_WORD])
        valid &= eligible
        by_group, by_parent = self.relations.stranded(recs, valid, since)
        victims = np.flatnonzero(valid & (by_group | by_parent))[:m]
        return ring[victims], q[victims], (recs[victims], by_parent[victims])

    def _choose(self, g, q, eligible, ref, want: int, related: list, since: int | None):
        """Up to `want` victims among one chunk of the ring (chunk positions). Without relation records the
        first unreferenced blocks in ring order (the plain CLOCK); with them, stranded values first (whatever
        their ref), then unreferenced ones in `_victim_order`; the related victims' records go to `related`.
        """
        rel = self.relations
        if rel.enabled:
            rows, valid = rel.of(g, q[:, META_COL_WORD])
            valid &= eligible
        if not rel.enabled or not valid.any():
            victims = np.flatnonzero(eligible & ~ref)[:want]
        else:
            by_group, by_parent = rel.stranded(rows, valid, since)
            stranded = eligible & (by_group | by_parent)
            plain = _victim_order(np.flatnonzero(eligible & ~ref & ~stranded), rows, valid)
            victims = np.concatenate([np.flatnonzero(stranded), plain])[:want]
            mine = victims[valid[victims]]
            if len(mine):
                related.append((rows[mine], by_parent[mine]))
        return victims

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


def _victim_order(plain: np.ndarray, rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Unreferenced candidates (chunk positions, ring order) reordered segment by segment, in the order of
    each segment's first candidate, deepest first within a segment. A value without a record is a segment
    of its own: a pool without records is evicted exactly as by the plain CLOCK."""
    if not len(plain):
        return plain
    ok = valid[plain]
    key = np.where(ok, rows["group"][plain], 0)
    _, first_at, inverse = np.unique(key, return_index=True, return_inverse=True)
    seg = np.where(ok, first_at[inverse], np.arange(len(plain)))
    depth = np.where(ok, (rows["depth"][plain] & DEPTH_MAX).astype(np.int64), 0)
    return plain[np.lexsort((-depth, seg))]
