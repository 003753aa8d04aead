"""SGLang servers (`python -m sglang.launch_server`) on one pool: the demo, the end-to-end test and bench.

Each `Server` is SGLang's real HTTP server in its own process group: scheduler(s), radix cache, HiCache
(write-through, L3 prefetch with `wait_complete`), model forward, detokenizer. Its L3 is MaruStorage
(`--hicache-storage-backend dynamic`) or, for comparison, SGLang's own HiCacheFile (`file`), SGLang's
MooncakeStore (`mooncake`), or none (HiCache's host pool, L2, only). With `dp_size` > 1 it is SGLang's
data-parallel controller, one scheduler per rank, each with its own HiCache and L3 backend instance.

Without a GPU the model is a `Model`: a directory holding a Llama `config.json`, served with dummy
weights. Without a tokenizer requests carry input ids; with `text` the directory also holds the offline
tokenizer of tools/wordtokenizer.py, which SGLang's benchmark client needs. tools/sglang_cpu.py supplies
what SGLang's CPU path lacks. With a GPU, `--model` names a real model directory and `--device cuda` serves it as it is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from .procgroup import group_pids


@dataclass(frozen=True)
class Model:
    """A Llama geometry with dummy weights; its KV per token is 2 x layers x kv_heads x head_dim x dtype bytes."""

    name: str = "maru-demo-llama"
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    vocab: int = 4096
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)

    def describe(self) -> str:
        return (f"Llama {self.layers} layers, hidden {self.hidden}, {self.heads} heads ({self.kv_heads} KV), "
                f"{self.dtype}, dummy weights: {self.kv_bytes_per_token // 1024} KiB of KV per token")

    def write(self, root: str) -> str:
        path = os.path.join(root, self.name)
        os.makedirs(path, exist_ok=True)
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                  "intermediate_size": self.hidden * 11 // 4, "num_attention_heads": self.heads,
                  "num_key_value_heads": self.kv_heads, "num_hidden_layers": self.layers, "head_dim": self.head_dim,
                  "vocab_size": self.vocab, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                  "rope_theta": 10000.0, "torch_dtype": self.dtype, "tie_word_embeddings": False,
                  "bos_token_id": 1, "eos_token_id": 2}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        return path


DEMO_MODEL = Model()


def maru_extra_config(pool: str, size: str) -> dict:
    """MaruStorage's extra config as the README gives it."""
    return {"backend_name": "maru", "module_path": "maru_sglang.maru_storage", "class_name": "MaruStorage",
            "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "maru_path": pool, "maru_pool_size": size}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    """One greedy generation: its tokens, time to first token, and what SGLang says it reused."""

    tokens: list[int]
    ttft: float
    cached: dict = field(default_factory=dict)  # SGLang's cached_tokens_details: device / host / storage

    def pages_from_l3(self, page_size: int) -> int:
        return int(self.cached.get("storage", 0)) // page_size


L3_BACKENDS = ("none", "file", "mooncake", "maru")


@dataclass
class ServerSpec:
    model_path: str
    pool: str | None = None  # MaruStorage's pool file
    pool_size: str = "1G"
    file_dir: str | None = None  # HiCacheFile's directory
    device: str = "cpu"
    page_size: int = 16
    max_tokens: int = 20000  # the device KV pool
    dummy_weights: bool = True
    extra_args: tuple = ()
    l3: str | None = None  # one of L3_BACKENDS; None: "maru" with a pool, else "file"
    l3_config: dict | None = None  # "mooncake": SGLang's MooncakeStore extra config (master address, ...)
    maru_keys: dict = field(default_factory=dict)  # "maru": maru_* keys added to the README's extra config
    text: bool = False  # the model directory has a tokenizer: requests may carry text
    dp_size: int = 1  # > 1: SGLang's data-parallel controller, round robin over the ranks
    env_overrides: dict = field(default_factory=dict)  # name -> value, or None to remove it
    metrics: bool = False  # --enable-metrics: /metrics in Prometheus text

    @property
    def backend(self) -> str:
        return self.l3 or ("maru" if self.pool is not None else "file")

    def _l3_argv(self) -> list[str]:
        backend = self.backend
        if backend == "maru":
            return ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                    json.dumps({**maru_extra_config(self.pool, self.pool_size), **self.maru_keys})]
        if backend == "mooncake":
            return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                    json.dumps(self.l3_config or {})]
        if backend == "file":
            return ["--hicache-storage-backend", "file"]
        if backend == "none":
            return []
        raise ValueError(f"unknown L3 backend {backend!r}; one of {', '.join(L3_BACKENDS)}")

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", "127.0.0.1",
                "--port", str(port), "--device", self.device, "--page-size", str(self.page_size),
                "--max-total-tokens", str(self.max_tokens), "--random-seed", "1", "--skip-server-warmup",
                "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_through",
                "--hicache-mem-layout", "page_first_direct", "--hicache-storage-prefetch-policy", "wait_complete",
                *self._l3_argv(), "--log-level", "warning"]
        if not self.text:
            argv.append("--skip-tokenizer-init")  # requests carry token ids
        if self.dummy_weights:
            argv += ["--load-format", "dummy"]
        if self.device == "cpu":
            # No overlap scheduling on a CPU: a forward there is synchronous, so overlap only defers each batch's
            # result processing, and with it the write-through that feeds L3, until the next batch has run. When
            # that batch is a prefill, a prefix reaches the other schedulers seconds late, and the sooner the L3
            # answers a new request's lookup, the likelier that is (#49, BENCHMARKS.md "At load").
            argv += ["--hicache-io-backend", "direct", "--sleep-on-idle", "--disable-overlap-schedule"]
        if self.dp_size > 1:
            argv += ["--dp-size", str(self.dp_size), "--load-balance-method", "round_robin"]
        if self.metrics:
            argv.append("--enable-metrics")
        return argv + list(self.extra_args)

    def env(self) -> dict:
        env = dict(os.environ)
        if self.device == "cpu":
            from .sglang_cpu import engine_env
            env = engine_env(env)
            if self.dp_size > 1:  # SGLang's CPU path asserts one core set per rank
                env["SGLANG_CPU_OMP_THREADS_BIND"] = cores_per_rank(self.dp_size)
        if self.file_dir is not None:
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.file_dir
        for name, value in self.env_overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = str(value)
        return env


def cores_per_rank(ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks: this process's cores cut into contiguous sets, "0|1"
    on two cores. With fewer cores than ranks, ranks share them round robin."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return "|".join(str(cores[i % len(cores)]) for i in range(ranks))
    size = len(cores) // ranks
    sets = [cores[i * size:(i + 1) * size] for i in range(ranks)]
    return "|".join(f"{s[0]}-{s[-1]}" if len(s) > 1 and s[-1] - s[0] == len(s) - 1 else ",".join(map(str, s))
                    for s in sets)


class Server:
    """One SGLang server process (its own process group) and a small client for it."""

    def __init__(self, spec: ServerSpec, name: str, log_dir: str | None = None, start_timeout: float = 300,
                 wait: bool = True):
        """Start the server; with `wait` (the default) return once it answers /health, else call wait_ready."""
        self.spec, self.name = spec, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"sglang-{name}-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(spec.argv(self.port), env=spec.env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.shm_files: set[str] = set()
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = 300) -> None:
        """Until the server answers /health; stopped, and the failure raised, if it exits or times out first."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.shm_files |= sglang_shm_files(self.proc.pid)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.shm_files |= sglang_shm_files(self.proc.pid)  # also those of a start that fails
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode} while starting; "
                                   f"its log, {self.log_path}, ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server {self.name} not ready in {timeout:.0f} s; its log ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def _post(self, path: str, body: dict | None = None, timeout: float = 600):
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"server {self.name}: POST {path}: {e.code} {e.reason}: "
                               f"{e.read().decode(errors='replace')[:1000]}") from None

    def get(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def generate(self, input_ids: list[int] | str, max_new_tokens: int = 16, timeout: float = 600) -> Reply:
        """Greedy decoding, streamed: TTFT is the time from sending the request to its first token.
        A str prompt is sent as text, for the server's tokenizer (a `text` spec)."""
        body = {"text" if isinstance(input_ids, str) else "input_ids": input_ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
        t0 = time.perf_counter()
        ttft, last = None, None
        with self._post("/generate", body, timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None and chunk.get("output_ids"):
                    ttft = time.perf_counter() - t0
                last = chunk
        if last is None or ttft is None:
            raise RuntimeError(f"server {self.name} streamed no tokens; its log ends:\n{self.log_tail()}")
        meta = last.get("meta_info", {})
        return Reply(tokens=list(last["output_ids"]), ttft=ttft, cached=dict(meta.get("cached_tokens_details") or {}))

    def flush_device_and_host(self, timeout: float = 60) -> None:
        """SGLang's /flush_cache: the radix tree, the device KV and the host (L2) pool; the L3 stays.

        SGLang refuses a flush (400) while a request or a write-through is still in flight: retry."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self._post("/flush_cache") as r:
                    r.read()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def clear_l3(self) -> None:
        """SGLang's /hicache/storage-backend/clear: the storage backend's clear()."""
        with self._post("/hicache/storage-backend/clear") as r:
            r.read()

    def kill(self) -> None:
        """SIGKILL to every process of the server at once: a crash, not a shutdown."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the server's process group (SGLang's own shutdown), SIGKILL if it lingers; then the
        load-snapshot files SGLang leaves in /dev/shm are removed."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any child SGLang left behind
        except (ProcessLookupError, PermissionError):
            pass
        for path in self.shm_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def sglang_shm_files(pgid: int) -> set[str]:
    """The /dev/shm/sglang_loads_* files that processes of group `pgid` hold open: SGLang's load snapshots,
    which it never removes. Only a server's own files are named, not those of other servers on the host."""
    found = set()
    for pid in group_pids(pgid):
        try:
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                target = os.readlink(os.path.join(fd_dir, fd))
                if target.startswith("/dev/shm/sglang_loads_"):
                    found.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def prompt(seed: int | str, length: int, vocab: int = DEMO_MODEL.vocab) -> list[int]:
    """A reproducible prompt of `length` token ids (ids 0-2 are left out: they may be special).

    Distinct seeds give unrelated prompts; an int seed is used by its absolute value (random.seed's rule),
    so -1 and 1 give the same prompt."""
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _count(spec: ServerSpec, store) -> int:
    if spec.pool is None:
        try:
            return len(os.listdir(spec.file_dir))
        except FileNotFoundError:
            return 0
    return store.stats()["entries"]


def _l3_of(spec: ServerSpec):
    """The pool, attached (one process slot) for as long as the caller counts; nothing for HiCacheFile."""
    import contextlib
    if spec.pool is None:
        return contextlib.nullcontext()
    from maru_shm import Store
    return Store.open(spec.pool)


def stored_pages(spec: ServerSpec) -> int:
    """Values in the servers' L3: entries of the pool, or page files of HiCacheFile's directory."""
    with _l3_of(spec) as store:
        return _count(spec, store)


def wait_until_stored(spec: ServerSpec, at_least: int, timeout: float = 120) -> int:
    """Wait until L3 holds at least `at_least` values (write-through reaches L3 after the reply)."""
    deadline = time.monotonic() + timeout
    with _l3_of(spec) as store:  # attached once, not once a poll
        while True:
            n = _count(spec, store)
            if n >= at_least or time.monotonic() > deadline:
                return n
            time.sleep(0.1)


def warm_up(writer: Server, reader: Server, spec: ServerSpec) -> None:
    """A short prompt written through by `writer`, then read from L3 by `reader`, whose caches are then
    flushed: a server's first requests pay one-time costs (loading SGLang's page-hash extension, first
    kernel calls) that are not what time to first token measures."""
    w = prompt("warm-up: written", 4 * spec.page_size + 1)
    before = stored_pages(spec)
    writer.generate(w, 1)
    wait_until_stored(spec, before + 4)
    reader.generate(w, 1)
    reader.generate(prompt("warm-up: computed", 4 * spec.page_size + 1), 1)
    reader.flush_device_and_host()
