"""The boundary of every public Store call: admitted or refused, fenced, and put right when an exception
ends it.

A call is refused once its store is closed, damaged or inherited across fork(); while it runs it is
counted in the store's call fence (mapping/fence.py), so close() never unmaps under it. Whatever bytecode
an exception meets, the call leaves no lock or thread mutex held and no block untracked.
"""

from __future__ import annotations

import functools
import os
import weakref

from .errors import PoolClosedError
from .locking.guard import release_stranded as release_stranded_guards
from .processes.cutcall import repair_left_dirty, settle_cut_call

# Stores open in this process. A child made by fork() inherits them with the parent's process slot and
# kept blocks: using one there would act as the parent. The child marks them forked: every call raises
# PoolClosedError, and close() only drops the child's copies of the mapping and descriptors. (Its copies
# of the lock descriptions are gone already: locking/ofd.py drops them at the fork, so the parent's death
# releases its locks and slot even while the child lives.)
OPEN_STORES: "weakref.WeakSet" = weakref.WeakSet()


def _forget_stores_in_child() -> None:
    for store in list(OPEN_STORES):
        store._forked = True


os.register_at_fork(after_in_child=_forget_stores_in_child)


def public_call(method=None, *, owns_blocks: bool = False):
    """A public call: refused once the store is closed, damaged or inherited across fork(); counted in the
    call fence while it runs, so that close() waits for it before unmapping.

    An exception raised at any bytecode of it (KeyboardInterrupt, a signal handler's) leaves no lock of its
    own held (guard.release_stranded, LockTable.release_stranded), counts it out of the fence, and leaves
    no block untracked: a call that `owns_blocks` (a put, a delete) keeps a ledger of every block it makes
    ours (allocator/keptblocks.py), and what the ledger still holds when an exception ends the call is settled
    as a reaper settles a dead slot's blocks; then the call repairs every domain it left dirty (cutcall.py)."""
    if method is None:
        return functools.partial(public_call, owns_blocks=owns_blocks)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        locks, fence, token = self._att.locks, self._fence, object()
        before = locks.held_now()
        admitted = False
        try:
            if self._forked or not fence.enter(token):
                raise _refusal(self)
            admitted = True
            if owns_blocks:
                self._kept.begin()
            self._att.check_intact()
            result = method(self, *args, **kwargs)
            if self._att.faults.faults:  # a page vanished under this call: what it read or wrote is not to be trusted
                self._att.check_intact()
            return result
        except BaseException:
            release_stranded_guards()
            locks.release_stranded(before)
            if owns_blocks:
                settle_cut_call(self)
            if admitted and not before:
                repair_left_dirty(self)
            raise
        finally:
            # Counted out even when an exception lands here: a one-line `try:` runs its `finally:` whichever
            # of its bytecodes the exception meets, and leaving twice is leaving once.
            try: _leave_call(self, owns_blocks, token)
            finally: fence.leave(token)
    return call


def _leave_call(store, owns_blocks: bool, token) -> None:
    """A public call is over: its ledger closed, the call counted out of the fence."""
    if owns_blocks:
        store._kept.end()
    store._fence.leave(token)


def _refusal(store) -> PoolClosedError:
    """Why a call is refused: the store is closed, or was opened by the parent of this forked process."""
    if store._forked:
        return PoolClosedError("store was opened before fork() by the parent process; open the pool again in "
                               "this process (the slot, locks and kept blocks are the parent's)")
    return PoolClosedError("store is closed")
