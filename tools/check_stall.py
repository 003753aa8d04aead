"""How long writers stall while `maru-shm check` runs on a live pool (RELIABILITY.md section 10).

    python -m tools.check_stall [--size 4G] [--writers 2] [--seconds 2]

Fills a pool with 128 KiB pages, starts writer processes that put batches of 8 pages in a loop and
record each batch's latency, runs `maru-shm check` (as a subprocess) in the middle, and prints the
writers' p50 / p99 / max batch latency outside and during the check, and the check's own time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

from maru_shm import remove_pool

PAGE = 128 << 10


def _writer(path: str, seed: int, stop, out) -> None:
    from maru_shm import Store
    s = Store.open(path, timeout=60)
    rng = np.random.default_rng(seed)
    vals = [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in range(8)]
    stamps = []
    n = 0
    while not stop.is_set():
        keys = [f"w{seed}-{(n + i) % 4096}" for i in range(8)]
        t0 = time.monotonic()
        s.batch_put(keys, vals)
        stamps.append((t0, time.monotonic() - t0))
        n += 8
    s.close()
    out.put(stamps)


def main(argv=None) -> int:
    from maru_shm import Store
    from maru_shm import parse_size
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="writing before and after the check")
    ap.add_argument("--path", default=f"/dev/shm/maru-check-stall-{os.getpid()}")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    with Store.open(a.path, size, create=True) as s:
        s.declare_size(PAGE)
        page = np.zeros(PAGE, np.uint8)
        keys = [f"fill{i}" for i in range(int(size * 0.9) // PAGE)]
        for i in range(0, len(keys), 128):
            s.batch_put(keys[i:i + 128], [page] * len(keys[i:i + 128]))
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_writer, args=(a.path, i, stop, out)) for i in range(a.writers)]
    try:
        for p in ps:
            p.start()
        time.sleep(a.seconds)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "tools.cli", "check", a.path], capture_output=True, text=True)
        t1 = time.monotonic()
        time.sleep(a.seconds)
        stop.set()
        stamps = [x for _ in ps for x in out.get(timeout=120)]
        for p in ps:
            p.join(30)
    finally:
        remove_pool(a.path)
    during = np.array([d for t, d in stamps if t0 <= t <= t1 or t <= t0 <= t + d]) * 1e3
    outside = np.array([d for t, d in stamps if t + d < t0 or t > t1]) * 1e3
    print(f"check of a {a.size} pool: {t1 - t0:.2f} s, exit {r.returncode}: {r.stdout.strip()}")
    for name, x in (("writers outside the check", outside), ("writers during the check", during)):
        if len(x):
            print(f"{name}: {len(x)} batches of 8 x 128 KiB, p50 {np.percentile(x, 50):.1f} ms, "
                  f"p99 {np.percentile(x, 99):.1f} ms, max {x.max():.1f} ms")
        else:
            print(f"{name}: no batch completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
