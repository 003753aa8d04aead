"""The eviction, mixshift and scaling scenarios of `maru-shm bench`, the charts, --json and the progress line.

Everything runs at a tiny size. Nothing here asserts a timing or a hit ratio
against a goal: only the structure of the results, that the figures are
sane (ratios in [0, 1], counts > 0), and that the reference simulators are
exact on hand-made traces.
"""

from __future__ import annotations

import io
import json
import os
import uuid

import numpy as np
import pytest

from tools.benchmarks import runner as bench
from tools.benchmarks.eviction import LRU, clock_hits, eviction, key_sizes, lru_hits, random_hits, zipf_trace
from tools.benchmarks.mixshift import mixshift, shift_trace
from tools.benchmarks.report import render
from tools.benchmarks.scaling import scaling, verdict

FIGURE_KEYS = {"name", "unit", "ours", "spread", "peer", "peer_name", "peer_spread", "ratio", "better", "goal", "met"}


# --------------------------------------------------------------------------- reference simulators
def test_lru_exact_on_hand_made_trace():
    lru = LRU(10)
    # a, b fit (8 bytes); a is refreshed; c evicts b (least recent), b then evicts a, a evicts c
    got = [lru.access(k, 4) for k in "abacbaa"]
    assert got == [False, False, True, False, False, False, True]
    assert list(lru.items) == ["b", "a"] and lru.used == 8


def test_lru_byte_capacity_and_oversized_values():
    lru = LRU(10)
    assert not lru.access("big", 11)  # larger than the whole cache: never kept
    assert "big" not in lru.items and lru.used == 0
    lru.access("x", 6)
    lru.access("y", 3)
    lru.access("z", 3)  # 12 > 10: x (oldest) goes, y and z stay
    assert list(lru.items) == ["y", "z"] and lru.used == 6
    lru.access("w", 10)  # needs the whole cache
    assert list(lru.items) == ["w"] and lru.used == 10


def test_lru_hits_counts_after_warmup():
    trace = np.array([0, 1, 0, 1, 2, 0])
    costs = np.array([5, 5, 5])
    # capacity 10: 0,1 miss; 0,1 hit; 2 evicts 0 (LRU: 0 used at t2, 1 at t3); 0 misses
    assert lru_hits(trace, costs, 10, warm=0) == (2, 6)
    assert lru_hits(trace, costs, 10, warm=2) == (2, 4)
    assert lru_hits(trace, costs, 100, warm=0) == (3, 6)


def test_clock_second_chance_on_hand_made_trace():
    trace = np.array([0, 1, 0, 2, 0, 1])
    costs = np.array([5, 5, 5])
    # ring [0,1], 0 referenced; 2 arrives: 0 gets a second chance, 1 is evicted; 0 hits; 1 misses
    assert clock_hits(trace, costs, 10, warm=0) == (2, 6)


def test_all_policies_agree_when_everything_fits():
    trace = zipf_trace(50, 2000, seed=1)
    sizes = key_sizes(50, seed=2)
    cap = int(sizes.sum())
    unique = len(set(trace.tolist()))
    want = (2000 - unique, 2000)
    assert lru_hits(trace, sizes, cap, 0) == want
    assert clock_hits(trace, sizes, cap, 0) == want
    assert random_hits(trace, sizes, cap, 0) == want


def test_zipf_trace_is_seeded_and_skewed():
    a, b = zipf_trace(1000, 20000, seed=3), zipf_trace(1000, 20000, seed=3)
    assert np.array_equal(a, b)
    assert a.min() >= 0 and a.max() < 1000
    counts = np.bincount(a, minlength=1000)
    top = np.sort(counts)[::-1]
    # Zipf(0.9) over 1000 keys: the most popular key draws about 1/H(1000, 0.9) = 9 % of requests
    assert 0.05 < top[0] / 20000 < 0.14
    assert top[:10].sum() > 0.25 * 20000


# --------------------------------------------------------------------------- eviction, tiny
EVICT_TAG = f"maru-test-evict-{uuid.uuid4().hex[:8]}"  # per xdist worker: other workers run the same fixture
SCALING_TAG = f"maru-test-scaling-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def eviction_result():
    return eviction([16 << 20, 32 << 20], n_keys=300, n_requests=3000, path_prefix=f"/dev/shm/{EVICT_TAG}")


