"""The prefix-tree trace for a DeepSeek-V4-like hybrid model: every page in six pools, through MaruStorage v2.

The `hybrid` scenario's pools (compressed KV at ratios 1/2/4/128, the c4 indexer, a sliding window) and its
calls, as SGLang's HybridCacheController makes them: a set is `batch_set_v1` of the KV markers (the logical
anchor) and `batch_set_v2` of one PoolTransfer per pool, the SWA pool naming only the call's last key
(`TRAILING_PAGES`); a lookup is `batch_exists_v2` (its `kv_hit_pages`: a prefix is restorable only where every
pool has its pages and the window its trailing page); a read is `batch_get_v1` + `batch_get_v2` of the hit run.
Pages are 256 tokens, so the trace's chains are shorter than the plain model's (`SHAPES`), and each pool has
fewer layers than the `hybrid` scenario's (`LAYERS`) to keep the working set near the plain trace's.

Its per-object LRU charges each pool's page separately (the 0-byte KV markers are left out), and a prefix is
a hit under the same rule as batch_exists_v2's.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

from .hybrid import PAGE, RATIOS, SWA_PAGE, _indexer_pool, _v4_pool
from .prefixtrace import MaruBackend, Model, Shape

# The family's shapes in 256-token pages (prefixtree.SHAPES), every chain within HYBRID_CONTEXT pages.
HYBRID_CONTEXT = 40
SHAPES = {
    "chat": Shape(1500, HYBRID_CONTEXT, sticky=0.9, host_share=1 / 12, host_of_pool=False, system_prompts=12,
                  system_pages=(2, 8), conversations=200, user_pages=(1, 2), answer_pages=(1, 2), page_tokens=PAGE),
    "sglang": Shape(1500, HYBRID_CONTEXT, system_prompts=8, system_pages=(3, 10), system_alpha=0.8,
                    conversations=600, user_pages=(1, 2), answer_pages=(1, 2), max_turns=10, page_tokens=PAGE),
    "rag": Shape(1500, HYBRID_CONTEXT, system_prompts=4, system_pages=(15, 25), conversations=900,
                 conversation_alpha=0.8, user_pages=(1, 1), answer_pages=(1, 1), max_turns=2, page_tokens=PAGE),
}
LAYERS = 3  # per compressed pool


def _config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="deepseek-ai/DeepSeek-V4-like", extra_config=extra)


@functools.lru_cache(maxsize=1)
def _pools(pages: int) -> dict:
    """The host pools, made once and registered by every tier in turn (SGLang checks the machine's free memory
    at each one it makes, which a busy machine may fail mid-run)."""
    pools = {name: _v4_pool(name, PAGE // r, PAGE, pages, LAYERS) for name, r in RATIOS.items()}
    pools["deepseek_v4_c4_indexer"] = _indexer_pool(pages, LAYERS)
    pools["swa"] = _v4_pool("swa", SWA_PAGE, SWA_PAGE, 2, LAYERS)
    return pools


class HybridMaruTier(MaruBackend):
    """The hybrid model's pages through MaruStorage, registered as HybridCacheController registers them."""

    def __init__(self, pool_size: int, tag: str, shape: Shape | None = None):
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

        n = HYBRID_CONTEXT
        anchor = LogicalHostPool(n * PAGE, PAGE, layout="page_first_direct")
        super().__init__(pool_size, tag, anchor, _config)
        b = self.backend
        b.register_mem_host_pool_v2(anchor, PoolName.KV)
        pools = _pools(n)
        for name, host in pools.items():
            b.register_mem_host_pool_v2(host, PoolName(name))
        b.on_host_pools_registered()
        self.sizes = sizes = {name: b.hybrid.pools[name].page_bytes for name in pools}
        self.full = [name for name in pools if name != "swa"]
        self.page_bytes, self.trailing_bytes = sum(sizes[x] for x in self.full), sizes["swa"]
        self._t, self._name, self._trailing = PoolTransfer, PoolName, PoolHitPolicy.TRAILING_PAGES
        self.kv_idx = torch.arange(n * PAGE, dtype=torch.int64)
        self.swa_idx = torch.arange(SWA_PAGE, dtype=torch.int64)
        self.query = [PoolTransfer(name=PoolName(x)) for x in self.full]
        self.query.append(PoolTransfer(name=PoolName.SWA, keys=["w"], hit_policy=self._trailing))

    def _transfers(self, keys) -> list:
        idx = self.kv_idx[:len(keys) * PAGE]
        out = [self._t(name=self._name(x), keys=keys, host_indices=idx, indices_from_pool=self._name.KV)
               for x in self.full]
        out.append(self._t(name=self._name.SWA, keys=keys[-1:], hit_policy=self._trailing,
                           host_indices=self.swa_idx))
        return out

    def exists(self, keys, prefix) -> int:
        return self.backend.batch_exists_v2(keys, self.query, self.info(prefix)).kv_hit_pages

    def get(self, keys, prefix, copy: bool = True) -> None:
        if not copy:
            h = self.backend.hybrid
            self.touch(self.backend.keyspace.digests(keys))
            for x in self.full:
                self.touch(h.digests(h.spec(x), keys))
            self.touch(h.digests(h.spec("swa"), keys[-1:]))
            return
        info = self.info(prefix)
        ok = self.backend.batch_get_v1(keys, self.kv_idx[:len(keys) * PAGE], info)
        res = self.backend.batch_get_v2(self._transfers(keys), info)
        assert all(ok) and all(all(v) for v in res.values()), "a restorable page batch_exists_v2 reported is gone"

    def set(self, keys, prefix) -> None:
        info = self.info(prefix)
        ok = self.backend.batch_set_v1(keys, self.kv_idx[:len(keys) * PAGE], info)
        res = self.backend.batch_set_v2(self._transfers(keys), info)
        assert all(ok) and all(all(v) for v in res.values()), "a set failed"

    def restorable(self, keys) -> tuple[int, list]:
        r = self.backend.batch_exists_v2(keys, self.query)  # no prefix keys: no touch
        return r.kv_hit_pages, list(r.restorable_prefix_pages or [])


