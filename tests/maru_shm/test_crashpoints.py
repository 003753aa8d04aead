"""Deterministic crash points (maru_shm/crashpoints.py): one test per point.

Each test builds a pool and puts known values from the test process, then runs a *separate Python
process* with MARU_SHM_CRASH_AT=<point> that opens the same pool and performs the operation that
reaches the point. The child must die by SIGKILL (returncode -9): that proves the point was reached
(a child that gets through its operation prints "survived" and exits 0). Then the test process opens
the pool again, as the next process would, and asserts:

- every value put before the crash reads back byte for byte (except what the operation itself
  legitimately removed or replaced, and, in the eviction tests, what eviction legitimately dropped:
  there the exact number of victims at the crash is asserted and every survivor must verify);
- after operations that take the locks the child held (puts and deletes in every index shard, puts
  in the classes involved, a put that formats a new slab under POOL), every lock record is clean:
  each dirty lock was repaired by its next acquirer;
- `check()` (without repair) is clean: the *natural* repairs (reaping at attach, dirty-lock domain
  repair) suffice everywhere; no test needs `check(repair=True)`;
- no block is leaked: every block that is not FREE is LIVE and named by its index entry, with no
  owner (the test process has nothing in flight), and the stats agree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from maru_shm import NotAPoolError, SizeMismatchError, Store, StoreError, crashpoints
from maru_shm.mapping import creation
from maru_shm.format.layout import FREE, LIVE, LOCK_IDS, LOCK_RECORD, META_STRUCT, U64, UNIT_HEAD
from maru_shm.index import Index, key_digest
from maru_shm.locking.lockfile import lock_file_path
from maru_shm.locking.locks import lock_name

from ..conftest import make_value

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE = 5000          # the seeded values' class (5312-byte blocks, 49 per 256 KiB slab)
FRESH_SIZE = 100_000  # a class no test uses otherwise: putting one formats a new slab under POOL
BIG = 65536          # eviction tests: 4 blocks per one-unit slab
HALF = 32768         # eviction tests: another one-unit class (8 blocks per slab)
WIDE = 150_000       # 155904-byte blocks: 3-unit slabs of 5 blocks (some blocks start in a TAIL unit)

_PRELUDE = """
import ctypes, os, sys
from maru_shm import Store
from maru_shm.index import key_digest
from tests.conftest import make_value
path = sys.argv[1]
"""


# ---------------------------------------------------------------- helpers

def run_child(pool_path: str, point: str, body: str, *, timeout: float = 60) -> None:
    """Run `body` in a new Python process with MARU_SHM_CRASH_AT=point; it must die by SIGKILL."""
    env = dict(os.environ, MARU_SHM_CRASH_AT=point)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    script = _PRELUDE + textwrap.dedent(body) + '\nprint("survived", flush=True)\n'
    p = subprocess.run([sys.executable, "-c", script, pool_path], env=env, cwd=ROOT,
                       capture_output=True, timeout=timeout)
    assert p.returncode == -signal.SIGKILL, (
        f"the child did not die at {point} (returncode {p.returncode}):\n"
        f"{p.stdout.decode()}\n{p.stderr.decode()[-3000:]}")


def raw_entry(pool_path: str, key) -> tuple[int, int, int]:
    """(entry word, entry offset, word of the block at that offset), read without attaching."""
    from maru_shm.checks.view import PoolView
    v = PoolView.open(pool_path)
    try:
        idx = Index(v.mm, v.geo)
        word, offset = idx.find(key_digest(key))
        (block_word,) = U64.unpack_from(v.mm, v.geo.off_blockmeta + offset // v.geo.granule * 32)
        del idx
        return word, offset, block_word
    finally:
        v.close()


def key_in_shard(s: Store, shard: int, tag: str) -> str:
    i = 0
    while True:
        k = f"{tag}-{shard}-{i}"
        if s.index.shard_of(key_digest(k)) == shard:
            return k
        i += 1


def seed(s: Store, n: int = 20, size: int = SIZE, tag: str = "seed") -> dict:
    values = {f"{tag}{i}": make_value(f"{tag}{i}", 1, size) for i in range(n)}
    for k, v in values.items():
        assert s.put(k, v)
    return values


def new_pool(pool_path: str, size: str = "8M", n: int = 20, **kw) -> dict:
    with Store.open(pool_path, size, create=True, **kw) as s:
        return seed(s, n)


def dirty_locks(s: Store) -> list[str]:
    out = []
    for lock_id in range(LOCK_IDS):
        holder, _ = LOCK_RECORD.unpack_from(s.mm, s.geo.off_locks + lock_id * LOCK_RECORD.size)
        if holder:
            out.append(lock_name(lock_id))
    return out


def leaked_blocks(s: Store) -> list[str]:
    """Blocks that are not FREE but are not a published, unowned LIVE value (nothing is in flight), other
    than the blocks `s` itself keeps for its next puts (kept.py: spares and old blocks, owned by `s`)."""
    a, g = s.alloc, s.geo
    ours = {off for items in a.kept_blocks.lists.values() for off, _ in items}
    out = []
    for h in [int(u) for u in (a.states == UNIT_HEAD).nonzero()[0]]:
        info = a.classes[int(a.clsfield[h])]
        for i in range(info.bps):
            off = h * g.unit_size + i * info.block
            word, d, length, owner, _, _ = META_STRUCT.unpack_from(s.mm, a.meta_off(off))
            if word & 3 == FREE or (off in ours and owner == s.slot + 1):
                continue
            if word & 3 != LIVE or s.index.find(d) != (word, off) or owner:
                out.append(f"block {off}: state {word & 3}, owner {owner}, indexed "
                           f"{s.index.find(d) == (word, off)}")
    return out


def exercise(s: Store, sizes=(SIZE,), fresh: bool = True) -> dict:
    """Take the locks a dead process may have left dirty: a put and a delete in every index shard,
    a put in each class of `sizes`, and (fresh) a put that formats a new slab under POOL."""
    added = {}
    for shard in range(s.geo.index_shards):
        k = key_in_shard(s, shard, "ex")
        added[k] = make_value(k, 7, SIZE)
        gone = key_in_shard(s, shard, "exdel")
        assert s.put(gone, make_value(gone, 7, SIZE))
        assert s.delete(gone)
    for n in sizes:
        added[f"ex-size-{n}"] = make_value(f"ex-size-{n}", 7, n)
    if fresh:
        added["ex-fresh"] = make_value("ex-fresh", 7, FRESH_SIZE)
    for k, v in added.items():
        assert s.put(k, v), k
    return added


def verify(s: Store, expected: dict, missing=()) -> None:
    bad = [k for k, v in expected.items() if s.get(k) != v]
    assert not bad, f"values lost or wrong after the crash: {bad}"
    back = [k for k in missing if s.get(k) is not None]
    assert not back, f"values that should be gone are readable: {back}"


def assert_recovered(s: Store, expected: dict) -> None:
    """The final state: values verify, no dirty lock, no leak, check() clean without repair."""
    verify(s, expected)
    assert dirty_locks(s) == [], "a lock the dead process held was never repaired"
    assert leaked_blocks(s) == []
    report = s.check()  # no repair: the natural repairs must have done everything
    assert report.ok, report.problems
    st = s.stats()
    assert st["processes"] == 1, "the dead process's slot was not reaped"
    assert st["live_blocks"] == st["entries"]


def recover(pool_path: str, expected: dict, missing=(), sizes=(SIZE,), fresh: bool = True) -> None:
    """Open the pool as the next process (attaching reaps the dead one), verify, exercise, verify."""
    with Store.open(pool_path) as s:
        verify(s, expected, missing)
        expected = dict(expected, **exercise(s, sizes, fresh))
        assert_recovered(s, expected)


# ---------------------------------------------------------------- every point has a test

ALL_POINTS = [
    "put.after_alloc", "alloc.mid_reuse", "put.mid_copy", "put.before_index", "index.mid_insert", "index.mid_replace",
    "put.before_disown", "put.before_free", "delete.before_free", "index.mid_shift", "evict.mid", "evict.block_mid",
    "slab.mid_move", "slab.mid_format", "slab.mid_free", "reap.mid", "classtab.mid_declare", "create.lock_file",
    "init.mid_header", "create.before_publish", "create.published", "lock.held.INIT", "lock.held.PROC", "lock.held.CLASSTAB", "lock.held.POOL", "lock.held.CLASS",
    "lock.held.SHARD", "lock.held.SLOT",
]


def test_every_point_is_tested_here():
    assert sorted(ALL_POINTS) == sorted(crashpoints.POINTS)
    here = open(__file__).read()
    for p in ALL_POINTS:
        assert f"def test_{p.replace('.', '_')}" in here, p


def test_parse():
    assert crashpoints.parse("put.mid_copy") == ("put.mid_copy", 1)
    assert crashpoints.parse("lock.held.PROC:2") == ("lock.held.PROC", 2)
    for bad in ("nope", "put.mid_copy:0", "put.mid_copy:x", "lock.held.proc"):
        with pytest.raises(ValueError):
            crashpoints.parse(bad)


def test_unset_means_unarmed():
    assert os.environ.get(crashpoints.ENV) is None and crashpoints.ARMED is None


def test_a_bad_point_name_fails_loudly(pool_path):
    env = dict(os.environ, MARU_SHM_CRASH_AT="put.typo", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", "import maru_shm"], env=env, capture_output=True)
    assert p.returncode == 1 and b"unknown crash point" in p.stderr


def test_the_count_selects_the_nth_hit(pool_path):
    """put.mid_copy:3 with two-piece puts: the first put completes, the second dies half copied."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.mid_copy:3", """
        s = Store.open(path)
        for k in ("n1", "n2"):
            v = make_value(k, 1, 5000)
            buf = ctypes.create_string_buffer(v, len(v))
            a = ctypes.addressof(buf)
            assert s.put_pieces(k, [(a, 2500), (a + 2500, 2500)])
    """)
    expected["n1"] = make_value("n1", 1, 5000)
    recover(pool_path, expected, missing=["n2"])


