"""No exception escapes a batch call (logged once per cause), and the legacy (non-v1) interface.

Fault injection: calls the backend directly (hicache_helpers) with bad indices, closed pools and
broken stores, which SGLang's controller never produces on purpose.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import torch  # noqa: E402

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import page_bytes, page_indices, prompt_keys  # noqa: E402

pytestmark = pytest.mark.sglang


def _raw(t) -> bytes:
    """Bytes of a tensor (bf16 holds NaNs: never compare such tensors by value)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _errors(caplog, what):
    return [r for r in caplog.records
            if r.name.startswith("maru_sglang") and r.levelno >= logging.ERROR and what in r.getMessage()]


# --------------------------------------------------------------------------- 8. batch calls never raise
def test_host_indices_of_the_wrong_length_fail_softly_and_log_once(mha_llama, caplog):
    host, backend = mha_llama
    keys = prompt_keys(4, "wrong-len")
    short = page_indices(host, 0, 3)  # 3 pages for 4 keys
    for _ in range(2):
        assert backend.batch_set_v1(keys, short) == [False] * 4
        assert backend.batch_get_v1(keys, short) == [False] * 4
    assert len(_errors(caplog, "batch_set_v1")) == 1
    assert len(_errors(caplog, "batch_get_v1")) == 1
    assert backend.batch_exists(keys) == 0  # nothing half-written


@pytest.mark.parametrize("bad", ["size", "minus_one"])
def test_host_indices_outside_the_host_pool_are_refused_and_copy_nothing(mha_llama, caplog, bad):
    """Bug: an index equal to the host pool's size, or -1, was turned into a pointer unchecked: batch_set_v1
    answered [True] (storing bytes from outside the host buffer, or skipping a present key), and
    batch_get_v1 wrote a page past the buffer. Now such a call answers False, logs once and copies nothing.
    The calls an unchecked backend would have answered without copying come first, so that without the
    check this test fails before any copy past the buffer."""
    host, backend = mha_llama
    keys = prompt_keys(2, f"oob-{bad}")
    src = page_indices(host, 0, 2)
    assert backend.batch_set_v1(keys, src) == [True, True]
    outside = host.logical_size if bad == "size" else -1
    idx = torch.cat([page_indices(host, 5, 1), torch.tensor([outside], dtype=torch.int64)])
    for _ in range(2):
        assert backend.batch_set_v1(keys, idx) == [False, False]  # unchecked: [True, True], present keys skipped
    absent = prompt_keys(2, f"oob-absent-{bad}")
    assert backend.batch_get_v1(absent, idx) == [False, False]
    assert len(_errors(caplog, "batch_set_v1")) == 1 and len(_errors(caplog, "batch_get_v1")) == 1
    written = backend.store.stats()["bytes_written"]
    assert backend.batch_set_v1(absent, idx) == [False, False]
    assert backend.batch_exists(absent) == 0 and backend.store.stats()["bytes_written"] == written
    hh.zero_pages(host, idx[:1])
    assert backend.batch_get_v1(keys, idx) == [False, False]  # present keys: a load would write past the buffer
    assert page_bytes(host, idx[:1]) == [bytes(backend.page_bytes)]  # nothing loaded, not even the good page
    assert backend.batch_get_v1(keys, page_indices(host, 5, 2)) == [True, True]  # the pool still works
    assert page_bytes(host, page_indices(host, 5, 2)) == page_bytes(host, src)


class _AskedTier:
    """A second tier that records what it is asked and answers like a detached one: enough to see whether a
    call reached it (Mooncake itself is not needed for that; test_tier2.py runs the real one)."""
    attached = True

    def __init__(self):
        self.asked = []

    def exists(self, keys):
        self.asked.append("batch_exists")
        return 0

    def get_v1(self, keys, host_indices):
        self.asked.append("batch_get_v1")
        return [False] * len(keys)

    def set_v1(self, keys, host_indices):
        self.asked.append("batch_set_v1")
        return [False] * len(keys)

    def exists_v2(self, keys, transfers):
        self.asked.append("batch_exists_v2")

    def get_v2(self, transfers):
        self.asked.append("batch_get_v2")
        return {}

    def set_v2(self, transfers):
        self.asked.append("batch_set_v2")
        return {}

    def count(self, name, n=1):
        pass


