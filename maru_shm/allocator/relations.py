"""Relation records and the doom ring: how values relate, so that eviction keeps what can still be a hit
(FORMAT.md section 6a, DESIGN.md section 8).

A page of a prompt serves only while every page before it in its chain, and its partner pages in the other
pools of a hybrid model, are present too. Eviction that takes a related value pushes a *doom* for its
segment; the values a doom strands are taken first (blockclock.py). Records and dooms are hints: any value
in them costs hits at worst, never bytes, and nothing checks or repairs them.
"""

from __future__ import annotations

import numpy as np

from ..format import CLASS_ENTRY, CLS_RELATED, DOOM_CURSOR_OFF, DOOM_ENTRIES, DOOM_LAYOUT, RELATION_LAYOUT, U32

TRAILING = 1 << 15   # `depth` flag: losing this value strands its whole segment
DEPTH_MAX = TRAILING - 1  # positions saturate here (a segment is one set call: SGLang sends 128 pages)
RELATION_DTYPE = RELATION_LAYOUT  # FORMAT.md section 6a, declared in format.py
DOOM_DTYPE = DOOM_LAYOUT
_HALF = 1 << 15
NAMED_LOOP = 8  # up to this many doomed groups, `named` compares each one; more, np.isin sorts
SCALAR_DOOMS = 256  # up to this many dooms since a record's birth, `record_of` checks them in Python


def chain(n: int, group: int, parent: int = 0, branch: int = 0, trailing: bool = False,
          positions=None) -> np.ndarray:
    """Records for n values of one segment (what `Store.batch_put_pieces(relations=)` takes): positions
    0 .. n-1 in chain order, or `positions`; TRAILING if `trailing`. `group` and `parent` are hashes (their
    low 32 bits are kept); positions saturate at DEPTH_MAX."""
    rel = np.zeros(n, dtype=RELATION_DTYPE)
    rel["group"] = (group & 0xFFFF_FFFF) or 1  # 0 means "no record"
    rel["parent"] = parent & 0xFFFF_FFFF
    depth = np.minimum(np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64), DEPTH_MAX)
    rel["depth"] = depth | TRAILING if trailing else depth
    rel["branch"] = min(max(branch, 0), DEPTH_MAX)
    return rel


