"""Two OS processes, separate SGLang host pools, one pool file: P2P sharing and who may see whose pages.

Two processes calling the backend directly (hicache_helpers), for the namespace rules (TP ranks, MLA,
models, dtypes, layouts) the CPU stack of test_sglang_controller.py does not vary, and the main job.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import digests, page_bytes, page_indices, prompt_keys  # noqa: E402
from maru_shm import Store  # noqa: E402

pytestmark = pytest.mark.sglang



def test_two_processes_share_pages_and_strangers_see_none(make_instance, pool_path):
    # process 1 (this one): an MHA rank and an MLA writer rank store a prompt's pages
    n, m = 24, 12
    host, writer = make_instance(kind="mha", pages=n)
    hh.fill_random(host, seed=11)
    keys = prompt_keys(n, "p2p-mha")
    assert writer.batch_set_v1(keys, page_indices(host, 0, n)) == [True] * n
    mha_want = digests(page_bytes(host, page_indices(host, 0, n)))

    mhost, mla0 = make_instance(kind="mla", pages=m, tp_rank=0, tp_size=2)
    assert mla0.is_writer
    hh.fill_random(mhost, seed=12)
    mkeys = prompt_keys(m, "p2p-mla")
    assert mla0.batch_set_v1(mkeys, page_indices(mhost, 0, m)) == [True] * m
    mla_want = digests(page_bytes(mhost, page_indices(mhost, 0, m)))
    fresh = prompt_keys(4, "p2p-nonwriter")

    # process 2: spawned, builds its own host pools and backends
    plan = {"mha_keys": keys, "mla_keys": mkeys, "nonwriter_keys": fresh}
    got, exitcode = hh.in_child(hh.p2p_reader, pool_path, plan)
    assert "error" not in got, got["error"]
    assert got["pid"] != os.getpid() and exitcode == 0

    # process 2 found the whole prompt and loaded byte-identical pages into other host slots
    assert got["mha_exists"] == n
    assert got["mha_loaded"] == [True] * n
    assert got["mha_digests"] == mha_want
    # another TP rank, another model, another KV dtype: none of those pages
    assert got["strangers"] == {"tp_rank 1 of 2": (0, 0), "another model": (0, 0), "fp16 KV": (0, 0)}

    # MLA pages are replicated over TP ranks: rank 1 of 2 finds and loads what rank 0 wrote
    assert got["mla_exists"] == m
    assert got["mla_loaded"] == [True] * m
    assert got["mla_digests"] == mla_want
    assert got["mla_rank1_sees_mha"] == 0
    # ... but rank 1 is not a storage writer: it reports success and stores nothing
    assert got["mla_rank1_is_writer"] is False
    assert got["nonwriter_set"] == [True] * len(fresh)
    assert got["nonwriter_exists"] == 0
    assert mla0.batch_exists(fresh) == 0

    # the child detached cleanly: only this process's two attachments remain
    with Store.open(pool_path) as s:
        assert s.stats()["processes"] == 3
        assert s.check().ok
