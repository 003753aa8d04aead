"""e2e: time to first token through SGLang's real serving loop, against prompt length, in one run.

Two `sglang.launch_server` processes per L3 backend (tools/serving.py): server 1 serves a prompt and
writes it through; server 2, its device and host caches flushed, serves the same prompt (an L3 hit)
and a cold prompt of the same length (recompute). Backends, measured in turn on the same machine:
MaruStorage on one pool file, and SGLang's own HiCacheFile on /dev/shm. Each figure is the median over
--repeat prompts; TTFT is measured at the client, from sending the request to its first streamed token.

On a CPU the model is the demo's dummy-weight Llama; `--e2e-model DIR --e2e-device cuda` serves a real
one. SGLang's CPU attention (`TorchNativeAttnBackend._run_sdpa_forward_extend`) computes an extend's
attention over the whole sequence, prefix included, so on a CPU an L3 hit saves the prefix's linear
layers but not its attention: the CPU ratio understates what a hit saves on a GPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from maru_shm import remove_pool

from .registry import figure, median_spread, pool_path, progress_of, scenario

NAME = "e2e"
SEEDS = 1000  # prompt seeds: one per (length, repeat), never the same prompt twice in a run


def ttft_by_length(spec, lengths: list[int], repeat: int, log_dir: str, progress, frac0: float, frac1: float) -> dict:
    """{length: {"hit": [s], "recompute": [s], "pages": [n]}} for one L3 backend."""
    from ..serving import Server, prompt, stored_pages, wait_until_stored, warm_up
    out = {n: {"hit": [], "recompute": [], "pages": []} for n in lengths}
    steps, done = len(lengths) * repeat, 0
    with Server(spec, "writer", log_dir) as one, Server(spec, "reader", log_dir) as two:
        warm_up(one, two, spec)
        for n in lengths:
            for i in range(repeat):
                progress(frac0 + (frac1 - frac0) * done / steps, f"{'maru' if spec.pool else 'file'} {n} tokens")
                seed = SEEDS + n * 10 + i
                shared, cold = prompt(seed, n), prompt(seed + SEEDS, n)
                before = stored_pages(spec)
                one.generate(shared, 1)
                wait_until_stored(spec, before + (n - 1) // spec.page_size)
                hit = two.generate(shared, 1)
                out[n]["hit"].append(hit.ttft)
                out[n]["pages"].append(hit.pages_from_l3(spec.page_size))
                out[n]["recompute"].append(two.generate(cold, 1).ttft)
                two.flush_device_and_host()
                done += 1
    return out


@scenario(NAME)
def bench_e2e(args) -> dict:
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        return {"scenario": NAME, "skipped": "sglang is not installed", "figures": []}
    from ..serving import DEMO_MODEL, ServerSpec
    lengths = getattr(args, "e2e_lengths", None) or [512, 2048, 8192]
    repeat = max(1, min(args.repeat, 3))
    progress = progress_of(args)
    work = tempfile.mkdtemp(prefix="maru-bench-e2e-")
    model = getattr(args, "e2e_model", None)
    device = getattr(args, "e2e_device", None) or "cpu"
    common = dict(model_path=model or DEMO_MODEL.write(work), device=device, dummy_weights=model is None or getattr(args, "e2e_dummy_weights", False),
                  max_tokens=max(20000, 2 * max(lengths) + 64))
    pool = pool_path("e2e")
    file_dir = os.path.join("/dev/shm", f"maru-bench-e2e-file-{os.getpid()}")
    try:
        maru = ttft_by_length(ServerSpec(pool=pool, pool_size="2G", **common), lengths, repeat, work, progress,
                              0.0, 0.5)
        os.makedirs(file_dir, exist_ok=True)
        hfile = ttft_by_length(ServerSpec(pool=None, file_dir=file_dir, **common), lengths, repeat, work, progress,
                               0.5, 1.0)
    finally:
        remove_pool(pool)
        shutil.rmtree(file_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    what = f"{model} on {device}" if model else DEMO_MODEL.describe()
    figs, rows = [], {}
    for n in lengths:
        rec, *rec_s = median_spread(maru[n]["recompute"])
        hit, *hit_s = median_spread(maru[n]["hit"])
        fhit, *fhit_s = median_spread(hfile[n]["hit"])
        full = (n - 1) // 16
        rows[n] = {"recompute_s": rec, "maru_hit_s": hit, "file_hit_s": fhit,
                   "maru_pages": maru[n]["pages"], "file_pages": hfile[n]["pages"], "full_pages": full}
        figs.append(figure(f"TTFT {n}-token prompt: recompute / L3 hit from MaruStorage (x faster)", rec / hit, 1.0,
                           "recompute", unit="x", goal="> 1", met=rec > hit, recompute_s=rec, recompute_spread=rec_s,
                           hit_s=hit, hit_spread=hit_s, pages=maru[n]["pages"], full_pages=full))
        figs.append(figure(f"TTFT {n}-token prompt, L3 hit: MaruStorage vs HiCacheFile on /dev/shm", hit, fhit,
                           "HiCacheFile", unit="s", better="lower", spread=hit_s, peer_spread=fhit_s,
                           pages=maru[n]["pages"], peer_pages=hfile[n]["pages"]))
    return {"scenario": NAME, "model": what, "lengths": rows, "figures": figs}
