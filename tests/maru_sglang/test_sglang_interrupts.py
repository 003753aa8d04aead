"""An exception at any line of a MaruStorage call leaves no lock of the backend held and hangs no later call
(invariant 9 for the backend; RELIABILITY.md section 13).

The injector of tests/maru_shm/test_interrupts.py: a seeded trace hook raises KeyboardInterrupt at one line
event of one backend call, as a SIGINT or a signal handler's exception would between two bytecodes; in three
runs of four inside maru_sglang, in the others anywhere in maru_sglang or maru_shm. Each run is one call SGLang
makes: v1 (batch_exists, batch_get_v1, batch_set_v1, with relation records), legacy (get, set, batch_get,
batch_set, exists), v2 for a hybrid model (batch_exists_v2, batch_get_v2, batch_set_v2 over its KV, Mamba,
sliding-window and draft pools), clear, get_stats, close (the backend is then closed again and made anew), a
call that finds the pool removed under it (detach and heal); and, with a real Mooncake Store behind two pool
files, the two-tier paths (read-through, promotion, write-through; v1 and v2). Real SGLang host pools throughout.

Each call runs on a thread of its own. After each: every Python lock reachable from the backends (and every
guard of maru_shm) is free, seen from another thread, and no lock of the pools is held; the next calls of every
kind, on a fresh thread, finish within WATCHDOG_S (a watchdog against a hang, not a speed figure); a page a get
reported loaded holds the bytes set for its key; no call but an interrupted one raised; a backend closed twice
has closed its store.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import queue
import random
import shutil
import sys
import threading
import time
import traceback

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402

import hicache_helpers as hh  # noqa: E402
import maru_sglang  # noqa: E402
import maru_shm  # noqa: E402
import mooncake_cluster as mc  # noqa: E402
from maru_shm.locking import guard as shm_guard  # noqa: E402
from maru_shm import StoreError, remove_pool  # noqa: E402
from maru_shm.locking.lockfile import lock_file_path  # noqa: E402

from ..conftest import in_finalizer  # noqa: E402
from ..conftest import a_lock_held_by_anyone  # noqa: E402

pytestmark = pytest.mark.sglang

WATCHDOG_S = 60.0  # a call that has not returned by then hangs (liveness, not speed)
PATIENCE_S = 2.0  # a lock busy this long is held, not in use by a background thread (every section is short)
SGLANG_ROOT = os.path.dirname(maru_sglang.__file__) + os.sep
SHM_ROOT = os.path.dirname(maru_shm.__file__) + os.sep
P = 8  # pages [0, P) of every host pool are write sources, [P, 2P) read destinations
CHAINS = [hh.prompt_keys(P, f"chain{i}") for i in range(6)]
TRAIL, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
# pool -> (hit policy, keys per transfer: 0 all, else the last n, host indices: "kv" when KV-derived)
SIDE = {"mamba": (TRAIL, 1, "own"), "swa": (TRAIL, 3, "own"), "draft": (ALL, 0, "kv")}
MARU = {"maru_prefix_eviction": True, "maru_heal_retry_s": 0.05}


# --------------------------------------------------------------------------- the injector
def _tracer(n: int | None, roots: tuple):
    """A trace function raising KeyboardInterrupt at the n-th line event inside `roots` (never, for None), and
    the count so far. Python unsets a trace function that raises: one interrupt. Finalizers are not traced
    (conftest.in_finalizer)."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                f = frame.f_code.co_filename
                raise KeyboardInterrupt(f"{f[len(os.path.dirname(SHM_ROOT[:-1])) + 1:]}:{frame.f_lineno} "
                                        f"({frame.f_code.co_name})")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(roots) and not in_finalizer(frame) else None
    return calls, seen


