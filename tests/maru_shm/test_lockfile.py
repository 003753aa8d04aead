"""The lock file (FORMAT.md section 3): a reader can never block, slow or impersonate a writer (BRIEF
invariant 10), and a pool is only ever locked through the one lock file it was made with.

- A user who may only read a pool (a member of a 0640 pool's group) takes F_RDLCK on every byte of every
  file it can open: the owner's open, put, get, check and the reaping of a dead slot still work within their
  normal timeouts, and the reader's own inspect and check still work, with liveness unknown.
- A missing or replaced lock file is refused with LockFileError (an opener locking another file would not
  exclude the pool's processes); `destroy --force` removes both files, and creation makes both again. A
  lock file made in an earlier boot is adopted by an opener with create=True.
- A lock file is known by its identity (st_dev, st_ino, recorded in the pool's header), not only its bytes:
  a byte-identical copy moved over it while two writers use the original is refused by openers, repair and
  destroy, and nobody is reaped.
- The lock file's mode follows the pool's: only the pool's writers may reach it.

The second user is a forked child that drops to an unused uid/gid (we run as root in CI).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
import stat

import pytest

from maru_shm import (LockFileError, PermissionDeniedError, PoolView, Store, VersionError, check_pool, destroy_pool,
                      repair_pool, pool_report)
from maru_shm.format.layout import LOCK_BOOT_OFF, LOCK_FILE_HEAD, LOCK_IDENTITY, LOCK_IDENTITY_OFF, POOL_UUID_OFF, U32
from maru_shm.locking.lockfile import lock_file_path
from maru_shm.checks.figures import processes

from ..conftest import check_value, make_value
from . import test_permissions
from .test_permissions import as_user, give, needs_root

ids = test_permissions.ids  # the fixture: (another uid, a group to share, its own group, a third uid)

TIMEOUT = 1.0  # a writer's normal lock timeout here: every wait below must end well within it


def _lock(path) -> str:
    return lock_file_path(path, False)


def _read_only_member_takes_every_lock(path, uid, gid, groups, ready_w):
    """Child: become a user who may only read the pool, then take a shared lock on every byte of every file
    of the pool it can open (the pool file: all of it, the lock bytes too; the lock file, if it could open
    it), report what it managed, and hold on until killed."""
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    held = []
    fds = []
    for name, p in (("pool", path), ("lock file", _lock(path))):
        try:
            fd = os.open(p, os.O_RDONLY)
        except PermissionError:
            continue
        fds.append(fd)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, fcntl_flock(fcntl.F_RDLCK, 0, 0))  # 0 bytes: to the end, and past it
        held.append(name)
    try:
        os.open(path, os.O_RDWR)
        held.append("pool, read-write")
    except PermissionError:
        pass
    os.write(ready_w, pickle.dumps(held))
    while True:
        os.pause()


def fcntl_flock(kind, start, length) -> bytes:
    import struct
    return struct.Struct("hhqqi4x").pack(kind, os.SEEK_SET, start, length, 0)


def _exit_without_detaching(path):
    """Child: attach, write, and exit without closing: a claimed slot and its kept blocks for the reaper."""
    s = Store.open(path, timeout=TIMEOUT)
    assert s.put("from-the-dead", make_value("from-the-dead", 1, 3000))
    os._exit(0)


def _inspect_and_check(path):
    with PoolView.open(path) as v:
        rep = pool_report(v)
        procs = processes(v)
    report = check_pool(path, timeout=TIMEOUT)
    return rep["repair"]["locks_seen"], [p["alive"] for p in procs], report.ok, report.unlocked


@needs_root
def test_a_read_only_member_can_neither_block_nor_fake_the_liveness_of_a_writer(pool_path, ids, children):
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True, mode=0o640, timeout=TIMEOUT) as s:
        assert s.put("from-owner", make_value("from-owner", 1, 3000))
    give(pool_path, gid=share_gid)  # the group may read the pool: 0640
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(_lock(pool_path)).st_mode) == 0o600  # its locks: the owner only
    dead = children.fork(_exit_without_detaching, pool_path)
    assert children.wait(dead) == 0

    r, w = os.pipe()
    reader = children.fork(_read_only_member_takes_every_lock, pool_path, uid, own_gid, [share_gid], w)
    os.close(w)
    data = os.read(r, 4096)
    os.close(r)
    assert data, f"the reader failed:\n{children.error(reader)}"
    assert pickle.loads(data) == ["pool"]  # the pool file, whole; not the lock file, not read-write

    # The owner, within its normal timeouts: attach (INIT, PROC, a SLOT), reap the dead slot (its SLOT
    # byte on the pool file is under the reader's lock), write, read, check.
    with Store.open(pool_path, timeout=TIMEOUT) as s:
        assert s.stats()["processes"] == 1  # the dead process was reaped: the reader kept nothing alive
        assert s.put("again", make_value("again", 1, 5000))
        assert check_value("again", s.get("again")) and check_value("from-owner", s.get("from-owner"))
        assert check_value("from-the-dead", s.get("from-the-dead"))
        report = s.check()
        assert report.ok and not report.unlocked, report.problems
        # The reader inspects and checks: no lock reached, liveness unknown, every figure still read.
        locks_seen, alive, ok, unlocked = as_user(_inspect_and_check, pool_path, uid=uid, gid=own_gid,
                                                  groups=[share_gid])
        assert (locks_seen, alive, ok, unlocked) == (False, [None], True, True)
    children.kill(reader)


def test_the_lock_file_is_made_with_the_pool_and_removed_with_it(pool_path):
    for mode, lock_mode in ((0o600, 0o600), (0o640, 0o600), (0o660, 0o660)):
        with Store.open(pool_path, "4M", create=True, mode=mode) as s:
            assert s.put("k", b"v")
        assert stat.S_IMODE(os.stat(_lock(pool_path)).st_mode) == lock_mode, oct(mode)
        with open(_lock(pool_path), "rb") as f:
            magic, uuid = LOCK_FILE_HEAD.unpack(f.read(LOCK_FILE_HEAD.size))
        assert uuid == s.geo.pool_uuid  # it names its pool
        assert destroy_pool(pool_path) == []
        assert not os.path.lexists(pool_path) and not os.path.lexists(_lock(pool_path))


def test_a_pool_whose_lock_file_was_removed_is_refused_until_destroyed(pool_path):
    s = Store.open(pool_path, "4M", create=True, timeout=TIMEOUT)
    assert s.put("k", b"v")
    os.unlink(_lock(pool_path))
    for create in (False, True):
        with pytest.raises(LockFileError, match="destroy --force"):
            Store.open(pool_path, create=create, timeout=TIMEOUT)
        assert not os.path.lexists(_lock(pool_path))  # no lock file made for a ready pool
    assert s.get("k") == b"v" and s.put("k2", b"w")  # the attached store goes on with the locks it holds
    with pytest.raises(LockFileError):
        destroy_pool(pool_path)  # nobody's liveness can be known
    assert destroy_pool(pool_path, force=True)  # names the store still attached
    s.close()
    with Store.open(pool_path, "4M", create=True, timeout=TIMEOUT) as s:  # created again: both files
        assert s.created and s.get("k") is None
    assert os.path.exists(_lock(pool_path))


def test_a_replaced_lock_file_is_refused(pool_path):
    with Store.open(pool_path, "4M", create=True):
        pass
    os.unlink(_lock(pool_path))
    os.close(os.open(_lock(pool_path), os.O_CREAT | os.O_RDWR, 0o600))  # ours, private: passes the owner rule
    for create in (False, True):
        with pytest.raises(LockFileError, match="not the one|removed or replaced"):
            Store.open(pool_path, create=create, timeout=TIMEOUT)
    with pytest.raises(LockFileError):
        destroy_pool(pool_path)


def test_a_lock_file_of_an_earlier_boot_is_adopted_by_a_creator(pool_path):
    """After a reboot a DAX pool keeps its bytes and loses its lock file (in /dev/shm): no process of that
    boot lives, so an opener with create=True makes a new one."""
    with Store.open(pool_path, "4M", create=True) as s:
        assert s.put("k", b"v")
    fd = os.open(pool_path, os.O_RDWR)
    os.pwrite(fd, b"another boot....", LOCK_BOOT_OFF)
    os.close(fd)
    os.unlink(_lock(pool_path))
    with pytest.raises(LockFileError):
        Store.open(pool_path, timeout=TIMEOUT)  # without create=True: no lock file is made
    with Store.open(pool_path, create=True, timeout=TIMEOUT) as s:
        assert s.get("k") == b"v" and not s.created
    with Store.open(pool_path, timeout=TIMEOUT) as s:
        assert s.get("k") == b"v" and s.check().ok
    _copy_over(_lock(pool_path))  # the adopted file is known by its identity from then on
    with pytest.raises(LockFileError, match="copy or a restore"):
        Store.open(pool_path, timeout=TIMEOUT)


def _keep_writing(path, ready_w, tag):
    """Child: attach, say so, then put and read back until killed (a put that raises ends the child with 1)."""
    s = Store.open(path, timeout=TIMEOUT)
    os.write(ready_w, b"x")
    i = 0
    while True:
        key = f"{tag}{i % 40}"
        assert s.put(key, make_value(key, i, 3000))
        assert check_value(key, s.get(key))
        i += 1


def _copy_over(path):
    """cp then mv: a file with the same bytes (and mode) takes the lock file's name; the original lives on,
    unlinked, open in the writers."""
    shutil.copy2(path, path + ".copy")
    os.rename(path + ".copy", path)


def test_a_copy_of_the_lock_file_moved_over_it_is_refused_while_writers_use_the_original(pool_path, children):
    """Bug: openers accepted the copy (its contents name the pool) and locked another inode than the writers:
    critical sections overlapped, the reaper retired both live writers' slots, and check --repair "fixed"
    what the writers were doing."""
    with Store.open(pool_path, "8M", create=True, timeout=TIMEOUT):
        pass
    r, w = os.pipe()
    writers = [children.fork(_keep_writing, pool_path, w, tag) for tag in "ab"]
    os.close(w)
    got = b""
    while len(got) < 2:
        got += os.read(r, 2)
    os.close(r)
    _copy_over(_lock(pool_path))
    for create in (False, True):
        with pytest.raises(LockFileError, match="copy or a restore.*destroy --force"):
            Store.open(pool_path, create=create, timeout=TIMEOUT)
    with pytest.raises(LockFileError, match="copy or a restore"):
        repair_pool(pool_path, timeout=TIMEOUT)
    with pytest.raises(LockFileError, match="copy or a restore"):
        destroy_pool(pool_path)
    with PoolView.open(pool_path) as v:  # liveness unknown: the copy carries nobody's locks
        assert [p["alive"] for p in processes(v)] == [None, None] and not v.sees_locks
    assert [os.waitpid(pid, os.WNOHANG) for pid in writers] == [(0, 0), (0, 0)]  # both still writing
    for pid in writers:
        children.kill(pid)
    with PoolView.open(pool_path) as v:
        assert len(processes(v)) == 2  # nobody was reaped
    assert len(destroy_pool(pool_path, force=True)) == 2  # named: their liveness cannot be known
    assert not os.path.lexists(pool_path) and not os.path.lexists(_lock(pool_path))


def test_a_lock_file_restored_from_a_copy_is_refused_but_one_rewritten_in_place_is_not(pool_path, tmp_path):
    """A restore that makes a new file (a copy moved back, an rsync) is refused even with no process
    attached, since the original's identity is gone; one written back into the same file is that file."""
    with Store.open(pool_path, "4M", create=True, timeout=TIMEOUT) as s:
        assert s.put("k", b"v")
    backup = tmp_path / "lock.bak"
    shutil.copy2(_lock(pool_path), backup)
    shutil.copyfile(backup, _lock(pool_path))  # into the same inode
    with Store.open(pool_path, timeout=TIMEOUT) as s:
        assert s.get("k") == b"v"
    os.unlink(_lock(pool_path))
    shutil.copy2(backup, _lock(pool_path))  # a new file with the old bytes
    for create in (False, True):
        with pytest.raises(LockFileError, match="copy or a restore"):
            Store.open(pool_path, create=create, timeout=TIMEOUT)


