"""Open-addressing index of KV keys, kept apart from the allocator (memcached's assoc.c)."""

from .table import Index, key_digest

__all__ = ["Index", "key_digest"]
