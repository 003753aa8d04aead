"""Who may open a pool (docs/DESIGN.md section 2).

- A pool is created 0600 (owner only) unless asked otherwise; the mode does not depend on the umask.
- mode=0o660 (group mode) shares it with the file's group: a second user in that group opens and
  uses it. Creation modes are limited to owner read-write plus optional group bits: a pool open to
  every user is refused.
- A pool owned by another user is refused with PermissionDeniedError, unless it is in group mode
  (group read-write, nothing for others) and we are in its group, or allow_foreign_owner=True.
- A symlink is refused (checked, and opened with O_NOFOLLOW so a swap after the check cannot
  redirect it); a dangling symlink is not followed to create its target.

The other users are not created in /etc/passwd: a forked child drops to an unused uid/gid with
os.setgroups/setgid/setuid (we run as root in CI), and the file is chowned to it where needed.
"""

from __future__ import annotations

import grp
import os
import pickle
import pwd
import stat
import traceback

import pytest

from maru_shm import PermissionDeniedError, Store
from maru_shm.locking.access import lock_file_mode
from maru_shm.locking.lockfile import lock_file_path, open_lock_file

from ..conftest import check_value, make_value

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid/gid and chown need root "
                                "(CAP_SETUID, CAP_SETGID, CAP_CHOWN)")


def _unused(getter, start: int) -> int:
    n = start
    while True:
        try:
            getter(n)
        except KeyError:
            return n
        n += 1


@pytest.fixture(scope="module")
def ids():
    """(uid of another user, a group it and nobody else is in, that user's own primary group, a 3rd uid)."""
    uid = _unused(pwd.getpwuid, 47000)
    other_uid = _unused(pwd.getpwuid, uid + 1)
    share_gid = _unused(grp.getgrgid, 47000)
    own_gid = _unused(grp.getgrgid, share_gid + 1)
    return uid, share_gid, own_gid, other_uid


