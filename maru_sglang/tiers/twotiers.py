"""Which pages go where when a second tier stands behind the pool: read-through, promotion, write-through.

Rules:
- Reads: the local pool first. Only its misses are asked of the second tier, which loads them straight
  into the host pool. On a storage writer rank, the pages that arrived are then stored into the pool
  (promotion), so the node's other processes hit locally.
- batch_exists: the leading run across both tiers, that is the pool's leading run, then the tier's
  leading run from there on. A get fetches exactly that split.
- Writes: to the pool, then through to the tier, which skips the keys it holds. A page counts as stored
  if either tier holds it. While the tier is detached, writes reach the pool only (counted as
  `offline_writes`); nothing is queued for later.
- Hybrid models: KV pages always move through the v1 calls (SGLang's hybrid controller does the same),
  other pools through the tier's v2 calls, transfer by transfer. A prefix length counts as restorable if
  one tier alone can restore it: the larger of the two answers wins.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Protocol

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

from ..hybrid import HybridPools
from .local import LocalTier


def _rows(host_indices, n_keys: int, rows: List[int]):
    """The host indices of the pages at positions `rows`, out of `n_keys` equal runs."""
    return host_indices.reshape(n_keys, -1)[rows].reshape(-1)


def _is_kv(name) -> bool:
    return name == PoolName.KV or str(getattr(name, "value", name)) == PoolName.KV.value


class Tier(Protocol):
    """What TwoTiers asks of a tier behind the pool (tier2.SecondTier): the v1 and v2 batch calls, each answered
    as misses (reads) or "not written" (writes) while it is detached or when it fails, and its counters."""

    attached: bool

    def exists(self, keys: List[str]) -> int: ...
    def get_v1(self, keys: List[str], host_indices) -> List[bool]: ...
    def set_v1(self, keys: List[str], host_indices) -> List[bool]: ...
    def exists_v2(self, keys: List[str], transfers) -> Optional[PoolTransferResult]: ...
    def get_v2(self, transfers) -> Dict[Any, List[bool]]: ...
    def set_v2(self, transfers) -> Dict[Any, List[bool]]: ...
    def count(self, name: str, n: int = 1) -> None: ...


class TwoTiers:
    """The read and write rules across the pool (`local`: its KV pages; `pools`: its v2 pools, for hybrid models)
    and the tier behind it (`tier`).

    Calls go one way: the SGLang adapter (MaruStorage) calls this, this calls the two tiers. `is_writer`: this
    rank stores pages (promotions too); `log_once(what, error)` logs a failure once per cause."""

    def __init__(self, local: LocalTier, pools: HybridPools, tier: Tier, is_writer: bool,
                 log_once: Callable[[str, BaseException], None]):
        self.local = local
        self.pools = pools
        self.tier = tier
        self.is_writer = is_writer
        self._log_once = log_once

    # ------------------------------------------------------------ v1
    def exists(self, keys: List[str], local: int) -> int:
        if local >= len(keys) or not self.tier.attached:
            return local
        rest = keys[local:]
        return local + int(self.tier.exists(rest))

    def fill(self, keys: List[str], host_indices, res: List[bool]) -> List[bool]:
        """Load the pool's misses from the tier into the host pool; promote what arrived."""
        miss = [i for i, ok in enumerate(res) if not ok]
        if not miss or not self.tier.attached:
            return res
        sub, idx = [keys[i] for i in miss], _rows(host_indices, len(keys), miss)
        got = self.tier.get_v1(sub, idx)
        out, arrived = self._take(res, miss, got)
        if arrived and self.is_writer:
            written = self.local.promote_v1([sub[j] for j in arrived], _rows(idx, len(sub), arrived))
            self.tier.count("promoted", written)
        return out

    def _take(self, res: List[bool], miss: List[int], got) -> tuple:
        """(res with what the tier loaded marked True, the positions in the ask that it loaded); counted."""
        arrived = [j for j, ok in enumerate(got) if ok]
        self.tier.count("hits", len(arrived))
        self.tier.count("misses", len(miss) - len(arrived))
        out = list(res)
        for j in arrived:
            out[miss[j]] = True
        return out, arrived

    def write_through(self, keys: List[str], host_indices, res: List[bool]) -> List[bool]:
        if not self.tier.attached:
            self.tier.count("offline_writes", len(keys))
            return res
        put = self.tier.set_v1(keys, host_indices)
        self._count_writes(put)
        return [a or bool(b) for a, b in zip(res, put)]

    def _count_writes(self, put: List[bool]) -> None:
        ok = sum(bool(x) for x in put)
        self.tier.count("written", ok)
        if ok < len(put):
            self.tier.count("write_failed", len(put) - ok)
            self._log_once("tier2: write-through", RuntimeError(
                "Mooncake did not take some pages (full segments, or a transfer error); they stay in the pool "
                "only. Counted in get_stats().maru['tier2']['write_failed']"))

    # ------------------------------------------------------------ v2 (hybrid models)
    def exists_v2(self, keys: List[str], transfers, local: PoolTransferResult) -> PoolTransferResult:
        if local.kv_hit_pages >= len(keys) or not self.tier.attached:
            return local
        theirs = self.tier.exists_v2(keys, transfers)
        if theirs is not None and theirs.kv_hit_pages > local.kv_hit_pages:
            return theirs
        return local

    def fill_v2(self, transfers, results: Dict[Any, List[bool]]) -> Dict[Any, List[bool]]:
        """Per transfer, load the pool's misses from the tier; promote what arrived."""
        if not self.tier.attached:
            return results
        asks, where = [], {}
        for t in transfers or []:
            res = results.get(t.name, [])
            miss = [i for i, ok in enumerate(res) if not ok]
            if not miss:
                continue
            if _is_kv(t.name):  # KV pages live under their v1 keys in the tier too
                results[t.name] = self.fill(list(t.keys), t.host_indices, res)
                continue
            keys = list(t.keys)
            asks.append(dataclasses.replace(t, keys=[keys[i] for i in miss],
                                            host_indices=_rows(t.host_indices, len(keys), miss)))
            where[t.name] = miss
        if not asks:
            return results
        got = self.tier.get_v2(asks)
        back = []
        for ask in asks:
            results[ask.name], ok = self._take(results[ask.name], where[ask.name], got.get(ask.name, []))
            if ok:
                back.append(dataclasses.replace(ask, keys=[ask.keys[j] for j in ok],
                                                host_indices=_rows(ask.host_indices, len(ask.keys), ok)))
        if back:
            self.tier.count("promoted", self.pools.promote_v2(back))
        return results

    def write_through_v2(self, transfers, results: Dict[Any, List[bool]]) -> Dict[Any, List[bool]]:
        side = [t for t in transfers or [] if t.keys and not _is_kv(t.name)]
        for t in transfers or []:
            if t.keys and _is_kv(t.name):
                results[t.name] = self.write_through(list(t.keys), t.host_indices, results.get(t.name, []))
        if not side:
            return results
        if not self.tier.attached:
            self.tier.count("offline_writes", sum(len(t.keys) for t in side))
            return results
        put = self.tier.set_v2(side)
        for t in side:
            theirs = put.get(t.name, [False] * len(t.keys))
            self._count_writes(theirs)
            results[t.name] = [a or bool(b) for a, b in zip(results.get(t.name, [False] * len(t.keys)), theirs)]
        return results
