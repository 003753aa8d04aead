"""Prefix-tree scenario of `maru-shm bench`: a family of SGLang-like conversation traces through MaruStorage.

A trace (seeded, `Trace`, its parameters a `Shape`): conversations open with one of a few shared system
prompts (Zipf-popular), then grow turn by turn: each request is the conversation so far plus a new user
message, and its answer is appended after it. Conversation slots come back with Zipf popularity; one that
reaches its last turn or outgrows the context starts a new conversation on its system prompt. Every page is
a 128 KiB KV page of Llama-3.1-8B at page_size 1 (one token per page), keyed like SGLang's page-hash
chain: a page's key names its whole prefix. The family (`SHAPES`): chat, sglang, rag.

Two replays of the same trace:

  direct     every request asks L3 for its whole prompt (batch_exists, then batch_get_v1 of the hit run)
             and writes what L3 did not have (batch_set_v1 with prefix_keys, as SGLang's backup does);
  SGLang-like  the shape's instances, each with its own host L2 (a page LRU touched tail to head, so it
             evicts leaves first as SGLang's radix tree does) and sticky routing. A request first takes the
             leading run its instance holds in host memory, asks L3 only for the rest with the held keys as
             `prefix_keys` (SGLang's `hicache_storage_pass_prefix_keys: true`), and backs up what it computed.

Contestants, each on the same replay:
  ours        MaruStorage made by SGLang's backend factory (the default eviction);
  clock       the same with `maru_prefix_eviction: false` (the plain per-class CLOCK);
  records     the same with `maru_prefix_eviction: true` (relation records: group dooming);
  variants    ours, or records for a rule of theirs, with rules switched off (prefixrules.py,
              `--prefixtree-ab`): the A/B of each rule;
  LRU         exact per-object LRU over the pool's data bytes (gets touch, sets insert absent pages);
  LRU held    the same over the most pages the pool held: the policy alone, without the slabs' cost;
  unbounded   a pool that never evicts: the most any policy can serve.

Pool sizes are the trace's working set (every page it writes, once) over 1.5, 3 and 6. Tokens served from
L3 count over the second half of the trace; usable payload (pages whose whole prefix is stored: a leading
run of some chain) is the mean of samples over the second half, over the file and over the live payload.
A cell is one (shape, seed, replay, size); the goals (VS_CLOCK ...) hold in every cell.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from maru_shm import remove_pool

from .hostpool import _host_pool, _storage_config, maru_extra
from .prefixrules import record_rules, rules_off, variants_of
from .registry import figure, pool_path, progress_of, scenario

PAGE_BYTES = 128 << 10  # Llama-3.1-8B, bf16, page_size 1: one token per page
MAX_CONTEXT = 120  # the longest chain, at most one batch of SGLang's STORAGE_BATCH_SIZE (128): a chain is one call


class Shape(NamedTuple):
    """A trace shape. Page counts are (lo, hi), drawn uniformly; popularity is Zipf(alpha) over a shuffled rank.

    A conversation opens on its system prompt and grows by turns (a user message, then its answer); after
    `max_turns` turns (0: no limit), or when the next turn would pass `max_context`, its slot starts a new
    conversation on the same system prompt. The SGLang-like replay gives each of `instances` servers a host
    L2 of `host_share` times the working set (or, with `host_of_pool`, times the L3 pool), routed sticky."""
    system_prompts: int
    system_pages: tuple
    system_alpha: float
    conversations: int
    conversation_alpha: float
    user_pages: tuple
    answer_pages: tuple
    max_turns: int
    max_context: int
    requests: int
    instances: int
    sticky: float
    host_share: float
    host_of_pool: bool


# The family (`--prefixtree-shapes`). chat: the trace this scenario was built on. sglang: a second replay
# tried as a new user would: fewer prompts, many slots, short conversations, an L2 of pool/8.
# rag: long documents shared by many short question/answer suffixes.
SHAPES = {
    "chat": Shape(12, (8, 32), 1.0, 600, 1.0, (1, 4), (1, 6), 0, MAX_CONTEXT, 4000, 4, 0.9, 1 / 12, False),
    "sglang": Shape(8, (10, 40), 0.8, 2000, 1.0, (1, 5), (1, 5), 10, MAX_CONTEXT, 3000, 4, 0.8, 1 / 8, True),
    "rag": Shape(4, (60, 100), 1.0, 3000, 0.8, (1, 4), (1, 3), 2, MAX_CONTEXT, 3000, 4, 0.8, 1 / 8, True),
}
PLAIN = SHAPES["chat"]
SIZES = (1.5, 3.0, 6.0)  # working set / pool
SAMPLES = 6  # usable-payload samples over the second half
# One get in this many copies its pages; the others only mark them read (Store.touch raises the ref counts as
# a get does). What a get does to eviction is the same; the copies would cost most of a replay's time.
COPY_EVERY = 16


def leading_run(items, keys) -> int:
    """How many of `keys`, from the first, are in `items`."""
    n = 0
    for k in keys:
        if k not in items:
            break
        n += 1
    return n


def _zipf(rng: random.Random, n: int, alpha: float) -> list[float]:
    w = [1.0 / (k + 1) ** alpha for k in range(n)]
    rng.shuffle(w)
    return w


class Trace:
    """Requests as (conversation, prompt page ids, answer page ids); page p's parent is parent[p] (-1: root)."""

    def __init__(self, seed: int = 11, requests: int | None = None, conversations: int | None = None,
                 shape: Shape = PLAIN):
        rng = random.Random(seed)
        self.shape = shape
        requests = requests or shape.requests
        conversations = conversations or shape.conversations
        self.parent: list[int] = []
        n_sys = shape.system_prompts
        prompts = [self._chain(-1, rng.randint(*shape.system_pages)) for _ in range(n_sys)]
        system = rng.choices(range(n_sys), weights=_zipf(rng, n_sys, shape.system_alpha), k=conversations)
        history = [list(prompts[s]) for s in system]
        turns = [0] * conversations
        conv_w = _zipf(rng, conversations, shape.conversation_alpha)
        self.requests = []
        self.leaves: list[list[int]] = []  # the last chain of every session: every stored page lies on one
        for c in rng.choices(range(conversations), weights=conv_w, k=requests):
            user, answer = rng.randint(*shape.user_pages), rng.randint(*shape.answer_pages)
            if len(history[c]) + user + answer > shape.max_context or turns[c] == shape.max_turns > 0:
                self.leaves.append(history[c])  # a new conversation on the same system prompt
                history[c], turns[c] = list(prompts[system[c]]), 0
            prompt = history[c] + self._chain(history[c][-1], user)
            out = self._chain(prompt[-1], answer)
            self.requests.append((c, prompt, out))
            history[c] = prompt + out
            turns[c] += 1
        self.leaves += history
        self.keys = [hashlib.sha256(b"prefixtree:%d:%d" % (seed, p)).hexdigest() for p in range(len(self.parent))]

    def _chain(self, parent: int, n: int) -> list[int]:
        first = len(self.parent)
        for i in range(n):
            self.parent.append(parent if i == 0 else first + i - 1)
        return list(range(first, first + n))

    @property
    def pages(self) -> int:
        return len(self.parent)


