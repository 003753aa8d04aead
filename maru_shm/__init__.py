"""maru_shm: a serverless shared-memory KV store in one mapped file.

    from maru_shm import Store
    with Store.open("/dev/shm/pool", size="4G", create=True) as store:
        store.put("key", b"value")
        store.get("key")

See docs/FORMAT.md for the file format and its crash-safety protocol.
"""

from .allocator.policy import Settings as EvictionSettings, using as eviction_settings
from .admin import check_pool, destroy_pool, is_device, plan_pool, remove_pool, repair_pool
from .checks.repair import CheckReport
from .errors import (CorruptPoolError, LockFileError, LockTimeout, NotAPoolError, PermissionDeniedError,
                     PoolClosedError, PoolDamagedError, PoolInUseError, SizeMismatchError, StoreError,
                     TruncatedPoolError, ValueTooLargeError, VersionError)
from .format.geometry import Geometry
from .index import key_digest, prefixed_digest, prefixed_digests
from .checks.view import PoolView
from .checks.figures import processes as pool_processes, report as pool_report
from .sizes import format_size, parse_size
from .store import Store

__version__ = "0.1.0"  # the package version too: pyproject.toml reads it from here

__all__ = [
    # the store
    "Store", "key_digest", "prefixed_digest", "prefixed_digests", "EvictionSettings", "eviction_settings",
    # administration and read-only views (the CLI's way in)
    "PoolView", "pool_report", "pool_processes", "check_pool", "repair_pool", "destroy_pool", "remove_pool", "plan_pool", "is_device",
    "CheckReport", "Geometry",
    # errors
    "StoreError", "NotAPoolError", "VersionError", "CorruptPoolError", "TruncatedPoolError",
    "SizeMismatchError", "PermissionDeniedError", "LockTimeout", "ValueTooLargeError", "PoolClosedError",
    "PoolDamagedError", "PoolInUseError", "LockFileError",
    # sizes
    "parse_size", "format_size",
]
