"""The pieces of `maru-shm bench --only serving` that need no SGLang server: the round-robin forwarder (against
small HTTP servers of its own), the Mooncake trace cut, the offline tokenizer, the Prometheus reader and the
server command lines each deployment and L3 tier gives.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request

import pytest

from tools import benchclient, tracecut
from tools.deployment import spec_for
from tools.roundrobin import RoundRobin
from tools.serving import ServerSpec, cores_per_rank


# --------------------------------------------------------------------------- the forwarder
class _Upstream:
    """An HTTP server that answers a POST with its name, streamed in three chunks, and a GET with its name."""

    def __init__(self, name: str):
        outer = self
        self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                outer.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in (f"data: {name}-1\n\n", f"data: {name}-2\n\n", "data: [DONE]\n\n"):
                    data = part.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _post(url: str, body: dict) -> str:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def upstreams():
    ups = [_Upstream("a"), _Upstream("b")]
    yield ups
    for u in ups:
        try:
            u.close()
        except OSError:
            pass


def test_generations_alternate_and_streams_arrive_whole(upstreams):
    a, b = upstreams
    with RoundRobin([a.url, b.url]) as rr:
        replies = [_post(rr.url, {"text": f"q{i}"}) for i in range(4)]
        with urllib.request.urlopen(rr.url + "/v1/models", timeout=10) as r:
            info = r.read().decode()
        assert rr.routed == {a.url: 2, b.url: 2}
    assert replies == ["data: a-1\n\ndata: a-2\n\ndata: [DONE]\n\n", "data: b-1\n\ndata: b-2\n\ndata: [DONE]\n\n"] * 2
    assert info == "a"  # anything but a generation goes to the first upstream
    assert [json.loads(x)["text"] for x in a.bodies + b.bodies] == ["q0", "q2", "q1", "q3"]


def test_a_dead_upstream_is_skipped_until_added_again(upstreams):
    a, b = upstreams
    with RoundRobin([a.url, b.url]) as rr:
        b.close()
        replies = [_post(rr.url, {"text": f"q{i}"}) for i in range(3)]
        assert all(r.startswith("data: a-1") for r in replies)
        assert rr.up == [a.url] and rr.refused[b.url] == 1
        c = _Upstream("c")
        try:
            rr.add(c.url)
            assert {_post(rr.url, {}).split("-")[0] for _ in range(2)} == {"data: a", "data: c"}
        finally:
            c.close()


def test_with_no_upstream_up_the_client_gets_502(upstreams):
    a, _ = upstreams
    with RoundRobin([a.url]) as rr:
        a.close()
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(rr.url, {})
        assert e.value.code == 502


# --------------------------------------------------------------------------- the trace cut
def _rec(ts, ids, out=50):
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": out, "hash_ids": ids}


def test_the_cut_keeps_whole_short_sessions_in_order_and_retimes_them():
    records = [_rec(0, [1, 2, 3]), _rec(5, [9] * 20), _rec(7, [9] * 20 + [1]), _rec(9, [4, 5]), _rec(10, [1, 2, 7]),
               _rec(11, [6]), _rec(12, [4, 8]), _rec(13, [1, 2, 3], out=2), _rec(14, [4, 5])]
    out = tracecut.cut(records, sessions=2, per_session=2, max_blocks=4, rate=2.0, output_len=4)
    # session 9 has records over 4 blocks, session 6 a single record: both left out; sessions 1 and 4 kept,
    # two records each, in arrival order
    assert [r["hash_ids"] for r in out] == [[1, 2, 3], [4, 5], [1, 2, 7], [4, 8]]
    assert [r["timestamp"] for r in out] == [0, 500, 1000, 1500]
    assert [r["output_length"] for r in out] == [4, 4, 4, 4]


# --------------------------------------------------------------------------- the offline tokenizer
def test_every_token_of_the_offline_tokenizer_comes_back_as_itself(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tools import wordtokenizer
    vocab = wordtokenizer.vocabulary(512)
    assert len(vocab) == 512 and sorted(vocab.values()) == list(range(512))
    words = [w for w in vocab if w not in wordtokenizer.SPECIAL + wordtokenizer.DIGITS + wordtokenizer.PUNCTUATION]
    assert all(w.isalpha() for w in words)
    tok = AutoTokenizer.from_pretrained(wordtokenizer.write(str(tmp_path), 512))
    ids = list(range(512)) * 2
    assert tok.encode(tok.decode(ids)) == ids  # what bench_serving does to build a prompt of a given length
    glued = tok.convert_ids_to_tokens(tok.encode("user: Round 1: 708hi hi 709hi Tell me a story based on this context."))
    assert glued[:8] == ["user", ":", "Round", "1", ":", "7", "0", "8"] and "<unk>" not in glued


# --------------------------------------------------------------------------- Prometheus text
METRICS = """# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="m"} 3600.0
sglang:cached_tokens_total{cache_source="storage",model_name="m"} 1552.0
sglang:prefetch_pgs_sum{dp_rank="0",storage_backend="x"} 33.0
sglang:prefetch_pgs_sum{dp_rank="1",storage_backend="x"} 7.0
master_evicted_key_count 12
"""


def test_metric_sums_and_labels():
    assert benchclient.metric_sum(METRICS, "sglang:cached_tokens_total", cache_source="storage") == 1552
    assert benchclient.metric_sum(METRICS, "sglang:cached_tokens_total") == 5152
    assert benchclient.metric_sum(METRICS, "sglang:prefetch_pgs_sum", dp_rank="1") == 7
    assert benchclient.metric_sum(METRICS, "master_evicted_key_count") == 12
    assert benchclient.metric_sum(METRICS, "absent") == 0
    assert benchclient.label_values(METRICS, "sglang:prefetch_pgs_sum", "dp_rank") == ["0", "1"]


# --------------------------------------------------------------------------- server command lines
def _flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_l3_and_deployment_gives_its_server_flags(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    none = ServerSpec("m", l3="none", text=True).argv(1)
    assert "--hicache-storage-backend" not in none and "--skip-tokenizer-init" not in none
    assert "--enable-hierarchical-cache" in none
    moon = ServerSpec("m", l3="mooncake", l3_config={"master_server_address": "127.0.0.1:5"}).argv(1)
    assert _flag(moon, "--hicache-storage-backend") == "mooncake"
    assert json.loads(_flag(moon, "--hicache-storage-backend-extra-config"))["master_server_address"] == "127.0.0.1:5"
    maru = ServerSpec("m", pool="/dev/shm/p", metrics=True).argv(1)
    assert _flag(maru, "--hicache-storage-backend") == "dynamic" and "--enable-metrics" in maru
    assert "--skip-tokenizer-init" in maru
    dp = spec_for(ServerSpec("m", pool="/dev/shm/p"), "dp", "1")
    assert _flag(dp.argv(1), "--dp-size") == "2" and _flag(dp.argv(1), "--load-balance-method") == "round_robin"
    env = dp.env()
    assert env["OMP_NUM_THREADS"] == "1" and len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    contended = spec_for(ServerSpec("m", pool="/dev/shm/p"), "pair", "default")
    assert "--dp-size" not in contended.argv(1) and "OMP_NUM_THREADS" not in contended.env()
    gpu_pair = spec_for(ServerSpec("m", device="cuda"), "pair", "1").argv(1)
    assert _flag(gpu_pair, "--mem-fraction-static") == "0.4" and "--hicache-io-backend" not in gpu_pair
    with pytest.raises(ValueError):
        ServerSpec("m", l3="nfs").argv(1)


def test_cores_are_cut_into_one_set_per_rank(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cores_per_rank(2) == "0-1|2-3"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 2, 5, 6})
    assert cores_per_rank(2) == "0,2|5-6"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert cores_per_rank(2) == "0|0"


# --------------------------------------------------------------------------- figures, report, chart
def _cell(threads, backend, budget, ttft, tokens, same=(True, True)):
    label = backend if budget is None else f"{backend} {budget >> 20}M"
    med = {"ttft_mean_ms": ttft, "ttft_p50_ms": ttft * 0.9, "ttft_p99_ms": ttft * 2, "request_throughput": 1000 / ttft,
           "input_throughput": 2e6 / ttft, "storage_tokens": tokens, "client_storage_tokens": tokens,
           "hit_rate_pct": 80.0, "duration_s": 5.0, "evictions": 0 if budget else None}
    check = {"prompts": 2} if backend == "none" else {"prompts": 2, "same": list(same)}
    return {"topology": "dp", "threads": threads, "workload": "gsp", "seed": 1, "backend": backend, "budget": budget,
            "label": label, "schedulers": 2, "runs": [], "median": med, "spread": {k: [v, v] for k, v in med.items()
                                                                                   if v is not None},
            "check": check, "texts_differ_from_none": None if backend == "none" else 0}


def test_serving_figures_compare_maru_with_its_peers_and_the_contention_ratio(tmp_path):
    from tools.benchmarks.charts import render_charts
    from tools.benchmarks.report import render
    from tools.benchmarks.serving_load import figures
    G = 1 << 30
    cells = [_cell("1", "none", None, 900, 0), _cell("1", "file", None, 500, 3000), _cell("1", "mooncake", G, 600, 3000),
             _cell("1", "maru", G, 450, 3000), _cell("default", "file", None, 550, 3000),
             _cell("default", "maru", G, 900, 2500, same=(True, False)), _cell("default", "maru-spin", G, 1350, 2500),
             _cell("default", "maru-sleep", G, 950, 2500)]
    figs = figures(cells)
    by = {f["name"]: f for f in figs}
    mean = by["serving dp threads=1 gsp seed 1: TTFT mean, maru 1024M vs file"]
    assert mean["ours"] == 450 and mean["peer"] == 500 and mean["met"] is True
    assert by["serving dp threads=1 gsp seed 1: TTFT mean, maru 1024M vs mooncake 1024M"]["met"] is True
    assert by["serving dp threads=default gsp seed 1: tokens from L3, maru 1024M vs file"]["met"] is False
    greedy = by["serving dp threads=default gsp seed 1: greedy subset, maru 1024M: tokens from L3 = recomputed"]
    assert greedy["ours"] == 1 and greedy["met"] is False
    ratio = by["serving dp gsp seed 1: TTFT mean, default threads / 1 thread, maru 1024M vs file"]
    assert ratio["ours"] == pytest.approx(2.0) and ratio["peer"] == pytest.approx(1.1) and ratio["met"] is False
    ab = by["serving dp threads=default gsp seed 1: TTFT mean, maru 1024M vs maru-spin 1024M"]  # the A/B of openmpwait
    assert ab["ours"] == 900 and ab["peer"] == 1350 and ab["met"] is True
    assert by["serving dp threads=default gsp seed 1: TTFT mean, maru 1024M vs maru-sleep 1024M"]["met"] is True
    spin = by["serving dp gsp seed 1: TTFT mean, default threads / 1 thread, maru-spin 1024M vs file"]  # over maru's 1
    assert spin["ours"] == pytest.approx(3.0)
    sleep = by["serving dp gsp seed 1: TTFT mean, default threads / 1 thread, maru-sleep 1024M vs file"]
    assert sleep["ours"] == pytest.approx(950 / 450)
    result = {"scenario": "serving", "model": "m", "repeat": 1, "skipped": None, "cells": cells, "figures": figs,
              "workloads": [{"name": "gsp", "seed": 1, "groups": 3, "per_group": 6, "system_len": 2048,
                             "question_len": 128}]}
    text = render([result])
    assert "dp (2 schedulers), threads 1, gsp seed 1:" in text and "maru 1024M" in text
    doc = {"machine": {"cores": 2, "loadavg_at_end": [1.0, 1.0, 1.0], "time": "t"}, "results": [result]}
    assert [p.rsplit("/", 1)[1] for p in render_charts(doc, str(tmp_path))] == ["serving.png"]


def test_the_plan_runs_the_wait_arms_only_where_a_worker_can_wait():
    import argparse
    from tools.benchmarks.serving_load import plan
    args = argparse.Namespace(serving_topologies=["dp"], serving_threads=None, serving_pools=[1 << 30],
                              serving_backends=["file", "maru", "maru-spin", "maru-sleep"])
    assert plan(args) == [("dp", "1", "file", None), ("dp", "1", "maru", 1 << 30), ("dp", "default", "file", None),
                          ("dp", "default", "maru", 1 << 30), ("dp", "default", "maru-spin", 1 << 30),
                          ("dp", "default", "maru-sleep", 1 << 30)]


def test_rounds_run_the_l3s_forward_and_backward_rotating_within_a_deployment_and_thread_setting():
    from tools.benchmarks.serving_load import rotated
    steps = [("dp", "1", "file", None), ("dp", "1", "maru", 1), ("dp", "1", "mooncake", 1), ("one", "1", "file", None),
             ("one", "1", "maru", 1)]
    assert rotated(steps, 0) == steps
    assert [s[2] for s in rotated(steps, 1)] == ["mooncake", "maru", "file", "maru", "file"]
    assert [s[2] for s in rotated(steps, 2)] == ["maru", "mooncake", "file", "maru", "file"]
    assert [s[2] for s in rotated(steps, 3)] == ["file", "mooncake", "maru", "file", "maru"]
    for r in range(6):
        assert [s[:2] for s in rotated(steps, r)] == [s[:2] for s in steps]  # deployments keep their order
    firsts = [[s[2] for s in rotated(steps, r)][0] for r in range(6)]
    assert sorted(firsts) == ["file", "file", "maru", "maru", "mooncake", "mooncake"]  # 6 rounds: each L3 runs first twice


def test_rounds_pool_each_cells_runs_and_keep_round_0s_greedy_check():
    from tools.benchmarks.serving_load import pooled
    G = 1 << 30

    def cell(backend, budget, rnd, ttfts, check):
        runs = [{"ttft_mean_ms": t, "storage_tokens": 100, "round": rnd} for t in ttfts]
        return {**_cell("1", backend, budget, ttfts[0], 100), "runs": runs, "check": check, "texts": [str(rnd)]}
    same = {"prompts": 2, "same": [True, True]}
    cells = [cell("file", None, 0, [500, 700], same), cell("maru", G, 0, [400], same),
             cell("file", None, 1, [600, 900, 800], None), cell("maru", G, 1, [900], None)]
    file, maru = pooled(cells)
    assert [r["round"] for r in file["runs"]] == [0, 0, 1, 1, 1]
    assert file["median"]["ttft_mean_ms"] == 700 and file["spread"]["ttft_mean_ms"] == [500, 900]
    assert maru["median"]["ttft_mean_ms"] == 650 and maru["check"] == same and maru["texts"] == ["1"]
    lost = pooled([cell("maru", G, 1, [900], None)])  # round 0's deployment failed: no greedy figure
    assert lost[0]["check"] == {"prompts": 0}


def test_closing_ends_idle_connections_quietly(upstreams, capfd):
    import socket
    rr = RoundRobin([upstreams[0].url])
    idle = socket.create_connection(("127.0.0.1", rr.port), timeout=10)  # connects and says nothing
    _post(rr.url, {})
    rr.close()
    assert idle.recv(1) == b""  # closed by the forwarder
    idle.close()
    assert "Task was destroyed" not in capfd.readouterr().err


def test_closing_ends_a_relay_in_flight_quietly(capfd, caplog):
    """A request whose upstream has not answered yet when the forwarder closes: its connection task ends
    without asyncio logging a cancelled task's "exception"."""
    import socket
    import time

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            time.sleep(2)

        def log_message(self, *a):
            pass
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    rr = RoundRobin([f"http://127.0.0.1:{slow.server_address[1]}"])
    try:
        client = socket.create_connection(("127.0.0.1", rr.port), timeout=10)
        client.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        deadline = time.monotonic() + 10
        while not rr.routed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rr.routed  # relayed, the upstream still thinking
        rr.close()
        assert client.recv(1) == b""
        client.close()
    finally:
        slow.shutdown()
        slow.server_close()
    said = capfd.readouterr().err + caplog.text
    assert "Exception in callback" not in said and "Task was destroyed" not in said


def test_cpu_is_counted_per_process_name_of_one_group():
    """A busy child in its own session: its CPU shows under its name, as its group's only process."""
    import os
    import subprocess
    import sys
    import time
    from tools import procgroup
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        before = procgroup.group_cpu(child.pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = procgroup.group_cpu(child.pid)
            if sum(r["cpu_s"] for r in after.values()) >= 0.3:
                break
            time.sleep(0.05)
        spent = procgroup.delta(after, before)
        assert list(after) == [os.path.basename(sys.executable)[:15]] and after[list(after)[0]]["processes"] == 1
        assert sum(r["cpu_s"] for r in spent.values()) >= 0.25
    finally:
        child.kill()
        child.wait()
