"""The prefix-tree family's traces, their two replays, and the references the store is measured against.

A trace is requests of (conversation, prompt page ids, answer page ids) over a tree of pages: page p's
parent is parent[p] (-1: a root), and a page's key names its whole prefix, as SGLang's page-hash chain
does. A *generated* trace (`Trace`, its parameters a `Shape`): conversations open with one of a few shared
system prompts (Zipf-popular), then grow turn by turn, each request the conversation so far plus a new user
message, its answer appended after it; conversation slots come back with Zipf popularity, and one that
reaches its last turn or outgrows the context starts again on its system prompt. A *recorded* trace
(`RecordedTrace`, Mooncake's): each request's `hash_ids` are a chain of 512-token blocks, each block as
many pages as the shape's page size gives; it has no answers, and its conversation (for routing) is its
first block.

Two replays of one trace (`replay`):
  direct       every request asks L3 for its whole prompt (exists, then get of the hit run) and writes what
               L3 did not have, with the pages before it as prefix keys;
  SGLang-like  the shape's instances, each with its own host L2 (a page LRU touched tail to head, so it
               evicts leaves first as SGLang's radix tree does) and sticky routing. A request first takes the
               leading run its instance holds, asks L3 only for the rest with the held keys as prefix keys
               (SGLang's `hicache_storage_pass_prefix_keys: true`), and backs up what it computed.

References: exact per-object LRU over the pool's bytes, an unbounded pool, and Belady's offline bound.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import lzma
import os
import random
from collections import OrderedDict, defaultdict
from typing import NamedTuple

import numpy as np

from maru_shm import remove_pool

from .hostpool import maru_extra
from .registry import pool_path

SIZES = (1.5, 3.0, 6.0)  # working set / pool
SAMPLES = 6  # usable-payload samples over the second half
# One get in this many copies its pages; the others only mark them read (Store.touch does to eviction what a
# get does). The copies would cost most of a replay's time.
COPY_EVERY = 16
TRACES = os.path.join(os.path.dirname(__file__), "traces")
BLOCK_TOKENS = 512  # a recorded trace's hash_ids block
NEVER = 1 << 40  # Belady: the next ask of a page asked no more


class Shape(NamedTuple):
    """A trace shape. Page counts are (lo, hi), drawn uniformly; popularity is Zipf(alpha) over a shuffled rank.

    After `max_turns` turns (0: no limit), or when the next turn would pass `max_context` pages, a slot starts a
    new conversation on its system prompt. The SGLang-like replay gives each of `instances` servers a host L2 of
    `host_share` times the working set (with `host_of_pool`: times the L3 pool), routed sticky with probability
    `sticky`. A page holds `page_tokens` tokens. `sizes`: the pools, as working set / pool. `source`: a recorded
    trace in traces/ instead of a generated one (its requests are the file's)."""
    requests: int
    max_context: int
    instances: int = 4
    sticky: float = 0.8
    host_share: float = 1 / 8
    host_of_pool: bool = True
    system_prompts: int = 0
    system_pages: tuple = (0, 0)
    system_alpha: float = 1.0
    conversations: int = 0
    conversation_alpha: float = 1.0
    user_pages: tuple = (1, 1)
    answer_pages: tuple = (1, 1)
    max_turns: int = 0
    page_tokens: int = 1
    sizes: tuple = SIZES
    source: str = ""


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
    """A generated trace (see the module's docstring); `leaves`: the last chain of every session."""

    def __init__(self, shape: Shape, seed: int = 11, requests: int | None = None, conversations: int | None = None):
        rng = random.Random(seed)
        self.shape, self.parent = shape, []
        requests = requests or shape.requests
        conversations = conversations or shape.conversations
        n_sys = shape.system_prompts
        prompts = [self._chain(-1, rng.randint(*shape.system_pages)) for _ in range(n_sys)]
        system = rng.choices(range(n_sys), weights=_zipf(rng, n_sys, shape.system_alpha), k=conversations)
        history = [list(prompts[s]) for s in system]
        turns = [0] * conversations
        conv_w = _zipf(rng, conversations, shape.conversation_alpha)
        self.requests, self.leaves = [], []
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


class RecordedTrace(Trace):
    """A recorded trace of `hash_ids` chains (traces/<shape.source>): each block is BLOCK_TOKENS /
    page_tokens pages, a request's prompt is its blocks' pages, its conversation its first block. `leaves`:
    the chains no other request continues (every stored page lies on one)."""

    def __init__(self, shape: Shape):
        self.shape, self.parent, self.requests = shape, [], []
        per = BLOCK_TOKENS // shape.page_tokens
        pages: dict[int, list[int]] = {}  # hash id -> its pages
        with lzma.open(os.path.join(TRACES, shape.source), "rt") as f:
            for line in f:
                ids, prompt = json.loads(line)["hash_ids"], []
                for h in ids:
                    if h not in pages:
                        pages[h] = self._chain(prompt[-1] if prompt else -1, per)
                    prompt += pages[h]
                self.requests.append((ids[0], prompt, []))
        continued = set(self.parent)
        ends = {prompt[-1]: prompt for _, prompt, _ in self.requests if prompt[-1] not in continued}
        self.leaves = list(ends.values())
        self.keys = [hashlib.sha256(b"recorded:%s:%d" % (shape.source.encode(), p)).hexdigest()
                     for p in range(len(self.parent))]


def make_trace(shape: Shape, seed: int, scale: float = 1.0, requests: int | None = None,
               conversations: int | None = None) -> Trace:
    """The shape's trace: generated with `seed` and `scale` times its requests, or recorded (whole)."""
    if shape.source:
        return RecordedTrace(shape)
    return Trace(shape, seed, requests or max(1, int(shape.requests * scale)), conversations)


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
    host memory). The instance takes in the whole chain after the caller has handled the request. The
    routing and the host caches (`host` pages each; default: the shape's share of the working set) do not
    depend on L3."""
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


def usable_bytes(trace: Trace, tier) -> int:
    """Bytes of the pages some chain reaches as a restorable leading run, each page once; a trailing pool's
    page counts where a restorable prefix ends on it."""
    seen: set[int] = set()
    ends: set[int] = set()
    for chain in trace.leaves:
        m, at = tier.restorable([trace.keys[p] for p in chain])
        seen.update(chain[:m])
        ends.update(chain[p - 1] for p in at)
    return len(seen) * tier.page_bytes + len(ends) * tier.trailing_bytes


def replay(trace: Trace, tier, sglang_like: bool, progress=lambda f: None, seed: int = 3,
           host: int | None = None) -> dict:
    """Pages served from L3 over the second half (and asked of it), and usable / live payload samples."""
    keys, n = trace.keys, len(trace.requests)
    half = n // 2
    sample_at = {half + (n - half) * (i + 1) // SAMPLES - 1 for i in range(SAMPLES)}  # the last request too
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
            usable.append(usable_bytes(trace, tier))
            live.append(tier.live_bytes())
        if i % 64 == 0:
            progress(i / n)
    return {"pages": served, "asked": asked, "usable": float(np.mean(usable)), "live": float(np.mean(live)),
            "live_max": int(max(live))}


def working_set(trace: Trace, page_bytes: int) -> int:
    """Bytes of every page the trace writes, once."""
    return replay(trace, LRUTier(None, page_bytes), False)["live_max"]


class LRUTier:
    """Exact per-object LRU of pages over a byte capacity (None: unbounded). Lookups do not touch, gets do;
    a set inserts the absent pages."""

    trailing_bytes = 0

    def __init__(self, capacity_bytes: int | None, page_bytes: int):
        self.page_bytes = page_bytes
        self.capacity = None if capacity_bytes is None else capacity_bytes // page_bytes
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
        return len(self.items) * self.page_bytes

    def close(self) -> None:
        pass


def asks(trace: Trace, sglang_like: bool, host: int | None = None) -> list[list[int]]:
    """The pages each request that asks L3 asks for, in request order (a request whose whole prompt its
    instance holds asks nothing)."""
    return [prompt[h:] for _, prompt, _, h in visits(trace, sglang_like, host=host) if h < len(prompt)]


class Belady(LRUTier):
    """Belady's offline bound over the replay's L3 asks (`asks`): a page whose next ask is furthest ahead goes
    first, tail first on ties. A set inserts its pages, then evicts: a page written now may be the victim.
    Routing and host caches do not depend on L3, so the asks are known before the replay."""

    def __init__(self, capacity_bytes: int, page_bytes: int, trace: Trace, asked: list[list[int]]):
        super().__init__(capacity_bytes, page_bytes)
        self.times: dict[str, list[int]] = defaultdict(list)
        for i, pages in enumerate(asked):
            for p in pages:
                self.times[trace.keys[p]].append(i)
        self.pid = {k: p for p, k in enumerate(trace.keys)}
        self.prio: dict[str, tuple] = {}
        self.items = self.prio
        self.heap: list = []
        self.now = -1

    def _push(self, k: str) -> None:
        t = self.times.get(k, ())
        j = bisect.bisect_right(t, self.now)
        pr = (-(t[j] if j < len(t) else NEVER), -self.pid[k])
        self.prio[k] = pr
        heapq.heappush(self.heap, (pr, k))

    def exists(self, keys, prefix) -> int:
        self.now += 1  # one lookup per asking request
        for k in keys:  # asked now: their next ask moves on
            if k in self.prio:
                self._push(k)
        return leading_run(self.prio, keys)

    def get(self, keys, prefix, copy: bool = True) -> None:
        pass

    def restorable(self, keys) -> tuple[int, list]:
        return leading_run(self.prio, keys), []  # not a lookup: the clock of asks stays

    def set(self, keys, prefix) -> None:
        for k in keys:
            if k not in self.prio:
                self._push(k)
        while len(self.prio) > self.capacity:
            pr, k = heapq.heappop(self.heap)
            if self.prio.get(k) == pr:
                del self.prio[k]


class Model(NamedTuple):
    """A model: its shapes, its tiers (maru(pool_size, tag, shape), lru(capacity, shape)), the
    bytes of one page in every pool (page_bytes(shape)), whether Belady's bound runs beside it, and the eviction
    settings its default amounts to (contestants of equal settings share one replay)."""
    name: str
    shapes: dict
    maru: object
    lru: object
    page_bytes: object
    belady: bool
    default: dict


class MaruBackend:
    """MaruStorage made by SGLang's dynamic backend factory on a scratch pool file: what every model shares.
    `maru`: more maru_* keys of its extra config."""

    def __init__(self, pool_size: int, tag: str, host, config, **maru):
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self._extra = HiCacheStorageExtraInfo
        self.path = pool_path(tag)
        extra = maru_extra(self.path, int(pool_size), maru_eager_map=False, **maru)
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
        """What a get does to eviction (the values read are marked used), without the copy."""
        assert self.backend.store.touch(digests) == len(digests), "a page batch_exists reported is gone"

    def check(self) -> bool:
        return self.backend.store.check().ok

    def close(self) -> None:
        self.backend.close()
        remove_pool(self.path)