class LRUTier:
    """Exact per-object LRU of 128 KiB pages over a byte capacity (None: unbounded). Lookups do not touch,
    gets do; a set inserts the absent pages."""

    page_bytes, trailing_bytes = PAGE_BYTES, 0

    def __init__(self, capacity_bytes: int | None):
        self.capacity = None if capacity_bytes is None else capacity_bytes // PAGE_BYTES
        self.items: OrderedDict = OrderedDict()

    def exists(self, keys, prefix) -> int:
        return leading_run(self.items, keys)

    def get(self, keys, prefix, copy: bool = True) -> None:
        for k in keys:
            self.items.move_to_end(k)

    def set(self, keys, prefix) -> None:
        items = self.items
        for k in keys:
            if k not in items:
                items[k] = None
        while self.capacity is not None and len(items) > self.capacity:
            items.popitem(last=False)

    def restorable(self, keys) -> tuple[int, list]:
        """(leading run, the prefix lengths whose trailing page is stored: none for a plain model)."""
        return self.exists(keys, None), []

    def live_bytes(self) -> int:
        return len(self.items) * PAGE_BYTES

    def close(self) -> None:
        pass


class MaruBackend:
    """MaruStorage made by SGLang's dynamic backend factory on a scratch pool file: what both models share."""

    def __init__(self, pool_size: int, prefix_eviction: bool, tag: str, host, config):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self._extra = HiCacheStorageExtraInfo
        self.path = pool_path(tag)
        extra = maru_extra(self.path, int(pool_size), maru_eager_map=False, maru_prefix_eviction=prefix_eviction)
        self.backend = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        self.backend.register_mem_pool_host(host)

    @property
    def file_bytes(self) -> int:
        """Read only after every host pool is registered: the first store access creates the pool, sized for
        the smallest page registered by then (a hybrid model's v2 pools come after the anchor)."""
        return self.backend.store.stats()["file_bytes"]

    @property
    def data_bytes(self) -> int:
        return self.backend.store.stats()["data_bytes"]

    def info(self, prefix):
        return self._extra(prefix_keys=list(prefix))

    def live_bytes(self) -> int:
        return self.backend.store.stats()["live_bytes"]

    def touch(self, digests) -> None:
        """What a get does to eviction (the ref counts of the values read), without the copy."""
        assert self.backend.store.touch(digests) == len(digests), "a page batch_exists reported is gone"

    def check(self) -> bool:
        return self.backend.store.check().ok

    def close(self) -> None:
        self.backend.close()
        remove_pool(self.path)


