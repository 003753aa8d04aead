"""capacity: Llama-3.1-8B pages (131072 B) filling a pool: live payload / file, vs Maru's fixed 1 MiB chunks."""

from __future__ import annotations

import os

from maru_shm import Store, remove_pool

from .registry import figure, pool_path, progress_of, scenario


NAME = "capacity"


@scenario(NAME)
def bench_capacity(args) -> dict:
    page = 131072
    size = args.pool_size
    path = pool_path("cap")
    try:
        with Store.open(path, size=size, create=True) as s:
            s.declare_size(page)
            buf = os.urandom(page)
            n = int(size // page * 1.1)
            keys = [f"page-{i}" for i in range(n)]
            for i in range(0, n, 128):
                s.batch_put(keys[i:i + 128], [buf] * len(keys[i:i + 128]))
                progress_of(args)(i / n)
            st = s.stats()
            assert s.check().ok
        maru_fixed = page / (1 << 20)
        met = st["utilization"] >= 0.97
        return {"scenario": "capacity", "pool_bytes": size, "value_bytes": page, "ours": st["utilization"],
                "peer": maru_fixed, "peer_name": "Maru fixed 1 MiB chunk", "goal": 0.97,
                "met": met, "entries": st["entries"], "evictions": st["evictions"],
                "figures": [figure("live payload / file", st["utilization"], maru_fixed, "Maru fixed 1 MiB chunk",
                                   goal=">= 0.97", met=met)]}
    finally:
        remove_pool(path)


MARU_CHUNK = 1 << 20  # Maru's fixed chunk: a value takes whole 1 MiB chunks

def simulate_slots(sizes, capacity, slot_of):
    """Live payload / capacity at the end of a FIFO cache whose items occupy slot_of(size) bytes."""
    live, used, q = 0, 0, []
    for sz in sizes:
        occ = slot_of(sz)
        q.append((sz, occ))
        live += sz
        used += occ
        while used > capacity:
            s0, o0 = q.pop(0)
            live -= s0
            used -= o0
    return live / capacity