# ---------------------------------------------------------------- the write path

def test_put_after_alloc(pool_path):
    """RESERVED blocks owned by the dead process: reaping at attach frees them."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.after_alloc", """
        s = Store.open(path)
        s.batch_put(["new1", "seed0"], [make_value("new1", 1, 5000), make_value("seed0", 2, 5000)])
    """)
    recover(pool_path, expected, missing=["new1"])  # seed0 keeps version 1


def test_put_after_alloc_of_a_single_key_leaves_its_spares_to_reaping(pool_path):
    """A single-key put reserves spares beside its block (kept.py) and dies: the block and the spares are
    RESERVED blocks of the dead process, and reaping at attach frees them all."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.after_alloc", """
        s = Store.open(path)
        s.put("new1", make_value("new1", 1, 3000))
    """)
    from maru_shm.checks.view import PoolView
    from maru_shm.checks.figures import pool_stats
    v = PoolView.open(pool_path)
    try:
        assert pool_stats(v)["reserved_blocks"] == 1 + 16  # its block and spare_limit spares (3 KiB blocks)
    finally:
        v.close()
    with Store.open(pool_path) as s:
        assert s.stats()["reserved_blocks"] == 0  # reaped at attach: the dead put's block and its spares
    recover(pool_path, expected, missing=["new1"], sizes=(SIZE, 3000))


