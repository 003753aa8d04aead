"""Node processes of the second-tier tests, on the loopback Mooncake Store of tools/mooncake_local.py."""

from __future__ import annotations

import os
import time

from tools.mooncake_local import MooncakeCluster, unavailable

__all__ = ["MooncakeCluster", "unavailable", "tiered", "wait_attached", "node_reader"]  # the first two re-exported


def tiered(pool: str, settings: dict, *, pages: int, retry_s: float = 0.2, **kw):
    """(host pool, MaruStorage) of one SGLang rank on `pool` with the second tier configured."""
    import hicache_helpers as hh

    return hh.make_instance(pool, pages=pages, maru={"maru_tier2": settings, "maru_tier2_retry_s": retry_s}, **kw)


def wait_attached(backend, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not backend.tier2.attached:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def node_reader(pool: str, settings: dict, keys: list, expect_tier: bool, q) -> None:
    """One SGLang process of a node: how many pages it finds, where, and their bytes; reported through q."""
    import traceback

    import hicache_helpers as hh

    out: dict = {"pid": os.getpid()}
    backend = None
    try:
        n = len(keys)
        t0 = time.monotonic()
        host, backend = tiered(pool, settings, pages=n + 8)
        out["startup_s"] = time.monotonic() - t0
        if expect_tier:
            out["attached"] = wait_attached(backend)
        out["local_before"] = backend.local_exists(keys)
        out["exists"] = backend.batch_exists(keys)
        dst = hh.page_indices(host, 8, n)  # other host slots than the writer used
        out["loaded"] = backend.batch_get_v1(keys, dst)
        out["digests"] = hh.digests(hh.page_bytes(host, dst))
        out["local_after"] = backend.local_exists(keys)
        out["tier2"] = backend.get_stats().maru["tier2"]
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        if backend is not None:
            backend.close()
        q.put(out)
