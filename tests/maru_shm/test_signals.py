"""No signal escapes the store into its host process (DESIGN.md section 10).

Each dangerous scenario runs in a child process: a SIGBUS or SIGSEGV there fails the test with the
signal's name instead of killing pytest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from maru_shm import PoolClosedError, Store, StoreError, remove_pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(body: str, *args, timeout: float = 120) -> str:
    """Run `body` in a fresh interpreter; it must exit 0 (not by a signal). Returns its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(body), *map(str, args)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode < 0:
        pytest.fail(f"the child died of {signal.Signals(-p.returncode).name}:\n{p.stdout}\n{p.stderr[-3000:]}")
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    return p.stdout


# ---------------------------------------------------------------- a file shrunk under attached processes

def test_truncation_under_an_attached_store_is_an_error_not_sigbus(pool_path):
    out = run_py("""
        import os, sys
        from maru_shm import Store, PoolDamagedError
        path = sys.argv[1]
        s = Store.open(path, "32M", create=True)
        for i in range(64):
            assert s.put(f"k{i}", bytes([i]) * 200_000)
        os.truncate(path, 0)                     # another process or user does this
        for call in (lambda: s.get("k1"), lambda: s.put("x", b"1"), lambda: s.batch_exists(["k1"]),
                     lambda: s.stats(), lambda: s.get_into("k2", bytearray(200_000))):
            try:
                call()
            except PoolDamagedError as e:
                assert "truncated" in str(e), e
            else:
                raise SystemExit("a call on a truncated pool did not raise")
        s.close()                                # no signal on the way out either
        print("size", os.stat(path).st_size)
    """, pool_path)
    assert "size 33554432" in out  # grown back, so every other mapping meets zero pages, not SIGBUS
    with pytest.raises(StoreError, match="creator died"):
        Store.open(pool_path)  # its contents are gone: it is an unfinished pool of ours now
    with Store.open(pool_path, "32M", create=True) as s:  # which the next creator formats again
        assert s.get("k1") is None and s.put("k1", b"new")


def test_truncation_under_a_read_only_view_is_an_error_not_sigbus(pool_path):
    """`maru-shm inspect`, `watch` and `check` read the pool through a read-only mapping (PoolView); the file
    shrunk under it must void their figures with PoolDamagedError, not kill them, and the view still closes."""
    out = run_py("""
        import os, sys
        from maru_shm import PoolDamagedError, PoolView, Store, pool_report
        from maru_shm.checks.check import check_live
        from maru_shm.checks.figures import class_table, counters, pool_stats, processes
        path = sys.argv[1]
        with Store.open(path, "32M", create=True) as s:
            for i in range(64):
                assert s.put(f"k{i}", bytes([i]) * 200_000)
        view = PoolView.open(path)
        assert pool_report(view)["index"]["entries"] == 64  # intact: figures as usual
        os.truncate(path, 4096)                  # another process or user does this
        for figure in (pool_report, pool_stats, class_table, processes, counters, check_live):
            try:
                figure(view)
            except PoolDamagedError as e:
                assert "could not be read" in str(e), e
            else:
                raise SystemExit(f"{figure.__name__} on a truncated pool did not raise")
        view.close()
        print("closed")
    """, pool_path)
    assert "closed" in out


def test_processes_attached_to_a_truncated_pool_all_see_an_error(pool_path):
    """One process truncates the file while three others are attached and busy (so the truncation lands
    inside their calls, mid-copy or mid-lookup: the fault guard absorbs that SIGBUS)."""
    out = run_py("""
        import os, sys, time, multiprocessing as mp
        from maru_shm import Store, PoolDamagedError
        path = sys.argv[1]

        def worker(path, q):
            s = Store.open(path)
            n = 0
            try:
                while True:
                    s.put(f"w{os.getpid()}-{n % 50}", b"x" * 50_000)
                    s.get(f"w{os.getpid()}-{(n * 7) % 50}")
                    n += 1
            except PoolDamagedError:
                q.put(("damaged", n))
            except BaseException as e:
                q.put(("other", repr(e)))
            s.close()

        Store.open(path, "32M", create=True).close()
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(path, q)) for _ in range(3)]
        for p in ps:
            p.start()
        time.sleep(1.5)
        os.truncate(path, 4096)
        got = [q.get(timeout=60) for _ in ps]
        for p in ps:
            p.join(30)
        print("results", got, "exitcodes", [p.exitcode for p in ps])
    """, pool_path)
    assert "exitcodes [0, 0, 0]" in out, out
    assert out.count("'damaged'") == 3, out