class Worker:
    """A storage thread of the test: runs one function at a time, traced by the tracer given with it. The
    caller waits WATCHDOG_S at most; a function still running then fails the test with its stack."""

    def __init__(self, name: str):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.inbox.get()) is not None:
            fn, tracer = job
            sys.settrace(tracer)
            try:
                out = (fn(), None)
            except BaseException as e:
                # the exception without its traceback, whose frames would keep views of a mapping alive (a
                # Store's close then refuses to unmap: BufferError); only its kind and text are looked at
                e.__traceback__ = e.__context__ = e.__cause__ = None
                out = (None, e)
            finally:
                sys.settrace(None)
            self.outbox.put(out)

    def run(self, fn, tracer=None):
        """fn() on this thread: (result, exception)."""
        self.inbox.put((fn, tracer))
        try:
            return self.outbox.get(timeout=WATCHDOG_S)
        except queue.Empty:
            stack = "".join(traceback.format_stack(sys._current_frames()[self.thread.ident]))
            pytest.fail(f"a call hangs: still running after {WATCHDOG_S:.0f} s on {self.thread.name}:\n{stack}")

    def stop(self) -> None:
        self.inbox.put(None)


# --------------------------------------------------------------------------- locks
_LOCKS = (type(threading.Lock()), type(threading.RLock()))
_LEAVES = (int, float, str, bytes, bool, type(None), memoryview)


def _locks_of(roots: dict) -> list:
    """(path, lock) of every threading lock reachable from `roots` through objects of maru_sglang and maru_shm
    and the containers they hold."""
    out, seen, stack = [], set(), [("", k, v) for k, v in roots.items()]
    while stack:
        parent, key, o = stack.pop()
        if id(o) in seen or isinstance(o, _LEAVES):
            continue
        seen.add(id(o))
        path = f"{parent}{key}"
        if isinstance(o, _LOCKS):
            out.append((path, o))
        elif isinstance(o, dict):
            stack += [(path, f"[{k!r}]", v) for k, v in list(o.items()) if not isinstance(v, _LEAVES)]
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack += [(path, f"[{i}]", v) for i, v in enumerate(list(o)) if not isinstance(v, _LEAVES)]
        elif type(o).__module__.startswith(("maru_sglang", "maru_shm")) and not isinstance(o, type):
            attrs = dict(vars(o)) if hasattr(o, "__dict__") else {}
            for cls in type(o).__mro__:
                for s in getattr(cls, "__slots__", ()):
                    if hasattr(o, s):
                        attrs[s] = getattr(o, s)
            stack += [(path, f".{k}", v) for k, v in attrs.items() if not isinstance(v, _LEAVES)]
    return out


