"""Shared fixtures for the maru_shm tests.

- `pool_path`: a unique pool path under /dev/shm per test, removed afterwards.
- `open_store`: opens a Store at `pool_path` (creating it) and closes it at teardown.
- `make_value` / `check_value`: self-verifying values. A value carries the key's
  digest, a version and its own length in a header and a body derived from
  (key, version), so any bytes a read returns can be verified on their own: a
  torn, shifted, foreign or stale-but-wrong buffer fails the check.
- `children`: forks helper processes (plain os.fork, the child leaves with
  os._exit) and SIGKILLs any that are still alive at teardown.
- `assert_clean(store)`: reap dead processes, then check() must find nothing.
- a collection hook that spreads the per-worker instances of the shared-pool
  tests over the xdist workers' first batches (see test_multiprocess.py,
  tests/stress/test_stress.py).

The helpers are plain functions too, so forked children can call them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import struct
import threading
import time
import traceback
import uuid
import weakref

import pytest

from maru_shm import Store, remove_pool
from maru_shm.format.layout import LOCK_BASE, LOCK_IDS
from maru_shm.locking import locks, ofd
from maru_shm.locking.lockfile import lock_file_path

_HEADER = struct.Struct("<16sQQ")  # key digest, version, total length
HEADER_SIZE = _HEADER.size  # 32


def _key_bytes(key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


_PERIOD = 4093  # prime, so no block/granule/page-sized shift lines the pattern up with itself


def make_value(key, version: int, size: int | None = None) -> bytes:
    """A value for `key` at `version` of `size` bytes (default: derived from key and version, 32 B..64 KiB).

    Header (key digest, version, length), then a pseudo-random pattern of prime period drawn from
    (key, version): a torn mix of two versions, a shifted copy or another key's bytes all fail
    `check_value`.
    """
    kd = hashlib.blake2b(_key_bytes(key), digest_size=16).digest()
    pattern = hashlib.shake_128(kd + version.to_bytes(8, "little")).digest(_PERIOD)
    if size is None:
        size = HEADER_SIZE + int.from_bytes(pattern[:4], "little") % (64 << 10)
    if size < HEADER_SIZE:
        raise ValueError(f"a self-verifying value needs at least {HEADER_SIZE} bytes")
    n = size - HEADER_SIZE
    body = pattern * (n // _PERIOD + 1)
    return b"".join((_HEADER.pack(kd, version, size), memoryview(body)[:n]))


def value_version(key, data) -> int | None:
    """The version `data` is a value of for `key`, or None if it is not an intact value of `key`."""
    data = bytes(data)
    if len(data) < HEADER_SIZE:
        return None
    kd, version, size = _HEADER.unpack_from(data)
    if size != len(data) or kd != hashlib.blake2b(_key_bytes(key), digest_size=16).digest():
        return None
    return version if make_value(key, version, size) == data else None


def check_value(key, data) -> bool:
    """True if `data` is an intact value of `key` (any version)."""
    return value_version(key, data) is not None


_FINALIZER = weakref.finalize.__call__.__code__


def in_finalizer(frame) -> bool:
    """Does `frame` run inside a weakref.finalize callback, one the garbage collector may start at any
    allocation (locks.py's `_forget_thread_fd`)? Trace hooks that inject KeyboardInterrupt leave these
    frames alone: an exception raised there never reaches the call (Python prints it and goes on), and on
    CPython 3.11 a trace function that raises in a finalizer the collector runs corrupts the interpreter
    (a segfault a few bytecodes later in the traced call)."""
    while frame is not None:
        if frame.f_code is _FINALIZER:
            return True
        frame = frame.f_back
    return False


def interrupt_at_line(n: int | None, files: tuple, seen: list | None = None):
    """A trace function that raises KeyboardInterrupt at the n-th line event inside `files` (as a SIGINT
    would, between two bytecodes; never, for None), counting the events in `seen`[0]. Python unsets a trace
    function that raises: one interrupt. Finalizers are not traced (in_finalizer)."""
    seen = [0] if seen is None else seen

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
                                        f"({frame.f_code.co_name})")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename in files and not in_finalizer(frame) else None
    return calls


def a_lock_held_by_anyone(path) -> str | None:
    """Name of the lowest lock with a record that some open file description holds, seen from a description
    of our own on the pool's lock file (F_OFD_GETLK over every id at once); None if none is held."""
    fd = os.open(lock_file_path(path, False), os.O_RDWR | os.O_CLOEXEC)
    try:
        res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, ofd.flock_bytes(fcntl.F_WRLCK, 0, LOCK_IDS))
    finally:
        os.close(fd)
    kind, _, start, _, _ = ofd._FLOCK.unpack(res)
    return None if kind == fcntl.F_UNLCK else locks.lock_name(start - LOCK_BASE)


