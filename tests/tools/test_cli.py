"""The `maru-shm` command, run as a subprocess on pools built here.

Pools: clean; damaged (a slab bitmap bit, an index entry, a dirty lock record,
the magic, the header checksum); in use by another live process, and after
that process was SIGKILLed. One test drives `inspect` and `watch` in a real
terminal (tmux, 160x50) and reads the screen.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from maru_shm import Store, remove_pool
from maru_shm.format.layout import ENTRY_SIZE, LOCK_RECORD, SHARD_LOCK_BASE, SLAB_BITMAP, SLAB_ENTRY, UNIT_HEAD
from maru_shm.format.geometry import Geometry

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
for _var in ("MARU_SHM_DEBUG", "COLUMNS", "LINES"):  # pytest may set COLUMNS; the terminal test needs 160
    ENV.pop(_var, None)
CLI = [PY, "-m", "tools.cli"]


def run(*args, timeout=60, cmd=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*(cmd or CLI), *map(str, args)], capture_output=True, text=True, env=ENV, cwd=REPO,
                          timeout=timeout, **kw)


def inspect_json(path) -> dict:
    r = run("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line on stderr, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maru-shm"), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def fill(path, n=200, size="16M", exact=20000) -> None:
    """Create a pool with `n` values over a few classes plus an exact-fit class, one hit and one miss."""
    with Store.open(path, size, create=True) as s:
        s.declare_size(exact)
        for i in range(n):
            s.put(f"k{i}", os.urandom(1000 + (i * 97) % 9000))
        for i in range(20):
            s.put(f"x{i}", os.urandom(exact))
        assert s.get("k1") is not None
        assert s.get("no such key") is None


class Mapped:
    """The pool file mapped read-write by the test itself, to damage it on purpose."""

    def __init__(self, path, geometry=True):
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, 0)
        self.g = Geometry.read(self.mm, len(self.mm)) if geometry else None

    def column(self, off, count, stride, dtype):
        a = np.ndarray((count,), dtype=dtype, buffer=self.mm, offset=off, strides=(stride,)).copy()
        return a

    def close(self):
        self.mm.close()
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --------------------------------------------------------------------------- another process using the pool
HELPER = r"""
import os, sys
from maru_shm import Store, remove_pool
s = Store.open(sys.argv[1])
print("ready", os.getpid(), s.slot, flush=True)
for line in sys.stdin:
    cmd, *rest = line.split()
    if cmd == "put":
        n, base = int(rest[0]), int(rest[1])
        ok = sum(s.put(f"w{base + i}", os.urandom(3000 + i)) for i in range(n))
        print("ok", ok, flush=True)
    elif cmd == "hold":  # take every shard lock and POOL, and keep them (as a writer stuck inside would)
        from maru_shm.format.layout import LOCK_POOL, SHARD_LOCK_BASE
        for lock_id in [LOCK_POOL] + [SHARD_LOCK_BASE + i for i in range(s.geo.index_shards)]:
            s.locks.acquire(lock_id)
        print("held", flush=True)
    elif cmd == "quit":
        break