def test_alloc_mid_reuse(pool_path):
    """An overwrite keeps its old block; the next put of the class reuses it without a lock and dies with its
    word RESERVED but digest and length still the old value's. Readers never take a RESERVED block, the
    reused key keeps its old value, and reaping frees the block (RESERVED, owned by the dead process)."""
    expected = new_pool(pool_path)
    run_child(pool_path, "alloc.mid_reuse", """
        s = Store.open(path)
        assert s.put("seed1", make_value("seed1", 2, 5000))  # the old block of seed1 is kept
        s.put("seed2", make_value("seed2", 2, 5000))  # reuses it: dies mid reuse
    """)
    expected["seed1"] = make_value("seed1", 2, 5000)
    recover(pool_path, expected)  # seed2 keeps version 1


def test_put_mid_copy(pool_path):
    """An overwrite dies half copied into its RESERVED block: the old value stays, the block is reaped."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.mid_copy", """
        s = Store.open(path)
        v = make_value("seed1", 2, 5000)
        buf = ctypes.create_string_buffer(v, len(v))
        a = ctypes.addressof(buf)
        s.put_pieces("seed1", [(a, 2500), (a + 2500, 2500)])
    """)
    recover(pool_path, expected)


def test_put_before_index(pool_path):
    """Committed (LIVE) but unpublished blocks of the dead process: reaping frees them (not indexed)."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.before_index", """
        s = Store.open(path)
        s.batch_put(["new1", "seed2"], [make_value("new1", 1, 5000), make_value("seed2", 2, 5000)])
    """)
    recover(pool_path, expected, missing=["new1"])


