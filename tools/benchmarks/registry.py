"""The scenario registry and what every scenario uses: progress, figures, scratch pools.

A scenario is a function(args) -> dict registered with @scenario(name); its result carries `figures`:
rows of ours, spread, peer, ratio, goal and met (see `figure`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

SCENARIOS = {}

class Progress:
    """One status line on stderr, redrawn in place with \\r; silent unless enabled (a terminal, no --json)."""

    def __init__(self, names: list[str], enabled: bool, stream=None):
        self.names, self.enabled = names, enabled
        self.stream = stream or sys.stderr
        self.i, self.t0, self._last = 0, time.monotonic(), 0.0

    def start(self, i: int) -> None:
        self.i = i
        self._last = 0.0
        self.update(0.0, force=True)

    def update(self, frac: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        n = len(self.names)
        overall = (self.i + max(0.0, min(1.0, frac))) / n
        bar = "#" * int(overall * 20)
        line = (f"bench [{bar:<20}] {overall * 100:3.0f}%  {self.i + 1}/{n} {self.names[self.i]}"
                f"{': ' + note if note else ''}  {now - self.t0:.0f}s")
        self.stream.write("\r" + line[:150] + "\x1b[K")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def progress_of(args):
    """The scenario's progress callback: progress(fraction of this scenario, note)."""
    p = getattr(args, "progress", None)
    return p.update if p is not None else (lambda frac, note="": None)


def figure(name: str, ours, peer=None, peer_name: str | None = None, *, unit: str = "", spread=None,
           peer_spread=None, goal: str | None = None, met: bool | None = None, better: str = "higher",
           **extra) -> dict:
    """One machine-readable row: ours (a median if timed) and its spread, the peer, their ratio, the goal.

    `ratio` is always ours / peer; `better` says which way wins ("higher" or "lower", e.g. a latency).
    """
    ratio = ours / peer if peer not in (None, 0) and ours is not None else None
    return {"name": name, "unit": unit, "ours": ours, "spread": list(spread) if spread is not None else None,
            "peer": peer, "peer_name": peer_name,
            "peer_spread": list(peer_spread) if peer_spread is not None else None,
            "ratio": ratio, "better": better, "goal": goal, "met": met, **extra}

def scenario(name):
    def deco(fn):
        SCENARIOS[name] = fn
        return fn
    return deco


def pool_path(tag: str) -> str:
    return os.path.join("/dev/shm", f"maru-bench-{os.getpid()}-{tag}")


def median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)
