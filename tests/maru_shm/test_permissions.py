"""Who may open a pool (docs/FORMAT.md section 12).

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


# ---------------------------------------------------------------- what the child does

def _use_pool(path):
    with Store.open(path, timeout=5) as s:
        got = s.get("from-owner")
        assert s.put("from-member", make_value("from-member", 1, 5000))
        return got, os.geteuid(), os.getegid()


def _open_only(path, **kw):
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
    os.chown(pool_path, -1, share_gid)  # the group the pool is shared with
    got, euid, egid = as_user(_use_pool, pool_path, uid=uid, gid=own_gid, groups=[share_gid])
    assert (euid, egid) == (uid, own_gid)  # really another user, whose primary group is not the pool's
    assert check_value("from-owner", got)
    with Store.open(pool_path) as s:  # and the owner sees what the member wrote
        assert check_value("from-member", s.get("from-member"))
        assert s.check().ok


@needs_root
def test_group_mode_member_attached_alongside_the_owner(pool_path, ids):
    """Owner attached the whole time; the member attaches, works, detaches; the table records its uid."""
    uid, share_gid, own_gid, _ = ids

    def member(path):
        with Store.open(path, timeout=5) as s:
            assert s.put("m", make_value("m", 1, 1000))
            o = s.geo.off_procs + s.slot * 128
            return int.from_bytes(s.mm[o + 24:o + 28], "little"), s.stats()["processes"]

    with Store.open(pool_path, "8M", create=True, mode=0o660) as s:
        os.chown(pool_path, -1, share_gid)
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
    with pytest.raises(PermissionDeniedError, match=f"owned by uid {uid}.*not in group mode"):
        Store.open(pool_path)
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
    os.chown(pool_path, uid, share_gid)
    os.chmod(pool_path, mode)
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
