"""Slab allocator: capacity, eviction instead of failure, slabs moving between classes, mixed sizes.

The figures (utilization) are printed (`-s`) and attached to the test report as user properties.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from maru_shm.allocator.policy import Settings
from maru_shm.format.sizeclasses import geometric_sizes
from maru_shm.format.layout import FREE_FLOOR_OFF, U32, UNIT_FREE, UNIT_HEAD
from maru_shm.allocator.keptblocks import keep_limit, spare_limit
from maru_shm.index import key_digest

from ...conftest import assert_clean, check_value, held_by_another_thread, make_value

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _report(record_property, name, value):
    record_property(name, round(value, 4))
    print(f"\n{name} = {value:.4f}")


def test_capacity_exact_class_fills_1gib(open_store, record_property):
    """Llama-3.1-8B pages (128 KiB per token, page_size 1) with an exact class fill >= 97 % of the file."""
    s = open_store("1G")
    page = 128 * KiB
    s.declare_size(page)
    n = s.geo.data_bytes // page + 64  # more than fits: the last puts must evict, not fail
    batch = 64
    for start in range(0, n, batch):
        keys = [f"page-{i}" for i in range(start, min(n, start + batch))]
        assert all(s.batch_put(keys, [make_value(k, 1, page) for k in keys]))
    st = s.stats()
    _report(record_property, "capacity_utilization_128KiB_1GiB", st["utilization"])
    assert st["utilization"] >= 0.97
    assert st["evictions"] > 0
    # the newest pages are all there, and they verify
    for i in range(n - 100, n):
        assert check_value(f"page-{i}", s.get(f"page-{i}"))
    assert_clean(s)


def test_full_pool_evicts_instead_of_failing(open_store):
    s = open_store("16M")
    rng = random.Random(7)
    sizes = [5000, 12_000, 40_000, 130_000, 300_000]
    written = n = 0
    while written < 4 * s.geo.file_size:
        size = rng.choice(sizes)
        k = f"k{n}"
        assert s.put(k, make_value(k, 1, size)), f"put {n} ({size} bytes) failed instead of evicting"
        written += size
        n += 1
    st = s.stats()
    assert st["evictions"] > 0 and st["put_failures"] == 0
    for i in range(n - 5, n):  # approximately LRU: the newest entries survive
        assert check_value(f"k{i}", s.get(f"k{i}"))
    present = sum(s.batch_exists([f"k{i}" for i in range(n)]))
    assert present == st["entries"]
    assert_clean(s)


def _churn(s, prefix, size, times):
    n = int(times * s.geo.data_bytes // size)
    for start in range(0, n, 32):
        keys = [f"{prefix}{i}" for i in range(start, min(n, start + 32))]
        assert all(s.batch_put(keys, [make_value(k, 1, size) for k in keys]))
    return n


def _live_fraction(s, size):
    """Fraction of the data area holding live values of exactly `size` bytes."""
    from maru_shm.checks.figures import class_table
    rows = [r for r in class_table(s) if r["block_size"] == s.alloc.class_for(size).block]
    return sum(r["live_bytes"] for r in rows) / s.geo.data_bytes


def test_free_slabs_move_between_classes(open_store, record_property):
    """No slab calcification: each size in turn gets nearly the whole pool."""
    s = open_store("64M")
    sizes = geometric_sizes(s.geo.granule, s.geo.max_value)
    small = next(b for b in sizes if b >= 20 * KiB)   # exact class sizes: no internal waste
    large = next(b for b in sizes if b >= 200 * KiB)
    for phase, size in enumerate([small, large, small]):
        _churn(s, f"p{phase}-", size, 2.0)
        frac = _live_fraction(s, size)
        _report(record_property, f"phase{phase}_{size}B_live_fraction", frac)
        assert frac >= 0.85, f"phase {phase}: {size}-byte values hold only {frac:.1%} of the data area"
    assert s.stats()["slab_moves"] > 0
    assert_clean(s)


def test_emptied_class_gives_its_slabs_away(open_store):
    # 66 MiB: the large class's slabs are 9 units; 28 slabs then need every unit, and one small slab the deletes
    # emptied stays.
    s = open_store("66M")
    sizes = geometric_sizes(s.geo.granule, s.geo.max_value)
    small = next(b for b in sizes if b >= 20 * KiB)
    large = next(b for b in sizes if b >= 100 * KiB)
    n = _churn(s, "a", small, 1.0)
    for i in range(n):
        s.delete(f"a{i}")
    assert s.stats()["live_bytes"] == 0
    _churn(s, "b", large, 1.2)
    assert _live_fraction(s, large) >= 0.85
    assert_clean(s)


def test_mixed_sizes_keep_the_pool_full(open_store, record_property):
    """Uniform 50-512 KiB payloads written at 3x the pool size: live payload / file stays >= 0.85."""
    s = open_store("1G")
    rng = random.Random(2024)
    written, n, samples = 0, 0, []
    while written < 3 * s.geo.file_size:
        sizes = [rng.randint(50 * KiB, 512 * KiB) for _ in range(16)]
        keys = [f"m{n + j}" for j in range(len(sizes))]
        assert all(s.batch_put(keys, [make_value(k, 1, z) for k, z in zip(keys, sizes)]))
        n += len(keys)
        written += sum(sizes)
        if written > 1.2 * s.geo.file_size and n % 256 == 0:
            samples.append(s.stats()["utilization"])
    st = s.stats()
    _report(record_property, "mixed_50_512KiB_utilization_final", st["utilization"])
    _report(record_property, "mixed_50_512KiB_utilization_min", min(samples))
    _report(record_property, "mixed_50_512KiB_data_utilization", st["data_utilization"])
    assert st["utilization"] >= 0.85
    assert min(samples) >= 0.85
    for k in rng.sample([f"m{i}" for i in range(n - 2000, n)], 200):
        v = s.get(k)
        assert v is None or check_value(k, v)
    assert_clean(s)


def test_batch_spanning_a_partial_slab_and_an_eviction_keeps_its_blocks(open_store):
    """One allocate call takes the last free blocks of a partial slab, then must evict to make room for
    the rest, and the slab CLOCK hand points at that very slab: the blocks already taken carry their
    owner by then, so the eviction skips the slab instead of freeing (and reformatting) it under them."""
    from maru_shm.format.layout import CLS_PARTIAL, SLAB_HAND_OFF, SLAB_REF, U32
    s = open_store("16M")
    size = 100 * KiB
    info = s.alloc.class_for(size)
    n = 0
    while True:  # fill the pool completely with this class
        keys = [f"f{n + i}" for i in range(16)]
        assert all(s.batch_put(keys, [make_value(k, 1, size) for k in keys]))
        n += 16
        if s.stats()["evictions"]:
            break
    # free two blocks of one slab: it becomes the class's partial slab, and the only one
    victims = [f"f{n - 1}", f"f{n - 2}"]
    for k in victims:
        assert s.delete(k)
    head = U32.unpack_from(s.mm, s.geo.class_entry(info.cid) + CLS_PARTIAL)[0] - 1
    assert head >= 0
    for u in range(s.geo.n_units):  # all referenced: the first sweep clears them and the next one
        s.mm[s.geo.slab_entry(u) + SLAB_REF] = 1  # starts at the hand, on the slab the batch just took from
    U32.pack_into(s.mm, SLAB_HAND_OFF, head)
    keys = [f"g{i}" for i in range(info.bps + 2)]
    assert all(s.batch_put(keys, [make_value(k, 2, size) for k in keys]))
    for k in keys:
        assert check_value(k, s.get(k)), k
    assert_clean(s)


# ---------------------------------------------------------------- eviction within a class (block CLOCK)

def _fill_one_class(s, size, tag="f"):
    """Put exactly as many values of one size as the pool holds: no free unit, no free block, no eviction."""
    info = s.alloc.class_for(size)
    n = s.geo.n_units // info.k * info.bps
    for start in range(0, n, 16):
        keys = [f"{tag}{i}" for i in range(start, min(n, start + 16))]
        assert all(s.batch_put(keys, [make_value(k, 1, size) for k in keys]))
    assert s.alloc.runs.find_free_run(info.k) is None and s.stats()["evictions"] == 0
    return info, n


def _slab_of(s, key):
    found = s.index.find(key_digest(key))
    return None if found is None else s.alloc.block_index(found[1])[0]


def test_block_clock_keeps_a_hot_block_and_evicts_its_cold_neighbours(open_store):
    """One class fills the pool. A block read between every put survives 3 pool-fulls of new values of
    its class, while the cold blocks that shared its slab are evicted: the victims are chosen per block
    (a slab CLOCK would keep the neighbours, since a hit on the hot block marks the whole slab)."""
    s = open_store("16M")
    size = 100 * KiB
    info, n = _fill_one_class(s, size)
    hot = "f0"
    h = _slab_of(s, hot)
    neighbours = [f"f{i}" for i in range(1, n) if _slab_of(s, f"f{i}") == h]
    assert len(neighbours) == info.bps - 1
    total = 3 * s.geo.data_bytes // info.block
    for i in range(total):
        assert check_value(hot, s.get(hot)), f"the hot block was evicted after {i} puts"
        k = f"new{i}"
        assert s.put(k, make_value(k, 1, size))
    assert check_value(hot, s.get(hot))
    assert not any(s.batch_exists(neighbours)), "cold neighbours of the hot block should be gone"
    assert s.stats()["evictions"] >= total - info.bps
    assert s.stats()["slab_moves"] == 0, "one class at its demand share evicts within, never moves"
    assert_clean(s)


def test_block_clock_sweep_is_bounded_when_every_block_is_owned(open_store):
    """Every block of the only class is owned by a live writer: the block CLOCK finds no victim in one
    bounded sweep, the slab CLOCK none either, and the put fails instead of looping. Once the blocks
    are disowned (every ref bit set), the next put evicts exactly one block, the one at the hand, and
    the sweep has cleared the ref bit of every other block."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, CLS_HAND, U64
    s = open_store("16M")
    size = 100 * KiB
    info, n = _fill_one_class(s, size)
    a = s.alloc
    offs = [h * s.geo.unit_size + i * info.block for h in a.slabs.class_slabs(info.cid) for i in range(info.bps)]
    g = [o // s.geo.granule for o in offs]
    a.meta_owners[g] = s.slot + 1
    a.meta_refs[g] = 1
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 4) == 0
    assert a.meta_refs[g].all(), "no victim: the hand passed nothing but owned blocks"
    assert not s.put("nope", make_value("nope", 1, size))
    a.meta_owners[g] = 0
    hand = U64.unpack_from(s.mm, a.geo.class_entry(info.cid) + CLS_HAND)[0]
    victim_off = (hand >> 8) * s.geo.unit_size + (hand & 0xFF) * info.block
    ev = s.stats()["evictions"]
    assert s.put("yes", make_value("yes", 1, size))
    assert s.stats()["evictions"] == ev + 1
    assert s.index.find(key_digest("yes"))[1] == victim_off, "the second pass takes the block at the hand"
    assert not a.meta_refs[g].any(), "the first pass cleared every ref bit"
    assert_clean(s)