s.close()
print("closed", flush=True)
"""


class Helper:
    """A child Python process holding a Store open on the pool, driven over stdin."""

    def __init__(self, path):
        self.p = subprocess.Popen([PY, "-c", HELPER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=ENV, cwd=REPO)
        line = self.p.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.pid, self.slot = int(line[1]), int(line[2])

    def put(self, n, base):
        self.p.stdin.write(f"put {n} {base}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().split()
        assert line[0] == "ok", line
        return int(line[1])

    def hold_locks(self):
        self.p.stdin.write("hold\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().split() == ["held"]

    def kill(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(10)

    def quit(self):
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(10)


@pytest.fixture
def helpers():
    started = []

    def start(path):
        h = Helper(path)
        started.append(h)
        return h

    yield start
    for h in started:
        h.kill()


# --------------------------------------------------------------------------- create / inspect
def test_help_for_every_command():
    r = run("--help")
    assert r.returncode == 0
    for c in ("create", "inspect", "check", "watch", "destroy", "bench"):
        assert c in r.stdout
    for c in ("create", "inspect", "check", "watch", "destroy"):
        r = run(c, "--help")
        assert r.returncode == 0, r.stderr
        assert "PATH" in r.stdout
    r = run()
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_create_then_inspect_json(pool_path):
    r = run("create", pool_path, "--size", "16M", "--mode", "0660")
    assert r.returncode == 0, r.stderr
    assert "created" in r.stdout
    assert os.stat(pool_path).st_mode & 0o777 == 0o660
    rep = inspect_json(pool_path)
    assert rep["schema"] == 2
    assert rep["geometry"]["file_bytes"] == 16 << 20
    assert rep["index"]["entries"] == 0 and rep["classes"] == [] and rep["processes"] == []
    assert rep["format"]["eviction"] == "count"  # the default ref rule

    r = run("create", pool_path, "--size", "16M")  # never over an existing file
    assert_error(r, "already exists")
    remove_pool(pool_path)
    fill(pool_path, n=200)
    rep = inspect_json(pool_path)
    assert rep["index"]["entries"] == 220
    assert rep["space"]["live_blocks"] == 220
    assert sum(c["live"] for c in rep["classes"]) == 220
    assert sum(c["live_bytes"] for c in rep["classes"]) == rep["space"]["live_bytes"]
    exact = [c for c in rep["classes"] if c["kind"] == "exact"]
    assert len(exact) == 1 and exact[0]["block_size"] == 20000 and exact[0]["live"] == 20
    assert exact[0]["fragmentation"] == 0.0
    for c in rep["classes"]:
        assert c["used"] + c["free"] == c["blocks"] == c["slabs"] * c["blocks_per_slab"]
        assert 0.0 <= c["fragmentation"] < 1.0
    assert rep["space"]["utilization"] == pytest.approx(rep["space"]["live_bytes"] / (16 << 20))
    c = rep["counters"]
    assert (c["puts"], c["hits"], c["misses"]) == (220, 1, 1) and c["hit_ratio"] == 0.5
    assert rep["processes"] == []  # the filling process detached
    assert rep["repair"] == {"dirty_locks": [], "shards": [], "classes": [], "pool": False, "dead_processes": [],
                             "locks_seen": True}
    assert 1.0 <= rep["index"]["probe_mean"] <= rep["index"]["probe_max"]


def test_create_with_age_stamps(pool_path):
    r = run("create", pool_path, "--size", "16M", "--eviction", "age")
    assert r.returncode == 0 and "age eviction" in r.stdout, r.stderr
    assert inspect_json(pool_path)["format"]["eviction"] == "age"
    assert "age eviction" in run("inspect", pool_path).stdout
    r = run("create", f"{pool_path}-x", "--size", "16M", "--eviction", "lru")
    assert r.returncode == 2 and "invalid choice" in r.stderr and not os.path.exists(f"{pool_path}-x")


def test_create_errors(pool_path):
    assert_error(run("create", pool_path), "--size is required")
    r = run("create", pool_path, "--size", "12 parsecs")
    assert r.returncode == 2 and "not a size" in r.stderr and "Traceback" not in r.stderr
    assert_error(run("create", pool_path, "--size", "4K"), "cannot hold")
    assert not os.path.exists(pool_path)


def _json_paths(obj, prefix: str, out: set) -> set:
    """Dotted key paths of a JSON value: `space.live_bytes`, `classes[].kind`, ..."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else k
            out.add(path)
            _json_paths(v, path, out)
    elif isinstance(obj, list):
        for v in obj:
            _json_paths(v, prefix + "[]", out)
    return out


def test_every_json_key_is_documented(pool_path, helpers):
    fill(pool_path)
    with Mapped(pool_path) as m:  # a dirty lock record, so the repair lists are not empty
        LOCK_RECORD.pack_into(m.mm, m.g.off_locks + (SHARD_LOCK_BASE + 1) * LOCK_RECORD.size, 7, 0)
    helpers(pool_path)
    rep = inspect_json(pool_path)
    assert rep["processes"] and rep["repair"]["dirty_locks"] and rep["classes"]
    doc = (REPO / "docs" / "CLI.md").read_text()
    # a process's own counters are documented once, as `counters.*`
    paths = {p.replace("processes[].counters.", "counters.") for p in _json_paths(rep, "", set())}
    missing = sorted(p for p in paths if f"| `{p}` |" not in doc)
    assert not missing, f"inspect --json keys not documented in docs/CLI.md: {missing}"


