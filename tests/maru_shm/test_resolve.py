"""Batched lock-free lookups (maru_shm/datapath/resolve.py) agree with the scalar probe, however far keys sit
from their home slots."""

from __future__ import annotations

import numpy as np

from maru_shm import Store
from maru_shm.index import digest_array, key_digest
from maru_shm.index.table import ABSENT, UNDECIDED
from maru_shm.datapath.resolve import PROBE_WINDOW


def _halves(keys):
    d = digest_array([key_digest(k) for k in keys]).view("<u8")
    return d[:, 0].copy(), d[:, 1].copy()


def test_batch_lookup_matches_the_scalar_probe_in_a_crowded_index(pool_path, make_value):
    """One shard of 128 slots filled to its 7/8 limit: clusters run far past PROBE_WINDOW slots, so hits
    and misses are decided by the home slot, by the windowed probe and by the scalar fallback."""
    with Store.open(pool_path, "16M", create=True, granule=1024, index_shards=1, index_slots=128) as s:
        keys = [f"key-{i}" for i in range(s.index.limit)]
        for i in range(0, len(keys), 16):
            assert all(s.batch_put(keys[i:i + 16], [make_value(k, 1, 2000) for k in keys[i:i + 16]]))
        assert s.stats()["entries"] == len(keys)
        absent = [f"absent-{i}" for i in range(200)]
        h0, h1 = _halves(keys + absent)
        rows = s.index.probe(h0, h1, PROBE_WINDOW)
        outcomes = {"found": 0, "absent": 0, "undecided": 0}
        for k, r in zip(keys + absent, rows.tolist()):
            found = s.index.find(key_digest(k))
            if r == UNDECIDED:
                outcomes["undecided"] += 1
            elif r == ABSENT:
                outcomes["absent"] += 1
                assert found is None, k
            else:
                outcomes["found"] += 1
                assert tuple(s.index.table[r, 2:].tolist()) == found, k
        assert all(outcomes.values()), outcomes  # every way of deciding is exercised
        res = s.resolve(digest_array([key_digest(k) for k in keys + absent]))
        assert res.ok[:len(keys)].all() and not res.ok[len(keys):].any()
        assert (res.lengths[:len(keys)] == 2000).all()
        for k, off in zip(keys, res.offsets[:len(keys)].tolist()):
            assert s._reader.lookup(key_digest(k))[0] == off
        got = [bytearray(2000) for _ in range(len(keys))]
        buf = [np.frombuffer(g, dtype=np.uint8) for g in got]
        assert all(s.batch_get_pieces(keys, [[(b.ctypes.data, 2000)] for b in buf]))
        assert all(bytes(g) == make_value(k, 1, 2000) for k, g in zip(keys, got))


def test_maybe_present_never_misses_a_stored_key_wherever_its_entry_sits(pool_path, make_value):
    """maybe_present: True for every stored key, also those displaced from their home slot, before and after
    deletions shift entries back; False exactly where the home slot is empty (the key is absent)."""
    with Store.open(pool_path, "16M", create=True, granule=1024, index_shards=1, index_slots=128) as s:
        keys = [f"key-{i}" for i in range(100)]
        assert all(s.batch_put(keys, [make_value(k, 1, 2000) for k in keys]))
        absent = [f"absent-{i}" for i in range(200)]
        for stored in (keys, keys[::2]):
            if stored is not keys:
                assert all(s.delete(k) for k in keys[1::2])  # backward-shift deletes move displaced entries
            h0, h1 = _halves(stored)
            assert not (s.index.probe(h0, h1, 1) >= 0).all(), "no key displaced: the test would test nothing"
            assert s.maybe_present(digest_array([key_digest(k) for k in stored])).all()
            d = digest_array([key_digest(k) for k in absent])
            empty_home = s.index.home_entries(*_halves(absent))[:, 2] == 0
            hint = s.maybe_present(d)
            assert hint.tolist() == (~empty_home).tolist() and not hint.all() and hint.any()


def test_leading_run_matches_resolve_in_a_crowded_index(pool_path, make_value):
    """leading_hits (the fused home-slot pass of SGLang's batch_exists) counts exactly the leading keys
    that resolve finds with the asked length: keys at home, displaced keys (a few: the scalar probe;
    many: resolve), a miss anywhere, and a stored length that is not the one asked."""
    with Store.open(pool_path, "16M", create=True, granule=1024, index_shards=1, index_slots=128) as s:
        keys = [f"key-{i}" for i in range(100)]
        for i in range(0, len(keys), 20):
            assert all(s.batch_put(keys[i:i + 20], [make_value(k, 1, 2000) for k in keys[i:i + 20]]))
        assert s.put("short", make_value("short", 1, 1000))
        d = digest_array([key_digest(k) for k in keys])
        h0, h1 = _halves(keys)
        at_home = (s.index.probe(h0, h1, 1) >= 0).tolist()
        assert not all(at_home) and at_home.index(False) > 0  # displaced keys after a run at home
        assert s.leading_hits(digests=d, length=2000) == len(keys)
        assert s.leading_hits(digests=d) == len(keys)
        home = [i for i, h in enumerate(at_home) if h]
        away = [i for i, h in enumerate(at_home) if not h]
        assert len(away) > 8  # all of them: more than the scalar probe takes, resolve decides
        assert s.leading_hits(digests=d[home], length=2000) == len(home)  # the fused pass alone
        few = home[:30] + away[:3] + home[30:]  # a few displaced keys: the scalar probe
        assert s.leading_hits(digests=d[few], length=2000) == len(few)
        assert s.leading_hits(digests=np.concatenate([d[few], digest_array([key_digest("absent")])])) == len(few)
        assert s.leading_hits(digests=d, length=1999) == 0
        for cut in (0, 1, at_home.index(False), 57, 99):
            ks = keys[:cut] + ["absent"] + keys[cut:]
            assert s.leading_hits(ks, length=2000) == cut, cut
        ks = keys[:10] + ["short"] + keys[10:]
        assert s.leading_hits(ks, length=2000) == 10
        assert s.leading_hits(ks) == len(ks)
        assert s.leading_hits(["short"], length=1000) == 1 and s.length_of("short") == 1000
        assert s.length_of(digest=key_digest("short")) == 1000 and s.length_of("absent") is None


def test_leading_run_stops_at_a_damaged_entry(pool_path, make_value):
    """An entry whose offset leaves the data area, or whose block word changed, ends the run there."""
    with Store.open(pool_path, "16M", create=True, granule=1024, index_shards=4) as s:
        keys = [f"key-{i}" for i in range(40)]
        assert all(s.batch_put(keys, [make_value(k, 1, 2000) for k in keys]))
        d = digest_array([key_digest(k) for k in keys])
        h0, h1 = _halves(keys)
        rows = s.index.probe(h0, h1, 1)
        home = [i for i in range(len(keys)) if rows[i] >= 0]
        i, j = home[5], home[20]
        saved = s.index.table[rows[i]].copy()
        s.index.table[rows[i], 3] = np.uint64(s.geo.data_bytes + 4096)
        assert s.leading_hits(digests=d[home], length=2000) == 5
        s.index.table[rows[i]] = saved
        off = int(s.index.table[rows[j], 3])
        s.alloc.meta_q[off // s.geo.granule, 0] += np.uint64(4)  # the block's word moved on (a reuse)
        assert s.leading_hits(digests=d[home], length=2000) == 20
        assert s.leading_hits(digests=d[home]) == 20