@contextlib.contextmanager
def held_by_another_thread(lock_cm, wait_s: float = 30):
    """`lock_cm` (a lock's context manager) entered by another thread of this process for the block's duration."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with lock_cm:
            held.set()
            release.wait(wait_s)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(wait_s)
        yield
    finally:
        release.set()
        t.join()


# Tests with one instance per xdist worker that want all their instances running at once on one pool.
PER_WORKER_TESTS = ("test_stress_shared_pool", "test_shared_pool_mixed_workload")


def reserve(store, info, keys, length: int) -> list[int]:
    """Reserve one block of class `info` per key for a value of `length` bytes, owned by `store` (never
    committed): what a writer holds between allocating and publishing."""
    import numpy as np
    from maru_shm.index import digest_array, key_digest
    halves = digest_array([key_digest(k) for k in keys]).view("<u8")
    return store.alloc.allocate(info, halves, np.full(len(keys), length, dtype=np.uint64), store.slot + 1)


def write_pool_image(path: str, image: bytes) -> None:
    """Write a pool's bytes to a new file at `path`, with the lock file its header's pool_uuid names, and that
    lock file's identity in the header where the image has one (a pool is opened only with the very lock file
    it was made with)."""
    from maru_shm.format.layout import LOCK_IDENTITY, LOCK_IDENTITY_OFF, POOL_UUID_OFF
    from maru_shm.locking.lockfile import identity, lock_file_path, name_pool
    for p, data in ((lock_file_path(path, False), None), (path, image)):
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            if data is None:
                name_pool(fd, image[POOL_UUID_OFF:POOL_UUID_OFF + 16].ljust(16, b"\0"))
                recorded = LOCK_IDENTITY.pack(*identity(fd))
            else:
                end = LOCK_IDENTITY_OFF + LOCK_IDENTITY.size
                if len(data) >= end and any(data[LOCK_IDENTITY_OFF:end]):
                    data = data[:LOCK_IDENTITY_OFF] + recorded + data[end:]
                os.write(fd, data)
        finally:
            os.close(fd)


def write_note(errdir: str, tag: str, text: str) -> None:
    """A worker process reports a failure (wrong read, traceback) as a file the test reads afterwards."""
    with open(os.path.join(errdir, f"{tag}-{os.getpid()}-{time.monotonic_ns()}.txt"), "w") as f:
        f.write(text)


def read_notes(errdir: str, limit: int = 3) -> str:
    """The first `limit` notes left by worker processes, for an assertion message."""
    names = sorted(os.listdir(errdir))[:limit]
    return "\n".join(open(os.path.join(errdir, n)).read() for n in names)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, put one instance of each per-worker test at the head of every worker's first batch.

    test_stress.test_stress_shared_pool and test_multiprocess.test_shared_pool_mixed_workload have one
    instance per worker and want them all to run at the same time on one pool. xdist's `load`
    scheduling hands each worker a first chunk of consecutive items (round-robin single items when
    there are few), so the instances are spaced one chunk apart: worker i starts with instance i of
    each. With any other order the tests still pass; the workers just overlap less.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    groups = [[it for it in items if getattr(it, "originalname", "") == name] for name in PER_WORKER_TESTS]
    groups = [g for g in groups if len(g) >= 2]
    if not groups:
        return
    special = {id(it) for g in groups for it in g}
    rest = [it for it in items if id(it) not in special]
    total = len(items)
    chunk = 1 if total < 2 * workers else max(2, total // workers // 4)
    if chunk < len(groups):  # round-robin: group after group, so worker i gets instance i of each
        items[:] = [it for g in groups for it in g] + rest
        return
    ordered = []
    for i in range(max(len(g) for g in groups)):
        heads = [g[i] for g in groups if i < len(g)]
        ordered.extend(heads)
        ordered.extend(rest[:chunk - len(heads)])
        rest = rest[chunk - len(heads):]
    items[:] = ordered + rest


def pytest_runtest_setup(item):
    """Tests marked slow run only when asked for (`-m slow`). Every test starts with pytest's faulthandler
    installed again (`_reinstall_faulthandler`)."""
    if item.get_closest_marker("slow") and "slow" not in (item.config.getoption("markexpr") or ""):
        pytest.skip("slow: run with -m slow")
    _reinstall_faulthandler(item.config)


def _reinstall_faulthandler(config) -> None:
    """A native library SGLang imports (libtvm_ffi) installs its own SIGSEGV handler over faulthandler's,
    and prints through fd 2, which pytest captures during a test: a crashed xdist worker then says only
    "Not properly terminated". faulthandler.enable() alone keeps a replaced handler (it is still "enabled"),
    so disable first, then enable on the stderr descriptor pytest's faulthandler plugin keeps. SIGBUS keeps
    the action it had: disabling would drop maru_shm's fault guard (faultguard.py), which chains to it."""
    import ctypes
    import faulthandler

    from maru_shm.mapping import faultguard
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key
        fd = config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):  # another pytest, or `-p no:faulthandler`
        return
    bus = faultguard._SigAction()
    faultguard._libc.sigaction(signal.SIGBUS, None, ctypes.byref(bus))
    faulthandler.disable()
    faulthandler.enable(file=fd)
    faultguard._libc.sigaction(signal.SIGBUS, ctypes.byref(bus), None)