def as_user(fn, *args, uid: int, gid: int, groups=()):
    """Run fn(*args) in a forked child with the given uid, primary gid and supplementary groups.

    Returns fn's result, or re-raises (as the same exception type when it is a StoreError) what it raised.
    Skips if the kernel refuses the switch (no CAP_SETUID in this container).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            try:
                os.setgroups(list(groups))
                os.setgid(gid)
                os.setuid(uid)
                out = ("ok", fn(*args))
            except PermissionError as e:
                out = ("switch", str(e)) if os.getuid() != uid else ("raised", e, traceback.format_exc())
            except BaseException as e:
                out = ("raised", e, traceback.format_exc())
            os.write(w, pickle.dumps(out))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child died"
    out = pickle.loads(data)
    if out[0] == "switch":
        pytest.skip(f"cannot switch to uid {uid}: {out[1]}")
    if out[0] == "raised":
        e = out[1]
        e.add_note(f"in the child (uid {uid}):\n{out[2]}")
        raise e
    return out[1]


def give(path, uid=-1, gid=-1, mode=None):
    """chown (and chmod) a pool as its owner would: the pool file and its lock file, whose mode follows the
    pool's (only the pool's writers may reach its locks)."""
    lock = lock_file_path(path, False)
    for p in (path, lock):
        os.chown(p, uid, gid)
    if mode is not None:
        os.chmod(path, mode)
        os.chmod(lock, lock_file_mode(mode))


# ---------------------------------------------------------------- what the child does

def _use_pool(path):
    with Store.open(path, timeout=5, mode=0o660) as s:  # a group opener: it joins a group-mode pool
        got = s.get("from-owner")
        assert s.put("from-member", make_value("from-member", 1, 5000))
        return got, os.geteuid(), os.getegid()


def _open_only(path, **kw):
    kw.setdefault("mode", 0o660)  # a group opener; private openers are tested on their own below
    with Store.open(path, timeout=5, **kw) as s:
        return s.get("from-owner")


# ---------------------------------------------------------------- creation modes

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077], ids=oct)
def test_created_0600_by_default_whatever_the_umask(pool_path, umask):
    old = os.umask(umask)
    try:
        with Store.open(pool_path, "4M", create=True):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o666, 0o606, 0o664, 0o700, 0o4600, 0o400, 0o060], ids=oct)
def test_creation_refuses_modes_beyond_owner_and_group(pool_path, mode):
    with pytest.raises(PermissionDeniedError, match="not a pool mode"):
        Store.open(pool_path, "4M", create=True, mode=mode)
    assert not os.path.exists(pool_path)  # refused before anything was created


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o660], ids=oct)
def test_creation_accepts_owner_and_group_modes(pool_path, mode):
    old = os.umask(0o077)
    try:
        with Store.open(pool_path, "4M", create=True, mode=mode):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == mode


# ---------------------------------------------------------------- a second user

@needs_root
def test_group_mode_lets_a_group_member_use_the_pool(pool_path, ids):
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True, mode=0o660) as s:
        assert s.put("from-owner", make_value("from-owner", 1, 3000))
    give(pool_path, gid=share_gid)  # the group the pool is shared with
    got, euid, egid = as_user(_use_pool, pool_path, uid=uid, gid=own_gid, groups=[share_gid])
    assert (euid, egid) == (uid, own_gid)  # really another user, whose primary group is not the pool's
    assert check_value("from-owner", got)
    with Store.open(pool_path, mode=0o660) as s:  # and the owner sees what the member wrote
        assert check_value("from-member", s.get("from-member"))
        assert s.check().ok


@needs_root
def test_group_mode_member_attached_alongside_the_owner(pool_path, ids):
    """Owner attached the whole time; the member attaches, works, detaches; the table records its uid."""
    uid, share_gid, own_gid, _ = ids

    def member(path):
        with Store.open(path, timeout=5, mode=0o660) as s:
            assert s.put("m", make_value("m", 1, 1000))
            o = s.geo.off_procs + s.slot * 128
            return int.from_bytes(s.mm[o + 24:o + 28], "little"), s.stats()["processes"]

    with Store.open(pool_path, "8M", create=True, mode=0o660) as s:
        give(pool_path, gid=share_gid)
        recorded_uid, procs = as_user(member, pool_path, uid=uid, gid=own_gid, groups=[share_gid])
        assert recorded_uid == uid and procs == 2
        assert check_value("m", s.get("m"))
        assert s.stats()["processes"] == 1


@needs_root
def test_owner_only_pool_is_closed_to_the_group(pool_path, ids):
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True):  # 0600
        pass
    os.chown(pool_path, -1, share_gid)
    with pytest.raises(PermissionDeniedError, match="Permission denied"):  # the kernel says no
        as_user(_open_only, pool_path, uid=uid, gid=own_gid, groups=[share_gid])


@needs_root
def test_group_mode_pool_is_closed_to_users_outside_the_group(pool_path, ids):
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True, mode=0o660):
        pass
    os.chown(pool_path, -1, share_gid)
    with pytest.raises(PermissionDeniedError):
        as_user(_open_only, pool_path, uid=uid, gid=own_gid, groups=[])


# ---------------------------------------------------------------- a pool owned by someone else

@needs_root
def test_pool_of_another_user_is_refused_unless_allowed(pool_path, ids):
    """We (root: the kernel lets us open anything) refuse a 0600 pool that another user owns."""
    uid, _, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("from-owner", make_value("from-owner", 1, 3000))
    os.chown(pool_path, uid, own_gid)
    with pytest.raises(PermissionDeniedError, match=f"owned by uid {uid}.*private pool"):
        Store.open(pool_path)
    with pytest.raises(PermissionDeniedError, match=f"owned by uid {uid}.*not in group mode"):
        Store.open(pool_path, mode=0o660)
    with Store.open(pool_path, allow_foreign_owner=True) as s:  # explicitly allowed
        assert check_value("from-owner", s.get("from-owner"))


@needs_root
def test_group_mode_pool_of_another_user_needs_our_membership(pool_path, ids):
    """Group mode is an offer to the file's group only: root outside the group is refused, inside accepted."""
    uid, share_gid, own_gid, _ = ids
    with Store.open(pool_path, "8M", create=True, mode=0o660) as s:
        assert s.put("from-owner", make_value("from-owner", 1, 3000))
    os.chown(pool_path, uid, share_gid)
    with pytest.raises(PermissionDeniedError, match=f"shared with group {share_gid}.*not in"):
        as_user(_open_only, pool_path, uid=0, gid=0, groups=[])
    assert check_value("from-owner", as_user(_open_only, pool_path, uid=0, gid=0, groups=[share_gid]))