def test_refused_host_indices_never_reach_the_second_tier(mha_llama):
    """The pool's misses go to the second tier with the same host indices: a call refused for its indices
    must not pass them on (the tier would copy outside the host buffer in the pool's stead)."""
    from maru_sglang.tiers.twotiers import TwoTiers

    host, backend = mha_llama
    tier = _AskedTier()
    backend.tiers = TwoTiers(backend.local, backend.hybrid, tier, backend.is_writer, backend.log_once)
    keys = prompt_keys(2, "oob-tier")
    inside = page_indices(host, 0, 2)
    assert backend.batch_get_v1(keys, inside) == [False, False] and tier.asked == ["batch_get_v1"]  # misses go on
    tier.asked.clear()
    outside = torch.cat([inside[:1], torch.tensor([host.logical_size], dtype=torch.int64)])
    assert backend.batch_get_v1(keys, outside) == [False, False]
    assert backend.batch_set_v1(keys, outside) == [False, False]
    assert tier.asked == []


def test_page_size_mismatch_fails_softly(make_instance):
    """page_size 4: an index count that is not a whole number of pages trips SGLang's own assertion."""
    host, backend = make_instance(layout="page_first_direct", page_size=4, pages=4)
    keys = prompt_keys(2, "ragged")
    ragged = page_indices(host, 0, 2)[:-1]
    assert backend.batch_set_v1(keys, ragged) == [False, False]
    assert backend.batch_get_v1(keys, ragged) == [False, False]


def test_closed_store_underneath_fails_softly_and_logs_once(mha_llama, caplog):
    host, backend = mha_llama
    keys = prompt_keys(3, "closed")
    idx = page_indices(host, 0, 3)
    assert backend.batch_set_v1(keys, idx) == [True] * 3
    backend.store.close()  # the pool goes away under SGLang's storage threads
    for _ in range(2):
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, idx) == [False] * 3
        assert backend.batch_set_v1(keys, idx) == [False] * 3
        assert backend.exists(keys[0]) is False
        assert backend.get(keys[0], host.get_dummy_flat_data_page()) is None
    for what in ("batch_exists", "batch_get_v1", "batch_set_v1"):
        assert len(_errors(caplog, what)) == 1, (what, [r.getMessage() for r in caplog.records])
    assert backend.get_stats().maru["hits"] == 0


def test_closed_backend_fails_softly(mha_llama):
    host, backend = mha_llama
    keys = prompt_keys(2, "closed-backend")
    backend.close()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, page_indices(host, 0, 2)) == [False, False]
    assert backend.batch_set_v1(keys, page_indices(host, 0, 2)) == [False, False]
    assert backend.get_stats() is not None


# --------------------------------------------------------------------------- 9. legacy interface
@pytest.mark.parametrize("kind, layout, page_size", [
    ("mha", "page_first_direct", 1), ("mha", "page_first_direct", 4), ("mha", "layer_first", 2),
    ("mha", "page_first", 2), ("mla", "page_first_direct", 1), ("mla", "layer_first", 2),
])
def test_legacy_interface_round_trip(make_instance, kind, layout, page_size):
    """What HiCacheController._generic_page_set / _generic_page_get do when interface_v1 is absent."""
    host, backend = make_instance(kind=kind, layout=layout, page_size=page_size, pages=8, v1=False)
    hh.fill_random(host, seed=9)
    n = 3
    keys = prompt_keys(n, f"legacy-{kind}-{layout}")
    src = page_indices(host, 0, n)
    want = page_bytes(host, src)

    data = [host.get_data_page(int(src[i * page_size])) for i in range(n)]  # flat page tensors
    flat_want = [_raw(d) for d in data]
    assert backend.batch_set(keys, data) is True
    assert all(backend.exists(k) for k in keys)
    assert backend.batch_exists(keys) == n

    pages = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(p is not None for p in pages)
    assert [_raw(p) for p in pages] == flat_want

    dst = page_indices(host, 4, n)
    hh.zero_pages(host, dst)
    for i, p in enumerate(pages):
        host.set_from_flat_data_page(int(dst[i * page_size]), p)
    assert page_bytes(host, dst) == want

    # single-key calls, a miss, a wrong-size target, and set of a present key
    one = backend.get(keys[0], host.get_dummy_flat_data_page())
    assert one is not None and _raw(one) == flat_want[0]
    assert backend.get(prompt_keys(1, "absent")[0], host.get_dummy_flat_data_page()) is None
    assert backend.get(keys[0], host.get_dummy_flat_data_page()[:-1]) is None
    assert backend.set(keys[0], data[1]) is True  # present: skipped, not rewritten
    assert _raw(backend.get(keys[0], host.get_dummy_flat_data_page())) == flat_want[0]
    assert backend.batch_set([], []) is True
    assert backend.exists(prompt_keys(1, "absent")[0]) is False


