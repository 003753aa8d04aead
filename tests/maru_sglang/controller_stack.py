"""The two SGLang processes of test_sglang_controller.py (run as `python -m tests.maru_sglang.controller_stack`).

The stack itself, and what it patches, is sglang_stack.py.
"""

from __future__ import annotations

import json
import os
import sys

from .sglang_stack import Stack, tokens_of


def writer(pool: str, models: str, v1: bool) -> dict:
    """Instance A: a parent prompt of 8 pages, then a child node of 4 more chained to it, backed up through
    the controller; reports every page's digest and what SGLang's metrics collector saw."""
    st = Stack(pool, models, v1=v1)
    parent, child = tokens_of(1000, 8), tokens_of(5000, 4)
    idx = st.alloc(len(parent) + len(child))
    st.fill(idx, seed=1)
    p_idx, c_idx = idx[:len(parent)], idx[len(parent):]
    p_hashes, p_done = st.backup(p_idx, parent)
    c_hashes, c_done = st.backup(c_idx, child, last_hash=p_hashes[-1])
    out = {"parent_done": p_done, "child_done": c_done, "parent_digests": st.page_digests(p_idx),
           "child_digests": st.page_digests(c_idx), "metrics": st.metrics(),
           "page_bytes": st.backend.page_bytes, "uses_pieces": st.backend.uses_pieces,
           "controller": type(st.ctrl).__name__, "backend": type(st.backend).__name__}
    st.close()
    return out


def reader(pool: str, models: str, v1: bool) -> dict:
    """Instance B: prefetches what A stored (the parent, the chain through the child), a longer prompt, a
    prompt nobody wrote; reads its metrics; clears the namespace and asks again."""
    st = Stack(pool, models, v1=v1)
    parent, child = tokens_of(1000, 8), tokens_of(5000, 4)
    out = {}
    hit, done, idx = st.prefetch("parent", parent)
    out["parent"] = {"hit": hit, "loaded": done, "digests": st.page_digests(idx[:done]) if done else []}
    hit, done, idx = st.prefetch("chain", parent + child)
    out["chain"] = {"hit": hit, "loaded": done, "digests": st.page_digests(idx[:done]) if done else []}
    hit, done, _ = st.prefetch("longer", parent + tokens_of(9000, 4))
    out["longer"] = {"hit": hit, "loaded": done}
    hit, done, _ = st.prefetch("nobody", tokens_of(20000, 6))
    out["miss"] = {"hit": hit, "loaded": done}
    out["metrics"] = st.metrics()
    out["cleared"] = st.ctrl.clear_storage_backend()
    hit, done, _ = st.prefetch("after-clear", parent)
    out["after_clear"] = {"hit": hit, "loaded": done}
    st.close()
    return out


def swa_writer(pool: str, models: str, v1: bool) -> dict:
    """A hybrid sliding-window model (layer 1 SWA): prompt P backed up with its SWA window of 2 pages,
    prompt Q with its KV pages only (as if its window had been evicted before the backup)."""
    st = Stack(pool, models, v1=v1, swa_layers=1)
    p_tokens, q_tokens = tokens_of(1000, 8), tokens_of(7000, 6)
    idx = st.alloc(len(p_tokens) + len(q_tokens))
    st.fill(idx, seed=2)
    _, p_done = st.backup(idx[:len(p_tokens)], p_tokens, swa_pages=2)
    _, q_done = st.backup(idx[len(p_tokens):], q_tokens)
    out = {"p_done": p_done, "q_done": q_done, "pools": st.backend.hybrid.summary(),
           "controller": type(st.ctrl).__name__, "stats": st.backend.hybrid.stats()}
    st.close()
    return out


def swa_reader(pool: str, models: str, v1: bool) -> dict:
    """The hit query of another instance, with the SWA transfer SGLang plans for a prefetch."""
    st = Stack(pool, models, v1=v1, swa_layers=1)
    p_tokens, q_tokens = tokens_of(1000, 8), tokens_of(7000, 6)
    out = {"p": st.hit_query("p", p_tokens, swa_pages=2), "q": st.hit_query("q", q_tokens, swa_pages=2),
           "p_short": st.hit_query("p-short", p_tokens[:6 * 16], swa_pages=2),
           "q_kv_only": st.hit_query("q-kv", q_tokens)}
    st.close()
    return out


def tiny_prompt(pool: str, models: str, v1: bool) -> dict:
    """The tiny Llama at page_size 1 (1 KiB pages) on a 64 MiB pool: one prompt of 8192 pages, an eighth of
    the file, backed up through the controller; then what the pool evicted and what a hit query finds."""
    n = 8192
    st = Stack(pool, models, v1=v1, page_size=1, size="64M", tokens=n)
    tokens = tokens_of(1000, n, page_size=1)
    idx = st.alloc(n)
    st.fill(idx, seed=3)
    hashes, done = st.backup(idx, tokens)
    store = st.backend.store
    out = {"page_bytes": st.backend.page_bytes, "done": done, "evictions": store.stats()["evictions"],
           "stored": st.backend.batch_exists(hashes), "hit": st.hit_query("tiny", tokens)[0],
           "granule": store.geo.granule, "check_ok": store.check().ok}
    st.close()
    return out


ROLES = {"writer": writer, "reader": reader, "swa_writer": swa_writer, "swa_reader": swa_reader,
         "tiny_prompt": tiny_prompt}


def main() -> None:
    role, pool, models, v1 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "v1"
    result = ROLES[role](pool, models, v1)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # SGLang's storage threads are not daemons of ours to join


if __name__ == "__main__":
    main()
