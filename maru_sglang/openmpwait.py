"""The host's idle OpenMP workers sleep instead of spinning while the pool's processes oversubscribe its cores.

Why (#49, BENCHMARKS.md "At load"): torch runs its intra-op threads on GNU OpenMP (libgomp). After each
parallel region a worker spins before it sleeps: 300,000 polls by default, a few milliseconds, and a model
forward is hundreds of regions with Python between them, so the worker of a scheduler never sleeps. With
two schedulers and the DP controller on two cores, those spins take the cores the other scheduler's
forward needs: a decode step took 0.31 s instead of 0.12 s. Alone on its cores, a scheduler gains from the
spin: the next region starts without a wake-up (one scheduler on two cores: TTFT ×0.8 spinning).
libgomp throttles the spin to 1,000 polls once the process manages more OpenMP threads than it has CPUs
(`do_spin` in libgomp's config/linux/wait.h: `gomp_managed_threads > gomp_available_cpus`). A second thread
that owns a team gets the process there, and when that thread ends libgomp frees its team
(`gomp_free_thread`) and the spin comes back. HiCacheFile parks such a team by accident (a torch copy on
one of SGLang's storage threads), for the process's life.

The mechanism: `_ParkedTeam`, one daemon thread owning a team as large as the CPUs the process may use,
waiting until stopped. The rule (`oversubscribed`): the team is parked while the processes attached to the
pool, each counted with this process's torch threads, run more threads than this process has CPUs; re-read
every CHECK_S, since schedulers attach and die at any time. `maru_openmp_wait`: `auto` (that rule), `sleep`
(parked for the process's life), `spin` (libgomp's default). Nothing is parked when torch runs one thread,
the runtime is not libgomp, or the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (read once, when libgomp
loads: theirs win).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional

from .sync import Mutex, boundary

logger = logging.getLogger("maru_sglang")

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PARK_THREAD, WATCH_THREAD = "maru-openmp-park", "maru-openmp-watch"
CHECK_S = 1.0  # how often `auto` re-reads the pool's processes
_lock = Mutex("openmpwait")
_workers: Optional["_IdleWorkers"] = None  # this process's (a forked child finds its parent's: not its own)


def _libgomp_path() -> str | None:
    """The libgomp this process has loaded (torch's bundled copy or the system's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libgomp" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def why_not() -> str | None:
    """Why idle workers cannot or need not be made to sleep here; None if they can."""
    set_by_user = [k for k in USER_SETTINGS if os.environ.get(k)]
    if set_by_user:
        return f"{', '.join(set_by_user)} set"
    import torch
    if torch.get_num_threads() <= 1:
        return "torch runs one thread"
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "torch's parallel backend is not OpenMP"
    if _libgomp_path() is None:
        return "the OpenMP runtime is not libgomp"
    return None


def oversubscribed(processes: int, threads: int, cpus: int) -> bool:
    """The rule of `auto`: the pool's processes, each counted as running this one's threads, outnumber its CPUs."""
    return processes * threads > cpus


class _ParkedTeam:
    """One daemon thread owning a team of `size` OpenMP threads, parked until stop(); its team is freed by
    libgomp when the thread ends."""

    def __init__(self, gomp: ctypes.CDLL, size: int):
        self._stop = threading.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=self._park, args=(gomp, size, started), name=PARK_THREAD, daemon=True)
        self.thread.start()
        started.wait(10.0)

    @boundary
    def _park(self, gomp: ctypes.CDLL, size: int, started: threading.Event) -> None:
        import torch
        grain = 32768  # ATen's GRAIN_SIZE: a region of n elements gets at most n // grain threads
        try:
            torch.empty(grain * 2).fill_(0.0)  # ATen sets this thread's team size to torch's on its first region
            gomp.omp_set_num_threads(size)  # this thread's teams only (an ICV of its own)
            torch.empty(grain * size).fill_(0.0)
        finally:
            started.set()
        while not self._stop.wait(3600.0):  # parked until stop(); every wait of the backend has a bound
            pass

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10.0)