def test_inspect_terminal_free_output_when_piped(pool_path):
    fill(pool_path)
    r = run("inspect", pool_path)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout  # no colour or cursor codes in a pipe
    for title in ("Pool", "Space", "Size classes", "Index", "Processes", "Repair", "Counters"):
        assert re.search(rf"^{title}$", r.stdout, re.M), title
    assert re.search(r"^\s+class\s+kind\s+block\s+units\s+slabs\s+blocks\s+used\s+free\s+live payload\s+frag$",
                     r.stdout, re.M)
    assert re.search(r"exact\s+20,000 B\s", r.stdout)
    assert "none attached" in r.stdout
    assert re.search(r"entries\s+220 of ", r.stdout)


def test_inspect_output_into_a_closed_pipe(pool_path):
    fill(pool_path)
    cmd = f"set -o pipefail; {shlex.join(CLI)} inspect {shlex.quote(pool_path)} | head -n 1"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Pool"
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_inspect_and_watch_never_write_nor_attach(pool_path, helpers):
    fill(pool_path)
    h = helpers(pool_path)
    before = (digest(pool_path), os.stat(pool_path).st_mtime_ns)
    rep = inspect_json(pool_path)
    assert [p["pid"] for p in rep["processes"]] == [h.pid]  # only the helper: inspect did not attach
    assert run("inspect", pool_path).returncode == 0
    assert run("watch", pool_path, "--interval", "0.05", "--count", "3").returncode == 0
    assert (digest(pool_path), os.stat(pool_path).st_mtime_ns) == before
    # no write access is needed at all: a 0444 file, with root's override dropped if we are root
    os.chmod(pool_path, 0o444)
    drop = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE")
        drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
    r = run("inspect", pool_path, "--json", cmd=drop + CLI)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["processes"][0]["alive"] is True
    r = run("check", pool_path, cmd=drop + CLI)  # check is read-only too: read permission is enough
    assert r.returncode == 0 and ": ok (" in r.stdout, (r.stdout, r.stderr)
    assert (digest(pool_path), os.stat(pool_path).st_mtime_ns) == before
    os.chmod(pool_path, 0o000)
    assert_error(run("inspect", pool_path, cmd=drop + CLI), "Permission denied")


def test_inspect_takes_no_lock(pool_path, helpers):
    """A process sitting inside every shard's and the pool's critical section does not delay inspect;
    their dirty records are not reported while the locks are held, and are once the holder dies."""
    fill(pool_path)
    h = helpers(pool_path)
    h.hold_locks()
    t0 = time.monotonic()
    rep = inspect_json(pool_path)
    assert run("watch", pool_path, "--count", "2", "--interval", "0.05").returncode == 0
    assert time.monotonic() - t0 < 20
    assert rep["index"]["entries"] == 220 and rep["repair"]["dirty_locks"] == []
    h.kill()
    rep = inspect_json(pool_path)
    assert rep["repair"]["shards"] == list(range(rep["geometry"]["index_shards"]))
    assert rep["repair"]["pool"] is True
    assert {d["holder_slot"] for d in rep["repair"]["dirty_locks"]} == {h.slot}


def test_watch_when_piped(pool_path):
    fill(pool_path)
    r = run("watch", pool_path, "--interval", "0.05", "--count", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"--- {pool_path} ") == 3
    assert r.stdout.count("Size classes") == 3 and "\x1b[" not in r.stdout
    r = run("watch", pool_path, "--interval", "0.05", "--count", "2", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["index"]["entries"] == 220 for x in lines)


