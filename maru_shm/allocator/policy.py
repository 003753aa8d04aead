"""Policy: every eviction decision, in one place (DESIGN.md sections 7 and 8). The mechanisms carry them out.

memcached splits slab_automove (decides) from the slab mover (moves); here this module decides:
  - the ref rule of the pool (FORMAT.md section 6): a count the passing hand lowers (the CLOCK), or an age
    stamp (FLAG_AGE): what a write and a hit do to a block's meta `ref`;
  - the victim order within a class (blockclock.py reads the ring and evicts what this names);
  - the index shard's CLOCK: whether an entry's block counts as referenced (publish.py);
  - the make-room ladder: free units, a slab move from donors, eviction within the class, a move from any class
    (the donors by demand.py's retention rule; slabmover.py moves);
  - what MaruStorage marks used: the stored pages a set offers again, and the prefix of a lookup.
`Settings` switch the rules, so that an A/B bench (`using`) measures each without patching code.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from ..format.layout import (AGE_CLAMP, AGE_TICK_OFF, AGE_TICKS, DEMAND_ACC_OFF, FLAG_AGE, FLAG_PINNED,
                             META_FLAGS_OFF, META_REF_OFF, REF_MAX, U32, U64)

# An age-stamp class reads at most this many blocks from the hand to choose its victims (a larger one: a window
# of them, the next from where the last victim was).
AGE_SCAN = 1 << 16


@dataclasses.dataclass(frozen=True)
class Settings:
    """The rules of eviction, each switchable (their A/B: BENCHMARKS.md, the prefix-tree family)."""
    # A hit raises the block's count up to this, the hand lowers it by one (at most REF_MAX, the format's).
    ref_max: int = REF_MAX
    # A class with a slab may take a slab from a class whose retention is long beside its own (demand.py).
    retention: bool = True
    # A move evicts the window's values, and each strands the pages its request has in the other classes, so it
    # pays only for a real shift in demand: the giver's retention after giving must be 1 + move_margin times the
    # taker's after taking. At 0.3 and 1.0 demand noise alone moved slabs on the prefix-tree family (hybrid,
    # chat: up to -16 % tokens in a cell); at 3.0 no cell of it moves by this rule, and a new class on a full
    # pool still takes its share (the mixshift benchmark).
    move_margin: float = 3.0
    # A set that offers a stored page again marks it used, as a hit does (maru_sglang/pages.py).
    offered_mark: bool = True
    # A lookup with prefix keys (SGLang's pages held in host memory) marks their stored copies used, so a chain's
    # head outlives its tail in L3 while the host serves it (maru_sglang/maru_storage.py). None: in age pools.
    prefix_mark: bool | None = None
    # The ref rule of a pool created now: age stamps (True) or the count (False). None: the creator's choice
    # (Store.open's `eviction`; MaruStorage: age for a plain model, the count for a hybrid one).
    age: bool | None = None


_current = Settings()


def current() -> Settings:
    """The settings a Store opened now takes."""
    return _current


@contextlib.contextmanager
def using(**changes):
    """Within: Stores opened take the settings with these changes (benches and tests; one process)."""
    global _current
    before = _current
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


def flags_for(eviction: str) -> int:
    """The superblock flags of a pool created now with Store.open's `eviction` ("count" or "age")."""
    if eviction not in ("count", "age"):
        raise ValueError(f"eviction must be 'count' or 'age', got {eviction!r}")
    age = _current.age if _current.age is not None else eviction == "age"
    return FLAG_AGE if age else 0