@needs_root
@pytest.mark.parametrize("mode", [0o666, 0o662, 0o664], ids=oct)
def test_pool_of_another_user_open_to_everyone_is_refused(pool_path, ids, mode):
    """Even in its group: a pool anyone could have written is not trusted (unless explicitly allowed)."""
    uid, share_gid, own_gid, other_uid = ids
    with Store.open(pool_path, "8M", create=True) as s:
        assert s.put("from-owner", make_value("from-owner", 1, 3000))
    give(pool_path, uid, share_gid, mode)
    with pytest.raises(PermissionDeniedError, match="open to every user"):
        as_user(_open_only, pool_path, uid=other_uid, gid=own_gid, groups=[share_gid])
    assert check_value("from-owner", as_user(lambda p: _open_only(p, allow_foreign_owner=True), pool_path,
                                             uid=other_uid, gid=own_gid, groups=[share_gid]))


# ---------------------------------------------------------------- symlinks

def test_symlink_to_a_pool_is_refused(pool_path):
    with Store.open(pool_path, "4M", create=True) as s:
        assert s.put("k", b"v")
    link = pool_path + ".link"
    os.symlink(pool_path, link)
    for kw in ({}, {"create": True, "size": "4M"}, {"allow_foreign_owner": True}):
        with pytest.raises(PermissionDeniedError, match="symlink"):
            Store.open(link, **kw)


def test_dangling_symlink_is_not_followed_to_create(pool_path, tmp_path):
    target = tmp_path / "would-be-created"
    link = pool_path + ".link"
    os.symlink(target, link)
    with pytest.raises(PermissionDeniedError, match="symlink"):
        Store.open(link, "4M", create=True)
    assert not target.exists()
    assert os.path.islink(link)


def test_symlink_swapped_in_after_the_check_is_not_followed(pool_path, monkeypatch):
    """O_NOFOLLOW, not just the islink() check: a link put in place between the two is still refused."""
    with Store.open(pool_path, "4M", create=True):
        pass
    real = pool_path + ".real"
    os.rename(pool_path, real)
    os.symlink(real, pool_path)
    monkeypatch.setattr(os.path, "islink", lambda p: False)  # the check is fooled; the open must not be
    try:
        with pytest.raises(PermissionDeniedError):
            Store.open(pool_path)
    finally:
        monkeypatch.undo()
        os.unlink(pool_path)
        os.unlink(real)


def test_not_a_regular_file_is_refused(tmp_path):
    from maru_shm import NotAPoolError
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(NotAPoolError):
        Store.open(fifo)


# ---------------------------------------------------------------- private openers (mode 0600)

def _plant_group_pool(path):
    """The attacker: pre-creates the victim's pool path as a group-mode pool holding its own value."""
    with Store.open(path, "8M", create=True, mode=0o660) as s:
        assert s.put("from-owner", b"planted by the attacker")
    return os.geteuid()