def test_watch_survives_the_pool_truncated_under_it(pool_path):
    """A pool shrunk between two refreshes: watch says so and goes on (it reopens the pool at the next tick),
    it is not killed by SIGBUS."""
    fill(pool_path)
    p = subprocess.Popen([*CLI, "watch", pool_path, "--interval", "0.3", "--count", "4"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    first = p.stdout.readline()
    assert first.startswith(f"--- {pool_path} "), first + p.stderr.read()
    os.truncate(pool_path, 4096)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (p.returncode, out, err)
    assert "could not be read" in out or "truncated" in out, out


def test_store_stats_and_inspect_agree(pool_path):
    fill(pool_path)
    from maru_shm.checks.view import PoolView
    from maru_shm.checks.figures import class_table, pool_stats
    with Store.open(pool_path) as s:
        st = s.stats()
        with PoolView.open(pool_path) as v:
            ro = pool_stats(v)
            assert class_table(v) == class_table(s)
    for k in ("path", "file_bytes", "data_bytes", "header_bytes", "granule", "unit_size", "units", "free_units",
              "slabs", "max_value", "live_blocks", "live_bytes", "utilization", "data_utilization", "entries",
              "index_slots", "index_shards", "load_factor", "max_shard_load", "probe_mean", "probe_max", "puts",
              "hits", "misses", "evictions", "hit_ratio", "processes"):
        assert k in st, k
    assert st["processes"] == 1 and ro["processes"] == 1
    for k in ("live_bytes", "entries", "slabs", "puts", "probe_max"):
        assert st[k] == ro[k], k


# --------------------------------------------------------------------------- check
def test_check_clean_and_damaged_bitmap(pool_path):
    fill(pool_path)
    r = run("check", pool_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ": ok (" in r.stdout
    with Mapped(pool_path) as m:
        states = m.column(m.g.off_slabs, m.g.n_units, SLAB_ENTRY, "<u4")
        for h in np.flatnonzero(states == UNIT_HEAD).tolist():  # a slab with a free block
            o = m.g.off_slabs + h * SLAB_ENTRY + SLAB_BITMAP
            bm = bytes(m.mm[o:o + 32])
            nblocks = int.from_bytes(m.mm[o - SLAB_BITMAP + 20:o - SLAB_BITMAP + 24], "little")
            free = [i for i in range(nblocks) if not bm[i >> 3] & (1 << (i & 7))]
            if free:
                break
        i = free[0]
        m.mm[o + (i >> 3)] |= 1 << (i & 7)
    r = run("check", pool_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"problem: slab {h} block {i}: bitmap says used, meta says FREE" in r.stdout
    assert "problem(s) found" in r.stdout
    r = run("check", pool_path, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok after repair" in r.stdout
    assert run("check", pool_path).returncode == 0
    assert inspect_json(pool_path)["index"]["entries"] == 220


def test_check_damaged_index_entry(pool_path):
    fill(pool_path)
    with Mapped(pool_path) as m:
        words = m.column(m.g.off_index + 16, m.g.index_slots, ENTRY_SIZE, "<u8")
        slot = int(np.flatnonzero(words)[0])
        e = m.g.off_index + slot * ENTRY_SIZE + 24
        m.mm[e:e + 8] = (m.g.data_bytes + 12345).to_bytes(8, "little")  # points outside the data area
    shard, pos = divmod(slot, m.g.shard_slots)
    r = run("check", pool_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"problem: index shard {shard} slot {pos}: offset" in r.stdout
    assert "not a block start in the data area" in r.stdout
    assert "(orphan)" in r.stdout  # the block the entry named is now owned by nobody
    r = run("check", pool_path, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert run("check", pool_path).returncode == 0
    assert inspect_json(pool_path)["index"]["entries"] == 219


def test_dirty_shard_lock_shows_as_needing_repair(pool_path):
    fill(pool_path)
    with Mapped(pool_path) as m:
        LOCK_RECORD.pack_into(m.mm, m.g.off_locks + (SHARD_LOCK_BASE + 3) * LOCK_RECORD.size, 5, 0)
    rep = inspect_json(pool_path)
    assert rep["repair"]["shards"] == [3]
    assert rep["repair"]["dirty_locks"][0]["lock"] == "SHARD[3]"
    assert rep["repair"]["dirty_locks"][0]["holder_slot"] == 4
    assert re.search(r"shards needing repair\s+3\s", run("inspect", pool_path).stdout)
    r = run("check", pool_path)
    assert r.returncode == 1 and "lock SHARD[3]: left dirty" in r.stdout
    assert run("check", pool_path, "--repair").returncode == 0
    assert inspect_json(pool_path)["repair"]["shards"] == []


def test_not_a_pool_cannot_run(pool_path, tmp_path):
    fill(pool_path)
    with Mapped(pool_path) as m:
        m.mm[3] ^= 0xFF  # magic
    before = digest(pool_path)
    for args in (("inspect", pool_path), ("inspect", pool_path, "--json"), ("check", pool_path),
                 ("check", pool_path, "--repair"), ("watch", pool_path, "--count", "1"), ("destroy", pool_path),
                 ("destroy", pool_path, "--force")):
        assert_error(run(*args), "not a maru-shm pool")
    assert digest(pool_path) == before and os.path.exists(pool_path)
    with Mapped(pool_path, geometry=False) as m:
        m.mm[3] ^= 0xFF
        m.mm[40] ^= 0x01  # inside the checksummed header
    assert_error(run("inspect", pool_path), "checksum")
    assert_error(run("check", pool_path), "checksum")
    assert_error(run("destroy", pool_path), "checksum", "--force")
    # small and foreign files are refused without being touched
    small = tmp_path / "hello.txt"
    small.write_text("hello\n")
    for c in ("inspect", "check", "destroy"):
        assert_error(run(c, small))
    assert small.read_text() == "hello\n"
    assert_error(run("inspect", tmp_path / "missing"), "does not exist")
    assert_error(run("check", tmp_path / "missing"), "does not exist")
    assert_error(run("inspect", tmp_path), "neither a regular file")
    link = pool_path + ".link"
    os.symlink(pool_path, link)
    for c in ("inspect", "check", "destroy"):
        assert_error(run(c, link), "symlink")


# --------------------------------------------------------------------------- another process
def test_live_process_blocks_destroy_until_it_dies(pool_path, helpers):
    fill(pool_path)
    h = helpers(pool_path)
    rep = inspect_json(pool_path)
    (p,) = rep["processes"]
    assert (p["pid"], p["slot"], p["alive"]) == (h.pid, h.slot, True)
    assert abs(p["started_ns"] - time.time_ns()) < 120 * 10**9
    out = run("inspect", pool_path).stdout
    assert re.search(rf"^\s+{h.slot}\s+{h.pid}\s+\d+\s+alive\s", out, re.M), out

    r = run("destroy", pool_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refusing" in r.stderr and f"pid {h.pid}" in r.stderr
    assert os.path.exists(pool_path)

    h.kill()
    for _ in range(2):  # inspect neither reaps nor repairs: the slot stays dead
        rep = inspect_json(pool_path)
        (p,) = rep["processes"]
        assert (p["pid"], p["alive"]) == (h.pid, False)
        assert rep["repair"]["dead_processes"] == [h.slot]
    out = run("inspect", pool_path).stdout
    assert re.search(rf"^\s+{h.slot}\s+{h.pid}\s+\d+\s+dead\s", out, re.M), out
    assert f"slot {h.slot} (pid {h.pid})" in out

    r = run("destroy", pool_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not os.path.exists(pool_path)
    assert_error(run("destroy", pool_path), "does not exist")


def test_destroy_force_with_a_live_process(pool_path, helpers):
    fill(pool_path)
    h = helpers(pool_path)
    r = run("destroy", pool_path, "--force")
    assert r.returncode == 0, r.stderr
    assert f"pid {h.pid}" in r.stderr and "warning" in r.stderr
    assert not os.path.exists(pool_path)
    assert h.put(5, 0) == 5  # its mapping outlives the name
    h.quit()


# --------------------------------------------------------------------------- bench and console script
def test_bench_is_dispatched(monkeypatch, capsys):
    import types

    from tools import cli
    got = []
    fake = types.ModuleType("tools.benchmarks")
    fake.main = lambda args: got.append(args) or 3
    monkeypatch.setitem(sys.modules, "tools.benchmarks", fake)
    assert cli.main(["bench", "--only", "ops", "-x"]) == 3
    assert got == [["--only", "ops", "-x"]]
    monkeypatch.setitem(sys.modules, "tools.benchmarks", None)  # as if the benchmarks were not installed
    assert cli.main(["bench"]) == 2
    assert "bench is unavailable" in capsys.readouterr().err


@pytest.mark.parametrize("module, extra", [("torch", "sglang"), ("matplotlib", "charts")])
def test_a_command_missing_an_extra_names_the_extra(monkeypatch, capsys, module, extra):
    import importlib
    import types

    from tools import cli
    fake = types.ModuleType("tools.benchmarks")
    fake.main = lambda args: importlib.import_module(module)
    monkeypatch.setitem(sys.modules, "tools.benchmarks", fake)
    monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
    monkeypatch.setenv("MARU_SHM_DEBUG", "1")  # a missing extra is not a bug: no traceback even then
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"needs {module}" in err and f"pip install 'maru-shm[{extra}]'" in err, err


def test_every_extra_the_cli_names_installs_its_module():
    import tomllib

    from tools import cli
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in cli.EXTRA_OF_MODULE.items():
        assert module in {re.split(r"[<>=!~;\[ ]", req)[0] for req in extras[extra]}, (module, extra)


def test_installed_console_script(pool_path):
    script = Path(sys.executable).parent / "maru-shm"
    if not script.exists():
        pytest.skip(f"no maru-shm console script next to {sys.executable} (project not pip-installed)")
    fill(pool_path)
    r = run("inspect", pool_path, "--json", cmd=[str(script)])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["index"]["entries"] == 220
    assert run("check", pool_path, cmd=[str(script)]).returncode == 0
    assert_error(run("inspect", pool_path + ".missing", cmd=[str(script)]), "does not exist")


def test_python_m_maru_shm_runs_the_cli(pool_path):
    import importlib.util
    if importlib.util.find_spec("maru_shm_tools") is None:
        pytest.skip("maru_shm_tools is not importable (project not pip-installed)")
    fill(pool_path)
    r = run("inspect", pool_path, "--json", cmd=[PY, "-m", "maru_shm"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["index"]["entries"] == 220
    assert_error(run("inspect", pool_path + ".missing", cmd=[PY, "-m", "maru_shm"]), "does not exist")


def test_the_install_adds_no_top_level_package_named_tools(tmp_path):
    """The CLI installs as maru_shm_tools: a package called `tools` in site-packages would collide with any
    other project's. Run from an empty directory, so the repository's own folder is not on the path."""
    script = Path(sys.executable).parent / "maru-shm"
    if not script.exists():
        pytest.skip(f"no maru-shm console script next to {sys.executable} (project not pip-installed)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib.util as u; print(u.find_spec('tools') is None, u.find_spec('maru_shm_tools') is not None)"
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr
    assert "maru_shm_tools.cli" in script.read_text()


# --------------------------------------------------------------------------- a real terminal
class Tmux:
    """One private tmux server (its own socket) holding one 160x50 session per command."""

    def __init__(self, exe):
        self.exe, self.sock = exe, f"maru-cli-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args, check=True) -> subprocess.CompletedProcess:
        r = subprocess.run([self.exe, "-f", "/dev/null", "-L", self.sock, *args], capture_output=True, text=True,
                           env=ENV, timeout=30)
        assert r.returncode == 0 or not check, (args, r.stderr)
        return r

    def start(self, name, argv):
        """Run argv in a new detached session `name`; the pane stays open after it exits."""
        cmd = ["new-session", "-d", "-s", name, "-x", "160", "-y", "50", shlex.join(argv) + "; sleep 600"]
        for _ in range(5):  # a server that is just starting up can refuse the first client
            r = self(*cmd, check=False)
            if r.returncode == 0:
                return
            time.sleep(0.3)
        raise AssertionError(f"tmux new-session failed: {r.stderr}")

    def screen(self, name) -> str:
        return self("capture-pane", "-p", "-t", name).stdout

    def wait_for(self, name, pred, timeout=30.0) -> str:
        deadline = time.monotonic() + timeout
        s = ""
        while time.monotonic() < deadline:
            s = self.screen(name)
            if pred(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"screen never matched; last screen:\n{s}")

    def kill(self):
        subprocess.run([self.exe, "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


def _puts_on_screen(screen: str) -> int | None:
    m = re.search(r"^puts\s+([\d,]+)", screen, re.M) or re.search(r"\bputs\s+([\d,]+)", screen)
    return int(m.group(1).replace(",", "")) if m else None


def test_inspect_and_watch_in_a_terminal(pool_path, helpers):
    exe = shutil.which("tmux")
    if exe is None:
        if os.environ.get("MARU_ALLOW_NO_TMUX") == "1":
            pytest.skip("tmux is not installed and MARU_ALLOW_NO_TMUX=1")
        pytest.fail("tmux is not installed: this test drives `maru-shm inspect/watch` in a real terminal. "
                    "Install tmux (scripts/test.sh does: apt-get install -y tmux), or set MARU_ALLOW_NO_TMUX=1 "
                    "to skip it.")
    fill(pool_path, n=60)
    h = helpers(pool_path)
    tm = Tmux(exe)
    try:
        tm.start("inspect", CLI + ["inspect", pool_path])
        s = tm.wait_for("inspect", lambda s: "Counters" in s and "orphans freed" in s)
        assert "\x1b" not in s
        for title in ("Size classes", "Index", "Processes", "Repair", "Counters"):
            assert re.search(rf"^{title}\s*$", s, re.M), (title, s)
        assert re.search(r"^class\s+kind\s+block\s+units\s+slabs\s+blocks\s+used\s+free\s+live payload\s+frag",
                         s, re.M), s
        assert "───" in s  # a drawn table, not the plain pipe format
        assert re.search(r"exact\s+20,000 B", s)
        assert re.search(rf"^\s*{h.slot}\s+{h.pid}\s+\d+\s+alive\b", s, re.M), s

        tm.start("watch", CLI + ["watch", pool_path, "--interval", "0.2"])
        s = tm.wait_for("watch", lambda s: "maru-shm watch" in s and _puts_on_screen(s) is not None)
        first = _puts_on_screen(s)
        assert first == 80, s
        assert h.put(25, 1000) == 25
        # a capture may catch a redraw half done: wait for a whole screen with the new count
        s = tm.wait_for("watch", lambda s: _puts_on_screen(s) == first + 25 and "Size classes" in s
                        and "Processes" in s and "orphans freed" in s)
        assert s.count("maru-shm watch") == 1  # refreshed in place, not appended
        assert re.search(r"entries\s+105 of", s), s
    finally:
        tm.kill()


# --------------------------------------------------------------------------- check writes nothing, stops no one
def test_check_without_repair_reports_a_dead_holders_damage_and_writes_nothing(pool_path, helpers):
    """A process died inside every shard's critical section and left its slot: check reports the dirty
    locks and the unreaped slot, and the file is byte for byte what it was (no reap, no lock repair)."""
    fill(pool_path)
    h = helpers(pool_path)
    h.hold_locks()
    h.kill()
    before = (digest(pool_path), os.stat(pool_path).st_mtime_ns)
    r = run("check", pool_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "left dirty" in r.stdout and "exited without detaching" in r.stdout, r.stdout
    assert (digest(pool_path), os.stat(pool_path).st_mtime_ns) == before
    r = run("check", pool_path, "--repair")  # repair does write, and heals it
    assert r.returncode == 0 and "ok after repair" in r.stdout, r.stdout


def test_check_after_a_process_exits_without_detaching_is_ok_and_says_what_the_next_opener_reaps(pool_path, helpers):
    """SGLang ends its schedulers without calling the backend's close(): the slot (and any block it still
    owned) is the next opener's to reap, so an operator's check after a normal shutdown exits 0 with a note."""
    fill(pool_path)
    h = helpers(pool_path)
    assert h.put(20, 5000) == 20
    h.kill()
    r = run("check", pool_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert re.search(r"note: \d+ thing\(s\) left by exited processes, which the next process to open the pool "
                     r"reaps \(not damage\); the first: .*exited", r.stdout), r.stdout
    assert "problem" not in r.stdout


def test_check_lets_writers_work_and_finds_nothing_on_a_busy_healthy_pool(pool_path, helpers):
    """Writers keep putting while check runs again and again: no false finding, and no writer waits for
    the whole check (each holds at most one domain's lock)."""
    fill(pool_path, size="64M")
    writers = [helpers(pool_path) for _ in range(2)]
    import threading
    stop = threading.Event()
    done = []

    def write(h, base):
        n = 0
        while not stop.is_set():
            assert h.put(20, base + n) == 20
            n += 20
        done.append(n)

    ts = [threading.Thread(target=write, args=(h, 100_000 * (i + 1))) for i, h in enumerate(writers)]
    for t in ts:
        t.start()
    try:
        for _ in range(4):
            r = run("check", pool_path)
            assert r.returncode == 0 and ": ok (" in r.stdout, (r.stdout, r.stderr)
    finally:
        stop.set()
        for t in ts:
            t.join()
    assert all(n > 0 for n in done)


def test_no_command_blocks_on_a_fifo_at_the_pool_path(tmp_path):
    fifo = tmp_path / "pool"
    os.mkfifo(fifo)
    for args in (("inspect", fifo), ("check", fifo), ("watch", fifo, "--count", "1")):
        r = run(*args, timeout=20)  # a read-only open of a FIFO used to wait for a writer forever
        assert_error(r, "neither a regular file nor a DAX device")
