"""SGLang's own HiCache controller drives MaruStorage across two processes.

Everything between the host pool and the pool file is SGLang 0.5.23's code: its assembler
(build_kv_only_stack) builds the HybridCacheController from a real ServerArgs, its `dynamic` factory
creates MaruStorage, and its backup, prefetch, io and sync threads move the pages. What is patched
(CUDA only) and what the test plays (the scheduler thread's two calls, because UnifiedRadixCache cannot
be imported without the `openai` package) is said in controller_stack.py.

Process A backs up a parent prompt of 8 pages and a child node of 4 chained to it; process B, a second
SGLang instance on the same pool, prefetches: the parent, the chain through the child, a longer prompt
whose stored part is the parent, and a prompt nobody wrote; it reads both instances' figures through
SGLang's StorageMetricsCollector, clears the storage backend and asks again. Both for `interface_v1: 1`
(zero-copy pieces) and the legacy path (flat pages).

A hybrid sliding-window model goes through the same assembler (build_hybrid_swa_stack): backup of the
SWA window and the hybrid hit query. The other modules of this folder call the backend's HiCacheStorage
methods directly, with hicache_helpers imitating the controller, where this real stack cannot reach:
the loads of v2 pools (UnifiedRadixCache stages them), pool shapes whose stacks need more than the CPU
pools give (Mamba, DeepSeek-V4, DSA), fault injection, and tests of one method at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maru_shm import remove_pool

from . import hicache_helpers as hh

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]


def _run(role: str, pool: str, models: str, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.maru_sglang.controller_stack", role, pool,
                           models, mode], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{role} ({mode}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", ["v1", "legacy"])
def test_sglangs_own_controller_across_two_processes(mode, tmp_path):
    """One test per interface, so that each pair of SGLang processes starts once whatever the xdist split;
    each check below says what it proves. v1 and legacy must give the very same figures."""
    pool = hh.shm_path(f"ctl-{mode}")
    try:
        a = _run("writer", pool, str(tmp_path), mode)
        b = _run("reader", pool, str(tmp_path), mode)
    finally:
        remove_pool(pool)
    _built_by_sglang(mode, a)
    _backed_up_and_prefetched_byte_identical(a, b)
    _chained_longer_and_missing_prompts(a, b)
    _figures_through_storage_metrics_collector(a, b)
    _clear_storage_backend_retires_every_page(b)


def _built_by_sglang(mode, a):
    assert a["controller"] == "HybridCacheController" and a["backend"] == "MaruStorage"
    assert a["uses_pieces"] == (mode == "v1")
    assert a["page_bytes"] == 16 * 2 * 2 * 2 * 64 * 2  # tokens x K,V x layers x heads x head_dim x bf16


def _backed_up_and_prefetched_byte_identical(a, b):
    assert (a["parent_done"], a["child_done"]) == (8 * 16, 4 * 16)
    assert b["parent"] == {"hit": 128, "loaded": 128, "digests": a["parent_digests"]}


def _chained_longer_and_missing_prompts(a, b):
    # a child node is found through its parent's hash chain
    assert b["chain"] == {"hit": 192, "loaded": 192, "digests": a["parent_digests"] + a["child_digests"]}
    assert b["longer"] == {"hit": 128, "loaded": 128}  # the hit stops at the stored part
    assert b["miss"] == {"hit": 0, "loaded": 0}


def _figures_through_storage_metrics_collector(a, b):
    # A: two backups (8 and 4 pages); B: three loads (8, 12 and 8 pages)
    assert (a["metrics"]["backup_pgs_count"], a["metrics"]["backup_pgs_sum"]) == (2, 12)
    assert a["metrics"]["backup_bandwidth_count"] == 2
    assert (b["metrics"]["prefetch_pgs_count"], b["metrics"]["prefetch_pgs_sum"]) == (3, 28)
    assert b["metrics"]["prefetch_bandwidth_count"] == 3
    assert a["metrics"]["prefetch_pgs_count"] == b["metrics"]["backup_pgs_count"] == 0


def _clear_storage_backend_retires_every_page(b):
    assert b["cleared"] is True
    assert b["after_clear"] == {"hit": 0, "loaded": 0}


def test_a_hybrid_sliding_window_model_through_sglangs_assembler(tmp_path):
    """A hybrid SWA model built by SGLang's build_hybrid_swa_stack: its SWA host pool reaches MaruStorage
    through the controller's own register_mem_host_pool_v2, the backup thread stores the SWA window with
    batch_set_v2, and the other instance's hit query (batch_exists_v2 with the transfer SGLang's SWA
    component plans) counts a prefix only where its SWA window is stored too.

    The SWA pages are not loaded back here: staging them and filling the planned keys is
    UnifiedRadixCache's work (its buffer pipeline), which cannot be imported (controller_stack.py)."""
    pool = hh.shm_path("ctl-swa")
    try:
        a = _run("swa_writer", pool, str(tmp_path), "v1")
        b = _run("swa_reader", pool, str(tmp_path), "v1")
    finally:
        remove_pool(pool)
    assert a["controller"] == "HybridCacheController" and a["pools"] == "swa 8.0 KiB"
    assert (a["p_done"], a["q_done"]) == (128, 96)
    assert a["stats"]["swa"]["sets"] == 2  # P's window of 2 pages, Q none
    assert b["p"] == [128, {"kv": 8, "swa": 8}]
    assert b["q"][0] == 0, "Q's KV pages are stored but its SWA window is not: nothing restorable"
    assert b["p_short"][0] == 0, "the first 6 pages of P end before its stored SWA window"
    assert b["q_kv_only"] == [96, {"kv": 6}]


def test_a_tiny_models_1_kib_pages_fill_the_pool_before_its_index(tmp_path):
    """SGLang's controller backs up one prompt of 1 KiB pages (a tiny model at page_size 1) filling an eighth
    of the pool file: nothing may be evicted, and the whole prompt must be an L3 hit. A pool sized before the
    page was known had 4 KiB granules and one index slot per 16 KiB: a shard of the index filled at about
    5 % of the file and evicted the prompt's pages, and the prompt then got no hit at all."""
    pool = hh.shm_path("ctl-tiny")
    try:
        r = _run("tiny_prompt", pool, str(tmp_path), "v1")
    finally:
        remove_pool(pool)
    assert r["page_bytes"] == 1024 and r["done"] == 8192
    assert r["evictions"] == 0
    assert r["stored"] == 8192 and r["hit"] == 8192
    assert r["granule"] == 1024 and r["check_ok"]
