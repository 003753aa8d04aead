"""Prefix-tree scenario of `maru-shm bench`: an SGLang-like conversation trace through MaruStorage.

The trace (seeded, `Trace`): conversations open with one of a few shared system prompts (Zipf-popular),
then grow turn by turn: each request is the conversation so far plus a new user message, and its answer is
appended after it. Conversations come back with Zipf popularity; one that outgrows the context starts a new
session on its system prompt. Every page is a 128 KiB KV page of Llama-3.1-8B at page_size 1 (one token
per page), keyed like SGLang's page-hash chain: a page's key names its whole prefix.

Two replays of the same trace:

  direct     every request asks L3 for its whole prompt (batch_exists, then batch_get_v1 of the hit run)
             and writes what L3 did not have (batch_set_v1 with prefix_keys, as SGLang's backup does);
  SGLang-like  INSTANCES servers, each with its own host-memory cache (a page LRU touched tail to head,
             so it evicts leaves first as SGLang's radix tree does) and mostly sticky routing. A request
             first takes the leading run its instance holds in host memory, asks L3 only for the rest with
             the held keys as `prefix_keys` (SGLang's `hicache_storage_pass_prefix_keys: true`), and
             backs up what it computed. The hot heads of chains stay in host memory and look cold to L3.

Contestants, each on the same replay:
  ours        MaruStorage made by SGLang's backend factory (prefix-aware eviction, the default);
  today       the same with `maru_prefix_eviction: false` (the plain per-class CLOCK);
  LRU         exact per-object LRU over the pool's data bytes (gets touch, sets insert absent pages): the
              goal's peer;
  LRU held    the same over the most pages the pool held (its data area less the space no slab of 16 MiB
              fits in): the policy alone, without the capacity the slabs cost;
  unbounded   a pool that never evicts: the most any policy can serve.

Pool sizes are the trace's working set (every page it writes, once: what an unbounded pool ends up
holding in the direct replay) over 1.5, 3 and 6. Tokens served
from L3 count over the second half of the trace; usable payload (pages whose whole prefix is stored: a
leading run of some chain) is the mean of samples over the second half, over the file and over the live
payload.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from maru_shm import remove_pool

from .hostpool import _host_pool, _storage_config, maru_extra
from .registry import figure, pool_path, progress_of, scenario

PAGE_BYTES = 128 << 10  # Llama-3.1-8B, bf16, page_size 1: one token per page
SYSTEM_PROMPTS = 12
CONVERSATIONS, REQUESTS = 600, 4000
ALPHA = 1.0  # Zipf popularity of conversations and of system prompts


class Shape(NamedTuple):
    """Page counts of a trace: (lo, hi) per system prompt, user message and answer; the longest chain."""
    system_pages: tuple
    user_pages: tuple
    answer_pages: tuple
    max_context: int  # at most one batch of SGLang's STORAGE_BATCH_SIZE (128): a chain is one call


PLAIN = Shape((8, 32), (1, 4), (1, 6), 120)
MAX_CONTEXT = PLAIN.max_context
INSTANCES, STICKY, HOST_SHARE = 4, 0.9, 1 / 12  # host pages per instance: HOST_SHARE x the working set
SIZES = (1.5, 3.0, 6.0)  # working set / pool
SAMPLES = 6  # usable-payload samples over the second half


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

    def __init__(self, seed: int = 11, requests: int = REQUESTS, conversations: int = CONVERSATIONS,
                 shape: Shape = PLAIN):
        rng = random.Random(seed)
        self.shape = shape
        self.parent: list[int] = []
        prompts = [self._chain(-1, rng.randint(*shape.system_pages)) for _ in range(SYSTEM_PROMPTS)]
        sys_w = _zipf(rng, SYSTEM_PROMPTS, ALPHA)
        system = rng.choices(range(SYSTEM_PROMPTS), weights=sys_w, k=conversations)
        history = [list(prompts[s]) for s in system]
        conv_w = _zipf(rng, conversations, ALPHA)
        self.requests = []
        self.leaves: list[list[int]] = []  # the last chain of every session: every stored page lies on one
        for c in rng.choices(range(conversations), weights=conv_w, k=requests):
            user, answer = rng.randint(*shape.user_pages), rng.randint(*shape.answer_pages)
            if len(history[c]) + user + answer > shape.max_context:  # a new session on the same system prompt
                self.leaves.append(history[c])
                history[c] = list(prompts[system[c]])
            prompt = history[c] + self._chain(history[c][-1], user)
            out = self._chain(prompt[-1], answer)
            self.requests.append((c, prompt, out))
            history[c] = prompt + out
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

    def get(self, keys, prefix) -> None:
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
        st = self.backend.store.stats()
        self.file_bytes, self.data_bytes = st["file_bytes"], st["data_bytes"]

    def info(self, prefix):
        return self._extra(prefix_keys=list(prefix))

    def live_bytes(self) -> int:
        return self.backend.store.stats()["live_bytes"]

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

    def get(self, keys, prefix) -> None:
        ok = self.backend.batch_get_v1(keys, self.idx[:len(keys)], self.info(prefix))
        assert all(ok), "a page batch_exists reported is gone (nothing else writes this pool)"

    def set(self, keys, prefix) -> None:
        ok = self.backend.batch_set_v1(keys, self.idx[:len(keys)], self.info(prefix))
        assert all(ok), "a set failed"

    def restorable(self, keys) -> tuple[int, list]:
        return self.backend.local_exists(keys), []  # no touch: measuring must not change what is evicted


class Model(NamedTuple):
    """A model's trace shape, its contestants (maru(pool_size, prefix_eviction, tag), lru(capacity_bytes)) and
    the tokens in one of its pages."""
    name: str
    shape: Shape
    requests: int
    conversations: int
    maru: object
    lru: object
    page_tokens: int


PLAIN_MODEL = Model("plain", PLAIN, REQUESTS, CONVERSATIONS, MaruTier, LRUTier, 1)


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


def visits(trace: Trace, sglang_like: bool, seed: int = 3):
    """The requests as a replay serves them: (index, prompt, answer, leading pages its instance holds in
    host memory). L3 is asked for the rest of the prompt; the instance takes in the whole chain after the
    caller has handled the request. The routing and the host caches do not depend on L3."""
    rng = random.Random(seed)
    hosts = [HostCache(max(trace.shape.max_context, int(trace.pages * HOST_SHARE))) for _ in range(INSTANCES)]
    for i, (c, prompt, out) in enumerate(trace.requests):
        host = None
        if sglang_like:
            home = c % INSTANCES if rng.random() < STICKY else rng.randrange(INSTANCES)
            host = hosts[home]
        yield i, prompt, out, host.held(prompt) if host is not None else 0
        if host is not None:
            host.insert(prompt + out)


def replay(trace: Trace, tier, sglang_like: bool, progress=lambda f: None, seed: int = 3) -> dict:
    """Pages served from L3 over the second half (and asked of it), and usable / live payload samples."""
    keys, n = trace.keys, len(trace.requests)
    half = n // 2
    sample_at = {half + (n - half) * (i + 1) // SAMPLES - 1 for i in range(SAMPLES)}
    served = asked = 0
    usable, live = [], []
    for i, prompt, out, h in visits(trace, sglang_like, seed):
        chain = [keys[p] for p in prompt]
        m = 0
        if h < len(chain):
            m = tier.exists(chain[h:], chain[:h])
            if m:
                tier.get(chain[h:h + m], chain[:h])
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
             model: Model = PLAIN_MODEL) -> dict:
    """Every contestant at one pool size and replay: tokens served, usable / file, usable / live."""
    out = {}
    for name, prefix in (("ours", True), ("today", False)):
        tier = model.maru(pool_size, prefix, f"prefixtree-{name}")
        try:
            r = replay(trace, tier, sglang_like, progress)
            r.update(file_bytes=tier.file_bytes, data_bytes=tier.data_bytes)
            assert tier.check()
        finally:
            tier.close()
        out[name] = r
    ours = out["ours"]
    held = ours["live_max"]  # what the pool itself held: LRU with the pool's own capacity
    for name, cap in (("lru", ours["data_bytes"]), ("lru_held", held), ("unbounded", None)):
        r = replay(trace, model.lru(cap), sglang_like)
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
               conversations: int | None = None, model: Model = PLAIN_MODEL) -> dict:
    trace = Trace(seed, requests or model.requests, conversations or model.conversations, model.shape)
    working_set = replay(trace, model.lru(None), False)["live_max"]  # every page the trace writes, once
    runs = {}
    steps = [(r, s) for r in ("direct", "sglang") for s in sizes]
    for k, (rep, ratio) in enumerate(steps):
        pool = int(working_set / ratio)
        note = f"{model.name} model, {rep} replay, working set {ratio:g}x the pool"
        res = run_size(trace, pool, rep == "sglang", lambda f: progress((k + f) / len(steps), note), model)
        runs[f"{rep}@{ratio:g}"] = {"replay": rep, "ratio": ratio, "pool_bytes": pool, **res}
    return {"model": model.name, "working_set_bytes": working_set, "pages": trace.pages,
            "requests": len(trace.requests), "sessions": len(trace.leaves), "runs": runs}


NAME = "prefixtree"


def gap_is_a_goal(run: dict) -> bool:
    """The share of the gap won is a goal only in the SGLang-like replay at 3x and 6x."""
    return run["replay"] == "sglang" and run["ratio"] >= 3


def _figures(r: dict) -> list:
    figs = []
    for run in r["runs"].values():
        ours, lru, today, top = run["ours"], run["lru"], run["today"], run["unbounded"]
        where = f"{r['model']} model, {run['replay']} replay, working set {run['ratio']:g}x pool"
        figs.append(figure(f"tokens from L3, {where}", ours["tokens"], lru["tokens"], "exact per-object LRU",
                           goal=">= LRU", met=ours["tokens"] >= lru["tokens"], today=today["tokens"],
                           unbounded=top["tokens"]))
        figs.append(figure(f"usable / live payload, {where}", ours["usable_live"], today["usable_live"],
                           "maru_prefix_eviction false", goal=">= 0.95", met=ours["usable_live"] >= 0.95,
                           lru=lru["usable_live"]))
        figs.append(figure(f"usable payload / file, {where}", ours["usable_file"], today["usable_file"],
                           "maru_prefix_eviction false", lru=lru["usable_file"]))
        if gap_is_a_goal(run):
            figs.append(figure(f"share of the gap LRU -> unbounded won, {where}", ours["gap_share"],
                               today["gap_share"], "maru_prefix_eviction false", goal=">= 0.25",
                               met=ours["gap_share"] >= 0.25))
    return figs


@scenario(NAME)
def bench_prefixtree(args) -> dict:
    from .prefixtree_hybrid import hybrid_model
    progress = progress_of(args)
    seeds = list(getattr(args, "prefixtree_seeds", None) or [11])
    runs, figs = {}, []
    for i, seed in enumerate(seeds):
        def part(k, i=i, seed=seed):
            return lambda f, note="": progress((2 * i + k + f) / (2 * len(seeds)), f"seed {seed}, {note}")
        models = {"plain": prefixtree(seed, progress=part(0)),
                  "hybrid": prefixtree(seed, model=hybrid_model(), progress=part(1))}
        runs[seed] = models
        where = f"seed {seed}, " if len(seeds) > 1 else ""
        figs += [{**f, "name": where + f["name"]} for m in models.values() for f in _figures(m)]
    return {"scenario": NAME, "seeds": seeds, "models": runs[seeds[0]], "by_seed": runs,
            "means": seed_means(runs) if len(seeds) > 1 else None, "figures": figs}


def seed_means(runs: dict) -> dict:
    """Per model and run ('plain' -> 'sglang@3' -> ...): the means over the seeds of ours / LRU, of the gap
    won and of usable / live, and the lowest usable / live. One trace's figures move with its seed."""
    rows: dict = {}
    for models in runs.values():
        for name, m in models.items():
            for key, run in m["runs"].items():
                o = run["ours"]
                rows.setdefault(name, {}).setdefault(key, []).append(
                    (o["tokens"] / max(1, run["lru"]["tokens"]), o["gap_share"], o["usable_live"], gap_is_a_goal(run)))
    return {name: {key: {"vs_lru": float(np.mean([v[0] for v in vals])), "gap_goal": vals[0][3],
                         "gap_share": float(np.mean([v[1] for v in vals])),
                         "usable_live": float(np.mean([v[2] for v in vals])),
                         "usable_live_min": float(min(v[2] for v in vals))}
                   for key, vals in keyed.items()} for name, keyed in rows.items()}
