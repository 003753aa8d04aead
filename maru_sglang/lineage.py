"""How SGLang's pages relate, told to the store so that eviction keeps what can still be a hit.

A page serves only while every page before it in its prompt's chain is stored too (SGLang asks
`batch_exists` for the chain and uses the leading run), and for a hybrid model only while its pages in the
other pools are stored as well. The store evicts first what relation records say can no longer be a hit (maru_shm,
FORMAT.md section 6a); this module writes them:

- One set call is one *segment*. SGLang's keys arrive in chain order, so a key's position in the call is
  its position in the segment. With `hicache_storage_pass_prefix_keys: true` SGLang passes every key
  before the call's as `extra_info.prefix_keys`: the segment's parent is the one holding the last of them,
  and its branch point that page's position there, both read from that page's own record. A call without
  prefix keys whose first pages are stored already (a hybrid model's system prompt, sent again by every
  conversation) takes those pages as its prefix. A parent that is no longer stored, or that a doom has
  stranded, makes the new segment stranded at birth: it is stored, and doomed at once (it can serve no
  prefix hit).
- The group is a hash of the last prefix key and the segment's first key, so every pool's pages of one
  request (v1 KV pages, v2 pages under the same keys) share it, and two continuations of one prefix do not.
- A page of a trailing pool (`TRAILING_PAGES`: SWA, Mamba; only the last pages serve) strands its whole
  segment when it goes.

Records are written only with `maru_prefix_eviction: true`. By default every model's pages are evicted by
the per-class CLOCK: the records lose tokens to it in some cell of every trace shape (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable, List, Optional

import numpy as np

from maru_shm import Store, chain_relations

from .hybrid import HybridPools
from .localtier import LogOnce
from .namespace import KeySpace


def _quiet(method):
    """Relations are hints: a failure to compute or record one costs hits, never a set or a read."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            self._log_once(f"prefix eviction ({method.__name__})", e)
            return None
    return call


class Segment:
    __slots__ = ("group", "parent", "branch", "orphan", "keys", "_pos")

    def __init__(self, group: int, parent: int, branch: int, orphan: bool, keys: List[str]):
        self.group, self.parent, self.branch, self.orphan, self.keys = group, parent, branch, orphan, keys
        self._pos = None

    def positions(self, keys: List[str]) -> np.ndarray:
        """Position of each key within the segment (keys of this segment, in any subset or order)."""
        if keys is self.keys or keys == self.keys:
            return np.arange(len(keys), dtype=np.int64)
        if self._pos is None:
            self._pos = {k: i for i, k in enumerate(self.keys)}
        return np.array([self._pos.get(k, 0) for k in keys], dtype=np.int64)

    def records(self, keys: List[str], trailing: bool = False):
        """Relation records of `keys` (pages of this segment), for Store.batch_put_pieces(relations=); None for
        no keys. `trailing`: the pages of a pool whose last pages alone serve (TRAILING_PAGES)."""
        if not keys:
            return None
        return chain_relations(len(keys), self.group, self.parent, self.branch, trailing, self.positions(keys))


class Lineage:
    """The segments of one backend's set calls. `enabled`: maru_prefix_eviction; `store()` the pool's store;
    `keyspace` whose pages these are; `hybrid` the v2 pools (what each stores); `log_once(what, error)` logs a
    failure once per cause."""

    def __init__(self, enabled: bool, store: Callable[[], Store], keyspace: KeySpace, hybrid: HybridPools,
                 log_once: LogOnce):
        self.enabled = enabled
        self._store = store
        self.keyspace = keyspace
        self.hybrid = hybrid
        self._log_once = log_once

    @staticmethod
    def _prefix(extra_info) -> Optional[list]:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return list(prefix) if prefix else None

    @_quiet
    def segment(self, keys: List[str], extra_info=None, stored=None) -> Optional[Segment]:
        """The segment a set call of these keys (in chain order) writes; None when disabled, empty, or when
        every key is stored already.

        A call without prefix keys may begin with pages another request stored: a hybrid model restores a
        prefix only where it ends on a sliding-window page, so every conversation on one system prompt sends
        that prompt's pages again. Those pages (`stored(keys)`: how many leading keys are stored) are its
        prefix; were they taken as its own, every such call would share one group, and evicting one
        conversation's page would doom the others' pages at that position.
        """
        if not self.enabled or not keys:
            return None
        ks, store = self.keyspace, self._store()
        prefix = self._prefix(extra_info)
        first = 0
        if not prefix and stored is not None:
            first = stored(keys)
            if first >= len(keys):
                return None
            prefix = keys[:first]
        tail = ks.digest(prefix[-1]) if prefix else b""
        group = int.from_bytes(hashlib.blake2b(tail + ks.digest(keys[first]), digest_size=4).digest(), "little")
        parent, branch, orphan = 0, 0, False
        if prefix:
            rec = store.relation_of(tail)
            orphan = rec is None
            if rec is not None:
                parent, branch = rec
        return Segment(group, parent, branch, orphan, list(keys))

    @_quiet
    def stored(self, seg: Optional[Segment]) -> None:
        """After the segment's pages are written: a segment whose parent is gone is doomed at once."""
        if seg is not None and seg.orphan:
            self._store().doom_segment(seg.group)

    @_quiet
    def segment_v2(self, transfers, extra_info=None) -> Optional[Segment]:
        """The segment of a v2 set call: its keys are those of the transfer with the most keys (the pages
        every page-aligned pool stores; a trailing pool names only the last ones)."""
        widest = max(transfers or [], key=lambda t: len(t.keys or []), default=None)
        keys = list(widest.keys or []) if widest is not None else []
        return self.segment(keys, extra_info, lambda ks: self.hybrid.leading_stored(widest.name, ks))
