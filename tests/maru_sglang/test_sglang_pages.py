"""Page size derivation, v1 round trips per layout, leading-run lookups, skip of present keys, exact length.

Calls MaruStorage's v1 methods directly (hicache_helpers): per layout, per page size, exact lengths
and the skip of present keys, which the controller's threads would only hide behind their queues.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import page_bytes, page_indices, prompt_keys  # noqa: E402
from maru_shm import Store  # noqa: E402
from maru_shm.format.layout import KIND_EXACT  # noqa: E402
from maru_shm.index import digest_array  # noqa: E402

pytestmark = pytest.mark.sglang


def _exact_class_in_file(path: str, nbytes: int) -> bool:
    """Seen through a second attachment: the class lives in the shared file, not in one process."""
    with Store.open(path) as s:
        info = s.alloc.class_for(nbytes)
        return info is not None and info.kind == KIND_EXACT and info.block == nbytes


# --------------------------------------------------------------------------- 1. page size derivation
@pytest.mark.parametrize("page_size, expected", [(1, 131072), (16, 2 << 20)])
def test_mha_llama_page_bytes_become_an_exact_class(make_instance, pool_path, page_size, expected):
    host, backend = make_instance(kind="mha", page_size=page_size, pages=2)
    assert host.get_size_per_token() * host.page_size == expected
    assert backend.page_bytes == expected
    assert backend.store.alloc.class_for(expected).kind == KIND_EXACT
    assert _exact_class_in_file(pool_path, expected)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_page_bytes_become_an_exact_class(make_instance, pool_path, page_size):
    host, backend = make_instance(kind="mla", page_size=page_size, pages=8)
    per_token = host.get_size_per_token()
    assert per_token == (512 + 64) * 2 * hh.MLA_GEOMETRY["layer_num"]  # bf16 latent + rope, every layer
    assert backend.page_bytes == per_token * page_size
    assert _exact_class_in_file(pool_path, per_token * page_size)


def test_a_page_below_4_kib_gets_an_exact_class_in_the_pool_it_creates(make_instance, pool_path):
    """A 1-layer MLA page (1152 B) is below the default 4 KiB granule: the pool this instance creates gets a
    granule that fits it, so the page has an exact class instead of a 4 KiB block."""
    host, backend = make_instance(kind="mla", pages=4, host_kw=dict(layer_num=1))
    assert backend.page_bytes == 1152
    assert backend.store.geo.granule == 1024
    assert _exact_class_in_file(pool_path, 1152)
    hh.fill_random(host, 5)
    keys = prompt_keys(2, "tiny")
    assert backend.batch_set_v1(keys, page_indices(host, 0, 2)) == [True, True]
    assert backend.batch_get_v1(keys, page_indices(host, 2, 2)) == [True, True]
    assert page_bytes(host, page_indices(host, 2, 2)) == page_bytes(host, page_indices(host, 0, 2))


# --------------------------------------------------------------------------- 2. v1 round trips
LAYOUTS = [
    pytest.param("mha", "page_first_direct", 1, 2, id="mha-page_first_direct-ps1"),
    pytest.param("mha", "page_first_direct", 16, 2, id="mha-page_first_direct-ps16"),
    pytest.param("mha", "layer_first", 1, 2 * hh.LLAMA_8B["layer_num"], id="mha-layer_first-ps1"),
    pytest.param("mha", "layer_first", 4, 2 * hh.LLAMA_8B["layer_num"], id="mha-layer_first-ps4"),
    pytest.param("mha", "page_first", 1, 2, id="mha-page_first-ps1"),
    pytest.param("mha", "page_first", 4, 2, id="mha-page_first-ps4"),
    pytest.param("mla", "page_first_direct", 1, 1, id="mla-page_first_direct-ps1"),
    pytest.param("mla", "page_first_direct", 16, 1, id="mla-page_first_direct-ps16"),
    pytest.param("mla", "page_first", 4, 1, id="mla-page_first-ps4"),
    pytest.param("mla", "layer_first", 4, hh.MLA_GEOMETRY["layer_num"], id="mla-layer_first-ps4"),
]


@pytest.mark.parametrize("kind, layout, page_size, pieces", LAYOUTS)
def test_v1_round_trip_is_byte_identical(make_instance, kind, layout, page_size, pieces):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    host, backend = make_instance(kind=kind, layout=layout, page_size=page_size, pages=8)
    assert backend.pieces_per_page == pieces
    assert backend.page_bytes == host.get_size_per_token() * page_size
    hh.fill_random(host, seed=7)
    src, dst = page_indices(host, 0, 3), page_indices(host, 4, 3)
    hh.zero_pages(host, dst)
    want = page_bytes(host, src)
    assert page_bytes(host, dst) != want
    keys = prompt_keys(3, f"{kind}-{layout}-{page_size}")
    info = HiCacheStorageExtraInfo(prefix_keys=[])

    assert backend.batch_exists(keys, info) == 0
    assert backend.batch_set_v1(keys, src, info) == [True] * 3
    assert backend.batch_exists(keys, info) == 3
    assert backend.batch_get_v1(keys, dst, info) == [True] * 3
    assert page_bytes(host, dst) == want


def test_batch_exists_counts_the_leading_run_only(mha_llama):
    host, backend = mha_llama
    keys = prompt_keys(6, "gap")
    present = [0, 1, 2, 4, 5]  # key 3 missing: a gap in the middle
    idx = page_indices(host, 0, 6)
    assert backend.batch_set_v1([keys[i] for i in present], idx[present]) == [True] * 5
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists(keys[4:]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.batch_get_v1([], idx[:0]) == []


def test_batch_set_v1_skips_keys_already_present(mha_llama, pool_path):
    host, backend = mha_llama
    keys = prompt_keys(4, "skip")
    first = page_indices(host, 0, 4)
    original = page_bytes(host, first)
    assert backend.batch_set_v1(keys, first) == [True] * 4
    written = backend.store.stats()["bytes_written"]

    other = page_indices(host, 8, 4)  # different bytes under the same keys
    assert page_bytes(host, other) != original
    assert backend.batch_set_v1(keys, other) == [True] * 4
    assert backend.store.stats()["bytes_written"] == written, "a present page was rewritten"
    assert backend.get_stats().maru["bytes_written"] == 4 * backend.page_bytes

    dst = page_indices(host, 12, 4)
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    assert page_bytes(host, dst) == original


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layout_without_page_buffer_meta_is_refused_at_register(pool_path, kind):
    """SGLang's page_unified host pools raise in get_page_buffer_meta: refuse them, naming the layouts that work."""
    make_host = hh.make_mha_host if kind == "mha" else hh.make_mla_host
    host = make_host("page_unified", page_size=1, pages=8)
    with pytest.raises(ValueError) as err:
        hh.create_backend(host, hh.storage_config(hh.extra_config(pool_path), mla=(kind == "mla")))
    msg = str(err.value)
    assert "page_unified" in msg
    for layout in ("page_first_direct", "page_first", "layer_first"):
        assert layout in msg


