"""Sharded open-addressing index: key digest -> (block word, data offset).

Each shard is its own linear-probing table with its own lock, so writers of
different keys rarely meet. Readers take no lock: they may see an entry
mid-update, which is why a hit is only believed after the block meta agrees
(see maru_shm.datapath.validity). Deletion shifts later entries back (no tombstones), and
a shard never exceeds 7/8 load: the writer evicts a cold entry first.
"""

from __future__ import annotations

import struct

import numpy as np

from .. import crashpoints as _cp
from ..errors import CorruptPoolError
from ..format.layout import (ENTRY_COLS, ENTRY_COL_DIGEST, ENTRY_COL_OFFSET, ENTRY_COL_WORD, ENTRY_OFFSET_OFF,
                             ENTRY_SIZE, ENTRY_STRUCT, ENTRY_WORD_OFF, SHARD_COUNT_OFF, SHARD_HEADER, SHARD_STRUCT,
                             U32, shard_limit, store_u64)
from ..format.geometry import Geometry

_ZERO_ENTRY = bytes(ENTRY_SIZE)
_D0, _D1, _WORD, _OFFSET = ENTRY_COL_DIGEST, ENTRY_COL_DIGEST + 1, ENTRY_COL_WORD, ENTRY_COL_OFFSET  # table columns
ABSENT, UNDECIDED = -1, -2  # Index.probe: an empty slot ended the probe / the window ended it
INSERT_WINDOW = 8  # insert_absent: slots after an occupied home slot searched for an empty one




def _member(a: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    """Elementwise: is a's value in `sorted_values`? (np.isin sorts both sides on each call.)"""
    if not sorted_values.size:
        return np.zeros(a.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_values, a), sorted_values.size - 1)
    return sorted_values[pos] == a


def _replace_entry(mm, e: int, word: int, offset: int) -> None:
    """Point the entry at file offset e at another block of its key: the offset, then the word. A reader
    pairing the old word with the new offset fails block validation: a miss. A death in between leaves
    the torn entry shard repair completes (FORMAT.md section 9)."""
    store_u64(mm, e + ENTRY_OFFSET_OFF, offset)
    if _cp.ARMED is not None:
        _cp.hit("index.mid_replace")
    store_u64(mm, e + ENTRY_WORD_OFF, word)


_HALVES = struct.Struct("<QQ")  # a digest as its two little-endian u64 halves (shard, home slot)


