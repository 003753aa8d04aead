"""How many cores the copy engine may use now: the policy that sizes its threads.

Extra copy threads help only on idle cores. On a busy core a worker is descheduled between two pieces,
possibly holding the GIL, and stalls the caller too: measured here with one busy process per core, two
copy threads ran at 0.7 of one. Worse, in an SGLang scheduler the busy cores are often the process's own:
its model forward runs an OpenMP team on them, whose barriers wait for any member a copy thread
displaced. So before a batch the engine asks how many of the cores it may run on (its affinity) were idle
lately, counting as busy everything but the engine's own copying: the kernel's per-CPU busy time
(/proc/stat) of those cores, less the CPU time the engine spent copying (`copy_seconds`), sampled at most
every INTERVAL seconds over the time since the previous sample.
"""

from __future__ import annotations

import os
import time
from typing import Callable

INTERVAL = 0.2      # seconds between two readings of /proc/stat
HEADROOM = 0.5      # free cores are rounded to the nearest whole core


def _busy_seconds(cpus: frozenset[int]) -> float | None:
    """CPU seconds spent busy since boot by the cores in `cpus`, or None without /proc/stat."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read(1 << 20).split(b"\n")
    except OSError:
        return None
    busy = 0
    seen = False
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        fields = line.split()
        try:
            cpu = int(fields[0][3:])
            ticks = [int(x) for x in fields[1:9]]
        except (ValueError, IndexError):
            return None
        if cpu in cpus and len(ticks) >= 5:
            busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
            seen = True
    return busy / os.sysconf("SC_CLK_TCK") if seen else None


def _allowed() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class IdleCores:
    """Cores free for the copy engine: those of its affinity that nothing but its own copying kept busy."""

    def __init__(self, copy_seconds: Callable[[], float] = lambda: 0.0):
        self.cpus = _allowed()
        self.allowed = len(self.cpus)
        self._copy_seconds = copy_seconds
        self._at = 0.0
        self._busy = self._own = 0.0
        self._free = self.allowed

    def free(self) -> int:
        """Whole cores left idle by everything but our copies since the last reading (at least 1: the caller's)."""
        now = time.monotonic()
        if now - self._at < INTERVAL:
            return self._free
        busy = _busy_seconds(self.cpus)
        own = self._copy_seconds()
        if busy is None:
            self._at = now
            return self._free
        if self._at:
            window = now - self._at
            others = max(0.0, (busy - self._busy) - (own - self._own)) / window  # cores' worth, not our copies'
            self._free = max(1, min(self.allowed, int(self.allowed - others + HEADROOM)))
        self._at, self._busy, self._own = now, busy, own
        return self._free


__all__ = ["IdleCores"]
