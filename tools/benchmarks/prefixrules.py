"""The rules of the default eviction, each switched off for an A/B (`--prefixtree-ab`): what each one wins.

A variant is a contestant with some rules replaced, in this process only, by what the store does without
them; `all` switches every rule off at once.
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
    "retention": _no_retention,    # slab moves balance the classes' retention
}


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
