"""Stress: every pytest-xdist worker hammers ONE pool file with a mixed workload; every read is verified.

`test_stress_shared_pool` has one instance per xdist worker (tests/conftest.py puts one at the head of
every worker's first batch, so they start together); all instances of a run open the same pool,
/dev/shm/maru-stress-<testrun_uid>. Each runs its share of STRESS_CALLS API calls (put, get,
get_into, delete, overwrite, batch_put with and without skip_existing, batch_get_into,
batch_get_pieces, batch_exists) over a shared key space, with values of 1-16 KiB that verify
themselves: header = key digest, version, length; body derived from (key, version) (conftest.make_value).
The version names its writer and its sequence number, so any reader can tell the bytes are exactly
what some writer put under that key.

Each instance asserts its own share (calls done, zero wrong reads, zero errors); a ledger next to the
pytest base temp dir (flock-protected, shared by the workers) sums them up, and the last instance to
finish — every other one has closed its Store by then, so the pool is quiescent — asserts the whole
run: at least STRESS_CALLS calls in total, zero wrong reads, check() clean, every indexed value intact.
Without xdist the test forks STRESS_PROCS processes itself and does the final part in the parent.

Knobs: MARU_STRESS_CALLS (default 100 000 in total), MARU_STRESS_POOL (default 24M: the working set is
larger, so eviction runs all the time), MARU_STRESS_KEYS (default 3000).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import time
import traceback

import numpy as np
import pytest

from maru_shm import Store, remove_pool
from maru_shm.index import key_digest

from ..conftest import HEADER_SIZE, assert_clean, make_value, read_notes as _notes, value_version, write_note as _note

STRESS_CALLS = int(os.environ.get("MARU_STRESS_CALLS", "100000"))
STRESS_POOL = os.environ.get("MARU_STRESS_POOL", "24M")
STRESS_KEYS = [f"stress-{i}" for i in range(int(os.environ.get("MARU_STRESS_KEYS", "3000")))]
STRESS_PROCS = 4  # without xdist
MIN_SIZE, MAX_SIZE = 1 << 10, 16 << 10
VERSION_BITS = 40  # version = writer << 40 | sequence number


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


# one instance per worker (at most 64: the pool has 128 process slots)
INSTANCES = list(range(min(_workers(), 64))) if _workers() >= 2 else ["alone"]

# counters of one process, in shared memory so forked children can report them
CALLS, KEYOPS, READS, WRONG, ERRORS, VERIFIED = range(6)
FIELDS = 6


class Tally:
    """Anonymous shared memory, one row per process; each row has one writer."""

    def __init__(self, rows: int):
        self.mm = mmap.mmap(-1, rows * FIELDS * 8)
        self.a = np.frombuffer(self.mm, dtype=np.int64).reshape(rows, FIELDS)

    def total(self, field: int) -> int:
        return int(self.a[:, field].sum())


def _verify(row, errdir, writers, key, data, where) -> None:
    """data came back for key: it must be exactly a value some writer of this run put under key."""
    row[READS] += 1
    version = value_version(key, data)
    if version is None or (version >> VERSION_BITS) >= writers:
        row[WRONG] += 1
        _note(errdir, "wrong", f"{where}: {len(data)} bytes for {key!r} are not a value written under it "
                               f"(version {version}); head {bytes(data[:48]).hex()}")
    else:
        row[VERIFIED] += 1


def stress_workload(store: Store, row, writer: int, writers: int, calls: int, seed: int, errdir: str) -> None:
    """`calls` API calls of a mixed workload; counts calls, per-key operations, verified and wrong reads."""
    rng = random.Random(seed)
    keys = STRESS_KEYS
    seq = 0

    def value(k):
        nonlocal seq
        seq += 1
        return make_value(k, (writer << VERSION_BITS) | seq, rng.randint(MIN_SIZE, MAX_SIZE))

    buf = bytearray(MAX_SIZE)
    recent: list[str] = []  # keys this process saw present: overwrite targets
    for _ in range(calls):
        op = rng.random()
        k = rng.choice(keys)
        n = 1
        try:
            if op < 0.22:                                   # put
                store.put(k, value(k))
            elif op < 0.42:                                 # get
                data = store.get(k)
                if data is not None:
                    _verify(row, errdir, writers, k, data, "get")
                    recent.append(k)
            elif op < 0.50:                                 # get_into
                got = store.get_into(k, buf)
                if got is not None:
                    _verify(row, errdir, writers, k, memoryview(buf)[:got], "get_into")
            elif op < 0.58:                                 # delete
                store.delete(k)
            elif op < 0.66:                                 # overwrite a key seen present
                if recent:
                    k = recent.pop(rng.randrange(len(recent)))
                store.put(k, value(k))
            elif op < 0.76:                                 # batch_put (some with skip_existing)
                ks = rng.sample(keys, rng.randint(2, 8))
                res = store.batch_put(ks, [value(x) for x in ks], skip_existing=rng.random() < 0.3)
                assert len(res) == len(ks)
                n = len(ks)
            elif op < 0.84:                                 # batch_get_into
                ks = rng.sample(keys, rng.randint(2, 8))
                outs = [bytearray(MAX_SIZE) for _ in ks]
                for x, o, got in zip(ks, outs, store.batch_get_into(ks, outs)):
                    if got is not None:
                        _verify(row, errdir, writers, x, memoryview(o)[:got], "batch_get_into")
                n = len(ks)
            elif op < 0.90:                                 # batch_get_pieces at the stored length
                ks = rng.sample(keys, rng.randint(2, 8))
                lens = [store.length_of(x) or HEADER_SIZE for x in ks]
                arrs = [np.empty(m, np.uint8) for m in lens]
                hits = store.batch_get_pieces(ks, [[(a.ctypes.data, a.nbytes)] for a in arrs])
                for x, a, hit in zip(ks, arrs, hits):
                    if hit:
                        _verify(row, errdir, writers, x, a.tobytes(), "batch_get_pieces")
                n = len(ks)
            else:                                           # batch_exists
                ks = rng.sample(keys, 32)
                assert len(store.batch_exists(ks)) == 32
                n = len(ks)
        except Exception:
            row[ERRORS] += 1
            _note(errdir, "error", traceback.format_exc())
        row[CALLS] += 1
        row[KEYOPS] += n
        if len(recent) > 64:
            del recent[:32]


def final_verification(store: Store, writers: int) -> int:
    """Quiescent pool: check() clean, every key reads back as a value some writer put, nothing foreign indexed."""
    assert_clean(store)
    present = 0
    for k in STRESS_KEYS:
        data = store.get(k)
        if data is not None:
            version = value_version(k, data)
            assert version is not None and (version >> VERSION_BITS) < writers, k
            present += 1
    assert present == store.stats()["entries"]
    digests = {key_digest(k) for k in STRESS_KEYS}
    for sh in range(store.geo.index_shards):
        for _, d, _, _ in store.index.entries(sh):
            assert d in digests  # nothing indexed that nobody wrote
    return present


def _share(instances: int) -> int:
    return -(-STRESS_CALLS // instances)


# ---------------------------------------------------------------- the ledger shared by the xdist workers

class Ledger:
    """A JSON file of totals, updated under flock by each instance of one run."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "a+")

    def __enter__(self) -> dict:
        fcntl.flock(self.f, fcntl.LOCK_EX)
        self.f.seek(0)
        text = self.f.read()
        self.data = json.loads(text) if text else {"started": 0, "finished": 0, "calls": 0, "keyops": 0,
                                                    "reads": 0, "verified": 0, "wrong": 0, "errors": 0}
        return self.data

    def __exit__(self, *exc) -> None:
        self.f.seek(0)
        self.f.truncate()
        self.f.write(json.dumps(self.data))
        self.f.flush()
        fcntl.flock(self.f, fcntl.LOCK_UN)

    def close(self) -> None:
        self.f.close()


