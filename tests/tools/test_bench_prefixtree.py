"""The prefix-tree scenario of `maru-shm bench`: its trace family, its reference tiers, and tiny runs.

Nothing here asserts a goal: only that the trace is the tree it claims to be, that the reference tiers
are exact on hand-made cases, and that a run through the real MaruStorage produces sane figures (a pool
that holds the whole working set serves exactly what an unbounded one does).
"""

from __future__ import annotations

import numpy as np
import pytest

from tools.benchmarks.prefixtrace import (Belady, HostCache, LRUTier, Trace, asks, host_pages, make_trace)
from tools.benchmarks.prefixtree import MAX_CONTEXT, SHAPES, _figures, page_bytes, prefixtree, summary, variants_of
from tools.benchmarks.report import render_prefixtree
from tools.benchmarks.prefixtree_hybrid import HybridLRUTier, hybrid_model

PAGE_BYTES = page_bytes(SHAPES["chat"])
GENERATED = sorted(n for n, sh in SHAPES.items() if not sh.source)
FIGURE_KEYS = {"name", "unit", "ours", "spread", "peer", "peer_name", "peer_spread", "ratio", "better", "goal", "met"}


def test_trace_is_a_seeded_prefix_tree():
    t = Trace(SHAPES["chat"], seed=5, requests=300, conversations=30)
    assert Trace(SHAPES["chat"], seed=5, requests=300, conversations=30).requests == t.requests
    assert len(set(t.keys)) == t.pages == len(t.parent)
    for _, prompt, out in t.requests:
        chain = prompt + out
        assert len(chain) <= MAX_CONTEXT
        assert t.parent[chain[0]] == -1  # every chain starts at a system prompt
        assert all(t.parent[b] == a for a, b in zip(chain, chain[1:]))
    roots = {p for p in range(t.pages) if t.parent[p] == -1}
    assert 1 < len(roots) <= 12
    on_leaf = {p for chain in t.leaves for p in chain}
    assert on_leaf == set(range(t.pages))  # usable payload is measured over the leaves: they cover every page
    # shared system prompts: some conversations start with the same page
    starts = [prompt[0] for _, prompt, _ in t.requests]
    assert len(set(starts)) < len({c for c, _, _ in t.requests})


@pytest.mark.parametrize("name", GENERATED)
def test_every_shape_keeps_its_parameters(name):
    sh = SHAPES[name]
    t = Trace(sh, seed=7, requests=400)
    roots = {p for p in range(t.pages) if t.parent[p] == -1}
    assert len(roots) <= sh.system_prompts
    assert all(sh.system_pages[0] <= len(prompt) for _, prompt, _ in t.requests)
    last: dict = {}
    for c, prompt, out in t.requests:
        assert len(prompt) + len(out) <= sh.max_context
        n, chain = last.get(c, (0, None))
        n = n + 1 if chain is not None and prompt[:len(chain)] == chain else 1  # a turn, or a new conversation
        assert sh.max_turns == 0 or n <= sh.max_turns
        last[c] = (n, prompt + out)


def test_host_l2_is_a_share_of_the_working_set_or_of_the_pool():
    chat, rag = Trace(SHAPES["chat"], seed=3, requests=300), Trace(SHAPES["rag"], seed=3, requests=300)
    assert host_pages(chat, 10 << 30, PAGE_BYTES) == max(chat.shape.max_context, int(chat.pages / 12))
    assert host_pages(rag, 1000 * PAGE_BYTES, PAGE_BYTES) == max(rag.shape.max_context, 125)


def test_lru_tier_exact_on_hand_made_case():
    lru = LRUTier(3 * PAGE_BYTES + 5, PAGE_BYTES)  # three pages
    lru.set(["a", "b", "c"], [])
    assert lru.exists(["a", "b", "x", "c"], []) == 2
    lru.get(["a"], [])  # a becomes the most recent; b is now the oldest
    lru.set(["d"], ["a", "b", "c"])
    assert list(lru.items) == ["c", "a", "d"]
    lru.set(["a", "e"], [])  # a present: not moved by a set; e evicts c
    assert list(lru.items) == ["a", "d", "e"]
    assert lru.live_bytes() == 3 * PAGE_BYTES and lru.restorable(["a", "d"]) == (2, [])
    unbounded = LRUTier(None, PAGE_BYTES)
    unbounded.set([str(i) for i in range(1000)], [])
    assert len(unbounded.items) == 1000


def test_the_recorded_trace_is_mooncakes_block_chains():
    """Every request's hash_ids become its blocks' pages, two pages a block; equal ids are one block."""
    t = make_trace(SHAPES["mooncake"], seed=0)
    assert len(t.requests) == 3993 and t.pages == 2 * 43924
    assert make_trace(SHAPES["mooncake"], seed=5).keys == t.keys  # recorded: no seed changes it
    assert sum(len(p) for _, p, _ in t.requests) == 2 * 121877  # its block accesses
    for _, prompt, out in t.requests:
        assert not out and len(prompt) <= SHAPES["mooncake"].max_context
        assert t.parent[prompt[0]] == -1 and all(t.parent[b] == a for a, b in zip(prompt, prompt[1:]))
    assert {p for chain in t.leaves for p in chain} == set(range(t.pages))