class Index:
    """View of the index regions of one mapped pool."""

    def __init__(self, mm, geo: Geometry):
        self.mm = mm
        self.off = geo.off_index
        self.off_hdr = geo.off_shards
        self.nshards = geo.index_shards
        self.slots = geo.shard_slots
        self.smask = geo.index_shards - 1
        self.mask = geo.shard_slots - 1
        self.limit = shard_limit(geo.shard_slots)
        self.shard_bytes = geo.shard_slots * ENTRY_SIZE
        # every entry as a row of u64 (digest lo, digest hi, word, offset): batch gathers and inserts
        self.table = np.ndarray((self.nshards * self.slots, ENTRY_COLS), dtype="<u8", buffer=mm, offset=self.off)
        self.smask_u = np.uint64(self.smask)
        self.mask_u = np.uint64(self.mask)
        self.slots_u = np.uint64(self.slots)

    def release_views(self) -> None:
        """Drop the numpy view so the mapping can be closed."""
        self.table = None

    def home_entries(self, h0: np.ndarray, h1: np.ndarray) -> np.ndarray:
        """Entries (rows of u64) in the home slots of digests given as u64 halves (take: no cast check of u64 rows)."""
        return self.table.take((h0 & self.smask_u) * self.slots_u + (h1 & self.mask_u), axis=0)

    # -- addressing ---------------------------------------------------------
    def shard_of(self, d: bytes) -> int:
        return _HALVES.unpack(d)[0] & self.smask

    def home_of(self, d: bytes) -> int:
        return _HALVES.unpack(d)[1] & self.mask

    def entry_off(self, shard: int, pos: int) -> int:
        return self.off + shard * self.shard_bytes + pos * ENTRY_SIZE

    # -- lock-free lookup ------------------------------------------------------
    def find(self, d: bytes):
        """(word, offset) of the entry for digest d, or None. No lock; bounded probe."""
        h0, h1 = _HALVES.unpack(d)
        base = self.off + (h0 & self.smask) * self.shard_bytes
        pos = h1 & self.mask
        mm, unpack, mask = self.mm, ENTRY_STRUCT.unpack_from, self.mask
        for _ in range(self.slots):
            ed, word, offset = unpack(mm, base + pos * ENTRY_SIZE)
            if word == 0:
                return None
            if ed == d:
                return word, offset
            pos = (pos + 1) & mask
        return None

    def probe(self, h0: np.ndarray, h1: np.ndarray, window: int, first_step: int = 0) -> np.ndarray:
        """Row of `table` holding each digest's entry (given its u64 halves); ABSENT if the probe met an
        empty slot first, UNDECIDED if neither happened within `window` slots (linear probing, as
        `find`, for a batch), starting `first_step` slots after the home slot. No lock.

        All `window` slots of every key are gathered at once (one numpy pass, not one per step): the
        first slot that is empty or holds the key decides. An entry whose word is 0 counts as empty, as
        in `find`: a writer stores the digest before the word, so it is not published yet.
        """
        n = len(h0)
        base = (h0 & self.smask_u).astype(np.int64) * self.slots
        steps = np.arange(first_step, first_step + window, dtype=np.int64)
        r = base[:, None] + (((h1 & self.mask_u).astype(np.int64)[:, None] + steps) & self.mask)  # (n, window)
        e = self.table[r]
        empty = e[:, :, _WORD] == 0
        hit = ~empty & (e[:, :, _D0] == h0[:, None]) & (e[:, :, _D1] == h1[:, None])
        first = (empty | hit).argmax(axis=1)
        at = np.arange(n)
        return np.where(hit[at, first], r[at, first], np.where(empty[at, first], ABSENT, UNDECIDED))

    # -- under the shard lock ----------------------------------------------------
    def count(self, shard: int) -> int:
        return SHARD_STRUCT.unpack_from(self.mm, self.off_hdr + shard * SHARD_HEADER)[0]

    def _set_count(self, shard: int, n: int) -> None:
        n &= 0xFFFFFFFF  # a damaged count + 1 wraps (shard repair recounts)
        U32.pack_into(self.mm, self.off_hdr + shard * SHARD_HEADER + SHARD_COUNT_OFF, n)  # one 4-byte store

    def _find_pos(self, shard: int, d: bytes):
        base = self.off + shard * self.shard_bytes
        pos = _HALVES.unpack(d)[1] & self.mask
        mm, unpack, mask = self.mm, ENTRY_STRUCT.unpack_from, self.mask
        for _ in range(self.slots):
            ed, word, offset = unpack(mm, base + pos * ENTRY_SIZE)
            if word == 0:
                return None, pos
            if ed == d:
                return (word, offset), pos
            pos = (pos + 1) & mask
        return None, None

    def home_plan(self, shards: np.ndarray, halves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, alone) of a batch: each key's home-slot row of `table`, and whether no other key of the
        batch has the same home slot. No lock: a writer computes it before its copy, for insert_absent."""
        rows = shards.astype(np.int64) * self.slots + (halves[:, 1] & self.mask_u).astype(np.int64)
        order = np.argsort(rows, kind="stable")  # keys sharing a home slot: neighbours once sorted
        s = rows[order]
        same = s[1:] == s[:-1]
        alone = np.ones(len(rows), dtype=bool)
        alone[order[1:][same]] = False
        alone[order[:-1][same]] = False
        return rows, alone

    def insert_absent(self, shards: np.ndarray, halves: np.ndarray, words: np.ndarray,
                      offsets: np.ndarray, plan: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Insert, in one numpy pass, every key of a batch that is provably absent and has a slot of its own;
        the shard locks of all `shards` are held. Returns the mask of keys inserted; the caller `put`s the
        rest one by one.

        A key's slot is its home slot if that is empty, or else the first empty slot within
        INSERT_WINDOW slots after it, if no slot before that one holds the key. Either proves the
        key absent (linear probing with backward-shift deletion keeps every entry's probe path from
        its home slot unbroken), so these need no further probe and replace nothing; and the slot
        is where `put` would have placed it. Keys that name the same slot (a shared home, or one
        key's first empty slot being another's home) are all left to the caller, so inserting one
        never moves another's first empty slot. Also left to the caller: keys sharing a home slot
        within the batch, keys found in the window (a replace), keys with no empty slot in it, and
        every key of a shard the batch would push to its load limit (the caller evicts first).
        Digest and offset of all keys are written before any word, so a reader never pairs a new
        word with a stale digest (FORMAT.md section 7). `plan`: `home_plan` of these keys (or of
        a batch they are a subset of, rows selected alike), computed before the locks were taken.
        """
        entries = self.table
        counts = np.ndarray((self.nshards,), dtype="<u4", buffer=self.mm, offset=self.off_hdr + SHARD_COUNT_OFF,
                            strides=(SHARD_HEADER,))
        try:
            shards = shards.astype(np.int64, copy=False)
            slot, alone = plan if plan is not None else self.home_plan(shards, halves)
            home_empty = entries[slot, _WORD] == 0
            ok = home_empty & alone
            target = slot
            away = np.flatnonzero(~home_empty & alone)
            if away.size:  # home taken: the first empty slot after it, unless the key comes first
                target = slot.copy()
                h = halves[away]
                steps = np.arange(INSERT_WINDOW + 1, dtype=np.int64)  # 0: the home slot itself
                r = (shards[away] * self.slots)[:, None] \
                    + (((h[:, 1] & self.mask_u).astype(np.int64)[:, None] + steps) & self.mask)
                e = entries[r]
                empty = e[:, :, _WORD] == 0
                stop = empty | ((e[:, :, _D0] == h[:, :1]) & (e[:, :, _D1] == h[:, 1:]))
                first = stop.argmax(axis=1)
                at = np.arange(away.size)
                free = empty[at, first]  # the key met an empty slot before any slot holding it
                target[away[free]] = r[at, first][free]
                ok[away[free]] = True
                # Two keys to be inserted naming one slot: both to the caller. Only those keys are compared:
                # a key left out anyway (sharing its home) may sort between them and hide the pair.
                cand = np.flatnonzero(ok)
                order = cand[np.argsort(target[cand], kind="stable")]
                t = target[order]
                same = t[1:] == t[:-1]
                if same.any():
                    ok[order[1:][same]] = False
                    ok[order[:-1][same]] = False
            add = np.bincount(shards[ok], minlength=self.nshards)
            fits = counts.astype(np.int64) + add <= self.limit
            if not fits.all():
                ok &= fits[shards]
                add = np.bincount(shards[ok], minlength=self.nshards)
            if ok.all():  # the common case: no boolean-mask copies
                sel, h, off, w = target, halves, offsets, words
            elif ok.any():
                sel, h, off, w = target[ok], halves[ok], offsets[ok], words[ok]
            else:
                return ok
            entries[sel, _D0] = h[:, 0]
            entries[sel, _D1] = h[:, 1]
            entries[sel, _OFFSET] = off
            entries[sel, _WORD] = w  # publication: one aligned 8-byte store per entry
            if _cp.ARMED is not None:
                _cp.hit("index.mid_insert")  # published, shard counts not yet raised
            touched = np.flatnonzero(add)
            counts[touched] = counts[touched] + add[touched].astype(np.uint32)
            return ok
        finally:
            del counts

    def is_full(self, shard: int) -> bool:
        return self.count(shard) >= self.limit

    def put(self, shard: int, d: bytes, word: int, offset: int, on_replace=None):
        """Insert or replace; return the replaced (word, offset) or None. Caller keeps load < limit.
        `on_replace(word, offset)` runs before an existing entry is overwritten (the writer claims the old
        block there, so a crash never orphans it)."""
        found, pos = self._find_pos(shard, d)
        if pos is None:  # impossible below the load limit: the shard's entries or its count are damaged
            raise CorruptPoolError(f"index shard {shard} has no empty slot: the pool is damaged; "
                                   "run `maru-shm check --repair`")
        e = self.entry_off(shard, pos)
        if found is not None and on_replace is not None:
            on_replace(*found)
        if found is None:
            self.mm[e:e + ENTRY_WORD_OFF] = d
            store_u64(self.mm, e + ENTRY_OFFSET_OFF, offset)
            store_u64(self.mm, e + ENTRY_WORD_OFF, word)  # publication point (one 8-byte store)
            if _cp.ARMED is not None:
                _cp.hit("index.mid_insert")
            self._set_count(shard, self.count(shard) + 1)
            return None
        _replace_entry(self.mm, e, word, offset)
        return found

    def remove(self, shard: int, d: bytes, offset: int | None = None, word: int | None = None):
        """Remove the entry for d (only if it names offset/word when given); return (word, offset) or None."""
        found, pos = self._find_pos(shard, d)
        if found is None:
            return None
        if (offset is not None and found[1] != offset) or (word is not None and found[0] != word):
            return None
        self._delete_at(shard, pos)
        self._set_count(shard, max(0, self.count(shard) - 1))
        return found

    def remove_many(self, halves: np.ndarray, offsets: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Remove the entries of a batch of digests ((n, 2) u64 halves) that name these blocks (offset and
        word); the shard locks of all of them are held. Returns the mask of entries removed.

        Entries whose slots no surviving entry's probe path crosses are removed
        by clearing them: backward-shift deletion would pull nothing back into
        them. That holds for an entry when every entry after it in its cluster
        (within 16 slots, up to an empty slot) either sits closer to its own
        home than to this slot, or is cleared in the same pass. All of them are
        cleared in one numpy pass, word first (a reader then sees an empty slot,
        never a half-cleared entry). An entry a survivor would shift back into
        takes `_delete_at` on the slots gathered here if its cluster ends within
        them and holds no other victim (such clusters are disjoint, so those
        rows are still current); the rest take the scalar `remove`, last.
        """
        # One gather of 32 slots from each home: the probe (the key within the first 16) and the 16
        # slots after the key's entry come from the same rows.
        h0, h1 = halves[:, 0], halves[:, 1]
        n = len(h0)
        at = np.arange(n)
        cols = ((h1 & self.mask_u).astype(np.int64)[:, None] + np.arange(32)) & self.mask  # (n, 32)
        r = (h0 & self.smask_u).astype(np.int64)[:, None] * self.slots + cols
        e = self.table[r]
        vacant = e[:, :, _WORD] == 0
        hit = ~vacant & (e[:, :, _D0] == h0[:, None]) & (e[:, :, _D1] == h1[:, None])
        j = (vacant | hit).argmax(axis=1)
        absent = vacant[at, j] & ~hit[at, j]
        rows = r[at, j]
        named = hit[at, j] & (j < 16) & (e[at, j, _WORD] == words) & (e[at, j, _OFFSET] == offsets)
        idx = np.flatnonzero(named)
        if len(idx) > 1:  # an item named twice in the batch: its later copies are not removed again
            first = np.zeros(n, dtype=bool)
            first[idx[np.unique(rows[idx], return_index=True)[1]]] = True
            named &= first
        d = np.arange(1, 17, dtype=np.int64)
        pos = np.minimum(j[:, None] + d, 31)  # the 16 slots after each entry (clipped rows are not named)
        after = e[at[:, None], pos]
        empty = after[:, :, _WORD] == 0
        first_empty = empty.argmax(axis=1)
        inside = d <= first_empty[:, None]  # the rest of the cluster, up to its first empty slot
        dist = (cols[at[:, None], pos] - (after[:, :, _D1] & self.mask_u).astype(np.int64)) & self.mask
        win = r[at[:, None], pos]
        victims = np.sort(rows[named])
        clear = named & empty[at, first_empty] & ((dist < d) | _member(win, victims) | ~inside).all(axis=1)
        for _ in range(16):  # an entry stays if a victim after it must go the scalar way: shrink to a fixpoint
            blocked = clear & (_member(win, np.sort(rows[named & ~clear])) & inside).any(axis=1)
            if not blocked.any():
                break
            clear &= ~blocked
        else:
            clear[:] = False  # no fixpoint yet: every entry the scalar way
        removed = np.zeros(len(rows), dtype=bool)
        if clear.any():
            gone = rows[clear]
            self.table[gone, _WORD] = 0  # the word first
            self.table[gone[:, None], [_D0, _D1, _OFFSET]] = 0
            counts = np.ndarray((self.nshards,), dtype="<u4", buffer=self.mm, offset=self.off_hdr + SHARD_COUNT_OFF,
                                strides=(SHARD_HEADER,))
            try:
                drop = np.bincount(gone // self.slots, minlength=self.nshards)
                touched = np.flatnonzero(drop)
                counts[touched] = np.maximum(counts[touched].astype(np.int64) - drop[touched], 0).astype(np.uint32)
            finally:
                del counts
            removed[clear] = True
        alone = named & ~clear & empty[at, first_empty] & ~(_member(win, victims) & inside).any(axis=1)
        for i in np.flatnonzero(alone).tolist():
            shard, hole = divmod(int(rows[i]), self.slots)
            size = int(first_empty[i])
            cluster = (((hole + d[:size]) & self.mask).tolist(), (after[i, :size, _D1] & self.mask_u).tolist())
            self._delete_at(shard, hole, cluster)
            self._set_count(shard, max(0, self.count(shard) - 1))
            removed[i] = True
        for i in np.flatnonzero(~clear & ~alone & ~absent).tolist():  # the scalar remove re-checks offset and word
            d = halves[i].tobytes()
            removed[i] = self.remove(self.shard_of(d), d, offset=int(offsets[i]), word=int(words[i])) is not None
        return removed

    def _cluster_after(self, shard: int, hole: int) -> tuple[list[int], list[int]]:
        """(positions, home slots) of the entries after `hole` up to the first empty slot (wrapping, at most
        the whole shard): one numpy gather per window of slots, not one struct call per entry."""
        base, mask, window = shard * self.slots, self.mask, 64
        pos = np.empty(0, dtype=np.int64)
        homes = np.empty(0, dtype=np.int64)
        start = 1
        while start < self.slots:
            steps = np.arange(start, min(start + window, self.slots), dtype=np.int64)
            p = (hole + steps) & mask
            rows = self.table[base + p]
            empty = np.flatnonzero(rows[:, _WORD] == 0)
            cut = int(empty[0]) if len(empty) else len(p)
            pos = np.concatenate((pos, p[:cut]))
            homes = np.concatenate((homes, (rows[:cut, _D1] & self.mask_u).astype(np.int64)))
            if len(empty):
                break
            start += len(p)
            window *= 4
        return pos.tolist(), homes.tolist()

    def _delete_at(self, shard: int, hole: int, cluster=None) -> None:
        """Backward-shift deletion: pull later entries of the cluster into the hole. `cluster`: what
        `_cluster_after` returns, if the caller read it under the shard lock."""
        mm = self.mm
        for j, k in zip(*(cluster or self._cluster_after(shard, hole))):
            stays = (hole < k <= j) if hole <= j else (k > hole or k <= j)
            if stays:
                continue
            ed, word, offset = ENTRY_STRUCT.unpack_from(mm, self.entry_off(shard, j))
            eh = self.entry_off(shard, hole)
            store_u64(mm, eh + ENTRY_WORD_OFF, 0)
            mm[eh:eh + ENTRY_WORD_OFF] = ed
            store_u64(mm, eh + ENTRY_OFFSET_OFF, offset)
            store_u64(mm, eh + ENTRY_WORD_OFF, word)
            if _cp.ARMED is not None:
                _cp.hit("index.mid_shift")  # the moved entry is in the hole and still at j: a duplicate
            hole = j
        eh = self.entry_off(shard, hole)
        store_u64(mm, eh + ENTRY_WORD_OFF, 0)
        mm[eh:eh + ENTRY_SIZE] = _ZERO_ENTRY

    def clock_victim(self, shard: int, is_referenced, is_pinned=None):
        """Pick a cold entry of the shard (CLOCK over slots); return (digest, word, offset). When every
        entry stays referenced for two sweeps (`is_referenced(offset, age=True)` ages it as it is passed), the
        first one not `is_pinned` is taken."""
        hdr = self.off_hdr + shard * SHARD_HEADER
        count, hand = SHARD_STRUCT.unpack_from(self.mm, hdr)
        hand &= self.mask
        fallback = None
        for _ in range(2 * self.slots):
            ed, word, offset = ENTRY_STRUCT.unpack_from(self.mm, self.entry_off(shard, hand))
            hand = (hand + 1) & self.mask
            if word == 0:
                continue
            if fallback is None and not (is_pinned is not None and is_pinned(offset)):
                fallback = (ed, word, offset)
            if is_referenced(offset, age=True):
                continue
            SHARD_STRUCT.pack_into(self.mm, hdr, count, hand)
            return ed, word, offset
        SHARD_STRUCT.pack_into(self.mm, hdr, count, hand)
        return fallback

    def entries(self, shard: int):
        """All non-empty (pos, digest, word, offset) of a shard (bounded scan)."""
        out = []
        for pos in range(self.slots):
            ed, word, offset = ENTRY_STRUCT.unpack_from(self.mm, self.entry_off(shard, pos))
            if word:
                out.append((pos, ed, word, offset))
        return out

    def rebuild(self, shard: int, keep, salvage=None) -> tuple[int, int]:
        """Drop entries `keep(d, word, offset)` rejects, duplicates and keys of other shards; re-insert the rest.

        `salvage(d, word, offset)`, if given, is asked about each rejected entry and may return the
        word to keep it with instead (0: drop it). Returns (kept, dropped). Used by shard repair after
        a holder died mid-update.
        """
        seen = {}
        dropped = 0
        for _, ed, word, offset in self.entries(shard):
            if ed in seen or self.shard_of(ed) != shard:
                dropped += 1
                continue
            if not keep(ed, word, offset):
                word = salvage(ed, word, offset) if salvage is not None else 0
                if not word:
                    dropped += 1
                    continue
            seen[ed] = (word, offset)
        start = self.entry_off(shard, 0)
        self.mm[start:start + self.shard_bytes] = bytes(self.shard_bytes)
        SHARD_STRUCT.pack_into(self.mm, self.off_hdr + shard * SHARD_HEADER, 0, 0)
        for ed, (word, offset) in list(seen.items())[:self.limit]:
            self.put(shard, ed, word, offset)
        return len(seen), dropped
