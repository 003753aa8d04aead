"""The host's idle OpenMP workers sleep instead of spinning, on a node whose cores its schedulers share.

Why (#49, BENCHMARKS.md "At load"): torch runs its intra-op threads on GNU OpenMP (libgomp). After each
parallel region a worker spins before it sleeps: 300,000 polls by default, a few milliseconds, and a model
forward is hundreds of regions with Python between them, so the worker of a scheduler never sleeps. With
two schedulers and the DP controller on two cores, those spins take the cores the other scheduler's
forward needs: a decode step took 0.31 s instead of 0.12 s. libgomp throttles the spin to 1,000 polls once
the process manages more OpenMP threads than it has CPUs (`do_spin` in libgomp's config/linux/wait.h:
`gomp_managed_threads > gomp_available_cpus`). A second, long-lived thread that owns a team gets the process
there. HiCacheFile does this by accident (a torch copy on one of SGLang's storage threads); without it the
scheduler spins, whatever the L3.

The rule: when the process runs torch on libgomp with more than one thread and the user set neither
OMP_WAIT_POLICY nor GOMP_SPINCOUNT (those are read once, when libgomp loads, and win), one parked daemon
thread starts a team as large as the CPUs the process may use, then waits forever. Its workers sleep; the
process's threads stay the ones torch asked for. `maru_openmp_wait: spin` leaves libgomp's default.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

from .sync import Mutex

logger = logging.getLogger("maru_sglang")

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_lock = Mutex("openmpwait")
_parked_in: int | None = None  # the pid whose parked thread runs (a forked child has none)


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


def _park(gomp: ctypes.CDLL, team: int, started: threading.Event) -> None:
    import torch
    grain = 32768  # ATen's GRAIN_SIZE: a region of n elements gets at most n // grain threads
    try:
        torch.empty(grain * 2).fill_(0.0)  # ATen sets this thread's team size to torch's on its first region
        gomp.omp_set_num_threads(team)  # this thread's teams only (an ICV of its own)
        torch.empty(grain * team).fill_(0.0)
    finally:
        started.set()
    while True:  # parked for the process's life: its team must outlive every forward
        time.sleep(3600)


def let_idle_workers_sleep() -> bool:
    """Park one thread owning a team of every CPU, once per process. True if it runs (now or already).
    Never raises: the host runs as it would without it."""
    global _parked_in
    with _lock:
        if _parked_in == os.getpid():
            return True
        if _parked_in is not None:  # a fork: libgomp's teams do not survive it, and a new one could hang
            return False
        reason = why_not()
        if reason is not None:
            logger.info("maru: the host's idle OpenMP workers keep libgomp's default wait (%s)", reason)
            return False
        team = _cpus()
        try:
            gomp = ctypes.CDLL(_libgomp_path())
            started = threading.Event()
            threading.Thread(target=_park, args=(gomp, team, started), name="maru-openmp-park", daemon=True).start()
            started.wait(10.0)
        except Exception as e:
            logger.warning("maru: the host's idle OpenMP workers keep libgomp's default wait (%s: %s)",
                           type(e).__name__, e)
            return False
        _parked_in = os.getpid()
    logger.info("maru: the host's idle OpenMP workers now sleep instead of spinning (a parked team of %d; "
                "maru_openmp_wait: spin keeps libgomp's default)", team)
    return True
