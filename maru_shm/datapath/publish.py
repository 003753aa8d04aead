"""The index side of writes and evictions: everything done under SHARD locks (FORMAT.md sections 7 and 8).

Publishing a batch, making room in a full shard (index-pressure eviction), unpublishing victims the
allocator chose, answering "is this block still indexed" for repairs, pinning and deleting one key, and
the shard repair a dirty SHARD lock triggers. A block leaves the index only while its remover owns it
(`claim_for_free`): between the SHARD lock (unpublish) and the CLASS lock (free) a death leaves it to
the reaper, never an orphan.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from .. import crashpoints as _cp
from ..batching import SMALL_BATCH
from ..errors import ValueTooLargeError
from ..format.layout import (FLAG_PINNED, LIVE, META_FLAGS_OFF, META_LENGTH_OFF, META_OWNER_OFF, META_STRUCT,
                             SHARD_LOCK_BASE, U16, U32, U64, length_sound)
from ..locking.ofd import dense_range
from .validity import Hit, lookup, names_lifetime


class Publisher:
    def __init__(self, att, procs, counters):
        self.att, self.procs, self.counters = att, procs, counters

    # ---------------------------------------------------------------- shard repair
    def shard_repair(self, shard: int):
        """The repair a dirty SHARD lock runs before its next holder goes on: rebuild the shard."""
        def repair():
            att = self.att
            att.index.rebuild(shard, lambda d, w, o: names_lifetime(att.mm, att.geo, d, w, o),
                              salvage=self.entry_salvage)
            self.counters.count(repairs=1)
        return repair

    def repair_shard_lock(self, lock_id: int) -> None:
        self.shard_repair(lock_id - SHARD_LOCK_BASE)()

    def entry_salvage(self, d: bytes, word: int, offset: int) -> int:
        """Shard repair, for an entry whose word does not match its block: the word to restore, 0 to drop it.

        An overwrite stores the new offset, then the new word. A publisher that dies between the two
        leaves the new block's offset with the old block's word: the old block is already claimed (its
        owner is the publisher, so reaping frees it) and the new block is LIVE, holds d and still names
        its publisher as owner (cleared only after publication). That block is restored into the entry,
        completing the publication; dropping the entry would lose the key (old and new value both).
        Nothing can have freed and reused the block in between: every path that frees a LIVE block
        either consults this shard under its lock (so this repair runs first) or holds a claim on it.
        """
        att = self.att
        if not 0 <= offset < att.geo.data_bytes:
            return 0
        loc = att.alloc.block_index(offset)
        if loc is None:
            return 0
        mword, md, length, owner, _, flags = META_STRUCT.unpack_from(att.mm, att.geo.meta_of(offset))
        if mword & 3 != LIVE or md != d or not owner or not length_sound(length, flags) or length > loc[1].block:
            return 0
        return mword

    def _hold_shard(self, d: bytes):
        s = self.att.index.shard_of(d)
        return s, self.att.locks.hold(SHARD_LOCK_BASE + s, repair=self.shard_repair(s))

    # ---------------------------------------------------------------- claims
    def claim_for_free(self, offset: int, word: int) -> None:
        """SHARD lock held, entry about to be removed: mark its block ours until we free it.

        Between unpublishing (shard lock) and freeing (class lock) the block is then
        owned by a live process, not an orphan; if we die there, reaping frees it.
        """
        att = self.att
        if 0 <= offset < att.geo.data_bytes:
            m = att.geo.meta_of(offset)
            if U64.unpack_from(att.mm, m)[0] == word:
                att.alloc.kept_blocks.track((offset,), indexed=True)  # our call holds it before it is ours
                att.mm[m + META_OWNER_OFF:m + META_OWNER_OFF + 2] = self.procs.owner.to_bytes(2, "little")

    # ---------------------------------------------------------------- publishing a batch
    def publish(self, batch, skip_existing: bool, res: list):
        """Index every committed block of a batch under all its shard locks at once (ascending, see locks.py).

        Returns (published flags, blocks to free, evictions, evicted bytes).
        """
        att = self.att
        shards = batch.shards
        to_free: list[tuple[int, int]] = []
        evicted = [0, 0]  # values, bytes
        with att.locks.hold_many(dense_range([SHARD_LOCK_BASE + s for s in shards]),
                                 repair_for=self.repair_shard_lock):
            att.alloc.kept_blocks.may_index(batch.placed_off)
            published, slow = batch.publish_fast(res)
            for k in slow:
                i = batch.placed_i[k]
                if self._publish_one(batch.digest(k), shards[k], batch.lives[k], batch.placed_off[k],
                                     skip_existing, to_free, evicted):
                    published[k] = True
                res[i] = True
            # Disown what we published now, while the shard locks pin it: nobody can unpublish and
            # free it before we release them. Done after the locks (check, then clear), a replace +
            # free + re-reservation by another process could slip in between and we would wipe
            # *their* owner, making their in-flight block evictable under them.
            # A block this batch published and then replaced (a key named twice) is not disowned: it is
            # unindexed and waits in to_free, owned by us, so that a death before the free leaves it to the
            # reaper; disowned, it would be an orphan (LIVE, unowned, unindexed) that only repair frees.
            if to_free:
                replaced = {off for off, _ in to_free}
                published_now = [p and off not in replaced for p, off in zip(published, batch.placed_off)]
            else:
                published_now = published
            if _cp.ARMED is not None:
                _cp.hit("put.before_disown")
            batch.disown(published_now)
        return published, to_free, evicted[0], evicted[1]

    def _publish_one(self, d: bytes, s: int, live: int, offset: int, skip_existing: bool,
                     to_free: list, evicted: list) -> bool:
        """SHARD s held: publish one block; False if skip_existing found d published (theirs stays)."""
        index = self.att.index
        if skip_existing:
            cur = index.find(d)
            if cur is not None and names_lifetime(self.att.mm, self.att.geo, d, cur[0], cur[1]):
                return False  # someone published it first: ours is spare
        self._make_room(s, to_free, evicted)
        old = index.put(s, d, live, offset, on_replace=lambda w, o: self.claim_for_free(o, w))
        if old is not None:
            to_free.append((old[1], old[0]))
        return True

    def _make_room(self, s: int, to_free: list, evicted: list) -> None:
        """SHARD s held: evict values of shard s (its CLOCK) until it has room for one more entry."""
        att = self.att
        index, alloc = att.index, att.alloc
        rebuilt = False
        for _ in range(2 * index.slots):  # bounded, whatever the shard says
            if not index.is_full(s):
                return
            victim = index.clock_victim(s, alloc.policy.shard_referenced, alloc.is_pinned)
            if victim is None or index.find(victim[0]) != victim[1:]:
                # A count above the entries present, or an entry its own probe cannot reach
                # (damage: removing it would fail, forever): rebuild the shard, once.
                if rebuilt:
                    return
                self.shard_repair(s)()
                rebuilt = True
                continue
            vd, vword, voff = victim
            self.claim_for_free(voff, vword)
            index.remove(s, vd)
            to_free.append((voff, vword))
            evicted[0] += 1
            if 0 <= voff < att.geo.data_bytes:
                m = att.geo.meta_of(voff)
                evicted[1] += U32.unpack_from(att.mm, m + META_LENGTH_OFF)[0]

    # ---------------------------------------------------------------- what the allocator asks
    def unpublish_many(self, halves: np.ndarray, offsets: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Remove the index entries of a batch of digests ((n, 2) u64 halves) that name these blocks
        (offset, word), in one round of their shard locks (taken together, ascending); the mask of
        entries removed. A few blocks go one by one (a crash point after each), more in one
        `Index.remove_many` pass."""
        index = self.att.index
        shards = (halves[:, 0] & index.smask_u).astype(np.int64)
        with self.att.locks.hold_many(dense_range((shards + SHARD_LOCK_BASE).tolist()),
                                      repair_for=self.repair_shard_lock):
            if len(offsets) > SMALL_BATCH:
                out = index.remove_many(halves, offsets, words)
                if out.any() and _cp.ARMED is not None:
                    _cp.hit("evict.mid")  # after unpublishing the victims
                return out
            out = np.zeros(len(offsets), dtype=bool)
            for k, (s, off, word) in enumerate(zip(shards.tolist(), offsets.tolist(), words.tolist())):
                out[k] = index.remove(s, halves[k].tobytes(), offset=off, word=word) is not None
                if out[k] and _cp.ARMED is not None:
                    _cp.hit("evict.mid")  # after unpublishing a block of the victim window
            return out

    def indexed_many(self, blocks) -> list[bool]:
        """Per (digest, offset, word, disown): is that block the published value of its digest?

        Repairs and reaping ask this before freeing a LIVE block, so it is answered under the digest's
        SHARD lock (one acquisition per shard; a dirty shard is repaired first): a lock-free probe can
        miss an entry that another process's backward-shift delete is moving, or read a torn entry
        that shard repair would restore, and the caller would free a published block. A "not indexed"
        answer stays true after the lock is released (only a block's owner publishes it, and these
        blocks are unowned or owned by a dead process); an indexed block can only be unpublished by
        a process that claims it first. While the lock pins an indexed block, its owner is cleared if
        it is still `disown` (nonzero): reaping a dead publisher's block must not wipe the claim of a
        live process that unpublishes it just after.

        Lock order: callers hold CLASS (and maybe POOL) locks, and SHARD comes after them. A caller
        holding every lock (check(repair=True)) is answered without taking any.
        """
        att = self.att
        out = [False] * len(blocks)
        by_shard: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            by_shard.setdefault(att.index.shard_of(b[0]), []).append(i)
        holds_all = att.locks.holds_all()
        for s, positions in by_shard.items():
            section = nullcontext() if holds_all else att.locks.hold(SHARD_LOCK_BASE + s,
                                                                    repair=self.shard_repair(s))
            with section:
                for i in positions:
                    d, offset, word, disown = blocks[i]
                    if att.index.find(d) != (word, offset):
                        continue
                    out[i] = True
                    if disown:
                        m = att.geo.meta_of(offset)
                        if U16.unpack_from(att.mm, m + META_OWNER_OFF)[0] == disown:
                            U16.pack_into(att.mm, m + META_OWNER_OFF, 0)
        return out

    # ---------------------------------------------------------------- one key
    def pin(self, d: bytes, key) -> bool:
        """Set FLAG_PINNED on the committed value of d (SHARD lock: a published block is not freed under it)."""
        att = self.att
        _, section = self._hold_shard(d)
        with section:
            hit: Hit | None = lookup(att.index, att.mm, att.geo, d)
            if hit is None:
                return False
            if hit.length > att.geo.granule:
                raise ValueTooLargeError(f"only values of at most {att.geo.granule} bytes can be pinned "
                                         f"({hit.length} bytes under {key!r})")
            flags = hit.meta + META_FLAGS_OFF
            att.mm[flags] = att.mm[flags] | FLAG_PINNED
        return True

    def unpublish_key(self, d: bytes):
        """Remove the entry of d, claiming its block first; (word, offset) removed, or None."""
        s, section = self._hold_shard(d)
        with section:
            cur = self.att.index.find(d)
            if cur is not None:
                self.claim_for_free(cur[1], cur[0])
            return self.att.index.remove(s, d)


__all__ = ["Publisher"]
