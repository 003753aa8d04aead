"""The process table: one slot per attached process, proved alive by its SLOT lock (FORMAT.md section 10).

A slot is claimed under the PROC lock together with its SLOT lock, and both stay held while the process
lives; the kernel drops the SLOT lock when the process dies however it dies, which is what makes
liveness checkable without trusting pids. Reaping what a dead slot left behind is reaper.py.
"""

from __future__ import annotations

import os
import time

from .. import crashpoints as _cp
from ..mapping.attachment import Attachment
from ..errors import StoreError
from ..format.layout import (COUNTERS, HEALS_OFF, LOCK_PROC, PROC_COUNTERS_OFF, PROC_ENTRY, PROC_HEAD, RETIRED_OFF,
                             SLOT_LOCK_BASE, U64, store_u64)
from ..locking.ofd import ofd_is_held, ofd_trylock, ofd_unlock

_U64_MASK = 2**64 - 1


def start_ticks(pid: int) -> int:
    """Process start time in clock ticks (field 22 of /proc/<pid>/stat), 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class ProcessTable:
    """This process's slot (`slot`, -1 when detached) and the liveness of every other slot."""

    def __init__(self, att: Attachment):
        self.att = att
        self.slot = -1
        self.counters_at = -1  # file offset of our slot's counters (COUNTERS layout), -1 while detached

    @property
    def owner(self) -> int:
        """This process's owner id in block metas: slot + 1 (0 means unowned)."""
        return self.slot + 1

    def claimed(self, slot: int) -> bool:
        """Is table entry `slot` claimed (by a live process, or a dead one not yet reaped)?"""
        return PROC_HEAD.unpack_from(self.att.mm, self.att.geo.slot_of(slot))[0] != 0

    def try_claim(self) -> bool:
        """PROC held: claim the first free slot whose SLOT lock we can take; False if none."""
        att = self.att
        for slot in range(att.geo.proc_slots):
            if self.claimed(slot):
                continue
            if not ofd_trylock(att.locks.fd, SLOT_LOCK_BASE + slot):
                continue  # being reaped right now
            pid = os.getpid()
            o = att.geo.slot_of(slot)
            att.mm[o:o + PROC_ENTRY] = bytes(PROC_ENTRY)
            PROC_HEAD.pack_into(att.mm, o, 1, pid, start_ticks(pid), time.time_ns(), os.geteuid())
            self.slot = slot
            self.counters_at = o + PROC_COUNTERS_OFF
            att.locks.slot_plus1 = slot + 1
            if _cp.ARMED is not None:
                _cp.hit_lock("SLOT")
            return True
        return False

    def attach(self, reap) -> None:
        """Claim a slot; when every slot is claimed, `reap()` (returns slots reaped) and look once more."""
        for attempt in range(2):
            with self.att.locks.hold(LOCK_PROC):
                if self.try_claim():
                    return
            # Every slot is claimed: some claimants may be dead (reaping is lazy). Reap, then look again.
            if attempt or not reap():
                break
        raise StoreError(f"process table of {self.att.path} is full ({self.att.geo.proc_slots} slots); "
                         "detach idle processes or recreate the pool with more proc_slots")

    def retire(self, slot: int) -> None:
        """PROC held: add a slot's counters to the retired totals and free the slot."""
        mm, o = self.att.mm, self.att.geo.slot_of(slot)
        own = COUNTERS.unpack_from(mm, o + PROC_COUNTERS_OFF)
        total = COUNTERS.unpack_from(mm, RETIRED_OFF)
        COUNTERS.pack_into(mm, RETIRED_OFF, *[(a + b) & _U64_MASK for a, b in zip(total, own)])
        mm[o:o + PROC_ENTRY] = bytes(PROC_ENTRY)

    def count_heal(self) -> None:
        """One more process attached after losing its previous pool (FORMAT.md section 2, `heals`): under PROC,
        and written as one 8-byte store, so a reader without the lock sees the old count or the new one."""
        mm = self.att.mm
        with self.att.locks.hold(LOCK_PROC):
            store_u64(mm, HEALS_OFF, (U64.unpack_from(mm, HEALS_OFF)[0] + 1) & _U64_MASK)

    def detach(self, settle) -> None:
        """Give up our slot: `settle(slot)` what it still owns, retire it, drop its SLOT lock.

        If settling fails, the slot stays claimed without its SLOT lock, so the next reaper settles it.
        """
        if self.slot < 0:
            return
        try:
            settle(self.slot)
            with self.att.locks.hold(LOCK_PROC):
                self.retire(self.slot)
        finally:
            self.drop_slot_lock()

    def drop_slot_lock(self) -> None:
        """Release our SLOT lock without touching the table (a damaged mapping is never written)."""
        if self.slot >= 0:
            ofd_unlock(self.att.locks.fd, SLOT_LOCK_BASE + self.slot)
            self.slot = -1
            self.counters_at = -1

    def alive(self, owner_plus1: int) -> bool:
        """Is the process in slot owner_plus1 - 1 alive? Its SLOT lock is held exactly while it lives."""
        slot = owner_plus1 - 1
        if slot == self.slot:
            return True
        if not 0 <= slot < self.att.geo.proc_slots:
            return False
        return ofd_is_held(self.att.locks.fd, SLOT_LOCK_BASE + slot)

