"""Who may open a pool: the creation modes, and the owner rule an opener applies to the pool and its lock
file (DESIGN.md section 2)."""

from __future__ import annotations

import os
import stat

from ..errors import PermissionDeniedError


def is_private(mode: int) -> bool:
    """A private opener (no group bits in its mode) trusts only a pool that no one else can write."""
    return not mode & 0o070


def check_owner(st: os.stat_result, path: str, allow_foreign_owner: bool, mode: int = 0o600) -> None:
    """Who may attach (docs/DESIGN.md section 2).

    A private opener (mode 0600): only a file it owns that neither its group nor others may write.
    A group opener (0660/0640): the file's owner; or a member of the file's group when the file is in
    group mode (group read-write, nothing for others). allow_foreign_owner=True accepts anything the
    kernel lets us open.
    """
    euid = os.geteuid()
    if allow_foreign_owner:
        return
    fmode = stat.S_IMODE(st.st_mode)
    override = "pass allow_foreign_owner=True to override"
    if is_private(mode):
        if st.st_uid != euid:
            raise PermissionDeniedError(
                f"{path} is owned by uid {st.st_uid}, not by this user ({euid}), and this opener asked for a "
                f"private pool (mode {mode:04o}); refusing to share memory with another user (open it with "
                f"mode=0o660 to join a group-mode pool, or {override})")
        if fmode & 0o022:
            raise PermissionDeniedError(
                f"{path} is writable by {'others' if fmode & 0o002 else 'its group'} (mode {fmode:04o}) but this "
                f"opener asked for a private pool (mode {mode:04o}); open it with mode=0o660 to share it with "
                f"the group, or chmod 0600 it ({override})")
        return
    if st.st_uid == euid and not fmode & 0o002:
        return
    if fmode & 0o007:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid} and open to every user (mode {fmode:04o}): anyone could have "
            f"written it; refusing to attach (make it 0660, or {override})")
    if fmode & 0o060 != 0o060:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({euid}), and is not in group mode "
            f"(mode {fmode:04o}, not 0660); refusing to share memory with another user ({override})")
    if st.st_gid not in {os.getegid(), *os.getgroups()}:
        raise PermissionDeniedError(
            f"{path} is owned by uid {st.st_uid} and shared with group {st.st_gid} (mode {fmode:04o}), which "
            f"this user ({euid}) is not in; refusing to attach ({override})")


def check_mode(mode: int) -> None:
    """Creation modes: owner read-write, optionally group bits (0660 to share, 0640 for read-only
    inspection by the group); never bits for others, execute or special bits."""
    if mode & ~0o660 or mode & 0o600 != 0o600:
        raise PermissionDeniedError(
            f"mode {mode:04o} is not a pool mode: use 0600 (this user only) or 0660 (shared with the file's "
            "group); a pool open to every user could be written by anyone")


def lock_file_mode(pool_mode: int) -> int:
    """The lock file's mode: read-write for exactly the classes that may write the pool (0660 for a pool
    its group may write, else 0600). Taking a lock needs only read access to the lock file."""
    return 0o600 | (0o060 if pool_mode & 0o020 else 0) | (0o006 if pool_mode & 0o002 else 0)


def check_lock_file_reach(lock_st: os.stat_result, pool_st: os.stat_result, lock_path: str, path: str) -> None:
    """A lock file may be reachable only by those who may write the pool (BRIEF invariant 10): group bits only
    when the pool's group may write it and the lock file has the pool's group, bits for others only when
    others may write the pool."""
    lmode, pmode = stat.S_IMODE(lock_st.st_mode), stat.S_IMODE(pool_st.st_mode)
    if (lmode & 0o007 and not pmode & 0o002) or \
            (lmode & 0o070 and (not pmode & 0o020 or lock_st.st_gid != pool_st.st_gid)):
        raise PermissionDeniedError(
            f"lock file {lock_path} (mode {lmode:04o}, group {lock_st.st_gid}) lets users lock {path} (mode "
            f"{pmode:04o}, group {pool_st.st_gid}) who may not write it: a reader could block its writers; its "
            f"owner's next open narrows it, or chmod it {lock_file_mode(pmode):04o}")