def test_a_pool_made_before_lock_file_identities_records_its_lock_files_at_the_next_open(pool_path):
    with Store.open(pool_path, "4M", create=True, timeout=TIMEOUT):
        pass
    fd = os.open(pool_path, os.O_RDWR)
    os.pwrite(fd, bytes(LOCK_IDENTITY.size), LOCK_IDENTITY_OFF)  # as the previous version left it
    with Store.open(pool_path, timeout=TIMEOUT):
        st = os.stat(_lock(pool_path))
        assert LOCK_IDENTITY.unpack(os.pread(fd, LOCK_IDENTITY.size, LOCK_IDENTITY_OFF)) == (st.st_dev, st.st_ino)
    os.close(fd)
    _copy_over(_lock(pool_path))
    with pytest.raises(LockFileError, match="copy or a restore"):
        Store.open(pool_path, timeout=TIMEOUT)


def test_a_pool_of_the_previous_format_is_refused_with_re_create(pool_path):
    """Format version 1 kept its locks on the pool file and has no lock file."""
    with Store.open(pool_path, "4M", create=True):
        pass
    os.unlink(_lock(pool_path))
    fd = os.open(pool_path, os.O_RDWR)
    os.pwrite(fd, U32.pack(1), 8)
    os.close(fd)
    for create in (False, True):
        with pytest.raises(VersionError, match="re-create"):
            Store.open(pool_path, create=create, timeout=TIMEOUT)
        assert not os.path.lexists(_lock(pool_path))
    destroy_pool(pool_path, force=True)
    assert not os.path.lexists(pool_path)