def test_truncation_inside_threaded_batch_copies_is_an_error_not_sigbus(pool_path):
    """The file shrinks while the copy engine's workers copy in and out of it (8 MiB batches of 512 KiB
    values, two copy threads): the SIGBUS then lands in a worker thread too, which the guard absorbs as
    well, and the batch call raises PoolDamagedError."""
    out = run_py("""
        import os, sys, threading, time
        import numpy as np
        from maru_shm import Store, PoolDamagedError
        from maru_shm.copying import copyengine
        path = sys.argv[1]
        s = Store.open(path, "128M", create=True, copy_threads=2)
        s._engine.cores.free = lambda: 2  # however busy the machine: the workers copy
        copyengine.BACKOFF = 0  # every batch, even after workers that were slow to help
        page = 512 << 10  # at or above MIN_THREADED_PIECE: threaded whatever the blocks' layout
        src = np.random.default_rng(1).integers(0, 256, 16 * page, dtype=np.uint8)
        dst = np.zeros(16 * page, dtype=np.uint8)
        pieces = [[(src.ctypes.data + i * page, page)] for i in range(16)]
        into = [[(dst.ctypes.data + i * page, page)] for i in range(16)]
        threading.Timer(1.0, os.truncate, (path, 4096)).start()
        n, outcome = 0, None
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                keys = [f"b{n % 4}-{i}" for i in range(16)]
                assert all(s.batch_put_pieces(keys, pieces))
                s.batch_get_pieces(keys, into)
                n += 1
        except PoolDamagedError:
            outcome = "damaged"
        print("outcome", outcome, "batches", n, "threaded", s._engine.batches_threaded)
        s.close()
    """, pool_path)
    assert "outcome damaged" in out, out
    batches, threaded = map(int, out.split()[3::2])
    assert threaded > batches, out  # puts and gets on the workers, the one the truncation met included


def test_a_guard_reset_to_the_default_action_is_installed_again_by_the_next_open(pool_path):
    """Another library may reset SIGBUS to its default after the first store installed the guard
    (`signal.signal`, or faulthandler.disable() where faulthandler was enabled first). The next open installs
    it again: a truncation under that store is an error, not the death of the process."""
    try:
        out = run_py("""
            import os, signal, sys
            from maru_shm import Store, PoolDamagedError
            first = Store.open(sys.argv[1] + ".first", "8M", create=True)
            signal.signal(signal.SIGBUS, signal.SIG_DFL)
            s = Store.open(sys.argv[1], "32M", create=True)
            for i in range(16):
                assert s.put(f"k{i}", bytes([i]) * 200_000)
            os.truncate(sys.argv[1], 0)
            try:
                s.get_into("k3", bytearray(200_000))
            except PoolDamagedError:
                print("an error")
            s.close()
            first.close()
        """, pool_path)
    finally:
        remove_pool(pool_path + ".first")
    assert "an error" in out


