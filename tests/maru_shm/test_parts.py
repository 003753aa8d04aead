"""The interfaces between the store's parts: the allocator's host, the read rule's two forms, admin."""

from __future__ import annotations

import os

import numpy as np
import pytest

from maru_shm import PoolInUseError, Store, check_pool, destroy_pool, key_digest
from maru_shm.allocator import Allocator, AllocatorHost
from maru_shm.store import AllocatorServices
from maru_shm.datapath.validity import check_entries, check_entry


def _protocol_members(proto) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)


def test_the_store_and_the_read_only_check_each_provide_every_member_of_the_allocator_host(pool_path):
    from maru_shm.checks.check import _Pool
    from maru_shm.checks.view import PoolView
    members = _protocol_members(AllocatorHost)
    assert {"geo", "mm", "locks", "owner", "count", "slot_alive", "indexed_many", "unpublish_many"} <= members
    with Store.open(pool_path, "16M", create=True) as s:
        assert isinstance(s.alloc.host, AllocatorServices)
        assert all(hasattr(s.alloc.host, m) for m in members)
        view = PoolView.of(s)
        pool = _Pool(view)
        try:
            assert all(hasattr(pool, m) for m in members)
        finally:
            pool.release_views()


class RecordingHost:
    """An AllocatorHost of our own (not the Store): every process alive, nothing indexed, every unpublish
    succeeds; it records what the allocator asked."""

    def __init__(self, store: Store):
        self.geo, self.mm, self.locks = store.geo, store.mm, store.locks
        self.owner = store.slot + 1
        self.counted: dict[str, int] = {}
        self.unpublished = 0

    def count(self, **counters: int) -> None:
        for k, v in counters.items():
            self.counted[k] = self.counted.get(k, 0) + v

    def slot_alive(self, owner_plus1: int) -> bool:
        return True

    def indexed_many(self, blocks):
        return [False] * len(blocks)

    def unpublish_many(self, halves, offsets, words):
        self.unpublished += len(offsets)
        return np.ones(len(offsets), dtype=bool)


def test_the_allocator_needs_nothing_but_its_host(pool_path):
    """Allocate a class full, commit the blocks LIVE and unowned, and evict them: the allocator asks its
    host to unpublish the victims and counts the evictions there, and never reaches the Store."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, LIVE, META_OWNER_OFF, U16, U64, next_word, store_u64
    with Store.open(pool_path, "16M", create=True) as s:
        host = RecordingHost(s)
        alloc = Allocator(host)
        try:
            info = alloc.class_for(20_000)
            digests = np.arange(8, dtype="<u8").reshape(4, 2)
            offs = alloc.allocate(info, digests, np.full(4, 20_000, dtype=np.uint64), owner=s.slot + 1)
            assert len(offs) == 4 and len(set(offs)) == 4
            for off in offs:  # commit and disown, as a publication would
                m = s.geo.meta_of(off)
                store_u64(s.mm, m, next_word(U64.unpack_from(s.mm, m)[0], LIVE))
                U16.pack_into(s.mm, m + META_OWNER_OFF, 0)
            with s.locks.hold(CLASS_LOCK_BASE + info.cid):
                freed = alloc.clock.evict_blocks(info, 4)
            assert freed == 4 and host.unpublished == 4
            assert host.counted["evictions"] == 4
        finally:
            alloc.release_views()


@pytest.mark.parametrize("seed", [1, 2])
def test_the_scalar_and_the_batch_read_rule_agree_on_every_entry(pool_path, seed):
    """validity.check_entry and validity.check_entries are one rule in two forms: on live, overwritten,
    deleted and made-up entries they accept exactly the same."""
    rng = np.random.default_rng(seed)
    with Store.open(pool_path, "16M", create=True) as s:
        keys = [f"k{i}" for i in range(200)]
        for k in keys:
            s.put(k, os.urandom(int(rng.integers(1, 9000))))
        for k in keys[::7]:
            s.delete(k)
        for k in keys[::5]:
            s.put(k, b"x" * 100)
        entries, digests = [], []
        for k in keys:
            d = key_digest(k)
            found = s.index.find(d)
            word, off = found if found is not None else (0, 0)
            entries.append((d, word, off))
            digests.append(d)
        for _ in range(50):  # made up: random words and offsets, some outside the data area
            d = os.urandom(16)
            entries.append((d, int(rng.integers(0, 2**62)), int(rng.integers(-10, s.geo.data_bytes + 10 ** 6))))
        scalar = [check_entry(s.mm, s.geo, d, w, o) is not None for d, w, o in entries]
        halves = np.frombuffer(b"".join(d for d, _, _ in entries), dtype="<u8").reshape(-1, 2)
        e = np.zeros((len(entries), 4), dtype=np.uint64)
        e[:, 0], e[:, 1] = halves[:, 0], halves[:, 1]
        e[:, 2] = [w for _, w, _ in entries]
        e[:, 3] = [o % 2**64 for _, _, o in entries]  # a negative offset is a huge u64, as in the file
        _, _, _, ok = check_entries(s.alloc.meta_q, s.geo, e, halves[:, 0], halves[:, 1])
        assert ok.tolist() == scalar
        assert sum(scalar) == len(keys) - len(keys[::7]) + len([k for k in keys[::7] if k in keys[::5]])


def test_destroy_pool_refuses_a_pool_in_use_and_names_who(pool_path):
    with Store.open(pool_path, "16M", create=True) as s:
        with pytest.raises(PoolInUseError) as e:
            destroy_pool(pool_path)
        assert [p["pid"] for p in e.value.processes] == [os.getpid()]
        assert os.path.exists(pool_path)
        assert check_pool(pool_path).ok
        s.put("a", b"1")
    assert destroy_pool(pool_path) == []
    assert not os.path.exists(pool_path)