def test_the_owner_fits_the_lock_file_to_the_pools_mode(pool_path):
    """A chmod of the pool by its owner never leaves its locks in reach of users who may not write it."""
    with Store.open(pool_path, "4M", create=True, mode=0o660):
        pass
    os.chmod(pool_path, 0o640)  # the group may only read now
    assert stat.S_IMODE(os.stat(_lock(pool_path)).st_mode) == 0o660
    with Store.open(pool_path, mode=0o660):
        assert stat.S_IMODE(os.stat(_lock(pool_path)).st_mode) == 0o600
    os.chmod(pool_path, 0o660)  # and writers of the group again
    with Store.open(pool_path, mode=0o660):
        assert stat.S_IMODE(os.stat(_lock(pool_path)).st_mode) == 0o660


@needs_root
def test_a_lock_file_in_reach_of_readers_is_refused_by_a_member(pool_path, ids):
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "4M", create=True, mode=0o660):
        pass
    give(pool_path, uid=uid, gid=share_gid)  # another user's group pool
    os.chmod(_lock(pool_path), 0o666)  # which anyone could lock
    with pytest.raises(PermissionDeniedError, match="lock file .* open to every user"):
        as_user(_open_as_member, pool_path, uid=0, gid=0, groups=[share_gid, own_gid])
    os.chmod(_lock(pool_path), 0o660)
    os.chown(_lock(pool_path), -1, own_gid)  # lockable by a group other than the pool's writers
    with pytest.raises(PermissionDeniedError, match="lock file .* lets users lock .* who may not write it"):
        as_user(_open_as_member, pool_path, uid=0, gid=0, groups=[share_gid, own_gid])
    os.chown(_lock(pool_path), -1, share_gid)
    assert as_user(_open_as_member, pool_path, uid=0, gid=0, groups=[share_gid, own_gid])


