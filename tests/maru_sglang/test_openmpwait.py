"""maru_sglang.openmpwait: the parked OpenMP team that lets the host's idle workers sleep (issue #49), and
`auto`, which parks it only while the pool's processes outnumber the CPUs.

Each case runs in a fresh interpreter: the team is parked once per process, and libgomp reads its
environment once, when it loads. What the team changes (a worker that sleeps instead of spinning) is a
rate, measured in BENCHMARKS.md "At load"; here: when it is parked, when not, and that torch's own
thread count is untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import json, os, threading, torch
from maru_sglang import openmpwait
torch.set_num_threads(int(os.environ["PROBE_THREADS"]))
if os.environ.get("PROBE_NO_LIBRARY"):  # the runtime cannot be loaded by name: the host runs on, unchanged
    def refuse(path):
        raise OSError(f"cannot load {path}")
    openmpwait.ctypes.CDLL = refuse
before = (torch.get_num_threads(), len(os.listdir("/proc/self/task")))
first = openmpwait.manage_idle_workers("sleep")
again = openmpwait.manage_idle_workers("sleep")
parked = [t.name for t in threading.enumerate() if t.name == "maru-openmp-park"]
after = (torch.get_num_threads(), len(os.listdir("/proc/self/task")))
torch.empty(1 << 20).fill_(1.0)  # the main thread's own team still runs torch's threads
print(json.dumps({"why_not": openmpwait.why_not(), "first": first, "again": again, "parked": parked,
                  "before": before, "after": after, "cpus": len(os.sched_getaffinity(0))}))
"""


def _probe(threads: int, **env) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    e.update(env, PROBE_THREADS=str(threads), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_team_of_every_cpu_is_parked_once_and_torch_keeps_its_threads():
    r = _probe(2)
    if r["why_not"] is not None:
        pytest.skip(f"no libgomp here: {r['why_not']}")
    assert r["first"] and r["again"] and r["parked"] == ["maru-openmp-park"]
    assert r["after"][0] == r["before"][0] == 2  # torch's intra-op threads unchanged
    # the parked thread and its team's workers: more OpenMP threads than CPUs, libgomp's throttled wait
    assert r["after"][1] - r["before"][1] >= r["cpus"]


@pytest.mark.parametrize("env, reason", [({"OMP_WAIT_POLICY": "passive"}, "OMP_WAIT_POLICY set"),
                                         ({"GOMP_SPINCOUNT": "10000"}, "GOMP_SPINCOUNT set")])
def test_the_users_own_wait_policy_wins(env, reason):
    r = _probe(2, **env)
    assert r["why_not"] == reason and not r["first"] and not r["parked"]
    assert r["after"][1] == r["before"][1]


def test_a_runtime_that_cannot_be_loaded_leaves_the_host_as_it_was():
    r = _probe(2, PROBE_NO_LIBRARY="1")
    if r["why_not"] is not None:
        pytest.skip(f"no libgomp here: {r['why_not']}")
    assert not r["first"] and not r["parked"] and r["after"] == r["before"]


def test_one_torch_thread_has_no_worker_to_spin():
    r = _probe(1)
    assert r["why_not"] == "torch runs one thread" and not r["first"] and not r["parked"]


AUTO_PROBE = r"""
import json, os, threading, time, torch
from maru_sglang import openmpwait
torch.set_num_threads(2)
openmpwait.CHECK_S = 0.05
count = {"n": None}
def tasks():
    return len(os.listdir("/proc/self/task"))
def parked():
    return [t.name for t in threading.enumerate() if t.name == openmpwait.PARK_THREAD]
def settle(expect_parked):  # the state once the watcher made it so (10 s at most) and the threads stay put
    deadline = time.monotonic() + 10
    while bool(parked()) != expect_parked and time.monotonic() < deadline:
        time.sleep(0.05)
    n = tasks()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if tasks() == n:
            break
        n = tasks()
    torch.empty(1 << 20).fill_(1.0)  # the main thread's team still runs, whatever the parked one does
    return {"parked": parked(), "tasks": tasks()}
before = tasks()
ok = openmpwait.manage_idle_workers("auto", lambda: count["n"])
seen = {"before": before, "ok": ok, "cpus": len(os.sched_getaffinity(0)), "unknown": settle(True)}
count["n"] = 1
seen["alone"] = settle(False)
count["n"] = seen["cpus"]
seen["crowded"] = settle(True)
count["n"] = None
time.sleep(0.5)  # ten turns of the watcher, which an unknown count must not change
seen["unknown_again"] = settle(True)
count["n"] = 1
seen["alone_again"] = settle(False)
print(json.dumps(seen))
"""


def test_auto_parks_the_team_while_the_pools_processes_outnumber_the_cpus():
    """`auto`: parked until the pool's processes are counted, and while they (each with this one's 2
    threads) outnumber the CPUs; alone, the parked thread ends and libgomp frees its team, so the workers
    spin again; an unknown count changes nothing."""
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", AUTO_PROBE], env={**e, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["ok"]:
        pytest.skip("no libgomp here")
    if r["cpus"] < 2:
        pytest.skip("one CPU: two threads always outnumber it")
    team = r["unknown"]["tasks"] - r["alone"]["tasks"]
    assert r["unknown"]["parked"] and team >= r["cpus"]  # the parked thread and its workers
    assert not r["alone"]["parked"]
    assert r["crowded"]["parked"] and r["crowded"]["tasks"] == r["unknown"]["tasks"]
    assert r["unknown_again"] == r["crowded"]
    assert r["alone_again"] == r["alone"]


def test_the_backend_applies_its_wait_setting(monkeypatch):
    import hicache_helpers as hh
    from maru_sglang import maru_storage

    calls = []
    monkeypatch.setattr(maru_storage, "manage_idle_workers", lambda mode, processes: calls.append(mode) or True)
    for value, expected in ((None, "auto"), ("auto", "auto"), ("sleep", "sleep"), ("spin", "spin")):
        calls.clear()
        extra = hh.extra_config("/dev/shm/unused-openmpwait", **({} if value is None else {"maru_openmp_wait": value}))
        maru_storage.MaruStorage(hh.storage_config(extra))
        assert calls == [expected], value
