"""Policy bounds on the prefix-tree trace: what a page-level policy can serve, online to offline.

The prefix-tree scenario measures the store against exact per-object LRU and an unbounded pool. This one
asks how much of that gap any eviction policy can win, and what it must know to win it. Each contestant
is a simulation of pages (no pool file, one 128 KiB page per key, as many as the pool's size holds)
replayed by `prefixtree.replay` on the plain model's trace, beside exact LRU and an unbounded pool:

  prefix LRU   online: exact LRU whose lookups (on a hit) and sets touch the call's prefix keys, as
               MaruStorage's do, whose victim takes the stored pages under it (a doom, as the store's
               relation records do), and which evicts a call's pages tail first. What recency and the
               prefix tree tell.
  ends known   prefix LRU that also knows when each session ends (its conversation starts afresh on its
               system prompt): the ended pages go first. An oracle of the trace's future.
  rates known  ends known, and among the live pages the fewest L3 asks over the whole trace go first (an
               oracle of each page's popularity as L3 sees it).
  offline      Belady over the replay's L3 asks: the page asked again furthest in the future goes first,
               tail first on ties. The routing and the host caches do not depend on L3, so the asks are
               known before the replay (`asks`).

The share of the gap won is (policy - LRU) / (unbounded - LRU), as in the prefix-tree scenario.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict

from .prefixtree import PAGE_BYTES, PLAIN_MODEL, SIZES, LRUTier, Trace, leading_run, replay, visits
from .registry import figure, progress_of, scenario

NEVER = 1 << 40  # the next ask of a page asked no more


def asks(trace: Trace, sglang_like: bool) -> list[list[int]]:
    """The pages each request asks L3 for, in request order (every request asks: its user message is new)."""
    out = []
    for _, prompt, _, h in visits(trace, sglang_like):
        assert h < len(prompt), "a request whose whole prompt an instance holds would not ask L3"
        out.append(prompt[h:])
    return out


def session_ends(trace: Trace) -> dict[int, int]:
    """page -> the request at which its session ended (its conversation began again on its system prompt).
    System-prompt pages, which the new session shares, and the last session of each conversation never end."""
    last: dict[int, list[int]] = {}
    ends: dict[int, int] = {}
    for i, (c, prompt, out) in enumerate(trace.requests):
        before = last.get(c)
        if before is not None and prompt[:len(before)] != before:
            kept = set(prompt)
            for p in before:
                if p not in kept:
                    ends.setdefault(p, i)
        last[c] = prompt + out
    return ends


class PageTier:
    """A simulated pool of `capacity_bytes // PAGE_BYTES` pages. Eviction takes the present page of the
    smallest `priority(page)` (kept current in a lazy heap) and every stored page under it. The clock is
    the request index: every request makes one lookup."""

    page_bytes, trailing_bytes = PAGE_BYTES, 0
    dooms = True  # a victim takes the stored pages under it

    def __init__(self, capacity_bytes: int, trace: Trace):
        self.capacity = capacity_bytes // PAGE_BYTES
        self.trace, self.pid = trace, {k: p for p, k in enumerate(trace.keys)}
        self.children: dict[int, list[int]] = defaultdict(list)
        for p, q in enumerate(trace.parent):
            self.children[q].append(p)
        self.prio: dict[str, tuple] = {}
        self.heap: list = []
        self.now = -1
        self.touched: dict[str, int] = {}

    def priority(self, k: str) -> tuple:
        return self.touched[k], -self.pid[k]

    def _push(self, k: str) -> None:
        pr = self.priority(k)
        self.prio[k] = pr
        heapq.heappush(self.heap, (pr, k))

    def _touch(self, keys) -> None:
        for k in keys or ():
            if k in self.prio:
                self.touched[k] = self.now
                self._push(k)

    def tick(self, keys) -> None:
        """A new request, asking for `keys`."""
        self.now += 1

    def exists(self, keys, prefix) -> int:
        self.tick(keys)
        m = leading_run(self.prio, keys)
        if m:
            self._touch(prefix)
        return m

    def get(self, keys, prefix) -> None:
        self._touch(keys)

    def set(self, keys, prefix) -> None:
        """Insert the absent pages, touch the prefix, then evict while over capacity: a page written now may
        be the victim (Belady keeps a page asked never again only as long as nothing else needs the room)."""
        for k in keys:
            if k not in self.prio:
                self.touched[k] = self.now
                self._push(k)
        self._touch(prefix)
        while len(self.prio) > self.capacity:
            self._evict()

    def _evict(self) -> None:
        while True:
            pr, k = heapq.heappop(self.heap)
            if self.prio.get(k) == pr:
                break
        self._drop(k)
        stack = list(self.children.get(self.pid[k], ())) if self.dooms else []
        while stack:
            p = stack.pop()
            if self.trace.keys[p] in self.prio:
                self._drop(self.trace.keys[p])
                stack.extend(self.children.get(p, ()))

    def _drop(self, k: str) -> None:
        del self.prio[k], self.touched[k]

    def restorable(self, keys) -> tuple[int, list]:
        return leading_run(self.prio, keys), []

    def live_bytes(self) -> int:
        return len(self.prio) * PAGE_BYTES

    def close(self) -> None:
        pass


class EndsKnown(PageTier):
    """Prefix LRU that knows when sessions end: an ended page goes before any live one."""

    def __init__(self, capacity_bytes: int, trace: Trace, ends: dict[int, int]):
        super().__init__(capacity_bytes, trace)
        self.ends = ends
        self.ending: dict[int, list[str]] = defaultdict(list)
        for p, i in ends.items():
            self.ending[i].append(trace.keys[p])

    def live(self, k: str) -> bool:
        return self.ends.get(self.pid[k], NEVER) > self.now

    def priority(self, k: str) -> tuple:
        return (self.live(k),) + super().priority(k)

    def tick(self, keys) -> None:
        super().tick(keys)
        for k in self.ending.pop(self.now, ()):
            if k in self.prio:
                self._push(k)


class RatesKnown(EndsKnown):
    """Ends known, and among live pages the fewest L3 asks over the whole trace go first."""

    def __init__(self, capacity_bytes: int, trace: Trace, ends: dict[int, int], asked: list[list[int]]):
        super().__init__(capacity_bytes, trace, ends)
        self.asks: dict[str, int] = defaultdict(int)
        for pages in asked:
            for p in pages:
                self.asks[trace.keys[p]] += 1

    def priority(self, k: str) -> tuple:
        return (self.live(k), self.asks[k]) + PageTier.priority(self, k)


class Offline(PageTier):
    """Belady: the present page whose next L3 ask is furthest goes first. No doom: a page under the victim
    that is asked sooner stays, and a lookup with prefix keys needs no stored head."""

    dooms = False

    def __init__(self, capacity_bytes: int, trace: Trace, asked: list[list[int]]):
        super().__init__(capacity_bytes, trace)
        self.times: dict[str, list[int]] = defaultdict(list)
        for i, pages in enumerate(asked):
            for p in pages:
                self.times[trace.keys[p]].append(i)

    def priority(self, k: str) -> tuple:
        t = self.times.get(k, ())
        j = bisect.bisect_right(t, self.now)
        return -(t[j] if j < len(t) else NEVER), -self.pid[k]

    def tick(self, keys) -> None:
        super().tick(keys)
        for k in keys:  # the pages asked now: their next ask moves on
            if k in self.prio:
                self._push(k)


CONTESTANTS = ("prefix_lru", "ends_known", "rates_known", "offline")


def bounds(seed: int = 11, sizes=SIZES, progress=lambda f, note="": None, requests: int | None = None,
           conversations: int | None = None) -> dict:
    """Pages served over the second half by each contestant, LRU and unbounded, per replay and size, with the
    share of the gap won. Capacities are the prefix-tree scenario's pool sizes, whole."""
    m = PLAIN_MODEL
    trace = Trace(seed, requests or m.requests, conversations or m.conversations, m.shape)
    working_set = replay(trace, LRUTier(None), False)["live_max"]
    ends, runs = session_ends(trace), {}
    steps = [(r, s) for r in ("direct", "sglang") for s in sizes]
    for k, (rep, ratio) in enumerate(steps):
        progress(k / len(steps), f"{rep} replay, working set {ratio:g}x the pool")
        like, cap = rep == "sglang", int(working_set / ratio)
        asked = asks(trace, like)
        tiers = {"lru": LRUTier(cap), "unbounded": LRUTier(None), "prefix_lru": PageTier(cap, trace),
                 "ends_known": EndsKnown(cap, trace, ends), "rates_known": RatesKnown(cap, trace, ends, asked),
                 "offline": Offline(cap, trace, asked)}
        pages = {name: replay(trace, tier, like)["pages"] for name, tier in tiers.items()}
        lo, hi = pages["lru"], pages["unbounded"]
        gap = {name: (v - lo) / (hi - lo) if hi > lo else 0.0 for name, v in pages.items()}
        runs[f"{rep}@{ratio:g}"] = {"replay": rep, "ratio": ratio, "pool_bytes": cap, "pages": pages, "gap_share": gap}
    return {"seed": seed, "pages": trace.pages, "requests": len(trace.requests), "runs": runs}


NAME = "prefixbounds"


@scenario(NAME)
def bench_prefixbounds(args) -> dict:
    seeds = list(getattr(args, "prefixtree_seeds", None) or [11])
    progress = progress_of(args)
    by_seed = {}
    for i, seed in enumerate(seeds):
        by_seed[seed] = bounds(seed, progress=lambda f, note="", i=i, seed=seed:
                               progress((i + f) / len(seeds), f"seed {seed}, {note}"))
    figs = []
    for seed, r in by_seed.items():
        for key, run in r["runs"].items():
            g, p = run["gap_share"], run["pages"]
            where = f"seed {seed}, plain model, {run['replay']} replay, working set {run['ratio']:g}x pool"
            for name in CONTESTANTS:
                figs.append(figure(f"share of the gap LRU -> unbounded won by {name.replace('_', ' ')}, {where}",
                                   g[name], None, None, pages=p[name], lru=p["lru"], unbounded=p["unbounded"]))
    return {"scenario": NAME, "seeds": seeds, "by_seed": by_seed, "figures": figs}