def test_mla_dcp_rank_registers_with_the_logical_page(make_instance, pool_path):
    """With decode context parallelism, SGLang's host indices count the widened (logical) page."""
    host = hh.make_mla_host(page_size=2, pages=8, dcp_size=2, dcp_rank=0)
    assert host.page_size == 1 and host.logical_page_size == 2
    cfg = hh.storage_config(hh.extra_config(pool_path), mla=True, tp_rank=0, tp_size=2, dcp_size=2, dcp_rank=0,
                            logical_page_size=2)
    backend = hh.create_backend(host, cfg)
    try:
        assert backend.page_bytes == host.get_size_per_token()  # one physical row per logical page on this rank
        hh.fill_random(host, 3)
        keys = prompt_keys(2, "dcp")
        assert backend.batch_set_v1(keys, page_indices(host, 0, 2)) == [True, True]
        assert backend.batch_get_v1(keys, page_indices(host, 4, 2)) == [True, True]
        assert page_bytes(host, page_indices(host, 4, 2)) == page_bytes(host, page_indices(host, 0, 2))
    finally:
        backend.close()


# --------------------------------------------------------------------------- 3. exact length
@pytest.mark.parametrize("delta", [-4096, +4096, -1])
def test_value_of_another_length_is_never_loaded(mha_llama, delta):
    host, backend = mha_llama
    keys = prompt_keys(3, f"len{delta}")
    src = page_indices(host, 0, 3)
    want = page_bytes(host, src)
    assert backend.batch_set_v1([keys[0], keys[2]], page_indices(host, 0, 3)[[0, 2]]) == [True, True]
    bad = bytes([0xAB]) * (backend.page_bytes + delta)
    assert backend.store.put(backend.keyspace.prefix() + keys[1], bad)

    assert backend.batch_exists(keys) == 1
    dst = page_indices(host, 8, 3)
    hh.zero_pages(host, dst)
    assert backend.batch_get_v1(keys, dst) == [True, False, True]
    got = page_bytes(host, dst)
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == bytes(backend.page_bytes), "a rejected value must not leave bytes in the host page"

    # storing the real page replaces the wrong-length value instead of skipping it as present
    assert backend.batch_set_v1([keys[1]], src[1:2]) == [True]
    assert backend.batch_exists(keys) == 3
    assert backend.batch_get_v1(keys[1:2], dst[1:2]) == [True]
    assert page_bytes(host, dst[1:2]) == want[1:2]


def test_a_present_page_is_never_written_again_wherever_its_index_entry_sits(make_instance):
    """720 keys stored, then each offered again with other bytes: every key keeps its first copy, also the
    ~1 % whose entries are displaced from their home slot."""
    host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=16, size="256M")
    idx = page_indices(host, 0, 16)
    firsts = {}
    for r in range(45):
        hh.fill_random(host, seed=100 + r)
        keys = prompt_keys(16, f"twice-{r}")
        assert backend.batch_set_v1(keys, idx) == [True] * 16
        firsts.update(zip(keys, page_bytes(host, idx)))
    store = backend.store
    displaced = 0
    for r in range(45):
        keys = prompt_keys(16, f"twice-{r}")
        h = digest_array(backend._digests(keys)).view("<u8")
        displaced += int((store.index.probe(h[:, 0], h[:, 1], 1) < 0).sum())  # not in its home slot
        hh.fill_random(host, seed=900 + r)  # other bytes under the same keys
        assert backend.batch_set_v1(keys, idx) == [True] * 16
    assert displaced > 0, "no entry displaced from its home slot: the test would not test the exact skip"
    for r in range(45):
        keys = prompt_keys(16, f"twice-{r}")
        hh.zero_pages(host, idx)
        assert backend.batch_get_v1(keys, idx) == [True] * 16
        assert page_bytes(host, idx) == [firsts[k] for k in keys]


def test_a_key_named_twice_in_one_call_keeps_its_first_copy(make_instance):
    host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=16)
    hh.fill_random(host, seed=21)
    idx = page_indices(host, 0, 4)
    want = page_bytes(host, idx)
    keys = prompt_keys(3, "dup")
    assert backend.batch_set_v1([keys[0], keys[1], keys[0], keys[2]], idx) == [True] * 4
    hh.zero_pages(host, idx)
    assert backend.batch_get_v1(keys, idx[:3]) == [True] * 3
    assert page_bytes(host, idx[:3]) == [want[0], want[1], want[3]]
