"""The maru_* extra-config keys, and clear() / close() / get_stats().

Calls the backend's methods directly (hicache_helpers) to test one extra-config key, clear(), close()
or get_stats() at a time; the same calls made by SGLang's controller are in test_sglang_controller.py.
"""

from __future__ import annotations

import logging
import os
import time

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import page_indices, prompt_keys  # noqa: E402
from maru_sglang.config import DEFAULT_PATH, DEFAULT_POOL_SIZE, MaruConfig  # noqa: E402
from maru_shm import Store  # noqa: E402

pytestmark = pytest.mark.sglang


def _maru_records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name.startswith("maru_sglang") and r.levelno >= level]


# --------------------------------------------------------------------------- 6. config
@pytest.mark.parametrize("extra", [None, {}, {"backend_name": "maru", "interface_v1": 1}])
def test_defaults_parse_without_creating_anything(extra, caplog):
    existed = os.path.exists(DEFAULT_PATH)
    before = os.stat(DEFAULT_PATH).st_mtime_ns if existed else None
    c = MaruConfig.from_extra_config(extra)
    assert c.path == DEFAULT_PATH == "/dev/shm/maru_shm"
    assert c.pool_size == DEFAULT_POOL_SIZE == 4 << 30
    assert c.chunk_size_bytes is None and c.timeout_s > 0 and c.instance_id
    assert os.path.exists(DEFAULT_PATH) == existed
    if existed:
        assert os.stat(DEFAULT_PATH).st_mtime_ns == before
    assert not _maru_records(caplog)


