"""Every error the store raises derives from StoreError, so callers can catch one type."""


class StoreError(Exception):
    """Base class of all maru_shm errors."""


class NotAPoolError(StoreError):
    """The file is not a maru-shm pool (wrong magic) or is not initialised."""


class VersionError(StoreError):
    """The pool was written by an incompatible format version."""


class CorruptPoolError(StoreError):
    """The pool header fails its checksum or a geometry check."""


class PoolDamagedError(StoreError):
    """The pool file was truncated, overwritten or re-created under an attached process."""


class TruncatedPoolError(PoolDamagedError):
    """The file is shorter than the geometry recorded in its header."""


class SizeMismatchError(StoreError):
    """An existing pool was opened with a size that differs from its own."""


class PermissionDeniedError(StoreError):
    """The pool is owned by another user, is a symlink, or cannot be opened."""


class LockFileError(StoreError):
    """The pool's lock file is missing, or is not the one its pool's processes lock (FORMAT.md section 3):
    an opener on another lock file would not exclude them."""


class LockTimeout(StoreError):
    """A lock could not be taken within the configured timeout."""


class ValueTooLargeError(StoreError):
    """The value is larger than the largest size class of the pool."""


class PoolClosedError(StoreError):
    """The store was used after close()."""


class PoolInUseError(StoreError):
    """An administrative action found live processes attached to the pool (`processes`: who)."""

    def __init__(self, message: str, processes: list):
        super().__init__(message)
        self.processes = processes
