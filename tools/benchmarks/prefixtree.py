"""Prefix-tree scenario of `maru-shm bench`: the trace family (prefixtrace.py) through MaruStorage, per model.

Models: `plain` (Llama-3.1-8B pages through v1 calls, this module) and `hybrid` (DeepSeek-V4-like pages in
six pools through v2 calls, prefixtree_hybrid.py). Shapes (`SHAPES`): chat, sglang and rag, generated;
mooncake, the recorded Mooncake trace (plain model only: 256-token pages of a scaled-down KV geometry, 16 KiB
a page, so its working set fits a test machine; tokens served are counted as the trace's).

Contestants, each on the same replay:
  ours        MaruStorage made by SGLang's backend factory (the default eviction: age stamps and the prefix mark
              for the plain model, the per-class CLOCK for the hybrid one);
  clock       the same with the plain per-class CLOCK (a count to 2) for every model;
  variants    ours with a rule switched off (`--prefixtree-ab`, VARIANTS: eviction settings): each rule's A/B;
  lru         exact per-object LRU over the pool's data bytes (gets touch, sets insert absent pages);
  belady      Belady's offline bound over the same bytes (plain model);
  unbounded   a pool that never evicts: the most any policy can serve.

Pools are the trace's working set (every page it writes, once) over each of the shape's sizes. Tokens served
from L3 count over the second half of the trace; usable payload (pages whose whole prefix is stored: a leading
run of some chain) is the mean of samples over the second half, over the file and over the live payload. A
cell is one (shape, seed, replay, size); a recorded shape has one trace, so it runs at the first seed only.
A cell is judged alone where a contestant it is compared with serves at least COUNTS tokens; every cell
counts in its shape's mean.
"""

from __future__ import annotations

import numpy as np

import functools

from maru_shm import eviction_settings

from .hostpool import _host_pool, _storage_config
from .prefixtrace import (Belady, LRUTier, MaruBackend, Model, Shape, asks, host_pages, make_trace, replay,
                          working_set)
from .prefixtree_hybrid import hybrid_model
from .registry import figure, progress_of, scenario

MAX_CONTEXT = 120  # pages: the longest chain, at most one batch of SGLang's STORAGE_BATCH_SIZE (128)
LLAMA = (8, 128, 32)  # Llama-3.1-8B KV: heads, head dim, layers (bf16, K and V: 128 KiB a token)
SMALL = (1, 16, 1)  # the recorded trace's pages: 64 B a token

# The family (`--prefixtree-shapes`). chat: the trace this scenario was built on. sglang: fewer prompts, many
# slots, short conversations, an L2 of pool/8. rag: long documents shared by many short question/answer
# suffixes. mooncake: Mooncake's recorded trace at 5 / 10 / 20 % of its working set, as its README measures.
SHAPES = {
    "chat": Shape(4000, MAX_CONTEXT, sticky=0.9, host_share=1 / 12, host_of_pool=False, system_prompts=12,
                  system_pages=(8, 32), conversations=600, user_pages=(1, 4), answer_pages=(1, 6)),
    "sglang": Shape(3000, MAX_CONTEXT, system_prompts=8, system_pages=(10, 40), system_alpha=0.8,
                    conversations=2000, user_pages=(1, 5), answer_pages=(1, 5), max_turns=10),
    "rag": Shape(3000, MAX_CONTEXT, system_prompts=4, system_pages=(60, 100), conversations=3000,
                 conversation_alpha=0.8, user_pages=(1, 4), answer_pages=(1, 3), max_turns=2),
    "mooncake": Shape(3993, 748, page_tokens=256, sizes=(20.0, 10.0, 5.0), source="mooncake_synthetic.jsonl.xz"),
}
COUNTS = 5000  # tokens: a cell below this in every contestant compared counts only in its shape's mean
# The A/B of each rule of the default (`--prefixtree-ab`): the eviction settings (maru_shm.EvictionSettings) of
# the default without it. CLOCK: the plain per-class CLOCK contestant's.
CLOCK = {"age": False}
VARIANTS = {
    "age": dict(age=True),  # age stamps (and, with them, the prefix mark) instead of the hybrid model's count
    "mark": dict(prefix_mark=False),  # a lookup marks the stored copies of its prefix keys used (age pools)
    "offered": dict(offered_mark=False),  # a set marks the stored pages it offers again used
    "count": dict(ref_max=1),  # a hit raises the count to 2, not 1 (count pools: the hybrid model's)
    "retention": dict(retention=False),  # slab moves balance the classes' retention
}