def test_a_sigbus_outside_any_pool_still_reaches_the_process(pool_path):
    """The guard absorbs faults inside pool mappings only: another mapping's SIGBUS keeps its default action."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    body = textwrap.dedent("""
        import mmap, os, sys
        from maru_shm import Store
        s = Store.open(sys.argv[1], "8M", create=True)
        other = sys.argv[1] + ".other"
        fd = os.open(other, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        os.unlink(other)
        os.ftruncate(fd, 0)
        mm[500000] = 1
        print("survived")
    """)
    p = subprocess.run([sys.executable, "-c", body, pool_path], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr[-2000:])


# ---------------------------------------------------------------- close() racing copies

def test_close_while_other_threads_copy_raises_pool_closed_never_segfaults(pool_path):
    out = run_py("""
        import sys, threading, numpy as np
        from maru_shm import Store, PoolClosedError
        path = sys.argv[1]
        bad = []
        for rnd in range(30):
            s = Store.open(path, "64M", create=(rnd == 0))
            if rnd == 0:
                for i in range(32):
                    s.put(f"big{i}", np.full(1 << 20, i, np.uint8))
            go = threading.Event()

            def reader(k):
                buf = np.empty(1 << 20, np.uint8)
                go.wait()
                try:
                    while True:
                        s.get_into(f"big{k}", buf)
                        s.batch_get_into([f"big{(k + j) % 32}" for j in range(4)],
                                         [np.empty(1 << 20, np.uint8) for _ in range(4)])
                        s.put(f"w{k}", buf)
                except PoolClosedError:
                    pass
                except BaseException as e:
                    bad.append(repr(e))

            ts = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
            for t in ts:
                t.start()
            go.set()
            s.close()
            for t in ts:
                t.join()
        print("bad", bad)
    """, pool_path)
    assert "bad []" in out, out


def test_calls_after_close_raise_pool_closed(pool_path):
    s = Store.open(pool_path, "8M", create=True)
    s.put("k", b"v")
    s.close()
    for call in (lambda: s.get("k"), lambda: s.put("k", b"w"), lambda: s.get_into("k", bytearray(1)),
                 lambda: s.batch_exists(["k"]), lambda: s.stats(), lambda: s.populate(), lambda: s.delete("k")):
        with pytest.raises(PoolClosedError):
            call()


# ---------------------------------------------------------------- a lost pool, for clients that heal

def test_lost_names_a_removed_replaced_or_damaged_pool_and_heals_are_counted_in_the_new_one(pool_path):
    out = run_py("""
        import os, sys
        from maru_shm import PoolDamagedError, PoolView, Store, pool_report
        path = sys.argv[1]
        s = Store.open(path, "8M", create=True)
        assert s.lost() is None
        os.unlink(path)                              # maru-shm destroy --force
        assert "removed or replaced" in str(s.lost()) and s.get("k") is None  # the mapping itself still works
        t = Store.open(path, "8M", create=True)      # another instance creates a new pool at the path
        assert "removed or replaced" in str(s.lost()) and t.lost() is None
        s.close()
        t.count_heal(); t.count_heal()
        assert t.stats()["heals"] == 2
        with PoolView.open(path) as v:
            assert pool_report(v)["counters"]["heals"] == 2
        os.truncate(path, 0)
        try:
            t.get("k")
        except PoolDamagedError as e:
            assert t.lost() is e                     # the damage a call met, still named after it
        else:
            raise SystemExit("a call on a truncated pool did not raise")
        t.close()
        assert "truncated" in str(t.lost())
        with Store.open(path, "8M", create=True) as u:   # formatted again: a new pool's count starts at 0
            assert u.lost() is None and u.stats()["heals"] == 0
        print("ok")
    """, pool_path)
    assert "ok" in out


# ---------------------------------------------------------------- a tmpfs too small for the pool

def test_attaching_to_a_sparse_pool_that_cannot_be_backed_is_refused(small_tmpfs):
    """A pool file larger than its tmpfs's free space with holes in it (made sparse, as older code or
    `truncate -s` leave it): opening it must fail clearly, and no put may ever meet an unbacked page."""
    path = small_tmpfs / "pool"
    with Store.open(path, "16M", create=True) as s:
        geo = s.geo
        assert s.put("k", b"v")
    # re-make it sparse: copy the header pages into a fresh file of the same size, holes elsewhere
    head = open(path, "rb").read(geo.off_data)
    os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.pwrite(fd, head, 0)
    os.ftruncate(fd, geo.file_size)
    os.close(fd)
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:  # someone else fills the tmpfs
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass
    out = run_py("""
        import sys
        from maru_shm import Store, StoreError
        try:
            s = Store.open(sys.argv[1])
        except StoreError as e:
            print("refused:", e)
        else:
            for i in range(64):
                s.put(f"k{i}", bytes(1 << 20))
            print("opened and wrote")
    """, path)
    assert out.startswith("refused:") and "not all allocated" in out, out
    os.unlink(filler)
    with Store.open(path) as s:  # with room again, the holes are allocated at attach and it works
        assert os.stat(path).st_blocks * 512 >= s.geo.file_size
        assert s.put("k2", b"w" * 100_000) and s.get("k2") == b"w" * 100_000