def test_index_mid_insert(pool_path):
    """Dies under SHARD after publishing a new entry, before the count: shard repair recounts,
    reaping clears the dead owner of the published block (it stays)."""
    expected = new_pool(pool_path)
    run_child(pool_path, "index.mid_insert", """
        s = Store.open(path)
        s.put("new1", make_value("new1", 1, 5000))
    """)
    expected["new1"] = make_value("new1", 1, 5000)
    recover(pool_path, expected)


def test_index_mid_replace(pool_path):
    """Dies under SHARD with a torn overwrite (new offset, old word) in the entry. Shard repair
    restores the entry to the new block, still owned by the dead publisher; the old block, which
    the publisher had claimed, is reaped. The key is not lost."""
    expected = new_pool(pool_path)
    with Store.open(pool_path) as s:
        # Overwrite once here: the child's new block is then the freed first block, whose word differs
        # from the current block's (block words count per granule: two first lifetimes look alike,
        # and the torn entry would validate by coincidence).
        expected["seed3"] = make_value("seed3", 2, SIZE)
        assert s.put("seed3", expected["seed3"])
    run_child(pool_path, "index.mid_replace", """
        s = Store.open(path)
        s.put("seed3", make_value("seed3", 3, 5000))
    """)
    word, offset, block_word = raw_entry(pool_path, "seed3")
    assert word != block_word, "the crash should have left a torn entry (new offset, old word)"
    expected["seed3"] = make_value("seed3", 3, SIZE)
    recover(pool_path, expected)


