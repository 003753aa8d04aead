"""The prefixbounds scenario of `maru-shm bench`: simulated page policies on the prefix-tree trace.

Each policy is checked on a hand-made tree where the right victim is known, and the replay's asks and the
trace's session ends against the trace itself. No figure is asserted beyond what holds by construction.
"""

from __future__ import annotations

from types import SimpleNamespace

from tools.benchmarks.prefixbounds import EndsKnown, Offline, PageTier, RatesKnown, asks, bounds, session_ends
from tools.benchmarks.prefixtree import PAGE_BYTES, LRUTier, Trace, replay
from tools.benchmarks.report import render_prefixbounds


def tree(parents: list[int]) -> SimpleNamespace:
    """Pages 0..n-1 named k0..; parent[p] -1 for a root."""
    return SimpleNamespace(keys=[f"k{p}" for p in range(len(parents))], parent=parents)


class Recorder(LRUTier):
    def __init__(self):
        super().__init__(None)
        self.asked = []

    def exists(self, keys, prefix):
        self.asked.append(list(keys))
        return super().exists(keys, prefix)

    def restorable(self, keys):  # the replay's usable-payload samples are not asks
        return LRUTier.exists(self, keys, None), []


def test_asks_are_what_the_replay_asks():
    t = Trace(seed=5, requests=300, conversations=30)
    for like in (False, True):
        rec = Recorder()
        replay(t, rec, like)
        assert rec.asked == [[t.keys[p] for p in pages] for pages in asks(t, like)]


def test_a_session_ends_when_its_conversation_begins_again():
    t = Trace(seed=5, requests=400, conversations=20)
    ends = session_ends(t)
    assert ends, "a trace this long restarts some conversation"
    later: dict[int, set] = {}
    for i, (_, prompt, out) in enumerate(t.requests):
        for p in prompt + out:
            later.setdefault(p, set()).add(i)
    for p, i in ends.items():
        assert max(later[p]) < i  # never used again from its end on
    system = {prompt[0] for _, prompt, _ in t.requests}
    assert not system & set(ends)  # the shared system prompt's head never ends


def visit(tier, keys, prefix=()) -> int:
    """One request of a replay: lookup, then write what was missing."""
    m = tier.exists(keys, list(prefix))
    if m < len(keys):
        tier.set(keys[m:], list(prefix) + keys[:m])
    return m


def test_prefix_lru_takes_the_oldest_tail_first_and_dooms_what_is_under_it():
    t = tree([-1, 0, 1, -1, -1])  # a chain k0 <- k1 <- k2, and roots k3, k4
    tier = PageTier(3 * PAGE_BYTES, t)
    visit(tier, ["k0", "k1"])
    visit(tier, ["k3"])
    visit(tier, ["k2"], ["k0", "k1"])  # the set touches its prefix: k0, k1 as recent as k2
    assert set(tier.prio) == {"k0", "k1", "k2"}  # k3, the oldest, went
    visit(tier, ["k3"])  # the oldest are k0 k1 k2 (one touch): the tail k2 goes first
    assert set(tier.prio) == {"k0", "k1", "k3"}
    tier.touched["k0"] = -5  # make the head the oldest: its victim takes k1 under it too
    tier._push("k0")
    visit(tier, ["k4"])
    assert set(tier.prio) == {"k3", "k4"}


def test_offline_takes_the_page_asked_again_furthest_even_one_written_now():
    t = tree([-1, -1, -1])
    asked = [[0], [1], [2], [1], [0]]
    tier = Offline(2 * PAGE_BYTES, t, asked)
    hits = [visit(tier, [t.keys[p] for p in pages]) for pages in asked]
    assert hits == [0, 0, 0, 1, 1]  # k2, asked never again, was the victim of its own write
    lru = LRUTier(2 * PAGE_BYTES)
    assert [visit(lru, [t.keys[p] for p in pages]) for pages in asked] == [0, 0, 0, 1, 0]


def test_ended_pages_go_first_and_rates_rank_the_live_ones():
    t = tree([-1, -1, -1])
    tier = EndsKnown(2 * PAGE_BYTES, t, {0: 1})  # page 0's session ends at request 1
    for k in ("k1", "k0", "k2"):  # k1 is the oldest, but k0 has ended
        visit(tier, [k])
    assert set(tier.prio) == {"k1", "k2"}
    rates = RatesKnown(2 * PAGE_BYTES, t, {}, [[0], [0], [1], [2]])  # k0 asked twice, k1 and k2 once
    for k in ("k0", "k1", "k2"):
        visit(rates, [k])
    assert set(rates.prio) == {"k0", "k2"}  # k1 and k2 tie on asks: the older k1 went


def test_offline_serves_no_less_than_lru_and_the_bounds_render():
    r = bounds(seed=5, sizes=(3.0,), requests=400, conversations=30)
    for run in r["runs"].values():
        p = run["pages"]
        assert p["lru"] <= p["offline"] <= p["unbounded"]
        assert p["lru"] < p["unbounded"], "the pool must be too small for the trace to say anything"
    lines = render_prefixbounds({"by_seed": {5: r}})
    assert len(lines) == 2 and "offline" in lines[0]