# ---------------------------------------------------------------- the test

def _alone_child(path, tally, r, errdir):
    with Store.open(path, STRESS_POOL, create=True, timeout=30) as s:
        stress_workload(s, tally.a[r], r, STRESS_PROCS, _share(STRESS_PROCS), 7000 + r, errdir)


@pytest.mark.parametrize("instance", INSTANCES)
def test_stress_shared_pool(instance, testrun_uid, tmp_path_factory, tmp_path, children, pool_path,
                            record_property):
    errdir = str(tmp_path)
    t0 = time.monotonic()
    if instance == "alone":  # not under xdist: be the processes ourselves
        tally = Tally(STRESS_PROCS)
        pids = [children.fork(_alone_child, pool_path, tally, r, errdir) for r in range(STRESS_PROCS)]
        for pid in pids:
            children.wait_ok(pid, timeout=600)
        assert tally.total(WRONG) == 0, _notes(errdir)
        assert tally.total(ERRORS) == 0, _notes(errdir)
        assert tally.total(CALLS) >= STRESS_CALLS and tally.total(VERIFIED) > 0
        with Store.open(pool_path) as s:
            present = final_verification(s, STRESS_PROCS)
        print(f"\nstress: {tally.total(CALLS)} calls ({tally.total(KEYOPS)} key operations), "
              f"{tally.total(VERIFIED)} verified reads, {present} keys present, {time.monotonic() - t0:.1f}s")
        return

    n = len(INSTANCES)
    path = f"/dev/shm/maru-stress-{testrun_uid}"
    base = tmp_path_factory.getbasetemp().parent
    ledger = Ledger(str(base / f"stress-{testrun_uid}.json"))
    tally = Tally(1)
    row = tally.a[0]
    store = None
    failure = None
    try:
        with ledger as d:  # serialises open against the last instance's unlink, too
            store = Store.open(path, STRESS_POOL, create=True, timeout=30)
            d["started"] += 1
        deadline = time.monotonic() + 10  # soft barrier: the others start this test first as well
        while time.monotonic() < deadline:
            with ledger as d:
                if d["started"] >= n:
                    break
            time.sleep(0.02)
        stress_workload(store, row, instance, n, _share(n), int(testrun_uid[:8], 16) + instance, errdir)
    except BaseException as e:
        failure = e
    mine = {"calls": int(row[CALLS]), "keyops": int(row[KEYOPS]), "reads": int(row[READS]),
            "verified": int(row[VERIFIED]), "wrong": int(row[WRONG]), "errors": int(row[ERRORS])}
    with ledger as d:
        for field, v in mine.items():
            d[field] += v
        d["finished"] += 1
        last = d["finished"] == n
        totals = dict(d)
        if not last and store is not None:
            store.close()  # before the last one looks: it checks a quiescent pool
            store = None
    try:
        if last:  # every other instance has finished and closed its Store: check the whole run
            print(f"\nstress: {totals['calls']} calls ({totals['keyops']} key operations) by {n} workers, "
                  f"{totals['verified']} verified reads, {totals['wrong']} wrong, {totals['errors']} errors; "
                  f"last worker done after {time.monotonic() - t0:.1f}s")
            record_property("stress_total_calls", totals["calls"])
            assert totals["wrong"] == 0 and totals["errors"] == 0, totals
            assert totals["calls"] >= STRESS_CALLS, totals
            if store is not None:
                assert final_verification(store, n) > 0
    finally:
        if store is not None:
            store.close()
        if last:
            remove_pool(path)
            try:
                os.unlink(ledger.path)
            except FileNotFoundError:
                pass
        ledger.close()
    if failure is not None:
        raise failure
    # this worker's share
    record_property("stress_calls", mine["calls"])
    assert mine["wrong"] == 0, _notes(errdir)
    assert mine["errors"] == 0, _notes(errdir)
    assert mine["calls"] >= _share(n) and mine["verified"] > 0, mine
