"""The second tier's status files beside a pool: what `maru-shm inspect` reads, and what it refuses."""

from __future__ import annotations

import json
import os

from maru_sglang.tiers import status as tierstatus


def test_statuses_round_trip_and_only_live_processes_show(tmp_path):
    pool = str(tmp_path / "pool")
    me = {"pid": os.getpid(), "instance": "a", "slot": 0, "state": "attached", "master": "h:1", "tag": "maru-x",
          "hits": 3, "updated_ns": 5}
    tierstatus.write_status(pool, f"{os.getpid()}-a", me)
    tierstatus.write_status(pool, "999999999-b", dict(me, pid=999999999, instance="b"))  # no such process
    assert tierstatus.read_statuses(pool, [os.getpid()]) == [me]
    tierstatus.remove_stale(pool)
    assert sorted(os.listdir(tierstatus.status_dir(pool))) == [f"{os.getpid()}-a.json"]
    tierstatus.remove_status(pool, f"{os.getpid()}-a")
    assert not os.path.exists(tierstatus.status_dir(pool))  # the last file out takes the directory


def test_planted_files_are_skipped_not_shown(tmp_path):
    pool = str(tmp_path / "pool")
    d = tierstatus.status_dir(pool)
    os.makedirs(d)
    good = {"pid": os.getpid(), "state": "down", "hits": 1}
    planted = {
        "text.json": "not json",
        "list.json": json.dumps([1, 2]),
        "strcount.json": json.dumps(dict(good, hits="1e9")),
        "nopid.json": json.dumps({"state": "attached"}),
        "boolpid.json": json.dumps(dict(good, pid=True)),
        "nested.json": json.dumps(dict(good, hits={"x": 1})),
        "ok.json": json.dumps(dict(good, state="x" * 1000)),
    }
    for name, text in planted.items():
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    os.symlink(os.path.join(d, "ok.json"), os.path.join(d, "link.json"))  # never followed
    os.mkfifo(os.path.join(d, "fifo.json"))  # never waited on
    got = tierstatus.read_statuses(pool, [os.getpid()])
    assert got == [dict(good, state="x" * 200)]
