"""SGLang's own benchmark client, `python -m sglang.bench_serving`, run unmodified as a subprocess.

What it needs here, and how it gets it:
- a tokenizer: the served model directory's (tools/wordtokenizer.py builds one for the CPU model);
- `datasets`: imported at start for loaders this benchmark never calls, so a stand-in (benchclient_path/)
  goes on the client's PYTHONPATH, and only there;
- a HOME of its own: the generated-shared-prefix dataset is cached in ~/.cache/sglang/benchmark/ under a
  name that holds the tokenizer's class, not its content, so a cache made with another tokenizer would be
  replayed as is. Each client run gets a fresh HOME inside the caller's work directory;
- no hub: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE are set.
Its result is the JSON line it appends to --output-file (with --output-details and --cache-report): TTFTs,
throughputs, and per request the generated text and SGLang's cached-token details, in the order the
requests were made.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

STAND_IN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchclient_path")
CLIENT = ("-m", "sglang.bench_serving")


def client_env(home: str, env: dict | None = None) -> dict:
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != STAND_IN_PATH]
    env["PYTHONPATH"] = os.pathsep.join([STAND_IN_PATH] + paths)
    env.update(HOME=home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    return env


def gsp_args(groups: int, per_group: int, system_len: int, question_len: int, output_len: int) -> list[str]:
    """bench_serving's generated-shared-prefix dataset: `groups` system prompts, `per_group` questions each."""
    return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups), "--gsp-prompts-per-group",
            str(per_group), "--gsp-system-prompt-len", str(system_len), "--gsp-question-len", str(question_len),
            "--gsp-output-len", str(output_len), "--num-prompts", str(groups * per_group)]


def greedy_body(output_len: int) -> str:
    """--extra-request-body for short greedy outputs. It replaces the client's sampling params as a whole."""
    return json.dumps({"sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}})


def mooncake_args(trace: str, rounds: int, output_len: int, requests: int) -> list[str]:
    """bench_serving's mooncake dataset replaying `trace` (a local file in Mooncake's format) at its
    timestamps, each session's `rounds` rounds as one burst, outputs capped at `output_len` tokens."""
    return ["--dataset-name", "mooncake", "--dataset-path", trace, "--mooncake-workload", "synthetic",
            "--mooncake-num-rounds", str(rounds), "--num-prompts", str(requests),
            "--extra-request-body", greedy_body(output_len)]


@dataclass
class ClientRun:
    result: dict  # bench_serving's JSON line: summary figures and per-request details
    log_path: str
    home: str

    @property
    def texts(self) -> list[str]:
        return self.result.get("generated_texts", [])

    @property
    def failed(self) -> int:
        return sum(1 for e in self.result.get("errors", []) if e)

    def storage_tokens(self) -> int:
        """Tokens the client saw served from L3 (SGLang's cached_tokens_details.storage, summed)."""
        return sum(int((d or {}).get("storage") or 0) for d in self.result.get("cached_tokens_details", []))


@dataclass
class ClientProcess:
    proc: subprocess.Popen
    out: str
    log: str
    home: str

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float = 3600) -> ClientRun:
        """Wait for the client and read its result line."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"bench_serving did not finish in {timeout:.0f} s; its log: {self.log}") from None
        lines = open(self.out).read().splitlines() if os.path.exists(self.out) else []
        if self.proc.returncode != 0 or not lines:
            with open(self.log, errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"bench_serving exited with {self.proc.returncode}; its log ({self.log}) ends:\n{tail}")
        return ClientRun(json.loads(lines[-1]), self.log, self.home)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start(base_url: str, model_dir: str, workload: list[str], work_dir: str, *, tag: str, seed: int = 1,
          rate: float | None = None, concurrency: int | None = None) -> ClientProcess:
    """Start the client in its own process group; `finish()` waits and reads what it wrote."""
    home = os.path.join(work_dir, f"home-{tag}")
    os.makedirs(home, exist_ok=True)
    out = os.path.join(work_dir, f"client-{tag}.jsonl")
    log = os.path.join(work_dir, f"client-{tag}.log")
    argv = [sys.executable, *CLIENT, "--backend", "sglang", "--base-url", base_url, "--model", model_dir,
            "--tokenizer", model_dir, *workload, "--seed", str(seed), "--cache-report", "--output-file", out,
            "--output-details", "--disable-tqdm", "--ready-check-timeout-sec", "120"]
    if rate is not None:
        argv += ["--request-rate", str(rate)]
    if concurrency is not None:
        argv += ["--max-concurrency", str(concurrency)]
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=client_env(home), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return ClientProcess(proc, out, log, home)


def run(base_url: str, model_dir: str, workload: list[str], work_dir: str, *, tag: str, timeout: float = 3600,
        **kw) -> ClientRun:
    client = start(base_url, model_dir, workload, work_dir, tag=tag, **kw)
    try:
        return client.finish(timeout)
    finally:
        client.kill()


class _Row:
    """What a pickled DatasetRow becomes here: its fields, without importing SGLang's dataset package (which
    imports `datasets`)."""

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else state[1] or {})


class _RowUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name == "DatasetRow":
            return _Row
        return super().find_class(module, name)


def gsp_prompts(run: ClientRun) -> list[str]:
    """The generated-shared-prefix prompts of a run, in the client's order: its own cache of the dataset."""
    paths = glob.glob(os.path.join(run.home, ".cache", "sglang", "benchmark", "gen_shared_prefix_*.pkl"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one generated-shared-prefix cache in {run.home}, found {paths}")
    with open(paths[0], "rb") as f:
        return [row.prompt for row in _RowUnpickler(f).load()]


_MOONCAKE_PROMPTS = """
import asyncio, json, sys
from transformers import AutoTokenizer
from sglang.benchmark.datasets.mooncake import get_mooncake_request_over_time
trace, rounds, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(line) for line in open(trace) if line.strip()]
tok = AutoTokenizer.from_pretrained(model)
async def main():
    return [row.prompt async for row in get_mooncake_request_over_time(rows, tok, 0.0, rounds)]
print(json.dumps(asyncio.run(main())))
"""


def mooncake_prompts(trace: str, rounds: int, model_dir: str, home: str) -> list[str]:
    """The prompts bench_serving's mooncake dataset sends for `trace`, in its order: built by SGLang's own
    generator, in a subprocess with the client's environment, timestamps ignored."""
    os.makedirs(home, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", _MOONCAKE_PROMPTS, trace, str(rounds), model_dir], env=client_env(home),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"building the mooncake prompts failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group("name") != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels") or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group("value"))
    return total


def label_values(text: str, name: str, label: str) -> list[str]:
    """The values `label` takes in the samples of `name`."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group("name") == name:
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels") or ""))
            if label in have:
                out.append(have[label])
    return out