class Relations:
    """The records (one per granule) and the doom ring of a pool made with FLAG_RELATIONS; inert otherwise."""

    def __init__(self, mm, geo):
        self.mm, self.geo = mm, geo
        self.enabled = geo.has_relations
        if self.enabled:
            self.records = np.ndarray((geo.n_granules,), dtype=RELATION_DTYPE, buffer=mm, offset=geo.off_relations)
            self.links = self.records.view("<u8")[::2]  # first word: group | parent << 32 (RELATION_DTYPE, LE)
            self.ring = np.ndarray((DOOM_ENTRIES,), dtype=DOOM_DTYPE, buffer=mm, offset=geo.off_dooms)
            self.ring_words = self.ring.view(np.uint64)  # the same entries as words: copied and filtered fast
            self.related = np.ndarray((geo.class_cap,), dtype="<u4", buffer=mm,  # each class entry's `related`
                                      offset=geo.off_classes + CLS_RELATED, strides=(CLASS_ENTRY,))
        self.shift = geo.granule.bit_length() - 1

    def release_views(self) -> None:
        self.records = self.links = self.ring = self.ring_words = self.related = None

    def doomed_any(self) -> bool:
        """Has any doom been pushed in this pool (can anything be stranded)?"""
        return self.enabled and self.cursor() != 0

    def cursor(self) -> int:
        """Dooms pushed so far (mod 2^32); its low 16 bits are the `born` of a record written now."""
        return U32.unpack_from(self.mm, DOOM_CURSOR_OFF)[0]

    # ---------------------------------------------------------------- which classes may hold records
    def mark_classes(self, cids) -> None:
        """Before a writer writes records into these classes: set each entry's `related` (FORMAT.md section 4).
        No lock: a store of 1, skipped when set; only a repair clearing the entry clears it."""
        if not self.enabled:
            return
        for cid in cids:
            if not self.related[cid]:
                self.related[cid] = 1

    def related_classes(self) -> np.ndarray:
        """Ids of the classes whose `related` is set (read without locks, as `in_class`)."""
        return np.flatnonzero(self.related) if self.enabled else np.zeros(0, dtype=np.int64)

    def in_class(self, cid: int) -> bool:
        """May class `cid` hold records? A class that never got one holds no stranded value to search for."""
        return self.enabled and bool(self.related[cid])

    # ---------------------------------------------------------------- the writer
    def write(self, offsets, live_words, rel: np.ndarray) -> np.ndarray:
        """Before the commit, by the owner of these RESERVED blocks (no lock): the record of each lifetime; the
        granules written. It is tagged with `live_words`, the words the commit will store: it applies from
        the commit on, and a crash before it leaves a record whose tag no LIVE word of that block carries."""
        if not self.enabled or not len(offsets):
            return np.zeros(0, dtype=np.int64)
        g = np.asarray(offsets, dtype=np.int64) >> self.shift
        rows = rel.copy()
        rows["tag"] = np.asarray(live_words, dtype=np.uint64) & np.uint64(0xFFFF)
        rows["born"] = self.cursor() & 0xFFFF
        self.records[g] = rows
        return g

    def record_of(self, offset: int, word: int) -> tuple[int, int] | None:
        """(group, position) of the block at this data offset for the lifetime `word`; (0, 0) if none; None if a
        doom strands it (it can no longer be a hit, and neither can what continues it)."""
        if not self.enabled or not 0 <= offset < self.geo.data_bytes:
            return 0, 0
        rows, valid = self.of(np.array([offset >> self.shift]), np.array([word], dtype=np.uint64))
        if not valid[0]:
            return 0, 0
        # Only dooms pushed at or after its birth strand a record (`_covered`): read those alone. `born` is
        # the cursor's low 16 bits, so the dooms since are the cursor's distance from it, mod 2^16.
        c = self.cursor()
        since = (c - ((c - int(rows["born"][0])) & 0xFFFF)) & 0xFFFF_FFFF
        ring = self._entries(since)
        if len(ring) <= SCALAR_DOOMS:
            stranded = _one_covered(rows[0], ring.view(np.uint64).tolist())
        else:
            by_group, by_parent = self._stranded_by(rows, valid, ring)
            stranded = bool(by_group[0] or by_parent[0])
        return None if stranded else (int(rows["group"][0]), int(rows["depth"][0]) & DEPTH_MAX)

    # ---------------------------------------------------------------- eviction
    def of(self, g: np.ndarray, words: np.ndarray):
        """Records of granules g whose blocks hold `words`: (rows, valid mask). A record of another lifetime
        or without a group is not valid."""
        rows = self.records[g]
        valid = (rows["group"] != 0) & (rows["tag"] == (words & np.uint64(0xFFFF)).astype(np.uint16))
        return rows, valid

    def named(self, g: np.ndarray, since: int | None = None) -> np.ndarray:
        """Mask of granules g whose record's group or parent a doom (from cursor `since` on) names: a cheap first
        cut of a whole-class search, reading neither the blocks' metas nor the records' tag and birth."""
        ring = self._entries(since)
        if not len(ring):
            return np.zeros(len(g), dtype=bool)
        links = self.links[g]  # one word a record: gathering it beats gathering the structured rows
        groups, parents = links & np.uint64(0xFFFF_FFFF), links >> np.uint64(32)
        named = np.unique(ring["group"]).astype(np.uint64)
        if len(named) > NAMED_LOOP:
            return np.isin(groups, named) | np.isin(parents, named)
        out = np.zeros(len(g), dtype=bool)
        for group in named:  # the usual case: the few dooms pushed since the last search
            out |= (groups == group) | (parents == group)
        return out

    def _entries(self, since: int | None) -> np.ndarray:
        """The ring's entries pushed from cursor `since` on (all of them without it, or once it is a whole
        ring behind), as a copy: other processes push meanwhile. Copied and filtered as words."""
        new = None if since is None else (self.cursor() - since) & 0xFFFF_FFFF
        if new is not None and new < DOOM_ENTRIES:
            words = self.ring_words[np.arange(since, since + new) % DOOM_ENTRIES]
        else:
            words = self.ring_words.copy()
        return words[(words & np.uint64(0xFFFF_FFFF)) != 0].view(DOOM_DTYPE)

    def stranded(self, rows: np.ndarray, valid: np.ndarray, since: int | None = None):
        """(by group, by parent): masks of the values a doom pushed after their birth strands; with `since` (a
        cursor), only the dooms pushed from then on (fewer to match when the rest were searched before)."""
        if not valid.any():
            return np.zeros(len(rows), dtype=bool), np.zeros(len(rows), dtype=bool)
        return self._stranded_by(rows, valid, self._entries(since))

    def _stranded_by(self, rows: np.ndarray, valid: np.ndarray, ring: np.ndarray):
        """`stranded` against these ring entries."""
        none = np.zeros(len(rows), dtype=bool)
        if not valid.any() or not len(ring):
            return none, none
        depth = (rows["depth"] & DEPTH_MAX).astype(np.int64)
        by_group = _covered(rows["group"], depth, rows["born"], valid, ring)
        by_parent = _covered(rows["parent"], rows["branch"].astype(np.int64), rows["born"],
                             valid & (rows["parent"] != 0), ring)
        return by_group, by_parent

    def doom(self, rows: np.ndarray, by_parent: np.ndarray) -> None:
        """Eviction took these valid related values: push (group, from) per group, the lowest from.

        from = the value's position; 0 (the whole segment) if it was TRAILING or stranded through its
        parent. No lock: pushers racing for a slot overwrite each other's hint.
        """
        if not self.enabled or not len(rows):
            return
        depth = rows["depth"]
        whole = ((depth & TRAILING) != 0) | by_parent
        frm = np.where(whole, 0, depth & DEPTH_MAX).astype(np.uint16)
        groups, inverse = np.unique(rows["group"], return_inverse=True)
        low = np.full(len(groups), DEPTH_MAX, dtype=np.uint16)
        np.minimum.at(low, inverse, frm)
        self._push(groups[:DOOM_ENTRIES], low[:DOOM_ENTRIES])

    def push(self, group: int) -> None:
        """A writer learned its new segment is stranded at birth (its parent is gone): doom it whole."""
        if self.enabled:
            self._push(np.array([(group & 0xFFFF_FFFF) or 1], dtype=np.uint32), np.zeros(1, dtype=np.uint16))

    def _push(self, groups: np.ndarray, frm: np.ndarray) -> None:
        c, n = self.cursor(), len(groups)
        seq = c + np.arange(n, dtype=np.int64)
        entries = np.zeros(n, dtype=DOOM_DTYPE)
        entries["group"], entries["from"], entries["seq"] = groups, frm, seq & 0xFFFF
        self.ring[seq % DOOM_ENTRIES] = entries
        U32.pack_into(self.mm, DOOM_CURSOR_OFF, (c + n) & 0xFFFF_FFFF)


