"""Eviction that knows prefixes, through MaruStorage (maru_sglang/lineage.py, FORMAT.md section 6a).

SGLang's `extra_info.prefix_keys` (with `hicache_storage_pass_prefix_keys`) links a stored suffix to its
prefix; a suffix whose prefix is gone is stranded at birth; the prefix keys of a read or a write are touched.
Calls go to MaruStorage's v1 methods with SGLang's own HiCacheStorageExtraInfo.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from hicache_helpers import page_indices, prompt_keys  # noqa: E402
import hicache_helpers as hh  # noqa: E402
from maru_shm import remove_pool  # noqa: E402

pytestmark = pytest.mark.sglang

BATCH = 32


def _info(prefix):
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def _head_and_tail(make_instance, seed: int):
    """A backend holding an 8-page head and its 8-page continuation, stored with the head as prefix_keys."""
    host, backend = make_instance(kind="mha", page_size=1, pages=BATCH, size="64M",
                                  maru={"maru_prefix_eviction": True})
    hh.fill_random(host, seed=seed)
    idx = page_indices(host, 0, 8)
    head, tail = prompt_keys(8, f"head{seed}"), prompt_keys(8, f"tail{seed}")
    assert all(backend.batch_set_v1(head, idx))
    assert all(backend.batch_set_v1(tail, idx, _info(head)))
    return backend, head, tail


@pytest.mark.parametrize("setting", [None, "auto", False])
def test_pages_carry_no_relation_records_by_default(make_instance, pool_path, setting):
    """By default (auto) pages carry no relation records: the per-class CLOCK evicts them (a hybrid model's
    too: test_sglang_v2.py)."""
    maru = {} if setting is None else {"maru_prefix_eviction": setting}
    host, backend = make_instance(kind="mha", page_size=1, pages=BATCH, size="64M", maru=maru,
                                  pool=f"{pool_path}-{setting}")
    hh.fill_random(host, seed=3)
    idx = page_indices(host, 0, 8)
    head, tail = prompt_keys(8, "plain-head"), prompt_keys(8, "plain-tail")
    assert all(backend.batch_set_v1(head, idx))
    assert all(backend.batch_set_v1(tail, idx, _info(head)))
    try:
        assert not backend.lineage.enabled
        st, ks = backend.store, backend.keyspace
        assert all(st.relation_of(ks.digest(k)) == (0, 0) for k in head + tail)  # stored, no record
    finally:
        backend.close()
        remove_pool(f"{pool_path}-{setting}")


def test_a_suffix_links_to_its_prefix(make_instance):
    backend, head, tail = _head_and_tail(make_instance, 1)
    st, ks = backend.store, backend.keyspace
    g_head, pos = st.relation_of(ks.digest(head[5]))
    assert pos == 5 and g_head != 0
    g_tail, pos = st.relation_of(ks.digest(tail[0]))
    assert pos == 0 and g_tail not in (0, g_head)
    found = st.resolve(ks.digests(tail))
    granules = found.offsets.astype("int64") >> (st.geo.granule.bit_length() - 1)
    rows, valid = st.att.alloc.relations.of(granules, found.words)
    assert valid.all() and set(rows["parent"].tolist()) == {g_head} and set(rows["branch"].tolist()) == {7}


def test_a_suffix_of_a_stranded_prefix_is_stranded_at_birth(make_instance):
    """A prefix still stored but stranded (a doom covers it: eviction takes it first) serves no hit, and neither
    can a suffix stored after it: the suffix is doomed at birth, as if its prefix were gone."""
    backend, head, tail = _head_and_tail(make_instance, 1)
    st, ks = backend.store, backend.keyspace
    rel = st.att.alloc.relations

    def stranded(keys):
        found = st.resolve(ks.digests(keys))
        rows, valid = rel.of(found.offsets.astype("int64") >> rel.shift, found.words)
        by_group, by_parent = rel.stranded(rows, valid)
        return (by_group | by_parent).tolist()
    assert not any(stranded(tail))
    st.doom_segment(st.relation_of(ks.digest(head[0]))[0])
    assert st.relation_of(ks.digest(head[5])) is None
    idx = page_indices(backend.mem_pool_host, 0, 4)
    later = prompt_keys(4, "after-the-doom")
    assert all(backend.batch_set_v1(later, idx, _info(head[:6])))
    assert all(stranded(later))


def test_a_suffix_whose_prefix_is_gone_goes_first(make_instance, pool_path):
    """Pages stored after a prefix that is no longer in the pool can serve no prefix hit: the pool takes them
    before any page that can, even just read. Without prefix eviction the plain CLOCK keeps them (their ref bit)
    and takes pages that could be hits instead."""
    for on in (True, False):
        host, backend = make_instance(kind="mha", page_size=1, pages=BATCH, size="48M",
                                      maru={"maru_prefix_eviction": on}, pool=f"{pool_path}-{on}")
        hh.fill_random(host, seed=2)
        idx = page_indices(host, 0, BATCH)
        capacity = backend.store.geo.data_bytes // backend.page_bytes
        kept = []
        for b in range(capacity // BATCH // 2):  # half the pool: chains that can be hits
            keys = prompt_keys(BATCH, f"ok-{on}-{b}")
            assert all(backend.batch_set_v1(keys, idx))
            kept.append(keys)
        missing = prompt_keys(4, f"never-stored-{on}")
        orphans = prompt_keys(BATCH, f"orphan-{on}")
        assert all(backend.batch_set_v1(orphans, idx, _info(missing)))
        assert all(backend.batch_get_v1(orphans, idx))  # read, so the plain CLOCK gives them a second chance
        for b in range(capacity // BATCH // 2 + 2):  # then enough new chains to need eviction
            keys = prompt_keys(BATCH, f"new-{on}-{b}")
            assert all(backend.batch_set_v1(keys, idx))
            kept.append(keys)
        st, ks = backend.store, backend.keyspace
        orphans_left = sum(st.batch_exists(digests=ks.digests(orphans)))
        stranded = sum(sum(st.batch_exists(digests=ks.digests(k))) - st.leading_hits(digests=ks.digests(k))
                       for k in kept)
        evictions = st.stats()["evictions"]
        backend.close()
        remove_pool(f"{pool_path}-{on}")
        assert evictions > BATCH
        if on:
            assert orphans_left == 0 and stranded == 0  # the orphans went first; chains lose tails, not heads
        else:
            assert orphans_left > 0


def _records(store, digests):
    """(rows, valid) of the relation records of the values under these digests."""
    found = store.resolve(digests)
    granules = found.offsets.astype("int64") >> (store.geo.granule.bit_length() - 1)
    return store.att.alloc.relations.of(granules, found.words)


def test_a_call_without_prefix_keys_takes_its_stored_leading_pages_as_prefix(make_instance):
    """A hybrid model restores a prefix only where it ends on a window page, so each conversation on one system
    prompt sends that prompt's pages again, with no prefix keys. The pages already stored are the call's prefix:
    its own pages get their own segment, children of the first conversation's. Taken as its own, every such call
    would share one group, and a doom of one conversation's page would strand the others'."""
    host, backend = make_instance(kind="mha", page_size=1, pages=BATCH, size="64M",
                                  maru={"maru_prefix_eviction": True})
    hh.fill_random(host, seed=5)
    idx = page_indices(host, 0, 12)
    shared = prompt_keys(4, "system")
    a, b = shared + prompt_keys(8, "conv-a"), shared + prompt_keys(8, "conv-b")
    assert all(backend.batch_set_v1(a, idx))
    assert all(backend.batch_set_v1(b, idx))
    st, ks = backend.store, backend.keyspace
    rows_a, valid_a = _records(st, ks.digests(a))
    rows_b, valid_b = _records(st, ks.digests(b[4:]))
    assert valid_a.all() and valid_b.all()
    g_a = int(rows_a["group"][0])
    assert set(rows_a["group"].tolist()) == {g_a} and set(rows_a["parent"].tolist()) == {0}
    assert g_a not in rows_b["group"].tolist()
    assert set(rows_b["parent"].tolist()) == {g_a} and set(rows_b["branch"].tolist()) == {3}
    assert (rows_b["depth"] & 0x7FFF).tolist() == list(range(4, 12))  # positions in the call
    assert all(backend.batch_set_v1(shared, idx[:4]))  # every key stored: nothing written, no record changes
    rows, _ = _records(st, ks.digests(shared))
    assert set(rows["group"].tolist()) == {g_a}
