"""How often chance alone puts ours this far behind the peer: a permutation test on medians.

A shared machine's runs spread by up to 20 %; a median that misses its goal by 2 % may be noise. Under the
hypothesis that both sets of runs come from one distribution, every split of the pooled runs into sets of
the same sizes is as likely; the p-value is the share of splits whose median gap is at least the observed
one, in the direction that is worse for ours. Exact up to EXACT_SPLITS splits, else sampled (fixed seed).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

EXACT_SPLITS = 20_000
SAMPLED_SPLITS = 20_000


def worse_by_chance(ours: list[float], peer: list[float], better: str = "lower") -> float | None:
    """The one-sided permutation p-value of median(ours) being worse than median(peer) by as much as it is;
    None with fewer than 2 runs on a side."""
    if len(ours) < 2 or len(peer) < 2:
        return None
    sign = 1.0 if better == "lower" else -1.0
    pooled, n = list(ours) + list(peer), len(ours)

    def gap(idx: set[int]) -> float:
        a = [x for i, x in enumerate(pooled) if i in idx]
        b = [x for i, x in enumerate(pooled) if i not in idx]
        return sign * (statistics.median(a) - statistics.median(b))
    observed = gap(set(range(n))) - 1e-12 * max(1.0, abs(max(pooled, key=abs)))
    if math.comb(len(pooled), n) <= EXACT_SPLITS:
        splits = [set(c) for c in itertools.combinations(range(len(pooled)), n)]
    else:
        rng = random.Random(0)
        splits = [set(rng.sample(range(len(pooled)), n)) for _ in range(SAMPLED_SPLITS)]
    return sum(gap(s) >= observed for s in splits) / len(splits)