def test_put_before_disown(pool_path):
    """Dies under SHARD after an overwrite is published, before clearing its owner: the new value
    stays (owner cleared by reaping), the replaced block (claimed by the dead process) is reaped."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.before_disown", """
        s = Store.open(path)
        s.put("seed4", make_value("seed4", 2, 5000))
    """)
    expected["seed4"] = make_value("seed4", 2, 5000)
    recover(pool_path, expected)


def test_put_before_free(pool_path):
    """Dies after publishing an overwrite, before freeing the old block: reaping frees it."""
    expected = new_pool(pool_path)
    run_child(pool_path, "put.before_free", """
        s = Store.open(path)
        s.put("seed5", make_value("seed5", 2, 5000))
    """)
    expected["seed5"] = make_value("seed5", 2, 5000)
    recover(pool_path, expected)


def test_delete_before_free(pool_path):
    """Dies after unpublishing a deleted key, before freeing its block (owned by it): reaping frees it."""
    expected = new_pool(pool_path)
    run_child(pool_path, "delete.before_free", """
        s = Store.open(path)
        s.delete("seed6")
    """)
    del expected["seed6"]
    recover(pool_path, expected, missing=["seed6"])


def colliding_keys(s: Store, n: int = 3) -> list[str]:
    """n keys with the same shard and the same home slot (so they sit in one probe cluster)."""
    seen: dict[tuple[int, int], list[str]] = {}
    i = 0
    while True:
        k = f"col{i}"
        d = key_digest(k)
        group = seen.setdefault((s.index.shard_of(d), s.index.home_of(d)), [])
        group.append(k)
        if len(group) == n:
            return group
        i += 1


def test_index_mid_shift(pool_path):
    """Deleting the head of a probe cluster dies after moving the next entry into the hole: the entry
    is duplicated. Shard repair dedupes; every key of the cluster is still reachable."""
    with Store.open(pool_path, "8M", create=True) as s:
        ks = colliding_keys(s)
        expected = {k: make_value(k, 1, SIZE) for k in ks}
        for k in ks:
            assert s.put(k, expected[k])
        expected.update(seed(s))
    run_child(pool_path, "index.mid_shift", f"""
        s = Store.open(path)
        s.delete({ks[0]!r})
    """)
    del expected[ks[0]]
    recover(pool_path, expected, missing=[ks[0]])


# ---------------------------------------------------------------- slabs: eviction, moves, formatting

def full_pool(pool_path: str) -> dict:
    """A 2 MiB pool (7 one-unit slabs) filled exactly with BIG values: the next slab needs eviction."""
    with Store.open(pool_path, "2M", create=True) as s:
        n = s.geo.n_units * (s.geo.unit_size // BIG)
        expected = seed(s, n, BIG, tag="big")
        assert s.alloc.runs.find_free_run(1) is None and s.stats()["evictions"] == 0
        return expected


def survivors(s: Store, expected: dict) -> dict:
    """Keys that still read back; every readable key must verify."""
    got = {k: s.get(k) for k in expected}
    assert all(v is None or v == expected[k] for k, v in got.items()), "a survivor of eviction is wrong"
    return {k: expected[k] for k, v in got.items() if v is not None}


def test_evict_mid(pool_path):
    """Slab CLOCK eviction dies after unpublishing the first block of its victim slab, holding the
    class lock and POOL (a HALF put: its class has no slab, so it takes one from the BIG class). That
    block is an orphan (LIVE, unowned, unindexed): class repair by the next holder of the BIG class
    lock frees it; POOL repair runs for the next put that makes room; survivors verify."""
    expected = full_pool(pool_path)
    run_child(pool_path, "evict.mid", """
        s = Store.open(path)
        s.put("halfnew", make_value("halfnew", 1, 32768))
    """)
    with Store.open(pool_path) as s:
        alive = survivors(s, expected)
        assert len(alive) == len(expected) - 1, "exactly the one unpublished block is gone"
        after = {f"after{i}": make_value(f"after{i}", 1, BIG) for i in range(6)}
        evictions = s.stats()["evictions"]
        assert s.put("after0", after["after0"]) and s.get("after0") == after["after0"]
        assert s.stats()["evictions"] == evictions, "class repair should have freed the orphan for this put"
        assert leaked_blocks(s) == []
        for k, v in list(after.items())[1:]:  # these evict (POOL is taken, and repaired, first)
            assert s.put(k, v) and s.get(k) == v
        assert s.stats()["evictions"] > 0
        halves = {f"half{i}": make_value(f"half{i}", 1, HALF) for i in range(2)}  # the HALF class lock too
        for k, v in halves.items():
            assert s.put(k, v)
        assert_recovered(s, survivors(s, dict(expected, **after, **halves)))


def test_evict_block_mid(pool_path):
    """Eviction within a class (block CLOCK): a batch of 3 BIG values into a pool full of BIG values
    unpublishes 3 victims in one round of shard locks and dies after freeing the first, holding the
    class lock. The other two are orphans (LIVE, unowned, unindexed): class repair by the next holder
    frees them, so the next 3 puts need no eviction; every survivor verifies, nothing leaks."""
    expected = full_pool(pool_path)
    run_child(pool_path, "evict.block_mid", """
        s = Store.open(path)
        keys = ["blk0", "blk1", "blk2"]
        s.batch_put(keys, [make_value(k, 1, 65536) for k in keys])
    """)
    with Store.open(pool_path) as s:
        alive = survivors(s, expected)
        assert len(alive) == len(expected) - 3, "exactly the three victims are gone"
        assert all(s.get(k) is None for k in ("blk0", "blk1", "blk2"))
        assert s.stats()["slab_moves"] == 0
        after = {f"after{i}": make_value(f"after{i}", 1, BIG) for i in range(3)}
        evictions = s.stats()["evictions"]
        assert all(s.batch_put(list(after), list(after.values())))
        assert s.stats()["evictions"] == evictions, "class repair should have freed the two orphans"
        assert leaked_blocks(s) == []
        more = {f"more{i}": make_value(f"more{i}", 1, BIG) for i in range(3)}
        assert all(s.batch_put(list(more), list(more.values())))
        assert s.stats()["evictions"] == evictions + 3 and s.stats()["slab_moves"] == 0
        assert_recovered(s, survivors(s, dict(expected, **after, **more)))


def test_evict_block_mid_batch_path(pool_path):
    """The batch path of eviction within a class (more than 8 victims): 12 BIG values into a pool full of
    BIG values remove 12 entries with Index.remove_many and die after bumping every victim's word to
    FREE, before bitmaps, free counts and the partial list say so. Class repair by the next holder
    rebuilds them from the metas, so the next 12 puts reuse exactly those blocks; nothing leaks."""
    expected = full_pool(pool_path)
    run_child(pool_path, "evict.block_mid", """
        s = Store.open(path)
        keys = [f"blk{i}" for i in range(12)]
        s.batch_put(keys, [make_value(k, 1, 65536) for k in keys])
    """)
    with Store.open(pool_path) as s:
        alive = survivors(s, expected)
        assert len(alive) == len(expected) - 12, "exactly the twelve victims are gone"
        assert s.stats()["slab_moves"] == 0
        after = {f"after{i}": make_value(f"after{i}", 1, BIG) for i in range(12)}
        evictions = s.stats()["evictions"]
        assert all(s.batch_put(list(after), list(after.values())))
        assert s.stats()["evictions"] == evictions, "the freed victims should have been reused, not evicted"
        assert leaked_blocks(s) == []
        assert_recovered(s, survivors(s, dict(expected, **after)))


def test_slab_mid_move(pool_path):
    """A slab of the BIG class is evicted to make room for a HALF slab; the process dies before
    formatting it. Exactly that slab's values are gone; the next HALF put formats the free unit."""
    expected = full_pool(pool_path)
    run_child(pool_path, "slab.mid_move", """
        s = Store.open(path)
        s.put("half", make_value("half", 1, 32768))
    """)
    with Store.open(pool_path) as s:
        alive = survivors(s, expected)
        assert len(alive) == len(expected) - s.geo.unit_size // BIG, "exactly one slab was evicted"
        assert s.get("half") is None
        halves = {f"half{i}": make_value(f"half{i}", 1, HALF) for i in range(4)}
        for k, v in halves.items():
            assert s.put(k, v)
        assert s.stats()["evictions"] == 0, "the freed unit should have been reused, not more evictions"
        assert_recovered(s, dict(alive, **halves))


