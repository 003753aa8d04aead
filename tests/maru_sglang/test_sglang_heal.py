"""The backend heals (DESIGN.md section 10, *Healing*): a pool truncated, removed and re-created by
another instance, or destroyed with `--force` under a running MaruStorage is detached, its calls answer
misses without raising, and it is reopened (or created again) with backoff; the heal is counted in the new
pool and shown by `maru-shm inspect`.

Real SGLang host pools and backends (hicache_helpers). maru_heal_retry_s is small, so heals come within
a fraction of a second; every wait is a generous deadline, never a timed assertion.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import page_bytes, page_indices, prompt_keys  # noqa: E402

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
HEAL = {"maru_heal_retry_s": 0.05}
DEADLINE_S = 30.0


def _eventually(probe, what: str):
    """probe() until it returns something true; fail naming `what` after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not within {DEADLINE_S:g} s: {what}")
        time.sleep(0.02)


def _cli(*args) -> subprocess.CompletedProcess:
    """This worktree's `maru-shm` command (the installed console script may be another checkout's)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def _served_again(host, backend, salt: str) -> None:
    """A new batch_set_v1 / batch_get_v1 round trip works (waiting for the heal), byte for byte."""
    keys, src, dst = prompt_keys(4, salt), page_indices(host, 0, 4), page_indices(host, 8, 4)
    _eventually(lambda: backend.batch_set_v1(keys, src) == [True] * 4, "a batch_set_v1 stored every page again")
    hh.zero_pages(host, dst)
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    assert page_bytes(host, dst) == page_bytes(host, src)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("maru_sglang") and r.levelno >= logging.ERROR]


def _said(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("maru_sglang") and needle in r.getMessage()]


def test_a_pool_truncated_under_the_backend_answers_misses_then_serves_again(make_instance, pool_path, caplog):
    caplog.set_level(logging.INFO, logger="maru_sglang")
    host, backend = make_instance(pages=16, maru=HEAL)
    hh.fill_random(host, seed=3)
    old = prompt_keys(4, "before")
    assert backend.batch_set_v1(old, page_indices(host, 0, 4)) == [True] * 4

    os.truncate(pool_path, 0)
    # the calls that meet the loss raise nothing into SGLang's threads: misses, and sets not done (or done
    # in the reopened pool, if the heal was already that quick)
    assert backend.batch_exists(old) == 0
    assert backend.batch_get_v1(old, page_indices(host, 8, 4)) == [False] * 4
    assert all(type(ok) is bool for ok in backend.batch_set_v1(prompt_keys(2, "during"), page_indices(host, 0, 2)))

    _served_again(host, backend, "after")
    assert backend.batch_exists(old) == 0  # the truncation took them: never served from the zeros
    assert {k: backend.get_stats().maru["pool"][k] for k in ("state", "losses", "heals")} == \
        {"state": "attached", "losses": 1, "heals": 1}
    assert not _errors(caplog), _errors(caplog)  # a loss is not a failure per call
    assert len(_said(caplog, "lost")) == 1 and len(_said(caplog, "healed after")) == 1


def test_a_pool_removed_and_created_again_by_another_instance_is_reattached_with_its_pages(make_instance, pool_path):
    host_a, a = make_instance(pages=16, maru=HEAL)
    hh.fill_random(host_a, seed=4)
    assert a.batch_set_v1(prompt_keys(2, "gone"), page_indices(host_a, 0, 2)) == [True] * 2

    os.unlink(pool_path)
    host_b, b = make_instance(pages=16, maru=HEAL)  # the same model and ranks: the same namespace
    assert b.store.created
    hh.fill_random(host_b, seed=5)
    theirs = prompt_keys(4, "theirs")
    assert b.batch_set_v1(theirs, page_indices(host_b, 0, 4)) == [True] * 4

    _eventually(lambda: a.batch_exists(theirs) == 4, "the first backend sees the pages the other wrote")
    dst = page_indices(host_a, 8, 4)
    assert a.batch_get_v1(theirs, dst) == [True] * 4
    assert page_bytes(host_a, dst) == page_bytes(host_b, page_indices(host_b, 0, 4))
    assert a.batch_exists(prompt_keys(2, "gone")) == 0  # those went with the removed file
    assert not a.store.created and a.store.slot != b.store.slot  # attached to the other's pool, a slot of its own
    mine = prompt_keys(2, "mine")
    assert a.batch_set_v1(mine, page_indices(host_a, 0, 2)) == [True] * 2
    assert b.batch_exists(mine) == 2  # and the other sees its pages: one pool again


def test_a_pool_destroyed_with_force_answers_misses_while_blocked_then_is_created_again(make_instance, pool_path):
    host, backend = make_instance(pages=16, maru=HEAL)
    hh.fill_random(host, seed=6)
    keys, src, dst = prompt_keys(4, "kept"), page_indices(host, 0, 4), page_indices(host, 8, 4)
    assert backend.batch_set_v1(keys, src) == [True] * 4

    r = _cli("destroy", "--force", pool_path)
    assert r.returncode == 0 and "process(es) were attached" in r.stderr, (r.returncode, r.stdout, r.stderr)
    with open(pool_path, "wb") as f:  # somebody's file at the path meanwhile: never overwritten, retried
        f.write(b"not a pool")
    _eventually(lambda: backend.batch_exists(keys) == 0, "the destroyed pool stops serving")
    _eventually(lambda: backend.get_stats().maru["pool"]["reopen_failures"] >= 2, "two refused reopen attempts")
    assert backend.batch_get_v1(keys, dst) == [False] * 4
    assert backend.batch_set_v1(keys, src) == [False] * 4  # detached: nothing stored anywhere
    assert backend.get_stats().maru["pool"]["state"] == "detached"
    with open(pool_path, "rb") as f:
        assert f.read() == b"not a pool"

    os.unlink(pool_path)
    _served_again(host, backend, "recreated")
    assert backend.store.created  # the backend created the pool again, for its own page size
    assert backend.store.geo.shortfalls(backend.page_bytes) == []


def test_the_heal_is_counted_in_the_new_pool_and_shown_by_inspect(make_instance, pool_path):
    host, backend = make_instance(pages=16, maru=HEAL)
    hh.fill_random(host, seed=7)
    assert backend.batch_set_v1(prompt_keys(2, "x"), page_indices(host, 0, 2)) == [True] * 2
    before = _cli("inspect", pool_path, "--json")
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["counters"]["heals"] == 0

    os.unlink(pool_path)  # removed under the backend, nobody else re-creates it
    _served_again(host, backend, "counted")
    rep = _cli("inspect", pool_path, "--json")
    assert rep.returncode == 0, rep.stderr
    rep = json.loads(rep.stdout)
    assert rep["counters"]["heals"] == 1
    assert [(p["pid"], p["alive"]) for p in rep["processes"]] == [(os.getpid(), True)]
    text = _cli("inspect", pool_path)
    assert text.returncode == 0 and re.search(r"\bheals\s+1\b", text.stdout), text.stdout


def test_storage_threads_busy_through_a_truncation_never_raise_and_all_serve_again(make_instance, pool_path, caplog):
    """SGLang runs several storage threads per backend: the truncation lands inside their calls."""
    host, backend = make_instance(pages=32, maru=HEAL)
    hh.fill_random(host, seed=8)
    truncated, stop = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    healed: list[int] = []

    def storage_thread(t: int) -> None:
        src, dst = page_indices(host, 8 * t, 4), page_indices(host, 8 * t + 4, 4)
        n = 0
        try:
            while not stop.is_set():
                after = truncated.is_set()  # then the old pool fails this round trip: only a reopened one serves it
                keys = prompt_keys(4, f"thread{t}-{n}")
                n += 1
                ok = backend.batch_set_v1(keys, src) == [True] * 4
                backend.batch_exists(keys)
                ok = backend.batch_get_v1(keys, dst) == [True] * 4 and ok
                if ok and after:
                    healed.append(t)
                    return
        except BaseException as e:  # anything escaping a call would reach SGLang's thread
            errors.append(e)

    threads = [threading.Thread(target=storage_thread, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    try:
        time.sleep(0.2)
        os.truncate(pool_path, 0)
        truncated.set()
        _eventually(lambda: len(healed) == 3 or errors, "every storage thread stored and loaded pages again")
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    assert not errors, errors
    assert backend.get_stats().maru["pool"]["losses"] >= 1
    assert not _errors(caplog), _errors(caplog)  # calls caught in the loss are misses, not failures
