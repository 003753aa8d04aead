"""The calls in flight inside one Store, so that close() never unmaps under a copy.

A copy releases the GIL (ctypes.memmove, numpy, torch): another thread's close() that unmapped the pool
then would turn that copy into a SIGSEGV in the host process, and no signal may escape the store
(docs/FORMAT.md section 13). Every public call enters the fence; close() shuts it (no new call gets in: PoolClosedError) and waits for the calls inside
to leave before the mapping goes.

Entering costs two list operations and no lock: list.append and list.pop are atomic under the GIL, and a
call re-checks `shut` after counting itself in, so close() (which sets `shut` first, then waits for the
list to empty) never misses a call that got in.
"""

from __future__ import annotations

import time


class CallFence:
    def __init__(self) -> None:
        self._inside: list = []
        self.shut = False

    def enter(self) -> bool:
        """Count one more call inside; False once the fence is shut."""
        if self.shut:
            return False
        self._inside.append(None)
        if self.shut:
            self._inside.pop()
            return False
        return True

    def leave(self) -> None:
        self._inside.pop()

    def shut_and_wait(self, timeout: float) -> bool:
        """Let no new call in, then wait up to `timeout` s for those inside; True if none is left."""
        self.shut = True
        deadline = time.monotonic() + timeout
        while self._inside:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True
