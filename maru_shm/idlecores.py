"""How many cores this process may use now: the policy that sizes the copy engine's threads.

Extra copy threads help only on idle cores. On a busy core a worker is descheduled between two pieces,
possibly holding the GIL, and stalls the caller too: measured here with one busy process per core, two
copy threads ran at 0.7 of one. So before each batch the engine asks how many cores the rest of the
machine leaves free, from the CPU time the kernel counts (/proc/stat) minus this process's own
(os.times), sampled at most every INTERVAL seconds over the time since the previous sample.
"""

from __future__ import annotations

import os
import time

INTERVAL = 0.2      # seconds between two readings of /proc/stat
HEADROOM = 0.5      # free cores are rounded to the nearest whole core


def _machine_busy_seconds() -> tuple[float, int] | None:
    """(CPU seconds spent busy by every core since boot, number of cores), or None without /proc/stat."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read(1 << 16).split(b"\n")
    except OSError:
        return None
    fields = lines[0].split()
    if len(fields) < 6 or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    ncpu = sum(1 for line in lines[1:] if line.startswith(b"cpu"))
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), max(1, ncpu)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class IdleCores:
    """Cores free for this process: its affinity, less what other processes kept busy lately."""

    def __init__(self):
        try:
            self.allowed = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.allowed = os.cpu_count() or 1
        self._at = 0.0
        self._busy = self._own = 0.0
        self._free = self.allowed

    def free(self) -> int:
        """Whole cores that other processes left idle since the last reading (at least 1: the caller's)."""
        now = time.monotonic()
        if now - self._at < INTERVAL:
            return self._free
        sample = _machine_busy_seconds()
        own = _own_seconds()
        if sample is None:
            self._at = now
            return self._free
        busy, ncpu = sample
        if self._at:
            window = now - self._at
            others = max(0.0, (busy - self._busy) - (own - self._own)) / window  # cores' worth, not ours
            self._free = max(1, min(self.allowed, int(ncpu - others + HEADROOM)))
        self._at, self._busy, self._own = now, busy, own
        return self._free


__all__ = ["IdleCores"]
