"""Per-process operation counters: counted in memory, published into this process's slot after each call.

The slot's counters are added to the retired totals when the slot is retired (FORMAT.md section 5), so
pool-wide figures survive processes that come and go.
"""

from __future__ import annotations

from .format import COUNTER_NAMES, N_COUNTERS

_POSITION = {name: i for i, name in enumerate(COUNTER_NAMES)}
_HITS, _MISSES, _BYTES_READ = _POSITION["hits"], _POSITION["misses"], _POSITION["bytes_read"]
_PUTS, _PUT_FAILURES, _BYTES_WRITTEN = _POSITION["puts"], _POSITION["put_failures"], _POSITION["bytes_written"]
_EVICTIONS, _EVICTED_BYTES = _POSITION["evictions"], _POSITION["evicted_bytes"]


class Counters:
    def __init__(self, procs, locks):
        self._procs = procs
        self._locks = locks
        self.values = [0] * N_COUNTERS

    def count(self, **counters: int) -> None:
        values = self.values
        for name, v in counters.items():
            values[_POSITION[name]] += v

    def count_put(self, puts: int, failures: int, evictions: int, evicted_bytes: int, written: int) -> None:
        """One put call's counters (the keyword form of `count` costs a microsecond on a single-key put)."""
        values = self.values
        values[_PUTS] += puts
        values[_PUT_FAILURES] += failures
        values[_EVICTIONS] += evictions
        values[_EVICTED_BYTES] += evicted_bytes
        values[_BYTES_WRITTEN] += written

    def count_get(self, length: int | None) -> None:
        """One single-key get (its length, None for a miss), counted and published at once: only the
        fields it changes are written, a third of a whole flush on the cheapest call of the store."""
        values = self.values
        if length is None:
            values[_MISSES] += 1
            self._procs.write_counter_pair(_MISSES, values[_MISSES])
        else:
            values[_HITS] += 1
            values[_BYTES_READ] += length
            self._procs.write_counter_pair(_HITS, values[_HITS], _BYTES_READ, values[_BYTES_READ])

    def flush(self) -> None:
        """Write the counters into our process slot (lock timeouts are the lock table's own count)."""
        self.values[_POSITION["lock_timeouts"]] = self._locks.timeouts
        self._procs.write_counters(self.values)
