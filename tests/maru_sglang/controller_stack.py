"""The two SGLang processes of test_sglang_controller.py (run as `python -m tests.maru_sglang.controller_stack`).

The stack itself, and what it patches, is tools/sglang_stack.py (the main job uses it too).
"""

from __future__ import annotations

import json
import os
import sys

from tools.sglang_stack import Stack, tokens_of


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


def main() -> None:
    role, pool, models, v1 = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "v1"
    result = (writer if role == "writer" else reader)(pool, models, v1)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # SGLang's storage threads are not daemons of ours to join


if __name__ == "__main__":
    main()
