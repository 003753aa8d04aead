"""Two SGLang servers on one pool under SGLang's own benchmark client, the short form of
`maru-shm bench --only serving`: the second scheduler's prefixes come from the pool.

Two `launch_server` processes of a small Llama (one scheduler and one OpenMP thread each) with MaruStorage
on one pool file, behind the round-robin forwarder of tools/roundrobin.py; `python -m sglang.bench_serving`,
unmodified, sends 10 generated-shared-prefix requests (2 groups of 5) through it with the same code the
benchmark uses (tools/loadrun.py). The client's own warm-up request is its first prompt, computed by the
first server; round robin hands the first measured request, the same prompt, to the second server.
Asserted: every request completed; the second server counted tokens from L3 in SGLang's own counter, and
the client saw the same total in the replies; a greedy subset answered with its prefixes from L3 gives
the tokens recomputed with the pool emptied; after both servers stop, an attach (which reaps their
slots, as any next opener does) and `check` find the pool clean. Nothing about time is asserted.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: this test runs SGLang 0.5.23's serving engine and client")

from maru_shm import Store, check_pool  # noqa: E402
from tools import benchclient, wordtokenizer  # noqa: E402
from tools.deployment import Deployment  # noqa: E402
from tools.l3backends import L3  # noqa: E402
from tools.loadrun import Workload, greedy_check, run_load, subset  # noqa: E402
from tools.serving import Model, ServerSpec  # noqa: E402

SMALL = Model(name="maru-load-llama", layers=4, hidden=256, heads=4, kv_heads=4)


def test_the_second_scheduler_loads_prefixes_from_the_pool_under_bench_serving(tmp_path):
    model = SMALL.write(str(tmp_path))
    wordtokenizer.write(model, SMALL.vocab)
    load = Workload("gsp", benchclient.gsp_args(2, 5, 256, 16, 2), output_len=2, seed=1, concurrency=2)
    with L3("maru", 64 << 20, str(tmp_path), "load") as l3:
        spec = ServerSpec(model_path=model, text=True, metrics=True, max_tokens=4096, **l3.spec_fields())
        with Deployment("pair", "1", spec, str(tmp_path), "load") as dep:
            fig, run = run_load(dep, l3, load, model, str(tmp_path), "load")
            check = greedy_check(dep, l3, subset(benchclient.gsp_prompts(run), 2), load.output_len)
        with Store.open(l3.pool) as store:
            stats = store.stats()
        report = check_pool(l3.pool)
    print(fig, check, stats)
    assert fig["completed"] == 10 and fig["failed"] == 0
    assert fig["storage_tokens_by_server"][1] > 0, fig  # the second server's prefixes came from the pool
    assert fig["storage_tokens"] == fig["client_storage_tokens"], fig
    assert check["prompts"] == 2 and all(s > 0 for s in check["l3_storage"]), check
    assert all(check["same"]), check
    assert all(s == 0 for s in check["recompute_storage"]), check  # the emptied pool served nothing
    assert report.ok, report.problems
    assert stats["evictions"] == 0 and stats["processes"] == 1  # the stopped servers' slots were reaped
