"""The calls in flight inside one Store, so that close() never unmaps under a copy.

A copy releases the GIL (ctypes.memmove, numpy, torch): another thread's close() that unmapped the pool
then would turn that copy into a SIGSEGV in the host process, and no signal may escape the store
(docs/DESIGN.md section 10). Every public call enters the fence; close() shuts it (no new call gets in: PoolClosedError) and waits for the calls inside
to leave before the mapping goes.

Each call is counted in under a token of its own, and entering or leaving is one dict operation (atomic
under the GIL, no lock); a call re-checks `shut` after counting itself in, so close() (which sets `shut`
first, then waits for the calls to leave) never misses a call that got in. Leaving with a token that is
not inside changes nothing: a call that an exception (KeyboardInterrupt) may have cut short anywhere in
its entry or its exit leaves again, and is never counted in forever (close() would wait out its limit).
"""

from __future__ import annotations

import time


class CallFence:
    def __init__(self) -> None:
        self._inside: dict = {}  # token -> None, one per call inside
        self.shut = False

    def enter(self, token) -> bool:
        """Count the call under `token` in; False once the fence is shut."""
        if self.shut:
            return False
        self._inside[token] = None
        if self.shut:
            self._inside.pop(token, None)
            return False
        return True

    def leave(self, token) -> None:
        """Count the call under `token` out, if it is in."""
        self._inside.pop(token, None)

    def shut_and_wait(self, timeout: float) -> bool:
        """Let no new call in, then wait up to `timeout` s for those inside; True if none is left."""
        self.shut = True
        deadline = time.monotonic() + timeout
        while self._inside:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True
