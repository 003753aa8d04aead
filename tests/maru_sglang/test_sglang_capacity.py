"""Capacity (seed 000): Llama-3.1-8B pages in exact-fit blocks fill the pool file, not 12.5 % of it.

Calls MaruStorage's batch_set_v1 directly (hicache_helpers): a capacity figure needs thousands of
pages and no controller thread changes what lands in the pool; test_sglang_controller.py runs the
controller's own paths.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

from hicache_helpers import page_indices, prompt_keys  # noqa: E402
import hicache_helpers as hh  # noqa: E402

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
