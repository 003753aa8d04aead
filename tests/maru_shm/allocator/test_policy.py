"""The eviction policy (allocator/policy.py): the ref rule a pool is created with, age stamps, and settings.

The count CLOCK's own tests are in test_slabs.py; these are the age rule's (FORMAT.md section 6, DESIGN.md
section 8) and what decides which rule a pool has.
"""

from __future__ import annotations

import numpy as np
import pytest

from maru_shm import EvictionSettings, Store, eviction_settings, remove_pool
from maru_shm.format.layout import (AGE_CLAMP, AGE_TICK_OFF, AGE_TICKS, CLASS_LOCK_BASE, CLS_HAND, DEMAND_ACC_OFF,
                                    DEMAND_EPOCH_OFF, FLAG_AGE, U32, U64)
from maru_shm.index import key_digest

from ...conftest import assert_clean, check_value, make_value
from .test_slabs import _fill_one_class

KiB = 1 << 10


def _granules(s, info):
    """The granules of the class's blocks in ring order (slabs by head unit, then block index)."""
    a = s.alloc
    return np.array([(h * s.geo.unit_size + i * info.block) // s.geo.granule
                     for h in a.slabs.class_slabs(info.cid) for i in range(info.bps)])


def _set_tick(s, tick: int) -> None:
    U32.pack_into(s.mm, AGE_TICK_OFF, tick)


def test_a_pool_gets_the_ref_rule_its_creator_asks_for(pool_path):
    """Store.open's `eviction` sets FLAG_AGE at creation ("count" by default); EvictionSettings.age overrides
    it; an existing pool keeps its own; any other name is refused."""
    with Store.open(pool_path, "8M", create=True) as s:
        assert not s.geo.flags & FLAG_AGE and not s.policy.age and not s.policy.prefix_mark
    with Store.open(pool_path, eviction="age") as s:  # opened, not created: its rule stays
        assert not s.policy.age
    for eviction, override, age in (("age", None, True), ("count", True, True), ("age", False, False)):
        path = f"{pool_path}-{eviction}-{override}"
        with eviction_settings(age=override), Store.open(path, "8M", create=True, eviction=eviction) as s:
            assert bool(s.geo.flags & FLAG_AGE) == s.policy.age == s.policy.prefix_mark == age
        remove_pool(path)
    with pytest.raises(ValueError, match="eviction"):
        Store.open(f"{pool_path}-bad", "8M", create=True, eviction="lru")
    assert EvictionSettings().age is None  # the settings came back


def test_writes_and_hits_stamp_the_age_tick_and_allocation_advances_it(open_store):
    s = open_store("16M", eviction="age")
    a, g = s.alloc, s.geo
    _set_tick(s, 300)  # its low byte is the stamp
    assert s.put("k", make_value("k", 1, 64 * KiB))
    m = s.index.find(key_digest("k"))[1] // g.granule
    assert a.meta_refs[m] == 300 & 0xFF
    _set_tick(s, 310)
    assert check_value("k", s.get("k")) and a.meta_refs[m] == 310 & 0xFF
    _set_tick(s, 320)
    assert s.touch([key_digest("k")]) == 1 and a.meta_refs[m] == 320 & 0xFF
    step = g.data_bytes // AGE_TICKS

    def allocated():  # bytes counted in demand so far: data_bytes / 4 an epoch, and the epoch's accumulator
        return U32.unpack_from(s.mm, DEMAND_EPOCH_OFF)[0] * (g.data_bytes // 4) + U64.unpack_from(s.mm, DEMAND_ACC_OFF)[0]
    tick0, bytes0 = s.policy.tick(), allocated()
    for i in range(0, 160, 16):  # about 10 MiB: several ticks, past an epoch
        keys = [f"v{j}" for j in range(i, i + 16)]
        assert all(s.batch_put(keys, [make_value(k, 1, 64 * KiB) for k in keys]))
    assert allocated() - bytes0 > g.data_bytes // 4
    assert s.policy.tick() - tick0 == allocated() // step - bytes0 // step  # one per data_bytes / AGE_TICKS


def test_an_age_class_evicts_its_oldest_blocks_ties_from_the_hand(open_store):
    """With every block stamped, an eviction of m blocks takes the m oldest; among equal stamps the first from
    the hand; the hand is left after the last victim. A stamp older than AGE_CLAMP is clamped as it is read."""
    s = open_store("16M", eviction="age")
    info, n = _fill_one_class(s, 100 * KiB)
    a = s.alloc
    g = _granules(s, info)
    _set_tick(s, 1000)
    now = 1000 & 0xFF
    a.meta_refs[g] = now  # every block young
    old = [5, 9, n - 2]
    a.meta_refs[g[old]] = (now - 40) & 0xFF
    a.meta_refs[g[[3, 7]]] = (now - 10) & 0xFF
    a.meta_refs[g[1]] = (now - 200) & 0xFF  # past the clamp
    U64.pack_into(s.mm, a.geo.class_entry(info.cid) + CLS_HAND, 0)
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 5) == 5
    words = a.meta_words[g] & np.uint64(3)
    gone = set(np.flatnonzero(words == 0).tolist())
    assert gone == {1, 5, 9, n - 2, 3}, "the oldest: the clamped one, the three 40 old, then the first 10 old"
    assert a.meta_refs[g[7]] == (now - 10) & 0xFF
    hand = U64.unpack_from(s.mm, a.geo.class_entry(info.cid) + CLS_HAND)[0]
    ring_of = {int(x): i for i, x in enumerate(g)}
    assert ring_of[((hand >> 8) * s.geo.unit_size + (hand & 0xFF) * info.block) // s.geo.granule] == n - 1
    a.meta_refs[g[0]] = (now - 250) & 0xFF
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 1) == 1
    assert a.meta_words[g[0]] & np.uint64(3) == 0  # the oldest again (the scan wraps past the hand)
    assert_clean(s)


