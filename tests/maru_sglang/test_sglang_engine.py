"""SGLang's real serving loop with MaruStorage as its L3: two `sglang.launch_server` processes, one pool.

Everything SGLang does for a request runs: the HTTP server, the scheduler, the radix tree's match and
its L3 prefetch, write-through after prefill, the model forward over the loaded KV, the detokenizer.
The model is a small Llama with dummy weights (tools/serving.py); tools/sglang_cpu.py supplies what
SGLang's CPU path lacks. Time to first token is the demo's and the benchmark's to report: on a shared
machine it is not asserted here.

A second model shape, hybrid or MLA, is not run here: on a CPU without AMX SGLang 0.5.23 has no path
for either.
- MLA: the CPU falls back to `torch_native` attention, which has no MLA branch. Served as above, a
  DeepSeek-V2-shaped model (kv_lora_rank 128, rope 32, nope 64) fails its first prefill in
  `TorchNativeAttnBackend._run_sdpa_forward_extend` (layers/attention/torch_native_backend.py) with
  "Expected size for first two dimensions of batch2 tensor to be: [8, 96] but got: [8, 160]": it reads
  the MLA pool's latent buffer as K.
- Hybrid linear attention (Qwen3-Next, Mamba): `layers/attention/linear/gdn_backend.py` binds, under
  `is_cpu()`, `sgl_kernel.mamba.causal_conv1d_fn_cpu` and `torch.ops.sgl_kernel.fused_gdn_gating_cpu`,
  kernels of the CUDA-only wheel with no torch fallback.
- Sliding-window hybrids (SGLang's hybrid SWA pool: Gemma4, Llama4, MiMo-V2, ...) were not tried.
The hybrid and MLA host pools go through SGLang's own controller in test_sglang_v2.py and
test_sglang_controller.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: this test runs SGLang 0.5.23's serving engine")

import hicache_helpers as hh  # noqa: E402
from maru_shm import remove_pool  # noqa: E402
from tools.demo import four_prompts, report  # noqa: E402
from tools.serving import Model, ServerSpec  # noqa: E402

SMALL = Model(name="maru-test-llama", layers=4, hidden=256, heads=4, kv_heads=4)


def test_a_second_server_answers_from_the_pool_with_the_same_tokens(tmp_path, capsys):
    """Server 2 loads every full page of server 1's prompt from the pool (SGLang's own count), and the
    tokens it answers with equal server 1's and those of the same prompt recomputed after the pool is
    cleared. The pool checks clean after both servers stop (their slots are the next opener's to reap)."""
    pool = hh.shm_path("engine")
    spec = ServerSpec(model_path=SMALL.write(str(tmp_path)), pool=pool, pool_size="256M", max_tokens=4096)
    try:
        run = four_prompts(spec, tokens=512, new_tokens=8, log_dir=str(tmp_path))
    finally:
        remove_pool(pool)
    r = run.replies
    report(run, SMALL.describe(), 512)
    print(capsys.readouterr().out)
    assert run.full_pages == 31  # 512 tokens, page 16: SGLang always computes the last token itself
    assert r["a"].pages_from_l3(16) == 0 and r["c"].pages_from_l3(16) == 0
    assert run.b_pages == 31, r["b"].cached
    assert r["b"].cached.get("device", 0) == 0 and r["b"].cached.get("host", 0) == 0
    assert r["d"].pages_from_l3(16) == 0, r["d"].cached  # the clear reached MaruStorage
    assert len(r["a"].tokens) == 8
    assert r["a"].tokens == r["b"].tokens == r["d"].tokens
    assert run.stats["evictions"] == 0
    assert run.check.ok, run.check.problems