def test_eviction_structure_and_sanity(eviction_result):
    r = eviction_result
    assert r["requests"] == 3000 and r["measured_requests"] == 1500 and len(r["points"]) == 2
    for p in r["points"]:
        for key in ("ours", "lru_file_bytes", "lru_live_bytes", "lru_class_rounded", "clock_live_bytes",
                    "random_live_bytes"):
            assert 0.0 <= p[key] <= 1.0, (key, p[key])
        assert p["requests"] == 1500 and 0 <= p["hits"] <= 1500
        assert p["check_ok"] and p["put_failures"] == 0
        assert 0 < p["live_bytes_mean"] <= p["data_bytes"] < p["pool_bytes"]
        assert p["gap_pp"] == pytest.approx(100 * (p["lru_file_bytes"] - p["ours"]))
        assert p["gap_pp"] == pytest.approx(p["gap_policy_pp"] + p["gap_space_pp"])
        assert p["met"] == (p["gap_pp"] <= p["goal_pp"])
        assert sum(p["space_final"].values()) <= 1.0 + 1e-9
        assert p["evictions"] > 0
        w = p["windows"]
        assert w is not None and w["evictions"] > 0 and 0 <= w["referenced_share"] <= 1
    assert not any(f.startswith(EVICT_TAG) for f in os.listdir("/dev/shm"))


# --------------------------------------------------------------------------- mixshift, tiny
def test_shift_trace_fills_with_a_then_alternates():
    t = shift_trace(50, 20, fill=100, shift=60, seed=3)
    assert len(t) == 160 and (t[:100] < 50).all()
    assert (t[100::2] < 50).all() and (t[101::2] >= 50).all() and (t[101::2] < 70).all()


def test_mixshift_structure_and_sanity():
    tag = f"maru-test-mixshift-{uuid.uuid4().hex[:8]}"
    r = mixshift(16 << 20, n_a=300, n_b=100, fill=1500, shift=3000, path_prefix=f"/dev/shm/{tag}")
    assert r["measured_requests"] == 1500
    for name in ("default", "no_moves", "lru"):
        assert 0.0 <= r[name]["a_hit_ratio"] <= 1.0 and 0.0 <= r[name]["b_hit_ratio"] <= 1.0, r[name]
    for name in ("default", "no_moves"):
        assert r[name]["check_ok"] and r[name]["evictions"] > 0 and 0.0 < r[name]["b_slab_share"] < 1.0
    assert not any(f.startswith(tag) for f in os.listdir("/dev/shm"))
    text = render([{"scenario": "mixshift", **r}]).splitlines()
    assert len(text) == 4 and all(line.startswith("mixshift") for line in text)


# --------------------------------------------------------------------------- scaling, tiny
@pytest.fixture(scope="module")
def scaling_result():
    return scaling((1, 2), duration=0.2, repeat=1, n_keys=16, pool=f"/dev/shm/{SCALING_TAG}", pool_bytes=32 << 20)


def test_scaling_structure_and_sanity(scaling_result):
    r = scaling_result
    assert [p["processes"] for p in r["points"]] == [1, 2]
    assert r["cores"] >= 1 and r["value_bytes"] == 128 << 10
    for p in r["points"]:
        for key in ("ops_s", "copy_ops_s", "cores_busy", "copy_cores_busy", "p50_us", "p99_us", "copy_p99_us"):
            assert p[key]["median"] > 0 and p[key]["spread"][0] <= p[key]["median"] <= p[key]["spread"][1]
        assert p["p50_us"]["median"] <= p["p99_us"]["median"]
        # a get racing an overwrite of its key may miss (Index.put: a torn word/offset pair is a miss)
        assert p["ratio"] > 0 and p["put_failures"] == 0 and p["gets_hit"] > 0.9
        assert p["lock_us_per_op"]["median"] > 0  # the child-side meter saw the puts' locks
        assert 0 <= p["lock_wait_share"]["median"] <= p["lock_share"]["median"] <= 1
    assert r["points"][0]["lock_wait_us_per_op"]["median"] == 0  # alone, nobody to wait for
    assert not any(f.startswith(SCALING_TAG) for f in os.listdir("/dev/shm"))


def _pt(n, ops, copy, cpu=None):
    p = {"processes": n, "ops_s": {"median": ops}, "copy_ops_s": {"median": copy}}
    if cpu is not None:
        p["copy_cores_busy"] = {"median": cpu}
    return p