def test_lru_and_belady_on_the_recorded_trace_agree_with_its_readme():
    """At block granularity (one page a block) and over the whole trace, as the trace's README measures: exact
    LRU serves 0.155 / 0.260 / 0.391 of the block accesses at 5 / 10 / 20 % of the unique blocks, Belady 0.386 /
    0.501 / 0.606. The bench's LRU touches only the hit run SGLang reads (the README's touches every block) and
    its Belady evicts a chain's tail first on ties (the README's breaks them by id): within 0.002 and 0.010."""
    t = make_trace(SHAPES["mooncake"]._replace(page_tokens=512), seed=0)
    asked = asks(t, False)
    got = []
    for frac in (0.05, 0.10, 0.20):
        for tier in (LRUTier(int(t.pages * frac), 1), Belady(int(t.pages * frac), 1, t, asked)):
            hit = total = 0
            for _, prompt, _ in t.requests:
                keys = [t.keys[p] for p in prompt]
                m = tier.exists(keys, [])
                tier.get(keys[:m], [])
                tier.set(keys[m:], keys[:m])
                hit, total = hit + m, total + len(keys)
            got.append(round(hit / total, 3))
    assert got == [0.154, 0.396, 0.261, 0.506, 0.389, 0.608]
    readme = [0.155, 0.386, 0.260, 0.501, 0.391, 0.606]
    assert all(abs(a - b) <= (0.0025 if i % 2 == 0 else 0.0105) for i, (a, b) in enumerate(zip(got, readme)))


def test_belady_keeps_the_page_asked_soonest():
    t = Trace(SHAPES["chat"], seed=3, requests=40, conversations=4)
    k = t.keys
    tier = Belady(2, 1, t, [[0], [1], [0]])
    assert tier.exists([k[0]], []) == 0
    tier.set([k[0]], [])
    assert tier.exists([k[1]], []) == 0
    tier.set([k[1], k[2]], [])  # over capacity: k[1] and k[2] are never asked again, the later page goes
    assert set(tier.items) == {k[0], k[1]}
    assert tier.restorable([k[0], k[1]]) == (2, []) and tier.now == 1  # measuring is no lookup
    assert tier.exists([k[0]], []) == 1


def test_host_cache_evicts_tails_first():
    host = HostCache(4)
    host.insert([1, 2, 3])
    host.insert([1, 2, 7, 8])  # 3 is the oldest page: it goes, the shared head stays
    assert host.held([1, 2, 3]) == 2
    assert host.held([1, 2, 7, 8, 9]) == 4
    assert host.held([5, 1]) == 0


def test_hybrid_lru_follows_batch_exists_v2():
    sizes = {"c1": 10, "c4": 3, "swa": 4}
    lru = HybridLRUTier(None, sizes)
    lru.set(["a", "b", "c"], [])  # one set call: a window page at c only
    lru.set(["d", "e"], ["a", "b", "c"])
    assert lru.restorable(["a", "b", "c", "d", "e", "f"]) == (5, [3, 5])
    assert lru.exists(["a", "b"], []) == 0  # no window page ends this prefix
    assert lru.live_bytes() == 5 * 13 + 2 * 4
    del lru.items[("c4", "d")]  # one pool's page gone: the prefix stops before it
    assert lru.restorable(["a", "b", "c", "d", "e"]) == (3, [3])
    small = HybridLRUTier(3 * 13 + 4, sizes)
    small.set(["a", "b", "c"], [])
    small.set(["d"], ["a", "b", "c"])  # evicts the oldest objects: a's pages
    assert small.used <= 3 * 13 + 4 and small.exists(["a", "b", "c"], []) == 0


@pytest.fixture(scope="module")
def tiny():
    # 0.8: a pool larger than the working set (nothing is evicted), 4: a pool that must evict
    return prefixtree(requests=160, conversations=16, sizes=(0.8, 4.0), variants=variants_of(["all"]))


def test_tiny_run_structure_and_sanity(tiny):
    assert tiny["pages"] > 0 and tiny["requests"] == 160
    assert set(tiny["runs"]) == {"direct@0.8", "direct@4", "sglang@0.8", "sglang@4"}
    for run in tiny["runs"].values():
        top = run["unbounded"]
        assert top["usable_live"] == 1.0 and top["tokens"] > 0
        for name in ("ours", "clock", "all", "lru", "belady"):
            r = run[name]
            assert 0 <= r["tokens"] <= top["tokens"]
            assert 0 < r["usable_live"] <= 1.0 and 0 < r["usable_file"] <= 1.0
    for rep in ("direct", "sglang"):
        whole = tiny["runs"][f"{rep}@0.8"]
        # a pool that holds every page evicts nothing: it serves all an unbounded one does
        assert whole["ours"]["tokens"] == whole["clock"]["tokens"] == whole["all"]["tokens"] == whole["unbounded"]["tokens"]
        assert whole["belady"]["tokens"] == whole["unbounded"]["tokens"]
        assert whole["ours"]["usable_live"] == pytest.approx(1.0, abs=1e-4)  # the backend keeps a few bytes of its own
        small = tiny["runs"][f"{rep}@4"]
        assert small["ours"]["tokens"] < small["unbounded"]["tokens"]  # a quarter of the tree cannot serve it all
        assert small["lru"]["tokens"] <= small["belady"]["tokens"] <= small["unbounded"]["tokens"]


