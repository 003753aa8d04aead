"""Capacity: Llama-3.1-8B pages in exact-fit blocks fill the pool file, not 12.5 % of it.

Calls MaruStorage's batch_set_v1 directly (hicache_helpers): a capacity figure needs thousands of
pages and no controller thread changes what lands in the pool; test_sglang_controller.py runs the
controller's own paths.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import logging  # noqa: E402

from hicache_helpers import page_indices, prompt_keys  # noqa: E402
import hicache_helpers as hh  # noqa: E402
from maru_shm import remove_pool  # noqa: E402

pytestmark = pytest.mark.sglang

BATCH = 64


def test_llama_pages_fill_the_pool_until_it_evicts(make_instance, capsys):
    host, backend = make_instance(kind="mha", page_size=1, pages=BATCH, size="256M")
    assert backend.page_bytes == 128 << 10
    hh.fill_random(host, seed=5)
    idx = page_indices(host, 0, BATCH)
    file_pages = backend.store.geo.file_size // backend.page_bytes  # 2048: an upper bound

    written, evicting_at = 0, None
    for b in range(4 * file_pages // BATCH):
        keys = prompt_keys(BATCH, f"cap-{b}")
        assert backend.batch_set_v1(keys, idx) == [True] * BATCH, "a full pool must evict, not fail"
        written += BATCH
        if evicting_at is None and backend.store.stats()["evictions"] > 0:
            evicting_at = written
        if evicting_at is not None and written >= evicting_at + 4 * BATCH:
            break
    assert evicting_at is not None, f"no eviction after {written} pages in a {file_pages}-page file"

    st = backend.store.stats()
    util = st["utilization"]
    with capsys.disabled():
        print(f"\ncapacity: {st['live_bytes'] / backend.page_bytes:.0f} live Llama-3.1-8B pages "
              f"(128 KiB) in a {st['file_bytes'] >> 20} MiB pool file: {util:.2%} of the file "
              f"({st['data_utilization']:.2%} of the data area); first eviction after {evicting_at} pages")
    assert util >= 0.96, f"live pages fill only {util:.2%} of the pool file"
    # the most recent prompt (and the namespace record its keys depend on) survived the pressure
    assert backend.batch_exists(keys) == BATCH
    assert backend.store.check().ok


TINY = dict(layer_num=2, head_num=2, head_dim=64)  # a tiny Llama: 1 KiB of K+V per token in bf16


def _fill_until_evicting(host, backend, tag: str, batch: int = 256) -> int:
    """Write new pages until the pool has evicted for a while; the pages written."""
    idx = page_indices(host, 0, batch)
    written, evicting_at = 0, None
    while evicting_at is None or written < evicting_at + 8 * batch:
        assert backend.batch_set_v1(prompt_keys(batch, f"{tag}-{written}"), idx) == [True] * batch
        written += batch
        if evicting_at is None and backend.store.stats()["evictions"] > 0:
            evicting_at = written
        assert written < 4 * backend.store.geo.file_size // backend.page_bytes, "the pool never evicted"
    return written


def test_tiny_model_pages_below_4_kib_fill_the_pool_densely(make_instance, capsys):
    """1 KiB pages (a tiny model at page_size 1) each got a 4 KiB block when the granule was fixed at 4 KiB:
    a full pool held live pages in a quarter of its file at most. The pool MaruStorage creates is sized for
    its page: an exact class of 1 KiB blocks, and an index that the data area fills first."""
    host, backend = make_instance(kind="mha", page_size=1, pages=256, size="64M", host_kw=TINY)
    assert backend.page_bytes == 1024
    hh.fill_random(host, seed=7)
    _fill_until_evicting(host, backend, "tiny")
    st = backend.store.stats()
    with capsys.disabled():
        print(f"\ncapacity, 1 KiB pages: {st['utilization']:.2%} of the 64 MiB file live "
              f"({st['data_utilization']:.2%} of the data area)")
    assert st["utilization"] >= 0.85, f"live 1 KiB pages fill only {st['utilization']:.2%} of the pool file"
    assert backend.store.check().ok


def test_a_pool_created_for_larger_pages_warns_once_naming_the_knob(make_instance, caplog):
    """A pool another instance created for 128 KiB pages cannot hold 1 KiB pages densely: an instance with
    such pages says so once, naming the key that sizes the pool for them; with that key set on the creator,
    the same two instances share a pool that fits both."""
    caplog.set_level(logging.WARNING, logger="maru_sglang")

    def knob_warnings():
        return [r.getMessage() for r in caplog.records if "maru_min_page_bytes" in r.getMessage()]

    make_instance(kind="mha", page_size=1, pages=2)  # Llama-3.1-8B's 128 KiB pages: it creates the pool
    _, small = make_instance(kind="mha", page_size=1, pages=2, host_kw=TINY)
    small.get_stats()
    assert len(knob_warnings()) == 1, knob_warnings()
    assert "1024-byte pages" in knob_warnings()[0]
    assert "granule" in knob_warnings()[0] and "index would evict first" in knob_warnings()[0]

    caplog.clear()
    pool = hh.shm_path("knob")
    try:
        _, big = make_instance(pool, kind="mha", page_size=1, pages=2, maru={"maru_min_page_bytes": "1K"})
        _, small = make_instance(pool, kind="mha", page_size=1, pages=2, host_kw=TINY)
        assert not small.store.created and small.store.geo.granule == 1024
        assert knob_warnings() == []
    finally:
        remove_pool(pool)