class MaruTier(MaruBackend):
    """A plain model's pages through MaruStorage's v1 calls, over a real Llama-3.1-8B host pool."""

    page_bytes, trailing_bytes = PAGE_BYTES, 0

    def __init__(self, pool_size: int, prefix_eviction: bool, tag: str):
        import torch
        super().__init__(pool_size, prefix_eviction, tag, _host_pool(1, MAX_CONTEXT), _storage_config)
        self.idx = torch.arange(MAX_CONTEXT, dtype=torch.int64)

    def exists(self, keys, prefix) -> int:
        return self.backend.batch_exists(keys, self.info(prefix))

    def get(self, keys, prefix, copy: bool = True) -> None:
        if copy:
            ok = self.backend.batch_get_v1(keys, self.idx[:len(keys)], self.info(prefix))
            assert all(ok), "a page batch_exists reported is gone (nothing else writes this pool)"
        else:
            self.touch(self.backend.keyspace.digests(keys))

    def set(self, keys, prefix) -> None:
        ok = self.backend.batch_set_v1(keys, self.idx[:len(keys)], self.info(prefix))
        assert all(ok), "a set failed"

    def restorable(self, keys) -> tuple[int, list]:
        return self.backend.local_exists(keys), []  # no touch: measuring must not change what is evicted


class Model(NamedTuple):
    """A model: its shape for each of the family's names, its contestants (maru(pool_size, prefix_eviction,
    tag), lru(capacity_bytes)), the tokens in one of its pages and the bytes of one page in every pool."""
    name: str
    shapes: dict
    maru: object
    lru: object
    page_tokens: int
    page_bytes: int


PLAIN_MODEL = Model("plain", SHAPES, MaruTier, LRUTier, 1, PAGE_BYTES)


def _usable(trace: Trace, tier) -> int:
    """Bytes of the pages some chain reaches as a restorable leading run, each page once; a trailing pool's
    page counts where a restorable prefix ends on it."""
    seen: set[int] = set()
    ends: set[int] = set()
    for chain in trace.leaves:
        m, at = tier.restorable([trace.keys[p] for p in chain])
        seen.update(chain[:m])
        ends.update(chain[p - 1] for p in at)
    return len(seen) * tier.page_bytes + len(ends) * tier.trailing_bytes


