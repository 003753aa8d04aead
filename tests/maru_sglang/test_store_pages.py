"""store_pages (maru_sglang/pages.py) on a bare Store: what offering pages that are stored already costs."""

from __future__ import annotations

import numpy as np

from maru_sglang.pages import store_pages
from maru_shm import Store
from maru_shm.index import digest_array, key_digest

PAGE = 8000


def _pieces(buf: np.ndarray, n: int) -> np.ndarray:
    out = np.empty((n, 1, 2), dtype=np.int64)
    out[:, 0, 0] = buf.ctypes.data
    out[:, 0, 1] = PAGE
    return out


def test_offering_stored_pages_again_writes_and_evicts_nothing(pool_path):
    """A full pool (its data area, not its index, is what runs out) whose index has displaced many entries
    from their home slots: offering every stored page again writes none, evicts none and loses none. A
    present page given a block of its own would make room for it by evicting another page, and which pages
    are displaced follows the digests' values."""
    buf = np.random.default_rng(5).integers(0, 256, PAGE, dtype=np.uint8)
    with Store.open(pool_path, "1M", create=True, granule=1024, index_shards=1, index_slots=128) as s:
        keys = [f"page-{i}" for i in range(400)]
        d = digest_array([key_digest(k) for k in keys])
        at = 0
        while s.stats()["evictions"] == 0:  # until the data area is full
            assert all(store_pages(s, keys[at:at + 4], d[at:at + 4], _pieces(buf, 4), PAGE)[0])
            at += 4
        stats = s.stats()
        assert stats["free_units"] == 0 and stats["entries"] < s.index.limit, "the data area must be what is full"
        present = np.flatnonzero(s.resolve(d[:at], full=False).ok)
        h = d[present].view("<u8")
        displaced = int((s.index.probe(h[:, 0], h[:, 1], 1) < 0).sum())  # not in their home slots
        assert displaced >= 8, "few entries displaced from their home slots: the test would test little"
        res, written = store_pages(s, [keys[i] for i in present], d[present], _pieces(buf, len(present)), PAGE)
        assert res == [True] * len(present) and written == 0
        assert s.stats()["evictions"] == stats["evictions"]
        assert s.resolve(d[present], full=False).ok.all()


def test_a_stored_page_offered_again_is_marked_used_as_a_hit_marks_it(pool_path):
    """Pages offered again and found stored get what a hit gives them (a raised ref count): a chain offered
    past a missing page serves hits from its later pages again once the set fills the gap, so they must not
    be the block CLOCK's next victims. Pages not offered again keep their count."""
    buf = np.random.default_rng(7).integers(0, 256, PAGE, dtype=np.uint8)
    with Store.open(pool_path, "1M", create=True, granule=1024) as s:
        keys = [f"page-{i}" for i in range(4)]
        d = digest_array([key_digest(k) for k in keys])
        assert all(store_pages(s, keys[:3], d[:3], _pieces(buf, 3), PAGE)[0])

        def refs():
            return s.alloc.meta_refs[s.resolve(d[:3], full=False).offsets.astype(np.int64) // s.geo.granule].tolist()
        assert refs() == [0, 0, 0], "a page is born unreferenced"
        again = [0, 2, 3]
        res, written = store_pages(s, [keys[i] for i in again], d[again], _pieces(buf, 3), PAGE)
        assert res == [True] * 3 and written == 1
        assert refs() == [1, 0, 1]