def variants_of(names) -> dict:
    """`--prefixtree-ab` names -> {variant: settings}; 'all' is every rule off at once, 'a+b' rules a and b."""
    out = {}
    for n in names:
        parts = list(VARIANTS) if n == "all" else n.split("+")
        unknown = [p for p in parts if p not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown rule {unknown[0]!r} (known: {', '.join(VARIANTS)}, all)")
        out[n] = {k: v for p in parts for k, v in VARIANTS[p].items()}
    return out


def kv_geometry(shape: Shape) -> tuple:
    return SMALL if shape.source else LLAMA


def page_bytes(shape: Shape) -> int:
    heads, dim, layers = kv_geometry(shape)
    return shape.page_tokens * 2 * heads * dim * 2 * layers


@functools.lru_cache(maxsize=4)
def _shape_host_pool(page_tokens: int, pages: int, geometry: tuple):
    """One host pool per page shape, shared by every tier in turn (SGLang checks the machine's free memory
    at each host pool it makes, which a busy machine may fail mid-run)."""
    return _host_pool(page_tokens, pages, *geometry)


class MaruTier(MaruBackend):
    """A plain model's pages through MaruStorage's v1 calls, over a real host pool of the shape's pages."""

    trailing_bytes = 0

    def __init__(self, pool_size: int, tag: str, shape: Shape):
        import torch
        host = _shape_host_pool(shape.page_tokens, shape.max_context, kv_geometry(shape))
        super().__init__(pool_size, tag, host, _storage_config)
        self.page_bytes, self.tokens = page_bytes(shape), shape.page_tokens
        self.idx = torch.arange(shape.max_context * shape.page_tokens, dtype=torch.int64)

    def exists(self, keys, prefix) -> int:
        return self.backend.batch_exists(keys, self.info(prefix))

    def get(self, keys, prefix, copy: bool = True) -> None:
        if copy:
            ok = self.backend.batch_get_v1(keys, self.idx[:len(keys) * self.tokens], self.info(prefix))
            assert all(ok), "a page batch_exists reported is gone (nothing else writes this pool)"
        else:
            self.touch(self.backend.keyspace.digests(keys))

    def set(self, keys, prefix) -> None:
        ok = self.backend.batch_set_v1(keys, self.idx[:len(keys) * self.tokens], self.info(prefix))
        assert all(ok), "a set failed"

    def restorable(self, keys) -> tuple[int, list]:
        return self.backend.local_exists(keys), []  # no touch: measuring must not change what is evicted


PLAIN_MODEL = Model("plain", SHAPES, MaruTier, lambda cap, shape: LRUTier(cap, page_bytes(shape)), page_bytes, True,
                    {"age": True})


def run_size(trace, pool_size: int, sglang_like: bool, progress=lambda f: None, model: Model = PLAIN_MODEL,
             variants: dict | None = None) -> dict:
    """Every contestant at one pool size and replay: tokens served, usable / file, usable / live.
    `variants`: name -> eviction settings (`variants_of`), each one more contestant. Contestants of one
    setting share one replay: it is deterministic."""
    shape = trace.shape
    pb = model.page_bytes(shape)
    host = host_pages(trace, pool_size, pb) if sglang_like else None
    out, ran = {}, {}
    contestants = [("ours", {}), ("clock", CLOCK)] + list((variants or {}).items())
    for name, settings in contestants:
        key = tuple(sorted({**model.default, **settings}.items()))
        if key in ran:
            out[name] = dict(ran[key])
            continue
        with eviction_settings(**settings):
            tier = model.maru(pool_size, f"prefixtree-{name}", shape)
            try:
                r = replay(trace, tier, sglang_like, progress, host=host)
                r.update(file_bytes=tier.file_bytes, data_bytes=tier.data_bytes)
                assert tier.check()
            finally:
                tier.close()
        out[name] = ran[key] = r
    ours = out["ours"]
    refs = [("lru", model.lru(ours["data_bytes"], shape)), ("unbounded", model.lru(None, shape))]
    if model.belady:
        refs.append(("belady", Belady(ours["data_bytes"], pb, trace, asks(trace, sglang_like, host))))
    for name, tier in refs:
        r = replay(trace, tier, sglang_like, host=host)
        r.update(file_bytes=ours["file_bytes"], data_bytes=ours["data_bytes"])
        out[name] = r
    for r in out.values():
        r["tokens"] = r["pages"] * shape.page_tokens
        r["usable_file"] = r["usable"] / r["file_bytes"]
        r["usable_live"] = r["usable"] / r["live"] if r["live"] else 1.0
    return out


def prefixtree(seed: int = 11, sizes=None, progress=lambda f, note="": None, requests: int | None = None,
               conversations: int | None = None, model: Model = PLAIN_MODEL, shape: str = "chat",
               variants: dict | None = None, scale: float = 1.0) -> dict:
    """One shape's trace for one model, every replay and size (default: the shape's). `scale`: a generated
    shape's requests times this."""
    sh = model.shapes[shape]
    trace = make_trace(sh, seed, scale, requests, conversations)
    ws = working_set(trace, model.page_bytes(sh))
    runs = {}
    steps = [(r, s) for r in ("direct", "sglang") for s in (sizes or sh.sizes)]
    for k, (rep, ratio) in enumerate(steps):
        pool = int(ws / ratio)
        note = f"{shape} shape, {model.name} model, {rep} replay, working set {ratio:g}x the pool"
        res = run_size(trace, pool, rep == "sglang", lambda f: progress((k + f) / len(steps), note), model, variants)
        runs[f"{rep}@{ratio:g}"] = {"replay": rep, "ratio": ratio, "pool_bytes": pool, **res}
    return {"model": model.name, "shape": shape, "seed": seed, "working_set_bytes": ws, "pages": trace.pages,
            "requests": len(trace.requests), "sessions": len(trace.leaves), "runs": runs}


NAME = "prefixtree"
# The goals per model (BRIEF.md, Goals: Eviction). Plain: tokens from L3 at least VS_CLOCK x the plain CLOCK's
# and VS_LRU x exact LRU's in every cell that counts, VS_LRU_MEAN x LRU's on each shape's mean, usable / live
# at least USABLE_LIVE on the direct replay. Hybrid: at least the CLOCK's on each shape's mean, HYBRID_VS_CLOCK x
# the CLOCK's in every cell that counts.
VS_CLOCK, VS_LRU, VS_LRU_MEAN, USABLE_LIVE, HYBRID_VS_CLOCK = 0.995, 0.97, 1.0, 0.95, 0.90


def summary(results: list, variants: dict | None = None, least: int = COUNTS) -> dict:
    """Over the cells of `results` (one shape and model, any seeds): a / b tokens for the pairs the goals
    compare (mean over every cell; worst over the cells that count), the cells below each goal, the lowest
    usable / live of the direct replay, and per variant (`variants_of`) its base / variant. A cell counts
    where a contestant it is compared with serves at least `least` tokens."""
    rows = [run for r in results for run in r["runs"].values()]

    def ratios(a, b):
        v = [run[a]["tokens"] / max(1, run[b]["tokens"]) for run in rows]
        judged = [x for x, run in zip(v, rows) if max(run[a]["tokens"], run[b]["tokens"]) >= least]
        return {"mean": float(np.mean(v)), "min": float(min(judged, default=np.nan)), "max": float(max(v)),
                "judged": judged}
    def usable_live(name):
        direct = [run[name]["usable_live"] for run in rows if run["replay"] == "direct"]
        return float(min(direct)) if direct else None
    out = {"cells": len(rows), "vs_clock": ratios("ours", "clock"), "vs_lru": ratios("ours", "lru"),
           "clock_vs_lru": ratios("clock", "lru"), "usable_live_min": usable_live("ours"),
           "usable_file_min": float(min(run["ours"]["usable_file"] for run in rows)),
           "ab": {v: ratios("ours", v) for v in (variants or {})}}
    if all("belady" in run for run in rows):
        out["belady_vs_lru"] = ratios("belady", "lru")
    return out


def goals(model: str, s: dict) -> list:
    """(name, figure, goal, cells below it or None, cells judged or None) of one shape's summary `s`."""
    def worst(name, pair, goal):
        judged = s[pair]["judged"]
        return name, s[pair]["min"], goal, sum(x < goal for x in judged), len(judged)
    if model == "hybrid":
        return [worst("tokens from L3 / plain CLOCK, worst cell that counts", "vs_clock", HYBRID_VS_CLOCK),
                ("tokens from L3 / plain CLOCK, mean", s["vs_clock"]["mean"], 1.0, None, None)]
    out = [worst("tokens from L3 / plain CLOCK, worst cell that counts", "vs_clock", VS_CLOCK),
           worst("tokens from L3 / exact LRU, worst cell that counts", "vs_lru", VS_LRU),
           ("tokens from L3 / exact LRU, mean", s["vs_lru"]["mean"], VS_LRU_MEAN, None, None)]
    if s["usable_live_min"] is not None:
        out.append(("usable / live payload, lowest direct cell", s["usable_live_min"], USABLE_LIVE, None, None))
    return out


def _figures(r: dict) -> list:
    """One shape's figures: per model, its goals over the cells, and the A/B of each variant."""
    figs = []
    for model, s in r["summary"].items():
        where = f"{r['shape']} shape, {model} model, {s['cells']} cells"
        for name, value, goal, below, judged in goals(model, s):
            figs.append(figure(f"{name}, {where}", value, None, None, goal=f">= {goal:.3f}",
                               met=not value < goal and not below, below=below, judged=judged))
        if "belady_vs_lru" in s:
            figs.append(figure(f"Belady's bound: tokens / exact LRU, mean, {where}", s["belady_vs_lru"]["mean"]))
        for v, ab in s["ab"].items():
            figs.append(figure(f"A/B: tokens with / without {v}, mean, {where}", ab["mean"], None, None,
                               worst=ab["min"]))
    return figs


@scenario(NAME)
def bench_prefixtree(args) -> dict:
    progress = progress_of(args)
    seeds = list(getattr(args, "prefixtree_seeds", None) or [11, 12, 13])
    shapes = list(getattr(args, "prefixtree_shapes", None) or SHAPES)
    variants = variants_of(getattr(args, "prefixtree_ab", None) or [])
    wanted = getattr(args, "prefixtree_models", None) or ["plain", "hybrid"]
    models = [m() for name, m in (("plain", lambda: PLAIN_MODEL), ("hybrid", hybrid_model)) if name in wanted]
    steps = [(sh, seed, m) for sh in shapes for m in models if sh in m.shapes
             for seed in (seeds[:1] if m.shapes[sh].source else seeds)]
    by_shape: dict = {}
    for k, (sh, seed, m) in enumerate(steps):
        def part(f, note="", k=k, seed=seed):
            progress((k + f) / len(steps), f"seed {seed}, {note}")
        res = prefixtree(seed, progress=part, model=m, shape=sh, variants=variants,
                         scale=getattr(args, "prefixtree_scale", None) or 1.0)
        by_shape.setdefault(sh, {}).setdefault(seed, {})[m.name] = res
    out, figs = {}, []
    for sh, by_seed in by_shape.items():
        names = {name for models_ in by_seed.values() for name in models_}
        summ = {n: summary([by_seed[seed][n] for seed in by_seed if n in by_seed[seed]], variants) for n in names}
        out[sh] = {"shape": sh, "by_seed": by_seed, "summary": summ}
        figs += _figures(out[sh])
    return {"scenario": NAME, "seeds": seeds, "shapes": out, "variants": variants,
            "figures": figs}
