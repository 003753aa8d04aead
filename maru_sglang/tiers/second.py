"""The second tier: Mooncake Store behind the shared-memory pool, through SGLang's own MooncakeStore.

A maru_shm pool serves the processes of one node; between nodes, pages travel through Mooncake Store.
This module owns the tier's life and its guard rails. Which pages go where is `twotiers.py`'s business.

Rules:
- SGLang never waits for the tier. With the master down, MooncakeStore's constructor blocks about 90 s
  (setup() retries 20 times) and then raises. So the store is built on a daemon thread, and only after
  the master's RPC port has accepted a TCP connection.
- A call never raises into SGLang's threads. A failure is logged once per cause, counted, and answered as
  a miss (reads) or as "not written" (writes).
- The master's death detaches the tier. Two signals count: an RPC failure (Mooncake's RPC_FAIL, -900)
  in any result, and an exception. After that no call reaches Mooncake: with the master down, each get or
  put stalls for about 4 s. The same thread probes the master every `retry_s` and attaches again once it
  answers. Mooncake's client reconnects by itself.
- Nothing read is trusted. A get that returns a byte count other than the buffer's size counts as a
  failed read, so a short object never passes for a page.
- The tier's keys carry the pool's namespace. `extra_backend_tag` is a digest of the key space (model,
  ranks, KV format), and MooncakeStore adds the model name and the rank suffixes. The clear() nonce is
  not in it, and clear() is never forwarded: MooncakeStore.clear() empties the whole cluster.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from . import status as tierstatus
from ..config import master_address
from ..sync import Mutex, MutexTimeout, Tally, boundary

logger = logging.getLogger("maru_sglang")

RPC_FAIL = -900  # mooncake-store ErrorCode::RPC_FAIL: the master did not answer
OBJECT_NOT_FOUND = -704  # ErrorCode::OBJECT_NOT_FOUND: an ordinary miss
PROBE_KEY = "maru-tier2-probe"  # looked up (never written) to test the master after a detach

WAITING, CONNECTING, ATTACHED, DOWN, CLOSED = "waiting", "connecting", "attached", "down", "closed"
COUNTERS = ("hits", "misses", "promoted", "written", "write_failed", "offline_writes", "read_errors", "attaches",
            "detaches", "build_failures")


def _flat_sizes(sizes) -> List[int]:
    """Requested bytes per object: an int per object, or a list of ints for multi-buffer objects."""
    return [sum(int(x) for x in s) if isinstance(s, (list, tuple)) else int(s) for s in sizes]


class WatchedClient:
    """A MooncakeDistributedStore whose result codes are watched: RPC_FAIL marks the tier down.

    It stands in for MooncakeStore.store, so every call SGLang's MooncakeStore makes passes here.
    """

    def __init__(self, store, tier: "SecondTier"):
        self._store = store
        self._tier = tier

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _watch(self, codes) -> list:
        codes = list(codes)
        if RPC_FAIL in codes:
            self._tier.went_down(f"RPC_FAIL ({RPC_FAIL}) from the master")
        return codes

    def batch_is_exist(self, keys):
        return self._watch(self._store.batch_is_exist(keys))

    def _gets(self, codes, sizes) -> list:
        codes = self._watch(codes)
        bad = 0
        for i, (got, want) in enumerate(zip(codes, _flat_sizes(sizes))):
            if got >= 0 and got != want:  # a short or long object is no page of ours: refuse it
                codes[i], bad = -1, bad + 1
            elif got < 0 and got not in (OBJECT_NOT_FOUND, RPC_FAIL):
                bad += 1
        if bad:
            self._tier.count("read_errors", bad)
        return codes

    def batch_get_into(self, keys, ptrs, sizes):
        return self._gets(self._store.batch_get_into(keys, ptrs, sizes), sizes)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes, *args):
        return self._gets(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes, *args), sizes)

    def batch_put_from(self, *args):
        return self._watch(self._store.batch_put_from(*args))

    def batch_put_from_multi_buffers(self, *args):
        return self._watch(self._store.batch_put_from_multi_buffers(*args))


class SecondTier:
    """Mooncake Store as the second tier of one MaruStorage: its state, its thread, its guarded calls.

    States: waiting (master not answering, or the store could not be built) -> connecting (building the
    store) -> attached <-> down (the master stopped answering) ; closed.
    """

    def __init__(self, settings: dict, retry_s: float, log_once: Callable[[str, BaseException], None]):
        self.settings = dict(settings)
        self.retry_s = float(retry_s)
        self.master = master_address(settings["master_server_address"])
        self._log_once = log_once
        self.state = WAITING
        self.tag: Optional[str] = None
        self._client = None  # SGLang's MooncakeStore, once built
        self._pools: List[tuple] = []  # v2 pools (host_pool, name) to register with the store
        self._lock = Mutex("the second tier's state")  # no Mooncake call runs under it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._counts: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._tally = Tally("the second tier's counters", self._fold)  # (counter, n) records, folded into them
        self._status: Optional[tuple] = None  # (pool path, file name, mode, identity) for maru-shm inspect
        self._published: Optional[dict] = None

    # ------------------------------------------------------------ life
    def start(self, storage_config, host_pool, tag: str, status: Optional[tuple] = None) -> None:
        """Begin attaching in the background: storage_config and host_pool as SGLang gave them to MaruStorage.

        status: (pool path, instance id, file mode, slot) to publish the tier's figures for maru-shm inspect.
        """
        if self._thread is not None:
            return
        self.tag = tag
        if status is not None:
            path, instance, mode, slot = status
            self._status = (path, f"{os.getpid()}-{instance}", mode, {"pid": os.getpid(), "instance": instance,
                                                                        "slot": slot})
            tierstatus.remove_stale(path)
            self._publish()
        cfg = copy.copy(storage_config)
        cfg.extra_config = dict(self.settings, extra_backend_tag=tag)
        self._thread = threading.Thread(target=self._run, args=(cfg, host_pool), name="maru-tier2", daemon=True)
        self._thread.start()

    def register_v2(self, host_pool, name) -> None:
        """A hybrid model's extra pool: registered with the store now if it is built, else when it is."""
        with self._lock:
            self._pools.append((host_pool, name))
            client = self._client
        if client is not None:  # else _build registers it
            self._register_pool(client, host_pool, name)

    def _register_pool(self, client, host_pool, name) -> None:
        try:
            client.register_mem_host_pool_v2(host_pool, name)
        except Exception as e:  # a pool Mooncake cannot serve: its transfers then miss in this tier
            self._log_once(f"tier2: registering pool {name}", e)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self.state = CLOSED
            self._client = None
        if self._status is not None:
            tierstatus.remove_status(self._status[0], self._status[1])

    def _publish(self) -> None:
        """Rewrite this tier's status file when its figures changed (never raises)."""
        if self._status is None or self._stop.is_set():
            return
        now = self.stats()
        if now == self._published:
            return
        path, name, mode, ident = self._status
        try:
            tierstatus.write_status(path, name, dict(now, **ident, updated_ns=time.time_ns()), mode)
            self._published = now
        except OSError as e:  # a full tmpfs or a removed directory costs the status, nothing else
            self._log_once("tier2: writing the status file for maru-shm inspect", e)

    @boundary
    def _run(self, cfg, host_pool) -> None:
        while not self._stop.is_set():
            if self.state in (WAITING, DOWN) and self._master_answers():
                if self._client is None:
                    self._build(cfg, host_pool)
                else:
                    self._probe()
            self._publish()
            self._stop.wait(self.retry_s)

    def _master_answers(self) -> bool:
        try:
            socket.create_connection(self.master, timeout=min(1.0, self.retry_s)).close()
            return True
        except OSError:
            return False

    def _build(self, cfg, host_pool) -> None:
        self.state = CONNECTING
        try:
            from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

            client = MooncakeStore(cfg, host_pool)
            client.store = WatchedClient(client.store, self)
            client.register_mem_pool_host(host_pool)
        except Exception as e:  # no engine installed, no storage segment, setup failed: try again later
            self.count("build_failures")
            self._log_once("tier2: attaching Mooncake Store", e)
            self.state = WAITING if not self._stop.is_set() else CLOSED
            return
        done = 0
        while True:  # the pools registered so far, then the client published once none is left to register
            with self._lock:
                if self._stop.is_set():
                    return
                pending = self._pools[done:]
                if not pending:
                    self._client, self.state = client, ATTACHED
                    break
            for pool, name in pending:
                self._register_pool(client, pool, name)
            done += len(pending)
        self.count("attaches")
        logger.info("maru: second tier attached: Mooncake master %s:%d, tag %s", *self.master, self.tag)

    def _probe(self) -> None:
        try:
            codes = self._client.store.batch_is_exist([PROBE_KEY])  # watched: a failure while DOWN changes nothing
        except Exception:
            return
        if RPC_FAIL in codes:
            return
        with self._lock:
            if self.state != DOWN:
                return
            self.state = ATTACHED
        self.count("attaches")
        logger.info("maru: second tier attached again: Mooncake master %s:%d answers", *self.master)

    def went_down(self, why: str) -> None:
        """Detach the tier. Runs on the failure path of SGLang's calls, so it never raises: a state mutex
        busy past its bound (its sections are short and wait for nothing) leaves the tier as it is."""
        try:
            with self._lock:
                if self.state != ATTACHED:
                    return
                self.state = DOWN
        except MutexTimeout:
            return
        self.count("detaches")
        logger.warning("maru: second tier detached (%s); the pool keeps serving, retrying every %.1f s",
                       why, self.retry_s)

    # ------------------------------------------------------------ guarded calls
    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter without waiting for anything (sync.Tally)."""
        self._tally.add((name, n))

    def _fold(self, record: tuple) -> None:
        self._counts[record[0]] += record[1]

    def call(self, what: str, fn: Callable[[Any], Any], fallback):
        """fn(MooncakeStore) while attached; `fallback` when not, or when it raises (which detaches)."""
        client = self._client if self.state == ATTACHED else None
        if client is None:
            return fallback
        try:
            return fn(client)
        except Exception as e:
            self._log_once(f"tier2: {what}", e)
            self.went_down(f"{what} raised {type(e).__name__}")
            return fallback

    # ------------------------------------------------------------ the tier's calls (twotiers.Tier)
    def exists(self, keys: List[str]) -> int:
        return self.call("batch_exists", lambda c: c.batch_exists(keys), 0)

    def get_v1(self, keys: List[str], host_indices) -> List[bool]:
        return self.call("batch_get_v1", lambda c: c.batch_get_v1(keys, host_indices), [False] * len(keys))

    def set_v1(self, keys: List[str], host_indices) -> List[bool]:
        return self.call("batch_set_v1", lambda c: c.batch_set_v1(keys, host_indices), [False] * len(keys))

    def exists_v2(self, keys: List[str], transfers):
        return self.call("batch_exists_v2", lambda c: c.batch_exists_v2(keys, transfers), None)

    def get_v2(self, transfers) -> dict:
        return self.call("batch_get_v2", lambda c: c.batch_get_v2(transfers), {})

    def set_v2(self, transfers) -> dict:
        return self.call("batch_set_v2", lambda c: c.batch_set_v2(transfers), {})

    @property
    def attached(self) -> bool:
        return self.state == ATTACHED

    def stats(self) -> dict:
        out = self._tally.read(lambda: dict(self._counts))
        out.update(state=self.state, master=f"{self.master[0]}:{self.master[1]}", tag=self.tag)
        return out
