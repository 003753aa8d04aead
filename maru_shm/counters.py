"""Per-process operation counters: counted in memory, published into this process's slot after each call.

The slot's counters are added to the retired totals when the slot is retired (FORMAT.md section 5), so
pool-wide figures survive processes that come and go.
"""

from __future__ import annotations

from .format import COUNTER_NAMES, N_COUNTERS

_POSITION = {name: i for i, name in enumerate(COUNTER_NAMES)}


class Counters:
    def __init__(self, procs, locks):
        self._procs = procs
        self._locks = locks
        self.values = [0] * N_COUNTERS

    def count(self, **counters: int) -> None:
        values = self.values
        for name, v in counters.items():
            values[_POSITION[name]] += v

    def flush(self) -> None:
        """Write the counters into our process slot (lock timeouts are the lock table's own count)."""
        self.values[_POSITION["lock_timeouts"]] = self._locks.timeouts
        self._procs.write_counters(self.values)
