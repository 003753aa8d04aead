"""The rules of the default eviction, each switched off for an A/B (`--prefixtree-ab`): what each one wins.

A variant is a contestant with some rules replaced, in this process only, by what the store does without
them; `all` switches every rule off at once. A rule of the relation records (RECORD_RULES) changes only a
pool that writes them, so its variant runs with `maru_prefix_eviction: true` and is compared with that;
the others (the CLOCK's count, the slab moves) change the default.
"""

from __future__ import annotations

import contextlib

import numpy as np


def _one_bit_ref():
    """The CLOCKs' `ref` one bit (REF_MAX 1), and no mark on the stored pages a set offers again."""
    from maru_sglang import pages
    from maru_shm import readpath
    from maru_shm.allocator import blockclock, blockmeta
    return [(m, "REF_MAX", 1) for m in (readpath, blockclock, blockmeta)] + \
        [(pages, "mark_offered_again", lambda store, digests, found=None: None)]


def _no_order():
    from maru_shm.allocator import blockclock
    return [(blockclock, "_victim_order", lambda plain, rows, valid: plain)]


def _no_parent_strand():
    from maru_shm.allocator.relations import Relations
    stranded_by = Relations._stranded_by

    def by_group_only(self, rows, valid, ring):
        by_group, by_parent = stranded_by(self, rows, valid, ring)
        return by_group, np.zeros_like(by_parent)
    return [(Relations, "_stranded_by", by_group_only)]


def _no_trailing_doom():
    from maru_shm.allocator.relations import TRAILING, Relations
    doom = Relations.doom

    def without_trailing(self, rows, by_parent):
        keep = (rows["depth"] & TRAILING) == 0
        return doom(self, rows[keep], by_parent[keep])
    return [(Relations, "doom", without_trailing)]


def _no_birth_doom():
    from maru_sglang.lineage import Lineage
    return [(Lineage, "stored", lambda self, seg: None)]


def _no_stranded_search():
    from maru_shm.allocator.blockclock import BlockClock
    from maru_shm.allocator.facade import Allocator
    evict = BlockClock.evict_blocks

    def evict_blocks(self, info, m, stranded_only=False):
        return 0 if stranded_only else evict(self, info, m)
    return [(BlockClock, "evict_blocks", evict_blocks), (Allocator, "reclaim_stranded", lambda self: 0)]


def _no_retention():
    """A class with a slab evicts its own blocks (a move only into a class with none, or when it finds no
    victim)."""
    from maru_shm.allocator.demand import DemandPolicy

    def donors(self, info):
        has = self.cls_nslabs > 0
        return np.flatnonzero(has) if not has[info.cid] else np.zeros(0, dtype=np.int64)
    return [(DemandPolicy, "donors", donors)]


RULES = {
    "count": _one_bit_ref,         # a hit raises the ref count to 2, a set marks the pages it offers again
    "order": _no_order,            # a chunk's victims segment by segment, tail first
    "parent": _no_parent_strand,   # a doom of a segment strands the segments continuing it
    "trailing": _no_trailing_doom,  # losing a trailing pool's page (SWA, Mamba) dooms its whole segment
    "birthdoom": _no_birth_doom,   # a segment written after its parent went is doomed at birth
    "stranded": _no_stranded_search,  # stranded values searched for before a move or CLOCK victim, and reclaimed
    "retention": _no_retention,    # slab moves balance the classes' retention
}


RECORD_RULES = {"order", "parent", "trailing", "birthdoom", "stranded"}


def record_rules(off) -> bool:
    """Does a variant switching these rules off switch off a rule of the relation records?"""
    return bool(RECORD_RULES & set(off))


def variants_of(names) -> dict:
    """`--prefixtree-ab` names -> {variant: rules off}; 'all' is every rule at once, 'a+b' rules a and b."""
    out = {}
    for n in names:
        if "+" in n:  # several rules in one variant
            out[n] = tuple(r for part in n.split("+") for r in variants_of([part])[part])
        elif n == "all":
            out["all"] = tuple(RULES)
        elif n in RULES:
            out[n] = (n,)
        else:
            raise ValueError(f"unknown rule {n!r} (known: {', '.join(RULES)}, all)")
    return out


@contextlib.contextmanager
def rules_off(names):
    """Within: the default without these rules (module attributes replaced, restored on the way out)."""
    saved = []
    try:
        for n in names:
            for owner, attr, value in RULES[n]():
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
