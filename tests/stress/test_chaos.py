"""SIGKILL in a loop while worker processes of several threads each hammer one pool (tools/chaos.py).

SGLang runs several storage threads per backend, so a kill lands with several of them mid-batch. After
the run a fresh process opens the pool (reaping the dead) and check() must find no orphan block; the
workers must have read no wrong byte; repair must leave check() clean.
"""

from __future__ import annotations

import os
import uuid

from tools import chaos


def test_sigkill_loop_with_threaded_workers_leaves_no_orphan():
    path = f"/dev/shm/maru-chaos-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    res = chaos.run(path, seconds=float(os.environ.get("MARU_CHAOS_SECONDS", "8")), workers=2, size="32M",
                    nkeys=2000, seed=7, threads=3, min_kills=20)
    assert res["kills"] >= 20 and res["operations"] > res["kills"]  # the workers worked between the kills
    assert res["wrong_reads"] == 0 and res["bad_values"] == 0
    assert res["worker_crashes"] == 0
    assert res["orphans_after_reaping"] == 0, res["problems_after_reaping"]
    assert res["ok"], res
