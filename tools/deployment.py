"""SGLang schedulers on one L3 behind one URL: the deployments `maru-shm bench --only serving` compares.

  dp    one launch_server with SGLang's data-parallel controller (--dp-size 2 --load-balance-method
        round_robin): two schedulers, each with its own HiCache and its own backend instance;
  pair  two launch_server processes of one scheduler each, behind tools/roundrobin.py, which hands
        requests to them in turn as the DP controller does (SGLang's client takes one --base-url, and two
        clients would split the load's shared prefixes between them); a server can be killed and restarted;
  one   one launch_server, one scheduler: the reference.
Threads: "1" gives every SGLang process one OpenMP thread (OMP_NUM_THREADS=1), one per core with two
schedulers on two cores: the sane deployment. "default" leaves torch its default, a thread per core in
every scheduler: with two schedulers the cores are oversubscribed, as on any busy serving host. (On a CPU
without AMX SGLang applies no thread binding, whatever SGLANG_CPU_OMP_THREADS_BIND says.)
"""

from __future__ import annotations

import dataclasses

from .roundrobin import RoundRobin
from .serving import Server, ServerSpec

TOPOLOGIES = {"dp": 2, "pair": 2, "one": 1}  # name -> schedulers
THREADS = {"1": {"OMP_NUM_THREADS": "1"}, "default": {"OMP_NUM_THREADS": None}}


def spec_for(base: ServerSpec, topology: str, threads: str) -> ServerSpec:
    """`base` as one server of `topology` with `threads`."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; one of {', '.join(TOPOLOGIES)}")
    if threads not in THREADS:
        raise ValueError(f"unknown thread setting {threads!r}; one of {', '.join(THREADS)}")
    extra = tuple(base.extra_args)
    if topology == "pair" and base.device != "cpu" and "--mem-fraction-static" not in extra:
        extra += ("--mem-fraction-static", "0.4")  # two servers share one accelerator's memory
    return dataclasses.replace(base, dp_size=2 if topology == "dp" else 1, extra_args=extra,
                               env_overrides={**base.env_overrides, **THREADS[threads]})


HOST_MEMORY_REFUSAL = "Not enough host memory available"  # SGLang keeps 10 GiB of MemAvailable for the host
HOST_MEMORY_TRIES, HOST_MEMORY_WAIT_S = 8, 30.0


def _start_all(spec: ServerSpec, names: list[str], log_dir: str, timeout: float) -> list[Server]:
    """Start servers side by side; all or none. SGLang refuses to start a HiCache host pool while the host's
    MemAvailable is under its fixed 10 GiB reserve plus the pool, which on a shared host comes and goes:
    such a refusal is retried after a wait, any other failure is raised."""
    import sys
    import time
    for attempt in range(HOST_MEMORY_TRIES):
        try:
            return _start_side_by_side(spec, names, log_dir, timeout)
        except RuntimeError as e:
            if HOST_MEMORY_REFUSAL not in str(e) or attempt == HOST_MEMORY_TRIES - 1:
                raise
            print(f"deployment: SGLang found too little host memory to start; retrying in {HOST_MEMORY_WAIT_S:.0f} s",
                  file=sys.stderr)
            time.sleep(HOST_MEMORY_WAIT_S)
    raise AssertionError("unreachable")


def _start_side_by_side(spec: ServerSpec, names: list[str], log_dir: str, timeout: float) -> list[Server]:
    """Start servers side by side, then wait for each; all or none (an interrupt stops those started)."""
    servers: list[Server] = []
    try:
        for name in names:
            servers.append(Server(spec, name, log_dir, start_timeout=timeout, wait=False))
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


class Deployment:
    """Servers of one topology on one L3; `url` is where the client sends."""

    def __init__(self, topology: str, threads: str, base: ServerSpec, log_dir: str, tag: str,
                 start_timeout: float = 600):
        self.topology, self.threads, self.log_dir, self.tag = topology, threads, log_dir, tag
        self.spec = spec_for(base, topology, threads)
        self.schedulers = TOPOLOGIES[topology]
        self.start_timeout = start_timeout
        names = [f"{tag}-a", f"{tag}-b"] if topology == "pair" else [tag]
        self.servers = _start_all(self.spec, names, log_dir, start_timeout)
        self.forwarder = RoundRobin([s.url for s in self.servers]) if topology == "pair" else None

    @property
    def url(self) -> str:
        return self.forwarder.url if self.forwarder is not None else self.servers[0].url

    def flush(self) -> None:
        """Device and host caches of every scheduler (SGLang's /flush_cache reaches every DP rank)."""
        for s in self.servers:
            s.flush_device_and_host()

    def clear_l3(self) -> None:
        """The L3's contents: one backend's clear() empties the store all schedulers share."""
        self.servers[0].clear_l3()

    def metrics(self) -> list[str]:
        return [s.get("/metrics") for s in self.servers]

    def kill(self, i: int) -> Server:
        """SIGKILL server i (pair only); the forwarder finds it gone at its next connection and skips it."""
        dead = self.servers[i]
        dead.kill()
        return dead

    def restart(self, i: int) -> Server:
        """A fresh server in place of server i, put back into the rotation."""
        self.servers[i].stop()
        fresh = Server(self.spec, f"{self.tag}-{'ab'[i]}-restarted", self.log_dir, start_timeout=self.start_timeout)
        self.servers[i] = fresh
        self.forwarder.add(fresh.url)
        return fresh

    def stop(self) -> None:
        if self.forwarder is not None:
            self.forwarder.close()
        for s in self.servers:
            s.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
