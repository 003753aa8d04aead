"""Which eviction a pool MaruStorage creates gets, and the prefix mark (DESIGN.md section 8).

A plain model's pool gets age stamps, a hybrid model's the count CLOCK: each the rule that meets its model's
goals (BENCHMARKS.md, the prefix-tree family). In an age pool, a lookup with prefix keys marks their stored
copies used. Calls go to MaruStorage's v1 methods with SGLang's own HiCacheStorageExtraInfo.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from hicache_helpers import page_indices, prompt_keys  # noqa: E402
import hicache_helpers as hh  # noqa: E402
from maru_shm import eviction_settings, remove_pool  # noqa: E402
from maru_shm.format.layout import AGE_TICK_OFF, U32  # noqa: E402

pytestmark = pytest.mark.sglang


def _stamps(backend, keys):
    st = backend.store
    found = st.resolve(backend.keyspace.digests(keys), full=False)
    assert found.ok.all()
    return st.alloc.meta_refs[found.offsets.astype("int64") // st.geo.granule].tolist()


@pytest.mark.parametrize("mark", [None, False])
def test_a_plain_model_gets_age_stamps_and_a_lookup_marks_its_prefix(make_instance, pool_path, mark):
    """The pool is created with age stamps. A lookup whose prefix keys (the pages the host holds) are stored
    stamps their copies with the age clock's now, as a hit would; the pages it asks about are not touched. With
    the prefix mark switched off (EvictionSettings.prefix_mark), nothing is stamped."""
    with eviction_settings(prefix_mark=mark):
        host, backend = make_instance(kind="mha", page_size=1, pages=16, size="64M", pool=f"{pool_path}-{mark}")
        hh.fill_random(host, seed=4)
        head, tail = prompt_keys(6, f"head-{mark}"), prompt_keys(4, f"tail-{mark}")
        assert all(backend.batch_set_v1(head, page_indices(host, 0, 6)))
        assert all(backend.batch_set_v1(tail, page_indices(host, 0, 4), HiCacheStorageExtraInfo(prefix_keys=head)))
        st = backend.store
        assert st.policy.age and st.policy.prefix_mark == (mark is None)
        before = _stamps(backend, head + tail)
        U32.pack_into(st.mm, AGE_TICK_OFF, st.policy.tick() + 77)
        assert backend.batch_exists(tail, HiCacheStorageExtraInfo(prefix_keys=head)) == 4
        now = st.policy.tick() & 0xFF
        assert _stamps(backend, tail) == before[6:]
        assert _stamps(backend, head) == ([now] * 6 if mark is None else before[:6])
        assert backend.batch_exists(head) == 6  # a lookup without prefix keys marks nothing
        backend.close()
        remove_pool(f"{pool_path}-{mark}")
