"""Relation records and the doom ring (FORMAT.md section 6a): eviction keeps what can still be a hit.

A chain's page serves only while every page before it is stored; a hybrid request's page only while its
pages in the other pools are. These tests store chains with records and check that what stays is usable,
against the same workload without records (where the plain CLOCK leaves stranded pages behind), and that
damaged records or a damaged doom ring cost nothing but hints.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from maru_shm import RELATION_DTYPE, chain_relations
from maru_shm.allocator.relations import TRAILING, Relations
from maru_shm.index import key_digest

from ...conftest import assert_clean, check_value, make_value

KiB = 1 << 10


def _put_chain(s, name: str, n: int, size: int, relations: bool, group: int, parent: int = 0, branch: int = 0):
    keys = [f"{name}-{i}" for i in range(n)]
    vals = [make_value(k, 1, size) for k in keys]
    rel = chain_relations(n, group, parent, branch) if relations else None
    bufs = [np.frombuffer(v, dtype=np.uint8) for v in vals]
    assert all(s.batch_put_pieces(keys, [[(b.ctypes.data, len(b))] for b in bufs], relations=rel))
    return keys


def _churn(s, relations: bool, chains: int = 120, seed: int = 3, turns: int = 1):
    """Chains of 4..24 pages of 64 KiB, each written in `turns` batches (without records only), and every
    third chain read back whole (the CLOCK's ref counts)."""
    rnd = random.Random(seed)
    stored = []
    for c in range(chains):
        n = rnd.randint(4, 24)
        if turns == 1:
            stored.append(_put_chain(s, f"c{c}", n, 64 * KiB, relations, group=c + 1))
        else:
            assert not relations
            keys = [f"c{c}-{i}" for i in range(n)]
            for t in range(turns):
                part = keys[t * n // turns:(t + 1) * n // turns]
                assert all(s.batch_put(part, [make_value(k, 1, 64 * KiB) for k in part]))
            stored.append(keys)
        if c % 3 == 0:
            old = stored[rnd.randrange(len(stored))]
            s.batch_get_into(old, [bytearray(64 * KiB) for _ in old])
    live = usable = 0
    for keys in stored:
        live += sum(s.batch_exists(keys))
        usable += s.leading_hits(keys)
    return live, usable


def test_chains_with_records_keep_only_usable_pages(open_store):
    s = open_store("32M")
    live, usable = _churn(s, relations=True)
    assert s.stats()["evictions"] > 0
    assert live > 0 and usable == live  # nothing stranded: every page left is part of a leading run
    assert_clean(s)


def test_without_records_the_plain_clock_strands_pages(open_store):
    """The same workload without records, each chain written in two batches as a conversation grows: the
    CLOCK evicts heads under their tails, stranding them."""
    s = open_store("32M")
    live, usable = _churn(s, relations=False, turns=2)
    assert usable < live


def test_a_partner_page_goes_with_its_request(open_store):
    """Two pools of one request (two classes): a class that evicts a request's page dooms the request, and the
    writer frees its pages in the other class at once (reclaim), so no request is left half stored."""
    s = open_store("32M")
    rnd = random.Random(5)
    reqs = []
    for r in range(150):
        n = rnd.randint(2, 12)
        a = _put_chain(s, f"r{r}a", n, 96 * KiB, True, group=r + 1)
        b = _put_chain(s, f"r{r}b", n, 20 * KiB, True, group=r + 1)
        reqs.append((a, b))
    assert s.stats()["evictions"] > 0
    for a, b in reqs:
        la, lb = s.leading_hits(a), s.leading_hits(b)
        assert la == lb == sum(s.batch_exists(a)) == sum(s.batch_exists(b)), (la, lb)
    assert_clean(s)


def test_a_class_searched_whole_is_searched_again_only_after_a_doom(open_store, pool_path):
    """A stranded search that took everything it found is not repeated until some process pushes a doom;
    then only the newer dooms are matched, and what they strand is found."""
    s = open_store("32M")
    other = open_store(path=pool_path, create=False)
    keys = _put_chain(s, "c", 6, 64 * KiB, True, group=7)
    _put_chain(s, "d", 6, 64 * KiB, True, group=8)
    alloc = s.att.alloc
    info = alloc.head_of(s.reader.lookup(key_digest(keys[0])).offset)[1]
    searches = []
    search = alloc.clock._stranded_in
    alloc.clock._stranded_in = lambda *a: searches.append(a[3]) or search(*a)

    def reclaim():
        with alloc.locks.class_lock(info.cid):
            return alloc.clock.evict_blocks(info, 1 << 20, stranded_only=True)
    other.doom_segment(99)  # a doom of no stored segment: the search finds nothing
    assert reclaim() == 0 and searches == [None]
    assert reclaim() == 0 and searches == [None]  # no doom since: not searched again
    other.doom_segment(7)
    assert reclaim() == 6 and len(searches) == 2 and searches[1] is not None
    assert s.batch_exists(keys) == [False] * 6 and s.batch_exists([f"d-{i}" for i in range(6)]) == [True] * 6
    assert_clean(s)


def test_one_reclaim_frees_a_doomed_segment_and_all_its_descendants(open_store):
    """A conversation stored turn by turn is a chain of segments. Dooming its first turn strands the second;
    freeing the second dooms the third, and so on: one reclaim follows the chain to its end (each round
    matches the dooms the last one pushed), and spares a turn that branched off before the doomed page."""
    s = open_store("32M")
    turns = [_put_chain(s, "t0", 6, 64 * KiB, True, group=1)]
    for t in range(1, 6):
        turns.append(_put_chain(s, f"t{t}", 3, 64 * KiB, True, group=t + 1, parent=t, branch=2 if t > 1 else 5))
    early = _put_chain(s, "early", 3, 64 * KiB, True, group=50, parent=1, branch=1)  # branches off at page 1
    other = _put_chain(s, "other", 4, 64 * KiB, True, group=60)
    alloc = s.att.alloc
    info = alloc.head_of(s.reader.lookup(key_digest(turns[0][0])).offset)[1]
    rows, valid = alloc.relations.of(*_records_at(s, turns[0][4:5]))
    assert valid.all()
    alloc.relations.doom(rows, np.zeros(1, dtype=bool))  # page 4 of the first turn was evicted
    assert alloc.reclaim_stranded() == 2 + 5 * 3
    assert s.batch_exists(turns[0]) == [True] * 4 + [False] * 2
    assert not any(any(s.batch_exists(t)) for t in turns[1:])
    assert s.batch_exists(early) == [True] * 3 and s.batch_exists(other) == [True] * 4
    assert alloc.relations.in_class(info.cid)
    assert_clean(s)


def _records_at(s, keys):
    """(granules, LIVE words) of the blocks holding these keys: what `Relations.of` reads."""
    found = [s.reader.lookup(key_digest(k)) for k in keys]
    g = np.array([f.offset >> s.att.alloc.relations.shift for f in found], dtype=np.int64)
    return g, s.att.alloc.metas.meta_q[g][:, 0]


def test_only_a_class_written_with_records_is_searched_whole(open_store):
    """A class no value with a record went into (MaruStorage's namespace record: 4 KiB, none) is skipped by
    the whole-class searches for stranded values; a put with records marks its class (`related`, FORMAT.md
    section 4) before writing them, and from then on the class is searched and what a doom strands is found."""
    from maru_shm.format import CLS_RELATED, U32
    s = open_store("32M")
    plain = [f"p-{i}" for i in range(4)]
    for k in plain:
        assert s.put(k, make_value(k, 1, 64 * KiB))
    alloc = s.att.alloc
    info = alloc.head_of(s.reader.lookup(key_digest(plain[0])).offset)[1]
    related = lambda: U32.unpack_from(s.mm, s.geo.class_entry(info.cid) + CLS_RELATED)[0]  # noqa: E731
    searched = []
    search = alloc.clock._stranded_in
    alloc.clock._stranded_in = lambda *a: searched.append(a[0].cid) or search(*a)
    s.doom_segment(5)
    assert related() == 0 and not alloc.relations.in_class(info.cid)
    assert alloc.reclaim_stranded() == 0 and info.cid not in searched
    keys = _put_chain(s, "c", 6, 64 * KiB, True, group=5)  # same class, with records: marked
    assert related() == 1 and alloc.relations.in_class(info.cid)
    s.doom_segment(5)
    assert alloc.reclaim_stranded() == 6 and info.cid in searched
    assert s.batch_exists(keys) == [False] * 6 and s.batch_exists(plain) == [True] * 4
    assert_clean(s)


@contextlib.contextmanager
def _scratch_relations(n_granules: int = 8):
    """Relations over a scratch buffer: n_granules records, a doom ring, no class table, no superblock."""
    class Geo:
        has_relations, granule, data_bytes = True, 4096, n_granules * 4096
        off_relations, off_dooms = 0, n_granules * 16
        class_cap, off_classes = 0, 0
    Geo.n_granules = n_granules
    buf = bytearray(n_granules * 16 + 4096 * 8 + 4096)
    import maru_shm.allocator.relations as R
    cursor_off = R.DOOM_CURSOR_OFF
    R.DOOM_CURSOR_OFF = len(buf) - 8  # the cursor at the buffer's end
    try:
        yield Relations(memoryview(buf), Geo)
    finally:
        R.DOOM_CURSOR_OFF = cursor_off


def test_stranded_rules():
    """The rule of section 6a on a scratch ring: group dooms at or below the depth, parent dooms at or below the
    branch point, only dooms pushed at or after the record's birth, TRAILING dooms the whole segment."""
    with _scratch_relations() as rel:
        rows = chain_relations(4, group=7, parent=9, branch=5)
        rows["born"] = 0
        valid = np.ones(4, dtype=bool)
        assert not any(rel.stranded(rows, valid)[0])
        rel.doom(chain_relations(1, 7, positions=[2]), np.zeros(1, dtype=bool))  # group 7 from 2
        g, p = rel.stranded(rows, valid)
        assert g.tolist() == [False, False, True, True] and not p.any()
        later = rows.copy()
        later["born"] = rel.cursor()  # written after that doom: not stranded by it
        assert not rel.stranded(later, valid)[0].any()
        rel.doom(chain_relations(1, 9, positions=[6]), np.zeros(1, dtype=bool))  # parent from 6 > branch 5
        assert not rel.stranded(rows, valid)[1].any()
        rel.doom(chain_relations(1, 9, positions=[5]), np.zeros(1, dtype=bool))  # parent from 5 = branch
        assert rel.stranded(rows, valid)[1].all()
        t = chain_relations(1, 11, positions=[3], trailing=True)
        assert int(t["depth"][0]) & TRAILING
        rel.doom(t, np.zeros(1, dtype=bool))  # a trailing page dooms its segment from 0
        g, _ = rel.stranded(chain_relations(3, 11), np.ones(3, dtype=bool))
        assert g.all()


@pytest.mark.parametrize("scalar", [True, False])
def test_record_of_reads_only_the_dooms_since_birth_and_agrees_with_the_whole_ring(scalar, monkeypatch):
    """`record_of` checks a record against the dooms pushed since its birth (in Python when they are few, with
    numpy when many): the same answer as the rule over the whole ring, for records born before, between and
    after dooms, with few, many and more than a ring of dooms since, over a 16-bit cursor wrap."""
    import maru_shm.allocator.relations as R
    monkeypatch.setattr(R, "SCALAR_DOOMS", R.SCALAR_DOOMS if scalar else -1)
    rnd = np.random.default_rng(7)
    with _scratch_relations(64) as rel:
        R.U32.pack_into(rel.mm, R.DOOM_CURSOR_OFF, 0xFFFF_FF00 if scalar else 0xFFF0)  # wraps below
        checked = stranded = 0
        for burst in (0, 3, 40, 300, 5000, 12):
            for _ in range(burst):
                rel.doom(chain_relations(1, int(rnd.integers(1, 24)), positions=[int(rnd.integers(0, 6))]),
                         np.zeros(1, dtype=bool))
            g = rnd.choice(64, 8, replace=False)  # records written now, born at the cursor
            rows = chain_relations(8, 0, positions=rnd.integers(0, 6, 8))
            rows["group"], rows["parent"] = rnd.integers(1, 24, 8), rnd.integers(0, 24, 8)
            rows["branch"] = rnd.integers(0, 6, 8)
            rel.write((g * 4096).tolist(), np.arange(8, dtype=np.uint64) + 100, rows)
            for gi in rnd.permutation(64).tolist():
                recs, valid = rel.of(np.array([gi]), rel.records["tag"][[gi]].astype(np.uint64))
                if not valid[0]:
                    continue
                whole = any(x[0] for x in rel.stranded(recs, valid))
                got = rel.record_of(gi * 4096, int(recs["tag"][0]))
                assert (got is None) == whole, (burst, gi)
                assert got is None or got == (int(recs["group"][0]), int(recs["depth"][0]) & R.DEPTH_MAX)
                checked += 1
                stranded += whole
        assert checked > 100 and 0 < stranded < checked


def test_named_finds_exactly_the_records_a_doom_names(open_store):
    """The whole-class search's first cut (`named`, which reads each record's group and parent as one word)
    marks exactly the records whose group or parent a doom pushed since `since` names: with a few new dooms
    (compared one by one) and with many (np.isin), against the same rule on the structured records."""
    from maru_shm.allocator.relations import NAMED_LOOP
    s = open_store("16M")
    rel = s.att.alloc.relations
    rnd = np.random.default_rng(4)
    g = rnd.choice(s.geo.n_granules, 3000, replace=False)
    rel.records["group"][g] = rnd.integers(1, 40, len(g))
    rel.records["parent"][g] = rnd.integers(0, 40, len(g))
    for new in (1, NAMED_LOOP, NAMED_LOOP + 5, 30):
        since = rel.cursor()
        for group in rnd.choice(np.arange(1, 40), new, replace=False).tolist():
            s.doom_segment(group)
        doomed = rel.ring["group"][np.arange(since, rel.cursor()) % len(rel.ring)]
        rows = rel.records[g]
        want = np.isin(rows["group"], doomed) | np.isin(rows["parent"], doomed)
        assert want.any() and (rel.named(g, since) == want).all(), new


def test_damaged_records_and_ring_cost_hints_never_bytes(open_store):
    """Random bytes over every relation record and the doom ring, then more churn: every value read is its
    own, every put succeeds, the pool checks clean."""
    s = open_store("32M")
    _churn(s, relations=True, chains=40)
    geo = s.geo
    rnd = np.random.default_rng(11)
    span = geo.off_dooms + 4096 * 8 - geo.off_relations
    s.att.mm[geo.off_relations:geo.off_relations + span] = rnd.integers(0, 256, span, dtype=np.uint8).tobytes()
    rng = random.Random(2)
    stored = []
    for c in range(60):
        stored += _put_chain(s, f"d{c}", rng.randint(4, 24), 64 * KiB, True, group=rng.randrange(1, 50))
    for k in stored[-200:]:
        v = s.get(k)
        assert v is None or check_value(k, v)
    assert_clean(s)


def test_a_relation_record_names_its_lifetime(open_store):
    s = open_store("16M")
    keys = _put_chain(s, "x", 3, 8 * KiB, True, group=42)
    assert s.relation_of(key_digest(keys[2])) == (42, 2)
    assert s.put(keys[2], make_value(keys[2], 2, 8 * KiB))  # a new lifetime, stored without a record
    assert s.relation_of(key_digest(keys[2])) == (0, 0)
    assert s.relation_of(key_digest("absent")) is None
    assert RELATION_DTYPE.itemsize == 16
    s.doom_segment(42)
    assert s.relation_of(key_digest(keys[1])) is None  # stranded: nothing continuing it can be a hit
    assert s.relation_of(key_digest(keys[2])) == (0, 0)  # the new lifetime has no record the doom could strand


def test_a_pool_made_without_relations_still_works(open_store):
    """A pool whose header lacks FLAG_RELATIONS (made by an earlier version) keeps its layout; records are
    ignored and eviction is the plain CLOCK."""
    from maru_shm.format import Geometry
    from maru_shm import poolfile
    plan = Geometry.plan
    orig = poolfile.Geometry.plan
    poolfile.Geometry.plan = staticmethod(lambda size, **kw: plan(size, **dict(kw, flags=kw.get("flags", 0) & ~2)))
    try:
        s = open_store("16M")
    finally:
        poolfile.Geometry.plan = orig
    assert not s.geo.has_relations and s.geo.off_relations == 0
    for c in range(40):
        _put_chain(s, f"o{c}", 8, 64 * KiB, True, group=c + 1)
    assert s.stats()["evictions"] > 0
    assert s.relation_of(key_digest("o39-0")) == (0, 0)
    assert_clean(s)


def test_a_class_larger_than_one_search_is_searched_in_windows(open_store, monkeypatch):
    """A class of more blocks than one search reads (STRANDED_SCAN) is searched a window of slabs at a time,
    each search going on after the last: the segments a doom strands in every slab are all freed after
    one lap, and a lap that took everything it found is not repeated until a new doom."""
    from maru_shm.allocator import blockclock
    s = open_store("32M")
    alloc = s.att.alloc
    turns = [_put_chain(s, f"t{t}", 8, 64 * KiB, True, group=t + 1, parent=t, branch=7) for t in range(40)]
    info = alloc.head_of(s.reader.lookup(key_digest(turns[0][0])).offset)[1]
    nslabs = len(alloc.class_slabs(info.cid))
    assert nslabs >= 4 and s.stats()["evictions"] == 0
    monkeypatch.setattr(blockclock, "STRANDED_SCAN", info.bps)  # one slab a search
    windows = []
    search = alloc.clock._stranded_in
    alloc.clock._stranded_in = lambda *a: windows.append((int(a[4][0]), len(a[4]))) or search(*a)
    rows, valid = alloc.relations.of(*_records_at(s, turns[0][7:8]))
    alloc.relations.doom(rows, np.zeros(1, dtype=bool))  # the first turn's last page was evicted

    def reclaim():
        with alloc.locks.class_lock(info.cid):
            return alloc.clock.evict_blocks(info, 1 << 20, stranded_only=True)
    freed = [reclaim() for _ in range(nslabs)]
    assert windows == [(j * info.bps, info.bps) for j in range(nslabs)]  # one slab each, in order, once
    assert sum(freed) == 1 + 39 * 8 and 0 < freed[0] < sum(freed)  # every turn after the doomed page
    assert s.batch_exists(turns[0]) == [True] * 7 + [False]
    assert not any(any(s.batch_exists(t)) for t in turns[1:])
    # Freeing stranded values dooms their segments: one more lap, which finds nothing and dooms nothing.
    assert [reclaim() for _ in range(nslabs)] == [0] * nslabs and len(windows) == 2 * nslabs
    assert reclaim() == 0 and len(windows) == 2 * nslabs  # no search until a new doom
    s.doom_segment(12345)
    assert reclaim() == 0 and windows[-1] == (0, info.bps)  # a new lap, from the first slab
    assert_clean(s)


def test_a_window_that_fills_the_request_is_searched_again(open_store, monkeypatch):
    """A search asked for m values that finds m in its window stays on that window (more may be there); it
    goes on to the next window only after one that yielded fewer than asked."""
    from maru_shm.allocator import blockclock
    s = open_store("32M")
    alloc = s.att.alloc
    keys = _put_chain(s, "w", 40, 64 * KiB, True, group=3)
    info = alloc.head_of(s.reader.lookup(key_digest(keys[0])).offset)[1]
    monkeypatch.setattr(blockclock, "STRANDED_SCAN", info.bps)
    s.doom_segment(3)
    windows = []
    search = alloc.clock._stranded_in
    alloc.clock._stranded_in = lambda *a: windows.append(int(a[4][0])) or search(*a)
    got = []
    with alloc.locks.class_lock(info.cid):
        for _ in range(200):
            got.append(alloc.clock.evict_blocks(info, 1, stranded_only=True))
            if len(windows) < len(got):
                break  # not searched: a lap took all it found and no doom came since
    assert sum(got) == 40 and not any(s.batch_exists(keys))
    for i in range(len(windows) - 1):
        assert (windows[i + 1] == windows[i]) == (got[i] == 1), (i, windows, got)
    assert_clean(s)


def test_the_clock_takes_a_segment_together_tail_first(open_store):
    """Among unreferenced values in one chunk of the hand, a segment's pages go together, deepest first (the
    plain CLOCK would take each chain's head first, in ring order)."""
    s = open_store("32M")
    alloc = s.att.alloc
    a = _put_chain(s, "a", 4, 64 * KiB, True, group=10)
    b = _put_chain(s, "b", 4, 64 * KiB, True, group=20)
    info = alloc.head_of(s.reader.lookup(key_digest(a[0])).offset)[1]
    alloc.metas.meta_refs[:] = 0  # every value unreferenced: the order alone decides

    def evict(m):
        with alloc.locks.class_lock(info.cid):
            return alloc.clock.evict_blocks(info, m)
    assert evict(2) == 2
    lost = [chain for chain in (a, b) if not all(s.batch_exists(chain))]
    assert len(lost) == 1 and s.batch_exists(lost[0]) == [True, True, False, False]  # one segment, its tail
    assert_clean(s)