def test_scaling_verdict():
    v = verdict([_pt(1, 100, 1000), _pt(2, 170, 1900), _pt(4, 160, 1900), _pt(8, 150, 1800)], 2)
    assert v["scales"]["at_processes"] == 2 and v["scales"]["met"] and v["scales"]["speedup"] == 1.7
    assert v["no_collapse"]["met"] and v["no_collapse"]["of_peak"] == pytest.approx(150 / 170)
    assert v["met"]
    v = verdict([_pt(1, 100, 1000), _pt(2, 120, 1900), _pt(4, 90, 1900), _pt(8, 50, 1800)], 2)
    assert not v["scales"]["met"] and not v["no_collapse"]["met"] and v["met"] is False
    v = verdict([_pt(1, 100, 1000, 1.0), _pt(2, 140, 1900, 1.8)], 2)
    assert v["scales"]["cpu_speedup"] == pytest.approx(1.8)
    assert v["scales"]["speedup_of_cpu_gain"] == pytest.approx(0.4 / 0.8)
    v = verdict([_pt(1, 100, 1000), _pt(2, 90, 900)], 1)  # one core: nothing to scale to
    assert v["scales"] is None and v["no_collapse"]["met"]


# --------------------------------------------------------------------------- charts
def test_charts_write_non_empty_pngs(tmp_path, eviction_result, scaling_result):
    pytest.importorskip("matplotlib")
    from tools.benchmarks.charts import main as charts_main
    from tools.benchmarks.charts import render_charts
    doc = {"machine": bench.machine(), "results": [
        {"scenario": "capacity", "value_bytes": 131072, "ours": 0.99, "peer": 0.125},
        {"scenario": "mixed", "ours": 0.91, "fixed_512k": 0.55, "pow2_classes": 0.75, "maru_1m": 0.27},
        {"scenario": "hybrid", "ours": 0.95, "fixed_slots": 0.30, "pow2_classes": 0.85},
        {"scenario": "eviction", **eviction_result},
        {"scenario": "scaling", **scaling_result},
    ]}
    paths = render_charts(doc, str(tmp_path / "a"), note="test")
    assert sorted(os.path.basename(p) for p in paths) == ["eviction.png", "scaling.png", "utilization.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 5000
    src = tmp_path / "results.json"
    src.write_text(json.dumps(doc, default=float))
    assert charts_main([str(src), str(tmp_path / "b")]) == 0
    assert len(os.listdir(tmp_path / "b")) == 3
    # a results file with only some scenarios draws only their charts
    assert render_charts({"results": [{"scenario": "capacity", "value_bytes": 1, "ours": 1, "peer": 1}]},
                         str(tmp_path / "c")) == [str(tmp_path / "c" / "utilization.png")]


# --------------------------------------------------------------------------- --json, figures, progress
TINY = ["--eviction-pools", "16M", "--eviction-keys", "200", "--eviction-requests", "1000",
        "--processes", "1", "--duration", "0.1", "--repeat", "1"]


def test_json_output_is_clean_and_has_figures(capsys, monkeypatch):
    monkeypatch.setattr(bench, "_is_tty", lambda stream: True)  # even on a terminal, --json draws no progress
    assert bench.main(["--only", "eviction", "--only", "scaling", "--json", *TINY]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)
    assert doc["machine"]["cores"] >= 1
    assert [r["scenario"] for r in doc["results"]] == ["eviction", "scaling"]
    for r in doc["results"]:
        assert r["figures"]
        for f in r["figures"]:
            assert FIGURE_KEYS <= set(f), f
            assert f["ours"] is not None
            if f["peer"]:
                assert f["ratio"] == pytest.approx(f["ours"] / f["peer"])
    ev = doc["results"][0]["figures"][0]
    assert ev["goal"] == "within 2.0 pp" and isinstance(ev["met"], bool)


def test_table_output_and_progress_on_a_terminal(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "_is_tty", lambda stream: True)
    assert bench.main(["--only", "eviction", *TINY]) == 0
    out, err = capsys.readouterr()
    assert "exact LRU" in out and "pp" in out and "\r" not in out
    assert err.startswith("\rbench [") and "eviction" in err and err.endswith("\r\x1b[K")


def test_progress_line():
    s = io.StringIO()
    p = bench.Progress(["a", "b"], enabled=True, stream=s)
    p.start(1)
    p.update(0.5, "half", force=True)
    p.done()
    assert "2/2 b: half" in s.getvalue() and " 75%" in s.getvalue()
    s = io.StringIO()
    p = bench.Progress(["a"], enabled=False, stream=s)
    p.start(0)
    p.update(1.0, force=True)
    p.done()
    assert s.getvalue() == ""