class HybridLRUTier:
    """Exact per-object LRU over a byte capacity (None: unbounded): every pool's page is its own object."""

    def __init__(self, capacity_bytes: int | None, sizes: dict):
        """sizes: the page bytes of each pool (a HybridMaruTier's: the pools' own arithmetic)."""
        self.capacity = capacity_bytes
        self.used = 0
        self.items: OrderedDict = OrderedDict()
        self.sizes = dict(sizes)
        self.full = [x for x in sizes if x != "swa"]
        self.page_bytes, self.trailing_bytes = sum(sizes[x] for x in self.full), sizes["swa"]

    def exists(self, keys, prefix) -> int:
        at = self.restorable(keys)[1]
        return at[-1] if at else 0

    def restorable(self, keys) -> tuple[int, list]:
        """batch_exists_v2's rule: a prefix whose pages every full pool holds, ending on a stored window page."""
        items, at = self.items, []
        for lead, k in enumerate(keys, 1):
            if not all((x, k) in items for x in self.full):
                break
            if ("swa", k) in items:
                at.append(lead)
        return (at[-1] if at else 0), at

    def _objects(self, keys):
        return [(x, k) for k in keys for x in self.full] + ([("swa", keys[-1])] if keys else [])

    def get(self, keys, prefix, copy: bool = True) -> None:
        for o in self._objects(keys):
            self.items.move_to_end(o)

    def set(self, keys, prefix) -> None:
        items = self.items
        for o in self._objects(keys):
            if o not in items:
                items[o] = self.sizes[o[0]]
                self.used += items[o]
        while self.capacity is not None and self.used > self.capacity:
            self.used -= items.popitem(last=False)[1]

    def live_bytes(self) -> int:
        return self.used

    def close(self) -> None:
        pass


def hybrid_model() -> Model:
    """The model, its LRU sized from a scratch HybridMaruTier's pools."""
    probe = HybridMaruTier(256 << 20, "prefixtree-probe")
    try:
        sizes = probe.sizes
    finally:
        probe.close()
    total = sum(sizes.values())
    return Model("hybrid", SHAPES, HybridMaruTier, lambda cap, shape: HybridLRUTier(cap, sizes),
                 lambda shape: total, False, {"age": False})  # MaruStorage: the count CLOCK for a hybrid model