def _free(lock) -> bool:
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def _held(locks: list) -> list:
    """Paths of the locks still held after PATIENCE_S of tries (this thread holds none of them)."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        locks = [(p, lk) for p, lk in locks if not _free(lk)]
        if not locks or time.monotonic() > deadline:
            return [p for p, _ in locks]
        time.sleep(0.01)


def _pool_lock_held(path: str) -> str | None:
    deadline = time.monotonic() + PATIENCE_S
    while True:
        try:
            held = a_lock_held_by_anyone(path) if os.path.exists(lock_file_path(path, False)) else None
        except FileNotFoundError:  # removed by the run (a lost pool), not yet made again
            held = None
        if held is None or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


# --------------------------------------------------------------------------- pages
def _content(tag: str, key: str, n: int) -> bytes:
    return hashlib.shake_128(f"{tag}/{key}".encode()).digest(n)


def _write_page(host, page: int, data: bytes) -> None:
    ptrs, sizes = host.get_page_buffer_meta(hh.slot_indices(host, page, 1))
    at = 0
    for p, s in zip(ptrs, sizes):
        ctypes.memmove(int(p), data[at:at + int(s)], int(s))
        at += int(s)


def _page_size_of(host) -> int:
    return sum(int(s) for s in host.get_page_buffer_meta(hh.slot_indices(host, 0, 1))[1])


class Node:
    """One backend of the rig and its host pools: `kind` v1, legacy or hybrid."""

    def __init__(self, name: str, kind: str, pool: str, tier2: dict | None):
        self.name, self.kind, self.pool, self.tier2 = name, kind, pool, tier2
        self.make()

    def make(self) -> None:
        maru = dict(MARU, **({"maru_tier2": self.tier2, "maru_tier2_retry_s": 0.2} if self.tier2 else {}))
        if self.kind == "hybrid":
            self.host = hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=2, head_num=2,
                                         head_dim=64)
            self.pools = {"mamba": hh.make_mamba_host(2 * P)}
            if self.tier2 is None:
                self.pools["swa"] = hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=1,
                                                     head_num=2, head_dim=64)
                self.pools["draft"] = hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=1,
                                                       head_num=1, head_dim=64)
            self.backend = hh.create_hybrid_maru(self.pool, self.host, self.pools, mla=False, size="8M", maru=maru)
        else:
            self.pools = {}
            self.host, self.backend = hh.make_instance(self.pool, kind="mha", page_size=1, pages=2 * P, size="8M",
                                                       v1=self.kind == "v1", maru=maru,
                                                       host_kw=dict(layer_num=2, head_num=1, head_dim=64))
        if self.tier2 is not None:
            assert mc.wait_attached(self.backend), "the second tier did not attach"
        page = self.host.get_dummy_flat_data_page()
        self.flat = page.numel() * page.element_size()  # bytes of a legacy (flat) page


class Rig:
    """The backends of one scenario and the workload's ops over them."""

    def __init__(self, nodes: list, rng: random.Random):
        self.nodes = {n.name: n for n in nodes}
        self.rng = rng
        self.graveyard: list = []  # backends replaced after a close: kept alive, so no finalizer runs mid-trace
        self.wrong: list[str] = []
        self.storage = Worker("storage")  # runs the interrupted calls, as SGLang's storage threads do
        self.helper = Worker("follow-up")  # the calls after each: a thread that no interrupt met

    # ---- helpers
    def keys(self) -> list:
        chain = self.rng.choice(CHAINS)
        start = self.rng.randrange(P)
        return chain[start:start + self.rng.randint(1, P - start)] if self.rng.random() < 0.3 else \
            chain[:self.rng.randint(1, P)]

    def _check(self, node: Node, tag: str, host, keys, first: int, ok) -> None:
        """Pages reported loaded hold the bytes set for their key."""
        got = hh.pool_page_bytes(host, hh.slot_indices(host, first, len(keys)), len(keys))
        for k, data, loaded in zip(keys, got, ok):
            if loaded and data != _content(tag, k, len(data)):
                self.wrong.append(f"{node.name}: {tag} page of {k[:12]} loaded with bytes of no value of the key")

    def _fill(self, tag: str, host, keys) -> None:
        n = _page_size_of(host)
        for i, k in enumerate(keys):
            _write_page(host, i, _content(tag, k, n))

    def _zero(self, host, n: int) -> None:
        hh.zero_pool_pages(host, hh.slot_indices(host, P, n), n)

    # ---- v1
    def set_v1(self, node: Node, keys):
        self._fill("kv", node.host, keys)
        return lambda: node.backend.batch_set_v1(keys, hh.slot_indices(node.host, 0, len(keys))), \
            lambda r: len(r) == len(keys)

    def get_v1(self, node: Node, keys):
        self._zero(node.host, len(keys))

        def check(r):
            self._check(node, "kv", node.host, keys, P, r)
            return len(r) == len(keys)
        return lambda: node.backend.batch_get_v1(keys, hh.slot_indices(node.host, P, len(keys))), check

    def exists_v1(self, node: Node, keys):
        return lambda: node.backend.batch_exists(keys), lambda r: 0 <= r <= len(keys)

    # ---- legacy
    def _flat(self, node: Node, key: str):
        return torch.frombuffer(bytearray(_content("flat", key, node.flat)), dtype=torch.uint8)

    def set_one(self, node: Node, keys):
        return lambda: node.backend.set(keys[0], self._flat(node, keys[0])), lambda r: r in (True, False)

    def set_flat(self, node: Node, keys):
        return lambda: node.backend.batch_set(keys, [self._flat(node, k) for k in keys]), lambda r: r in (True, False)

    def get_flat(self, node: Node, keys):
        targets = [torch.zeros(node.flat, dtype=torch.uint8) for _ in keys]

        def check(r):
            for k, t, got in zip(keys, targets, r):
                if got is not None and bytes(t.numpy()) != _content("flat", k, node.flat):
                    self.wrong.append(f"{node.name}: flat page of {k[:12]} loaded with bytes of no value of the key")
            return len(r) == len(keys)
        return lambda: node.backend.batch_get(keys, targets), check

    def get_one(self, node: Node, keys):
        target = torch.zeros(node.flat, dtype=torch.uint8)

        def check(r):
            if r is not None and bytes(target.numpy()) != _content("flat", keys[0], node.flat):
                self.wrong.append(f"{node.name}: flat page of {keys[0][:12]} loaded with bytes of no value of the key")
            return True
        return lambda: node.backend.get(keys[0], target), check

    def exists_one(self, node: Node, keys):
        return lambda: node.backend.exists(keys[0]), lambda r: r in (True, False)

    # ---- v2
    def _transfer(self, node: Node, name: str, keys, first: int):
        policy, last, src = SIDE[name]
        keys = keys[-last:] if last else keys
        host = node.pools[name]
        return PoolTransfer(name=PoolName(name), host_indices=hh.slot_indices(host, first, len(keys)), keys=list(keys),
                            hit_policy=policy, indices_from_pool=PoolName.KV if src == "kv" else None)

    def set_v2(self, node: Node, keys):
        names = [n for n in node.pools if self.rng.random() < 0.7] or list(node.pools)
        for n in names:
            self._fill(n, node.pools[n], keys[-SIDE[n][1]:] if SIDE[n][1] else keys)
        transfers = [self._transfer(node, n, keys, 0) for n in names]
        if self.rng.random() < 0.3:  # a transfer named kv moves the KV pages themselves
            self._fill("kv", node.host, keys)
            transfers.append(PoolTransfer(name=PoolName.KV, host_indices=hh.slot_indices(node.host, 0, len(keys)),
                                          keys=list(keys)))
        return lambda: node.backend.batch_set_v2(transfers), \
            lambda r: all(len(r[t.name]) == len(t.keys) for t in transfers)

    def get_v2(self, node: Node, keys):
        names = [n for n in node.pools if self.rng.random() < 0.7] or list(node.pools)
        transfers = [self._transfer(node, n, keys, P) for n in names]
        for t in transfers:
            self._zero(node.pools[t.name.value], len(t.keys))

        def check(r):
            for t in transfers:
                self._check(node, t.name.value, node.pools[t.name.value], t.keys, P, r[t.name])
            return all(len(r[t.name]) == len(t.keys) for t in transfers)
        return lambda: node.backend.batch_get_v2(transfers), check

    def exists_v2(self, node: Node, keys):
        query = [PoolTransfer(name=PoolName(n), keys=["__placeholder__"] * SIDE[n][1] if SIDE[n][0] == TRAIL else None,
                              hit_policy=SIDE[n][0]) for n in node.pools]
        return lambda: node.backend.batch_exists_v2(keys, query), lambda r: 0 <= r.kv_hit_pages <= len(keys)

    # ---- housekeeping
    def clear(self, node: Node, keys):
        return node.backend.clear, lambda r: r is None

    def stats(self, node: Node, keys):
        return node.backend.get_stats, lambda r: isinstance(r.maru, dict)

    def close(self, node: Node, keys):
        return node.backend.close, lambda r: r is None

    def lose(self, node: Node, keys):
        """The pool removed under the backends: the call finds it lost (one path check per maru_heal_retry_s),
        detaches, and the heal thread makes it again."""
        remove_pool(node.pool)
        time.sleep(MARU["maru_heal_retry_s"] * 1.5)
        return self.exists_v1(node, keys) if node.kind != "legacy" else self.exists_one(node, keys)

    OPS = {"v1": ("set_v1", "get_v1", "exists_v1"),
           "legacy": ("set_one", "set_flat", "get_flat", "get_one", "exists_one"),
           "hybrid": ("set_v1", "get_v1", "exists_v1", "set_v2", "get_v2", "exists_v2")}
    RARE = (("clear", 0.03), ("stats", 0.04), ("close", 0.03), ("lose", 0.01))

    def pick(self) -> tuple:
        node = self.rng.choice(list(self.nodes.values()))
        x = self.rng.random()
        for op, p in self.RARE:
            if x < p and (op != "lose" or node.tier2 is None):
                return node, op
            x -= p
        return node, self.rng.choice(self.OPS[node.kind])

    def after_close(self, node: Node, store) -> None:
        """A close an exception cut short finishes when called again: the store is closed; then a new backend."""
        _, error = self.helper.run(node.backend.close)
        assert error is None, f"{node.name}: close() called again raised {error!r}"
        assert store is None or store._closed, f"{node.name}: closed twice, its store is still open"
        self.graveyard.append(node.backend)
        _, error = self.helper.run(node.make)
        assert error is None, f"{node.name}: a new backend after the close failed: {error!r}"

    def follow_up(self) -> None:
        """The next calls of every kind, on a fresh thread: each finishes (the watchdog) and raises nothing."""
        def calls():
            for node in self.nodes.values():
                keys = CHAINS[0][:2]
                for op in (*self.OPS[node.kind], "stats"):
                    fn, ok = getattr(self, op)(node, keys)
                    assert ok(fn()), f"{node.name}.{op}: a malformed answer"
        _, error = self.helper.run(calls)
        if error is not None:
            raise AssertionError(f"a call after the interrupt raised: {error!r}") from error

    def serves_again(self) -> None:
        """Every backend stores and loads pages again (a lost pool healed meanwhile): within WATCHDOG_S."""
        keys, deadline = hh.prompt_keys(2, "again"), time.monotonic() + WATCHDOG_S
        for node in self.nodes.values():
            ops = ("set_flat", "get_flat") if node.kind == "legacy" else ("set_v1", "get_v1")
            while True:
                stored = getattr(self, ops[0])(node, keys)[0]()
                load, check = getattr(self, ops[1])(node, keys)
                loaded = load()
                check(loaded)  # the bytes of each page loaded
                if stored in (True, [True, True]) and all(x is not None and x is not False for x in loaded):
                    break
                assert time.monotonic() < deadline, f"{node.name} does not serve again: {stored}, {loaded}"
                time.sleep(0.05)

    def locks(self) -> list:
        roots = {f"{n.name}": n.backend for n in self.nodes.values()}
        roots.update({f"maru_shm guard {i}": g for i, g in enumerate(list(shm_guard._GUARDS))})
        return _locks_of(roots)


