"""A stand-in for Hugging Face `datasets` on SGLang's benchmark client's path only (tools/benchclient.py).

`sglang.benchmark.serving` imports `datasets` at start for its mmmu and longbench loaders; the datasets the
`serving` benchmark uses (generated-shared-prefix, mooncake from a local file) never call it. Loading a
hub dataset is refused with a clear error instead of a download.
"""

MARU_STAND_IN = True


def load_dataset(*args, **kwargs):
    raise RuntimeError("the `datasets` package here is maru-shm's stand-in for SGLang's benchmark client: "
                       "it loads no hub dataset (use generated-shared-prefix or a local mooncake trace)")
