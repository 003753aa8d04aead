"""The second tier with the real engine: mooncake_master and a storage process on 127.0.0.1.

Two pool files stand for two nodes. Node A writes; node B's first process gets the pages from Mooncake,
byte-identical, and promotes them; node B's second process hits locally with Mooncake gone. Also: a master
that is down at startup, one killed mid-run, namespaces, clear(), a refused short object, and config errors.
Skipped, with the reason, where the engine cannot be installed (scripts/test.sh installs it).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import hicache_helpers as hh  # noqa: E402
from maru_shm import remove_pool  # noqa: E402
import mooncake_cluster as mc  # noqa: E402
from hicache_helpers import digests, page_bytes, page_indices, prompt_keys  # noqa: E402

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(mc.unavailable() is not None, reason=str(mc.unavailable()))]

# A liveness bound, not a speed figure: MooncakeStore's own constructor blocks ~90 s with the master down, and a
# backend that waited for it would pass this bound by far; a child's start under a loaded 2-core CI run (its torch
# and SGLang imports) took 22.9 s, so the margin below the 90 s is what the bound keeps.
STARTUP_BOUND_S = 60.0


@pytest.fixture
def cluster(tmp_path):
    c = mc.MooncakeCluster(str(tmp_path)).start()
    yield c
    c.stop()


@pytest.fixture
def pools():
    made = []

    def new(tag="node"):
        made.append(hh.shm_path(tag))
        return made[-1]

    yield new
    for p in made:
        remove_pool(p)
        shutil.rmtree(p + ".tier2", ignore_errors=True)


@pytest.fixture
def tiered(pools):
    """tiered(pool, settings, pages=..., **kw) -> (host, backend); closed at teardown."""
    made = []

    def make(pool, settings, **kw):
        host, backend = mc.tiered(pool, settings, **kw)
        made.append(backend)
        return host, backend

    yield make
    for b in made:
        b.close()


def _in_child(pool, settings, keys, expect_tier):
    got, _ = hh.in_child(mc.node_reader, pool, settings, keys, expect_tier, timeout=240)
    assert "error" not in got, got["error"]
    return got


def _write_node_a(tiered, pools, cluster, n, salt):
    host, a = tiered(pools("A"), cluster.settings, pages=n)
    assert mc.wait_attached(a)
    hh.fill_random(host, seed=hash(salt) & 0xFFFF)
    keys = prompt_keys(n, salt)
    assert a.batch_set_v1(keys, page_indices(host, 0, n)) == [True] * n
    return keys, digests(page_bytes(host, page_indices(host, 0, n))), a


def test_node_b_reads_node_a_through_mooncake_then_hits_locally_without_it(cluster, tiered, pools):
    n = 12
    keys, want, a = _write_node_a(tiered, pools, cluster, n, "two-nodes")
    assert a.get_stats().maru["tier2"]["written"] == n
    pool_b = pools("B")

    first = _in_child(pool_b, cluster.settings, keys, expect_tier=True)
    assert first["attached"]
    assert first["local_before"] == 0 and first["exists"] == n
    assert first["loaded"] == [True] * n
    assert first["digests"] == want
    assert first["local_after"] == n  # promoted into node B's pool
    assert first["tier2"]["hits"] == n and first["tier2"]["promoted"] == n

    cluster.stop()  # master and storage process gone
    second = _in_child(pool_b, cluster.settings, keys, expect_tier=False)
    assert second["startup_s"] < STARTUP_BOUND_S
    assert second["local_before"] == n and second["exists"] == n
    assert second["loaded"] == [True] * n and second["digests"] == want
    assert second["tier2"]["state"] == "waiting" and second["tier2"]["hits"] == 0


def test_a_master_down_at_startup_blocks_nothing_and_the_tier_attaches_when_it_answers(tmp_path, tiered, pools):
    c = mc.MooncakeCluster(str(tmp_path))  # not started: nothing listens on its port
    n = 6
    t0 = time.monotonic()
    host, a = tiered(pools("A"), c.settings, pages=2 * n)
    assert time.monotonic() - t0 < STARTUP_BOUND_S
    assert a.tier2.state == "waiting"
    hh.fill_random(host, seed=3)
    early = prompt_keys(n, "early")
    assert a.batch_set_v1(early, page_indices(host, 0, n)) == [True] * n  # the pool serves meanwhile
    assert a.batch_exists(early) == n
    stats = a.get_stats().maru["tier2"]
    assert stats["offline_writes"] == n and stats["written"] == 0
    try:
        c.start()
        assert mc.wait_attached(a)
        late = prompt_keys(n, "late")
        assert a.batch_set_v1(late, page_indices(host, n, n)) == [True] * n
        assert a.get_stats().maru["tier2"]["written"] == n
        _, b = tiered(pools("B"), c.settings, pages=n)
        assert mc.wait_attached(b)
        assert b.batch_exists(late) == n and b.batch_exists(early) == 0  # written while detached: pool only
    finally:
        c.stop()


def test_a_master_killed_mid_run_detaches_and_the_pool_keeps_serving(cluster, tiered, pools):
    n = 8
    keys, want, a = _write_node_a(tiered, pools, cluster, n, "killed")
    host_b, b = tiered(pools("B"), cluster.settings, pages=2 * n)
    assert mc.wait_attached(b)
    assert b.batch_get_v1(keys[:4], page_indices(host_b, 0, 4)) == [True] * 4  # promoted: 4 local now

    cluster.kill_master()
    assert b.batch_exists(keys) == 4  # the local run; the tier's RPC failure detaches it
    assert b.tier2.state == "down"
    got = b.batch_get_v1(keys, page_indices(host_b, 0, n))
    assert got == [True] * 4 + [False] * (n - 4)  # no exception, no stall on a dead tier
    assert digests(page_bytes(host_b, page_indices(host_b, 0, 4))) == want[:4]
    fresh = prompt_keys(3, "while-down")
    assert b.batch_set_v1(fresh, page_indices(host_b, 0, 3)) == [True] * 3
    stats = b.get_stats().maru["tier2"]
    assert stats["detaches"] == 1 and stats["offline_writes"] == 3

    cluster.start_master()  # a new, empty master on the same port: the tier attaches again
    assert mc.wait_attached(b)
    assert b.get_stats().maru["tier2"]["attaches"] == 2


def test_the_tier_keeps_namespaces_and_clear_stays_local(cluster, tiered, pools):
    n = 6
    keys, want, a = _write_node_a(tiered, pools, cluster, n, "namespaces")
    for label, kw in (("tp rank 1 of 2", dict(tp_rank=1, tp_size=2)), ("another model", dict(model="Qwen/Qwen3-8B")),
                      ("fp16 KV", dict(dtype="float16"))):
        h, other = tiered(pools("S"), cluster.settings, pages=n, **kw)
        assert mc.wait_attached(other), label
        assert other.batch_exists(keys) == 0, label
        assert sum(other.batch_get_v1(keys, page_indices(h, 0, n))) == 0, label

    a.clear()  # retires node A's pool namespace, never Mooncake's cluster
    assert a.local_exists(keys) == 0
    host_b, b = tiered(pools("B"), cluster.settings, pages=n)
    assert mc.wait_attached(b)
    assert b.batch_get_v1(keys, page_indices(host_b, 0, n)) == [True] * n
    assert digests(page_bytes(host_b, page_indices(host_b, 0, n))) == want


def test_an_object_of_the_wrong_size_is_never_loaded_as_a_page(cluster, tiered, pools):
    from mooncake.store import MooncakeDistributedStore

    n = 3
    keys, want, a = _write_node_a(tiered, pools, cluster, n, "short")
    # overwrite page 1's K object in Mooncake with a short object, under the exact key MooncakeStore uses
    client = a.tier2._client
    key_k = client._get_mha_buffer_meta(client._tag_keys([keys[1]]), page_indices(a.mem_pool_host, 0, 1))[0][0]
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.settings["master_server_address"]) == 0
    assert raw.remove(key_k) == 0
    assert raw.put(key_k, b"short") == 0

    host_b, b = tiered(pools("B"), cluster.settings, pages=n)
    assert mc.wait_attached(b)
    hh.zero_pages(host_b, page_indices(host_b, 0, n))
    assert b.batch_get_v1(keys, page_indices(host_b, 0, n)) == [True, False, True]
    assert b.local_exists(keys) == 1 and b.local_get_v1(keys[2:], page_indices(host_b, 2, 1)) == [True]
    stats = b.get_stats().maru["tier2"]
    assert stats["read_errors"] == 1 and stats["promoted"] == 2


@pytest.mark.parametrize("value, match", [
    ({"protocol": "tcp"}, "master_server_address must be host:port"),
    ({"master_server_address": "127.0.0.1"}, "master_server_address must be host:port"),
    ({"master_server_address": "127.0.0.1:0"}, "master_server_address must be host:port"),
    ({"master_server_address": "h:1", "extra_backend_tag": "x"}, "extra_backend_tag is set by maru"),
    ({"master_server_address": "h:1", "standalone_storage": True}, "standalone_storage"),
    ("{not json", "not a JSON object"),
    (["127.0.0.1:1"], "expected an object"),
])
def test_bad_tier2_settings_are_refused_by_name(value, match):
    from maru_sglang.config import MaruConfig

    with pytest.raises(ValueError, match=match):
        MaruConfig.from_extra_config({"maru_tier2": value})


def test_the_tier_needs_zero_copy_io(pools):
    with pytest.raises(ValueError, match="interface_v1"):
        hh.make_instance(pools("A"), v1=False, maru={"maru_tier2": {"master_server_address": "127.0.0.1:9"}})


def test_a_hybrid_models_mamba_state_travels_through_the_tier_pool_by_pool(cluster, pools):
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    trail = PoolHitPolicy.TRAILING_PAGES
    n, made = 4, []

    def node(tag, seed):
        anchor = hh.make_mha_host("page_first_direct", page_size=1, pages=2 * n, layer_num=2)
        mamba = hh.make_mamba_host(2 * n)
        for i, h in enumerate((anchor, mamba)):
            hh.fill_random_pages(h, n, seed=seed + i)
        m = hh.create_hybrid_maru(pools(tag), anchor, {"mamba": mamba}, mla=False,
                                  maru={"maru_tier2": cluster.settings, "maru_tier2_retry_s": 0.2})
        made.append(m)
        assert mc.wait_attached(m)
        return anchor, mamba, m

    def mamba_at(key, slot):
        return PoolTransfer(name=PoolName.MAMBA, keys=[key], hit_policy=trail, host_indices=torch.tensor([slot]))

    def query():
        return [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=trail)]

    try:
        keys = prompt_keys(n, "qwen3-next")
        anchor_a, mamba_a, a = node("A", 10)
        assert a.batch_set_v1(keys, page_indices(anchor_a, 0, n)) == [True] * n
        assert a.batch_set_v2([mamba_at(keys[-1], 1)]) == {PoolName.MAMBA: [True]}
        assert a.get_stats().maru["tier2"]["written"] == n + 1

        anchor_b, mamba_b, b = node("B", 20)
        assert b.hybrid.batch_exists_v2(keys, query()).kv_hit_pages == 0  # nothing in node B's pool
        hit = b.batch_exists_v2(keys, query())
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages, hit.restorable_prefix_pages) == \
            (n, {PoolName.KV: n, PoolName.MAMBA: n}, [n])
        assert b.batch_get_v1(keys, page_indices(anchor_b, n, n)) == [True] * n
        assert b.batch_get_v2([mamba_at(keys[-1], n)]) == {PoolName.MAMBA: [True]}
        assert hh.pool_page_bytes(mamba_b, torch.tensor([n]), 1) == hh.pool_page_bytes(mamba_a, torch.tensor([1]), 1)
        assert digests(page_bytes(anchor_b, page_indices(anchor_b, n, n))) == \
            digests(page_bytes(anchor_a, page_indices(anchor_a, 0, n)))
        local = b.hybrid.batch_exists_v2(keys, query())  # promoted, pool by pool
        assert (local.kv_hit_pages, local.restorable_prefix_pages) == (n, [n])
    finally:
        for m in made:
            m.close()


def test_maru_shm_inspect_shows_each_processs_second_tier(cluster, tiered, pools):
    import json
    import subprocess
    import sys

    from maru_sglang.tiers.status import status_dir

    n = 5
    keys, want, a = _write_node_a(tiered, pools, cluster, n, "inspect")
    cli = [os.path.join(os.path.dirname(sys.executable), "maru-shm")]
    deadline, row = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        rep = json.loads(subprocess.run(cli + ["inspect", "--json", a.config.path], capture_output=True, text=True,
                                        check=True).stdout)
        row = next((t for t in rep["tier2"] if t["pid"] == os.getpid()), None)
        if row is not None and row["written"] == n:
            break
        time.sleep(0.1)
    assert row is not None and row["written"] == n, rep["tier2"]
    assert row["state"] == "attached" and row["slot"] == a.store.slot and row["master"].endswith(f":{cluster.port}")
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "CLI.md")).read()
    assert not [k for k in row if f"| `tier2[].{k}` |" not in doc]  # every key documented
    text = subprocess.run(cli + ["inspect", a.config.path], capture_output=True, text=True, check=True).stdout
    assert "Second tier (Mooncake Store)" in text and "attached" in text

    a.close()  # its status file goes with it
    assert not os.path.exists(status_dir(a.config.path))  # the last one out removes the directory
