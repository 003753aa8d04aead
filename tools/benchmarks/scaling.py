"""Process-scaling scenario of `maru-shm bench`: 1, 2, 4, 8 processes on one pool.

Each process attaches to the same pool and, for a fixed time after a common
start barrier, does single-key operations on a shared key space: 50 % `get_into`
and 50 % `put` of 128 KiB values (key and operation drawn from a seeded
stream, the same for both contestants). Every operation is timed with
`time.perf_counter_ns`; the figures are aggregate ops/s (sum over processes of
ops / own elapsed time), p50 and p99 latency over all operations of the round,
and lock time: in each child (and only there), `LockTable.acquire` and the OFD
try-lock are wrapped to add up the time spent acquiring locks and the share of
acquisitions that found the lock taken and had to wait (maru_shm keeps no
such figure itself; it only counts timeouts).

The peer, measured by the same processes in alternating rounds: the copy
limit, a plain `memmove` of 128 KiB into (put) or out of (get) a slot of one
shared /dev/shm mapping of the same key space, no index and no locks.

Every round also records the CPU time the processes got (`time.process_time`)
per second of the round: `cores_busy`. For the copy rounds, which never wait,
that is how many cores the machine actually gave n processes (on a shared
machine, fewer than it has); for ours, the difference from the copy rounds is
time spent asleep in lock back-off. The verdict reports it next to ours.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from maru_shm import remove_pool

from .registry import figure, progress_of, scenario

VALUE = 128 << 10
PROCESSES = (1, 2, 4, 8)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class _LockMeter:
    """Child-only wrap of the lock path: time inside acquire, and acquisitions that had to wait."""

    def __init__(self):
        import maru_shm.locking.locks as locks
        self.locks = locks
        self.acquire_ns = self.wait_ns = self.acquires = self.waited = 0
        self._busy = False
        self._depth = 0
        orig_try = locks.ofd_trylock
        pc = time.perf_counter_ns
        meter = self

        def trylock(fd, lock_id, n=1, **kw):
            ok = orig_try(fd, lock_id, n, **kw)
            if not ok:
                meter._busy = True
            return ok

        def timed(orig, counts_as_wait):
            """Wrap a lock-taking method: time inside it, and whether a try-lock inside found it taken."""
            def wrapper(self, *args):
                if meter._depth:  # count the outermost call only
                    return orig(self, *args)
                meter._depth += 1
                meter._busy = False
                t0 = pc()
                try:
                    return orig(self, *args)
                finally:
                    meter._depth -= 1
                    dt = pc() - t0
                    meter.acquire_ns += dt
                    meter.acquires += 1
                    if meter._busy and counts_as_wait(args):
                        meter.wait_ns += dt
                        meter.waited += 1
            return wrapper

        locks.ofd_trylock = trylock  # the lock paths look the name up in their module at call time
        # Every taker (acquire, hold, acquire_many, hold_many) goes through _take or _take_many. A failed
        # non-blocking try-lock is not a wait (_take's 4th argument: blocking); a batch of shard locks always blocks.
        locks.LockTable._take = timed(locks.LockTable._take, lambda args: args[3])
        locks.LockTable._take_many = timed(locks.LockTable._take_many, lambda args: True)

    def take(self) -> tuple[int, int, int, int]:
        r = (self.acquire_ns, self.wait_ns, self.acquires, self.waited)
        self.acquire_ns = self.wait_ns = self.acquires = self.waited = 0
        return r


def _worker(rank: int, pool: str, copy_path: str, n_keys: int, barrier, conn) -> None:
    """Child: attach, then run rounds on command until told to stop."""
    from maru_shm import Store
    meter = _LockMeter()
    store = Store.open(pool, populate=True)
    fd = os.open(copy_path, os.O_RDWR)
    cmm = mmap.mmap(fd, n_keys * VALUE)
    try:
        cmm.madvise(23)  # populate, as the pool is
    except (OSError, ValueError):
        pass
    anchor = ctypes.c_char.from_buffer(cmm)
    base = ctypes.addressof(anchor)
    val = os.urandom(VALUE)
    src = ctypes.c_char_p(val)
    out = bytearray(VALUE)
    out_c = (ctypes.c_char * VALUE).from_buffer(out)
    keys = [f"scale-{i}" for i in range(n_keys)]
    memmove, pc = ctypes.memmove, time.perf_counter_ns
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, mode, duration, seed = cmd
            rng = np.random.default_rng(seed * 1009 + rank)
            n = 1 << 16
            ks = rng.integers(0, n_keys, n).tolist()
            gets = (rng.random(n) < 0.5).tolist()
            lats: list[int] = []
            hits = misses = fails = 0
            meter.take()
            barrier.wait()
            cpu0 = time.process_time()
            t_start = pc()
            deadline = t_start + int(duration * 1e9)
            i = 0
            if mode == "maru":
                get_into, put = store.get_into, store.put
                while True:
                    j = i & (n - 1)
                    k, g = keys[ks[j]], gets[j]
                    t0 = pc()
                    if t0 >= deadline:
                        break
                    if g:
                        r = get_into(k, out)
                    else:
                        r = put(k, val)
                    lats.append(pc() - t0)
                    if g:
                        if r is None:
                            misses += 1
                        else:
                            hits += 1
                    elif not r:
                        fails += 1
                    i += 1
            else:
                while True:
                    j = i & (n - 1)
                    a, g = base + ks[j] * VALUE, gets[j]
                    t0 = pc()
                    if t0 >= deadline:
                        break
                    if g:
                        memmove(out_c, a, VALUE)
                    else:
                        memmove(a, src, VALUE)
                    lats.append(pc() - t0)
                    i += 1
            elapsed = (pc() - t_start) / 1e9
            cpu_s = time.process_time() - cpu0
            is_get = np.asarray(gets, dtype=bool)[np.arange(i) & (n - 1)]
            conn.send({"ops": i, "elapsed": elapsed, "lat": np.asarray(lats, dtype=np.int64).tobytes(),
                       "is_get": is_get.tobytes(), "cpu_s": cpu_s,
                       "locks": meter.take(), "hits": hits, "misses": misses, "put_failures": fails})
    finally:
        del out_c, anchor
        cmm.close()
        os.close(fd)
        store.close()


def _round(conns, barrier, mode: str, duration: float, seed: int) -> dict:
    """One timed round in every worker; a worker that died fails the round instead of hanging it."""
    limit = 60 + 4 * duration
    for c in conns:
        c.send(("run", mode, duration, seed))
    try:
        barrier.wait(timeout=limit)
    except Exception as e:  # threading.BrokenBarrierError: a worker never arrived
        raise RuntimeError("scaling worker did not start its round (it died: see its traceback above)") from e
    res = []
    for c in conns:
        if not c.poll(limit):
            raise RuntimeError("scaling worker did not finish its round")
        res.append(c.recv())
    lat = np.concatenate([np.frombuffer(r["lat"], dtype=np.int64) for r in res])
    is_get = np.concatenate([np.frombuffer(r["is_get"], dtype=bool) for r in res])

    def pct(x, q):
        return float(np.percentile(x, q)) / 1e3 if x.size else float("nan")
    ops = sum(r["ops"] for r in res)
    acq_ns, wait_ns, acq, waited = (sum(r["locks"][i] for r in res) for i in range(4))
    busy_s = sum(r["elapsed"] for r in res)
    return {"ops_s": sum(r["ops"] / r["elapsed"] for r in res if r["elapsed"] > 0), "ops": ops,
            "p50_us": pct(lat, 50), "p99_us": pct(lat, 99),
            "get_p50_us": pct(lat[is_get], 50), "get_p99_us": pct(lat[is_get], 99),
            "put_p50_us": pct(lat[~is_get], 50), "put_p99_us": pct(lat[~is_get], 99),
            "lock_us_per_op": acq_ns / 1e3 / ops if ops else 0.0,
            "lock_wait_us_per_op": wait_ns / 1e3 / ops if ops else 0.0,
            "lock_wait_share": wait_ns / 1e9 / busy_s if busy_s else 0.0,
            "lock_share": acq_ns / 1e9 / busy_s if busy_s else 0.0,
            "acquires_waited": waited / acq if acq else 0.0, "acquires": acq,
            # CPU seconds the processes got per second of the round: how many cores were theirs
            "cores_busy": sum(r["cpu_s"] for r in res) / (busy_s / len(res)) if busy_s else 0.0,
            # work done per CPU-second: what survives a machine that gives fewer cores than it has
            "ops_per_cpu_s": ops / sum(r["cpu_s"] for r in res) if sum(r["cpu_s"] for r in res) else 0.0,
            "hits": sum(r["hits"] for r in res), "misses": sum(r["misses"] for r in res),
            "put_failures": sum(r["put_failures"] for r in res)}


def _med(rounds: list[dict], key: str) -> dict:
    xs = [r[key] for r in rounds]
    return {"median": statistics.median(xs), "spread": [min(xs), max(xs)]}


def scaling(processes=PROCESSES, duration: float = 1.0, repeat: int = 3, n_keys: int = 512,
            progress=None, pool: str | None = None, pool_bytes: int | None = None) -> dict:
    """Aggregate ops/s, p50/p99 and lock time at each process count, ours vs the copy limit."""
    from maru_shm import Store
    pool = pool or os.path.join("/dev/shm", f"maru-bench-{os.getpid()}-scaling")
    copy_path = pool + "-copy"
    # room for every key plus the overwrites in flight, and for slabs the keys do not fill
    pool_bytes = pool_bytes or max(256 << 20, 3 * n_keys * VALUE)
    ctx = mp.get_context("spawn")
    points = []
    total = len(processes) * repeat
    done = 0
    try:
        with Store.open(pool, size=pool_bytes, create=True, populate=True) as s:
            s.declare_size(VALUE)
            val = os.urandom(VALUE)
            keys = [f"scale-{i}" for i in range(n_keys)]
            for i in range(0, n_keys, 64):
                assert all(s.batch_put(keys[i:i + 64], [val] * len(keys[i:i + 64])))
        with open(copy_path, "wb") as f:
            f.truncate(n_keys * VALUE)
        for n in processes:
            barrier = ctx.Barrier(n + 1)
            pipes = [ctx.Pipe() for _ in range(n)]
            procs = [ctx.Process(target=_worker, args=(r, pool, copy_path, n_keys, barrier, pipes[r][1]),
                                 daemon=True) for r in range(n)]
            for p in procs:
                p.start()
            conns = [a for a, _ in pipes]
            rounds: dict[str, list] = {"maru": [], "copy": []}
            try:
                for rep in range(repeat):
                    order = ("maru", "copy") if rep % 2 == 0 else ("copy", "maru")
                    for mode in order:
                        rounds[mode].append(_round(conns, barrier, mode, duration, rep))
                    done += 1
                    if progress is not None:
                        progress(done / total, f"{n} process{'es' if n > 1 else ''}, round {rep + 1}/{repeat}")
                for c in conns:
                    c.send(("stop",))
            finally:
                for p in procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                        p.join()
            bad = [p.exitcode for p in procs if p.exitcode != 0]
            if bad:
                raise RuntimeError(f"scaling worker exited with {bad}")
            pt = {"processes": n}
            for key in ("ops_s", "p50_us", "p99_us", "get_p50_us", "get_p99_us", "put_p50_us", "put_p99_us",
                        "lock_us_per_op", "lock_wait_us_per_op", "lock_wait_share",
                        "lock_share", "acquires_waited"):
                pt[key] = _med(rounds["maru"], key)
            for key in ("ops_s", "p50_us", "p99_us", "get_p50_us", "get_p99_us", "put_p50_us", "put_p99_us"):
                pt[f"copy_{key}"] = _med(rounds["copy"], key)
            pt["cores_busy"] = _med(rounds["maru"], "cores_busy")
            pt["copy_cores_busy"] = _med(rounds["copy"], "cores_busy")
            pt["ops_per_cpu_s"] = _med(rounds["maru"], "ops_per_cpu_s")
            pt["copy_ops_per_cpu_s"] = _med(rounds["copy"], "ops_per_cpu_s")
            r = rounds["maru"]
            pt["ratio"] = pt["ops_s"]["median"] / pt["copy_ops_s"]["median"]
            pt["gets_hit"] = sum(x["hits"] for x in r) / max(1, sum(x["hits"] + x["misses"] for x in r))
            pt["put_failures"] = sum(x["put_failures"] for x in r)
            points.append(pt)
    finally:
        for p in (pool, copy_path):
            remove_pool(p)
    return {"value_bytes": VALUE, "keys": n_keys, "duration_s": duration, "repeat": repeat, "cores": cores(),
            "points": points, **verdict(points, cores())}


def verdict(points: list[dict], ncores: int) -> dict:
    """The goal: scales to the core count and does not collapse beyond it."""
    by_n = {p["processes"]: p["ops_s"]["median"] for p in points}
    cby_n = {p["processes"]: p["copy_ops_s"]["median"] for p in points}
    uby_n = {p["processes"]: p["copy_cores_busy"]["median"] for p in points if "copy_cores_busy" in p}
    out: dict = {}
    one = by_n.get(1)
    at = max((n for n in by_n if n <= ncores), default=None)
    if one and at and at > 1:
        speedup = by_n[at] / one
        out["scales"] = {"at_processes": at, "speedup": speedup, "goal": 0.8 * at, "met": speedup >= 0.8 * at,
                         "copy_speedup": cby_n[at] / cby_n[1] if cby_n.get(1) else None,
                         "cpu_speedup": uby_n[at] / uby_n[1] if uby_n.get(1) and at in uby_n else None}
        cpu = out["scales"]["cpu_speedup"]
        # ours against what the machine gave (1.0: we used every bit of the extra CPU we got); only
        # meaningful when the machine gave noticeably more than one process gets
        out["scales"]["speedup_of_cpu_gain"] = (speedup - 1) / (cpu - 1) if cpu and cpu > 1.2 else None
    else:
        out["scales"] = None  # one core, or no 1-process point: nothing to scale to
    last = max(by_n)
    if len(by_n) > 1:
        peak = max(by_n.values())
        out["no_collapse"] = {"at_processes": last, "of_peak": by_n[last] / peak, "goal": 0.8,
                              "met": by_n[last] / peak >= 0.8,
                              "copy_of_peak": cby_n[last] / max(cby_n.values()) if cby_n else None}
    else:
        out["no_collapse"] = None
    checks = [v["met"] for v in (out["scales"], out["no_collapse"]) if v]
    out["met"] = all(checks) if checks else None
    return out


NAME = "scaling"


@scenario(NAME)
def bench_scaling(args) -> dict:
    r = scaling(args.processes, duration=args.duration, repeat=args.repeat, progress=progress_of(args))
    figs = []
    for p in r["points"]:
        n = p["processes"]
        figs.append(figure(f"{n} processes, aggregate ops/s", p["ops_s"]["median"], p["copy_ops_s"]["median"],
                           "plain 128 KiB copies, same processes", unit="ops/s", spread=p["ops_s"]["spread"],
                           peer_spread=p["copy_ops_s"]["spread"]))
        for q in ("p50", "p99"):
            figs.append(figure(f"{n} processes, {q} latency", p[f"{q}_us"]["median"], p[f"copy_{q}_us"]["median"],
                               "plain 128 KiB copies, same processes", unit="us", spread=p[f"{q}_us"]["spread"],
                               peer_spread=p[f"copy_{q}_us"]["spread"], better="lower"))
        figs.append(figure(f"{n} processes, lock wait per op", p["lock_wait_us_per_op"]["median"], unit="us",
                           spread=p["lock_wait_us_per_op"]["spread"], better="lower",
                           share_of_time=p["lock_wait_share"]["median"]))
    sc, nc = r["scales"], r["no_collapse"]
    if sc:
        figs.append(figure(f"speedup at {sc['at_processes']} processes (largest count <= cores) over 1", sc["speedup"],
                           sc["copy_speedup"], "copy limit speedup", goal=f">= {sc['goal']:.2g}", met=sc["met"]))
    if nc:
        figs.append(figure(f"ops/s at {nc['at_processes']} processes / peak", nc["of_peak"], nc["copy_of_peak"],
                           "copy limit, same", goal=">= 0.8", met=nc["met"]))
    return {"scenario": "scaling", **r, "figures": figs}
