"""kill -9 chaos: workers hammer one pool while a killer SIGKILLs one every 20-200 ms.

    python -m tools.chaos --seconds 10 --workers 4            # short mode (CI)
    python -m tools.chaos --seconds 600 --workers 8 --size 1G # long mode, by hand

With --threads N each worker is a process of N threads sharing one Store.

Every value is self-verifying (its bytes derive from key and version), so a
worker detects any wrong read on the spot and records it in shared memory
before anything can kill it. Afterwards a fresh process opens the pool (which reaps
the dead) and check() must find nothing, not even an orphan; then check(repair=True),
and check() must be clean, every key still present must verify, no block may be held by
a dead process, the workers must have seen zero wrong reads, and no worker may
have died of an exception of its own (`worker_crashes`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time

from maru_shm import LockTimeout, Store, remove_pool

SIZES = (4096, 5000, 20000, 70000, 131072)


def make_value(key: str, version: int, n: int) -> bytes:
    """n bytes that only (key, version) produce: 8-byte version, then a keyed stream."""
    seed = hashlib.blake2b(f"{key}:{version}".encode(), digest_size=32).digest()
    body = (seed * (n // 32 + 1))[:n - 8]
    return version.to_bytes(8, "little") + body


def verify(key: str, value: bytes) -> bool:
    if len(value) < 8:
        return False
    return value == make_value(key, int.from_bytes(value[:8], "little"), len(value))


def worker(path: str, wid: int, nkeys: int, counters, seed: int, threads: int = 1) -> None:
    """`threads` threads sharing one Store, each running the mixed workload until the process is killed
    (SGLang runs several storage threads per backend: a SIGKILL lands with several of them mid-batch)."""
    store = Store.open(path)
    if threads <= 1:
        _work(store, wid, nkeys, counters, seed)
    import threading
    for t in range(threads):
        threading.Thread(target=_work, args=(store, wid * threads + t, nkeys, counters, seed + t),
                         daemon=True).start()
    threading.Event().wait()


def _work(store, wid: int, nkeys: int, counters, seed: int) -> None:
    """Mixed workload: put, get, delete, overwrite, batch put/get/exists."""
    rnd = random.Random(seed)
    ops = 0
    while True:
        key = f"k{rnd.randrange(nkeys)}"
        r = rnd.random()
        try:
            if r < 0.35:
                store.put(key, make_value(key, rnd.getrandbits(40), rnd.choice(SIZES)))
            elif r < 0.75:
                v = store.get(key)
                if v is not None and not verify(key, v):
                    counters[2 * wid + 1] += 1
            elif r < 0.82:
                store.delete(key)
            elif r < 0.92:
                # 16 values of 128 KiB, or 128 of 4 KiB: a batch touching most index shards (their whole
                # range is locked at once, ofd.dense_range)
                n, size = (16, 131072) if rnd.random() < 0.5 else (128, 4096)
                keys = [f"k{rnd.randrange(nkeys)}" for _ in range(n)]
                store.batch_put(keys, [make_value(k, rnd.getrandbits(40), size) for k in keys],
                                skip_existing=rnd.random() < 0.5)
            else:
                keys = [f"k{rnd.randrange(nkeys)}" for _ in range(16)]
                outs = [bytearray(131072) for _ in keys]
                for k, o, n in zip(keys, outs, store.batch_get_into(keys, outs)):
                    if n is not None and not verify(k, bytes(o[:n])):
                        counters[2 * wid + 1] += 1
                store.batch_exists(keys)
                store.leading_hits(keys)
        except LockTimeout:
            pass  # a lock held by a process frozen mid-kill: that call fails, the next goes on
        ops += 1
        if ops % 16 == 0:
            counters[2 * wid] = ops


def run(path: str, seconds: float, workers: int, size: str, nkeys: int, seed: int, progress=None,
        threads: int = 1, min_kills: int = 0) -> dict:
    """Kill and respawn workers for `seconds`, and on until at least `min_kills` kills (a slow machine forks slowly)."""
    remove_pool(path)
    Store.open(path, size=size, create=True).close()
    ctx = mp.get_context("fork")
    slots = workers + 1
    counters = ctx.Array("q", 2 * slots * 1024 * threads, lock=False)  # (ops, wrong reads) per worker thread
    rnd = random.Random(seed)
    incarnation = 0

    def spawn():
        nonlocal incarnation
        wid = incarnation % (slots * 1024)
        incarnation += 1
        p = ctx.Process(target=worker, args=(path, wid, nkeys, counters, rnd.getrandbits(32), threads), daemon=True)
        p.start()
        return p

    procs = [spawn() for _ in range(workers)]
    kills = crashes = 0

    def stop(p) -> None:
        """SIGKILL a worker; one that already ended by itself raised (a bug): count it, never kill a reused pid."""
        nonlocal crashes
        if p.exitcode is not None or not p.is_alive():
            crashes += 1
        else:
            os.kill(p.pid, signal.SIGKILL)
        p.join()

    end = time.monotonic() + seconds
    while time.monotonic() < end or kills < min_kills:
        time.sleep(rnd.uniform(0.02, 0.2))
        victim = rnd.randrange(len(procs))
        stop(procs[victim])
        kills += 1
        procs[victim] = spawn()
        if progress:
            progress(kills, end - time.monotonic())
    for p in procs:
        stop(p)
    ops = sum(counters[0::2])
    wrong = sum(counters[1::2])
    with Store.open(path) as store:  # opening reaps the dead workers' slots, as any next process would
        before = store.check()
        repaired = store.check(repair=True)
        after = store.check()
        present = bad_values = 0
        for i in range(nkeys):
            v = store.get(f"k{i}")
            if v is not None:
                present += 1
                bad_values += not verify(f"k{i}", v)
        st = store.stats()
    remove_pool(path)
    ok = wrong == 0 and bad_values == 0 and after.ok and st["processes"] == 1 and crashes == 0
    orphans = sum("orphan" in p for p in before.problems)
    ok = ok and orphans == 0  # a dirty lock is repaired by its next holder, by design: not a failure
    return {"ok": ok, "seconds": seconds, "min_kills": min_kills, "workers": workers, "threads": threads, "kills": kills,
            "worker_crashes": crashes, "orphans_after_reaping": orphans, "problems_after_reaping": before.problems[:20],
            "operations": ops,
            "wrong_reads": wrong, "repair_fixes": repaired.repaired, "problems_before_repair": repaired.problems[:20],
            "problems_after_repair": after.problems[:20], "keys_present": present, "bad_values": bad_values,
            "evictions": st["evictions"], "repairs_by_lock_holders": st["repairs"],
            "orphans_freed": st["orphans_freed"], "utilization": st["utilization"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default=f"/dev/shm/maru-chaos-{os.getpid()}")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker process, sharing its Store")
    ap.add_argument("--min-kills", type=int, default=0, help="go on past --seconds until this many SIGKILLs")
    ap.add_argument("--size", default="128M")
    ap.add_argument("--keys", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.pool, a.seconds, a.workers, a.size, a.keys, a.seed, threads=a.threads, min_kills=a.min_kills)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:24s} {v}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
