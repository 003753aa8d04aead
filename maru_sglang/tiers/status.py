"""Where `maru-shm inspect` finds the second tier's state: one small JSON file per tiered MaruStorage.

The tier's counters belong to the process that runs it, not to the pool: the pool file has no field for
them (its process slots are full, FORMAT.md section 10), and a format change for a per-process figure
would cost every reader. So each MaruStorage with a second tier rewrites
`<pool path>.tier2/<pid>-<instance>.json` whenever its figures change, at most once per retry interval,
and removes it on close. The file is written to a temporary name and renamed, so a reader never sees half
of it. A file whose pid no longer attaches to the pool is stale: readers skip it, and the next tiered
process on the pool removes those whose process is gone.

The stdlib and maru_shm only: the command line reads these files without importing SGLang.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from typing import Iterable

from maru_shm import is_device


def status_dir(pool_path: str) -> str:
    """Beside the pool file; for a device (nothing can be created in /dev), in /dev/shm beside its lock file."""
    if is_device(pool_path):
        return f"/dev/shm/.maru_shm-{os.path.basename(pool_path)}.tier2"
    return f"{pool_path}.tier2"


def write_status(pool_path: str, name: str, status: dict, mode: int = 0o600) -> None:
    """Publish `status` as <dir>/<name>.json (atomically); raises OSError (the caller logs it once)."""
    d = status_dir(pool_path)
    os.makedirs(d, mode=0o700 | (mode & 0o044) | ((mode & 0o044) >> 2), exist_ok=True)  # readers may list it
    tmp = os.path.join(d, f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(status, f, sort_keys=True)
    os.replace(tmp, os.path.join(d, f"{name}.json"))


def remove_status(pool_path: str, name: str) -> None:
    """Remove one status file, and the directory once it is empty (a writer's next rename recreates it)."""
    try:
        os.unlink(os.path.join(status_dir(pool_path), f"{name}.json"))
        os.rmdir(status_dir(pool_path))
    except OSError:
        pass


def remove_all(pool_path: str) -> None:
    """With the pool destroyed, its status files go too."""
    shutil.rmtree(status_dir(pool_path), ignore_errors=True)


def read_statuses(pool_path: str, live_pids: Iterable[int]) -> list[dict]:
    """The status of every tiered process that still attaches to the pool (others are stale), by pid."""
    live = set(int(p) for p in live_pids)
    out = []
    try:
        names = sorted(os.listdir(status_dir(pool_path)))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            st = json.loads(_read_small(os.path.join(status_dir(pool_path), name)))
        except (OSError, ValueError):
            continue
        st = _checked(st)
        if st is not None and st["pid"] in live:
            out.append(st)
    return sorted(out, key=lambda s: (s.get("pid", 0), str(s.get("instance", ""))))


_TEXT = ("state", "master", "tag", "instance")
MAX_STATUS_BYTES = 64 << 10


def _read_small(path: str) -> bytes:
    """A regular file's bytes, never following a link and never blocking on a FIFO or device."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATUS_BYTES:
            raise ValueError("not a status file")
        return os.read(fd, MAX_STATUS_BYTES)
    finally:
        os.close(fd)


def _checked(st) -> dict | None:
    """A status as written by write_status, or None: anyone who can write the directory can plant a file."""
    if not isinstance(st, dict):
        return None
    out = {}
    for k, v in st.items():
        if k in _TEXT:
            out[k] = str(v)[:200]
        elif isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
        elif v is None and k == "tag":
            out[k] = None
        else:
            return None
    return out if isinstance(out.get("pid"), int) else None


def remove_stale(pool_path: str) -> None:
    """Delete the status files of processes that no longer exist."""
    try:
        names = os.listdir(status_dir(pool_path))
    except OSError:
        return
    for name in names:
        pid = name.split("-", 1)[0]
        if name.endswith(".json") and pid.isdigit() and not _exists(int(pid)):
            remove_status(pool_path, name[:-len(".json")])


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True
