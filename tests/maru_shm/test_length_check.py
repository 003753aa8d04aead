"""The length check of block metas (FORMAT.md section 6): a damaged length is a miss, never wrong bytes.

A block meta's length decides how many bytes a get returns. Its flags byte holds a check of it (bits
1-7: 3 x length mod 125), written with the length by every reservation. Every single flipped bit of the
length or of the check, taken here one by one, must make every read path miss, check() report the
block, and check(repair=True) free it; the check itself refutes every flip of one or two of those bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from maru_shm import Store
from maru_shm.format.layout import (FLAG_PINNED, LENGTH_CHECK_BITS, META_FLAGS_OFF, META_LENGTH_OFF, length_flags,
                                    length_sound)
from maru_shm.index import key_digest

from ..conftest import assert_clean, make_value

SIZE = 3000  # a flip of its bit 10 makes 4024: still inside its 4096-byte block, wrong bytes without the check
KEYS = [f"k{i}" for i in range(12)]  # more than SMALL_BATCH: batch reads take the vector path
VICTIM = KEYS[5]
FLIPS = [("length", b) for b in range(32)] + [("check", b) for b in range(1, 8)]


def _meta(s, key) -> int:
    return s.alloc.meta_off(s.index.find(key_digest(key))[1])


def _flip(s, key, field: str, bit: int) -> None:
    m = _meta(s, key)
    at = m + (META_LENGTH_OFF + bit // 8 if field == "length" else META_FLAGS_OFF)
    s.mm[at] ^= 1 << (bit % 8)


def _reads_of(s, key: str, length: int):
    """What every read path returns for `key`, its destination sized `length` bytes where one is asked."""
    vals = {k: make_value(k, 1, SIZE) for k in KEYS}
    out = {"get": s.get(key), "exists": s.exists(key), "length_of": s.length_of(key),
           "batch_exists": s.batch_exists(KEYS)[KEYS.index(key)]}
    buf = bytearray(max(length, SIZE))
    n = s.get_into(key, buf)
    out["get_into"] = None if n is None else bytes(buf[:n])
    out["batch_get_into"] = s.batch_get_into([key], [buf])[0]
    out["leading_hits"] = s.leading_hits(KEYS)
    out["leading_hits_len"] = s.leading_hits([key], length)
    out["leading_hits_len_many"] = s.leading_hits([key] * len(KEYS), length)  # past the scalar retry
    host = np.zeros((len(KEYS), max(length, SIZE)), dtype=np.uint8)
    sizes = [length if k == key else SIZE for k in KEYS]
    pieces = [((host.ctypes.data + i * host.shape[1], n),) for i, n in enumerate(sizes)]
    i = KEYS.index(key)
    few = s.batch_get_pieces(KEYS[i:i + 1], pieces[i:i + 1])[0]  # the scalar batch path
    out["batch_get_few"] = bytes(host[i, :length]) if few else None
    host[:] = 0
    many = s.batch_get_pieces(KEYS, pieces)
    out["batch_get_many"] = bytes(host[i, :length]) if many[i] else None
    assert all(ok for k, ok in zip(KEYS, many) if k != key), "a key beside the damaged one missed"
    assert all(bytes(host[j, :SIZE]) == vals[k] for j, k in enumerate(KEYS) if k != key)
    return out


def _assert_miss(reads: dict, key: str) -> None:
    misses = {"get": None, "exists": False, "length_of": None, "batch_exists": False, "get_into": None,
              "batch_get_into": None, "leading_hits": KEYS.index(key), "leading_hits_len": 0, "leading_hits_len_many": 0,
              "batch_get_few": None, "batch_get_many": None}
    wrong = {p: v if not isinstance(v, bytes) else f"{len(v)} bytes" for p, v in reads.items() if v != misses[p]}
    assert not wrong, f"read paths that did not miss: {wrong}"


def _pool(pool_path):
    s = Store.open(pool_path, "8M", create=True)
    assert all(s.batch_put(KEYS, [make_value(k, 1, SIZE) for k in KEYS]))
    return s


def test_the_check_refutes_every_flip_of_one_or_two_bits():
    """The property the check is chosen for, over lengths near each power of two and some KV page sizes:
    every one or two of the 39 bits (32 of the length, 7 of the check) flipped is refuted."""
    lengths = {n for p in range(33) for n in range((1 << p) - 3, (1 << p) + 3) if 0 <= n < 1 << 32}
    lengths |= {3000, 4024, 16 << 10, 128 << 10, 2 << 20, 576 * 1024 + 77, 0xFFFFFFFF}
    places = [(1 << b, 0) for b in range(32)] + [(0, 1 << b) for b in range(1, 8)]  # (length bit, flags bit)
    for n in sorted(lengths):
        f = length_flags(n)
        assert length_sound(n, f) and length_sound(n, f | FLAG_PINNED)
        assert f & ~LENGTH_CHECK_BITS == 0
        for i, (l1, f1) in enumerate(places):
            assert not length_sound(n ^ l1, f ^ f1), (n, l1, f1)
            for l2, f2 in places[i + 1:]:
                assert not length_sound(n ^ l1 ^ l2, f ^ f1 ^ f2), (n, (l1, f1), (l2, f2))


@pytest.mark.parametrize("field,bit", FLIPS, ids=[f"{f}{b}" for f, b in FLIPS])
def test_a_flipped_bit_of_the_length_or_its_check_is_a_miss(pool_path, field, bit):
    """Every read path misses the damaged key (and only it), check() reports it, repair frees it, and the key
    can be stored again."""
    with _pool(pool_path) as s:
        m = _meta(s, VICTIM)
        _flip(s, VICTIM, field, bit)
        length = int.from_bytes(s.mm[m + META_LENGTH_OFF:m + META_LENGTH_OFF + 4], "little")
        assert length != SIZE or field == "check"
        _assert_miss(_reads_of(s, VICTIM, length if length <= 4096 else SIZE), VICTIM)
        report = s.check()
        assert not report.ok and any("disagrees with its check" in p for p in report.problems), report.problems
        s.check(repair=True)
        assert_clean(s)
        assert s.get(VICTIM) is None
        assert all(s.get(k) == make_value(k, 1, SIZE) for k in KEYS if k != VICTIM)
        assert s.put(VICTIM, make_value(VICTIM, 2, SIZE)) and s.get(VICTIM) == make_value(VICTIM, 2, SIZE)


def test_a_pinned_value_keeps_its_check(pool_path):
    """Pinning sets bit 0 of the flags byte beside the check: the value still reads back."""
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("p", b"x" * 300) and s.pin("p")
        m = _meta(s, "p")
        assert s.mm[m + META_FLAGS_OFF] == length_flags(300) | FLAG_PINNED
        assert s.get("p") == b"x" * 300
        assert_clean(s)


@pytest.mark.parametrize("bit", [0, 10])
def test_a_write_that_skips_existing_keys_replaces_a_damaged_value(pool_path, bit):
    """SGLang writes with skip_existing: a value readers refuse must not count as present, or the key would
    miss until a repair."""
    with _pool(pool_path) as s:
        _flip(s, VICTIM, "length", bit)
        assert s.get(VICTIM) is None
        assert s.batch_put(KEYS, [make_value(k, 2, SIZE) for k in KEYS], skip_existing=True)
        assert s.get(VICTIM) == make_value(VICTIM, 2, SIZE)
        assert all(s.get(k) == make_value(k, 1, SIZE) for k in KEYS if k != VICTIM)
        assert_clean(s)


def test_every_writer_of_a_length_writes_its_check(pool_path):
    """put (one key), batch_put (small and vectorised), a kept block reused by an overwrite: each meta's
    length agrees with its check."""
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("one", b"a" * 1234)
        assert all(s.batch_put([f"few{i}" for i in range(3)], [b"b" * (100 + i) for i in range(3)]))
        many = [f"many{i}" for i in range(40)]
        assert all(s.batch_put(many, [b"c" * 2222] * 40))
        for i in range(40):  # overwrites: the replaced blocks are kept and reused (kept.py)
            assert s.put(many[i], b"d" * (2000 + i))
        for k in ["one", "few0", "few1", "few2"] + many:
            m = _meta(s, k)
            length = int.from_bytes(s.mm[m + META_LENGTH_OFF:m + META_LENGTH_OFF + 4], "little")
            assert length_sound(length, s.mm[m + META_FLAGS_OFF]), k
        assert s.get("many7") == b"d" * 2007
        assert_clean(s)