@pytest.fixture
def pool_path():
    path = f"/dev/shm/maru-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield path
    remove_pool(path)
    try:
        os.unlink(path + ".link")
    except FileNotFoundError:
        pass


@pytest.fixture
def open_store(pool_path):
    """open_store(size="16M", **kw) -> Store at pool_path (create=True); every Store opened is closed at teardown."""
    opened = []

    def _open(size=None, path=None, **kw):
        kw.setdefault("create", True)
        if size is None and kw["create"]:
            size = "16M"
        s = Store.open(path or pool_path, size, **kw)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


def assert_clean(store, reap: bool = True) -> None:
    """check() finds nothing wrong. Dead processes are reaped first (reaping is lazy by design:
    at attach and under allocation pressure), so a helper killed by the test is not a finding."""
    if reap:
        store.reap_dead()
    report = store.check()
    assert report.ok, report.problems


@pytest.fixture(name="assert_clean")
def _assert_clean_fixture():
    return assert_clean


@pytest.fixture(name="make_value")
def _make_value_fixture():
    return make_value


@pytest.fixture(name="check_value")
def _check_value_fixture():
    return check_value


class Children:
    """Forked helper processes of one test; leftovers are SIGKILLed at teardown."""

    def __init__(self, tmpdir):
        self.pids: set[int] = set()
        self.tmpdir = tmpdir

    def fork(self, fn, *args) -> int:
        """Run fn(*args) in a forked child; exit code 0 if it returned, 1 if it raised (traceback kept)."""
        pid = os.fork()
        if pid == 0:  # child: never return into pytest
            code = 1
            try:
                fn(*args)
                code = 0
            except BaseException:
                try:
                    with open(os.path.join(self.tmpdir, f"child-{os.getpid()}.err"), "w") as f:
                        f.write(traceback.format_exc())
                except BaseException:
                    pass
            finally:
                os._exit(code)
        self.pids.add(pid)
        return pid

    def wait(self, pid: int, timeout: float = 60.0) -> int:
        """Wait for a child; return its exit code (negative signal number if killed)."""
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.pids.discard(pid)
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise TimeoutError(f"child {pid} did not finish within {timeout}s")
            time.sleep(0.005)

    def kill(self, pid: int) -> int:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.wait(pid)

    def error(self, pid: int) -> str:
        try:
            with open(os.path.join(self.tmpdir, f"child-{pid}.err")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_ok(self, pid: int, timeout: float = 60.0) -> None:
        code = self.wait(pid, timeout)
        assert code == 0, f"child {pid} exited with {code}:\n{self.error(pid)}"

    def cleanup(self) -> None:
        for pid in list(self.pids):
            self.kill(pid)


@pytest.fixture
def children(tmp_path):
    c = Children(str(tmp_path))
    yield c
    c.cleanup()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 24 MiB tmpfs of the test's own (as a Docker container's 64 MiB /dev/shm is small for a pool)."""
    import subprocess
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24M,mode=1777", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