def _one_covered(row, words: list) -> bool:
    """`stranded` for one record against a few ring words (group | from << 32 | seq << 48), in Python: numpy's
    cost per call would dominate."""
    group, parent, born = int(row["group"]), int(row["parent"]), int(row["born"])
    depth, branch = int(row["depth"]) & DEPTH_MAX, int(row["branch"])
    for w in words:
        g, frm = w & 0xFFFF_FFFF, (w >> 32) & 0xFFFF
        if ((g == group and frm <= depth) or (parent and g == parent and frm <= branch)) \
                and ((w >> 48) - born) & 0xFFFF < _HALF:
            return True
    return False


def _covered(groups, depth, born, valid, ring) -> np.ndarray:
    """Per value: does a ring entry of its group, pushed at or after its birth, start at or below `depth`?"""
    out = np.zeros(len(groups), dtype=bool)
    near = ring[np.isin(ring["group"], groups[valid])]  # entries naming a candidate (few candidates: a loop)
    if not len(near):
        return out
    k = np.flatnonzero(valid & np.isin(groups, near["group"]))
    same = groups[k][:, None] == near["group"][None, :]
    low = near["from"][None, :].astype(np.int64) <= depth[k][:, None]
    after = ((near["seq"][None, :].astype(np.int64) - born[k][:, None].astype(np.int64)) & 0xFFFF) < _HALF
    out[k] = (same & low & after).any(axis=1)
    return out