class HostCache:
    """One instance's host memory: a page LRU, touched tail to head so a chain leaves tail first."""

    def __init__(self, capacity_pages: int):
        self.capacity = capacity_pages
        self.items: OrderedDict = OrderedDict()

    def held(self, chain) -> int:
        return leading_run(self.items, chain)

    def insert(self, chain) -> None:
        items = self.items
        for p in reversed(chain):
            items[p] = None
            items.move_to_end(p)
        while len(items) > self.capacity:
            items.popitem(last=False)


def host_pages(trace: Trace, pool_bytes: int, page_bytes: int) -> int:
    """Pages of one instance's host L2 (at least one chain's)."""
    shape = trace.shape
    share = shape.host_share * (pool_bytes / page_bytes if shape.host_of_pool else trace.pages)
    return max(shape.max_context, int(share))


def visits(trace: Trace, sglang_like: bool, seed: int = 3, host: int | None = None):
    """The requests as a replay serves them: (index, prompt, answer, leading pages its instance holds in
    host memory). L3 is asked for the rest of the prompt; the instance takes in the whole chain after the
    caller has handled the request. The routing and the host caches (`host` pages each; default: the
    shape's share of the working set) do not depend on L3."""
    rng = random.Random(seed)
    shape = trace.shape
    cap = host or max(shape.max_context, int(trace.pages * shape.host_share))
    hosts = [HostCache(cap) for _ in range(shape.instances)]
    for i, (c, prompt, out) in enumerate(trace.requests):
        host = None
        if sglang_like:
            home = c % shape.instances if rng.random() < shape.sticky else rng.randrange(shape.instances)
            host = hosts[home]
        yield i, prompt, out, host.held(prompt) if host is not None else 0
        if host is not None:
            host.insert(prompt + out)