def test_a_clamped_stamp_stays_old_until_the_next_eviction(open_store):
    """A stamp more than 255 ticks old would read as young again. An eviction rewrites every stamp older than
    AGE_CLAMP to exactly that age, so a class that evicts within AGE_CLAMP ticks of the last time still finds
    such a block old: 129 ticks, then 127 more, is 256 unclamped (read as 0), 255 clamped."""
    s = open_store("16M", eviction="age")
    info, n = _fill_one_class(s, 100 * KiB)
    a = s.alloc
    g = _granules(s, info)
    _set_tick(s, 5000)
    a.meta_refs[g] = 5000 & 0xFF
    a.meta_refs[g[2]] = (5000 - 129) & 0xFF
    a.meta_refs[g[4]] = (5000 - 129) & 0xFF
    U64.pack_into(s.mm, a.geo.class_entry(info.cid) + CLS_HAND, 0)
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 1) == 1  # ties: the first from the hand
    assert a.meta_words[g[2]] & np.uint64(3) == 0
    assert a.meta_refs[g[4]] == (5000 - AGE_CLAMP) & 0xFF  # clamped, not evicted
    _set_tick(s, 5000 + 127)
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 1) == 1
    assert a.meta_words[g[4]] & np.uint64(3) == 0, "the clamped block is still the oldest"


def test_in_an_age_pool_the_shard_clock_keeps_young_and_pinned_blocks(open_store):
    s = open_store("16M", eviction="age")
    assert s.put("young", make_value("young", 1, 4096)) and s.put("old", make_value("old", 1, 4096))
    assert s.put("pin", make_value("pin", 1, 512)) and s.pin("pin")
    _set_tick(s, 700)
    offs = {k: s.index.find(key_digest(k))[1] for k in ("young", "old", "pin")}
    for k in ("old", "pin"):
        s.alloc.meta_refs[offs[k] // s.geo.granule] = (700 - AGE_TICKS) & 0xFF
    s.alloc.meta_refs[offs["young"] // s.geo.granule] = (700 - AGE_TICKS + 1) & 0xFF
    ref = s.policy.shard_referenced
    assert ref(offs["young"], age=True) and ref(offs["young"]) and not ref(offs["old"], age=True)
    assert ref(offs["pin"]) and not ref(s.geo.data_bytes)


def test_an_age_pool_keeps_what_is_read_under_churn(open_store):
    """Four times the pool written through it while a few keys are read every round: they stay."""
    s = open_store("16M", eviction="age")
    hot = [f"hot{i}" for i in range(4)]
    for k in hot:
        assert s.put(k, make_value(k, 1, 64 * KiB))
    for i in range(4 * 16 * 16):
        assert s.put(f"c{i}", make_value(f"c{i}", 1, 64 * KiB))
        if i % 8 == 0:
            assert all(check_value(k, s.get(k)) for k in hot)
    assert s.stats()["evictions"] > 0 and all(check_value(k, s.get(k)) for k in hot)
    assert_clean(s)