def test_slab_mid_format(pool_path):
    """Dies right after writing the HEAD of a new 3-unit slab (class of 155904-byte blocks). Every
    block of that slab must be usable by the next process, including blocks that start in its
    second unit, before anyone repairs POOL."""
    expected = new_pool(pool_path)
    run_child(pool_path, "slab.mid_format", """
        s = Store.open(path)
        s.put("wide", make_value("wide", 1, 150000))
    """)
    with Store.open(pool_path) as s:
        verify(s, expected, missing=["wide"])
        wide = {f"wide{i}": make_value(f"wide{i}", 1, WIDE) for i in range(5)}  # fills the slab
        for k, v in wide.items():
            assert s.put(k, v)
        verify(s, wide)  # readable at once, POOL not yet repaired (no put needed a new slab)
        expected.update(wide)
        expected.update(exercise(s))
        assert_recovered(s, expected)


def test_slab_mid_free(pool_path):
    """Eviction of a 3-unit slab dies after its HEAD is FREE, before its TAILs are (a put of another
    3-unit class, 71488-byte blocks: it has no slab, so it takes one from the WIDE class). POOL repair by the next holder clears the
    dangling TAILs, so the next slab reuses those units without evicting more."""
    with Store.open(pool_path, "8M", create=True) as s:
        per_slab = s.alloc.class_for(WIDE).bps
        n = s.geo.n_units // s.alloc.class_for(WIDE).k * per_slab
        expected = seed(s, n, WIDE, tag="wide")
        assert s.alloc.runs.find_free_run(s.alloc.class_for(WIDE).k) is None and s.stats()["evictions"] == 0
    run_child(pool_path, "slab.mid_free", """
        s = Store.open(path)
        s.put("other", make_value("other", 1, 70000))
    """)
    with Store.open(pool_path) as s:
        alive = survivors(s, expected)
        assert len(alive) == len(expected) - per_slab, "exactly one slab was evicted"
        new = {"widenew": make_value("widenew", 2, WIDE)}
        assert s.put("widenew", new["widenew"])
        assert s.stats()["evictions"] == 0, "the evicted slab's units should have been reused"
        new["other"] = make_value("other", 2, 70000)  # takes the dead process's class lock (a slab move)
        assert s.put("other", new["other"])
        assert_recovered(s, survivors(s, dict(alive, **new)))


