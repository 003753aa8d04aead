"""Open-addressing index of KV keys, kept apart from the allocator (memcached's assoc.c)."""

from .digest import digest_array, key_digest, prefixed_digest, prefixed_digests
from .table import Index

__all__ = ["Index", "key_digest", "prefixed_digest", "prefixed_digests", "digest_array"]