def replay(trace: Trace, tier, sglang_like: bool, progress=lambda f: None, seed: int = 3,
           host: int | None = None) -> dict:
    """Pages served from L3 over the second half (and asked of it), and usable / live payload samples."""
    keys, n = trace.keys, len(trace.requests)
    half = n // 2
    sample_at = {half + (n - half) * (i + 1) // SAMPLES - 1 for i in range(SAMPLES)}
    served = asked = 0
    usable, live = [], []
    for i, prompt, out, h in visits(trace, sglang_like, seed, host):
        chain = [keys[p] for p in prompt]
        m = 0
        if h < len(chain):
            m = tier.exists(chain[h:], chain[:h])
            if m:
                tier.get(chain[h:h + m], chain[:h], copy=i % COPY_EVERY == 0)
        full = chain + [keys[p] for p in out]
        if h + m < len(full):
            tier.set(full[h + m:], full[:h + m])
        if i >= half:
            served += m
            asked += len(chain) - h
        if i in sample_at:
            usable.append(_usable(trace, tier))
            live.append(tier.live_bytes())
        if i % 64 == 0:
            progress(i / n)
    return {"pages": served, "asked": asked, "usable": float(np.mean(usable)), "live": float(np.mean(live)),
            "live_max": int(max(live))}


def run_size(trace: Trace, pool_size: int, sglang_like: bool, progress=lambda f: None,
             model: Model = PLAIN_MODEL, variants: dict | None = None) -> dict:
    """Every contestant at one pool size and replay: tokens served, usable / file, usable / live.
    `variants`: name -> rules of the default switched off (prefixrules.py), each one more contestant.
    Contestants of one setting (the default's is the plain CLOCK's) share one replay: it is deterministic."""
    from maru_sglang.config import MaruConfig
    host = host_pages(trace, pool_size, model.page_bytes) if sglang_like else None
    out, ran = {}, {}
    default = MaruConfig.from_extra_config({}).prefix_eviction
    contestants = [("ours", default, ()), ("clock", False, ()), ("records", True, ())] + \
        [(k, True if record_rules(v) else default, v) for k, v in (variants or {}).items()]
    for name, prefix, off in contestants:
        if (prefix, off) in ran:
            out[name] = dict(ran[(prefix, off)])
            continue
        with rules_off(off):
            tier = model.maru(pool_size, prefix, f"prefixtree-{name}")
            try:
                r = replay(trace, tier, sglang_like, progress, host=host)
                r.update(file_bytes=tier.file_bytes, data_bytes=tier.data_bytes)
                assert tier.check()
            finally:
                tier.close()
        out[name] = ran[(prefix, off)] = r
    ours = out["ours"]
    held = ours["live_max"]  # what the pool itself held: LRU with the pool's own capacity
    for name, cap in (("lru", ours["data_bytes"]), ("lru_held", held), ("unbounded", None)):
        r = replay(trace, model.lru(cap), sglang_like, host=host)
        r.update(file_bytes=ours["file_bytes"], data_bytes=ours["data_bytes"], capacity_pages=cap)
        out[name] = r
    for r in out.values():
        r["tokens"] = r["pages"] * model.page_tokens
        r["usable_file"] = r["usable"] / r["file_bytes"]
        r["usable_live"] = r["usable"] / r["live"] if r["live"] else 1.0
    lru, top = out["lru"]["tokens"], out["unbounded"]["tokens"]
    for r in out.values():
        r["gap_share"] = (r["tokens"] - lru) / (top - lru) if top > lru else 0.0
    return out


def prefixtree(seed: int = 11, sizes=SIZES, progress=lambda f, note="": None, requests: int | None = None,
               conversations: int | None = None, model: Model = PLAIN_MODEL, shape: str = "chat",
               variants: dict | None = None, scale: float = 1.0) -> dict:
    """One shape's trace for one model, every replay and size. `scale`: the shape's requests times this."""
    sh = model.shapes[shape]
    trace = Trace(seed, requests or max(1, int(sh.requests * scale)), conversations, sh)
    working_set = replay(trace, model.lru(None), False)["live_max"]  # every page the trace writes, once
    runs = {}
    steps = [(r, s) for r in ("direct", "sglang") for s in sizes]
    for k, (rep, ratio) in enumerate(steps):
        pool = int(working_set / ratio)
        note = f"{shape} shape, {model.name} model, {rep} replay, working set {ratio:g}x the pool"
        res = run_size(trace, pool, rep == "sglang", lambda f: progress((k + f) / len(steps), note), model, variants)
        runs[f"{rep}@{ratio:g}"] = {"replay": rep, "ratio": ratio, "pool_bytes": pool, **res}
    return {"model": model.name, "shape": shape, "seed": seed, "working_set_bytes": working_set,
            "pages": trace.pages, "requests": len(trace.requests), "sessions": len(trace.leaves), "runs": runs}


NAME = "prefixtree"
# The goals, in every cell (shape, seed, replay, size) of both models: tokens from L3 at least these times the
# plain CLOCK's and exact LRU's (and LRU's on the mean over the cells); usable / live on the direct replay.
VS_CLOCK, VS_LRU, VS_LRU_MEAN, USABLE_LIVE = 0.995, 0.97, 1.0, 0.95


def cells(results: list) -> list:
    """Every (result, run) of a list of `prefixtree` results."""
    return [(r, run) for r in results for run in r["runs"].values()]


def summary(results: list, variants: dict | None = None) -> dict:
    """Over the cells of `results` (one shape and model, any seeds): ours and records / plain CLOCK and / LRU
    (mean, worst), the lowest usable / live of the direct replay, and per variant (`variants_of`) its base /
    variant (mean, worst): what the rules it switches off win."""
    rows = cells(results)

    def ratios(a, b):
        v = [run[a]["tokens"] / max(1, run[b]["tokens"]) for _, run in rows]
        return {"mean": float(np.mean(v)), "min": float(min(v)), "max": float(max(v))}
    def usable_live(name):
        direct = [run[name]["usable_live"] for _, run in rows if run["replay"] == "direct"]
        return float(min(direct)) if direct else None
    return {"cells": len(rows), "vs_clock": ratios("ours", "clock"), "vs_lru": ratios("ours", "lru"),
            "clock_vs_lru": ratios("clock", "lru"), "records_vs_clock": ratios("records", "clock"),
            "records_vs_lru": ratios("records", "lru"),
            "usable_live_min": usable_live("ours"), "records_usable_live_min": usable_live("records"),
            "usable_file_min": float(min(run["ours"]["usable_file"] for _, run in rows)),
            "ab": {v: ratios("records" if record_rules(off) else "ours", v) for v, off in (variants or {}).items()}}


def _figures(r: dict) -> list:
    """One shape's figures: per model, its goals over the cells, and the A/B of each variant."""
    figs = []
    for model, s in r["summary"].items():
        where = f"{r['shape']} shape, {model} model, {s['cells']} cells"
        figs.append(figure(f"tokens from L3 / plain CLOCK, worst cell, {where}", s["vs_clock"]["min"], None, None,
                           goal=f">= {VS_CLOCK}", met=s["vs_clock"]["min"] >= VS_CLOCK, mean=s["vs_clock"]["mean"]))
        figs.append(figure(f"tokens from L3 / exact LRU, worst cell, {where}", s["vs_lru"]["min"], None, None,
                           goal=f">= {VS_LRU}", met=s["vs_lru"]["min"] >= VS_LRU))
        figs.append(figure(f"tokens from L3 / exact LRU, mean, {where}", s["vs_lru"]["mean"], None, None,
                           goal=f">= {VS_LRU_MEAN}", met=s["vs_lru"]["mean"] >= VS_LRU_MEAN))
        if s["usable_live_min"] is not None:
            figs.append(figure(f"usable / live payload, lowest direct cell, {where}", s["usable_live_min"], None, None,
                               goal=f">= {USABLE_LIVE}", met=s["usable_live_min"] >= USABLE_LIVE))
        figs.append(figure(f"maru_prefix_eviction true: tokens from L3 / plain CLOCK, mean, {where}",
                           s["records_vs_clock"]["mean"], None, None, worst=s["records_vs_clock"]["min"]))
        for v, ab in s["ab"].items():
            figs.append(figure(f"A/B: tokens with / without {v}, mean, {where}", ab["mean"], None, None,
                               worst=ab["min"]))
    return figs


@scenario(NAME)
def bench_prefixtree(args) -> dict:
    from .prefixtree_hybrid import hybrid_model
    progress = progress_of(args)
    seeds = list(getattr(args, "prefixtree_seeds", None) or [11, 12, 13])
    shapes = list(getattr(args, "prefixtree_shapes", None) or SHAPES)
    variants = variants_of(getattr(args, "prefixtree_ab", None) or [])
    wanted = getattr(args, "prefixtree_models", None) or ["plain", "hybrid"]
    models = [m for name, m in (("plain", lambda: PLAIN_MODEL), ("hybrid", hybrid_model)) if name in wanted]
    models = [m() for m in models]
    steps = [(sh, seed, m) for sh in shapes for seed in seeds for m in models]
    by_shape: dict = {}
    for k, (sh, seed, m) in enumerate(steps):
        def part(f, note="", k=k, seed=seed):
            progress((k + f) / len(steps), f"seed {seed}, {note}")
        res = prefixtree(seed, progress=part, model=m, shape=sh, variants=variants,
                         scale=getattr(args, "prefixtree_scale", None) or 1.0)
        by_shape.setdefault(sh, {}).setdefault(seed, {})[m.name] = res
    out, figs = {}, []
    for sh, by_seed in by_shape.items():
        summ = {m.name: summary([by_seed[seed][m.name] for seed in seeds], variants) for m in models}
        out[sh] = {"shape": sh, "by_seed": by_seed, "summary": summ}
        figs += _figures(out[sh])
    return {"scenario": NAME, "seeds": seeds, "shapes": out, "variants": {k: list(v) for k, v in variants.items()},
            "figures": figs}