def _open_as_member(path):
    with Store.open(path, mode=0o660, timeout=TIMEOUT):
        return True


def test_a_symlinked_lock_file_is_refused_by_open_and_destroy(pool_path, tmp_path):
    with Store.open(pool_path, "4M", create=True):
        pass
    os.unlink(_lock(pool_path))
    os.symlink(tmp_path / "elsewhere", _lock(pool_path))
    with pytest.raises(PermissionDeniedError, match="symlink"):
        Store.open(pool_path, create=True, timeout=TIMEOUT)
    with pytest.raises(PermissionDeniedError, match="symlink"):
        destroy_pool(pool_path)
    assert not (tmp_path / "elsewhere").exists()
    destroy_pool(pool_path, force=True)
    assert not os.path.lexists(pool_path) and not os.path.lexists(_lock(pool_path))


def test_a_failed_creation_leaves_no_lock_file(pool_path):
    with open(pool_path, "wb") as f:
        f.write(b"somebody's data")
    with pytest.raises(Exception):
        Store.open(pool_path, "4M", create=True, timeout=TIMEOUT)
    assert not os.path.lexists(_lock(pool_path))
    os.unlink(pool_path)
    with pytest.raises(Exception):
        Store.open(pool_path, "1K", create=True, timeout=TIMEOUT)  # too small to be a pool
    assert not os.path.lexists(pool_path) and not os.path.lexists(_lock(pool_path))


def test_a_view_of_a_pool_in_use_sees_its_processes_alive(pool_path):
    with Store.open(pool_path, "4M", create=True) as s:
        with PoolView.open(pool_path) as v:
            assert [p["alive"] for p in processes(v)] == [True] and v.sees_locks
        uuid = s.geo.pool_uuid
    assert uuid == open(pool_path, "rb").read(POOL_UUID_OFF + 16)[POOL_UUID_OFF:]
