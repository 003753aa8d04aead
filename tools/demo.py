"""The main job: two real SGLang servers share one maru_shm pool, and the second answers the first's prompt.

Two `python -m sglang.launch_server` processes (tools/serving.py) with HiCache on and MaruStorage as their
L3, on one pool file in /dev/shm that whichever starts first creates. Four requests, greedy decoding:

  a. server 1 serves a long prompt A;
  b. server 2, its device and host caches cold, serves A: the prefix must come from the pool;
  c. server 2 serves a cold prompt C of the same length: the recompute time;
  d. server 2 serves A again after SGLang's /flush_cache and /hicache/storage-backend/clear: the same
     prompt computed from nothing, the baseline for the tokens.

Pages from L3 are SGLang's own count (cached_tokens_details.storage of each reply). It prints OK when b
loaded every full page of A before its last token, a, b and d gave the same tokens, TTFT(b) < TTFT(c)
and `check` finds the pool clean after both servers stop.

    python -m tools.demo [--tokens 2000] [--pool /dev/shm/maru_shm_demo] [--model DIR --device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass

from maru_shm import remove_pool

from .serving import DEMO_MODEL, Reply, Server, ServerSpec, prompt, stored_pages, wait_until_stored, warm_up


@dataclass
class FourPrompts:
    """What the four requests gave, and the pool's state after both servers stopped."""

    replies: dict  # "a".."d" -> Reply
    full_pages: int  # pages of A that SGLang may take from L3: the last token is always computed
    page_size: int
    check: object  # maru_shm CheckReport
    stats: dict

    @property
    def b_pages(self) -> int:
        return self.replies["b"].pages_from_l3(self.page_size)

    @property
    def same_tokens(self) -> bool:
        r = self.replies
        return r["a"].tokens == r["b"].tokens == r["d"].tokens

    @property
    def ok_without_timing(self) -> bool:
        r = self.replies
        return (self.b_pages == self.full_pages and r["d"].pages_from_l3(self.page_size) == 0
                and self.same_tokens and self.check.ok)

    @property
    def ok(self) -> bool:
        return self.ok_without_timing and self.replies["b"].ttft < self.replies["c"].ttft


def four_prompts(spec: ServerSpec, tokens: int, new_tokens: int = 16, log_dir: str | None = None,
                 say=lambda msg: None) -> FourPrompts:
    """Run a-d on two servers of `spec` (spec.pool is the shared pool) and check the pool afterwards."""
    from maru_shm import check_pool, Store
    A, C = prompt(1, tokens), prompt(2, tokens)
    full_pages = (tokens - 1) // spec.page_size
    replies: dict[str, Reply] = {}
    say("starting two SGLang servers on the pool, and one short prompt through each to warm them up ...")
    with Server(spec, "instance-1", log_dir) as one, Server(spec, "instance-2", log_dir) as two:
        warm_up(one, two, spec)
        before = stored_pages(spec)
        replies["a"] = one.generate(A, new_tokens)
        stored = wait_until_stored(spec, before + full_pages) - before
        say(f"a: instance 1 served A; write-through put {stored} pages into the pool")
        replies["b"] = two.generate(A, new_tokens)
        replies["c"] = two.generate(C, new_tokens)
        two.flush_device_and_host()
        two.clear_l3()
        replies["d"] = two.generate(A, new_tokens)
    with Store.open(spec.pool) as store:  # attaching reaps the servers' slots, as any next opener does
        stats = store.stats()
    return FourPrompts(replies, full_pages, spec.page_size, check_pool(spec.pool), stats)


def _tokens(reply: Reply, ref: Reply | None) -> str:
    """The first output tokens; for a request of prompt A other than a itself, whether they equal a's."""
    head = f"{' '.join(map(str, reply.tokens[:6]))} … ({len(reply.tokens)})"
    if ref is None or reply is ref:
        return head
    return head + ("  = a" if reply.tokens == ref.tokens else "  differs from a")


def report(run: FourPrompts, model_line: str, tokens: int) -> None:
    r = run.replies
    rows = [("a", "1", "A", "recompute"), ("b", "2", "A", "from the pool"), ("c", "2", "C", "recompute (cold)"),
            ("d", "2", "A", "recompute (pool cleared)")]
    print("\n| case | server | prompt | TTFT | pages from L3 | output tokens |")
    print("|------|--------|--------|------|---------------|---------------|")
    for case, server, p, what in rows:
        print(f"| {case} {what} | {server} | {p} ({tokens}) | {r[case].ttft * 1e3:,.0f} ms | "
              f"{r[case].pages_from_l3(run.page_size)} | {_tokens(r[case], r['a'] if p == 'A' else None)} |")
    print(f"\n{model_line}")
    print(f"TTFT recompute / from the pool: {r['c'].ttft / r['b'].ttft:.2f}x  "
          f"(b loaded {run.b_pages} of A's {run.full_pages} full pages; the last token is always computed)")
    s = run.stats
    print(f"pool: {s['entries']} entries, {s['utilization']:.1%} of the file used, {s['evictions']} evictions; "
          f"check {'clean' if run.check.ok else run.check.problems}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="/dev/shm/maru_shm_demo", help="the pool file (created fresh)")
    ap.add_argument("--size", default="1G", help="pool size")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--model", help="a model directory to serve instead of the demo's dummy-weight Llama")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda with a GPU")
    ap.add_argument("--dummy-weights", action="store_true",
                    help="serve --model's geometry with random weights (a config.json is enough)")
    ap.add_argument("--keep", action="store_true", help="keep the pool file and the server logs")
    a = ap.parse_args(argv)
    remove_pool(a.pool)
    work = tempfile.mkdtemp(prefix="maru-demo-")
    model_path = a.model or DEMO_MODEL.write(work)
    model_line = (f"model: {a.model} on {a.device}" if a.model else f"model: {DEMO_MODEL.describe()}")
    spec = ServerSpec(model_path=model_path, pool=a.pool, pool_size=a.size, device=a.device,
                      dummy_weights=a.model is None or a.dummy_weights, max_tokens=max(20000, 3 * a.tokens))
    print(f"pool {a.pool} ({a.size}), page size {spec.page_size} tokens; {model_line}; server logs in {work}")
    try:
        run = four_prompts(spec, a.tokens, a.new_tokens, log_dir=work, say=print)
    finally:
        if not a.keep:
            remove_pool(a.pool)
    report(run, model_line, a.tokens)
    r = run.replies
    why = [m for bad, m in [
        (run.b_pages != run.full_pages, f"b loaded {run.b_pages} pages from the pool, not {run.full_pages}"),
        (r["d"].pages_from_l3(run.page_size) != 0, "d still found pages in the cleared pool"),
        (not run.same_tokens, "a, b and d did not give the same tokens"),
        (r["b"].ttft >= r["c"].ttft, "TTFT(b) was not below TTFT(c)"),
        (not run.check.ok, "check found problems in the pool")] if bad]
    print("OK" if not why else "FAIL: " + "; ".join(why))
    return 0 if not why else 1


if __name__ == "__main__":
    sys.exit(main())