def test_maru_server_keys_are_accepted_with_one_warning(make_instance, caplog):
    caplog.set_level(logging.INFO, logger="maru_sglang")
    server = {"maru_server_url": "tcp://localhost:5555", "maru_use_async_rpc": True, "maru_max_inflight": 64}
    _, backend = make_instance(pages=2, maru=server)
    assert backend.page_bytes == 128 << 10  # works as usual
    warnings = _maru_records(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    for key in server:
        assert key in warnings[0].getMessage()


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_the_retired_prefix_eviction_key_is_accepted_and_ignored_with_one_warning(make_instance, caplog, value):
    """maru_prefix_eviction turned on relation records, which are gone: a config naming it still loads, says once
    that the key is ignored, and the backend works as usual."""
    host, backend = make_instance(pages=4, maru={"maru_prefix_eviction": value})
    warnings = [r.getMessage() for r in _maru_records(caplog)]
    assert len(warnings) == 1 and "maru_prefix_eviction" in warnings[0] and "ignor" in warnings[0], warnings
    keys = prompt_keys(4, f"retired-{value}")
    assert all(backend.batch_set_v1(keys, page_indices(host, 0, 4)))
    assert backend.batch_exists(keys) == 4


def test_unknown_maru_keys_are_warned_by_name(make_instance, caplog):
    _, backend = make_instance(pages=2, maru={"maru_pool_sise": "1G", "maru_frobnicate": 1, "other_key": 2})
    msgs = [r.getMessage() for r in _maru_records(caplog)]
    assert any("maru_pool_sise" in m and "maru_frobnicate" in m for m in msgs), msgs
    assert not any("other_key" in m for m in msgs)


@pytest.mark.parametrize("key, value", [
    ("maru_pool_size", "lots"), ("maru_pool_size", "-4G"), ("maru_pool_size", 0),
    ("maru_timeout_ms", -5), ("maru_timeout_ms", "soon"), ("maru_timeout_ms", "nan"), ("maru_timeout_ms", "inf"),
    ("maru_timeout_ms", 1e400), ("maru_chunk_size_bytes", "1X"), ("maru_min_page_bytes", "tiny"),
    ("maru_min_page_bytes", 0),
    ("maru_eager_map", "maybe"), ("maru_mode", "rw"), ("maru_path", ""),
    ("maru_copy_threads", 0), ("maru_copy_threads", "many"), ("maru_copy_threads", True), ("maru_copy_threads", 65),
    ("maru_copy_threads", 2.5), ("maru_heal_retry_s", 0), ("maru_heal_retry_s", "soon"), ("maru_heal_retry_s", "nan"),
    ("maru_openmp_wait", "passive"), ("maru_openmp_wait", True),
])
def test_bad_values_fail_at_construction_naming_the_key(pool_path, key, value):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = hh.make_mha_host(pages=2)
    cfg = hh.storage_config(hh.extra_config(pool_path, **{key: value}))
    with pytest.raises(ValueError, match=key):
        StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert not os.path.exists(pool_path), "a rejected config must not create the pool"


def test_pool_too_small_for_one_page_fails_clearly_when_the_pools_are_registered(pool_path):
    """The pool is attached once every host pool is registered; SGLang's attach_storage_backend makes both
    calls, so the error still stops the server at start."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = hh.make_mha_host(page_size=16, pages=2)  # 2 MiB pages
    backend = StorageBackendFactory.create_backend("dynamic", hh.storage_config(hh.extra_config(pool_path, "1M")),
                                                   host)
    try:
        backend.register_mem_pool_host(host)
        with pytest.raises(ValueError) as err:
            backend.on_host_pools_registered()
        msg = str(err.value)
        assert "2097152" in msg and "maru_pool_size" in msg
    finally:
        backend.close()


def test_existing_pool_opens_as_it_is(make_instance, pool_path):
    host, first = make_instance(pages=4, size="32M")
    hh.fill_random(host, 2)
    keys = prompt_keys(2, "existing")
    assert first.batch_set_v1(keys, page_indices(host, 0, 2)) == [True, True]
    size = os.path.getsize(pool_path)

    _, second = make_instance(pages=4, size="128M")  # another maru_pool_size: the pool stays as it is
    assert os.path.getsize(pool_path) == size == second.store.geo.file_size
    assert not second.store.created
    assert second.batch_exists(keys) == 2


# --------------------------------------------------------------------------- 7. clear, close, stats
def test_clear_retires_only_this_namespace(make_instance, pool_path):
    host, llama = make_instance(pages=8)
    hh.fill_random(host, 4)
    qhost, qwen = make_instance(pages=8, model="Qwen/Qwen2.5-7B-Instruct")
    hh.fill_random(qhost, 5)
    _, llama_twin = make_instance(pages=8)  # another instance of the same model and rank: same namespace
    keys = prompt_keys(4, "clear")
    assert llama.batch_set_v1(keys, page_indices(host, 0, 4)) == [True] * 4
    assert qwen.batch_set_v1(keys, page_indices(qhost, 0, 4)) == [True] * 4
    assert llama_twin.batch_exists(keys) == 4

    llama.clear()
    assert llama.batch_exists(keys) == 0
    assert llama.batch_get_v1(keys, page_indices(host, 4, 4)) == [False] * 4
    assert qwen.batch_exists(keys) == 4  # another namespace keeps its pages
    assert qwen.batch_get_v1(keys, page_indices(qhost, 4, 4)) == [True] * 4
    time.sleep(0.06)  # other attachments re-read the namespace record at most every 50 ms
    assert llama_twin.batch_exists(keys) == 0

    # the cleared namespace is usable again at once
    assert llama.batch_set_v1(keys[:2], page_indices(host, 0, 2)) == [True, True]
    assert llama.batch_exists(keys) == 2


def test_evicted_namespace_record_does_not_hide_the_pages(make_instance, pool_path):
    """The nonce record is an ordinary small value a full pool may evict: every attachment that knew
    the nonce restores it, so the namespace's pages stay reachable (only clear() changes it)."""
    host, llama = make_instance(pages=8)
    hh.fill_random(host, 6)
    _, llama_twin = make_instance(pages=8)
    keys = prompt_keys(4, "evicted-record")
    assert llama.batch_set_v1(keys, page_indices(host, 0, 4)) == [True] * 4
    assert llama_twin.batch_exists(keys) == 4
    assert llama.store.delete(f"__maru_ns__/{llama.keyspace.base}")  # as an eviction would
    time.sleep(0.06)  # past the 50 ms namespace cache
    assert llama_twin.batch_exists(keys) == 4
    assert llama.batch_exists(keys) == 4
    assert llama.batch_get_v1(keys, page_indices(host, 4, 4)) == [True] * 4


def test_close_detaches_from_the_pool(make_instance, pool_path):
    _, backend = make_instance(pages=2)
    with Store.open(pool_path) as observer:
        before = observer.stats()["processes"]
        backend.close()
        assert observer.stats()["processes"] == before - 1
        backend.close()  # idempotent
        assert observer.stats()["processes"] == before - 1
    assert backend.batch_exists(prompt_keys(1)) == 0  # and a closed backend still never raises


def test_get_stats_returns_storage_metrics_with_maru_figures(mha_llama):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host, backend = mha_llama
    pb = backend.page_bytes
    keys = prompt_keys(5, "stats")
    assert backend.batch_set_v1(keys[:4], page_indices(host, 0, 4)) == [True] * 4
    assert backend.batch_set_v1(keys[:2], page_indices(host, 0, 2)) == [True] * 2  # present: skipped
    assert backend.batch_get_v1(keys, page_indices(host, 8, 5)) == [True] * 4 + [False]

    m = backend.get_stats()
    assert isinstance(m, StorageMetrics)
    maru = m.maru
    for k in ("hits", "misses", "bytes_read", "bytes_written", "evictions"):
        assert k in maru, k
    assert (maru["hits"], maru["misses"]) == (4, 1)
    assert maru["bytes_read"] == 4 * pb
    assert maru["bytes_written"] == 4 * pb
    assert maru["evictions"] == 0
    assert m.prefetch_pgs == [4] and m.backup_pgs == [4, 2]
    assert len(m.prefetch_bandwidth) == 1 and len(m.backup_bandwidth) == 2
    drained = backend.get_stats()  # SGLang logs per call: the per-operation lists are drained
    assert drained.prefetch_pgs == [] and drained.backup_pgs == []
    assert drained.maru["hits"] == 4  # the running totals are not


def test_get_stats_reads_counters_and_never_scans_the_pool(mha_llama, monkeypatch):
    """SGLang calls get_stats() on its scheduler thread once per step (UnifiedRadixCache.check_hicache_events):
    a scan of the pool there (Store.stats(), tens of milliseconds on a GiB pool) slowed every step."""
    host, backend = mha_llama
    assert backend.batch_set_v1(prompt_keys(2, "scan"), page_indices(host, 0, 2)) == [True] * 2
    monkeypatch.setattr(Store, "stats", lambda self: pytest.fail("get_stats() scanned the pool"))
    m = backend.get_stats()
    assert m.maru["sets"] == 2 and m.maru["evictions"] == 0


def test_get_stats_reads_the_pool_counters_at_most_once_a_second(mha_llama, monkeypatch):
    """A scheduler loop that waits on a prefetch calls get_stats() thousands of times a second: the pool-wide
    counters (Store.counts(), most of the call's cost) are read once per POOL_COUNTS_EVERY_S, the per-call
    figures on every call."""
    from maru_sglang import maru_storage

    host, backend = mha_llama
    assert backend.batch_set_v1(prompt_keys(2, "often"), page_indices(host, 0, 2)) == [True] * 2
    reads, real = [], Store.counts
    monkeypatch.setattr(Store, "counts", lambda self: reads.append(1) or real(self))
    clock = [1e12]  # later than any real monotonic reading
    monkeypatch.setattr(maru_storage.time, "monotonic", lambda: clock[0])
    for _ in range(50):
        m = backend.get_stats()
    assert len(reads) == 1 and m.maru["sets"] == 2 and m.maru["evictions"] == 0
    clock[0] += maru_storage.POOL_COUNTS_EVERY_S
    backend.get_stats()
    assert len(reads) == 2