def _run(rig: Rig, interrupts: int, seed: int) -> dict:
    """Calls of the rig's ops until `interrupts` of them were interrupted, each at a random line event (the first
    call of an op measures how many it has, and a call may end before the event drawn); the checks of the
    module docstring after each; at the end every backend serves again. The figures."""
    rng = random.Random(seed)
    events: dict = {}  # (op, scope) -> line events of the last uninterrupted calls
    figures = {"interrupts": 0, "in_maru_shm": 0, "calls": 0, "locks_checked": 0, "by_op": collections.Counter()}
    while figures["interrupts"] < interrupts:
        assert figures["calls"] < 3 * interrupts + 100, figures
        node, op = rig.pick()
        keys = rig.keys()
        scope = (SGLANG_ROOT,) if rng.random() < 0.75 else (SGLANG_ROOT, SHM_ROOT)
        seen_before = events.get((op, scope))
        n = rng.randint(1, sum(seen_before) // len(seen_before)) if seen_before else None
        store = node.backend.pool.store
        fn, ok = getattr(rig, op)(node, keys)
        tracer, seen = _tracer(n, scope)
        result, error = rig.storage.run(fn, tracer)
        figures["calls"] += 1
        where = f"{node.name}.{op} uninterrupted"
        if isinstance(error, StoreError) and op == "clear":
            error = None  # clear() reports a pool it cannot write (detached while it heals) by raising
        if error is not None:
            if not isinstance(error, KeyboardInterrupt):
                raise AssertionError(f"{node.name}.{op} raised {error!r}") from error
            where = f"{node.name}.{op} interrupted at {error}"
            figures["interrupts"] += 1
            figures["in_maru_shm"] += str(error).startswith("maru_shm")
            figures["by_op"][op] += 1
        else:
            events.setdefault((op, scope), collections.deque(maxlen=8)).append(seen[0])
            assert ok(result), f"{where}: a malformed answer {result!r}"
        assert not rig.wrong, (where, rig.wrong)
        locks = rig.locks()
        figures["locks_checked"] = max(figures["locks_checked"], len(locks))
        held = _held(locks)
        assert not held, f"after {where}: Python locks still held: {held}"
        for path in {nd.pool for nd in rig.nodes.values()}:
            lock = _pool_lock_held(path)
            assert lock is None, f"after {where}: lock {lock} of pool {path} is still held"
        if op == "close":
            rig.after_close(node, store)
        rig.follow_up()
        assert not rig.wrong, (where, rig.wrong)
    _, error = rig.helper.run(rig.serves_again)
    assert error is None, repr(error)
    return figures


@pytest.fixture
def pools():
    made = []

    def new(tag):
        made.append(hh.shm_path(tag))
        return made[-1]

    yield new
    for p in made:
        remove_pool(p)
        shutil.rmtree(p + ".tier2", ignore_errors=True)  # a second tier's status files


def _pool_rig(pools, seed: int) -> Rig:
    path = pools("intr")
    return Rig([Node("v1", "v1", path, None), Node("legacy", "legacy", path, None),
                Node("hybrid", "hybrid", path, None)], random.Random(seed))


def _tier_rig(pools, cluster, seed: int) -> Rig:
    return Rig([Node("node_a", "hybrid", pools("tierA"), cluster.settings),
                Node("node_b", "hybrid", pools("tierB"), cluster.settings)], random.Random(seed))


def _close(rig: Rig) -> None:
    """Close every backend, each on a thread of its own: one that hangs (the failure being reported) is left."""
    rig.storage.stop()
    rig.helper.stop()
    for b in [*(n.backend for n in rig.nodes.values()), *rig.graveyard]:
        t = threading.Thread(target=b.close, daemon=True)
        t.start()
        t.join(WATCHDOG_S)


def _check_figures(figures: dict, ops: set) -> None:
    assert figures["in_maru_shm"] > 0, figures
    assert ops <= set(figures["by_op"]), f"ops never interrupted: {ops - set(figures['by_op'])}; {figures}"
    assert figures["locks_checked"] >= 10, figures  # the walk finds the backends' mutexes and the store's guards


def test_an_interrupt_at_any_line_of_a_backend_call_leaves_no_lock_held_and_no_call_hangs(pools):
    rig = _pool_rig(pools, seed=50)
    try:
        figures = _run(rig, interrupts=200, seed=50)
    finally:
        _close(rig)
    _check_figures(figures, {op for ops in Rig.OPS.values() for op in ops} | {"close", "clear", "stats"})


@pytest.fixture
def cluster(tmp_path):
    if mc.unavailable() is not None:
        pytest.skip(str(mc.unavailable()))
    c = mc.MooncakeCluster(str(tmp_path)).start()
    yield c
    c.stop()


def test_an_interrupt_at_any_line_of_a_two_tier_call_leaves_no_lock_held_and_no_call_hangs(pools, cluster):
    rig = _tier_rig(pools, cluster, seed=51)
    try:
        figures = _run(rig, interrupts=100, seed=51)
    finally:
        _close(rig)
    _check_figures(figures, set(Rig.OPS["hybrid"]))


@pytest.mark.slow
def test_interrupts_over_every_backend_call_long_run(pools, tmp_path):
    """The long run: MARU_BACKEND_INTERRUPTS interrupts (5 000 by default) over the pool's rig, and a quarter as
    many over the two-tier rig where Mooncake runs; the figures are printed (RELIABILITY.md section 13)."""
    target = int(os.environ.get("MARU_BACKEND_INTERRUPTS", "5000"))
    rigs = [("pool", lambda: _pool_rig(pools, seed=52), target)]
    cluster = None
    if mc.unavailable() is None:
        cluster = mc.MooncakeCluster(str(tmp_path)).start()
        rigs.append(("two tiers", lambda: _tier_rig(pools, cluster, seed=53), target // 4))
    try:
        for name, make, n in rigs:
            rig = make()
            t0 = time.monotonic()
            try:
                figures = _run(rig, interrupts=n, seed=54 + n)
            finally:
                _close(rig)
            print(f"\n{name}: {figures['calls']} calls in {time.monotonic() - t0:.0f} s, 0 locks held, 0 hangs: "
                  f"{figures}")
            _check_figures(figures, set())
    finally:
        if cluster is not None:
            cluster.stop()
