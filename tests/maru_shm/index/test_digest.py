"""Key digests under a namespace prefix: the batch, per-key and single-key forms agree for every kind of key."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from maru_shm.index import key_digest, prefixed_digest, prefixed_digests

_SHA = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20)]


@pytest.mark.parametrize("keys", [
    _SHA,  # SGLang's page hashes: the vectorised hex path
    [k.upper() for k in _SHA[:3]],
    _SHA[:5] + ["not-a-hash", "x" * 64, "g" + _SHA[0][1:]],  # mixed: every key falls back one by one
    [_SHA[0][:62] + "  "],  # 64 characters that fromhex reads as 31 bytes (it skips whitespace)
    [_SHA[0][:63], _SHA[1] + "a"],  # lengths 63 and 65: joined they would realign
    ["short", ""],
])
def test_single_key_digest_equals_the_batch_row(keys):
    batch = prefixed_digests("model|tp0of1|kv/", keys)
    assert batch.shape == (len(keys), 16) and batch.dtype == np.uint8 and batch.flags.c_contiguous
    for k, row in zip(keys, batch):
        assert prefixed_digest("model|tp0of1|kv/", k) == row.tobytes(), k


def test_hex_keys_are_salted_by_the_prefix_and_others_hashed_with_it():
    a, b = prefixed_digests("ns-a/", _SHA[:4]), prefixed_digests("ns-b/", _SHA[:4])
    assert not (a == b).all(axis=1).any()  # no page of one namespace shares a digest with the other's
    assert prefixed_digest("ns-a/", "plain key") == key_digest("ns-a/plain key")
