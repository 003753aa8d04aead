"""maru_shm: a serverless shared-memory KV store in one mapped file.

    from maru_shm import Store
    with Store.open("/dev/shm/pool", size="4G", create=True) as store:
        store.put("key", b"value")
        store.get("key")

See docs/FORMAT.md for the file format and its crash-safety protocol.
"""

from .errors import (CorruptPoolError, LockTimeout, NotAPoolError, PermissionDeniedError, PoolClosedError,
                     PoolDamagedError,
                     SizeMismatchError, StoreError, TruncatedPoolError, ValueTooLargeError, VersionError)
from .sizes import format_size, parse_size
from .store import Store

__version__ = "0.1.0"

__all__ = [
    "Store", "StoreError", "NotAPoolError", "VersionError", "CorruptPoolError", "TruncatedPoolError",
    "SizeMismatchError", "PermissionDeniedError", "LockTimeout", "ValueTooLargeError", "PoolClosedError", "PoolDamagedError",
    "parse_size", "format_size",
]