def test_lock_held_POOL(pool_path):
    """Dies holding its class lock and POOL, about to format a new slab: both repaired by the next holders."""
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.POOL", """
        s = Store.open(path)
        s.put("wide", make_value("wide", 1, 300000))
    """)
    recover(pool_path, expected, missing=["wide"], sizes=(SIZE, 300_000))


# ---------------------------------------------------------------- reaping, classes, creation

def test_reap_mid(pool_path):
    """A reaper dies after settling one block of a dead process (holding that class's lock, the
    dead slot not yet retired). The next process finishes the reaping."""
    expected = new_pool(pool_path)
    # first victim: dies with three committed, unpublished blocks (owned, not indexed)
    run_child(pool_path, "put.before_index", """
        s = Store.open(path)
        s.batch_put(["new1", "new2", "new3"], [make_value(k, 1, 5000) for k in ("new1", "new2", "new3")])
    """)
    # the reaper: attaching reaps the first victim and dies after the first block
    run_child(pool_path, "reap.mid", """
        s = Store.open(path)
    """)
    recover(pool_path, expected, missing=["new1", "new2", "new3"])


def test_classtab_mid_declare(pool_path):
    """Dies holding CLASSTAB with an exact-fit class entry complete but classes_version not bumped."""
    expected = new_pool(pool_path)
    stale = Store.open(pool_path)  # a process that read the class table before the declaration
    try:
        run_child(pool_path, "classtab.mid_declare", """
            s = Store.open(path)
            s.declare_size(12345)
        """)
        with Store.open(pool_path) as s:
            cid = s.declare_size(12345)  # read from the table at open: no CLASSTAB needed
            assert cid >= s.geo.n_geo_classes and s.alloc.classes[cid].block == 12345
            assert stale.declare_size(12345) == cid  # the stale view re-reads under CLASSTAB
    finally:
        stale.close()
    with Store.open(pool_path) as s:
        verify(s, expected)
        cid = s.declare_size(12345)
        assert s.declare_size(23456) != cid  # a new declaration takes (and repairs) CLASSTAB
        exact = {"exact": make_value("exact", 1, 12345)}
        assert s.put("exact", exact["exact"])
        expected.update(exact)
        expected.update(exercise(s))
        assert_recovered(s, expected)


def test_lock_held_CLASSTAB(pool_path):
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.CLASSTAB", """
        s = Store.open(path)
        s.declare_size(12345)
    """)
    with Store.open(pool_path) as s:
        verify(s, expected)
        s.declare_size(12345)
        expected["exact"] = make_value("exact", 1, 12345)
        assert s.put("exact", expected["exact"])
        expected.update(exercise(s))
        assert_recovered(s, expected)


# ---------------------------------------------------------------- creation (FORMAT.md section 2, *Creation*)

def creation_leftovers(pool_path: str) -> list[str]:
    """The named temporary files of creators of `pool_path` (creation.py) still in its directory."""
    folder, name = os.path.split(pool_path)
    return [n for n in os.listdir(folder) if n.startswith(f".{name}.maru-new-")]


BUILDS = pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])


def create_after_a_killed_creator(pool_path: str, point: str, named: bool, *, built: bool) -> None:
    """A creator of an 8 MiB pool dies at `point` before its pool is at the path: there is no pool (an opener
    without create=True is told so), only the lock file and, if it `built` under a temporary name (`named`:
    a file system without unnamed files), that file; the next creator, of another size, makes its own pool
    with that lock file and removes the leftover."""
    run_child(pool_path, point, f"""
        import maru_shm.mapping.creation
        maru_shm.mapping.creation._UNNAMED = {not named}
        Store.open(path, "8M", create=True)
    """)
    assert not os.path.lexists(pool_path)
    assert os.path.exists(lock_file_path(pool_path, False))
    assert bool(creation_leftovers(pool_path)) == (named and built)
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(pool_path, timeout=0.2)
    with Store.open(pool_path, "4M", create=True) as s:
        assert s.created and s.geo.file_size == 4 << 20
        expected = seed(s)
        expected.update(exercise(s))
        assert_recovered(s, expected)
    assert creation_leftovers(pool_path) == []


def test_create_lock_file(pool_path):
    create_after_a_killed_creator(pool_path, "create.lock_file", False, built=False)


@BUILDS
def test_init_mid_header(pool_path, named, monkeypatch):
    """A creator dies half way through writing the header of the pool it builds (unnamed, or named where
    the file system has no unnamed files)."""
    monkeypatch.setattr(creation, "_UNNAMED", not named)  # the next creator's way too
    create_after_a_killed_creator(pool_path, "init.mid_header", named, built=True)


def test_init_mid_header_in_place(pool_path):
    """A creator formatting a file already at the path (here an empty one) dies half way through the header:
    the file is no pool yet; the next create=True formats it (no values can predate a pool's creation)."""
    open(pool_path, "wb").close()
    run_child(pool_path, "init.mid_header", """
        Store.open(path, "8M", create=True)
    """)
    with pytest.raises(NotAPoolError):
        Store.open(pool_path, timeout=0.2)
    with Store.open(pool_path, "8M", create=True) as s:
        expected = seed(s)
        expected.update(exercise(s))
        assert_recovered(s, expected)


@BUILDS
def test_create_before_publish(pool_path, named, monkeypatch):
    monkeypatch.setattr(creation, "_UNNAMED", not named)
    create_after_a_killed_creator(pool_path, "create.before_publish", named, built=True)


def test_lock_held_INIT_creating(pool_path):
    """A creator dies holding INIT before it built anything: the kernel drops INIT with the process."""
    create_after_a_killed_creator(pool_path, "lock.held.INIT", False, built=False)


@BUILDS
def test_create_published(pool_path, named):
    """The creator dies with its pool at the path, INIT still held: the pool is whole, with its lock file."""
    run_child(pool_path, "create.published", f"""
        import maru_shm.mapping.creation
        maru_shm.mapping.creation._UNNAMED = {not named}
        Store.open(path, "8M", create=True)
    """)
    assert creation_leftovers(pool_path) == []
    with pytest.raises(SizeMismatchError):
        Store.open(pool_path, "4M", create=True, timeout=1)
    recover(pool_path, {})


def test_lock_held_INIT(pool_path):
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.INIT", """
        Store.open(path)
    """)
    recover(pool_path, expected)


# ---------------------------------------------------------------- each lock kind held

@pytest.mark.parametrize("nth", [1, 2], ids=["attach", "detach"])
def test_lock_held_PROC(pool_path, nth):
    """N=1: dies attaching (PROC held, no slot yet). N=2: dies detaching (PROC held, its blocks
    settled, its slot not yet retired): its published value stays, the slot is reaped."""
    expected = new_pool(pool_path)
    run_child(pool_path, f"lock.held.PROC:{nth}", """
        s = Store.open(path)
        s.put("new1", make_value("new1", 1, 5000))
        s.close()
    """)
    if nth == 2:
        expected["new1"] = make_value("new1", 1, 5000)
    recover(pool_path, expected, missing=[] if nth == 2 else ["new1"])


def test_lock_held_CLASS(pool_path):
    """Dies holding a class lock, about to reserve: class repair by the next holder."""
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.CLASS", """
        s = Store.open(path)
        s.put("new1", make_value("new1", 1, 5000))
    """)
    recover(pool_path, expected, missing=["new1"])


def test_lock_held_SHARD(pool_path):
    """Dies holding a shard lock with a committed block in hand: shard repair, the block is reaped."""
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.SHARD", """
        s = Store.open(path)
        s.put("seed7", make_value("seed7", 2, 5000))
    """)
    recover(pool_path, expected)


def test_lock_held_SLOT(pool_path):
    """Dies right after claiming a process slot (SLOT and PROC held): the slot is reaped."""
    expected = new_pool(pool_path)
    run_child(pool_path, "lock.held.SLOT", """
        Store.open(path)
    """)
    recover(pool_path, expected)


@pytest.mark.parametrize("n", [3, 40], ids=["scalar", "vector"])
def test_put_before_free_with_a_key_named_twice_in_the_batch(pool_path, n):
    """A batch names one key twice: its first block is published, then replaced by the second and left to
    free. Dying before that free must leave the first block to the reaper (owned by the dead process),
    not disowned as if it were still published: a LIVE, unowned, unindexed block is an orphan that only a
    full repair would ever free."""
    new_pool(pool_path)
    run_child(pool_path, "put.before_free", f"""
        s = Store.open(path)
        keys = ["twice"] + [f"other{{i}}" for i in range({n} - 2)] + ["twice"]
        s.batch_put(keys, [make_value(k, i + 1, 5000) for i, k in enumerate(keys)])
    """)
    with Store.open(pool_path) as s:
        report = s.check()
        assert not any("orphan" in p for p in report.problems), report.problems
