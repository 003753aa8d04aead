"""Per-process operation counters: counted in memory, published into this process's slot after each call.

The slot is the process table's (`ProcessTable.counters_at`); what is written there, in COUNTERS order,
is this module's alone.

The slot's counters are added to the retired totals when the slot is retired (FORMAT.md section 10), so
pool-wide figures survive processes that come and go.
"""

from __future__ import annotations

import struct

from ..format.layout import COUNTERS, COUNTER_NAMES, COUNTER_SIZE, N_COUNTERS, U64

_POSITION = {name: i for i, name in enumerate(COUNTER_NAMES)}
_HITS, _MISSES, _BYTES_READ = _POSITION["hits"], _POSITION["misses"], _POSITION["bytes_read"]
_PUTS, _PUT_FAILURES, _BYTES_WRITTEN = _POSITION["puts"], _POSITION["put_failures"], _POSITION["bytes_written"]
_EVICTIONS, _EVICTED_BYTES = _POSITION["evictions"], _POSITION["evicted_bytes"]
_LOCK_TIMEOUTS = _POSITION["lock_timeouts"]
_U64_MASK = (1 << 64) - 1  # a counter past 2**64 wraps in the slot (the in-memory count goes on)


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
        at = self._procs.counters_at
        if length is None:
            values[_MISSES] += 1
            if at >= 0:
                U64.pack_into(self._procs.att.mm, at + COUNTER_SIZE * _MISSES, values[_MISSES] & _U64_MASK)
        else:
            values[_HITS] += 1
            values[_BYTES_READ] += length
            if at >= 0:
                mm = self._procs.att.mm
                U64.pack_into(mm, at + COUNTER_SIZE * _HITS, values[_HITS] & _U64_MASK)
                U64.pack_into(mm, at + COUNTER_SIZE * _BYTES_READ, values[_BYTES_READ] & _U64_MASK)

    def flush(self) -> None:
        """Publish the counters into our process slot, if we have one (every call of the store does; stats()
        reads them). Lock timeouts are the lock table's own count. No lock: only we write our slot."""
        values = self.values
        values[_LOCK_TIMEOUTS] = self._locks.timeouts
        at = self._procs.counters_at
        if at >= 0:
            try:
                COUNTERS.pack_into(self._procs.att.mm, at, *values)
            except struct.error:  # a count past 2**64 wraps in the slot
                COUNTERS.pack_into(self._procs.att.mm, at, *[v & _U64_MASK for v in values])
