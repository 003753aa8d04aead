"""mixed: uniform 50-512 KiB payloads written at 3x the pool size: live payload / file at the end, vs fixed
512 KiB slots, power-of-two classes and Maru's 1 MiB chunks simulated on the same sequence."""

from __future__ import annotations

import os
import random

from maru_shm import Store, remove_pool

from .capacity import MARU_CHUNK, simulate_slots
from .registry import figure, pool_path, progress_of, scenario


NAME = "mixed"


@scenario(NAME)
def bench_mixed(args) -> dict:
    size = args.pool_size
    rnd = random.Random(7)
    lo, hi = 50 << 10, 512 << 10
    total, sizes = 0, []
    while total < 3 * size:
        n = rnd.randint(lo, hi)
        sizes.append(n)
        total += n
    blob = os.urandom(hi)
    path = pool_path("mixed")
    samples = []
    try:
        with Store.open(path, size=size, create=True) as s:
            for i in range(0, len(sizes), 64):
                chunk = sizes[i:i + 64]
                s.batch_put([f"m{i + j}" for j in range(len(chunk))], [memoryview(blob)[:n] for n in chunk])
                if i > len(sizes) // 2 and (i // 64) % 8 == 0:
                    samples.append(s.stats()["utilization"])
                progress_of(args)(i / len(sizes))
            st = s.stats()
            assert s.check().ok
    finally:
        remove_pool(path)
    pow2 = simulate_slots(sizes, size, lambda n: 1 << (n - 1).bit_length())
    fixed = simulate_slots(sizes, size, lambda n: hi)
    maru_1m = simulate_slots(sizes, size, lambda n: -(-n // MARU_CHUNK) * MARU_CHUNK)
    ours = min(samples + [st["utilization"]])
    met = ours >= 0.90
    return {"scenario": "mixed", "pool_bytes": size, "written_bytes": total, "ours": ours,
            "ours_final": st["utilization"], "fixed_512k": fixed, "pow2_classes": pow2, "maru_1m": maru_1m,
            "goal": 0.90, "met": met, "evictions": st["evictions"],
            "figures": [figure("live payload / file (min over churn)", ours, fixed, "fixed 512 KiB slots",
                               goal=">= 0.90", met=met),
                        figure("live payload / file (min over churn)", ours, pow2, "power-of-two classes"),
                        figure("live payload / file (min over churn)", ours, maru_1m, "Maru fixed 1 MiB chunks")]}