def test_block_clock_keeps_a_value_hit_twice_over_one_hit_once(open_store):
    """The ref count: hits raise it up to REF_MAX, the hand lowers it by one as it passes. With the hand at the
    first block, the second block hit twice and the third hit once, a sweep for every block but one takes
    the unreferenced blocks in the first pass and the block hit once in the second: the block hit twice,
    earlier in the ring, survives with a count of 1 (a one-bit CLOCK would take it first in the second pass).
    """
    from maru_shm.format.layout import CLASS_LOCK_BASE, CLS_HAND, REF_MAX, U64
    s = open_store("16M")
    size = 100 * KiB
    info, n = _fill_one_class(s, size)
    a = s.alloc
    ring = [h * s.geo.unit_size + i * info.block for h in a.slabs.class_slabs(info.cid) for i in range(info.bps)]
    g = np.array([o // s.geo.granule for o in ring])
    key_at = {s.index.find(key_digest(f"f{i}"))[1]: f"f{i}" for i in range(n)}
    twice, once = key_at[ring[1]], key_at[ring[2]]
    U64.pack_into(s.mm, a.geo.class_entry(info.cid) + CLS_HAND, 0)
    a.meta_refs[g] = 0
    for _ in range(REF_MAX + 1):
        assert check_value(twice, s.get(twice))
    assert check_value(once, s.get(once))
    assert a.meta_refs[g[1]] == REF_MAX and a.meta_refs[g[2]] == 1, "a hit raises the count, up to REF_MAX"
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, n - 1) == n - 1
    assert check_value(twice, s.get(twice)), "the block hit twice survives"
    assert s.get(once) is None
    assert a.meta_refs[g[1]] == 1, "lowered by each of the two passes, raised by the get above"
    assert_clean(s)


def test_slabs_move_to_a_class_short_of_its_demand_share(open_store):
    """Class A fills the pool; then A and B are put at equal byte rates. B starts with no slab (it must
    take one), and takes slabs from A until their retentions (slab bytes / demand) are within the move
    margin: at equal demand A then holds 1 + MOVE_MARGIN times B's slab bytes, and evicts within itself.
    Moves happen, but far fewer than B's puts (a class near its share does not move). Without the rule B
    would keep its first slab only."""
    MOVE_MARGIN = Settings().move_margin
    s = open_store("64M")
    sizes = geometric_sizes(s.geo.granule, s.geo.max_value)
    a_size = next(b for b in sizes if b >= 100 * KiB)
    b_size = next(b for b in sizes if b >= 200 * KiB)
    ia, n = _fill_one_class(s, a_size, "a")
    ib = s.alloc.class_for(b_size)
    assert list(s.alloc.policy.donors(ib)) == [ia.cid], "a class without a slab must get one"
    assert not len(s.alloc.policy.donors(ia))
    b_puts = written = 0
    while written < 4 * s.geo.data_bytes:
        kb = f"b{b_puts}"
        assert s.put(kb, make_value(kb, 1, b_size))
        for j in range(round(b_size / a_size)):
            ka = f"a2-{b_puts}-{j}"
            assert s.put(ka, make_value(ka, 1, a_size))
        written += 2 * b_size
        b_puts += 1
    moves = s.stats()["slab_moves"]
    nslabs = s.alloc.cls_nslabs
    share_b = nslabs[ib.cid] * ib.k / (nslabs[ia.cid] * ia.k + nslabs[ib.cid] * ib.k)
    print(f"\nB's slab share {share_b:.3f}, {moves} slab moves for {b_puts} puts of B")
    balance = 1 / (2 + MOVE_MARGIN)
    assert 0.75 * balance <= share_b <= 1.25 * balance, share_b
    assert 0 < moves < b_puts / 4, (moves, b_puts)
    assert_clean(s)


def test_the_move_rule_balances_retention_with_a_margin(open_store):
    """`donors`: a class without a slab may take one from every class that has one. Otherwise, with
    retention = slab units / decayed demand, class d may give class c a slab only if d after giving a
    window of c's k units keeps its values 1 + MOVE_MARGIN times as long as c after taking. That never
    makes c a donor of d in turn. A class whose demand has decayed to nothing gives."""
    MOVE_MARGIN = Settings().move_margin
    from maru_shm.format.layout import CLS_DEMAND, CLS_DEMAND_EPOCH, DEMAND_EPOCH_OFF, U32, U64
    s = open_store("64M")
    sizes = geometric_sizes(s.geo.granule, s.geo.max_value)
    ia, _ = _fill_one_class(s, next(b for b in sizes if b >= 100 * KiB), "a")
    ib = s.alloc.class_for(next(b for b in sizes if b >= 200 * KiB))
    assert list(s.alloc.policy.donors(ib)) == [ia.cid]
    assert s.put("b0", make_value("b0", 1, ib.block))  # takes a window of A's slabs
    nslabs = s.alloc.cls_nslabs
    assert nslabs[ib.cid] == 1
    ua, ub = float(nslabs[ia.cid] * ia.k), float(nslabs[ib.cid] * ib.k)
    (epoch,) = U32.unpack_from(s.mm, DEMAND_EPOCH_OFF)

    def donors_at(dem_a, dem_b):
        for info, value in ((ia, dem_a), (ib, dem_b)):
            U64.pack_into(s.mm, s.geo.class_entry(info.cid) + CLS_DEMAND, int(value))
            U32.pack_into(s.mm, s.geo.class_entry(info.cid) + CLS_DEMAND_EPOCH, epoch)
        assert not len(s.alloc.policy.donors(ia)), "B gave to A"
        return list(s.alloc.policy.donors(ib))

    assert donors_at(ua * 1000, ub * 1000) == []  # demand in proportion to the slabs
    giver = (ua - ib.k) / (ua * 1000)  # A's retention after giving a window of B's size
    to_move = (1 + MOVE_MARGIN) * (ub + ib.k) / giver  # B's demand past which B's retention after taking is short
    assert donors_at(ua * 1000, to_move * 0.99) == []
    assert donors_at(ua * 1000, to_move * 1.01) == [ia.cid]
    assert donors_at(0, 1) == [ia.cid]  # A idle: it keeps its values for ever, and gives
    assert_clean(s)


def test_block_clock_takes_victims_in_ring_order_across_chunks(open_store):
    """A class of ~900 blocks (the sweep reads 512 at a time). With every ref bit set but on three
    blocks far apart (100, 600, 800), the victims are exactly those three, in ring order from the hand, and only the
    ref bits the hand passed are cleared. With every ref bit set, the second pass takes the blocks
    at the hand, and the first pass has cleared every bit."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, CLS_HAND, U64
    s = open_store("16M")
    size = 16 * KiB
    s.declare_size(size)
    info, n = _fill_one_class(s, size)
    a = s.alloc
    ring = [h * s.geo.unit_size + i * info.block for h in a.slabs.class_slabs(info.cid) for i in range(info.bps)]
    assert len(ring) > 850
    g = np.array([o // s.geo.granule for o in ring])
    owner_of = {s.index.find(key_digest(f"f{i}"))[1]: f"f{i}" for i in range(n)}
    U64.pack_into(s.mm, a.geo.class_entry(info.cid) + CLS_HAND, 0)  # the hand at the first block
    a.meta_refs[g] = 1
    cold = [100, 600, 800]
    a.meta_refs[g[cold]] = 0
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 3) == 3
    assert [s.get(owner_of[ring[i]]) for i in cold] == [None] * 3
    refs = a.meta_refs[g]
    assert not refs[:801].any() and refs[801:].all(), "cleared exactly up to the last victim"
    hand = U64.unpack_from(s.mm, a.geo.class_entry(info.cid) + CLS_HAND)[0]
    assert (hand >> 8) * s.geo.unit_size + (hand & 0xFF) * info.block == ring[801]
    a.meta_refs[g] = 1
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert a.clock.evict_blocks(info, 2) == 2
    live = np.setdiff1d(np.arange(len(ring)), cold)  # the three blocks freed above are FREE: skipped
    assert not a.meta_refs[g[live]].any() and a.meta_refs[g[cold]].all()
    assert s.get(owner_of[ring[801]]) is None and s.get(owner_of[ring[802]]) is None
    assert check_value(owner_of[ring[803]], s.get(owner_of[ring[803]]))
    assert_clean(s)


def _free_runs_by_trying_every_start(alloc, k: int, count: int) -> list[int]:
    """The definition find_free_runs implements: every start of k FREE units in turn, lowest first,
    skipping starts inside a run already taken or inside an earlier slab's extent."""
    free = alloc.states == UNIT_FREE
    out, nxt = [], -1
    for u in range(alloc.geo.n_units - k + 1):
        if u >= nxt and free[u:u + k].all() and not alloc.runs.reached_by_earlier_slab(u):
            out.append(u)
            nxt = u + k
            if len(out) == count:
                break
    return out


def test_free_run_search_matches_trying_every_start(open_store):
    """find_free_runs reads the slab table in windows from the free floor and takes runs per free segment;
    on random slab tables (scattered heads, one long free stretch crossing windows, a damaged head whose
    extent covers FREE units) it returns what trying every start would, and leaves no FREE unit below the
    floor it writes."""
    s = open_store("1G")
    a = s.alloc
    rng = random.Random(5)
    k_of = {c.k: c.cid for c in a.classes if c is not None}
    try:
        for trial in range(120):
            heads = np.array([rng.random() < (0.3 if trial % 3 else 0.001) for _ in range(a.geo.n_units)])
            a.states[:] = np.where(heads, UNIT_HEAD, UNIT_FREE)
            a.clsfield[:] = k_of[1]
            if trial % 4 == 0:  # a head whose class says 4 units, with FREE (damaged) entries after it
                h = rng.randrange(a.geo.n_units - 8)
                a.states[h] = UNIT_HEAD
                a.clsfield[h] = k_of[4]
                a.states[h + 1:h + 4] = UNIT_FREE
            k, count = rng.choice([1, 2, 4]), rng.choice([1, 3, 40, 5000])
            U32.pack_into(s.mm, FREE_FLOOR_OFF, 0)
            want = _free_runs_by_trying_every_start(a, k, count)
            assert a.runs.find_free_runs(k, count) == want, (trial, k, count)
            floor = U32.unpack_from(s.mm, FREE_FLOOR_OFF)[0]
            assert not (a.states[:floor] == UNIT_FREE).any()
            assert a.runs.find_free_runs(k, count) == want  # the same from the floor it raised
    finally:
        a.states[:] = UNIT_FREE  # an empty pool again, for the fixture's check
        a.clsfield[:] = 0
        U32.pack_into(s.mm, FREE_FLOOR_OFF, 0)


def class_lock_held_by_another_thread(s, cid: int):
    """CLASS[cid] held by another thread of this process for the duration of the block."""
    from maru_shm.format.layout import CLASS_LOCK_BASE
    return held_by_another_thread(s.locks.hold(CLASS_LOCK_BASE + cid), 10)


def test_an_overwrite_keeps_its_old_block_and_the_next_put_reuses_it_without_the_class_lock(open_store, pool_path,
                                                                                         make_value):
    """free_blocks(keep=...) from the put path: the old block of an overwrite stays LIVE, owned and unindexed
    (check is clean: held, not live), and this process's next put of that class takes it without the class
    lock, even while another holder has that lock. At most keep_limit blocks are kept per class; close
    frees them."""
    import time
    from maru_shm import Store
    s = open_store("16M")
    info = s.alloc.class_for(20_000)
    assert s.put("a", make_value("a", 1, 20_000))
    old_off, old_word, _, _ = s._reader.lookup(key_digest("a"))
    spares = s.alloc.kept_blocks.lists[info.cid][:]  # the first put's spares (keptblocks.spare_limit), RESERVED
    assert len(spares) == spare_limit(info)
    assert s.put("a", make_value("a", 2, 20_000))  # takes a spare; the old block joins the list last
    assert s.alloc.kept_blocks.lists[info.cid] == spares[:-1] + [(old_off, old_word)]
    st = s.stats()
    assert st["live_blocks"] == st["entries"] == 1 and st["held_blocks"] == 1
    assert st["reserved_blocks"] == len(spares) - 1
    assert s.check().ok
    with class_lock_held_by_another_thread(s, info.cid):
        t0 = time.monotonic()
        assert s.put("b", make_value("b", 1, 20_000))  # the kept block: no class lock
        assert time.monotonic() - t0 < 1.0
        assert s._reader.lookup(key_digest("b"))[0] == old_off
        assert s.alloc.kept_blocks.lists[info.cid] == spares[:-1]
    assert s.get("a") == make_value("a", 2, 20_000) and s.get("b") == make_value("b", 1, 20_000)
    s.put("spare-used", make_value("c", 1, 20_000))
    limit = keep_limit(info)
    for r in range(3):
        for i in range(limit + 4):
            assert s.put(f"k{i}", make_value(f"k{i}", r, 20_000))
    assert len(s.alloc.kept_blocks.lists[info.cid]) <= limit
    st = s.stats()
    assert st["held_blocks"] + st["reserved_blocks"] == len(s.alloc.kept_blocks.lists[info.cid])
    assert s.check().ok
    s.close()
    s2 = Store.open(pool_path)
    try:
        st = s2.stats()
        assert st["held_blocks"] == st["reserved_blocks"] == 0
        assert st["live_blocks"] == st["entries"] == limit + 7
        assert s2.check().ok
    finally:
        s2.close()


def test_a_single_key_put_reserves_spares_so_the_next_puts_take_no_class_lock(open_store, pool_path, make_value):
    """Under the class lock a single-key put also reserves up to spare_limit free blocks of the partial slab
    (RESERVED, ours, no digest); the next puts of the class take them while another holder has the class
    lock. Batches of several keys reserve none, large classes none, and spares never make room: with no
    free block left in the slab there are none. check is clean throughout and close frees them."""
    import time
    from maru_shm import Store
    s = open_store("16M")
    small, large = s.alloc.class_for(4096), s.alloc.class_for(131072)
    assert spare_limit(small) == 16 and spare_limit(large) == 0
    assert s.put("first", make_value("first", 1, 4096))
    assert len(s.alloc.kept_blocks.lists[small.cid]) == 16
    assert s.stats()["reserved_blocks"] == 16 and s.check().ok
    with class_lock_held_by_another_thread(s, small.cid):
        t0 = time.monotonic()
        for i in range(16):
            assert s.put(f"k{i}", make_value(f"k{i}", 1, 4096))
        assert time.monotonic() - t0 < 1.0  # none waited for the class lock
        assert not s.alloc.kept_blocks.lists.get(small.cid)
    assert s.put("large", make_value("large", 1, 131072)) and not s.alloc.kept_blocks.lists.get(large.cid)
    assert all(s.batch_put([f"b{i}" for i in range(4)], [make_value(f"b{i}", 1, 8192) for i in range(4)]))
    assert not s.alloc.kept_blocks.lists.get(s.alloc.class_for(8192).cid)  # a batch reserves no spares
    assert all(s.get(f"k{i}") == make_value(f"k{i}", 1, 4096) for i in range(16))
    assert s.check().ok
    s.close()
    s2 = Store.open(pool_path)
    try:
        st = s2.stats()
        assert st["reserved_blocks"] == st["held_blocks"] == 0 and st["live_blocks"] == 22
        assert s2.check().ok
    finally:
        s2.close()


def test_spares_never_make_room(open_store, make_value):
    """A full class gives a single-key put its block by eviction, and no spare beyond the slab's free blocks."""
    s = open_store("8M")
    info = s.alloc.class_for(65536)
    assert spare_limit(info) == 1
    n = 0
    while s.stats()["evictions"] == 0 and n < 10_000:
        assert s.put(f"k{n}", make_value(f"k{n}", 1, 65536))
        n += 1
    assert n < 10_000
    evictions = s.stats()["evictions"]
    for i in range(50):  # every put now evicts its own block, and no more: a full slab has no spare to give
        assert s.put(f"x{i}", make_value(f"x{i}", 1, 65536))
        assert not s.alloc.kept_blocks.lists.get(info.cid)
    st = s.stats()
    assert st["evictions"] - evictions == 50 and st["reserved_blocks"] == 0
    assert s.check().ok


def test_threads_overwriting_share_the_kept_blocks_and_orphan_none(open_store, make_value):
    """Threads of one process share the list of kept blocks: some add old blocks while others take them.
    Nothing is dropped between the two: every LIVE block is an indexed value or a kept one."""
    import threading
    s = open_store("32M")
    keys = [f"k{i}" for i in range(16)]
    errors = []

    def worker(t):
        try:
            for r in range(150):
                k = keys[(r * 7 + t) % len(keys)]
                s.put(k, make_value(k, r, 20_000))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = s.stats()
    kept = sum(len(v) for v in s.alloc.kept_blocks.lists.values())
    assert st["live_blocks"] == st["entries"] == len(keys)
    assert st["held_blocks"] + st["reserved_blocks"] == kept <= keep_limit(s.alloc.class_for(20_000)) + 4  # + one per racing thread
    assert s.check().ok


def _a_full_slab(s, size: int):
    """An exact class of `size` filled ("f0", "f1", ...): (its info, the slab holding "f0", that slab's keys)."""
    s.declare_size(size)
    info, n = _fill_one_class(s, size)
    h = _slab_of(s, "f0")
    return info, h, [f"f{i}" for i in range(n) if _slab_of(s, f"f{i}") == h]


def _overwrite_claims(s, info, d, off, word) -> None:
    """What a live process's overwrite or delete of digest `d` does first: under the shard lock its entry goes
    (here: removed) and the block at `off` with `word` becomes its claim, which it keeps for its next put of
    the class (no class lock needed to reuse it)."""
    from maru_shm.format.layout import SHARD_LOCK_BASE
    sh = s.index.shard_of(d)
    with s.locks.hold(SHARD_LOCK_BASE + sh):
        s._publisher.claim_for_free(off, word)
        s.index.remove(sh, d)
    s.alloc.kept_blocks.lists.setdefault(info.cid, []).append((off, word))


def _claim_and_reuse_before(s, info, key, call):
    """Wrap `call` (an allocator host method): before it, a live process's overwrite of `key` claims its
    block and keeps it; after it, its next put of the class ("new") reuses the block, publishes it and
    clears its owner, all without the class lock. Returns (wrapper, offset and word of the block)."""
    d = key_digest(key)
    word, off = s.index.find(d)

    def wrapper(*args):
        _overwrite_claims(s, info, d, off, word)
        out = call(*args)
        assert s.put("new", make_value("new", 1, info.block))
        assert s.index.find(key_digest("new")) == (word + 8, off) and s.alloc.metas.owner(s.alloc.meta_off(off)) == 0
        return out
    return wrapper, off, word


def test_a_slab_move_leaves_a_slab_whose_block_was_claimed_while_it_unpublished(open_store, make_value):
    """A slab move checks its slabs, then unpublishes their values under the shard locks. If a live process
    claims one of those blocks in between (its overwrite replaced the entry first) and keeps it for reuse
    without a class lock, freeing the slab would hand that block out twice. The move re-checks after
    unpublishing: the slab stays, the blocks it did unpublish are freed one by one, the claimed one stays
    LIVE and owned, and the process's next put of the class reuses it."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, LOCK_POOL, UNIT_HEAD, U64
    s = open_store("16M")
    size = 20 * KiB
    info, h, victims = _a_full_slab(s, size)
    claimed = victims[0]
    d = key_digest(claimed)
    off, word = s.index.find(d)[1], s.index.find(d)[0]
    real = s.alloc.host.unpublish_many

    def claim_first(halves, offsets, words):  # "another" live process (here: this one) overwrites first
        _overwrite_claims(s, info, d, off, word)
        return real(halves, offsets, words)

    s.alloc.host.unpublish_many = claim_first
    with s.locks.hold(CLASS_LOCK_BASE + info.cid), s.locks.hold(LOCK_POOL):
        s.alloc.mover.evict_slabs([(h, info)])
    s.alloc.host.unpublish_many = real
    assert U32.unpack_from(s.mm, s.geo.slab_entry(h))[0] == UNIT_HEAD, "the slab stays in its class"
    assert U64.unpack_from(s.mm, s.alloc.meta_off(off))[0] == word, "the claimed block is untouched"
    assert all(s.get(k) is None for k in victims)
    assert s.stats()["held_blocks"] == 1 and s.stats()["slab_moves"] == 0
    assert s.check().ok
    assert s.put("new", make_value("new", 1, size))
    assert s._reader.lookup(key_digest("new"))[0] == off, "the next put reuses the kept block"
    assert s.check().ok


def test_a_slab_move_leaves_a_slab_whose_claimed_block_was_reused_before_its_recheck(open_store, make_value):
    """As above, but the claimant gets further before the move re-checks its slabs: it keeps the block,
    reuses it for its next put of the class (no class lock: a kept block is its own), publishes that
    value and clears its owner. The re-check then finds no owned block; only the word, moved on by the
    reuse, shows that the block is not the one the move listed and unpublished. Returning the slab would
    free a published block and reformat its units under its entry (seen with threads sharing one Store:
    `check` reported an entry whose offset was no block start of the new class)."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, LOCK_POOL, UNIT_HEAD, U64
    s = open_store("16M")
    size = 20 * KiB
    info, h, victims = _a_full_slab(s, size)
    real = s.alloc.host.unpublish_many
    s.alloc.host.unpublish_many, off, word = _claim_and_reuse_before(s, info, victims[0], real)
    value = make_value("new", 1, size)
    with s.locks.hold(CLASS_LOCK_BASE + info.cid), s.locks.hold(LOCK_POOL):
        s.alloc.mover.evict_slabs([(h, info)])
    s.alloc.host.unpublish_many = real
    assert U32.unpack_from(s.mm, s.geo.slab_entry(h))[0] == UNIT_HEAD, "the slab stays in its class"
    assert U64.unpack_from(s.mm, s.alloc.meta_off(off))[0] == word + 8, "the reused block is untouched"
    assert s.get("new") == value
    assert all(s.get(k) is None for k in victims)
    assert s.stats()["slab_moves"] == 0
    assert s.check().ok


def test_class_repair_leaves_a_block_claimed_while_it_asked_the_index(open_store, make_value):
    """Class repair picks LIVE blocks without owner, asks the index which are still published, and frees
    the rest. A live process that overwrote one of them meanwhile claimed it (its entry replaced under the
    shard lock before the index was asked) and may reuse it without the class lock: repair reads the owner
    again before freeing, and leaves it used."""
    from maru_shm.format.layout import CLASS_LOCK_BASE, U64
    s = open_store("16M")
    info = s.alloc.class_for(20_000)
    assert s.put("a", make_value("a", 1, 20_000)) and s.put("b", make_value("b", 1, 20_000))
    d = key_digest("a")
    word, off = s.index.find(d)
    real = s.alloc.host.indexed_many

    def claim_first(ask):
        _overwrite_claims(s, info, d, off, word)
        return real(ask)

    s.alloc.host.indexed_many = claim_first
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert s.alloc.repair_class(info.cid) == 0
    s.alloc.host.indexed_many = real
    assert U64.unpack_from(s.mm, s.alloc.meta_off(off))[0] == word, "the claimed block is untouched"
    assert s.check().ok
    assert s.put("c", make_value("c", 1, 20_000))
    assert s._reader.lookup(key_digest("c"))[0] == off, "the next put reuses it"
    assert s.put("e", make_value("e", 1, 20_000)) and s._reader.lookup(key_digest("e"))[0] != off
    assert s.check().ok and s.get("b") == make_value("b", 1, 20_000)


def test_class_repair_leaves_a_claimed_block_reused_before_it_frees(open_store):
    """As above, but the claimant has reused the block, published the new value and cleared its owner
    before repair frees what the index did not name: the owner says nothing then, the word (moved on) does."""
    from maru_shm.format.layout import CLASS_LOCK_BASE
    s = open_store("16M")
    info = s.alloc.class_for(20_000)
    assert s.put("a", make_value("a", 1, 20_000)) and s.put("b", make_value("b", 1, 20_000))
    s.alloc.free_kept()  # the spares of the single-key puts: "new" must reuse the claimed block
    real = s.alloc.host.indexed_many
    s.alloc.host.indexed_many, off, word = _claim_and_reuse_before(s, info, "a", real)
    with s.locks.hold(CLASS_LOCK_BASE + info.cid):
        assert s.alloc.repair_class(info.cid) == 0
    s.alloc.host.indexed_many = real
    assert s.get("new") == make_value("new", 1, info.block)
    assert s.check().ok and s.get("b") == make_value("b", 1, 20_000)


def test_reaping_leaves_a_block_claimed_and_reused_while_it_asked_the_index(open_store):
    """A dead process's LIVE block that the index does not name is freed by the reaper, unless a live process
    claimed it first (its overwrite replaced the entry before the reaper asked the index): then it is that
    process's, which may already have reused it and published the new value, its owner cleared. The reaper
    frees only a block still of the dead slot with the word it read."""
    from maru_shm.format.layout import META_OWNER_OFF, U16
    s = open_store("16M")
    info = s.alloc.class_for(20_000)
    assert s.put("a", make_value("a", 1, 20_000))
    s.alloc.free_kept()
    dead = s._procs.owner + 5  # a slot no process holds: its owner is dead
    assert not s._procs.alive(dead)
    real = s.alloc.host.indexed_many
    wrapper, off, word = _claim_and_reuse_before(s, info, "a", real)
    U16.pack_into(s.mm, s.alloc.meta_off(off) + META_OWNER_OFF, dead)  # it died after publishing, before disowning
    s.alloc.host.indexed_many = wrapper
    assert s.alloc.resolve_owned([off], dead) == 0
    s.alloc.host.indexed_many = real
    assert s.get("new") == make_value("new", 1, info.block)
    assert s.check().ok


def test_a_slab_move_cut_short_repairs_the_donor_class(open_store, monkeypatch):
    """Bug: a slab move gave back the donor classes' locks clean even when an exception (KeyboardInterrupt)
    cut their eviction short, so a half-emptied donor slab was never repaired. Their marks now stay, and the
    cut call, as the next holder of every lock it left dirty, repairs the donor class before it raises."""
    from maru_shm.allocator.slabmover import SlabMover
    from maru_shm.format.layout import CLASS_LOCK_BASE, LOCK_RECORD

    s = open_store("4M", timeout=2.0)
    donor, _ = _fill_one_class(s, 16 * KiB)
    taker = s.alloc.class_for(200 * KiB)
    assert taker.cid != donor.cid and not s.alloc.slabs.class_slabs(taker.cid)

    def interrupted(self, slabs):
        raise KeyboardInterrupt("inside the donor's eviction")
    monkeypatch.setattr(SlabMover, "evict_slabs", interrupted)
    repaired = []
    real = s.alloc.repair_class
    monkeypatch.setattr(s.alloc, "repair_class", lambda c: (repaired.append(c), real(c)))
    with pytest.raises(KeyboardInterrupt):
        s.put("large", make_value("large", 1, 200 * KiB))  # the taker has no slab: a donor slab must move
    rec = s.geo.off_locks + (CLASS_LOCK_BASE + donor.cid) * LOCK_RECORD.size
    assert donor.cid in repaired and LOCK_RECORD.unpack_from(s.mm, rec)[0] == 0
    monkeypatch.undo()
    assert s.put("large", make_value("large", 1, 200 * KiB)) and s.get("large") == make_value("large", 1, 200 * KiB)
    assert_clean(s)