def test_legacy_and_v1_instances_never_exchange_pages_in_another_byte_order(make_instance):
    """layer_first MHA: a flat legacy page is K0 K1 .. V0 V1 .., v1 pieces are K0 V0 K1 V1 ..

    A v1 instance must not load a legacy instance's page as if it were its own format: it either does not
    see it or loads exactly the same page.
    """
    lhost, legacy = make_instance(layout="layer_first", page_size=2, pages=4, v1=False)
    vhost, v1 = make_instance(layout="layer_first", page_size=2, pages=4, v1=True)
    hh.fill_random(lhost, 21)
    keys = prompt_keys(2, "mixed")
    assert legacy.batch_set(keys, [lhost.get_data_page(i * 2) for i in range(2)]) is True
    want = page_bytes(lhost, page_indices(lhost, 0, 2))
    dst = page_indices(vhost, 2, 2)
    loaded = v1.batch_get_v1(keys, dst)
    got = page_bytes(vhost, dst)
    for i in range(2):
        assert not loaded[i] or got[i] == want[i], f"page {i} loaded in the wrong byte order"


def test_a_pool_whose_creator_died_mid_format_is_formatted_again_on_restart(pool_path, make_instance):
    """An instance killed while creating the pool (crash point init.mid_header) must not stop every
    restart: MaruStorage opens with create=True, which makes the pool the dead creator did not publish."""
    import os
    import signal
    import subprocess
    import sys
    env = dict(os.environ, MARU_SHM_CRASH_AT="init.mid_header")
    p = subprocess.run([sys.executable, "-c", "import sys; from maru_shm import Store; "
                        "Store.open(sys.argv[1], '64M', create=True)", pool_path], env=env, timeout=60)
    assert p.returncode == -signal.SIGKILL
    folder, name = os.path.split(pool_path)
    assert not os.path.exists(pool_path)  # the pool was being built unnamed: nothing is left of it
    assert not [n for n in os.listdir(folder) if n.startswith(f".{name}.maru-new-")]
    host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=4)
    hh.fill_random(host, seed=3)
    keys = prompt_keys(4, "after-restart")
    assert backend.batch_set_v1(keys, page_indices(host, 0, 4)) == [True] * 4
    assert backend.batch_exists(keys) == 4


def test_the_namespace_record_is_pinned_and_survives_a_pool_full_of_pages(make_instance):
    """A full pool evicts: the namespace record (the clear() nonce) must not be among the victims, or a
    process that never saw the nonce would draw another and miss every page of the namespace."""
    from maru_shm.index import key_digest
    host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=16, size="64M")
    hh.fill_random(host, seed=5)
    backend.batch_exists(prompt_keys(1, "warm"))  # reads (and if needed writes) the record
    rec = f"__maru_ns__/{backend.keyspace.base}"
    store = backend.store
    off = store.index.find(key_digest(rec))[1]
    assert store.mm[store.alloc.meta_off(off) + 31] & 1  # FLAG_PINNED
    nonce = store.get(rec)
    for r in range(40):  # 640 pages of 128 KiB through a 64 MiB pool: it evicts all the time
        keys = prompt_keys(16, f"fill{r}")
        backend.batch_set_v1(keys, page_indices(host, 0, 16))
    assert store.stats()["evictions"] > 0
    assert store.get(rec) == nonce


def test_legacy_and_v1_report_the_same_metrics(make_instance):
    """160 pages written and read back through the legacy calls show in get_stats() as through v1."""
    stats = {}
    for v1 in (True, False):
        host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=16, v1=v1,
                                      size="128M")
        hh.fill_random(host, seed=11)
        backend.get_stats()  # drain what registration left
        for r in range(10):
            keys = prompt_keys(16, f"metrics-{v1}-{r}")
            if v1:
                assert backend.batch_set_v1(keys, page_indices(host, 0, 16)) == [True] * 16
                assert backend.batch_get_v1(keys, page_indices(host, 0, 16)) == [True] * 16
            else:
                assert backend.batch_set(keys, [host.get_data_page(i) for i in range(16)]) is True
                got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
                assert all(p is not None for p in got)
        m = backend.get_stats()
        stats[v1] = (sum(m.backup_pgs), sum(m.prefetch_pgs), len(m.backup_bandwidth), len(m.prefetch_bandwidth),
                     {k: m.maru[k] for k in ("sets", "set_skipped", "hits", "misses", "bytes_written",
                                             "bytes_read")})
        backend.close()
    assert stats[True] == stats[False]
    assert stats[False][0] == 160 and stats[False][4]["sets"] == 160
