"""Vectorised lock-free lookup of a batch of key digests.

The scalar read path (validity.lookup) costs a few microseconds of Python per
key; SGLang asks about 128 keys at a time. This module answers a whole batch
with a handful of numpy gathers over the mapped index, block metas and slab
table, applying the read rule of validity.py (docs/FORMAT.md section 8) in
its batch forms. A copy that follows must still re-read the word afterwards.

`pool` below is anything holding the attached pool's `mm`, `geo`, `index`
and `alloc` (the Store, or its Attachment).
"""

from __future__ import annotations

import numpy as np

from ..index.table import ABSENT
from .validity import block_starts_ok, check_entries, leading_mismatch, lookup


class Resolved:
    """Per-key results of one batch: ok mask, offsets, words, lengths (numpy arrays)."""

    __slots__ = ("ok", "offsets", "words", "lengths")

    def __init__(self, ok, offsets, words, lengths):
        self.ok, self.offsets, self.words, self.lengths = ok, offsets, words, lengths


def resolve(pool, digests: np.ndarray, full: bool = True) -> Resolved:
    """Look up and validate every digest of an (n, 16) uint8 array, without locks.

    full=False stops after rules 1-4 (enough to answer "exists", see
    validity.py); a caller that copies must use full=True (rule 5 too).

    Each key's home slot is gathered and checked in one pass (check_entries).
    Keys that fail at their home slot but found it occupied (displaced by
    probing, absent behind a collision, or caught mid-update) probe on
    together (`Index.probe`, PROBE_WINDOW slots); the few still undecided after
    that, or found but failing the checks, are finished by the scalar lookup.
    """
    halves = np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1, 16).view("<u8")
    h0, h1 = halves[:, 0], halves[:, 1]
    idx, meta_q, geo = pool.index, pool.alloc.meta_q, pool.geo
    offs, words, lengths, ok = check_entries(meta_q, geo, idx.home_entries(h0, h1), h0, h1)
    if not ok.all():
        again = np.flatnonzero(~ok & (words != 0))
        if again.size > SCALAR_AGAIN:
            rows = idx.probe(h0[again], h1[again], PROBE_WINDOW, first_step=1)
            at = np.flatnonzero(rows >= 0)
            if at.size:
                sel = again[at]
                o2, w2, l2, ok2 = check_entries(meta_q, geo, idx.table[rows[at]], h0[sel], h1[sel])
                offs[sel], words[sel], lengths[sel], ok[sel] = o2, w2, l2, ok2
            again = again[rows != ABSENT]
        if again.size:
            for i in again[~ok[again]].tolist():
                hit = lookup(idx, pool.mm, geo, halves[i].tobytes())  # same rules, after a bounded probe
                if hit is not None:
                    offs[i], words[i], lengths[i] = hit.offset, hit.word, hit.length
                    ok[i] = True
    if full:
        ok &= block_starts_ok(pool.alloc, geo, offs, lengths)
    return Resolved(ok, offs, words, lengths)


def leading_present(pool, digests: np.ndarray, length: int | None = None) -> int:
    """How many digests, from the first, name a committed value (of exactly `length` bytes, if given).

    SGLang asks this of every prefetch (`batch_exists`, 128 keys), so the common
    case, every key in its home slot, takes one fused pass (validity.leading_mismatch).
    The keys before the first mismatch are hits; the others take the scalar lookup
    (a few keys displaced from their home slot) or, if there are many, `resolve`
    decides from the first.
    """
    n = len(digests)
    geo = pool.geo
    if not n or (length is not None and not 0 <= length <= min(geo.data_bytes, 0xFFFFFFFF)):
        return 0  # (a block meta holds a u32 length: a longer value is never stored)
    halves = digests.view("<u8")
    idx = pool.index
    bad = leading_mismatch(pool.alloc.meta_q, geo, idx.home_entries(halves[:, 0], halves[:, 1]),
                           halves, length)
    if not bad.any():
        return n
    nz = np.flatnonzero(bad)
    if nz.size <= SCALAR_AGAIN:  # a few keys displaced from their home slot (or misses): the scalar lookup
        for i in nz.tolist():
            hit = lookup(idx, pool.mm, geo, digests[i].tobytes())
            if hit is None or (length is not None and hit.length != length):
                return i
        return n
    first = int(nz[0])
    r = resolve(pool, digests[first:], full=False)
    ok = r.ok if length is None else r.ok & (r.lengths == length)
    miss = np.flatnonzero(~ok)
    return first + (int(miss[0]) if miss.size else int(ok.size))


SCALAR_AGAIN = 8  # up to this many keys displaced from their home slot take the scalar lookup at once
PROBE_WINDOW = 16  # slots after the home slot probed together; keys still undecided take the scalar lookup


__all__ = ["resolve", "leading_present", "Resolved", "PROBE_WINDOW"]
