"""The L3 tiers `maru-shm bench --only serving` puts under SGLang's schedulers, each at a byte budget, and
what each one tells about its contents and evictions.

  none      HiCache's host pool (L2) only: no storage backend.
  file      SGLang's HiCacheFile in a directory on /dev/shm. It has no capacity: it never evicts, and it
            holds the whole working set whatever the budget.
  mooncake  SGLang's own MooncakeStore backend against a real mooncake_master and one storage process on
            loopback (tools/mooncake_local.py), whose segment is the budget. SGLang's clients mount no
            memory of their own (global_segment_size 0), so the budget is the whole store. The master's
            metrics count evicted keys (a page is one key per K and V buffer, or one).
  maru      MaruStorage on one pool file of the budget's size; its counters count evicted values.
  maru-spin, maru-sleep  the same with `maru_openmp_wait: spin` (the host's idle OpenMP workers spin, as
            without the pool) or `sleep` (they always sleep): with maru's `auto`, the A/B of that rule
            (maru_sglang.openmpwait). Asked for by name, never by default.
Counters are read without attaching to the pool (a read-only view), so reading them never reaps a slot.

Emptying between runs is SGLang's /hicache/storage-backend/clear, each backend's own clear(). HiCacheFile
deletes its files and Mooncake removes every object not under a read lease (cleared again until none is
left). MaruStorage retires its key namespace: nothing is reachable at once, but the pages stay, counted
as entries, until eviction reclaims them, so a bounded pool starts its second run full of retired pages
(evicted as needed, and counted as evictions) where the others start empty.
"""

from __future__ import annotations

import os
import shutil
import urllib.request

from maru_shm import PoolView, format_size, pool_report, remove_pool

MARU = {"maru": {}, "maru-spin": {"maru_openmp_wait": "spin"},
        "maru-sleep": {"maru_openmp_wait": "sleep"}}  # MaruStorage, with the keys each adds
WAIT_ARMS = tuple(n for n in MARU if n != "maru")  # another OpenMP wait only: with one thread, maru again
NAMES = ("none", "file", "mooncake", *MARU)
BOUNDED = ("mooncake", *MARU)  # the tiers a budget limits; the others run once, at no budget


class L3:
    """One tier for one deployment: `spec_fields()` configure its servers; `counters()` read it."""

    def __init__(self, name: str, budget: int | None, work_dir: str, tag: str):
        if name not in NAMES:
            raise ValueError(f"unknown L3 {name!r}; one of {', '.join(NAMES)}")
        self.name, self.budget, self.work_dir = name, budget if name in BOUNDED else None, work_dir
        self.pool = os.path.join("/dev/shm", f"maru-bench-serving-{os.getpid()}-{tag}") if name in MARU else None
        self.file_dir = (os.path.join("/dev/shm", f"maru-bench-serving-file-{os.getpid()}-{tag}")
                         if name == "file" else None)
        self.cluster = None

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name} {format_size(self.budget, style='short')}"

    def __enter__(self) -> "L3":
        if self.name in MARU:
            remove_pool(self.pool)
        elif self.name == "file":
            os.makedirs(self.file_dir, exist_ok=True)
        elif self.name == "mooncake":
            from .mooncake_local import MooncakeCluster, unavailable
            why = unavailable()
            if why:
                raise RuntimeError(why)
            self.cluster = MooncakeCluster(self.work_dir, segment=self.budget).start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.pool is not None:
            remove_pool(self.pool)
        if self.file_dir is not None:
            shutil.rmtree(self.file_dir, ignore_errors=True)

    def spec_fields(self) -> dict:
        """ServerSpec fields for this tier."""
        if self.name in MARU:
            return {"l3": "maru", "pool": self.pool, "pool_size": str(self.budget), "maru_keys": MARU[self.name]}
        if self.name == "file":
            return {"l3": "file", "file_dir": self.file_dir}
        if self.name == "mooncake":
            return {"l3": "mooncake", "l3_config": {**self.cluster.settings, "global_segment_size": 0}}
        return {"l3": "none"}

    def left_after_clear(self) -> int | None:
        """Entries still reachable after a clear: 0 when empty, None where it cannot be counted (MaruStorage:
        its clear() makes every page unreachable at once, and its entries stay until evicted)."""
        if self.name == "none":
            return 0
        if self.name in MARU:
            return None
        return self.counters()["entries"]

    def counters(self) -> dict:
        """{"evictions", "entries", "bytes"} as this tier counts them; None where it has no such count."""
        if self.name in MARU:
            with PoolView.open(self.pool) as view:
                r = pool_report(view)
            return {"evictions": r["counters"]["evictions"], "entries": r["index"]["entries"],
                    "bytes": r["space"]["live_bytes"]}
        if self.name == "mooncake":
            url = f"http://127.0.0.1:{self.cluster.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            from .benchclient import metric_sum
            return {"evictions": int(metric_sum(text, "master_evicted_key_count")),
                    "entries": int(metric_sum(text, "master_key_count")),
                    "bytes": int(metric_sum(text, "master_allocated_bytes"))}
        if self.name == "file":
            entries, size = 0, 0
            with os.scandir(self.file_dir) as it:
                for entry in it:
                    try:
                        size += entry.stat().st_size
                        entries += 1
                    except FileNotFoundError:  # removed by a clear meanwhile
                        pass
            return {"evictions": 0, "entries": entries, "bytes": size}
        return {"evictions": None, "entries": None, "bytes": None}