@needs_root
def test_private_opener_refuses_a_group_pool_planted_by_another_user(pool_path, ids):
    """Two users sharing a group: the attacker pre-creates the path 0660; the victim asks for a private pool
    (the default mode) and must not attach to it (it would read the attacker's values)."""
    attacker, share_gid, own_gid, victim = ids
    assert as_user(_plant_group_pool, pool_path, uid=attacker, gid=share_gid, groups=[share_gid]) == attacker
    with pytest.raises(PermissionDeniedError, match=f"owned by uid {attacker}.*private pool"):
        as_user(lambda p: _open_only(p, mode=0o600), pool_path, uid=victim, gid=own_gid, groups=[share_gid])
    with pytest.raises(PermissionDeniedError, match=f"owned by uid {attacker}.*private pool"):  # create=True too
        as_user(lambda p: Store.open(p, "8M", create=True), pool_path, uid=victim, gid=own_gid, groups=[share_gid])
    # asking for the group pool explicitly is the victim's informed choice
    assert as_user(_open_only, pool_path, uid=victim, gid=own_gid, groups=[share_gid]) == b"planted by the attacker"


@pytest.mark.parametrize("fmode", [0o620, 0o660, 0o602], ids=oct)
def test_private_opener_refuses_its_own_pool_that_others_can_write(pool_path, fmode):
    with Store.open(pool_path, "4M", create=True):
        pass
    os.chmod(pool_path, fmode)
    with pytest.raises(PermissionDeniedError, match="writable by .*private pool"):
        Store.open(pool_path)
    if not fmode & 0o002:
        with Store.open(pool_path, mode=0o660):  # a group opener accepts its own group-writable pool
            pass


# ---------------------------------------------------------------- the lock file (a DAX device's, here)

def _fake_dax(tmp_path, monkeypatch, name="dax97.3"):
    """A stand-in for /dev/daxN.M: the lock file logic runs on its name only."""
    lock = lock_file_path(f"/dev/{name}", True)
    if os.path.lexists(lock):
        os.unlink(lock)
    return f"/dev/{name}", lock


def open_side_lock(dev, mode):
    """The checked opener, making a device's lock file as a creator does."""
    return open_lock_file(dev, True, mode, create=True)[0]


@needs_root
def test_side_lock_file_of_another_user_is_refused(ids, tmp_path, monkeypatch):
    uid, share_gid, own_gid, _ = ids
    dev, lock = _fake_dax(tmp_path, monkeypatch)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        os.chown(lock, uid, own_gid)  # pre-created by another user, who could hold INIT forever
        with pytest.raises(PermissionDeniedError, match="lock file .* owned by uid"):
            open_side_lock(dev, 0o600)
        os.chown(lock, os.geteuid(), os.getegid())
        os.chmod(lock, 0o666)
        with pytest.raises(PermissionDeniedError, match="lock file .* writable"):
            open_side_lock(dev, 0o600)
        os.chmod(lock, 0o600)
        os.close(open_side_lock(dev, 0o600))  # ours and private: accepted
    finally:
        os.unlink(lock)


def test_side_lock_file_that_is_a_symlink_or_fifo_is_refused(tmp_path, monkeypatch):
    dev, lock = _fake_dax(tmp_path, monkeypatch)
    try:
        os.symlink(tmp_path / "elsewhere", lock)
        with pytest.raises(PermissionDeniedError, match="symlink"):
            open_side_lock(dev, 0o600)
        assert not (tmp_path / "elsewhere").exists()
        os.unlink(lock)
        os.mkfifo(lock, 0o600)
        with pytest.raises(PermissionDeniedError, match="not a regular file"):  # and no hang on the FIFO
            open_side_lock(dev, 0o600)
    finally:
        if os.path.lexists(lock):
            os.unlink(lock)


def test_a_character_device_that_is_not_dax_leaves_no_lock_file():
    from maru_shm import StoreError
    lock = lock_file_path("/dev/null", True)
    if os.path.lexists(lock):
        os.unlink(lock)
    with pytest.raises(StoreError, match="DAX"):
        Store.open("/dev/null")
    assert not os.path.lexists(lock)