def test_summary_is_the_cells_own_figures(tiny):
    """Two seeds' tiny runs: the summary's ratios are the cells' own, its worst the lowest, and the report
    prints the summary and every cell."""
    other = prefixtree(seed=12, requests=160, conversations=16, sizes=(0.8, 4.0), variants=variants_of(["all"]))
    assert other["pages"] != tiny["pages"]  # another trace
    s = summary([tiny, other], variants_of(["all"]), least=0)  # every cell judged alone
    runs = list(tiny["runs"].values()) + list(other["runs"].values())
    vs_lru = [r["ours"]["tokens"] / r["lru"]["tokens"] for r in runs]
    assert s["cells"] == 8 and s["vs_lru"]["mean"] == pytest.approx(sum(vs_lru) / 8) and s["vs_lru"]["min"] == min(vs_lru)
    assert s["ab"]["all"]["min"] == min(r["ours"]["tokens"] / max(1, r["all"]["tokens"]) for r in runs)
    assert s["usable_live_min"] == min(r["ours"]["usable_live"] for r in runs if r["replay"] == "direct")
    result = {"shape": "chat", "summary": {"plain": s}, "by_seed": {11: {"plain": tiny}, 12: {"plain": other}}}
    figs = _figures(result)
    assert figs and all(FIGURE_KEYS <= set(f) for f in figs)
    assert any(f["name"].startswith("A/B") for f in figs)
    lines = render_prefixtree({"shapes": {"chat": result}})
    assert sum(x.startswith("prefixtree chat plain seed") for x in lines) == 2 and "without all" in lines[0]


def test_variants_are_eviction_settings():
    v = variants_of(["count", "retention+offered", "all"])
    assert v["count"] == {"ref_max": 1}
    assert v["retention+offered"] == {"retention": False, "offered_mark": False}
    assert v["all"] == {"age": True, "prefix_mark": False, "offered_mark": False, "ref_max": 1, "retention": False}
    with pytest.raises(ValueError):
        variants_of(["no such rule"])


def test_tiny_hybrid_run_matches_the_unbounded_pool_when_nothing_is_evicted():
    r = prefixtree(requests=60, conversations=8, sizes=(0.8,), model=hybrid_model())
    assert r["model"] == "hybrid"
    for rep in ("direct", "sglang"):
        run = r["runs"][f"{rep}@0.8"]
        # MaruStorage's batch_exists_v2 and the LRU's mirror of its rule agree where nothing is evicted
        assert run["ours"]["tokens"] == run["unbounded"]["tokens"] > 0
        assert run["unbounded"]["usable_live"] == pytest.approx(1.0)
        assert run["ours"]["usable_live"] == pytest.approx(1.0, abs=1e-3)


def test_hybrid_tier_creates_its_pool_for_its_smallest_page(caplog):
    """The bench drives MaruStorage as SGLang does: nothing touches the store before every v2 pool is
    registered, so the pool is created for the smallest page and never warns that it was made for larger."""
    from tools.benchmarks.prefixtree_hybrid import HybridMaruTier
    caplog.set_level("WARNING", logger="maru_sglang")
    tier = HybridMaruTier(256 << 20, "t-hybrid-sizing")
    try:
        store = tier.backend.store
        assert all(store.geo.shortfalls(b) == [] for b in tier.sizes.values() if b)  # every page fits densely
        assert not [r for r in caplog.records if "created for larger values" in r.getMessage()]
    finally:
        tier.close()


def test_the_count_and_offered_switches_reach_a_store_opened_under_them(pool_path):
    """`--prefixtree-ab count` and `offered`: a count pool opened under their settings raises a hit's ref to 1 at
    most and gets no mark on a page a set offers again; one opened after them has the count to 2 and the mark."""
    from maru_sglang import pages
    from maru_shm import Store, eviction_settings, remove_pool
    from maru_shm.index import key_digest
    from ..conftest import make_value

    def refs(s, g, gets):
        for _ in range(gets):
            assert s.get("k") is not None
        return int(s.alloc.meta_refs[g])

    for settings, top, mark in ((variants_of(["count+offered"])["count+offered"], 1, False), ({}, 2, True)):
        with eviction_settings(**settings):
            s = Store.open(pool_path, "16M", create=True)
        with s:
            assert s.put("k", make_value("k", 1, 4096))
            g = s.index.find(key_digest("k"))[1] // s.geo.granule
            assert refs(s, g, 3) == top  # a hit raises the count to the setting's top
            s.alloc.meta_refs[g] = 0
            pages.mark_offered_again(s, np.frombuffer(key_digest("k"), np.uint8).reshape(1, 16))
            assert refs(s, g, 0) == mark
        remove_pool(pool_path)