class EvictionPolicy:
    """The decisions for one attached pool: its ref rule (FLAG_AGE), `settings` as they were when it was
    opened."""

    def __init__(self, settings: Settings, mm, geo, refs: np.ndarray, demand):
        self.settings, self.mm, self.geo, self.refs, self.demand = settings, mm, geo, refs, demand
        self.ref_max = max(1, min(settings.ref_max, REF_MAX))
        self.age = bool(geo.flags & FLAG_AGE)
        self.prefix_mark = self.age if settings.prefix_mark is None else settings.prefix_mark
        if self.age:
            self.birth, self.mark_one, self.mark_many = self._stamp, self._stamp_one, self._stamp_many
            self.shard_referenced, self.victims = self._young, self._oldest

    def release_views(self) -> None:
        self.refs = None

    # ---------------------------------------------------------------- the count (the CLOCK)
    def birth(self) -> int:
        """The `ref` of a new lifetime: nothing read it yet."""
        return 0

    def mark_one(self, meta: int) -> None:
        """A hit on the block whose meta is at file offset `meta` (no lock: a lost race costs a count)."""
        mm = self.mm
        mm[meta + META_REF_OFF] = min(self.ref_max, mm[meta + META_REF_OFF] + 1)

    def mark_many(self, gidx: np.ndarray) -> None:
        """Hits on the blocks starting at granules `gidx`."""
        refs = self.refs
        refs[gidx] = np.minimum(refs[gidx], self.ref_max - 1) + 1

    def shard_referenced(self, offset: int, age: bool = False) -> bool:
        """The index shard's CLOCK: does the block at this data offset count as referenced; `age`: lower its
        count as the block CLOCK's hand does. A pinned block always does; out of range: no."""
        if not 0 <= offset < self.geo.data_bytes:
            return False
        m, mm = self.geo.meta_of(offset), self.mm
        if mm[m + META_FLAGS_OFF] & FLAG_PINNED:
            return True
        ref = mm[m + META_REF_OFF]
        if ref and age:
            mm[m + META_REF_OFF] = min(ref, self.ref_max) - 1
        return bool(ref)

    # ---------------------------------------------------------------- the victim order
    def victims(self, ring, m: int):
        """Up to m victims of a class (blockclock.Ring): (ring positions, meta rows), none if nothing is.

        The hand moves over at most ref_max + 1 passes of the ring: a candidate whose count is 0 is a victim,
        any other is lowered by one as the hand passes, so the last pass takes every candidate still there. The
        ring is read in chunks from the hand (a few victims never read a large class whole); no chunk spans the
        end of a pass, so each pass re-reads the counts the one before lowered. Positions t in
        [0, (ref_max + 1) n): ring index (hand + t) mod n; the hand is left after the last victim.
        """
        n, p, top = ring.n, ring.hand, self.ref_max
        chunk = max(4 * m, 512)
        picked, rows = [], []
        got = t = 0
        refs = self.refs
        while t < (top + 1) * n and got < m:
            t1 = min(t + chunk, (t // n + 1) * n)
            pos = (p + np.arange(t, t1, dtype=np.int64)) % n
            g, q, eligible, ref = ring.read(pos)
            ref = ref != 0
            if t >= n and picked:
                eligible &= ~np.isin(pos, np.concatenate(picked))  # taken in an earlier pass already
            victims = np.flatnonzero(eligible & ~ref)[:m - got]
            got += len(victims)
            end = int(victims.max()) + 1 if got == m else len(pos)
            passed = eligible & ref  # second chances: lowered as the hand passes
            passed[victims] = False
            passed = g[:end][passed[:end]]
            r = refs[passed]
            refs[passed] = np.minimum(r, top) - (r > 0)  # a damaged count above the top costs no extra pass
            if len(victims):
                picked.append(pos[victims])
                rows.append(q[victims])
            t += end
        ring.move_hand((p + t) % n)
        if not got:
            return np.zeros(0, dtype=np.int64), None
        return np.concatenate(picked), np.concatenate(rows)

    # ---------------------------------------------------------------- age stamps (FLAG_AGE)
    def tick(self) -> int:
        return U32.unpack_from(self.mm, AGE_TICK_OFF)[0]

    def _stamp(self) -> int:
        """A new lifetime is stamped now."""
        return self.tick() & 0xFF

    def _stamp_one(self, meta: int) -> None:
        self.mm[meta + META_REF_OFF] = self.tick() & 0xFF

    def _stamp_many(self, gidx: np.ndarray) -> None:
        self.refs[gidx] = self.tick() & 0xFF

    def _young(self, offset: int, age: bool = False) -> bool:
        """The index shard's CLOCK in an age pool: a block stamped within the last AGE_TICKS ticks (one pool's
        worth of allocation) counts as referenced; passing it changes nothing. A pinned block always does."""
        if not 0 <= offset < self.geo.data_bytes:
            return False
        m, mm = self.geo.meta_of(offset), self.mm
        return bool(mm[m + META_FLAGS_OFF] & FLAG_PINNED) or (self.tick() - mm[m + META_REF_OFF]) & 0xFF < AGE_TICKS

    def _oldest(self, ring, m: int):
        """Up to m victims of a class in an age pool: its m oldest candidates, on ties the first from the hand
        (ring order), read from the whole ring or its next AGE_SCAN blocks; the hand is left after the last
        victim. A stamp older than AGE_CLAMP ticks is rewritten to exactly that age as it is read, so a stamp
        never wraps in a class that evicts again within AGE_CLAMP - 1 ticks."""
        n, p = ring.n, ring.hand
        span = min(n, AGE_SCAN)
        pos = (p + np.arange(span, dtype=np.int64)) % n
        g, q, eligible, ref = ring.read(pos)
        now = self.tick() & 0xFF
        age = (now - ref.astype(np.int64)) & 0xFF
        old = eligible & (age > AGE_CLAMP)
        if old.any():
            self.refs[g[old]] = (now - AGE_CLAMP) & 0xFF
            age[old] = AGE_CLAMP
        cand = np.flatnonzero(eligible)
        pick = np.sort(cand[np.argsort(-age[cand], kind="stable")[:m]])
        ring.move_hand(int((p + (pick[-1] + 1 if len(pick) else span)) % n))
        if not len(pick):
            return np.zeros(0, dtype=np.int64), None
        return pos[pick], q[pick]

    # ---------------------------------------------------------------- making room
    def allocated(self, cid: int, nbytes: int) -> None:
        """CLASS[cid] held: an allocation of `nbytes` in the class (its demand). In an age pool the age clock
        advances once per data_bytes / AGE_TICKS bytes allocated, counted on the demand's accumulator (hints
        without a lock: a lost update only delays a tick)."""
        if self.age:
            step = max(1, self.geo.data_bytes // AGE_TICKS)
            (acc,) = U64.unpack_from(self.mm, DEMAND_ACC_OFF)
            crossed = (acc + nbytes) // step - acc // step
            if crossed:
                U32.pack_into(self.mm, AGE_TICK_OFF, (self.tick() + crossed) & 0xFFFF_FFFF)
        self.demand.add(cid, nbytes)

    def donors(self, info) -> np.ndarray:
        """The classes (ids) that may give class `info` a slab now: by retention (demand.py), or, without that
        rule, every class with a slab while `info` has none, and none once it has one."""
        if self.settings.retention:
            return self.demand.donors(info, self.settings.move_margin)
        has = self.demand.cls_nslabs > 0
        return np.flatnonzero(has) if not has[info.cid] else np.zeros(0, dtype=np.int64)

    def make_room(self, room, info, nblocks: int) -> bool:
        """CLASS[c] held, the class has no free block: make room for up to `nblocks` more, trying in turn
        free units for new slabs, a slab move from the donors, eviction within the class and, with no donor
        and no victim (every block of the class in flight or pinned), a move from any class. `room`: the
        mechanisms (reserve.Reserver). False if none made room."""
        if room.format_free_slabs(info, nblocks):
            return True
        donors = self.donors(info)
        if len(donors) and room.move_slab(info, set(donors.tolist())):
            return True
        if room.clock.evict_blocks(info, nblocks):
            return True
        return not len(donors) and room.move_slab(info, None)