class _IdleWorkers:
    """This process's parked team (or none) and, under `auto`, the thread that applies the rule."""

    def __init__(self, gomp: ctypes.CDLL):
        self.gomp, self.cpus = gomp, _cpus()
        import torch
        self.threads = torch.get_num_threads()
        self.team: _ParkedTeam | None = None
        self.always = False  # `sleep` asked for: parked for the process's life
        self.processes: Callable[[], Callable | None] | None = None  # a weak reference to the latest count
        self.watcher: threading.Thread | None = None
        self.pid = os.getpid()

    def do_park(self, why: str) -> None:
        """_lock held."""
        if self.team is None:
            self.team = _ParkedTeam(self.gomp, self.cpus)
            logger.info("maru: the host's idle OpenMP workers sleep (a parked team of %d: %s)", self.cpus, why)

    def do_unpark(self, why: str) -> None:
        """_lock held."""
        if self.team is not None:
            team, self.team = self.team, None
            team.stop()
            logger.info("maru: the host's idle OpenMP workers spin (libgomp's default: %s)", why)

    def do_apply_rule(self) -> None:
        """_lock held: park or unpark by `oversubscribed`; an unknown count changes nothing."""
        if self.always or self.processes is None:
            return
        try:
            count = self.processes()
            n = None if count is None else count()
        except Exception:
            n = None
        if n is None:
            return
        why = f"{n} process(es) on the pool x {self.threads} threads, {self.cpus} CPUs"
        if oversubscribed(n, self.threads, self.cpus):
            self.do_park(why)
        else:
            self.do_unpark(why)

    @boundary
    def watch(self) -> None:
        failed = False
        while not self.always:
            time.sleep(CHECK_S)
            try:
                with _lock:
                    self.do_apply_rule()
            except Exception as e:  # a thread that could not start, the mutex past its bound: next time
                if not failed:
                    logger.warning("maru: the OpenMP wait rule failed once (%s: %s); it is retried every %.0f s",
                                   type(e).__name__, e, CHECK_S)
                failed = True


def _idle_workers() -> _IdleWorkers | None:
    """_lock held: this process's, made on first use; None where nothing can be parked (logged)."""
    global _workers
    if _workers is not None:
        return _workers if _workers.pid == os.getpid() else None  # a fork: teams do not survive it, a new one could hang
    reason = why_not()
    try:
        if reason is None:
            _workers = _IdleWorkers(ctypes.CDLL(_libgomp_path()))
            return _workers
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    logger.info("maru: the host's idle OpenMP workers keep libgomp's default wait (%s)", reason)
    return None


def manage_idle_workers(mode: str, processes: Callable[[], int | None] | None = None) -> bool:
    """Apply `maru_openmp_wait` to this process: "sleep" parks a team for the process's life; "auto" parks
    one while `processes()` (the pool's live processes, None while unknown) makes `oversubscribed` true,
    parked until the first count; the latest caller's `processes` is the one read. True if a team is parked
    now or may be. Never raises: the host runs as it would without it."""
    if mode == "spin":
        return False
    try:
        with _lock:
            w = _idle_workers()
            if w is None:
                return False
            if mode == "sleep":
                w.always = True
                w.do_park("maru_openmp_wait: sleep")
                return True
            if processes is not None:  # a backend's method, held weakly: the watcher keeps no backend alive
                w.processes = weakref.WeakMethod(processes) if hasattr(processes, "__self__") else lambda: processes
            if w.team is None and w.watcher is None:
                w.do_park("until the pool's processes are counted")
            if w.watcher is None:
                w.watcher = threading.Thread(target=w.watch, name=WATCH_THREAD, daemon=True)
                w.watcher.start()
            return True
    except Exception as e:
        logger.warning("maru: the host's idle OpenMP workers keep libgomp's default wait (%s: %s)", type(e).__name__, e)
        return False
