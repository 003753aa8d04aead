"""P2P sharing without a GPU: two SGLang instances, one maru_shm pool (the README's main job).

Each instance is its own process with SGLang's own HiCache storage stack (tools/sglang_stack.py): the
HybridCacheController that SGLang's assembler builds from a real ServerArgs, with MaruStorage attached by
SGLang's `dynamic` backend factory. Instance 1 backs a prompt's KV pages up through the controller's
backup thread. Instance 2 prefetches the same prompt through the controller's prefetch path (hit query,
io thread, acks) and checks every byte. Instances with another TP rank, model or KV dtype query the same
prompt and must hit none of it. The figures printed are the controller's acks and what MaruStorage
reports to SGLang's StorageMetricsCollector.

    python -m tools.demo [--pool /dev/shm/maru_shm_demo] [--pages 512] [--page-size 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time

def _stack(pool: str, size: str, models: str, pages: int, page_size: int, **kw):
    from .sglang_stack import LLAMA_8B, Stack
    return Stack(pool, models, v1=True, tokens=pages * page_size + page_size, page_size=page_size,
                 geometry=kw.pop("geometry", LLAMA_8B), size=size, **kw)


def _prompt(pages: int, page_size: int) -> list[int]:
    from .sglang_stack import tokens_of
    return tokens_of(1000, pages, page_size)


def _bandwidth(metrics: dict, kind: str) -> float:
    """Mean GB/s over the batches MaruStorage reported to the collector (0 if none)."""
    n = metrics.get(f"{kind}_bandwidth_count", 0)
    return metrics.get(f"{kind}_bandwidth_sum", 0) / n if n else 0.0


def writer(pool, size, models, pages, page_size, q):
    st = _stack(pool, size, models, pages, page_size)
    tokens = _prompt(pages, page_size)
    idx = st.alloc(len(tokens))
    st.fill(idx, seed=1)
    t = time.perf_counter()
    _, done = st.backup(idx, tokens)
    dt = time.perf_counter() - t
    q.put({"stored": done // page_size, "seconds": dt, "page_bytes": st.backend.page_bytes,
           "digests": st.page_digests(idx), "metrics": st.metrics()})
    st.close()


def reader(pool, size, models, pages, page_size, q):
    st = _stack(pool, size, models, pages, page_size)
    tokens = _prompt(pages, page_size)
    t = time.perf_counter()
    hit, loaded, idx = st.prefetch("demo", tokens)
    dt = time.perf_counter() - t
    q.put({"hit": hit // page_size, "loaded": loaded // page_size, "seconds": dt,
           "digests": st.page_digests(idx[:loaded]) if loaded else [], "metrics": st.metrics()})
    st.close()


def stranger(pool, size, models, pages, page_size, label, q):
    from .sglang_stack import LLAMA_8B, Geometry
    kw = {"tp rank 1 of 2": dict(tp=(1, 2)),
          "another model": dict(geometry=Geometry(LLAMA_8B.layers, LLAMA_8B.kv_heads, LLAMA_8B.head_dim,
                                                  "Qwen/Qwen2.5-7B-Instruct")),
          "fp16 KV": dict(dtype="float16")}[label]
    st = _stack(pool, size, models, pages, page_size, **kw)
    hit, _, _ = st.prefetch("stranger", _prompt(pages, page_size))
    q.put({label: hit // page_size})
    st.close()


def _run(target, *args, timeout=600):
    """Run one instance in its own process; its report, or RuntimeError if it died or hung without one."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                return q.get(timeout=1), p.pid
            except queue.Empty:
                if not p.is_alive() and q.empty():
                    raise RuntimeError(f"instance {target.__name__} (pid {p.pid}) died with exit code {p.exitcode}")
        raise RuntimeError(f"instance {target.__name__} (pid {p.pid}) gave no report in {timeout} s")
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="/dev/shm/maru_shm_demo")
    ap.add_argument("--size", default="512M")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the pool file afterwards")
    a = ap.parse_args(argv)
    if os.path.exists(a.pool):
        os.unlink(a.pool)
    models = tempfile.mkdtemp(prefix="maru-demo-models-")
    args = (a.pool, a.size, models, a.pages, a.page_size)
    print(f"pool {a.pool} ({a.size}); Llama-3.1-8B KV geometry, page_size {a.page_size}, {a.pages} pages; "
          "each instance: SGLang's HybridCacheController (build_kv_only_stack) + MaruStorage (dynamic factory)")
    w, wpid = _run(writer, *args)
    mb = w["metrics"]
    print(f"instance 1 (pid {wpid}): backup thread stored {w['stored']}/{a.pages} pages of {w['page_bytes']} B "
          f"in {w['seconds'] * 1e3:.1f} ms; MaruStorage to SGLang's metrics: {int(mb['backup_pgs_sum'])} pages "
          f"in {int(mb['backup_pgs_count'])} batches, {_bandwidth(mb, 'backup'):.2f} GB/s")
    r, rpid = _run(reader, *args)
    mr = r["metrics"]
    same = sum(x == y for x, y in zip(w["digests"], r["digests"]))
    print(f"instance 2 (pid {rpid}): hit query {r['hit']}/{a.pages} pages, io thread loaded {r['loaded']} in "
          f"{r['seconds'] * 1e3:.1f} ms, byte-identical {same}/{r['loaded']}; MaruStorage to SGLang's metrics: "
          f"{int(mr['prefetch_pgs_sum'])} pages in {int(mr['prefetch_pgs_count'])} batches, "
          f"{_bandwidth(mr, 'prefetch'):.2f} GB/s")
    strangers = {}
    for label in ("tp rank 1 of 2", "another model", "fp16 KV"):
        res, _ = _run(stranger, *args, label)
        strangers.update(res)
        print(f"  instance with {label}: hits {res[label]} of those pages")
    from maru_shm import Store, format_size
    with Store.open(a.pool) as s:
        st = s.stats()
        chk = s.check()
    print(f"pool: {st['entries']} entries, {format_size(st['live_bytes'])} live in a {format_size(st['file_bytes'])} "
          f"file ({st['utilization']:.1%}), {st['evictions']} evictions, check {'clean' if chk.ok else chk.problems}")
    if not a.keep:
        os.unlink(a.pool)
    ok = (w["stored"] == a.pages and r["hit"] == r["loaded"] == a.pages and same == a.pages and chk.ok
          and not any(strangers.values()))
    print("P2P sharing: OK" if ok else "P2P sharing: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
