"""Key digests: 128-bit identifiers the index stores instead of keys.

`key_digest` hashes any key with BLAKE2b-128 (0.5 us per key). For a batch
of keys under one namespace prefix, `prefixed_digests` is faster when the
keys are what SGLang uses: 64-hex-character SHA-256 page hashes, already
uniform 256-bit values. Their first 128 bits XOR BLAKE2b-128(prefix) is then a
digest as good as hashing prefix+key, and numpy decodes a whole batch at
once. Keys that are not 64 hex characters are hashed with BLAKE2b-128 of
prefix+key. Callers must use one digest function consistently for a key.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

def key_digest(key) -> bytes:
    """128-bit BLAKE2b digest of a str or bytes key."""
    if isinstance(key, str):
        key = key.encode()
    return hashlib.blake2b(key, digest_size=16).digest()


def prefixed_digests(prefix: str, keys) -> np.ndarray:
    """Digests of `prefix + key` for each key, as an (n, 16) uint8 array (see the module docstring)."""
    n = len(keys)
    if n and set(map(len, keys)) == {64}:  # equal lengths: the joined batch cannot realign
        try:
            raw = bytes.fromhex("".join(keys))
        except (ValueError, TypeError):
            raw = b""
        if len(raw) == 32 * n:  # one XOR over (n, 2) u64 halves: the result is contiguous, no copy later
            return (np.frombuffer(raw, dtype="<u8").reshape(n, 4)[:, :2] ^ _salt_halves(prefix)).view(np.uint8)
    # otherwise key by key, by the one rule for a single key
    return np.frombuffer(bytearray(b"".join([prefixed_digest(prefix, k) for k in keys])), dtype=np.uint8).reshape(n, 16)


def prefixed_digest(prefix: str, key) -> bytes:
    """The digest `prefixed_digests` gives one key, as 16 bytes, without numpy (a single-key probe)."""
    if isinstance(key, str) and len(key) == 64:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) == 32:  # (fromhex skips whitespace: a 64-character key may give fewer bytes)
            return (int.from_bytes(raw[:16], "little") ^ _salt_int(prefix)).to_bytes(16, "little")
    return key_digest(prefix.encode() + (key.encode() if isinstance(key, str) else bytes(key)))


@functools.lru_cache(maxsize=64)
def _salt(prefix: str) -> np.ndarray:
    return np.frombuffer(key_digest(prefix.encode() + b"\0hex"), dtype=np.uint8)


@functools.lru_cache(maxsize=64)
def _salt_halves(prefix: str) -> np.ndarray:
    return _salt(prefix).view("<u8")


@functools.lru_cache(maxsize=64)
def _salt_int(prefix: str) -> int:
    return int.from_bytes(_salt(prefix).tobytes(), "little")


def digest_array(digests) -> np.ndarray:
    """(n, 16) uint8 array from a list of 16-byte digests or an array."""
    if isinstance(digests, np.ndarray):
        return np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1, 16)
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, 16)
