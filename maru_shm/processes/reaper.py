"""Reaping: settle what a dead process left behind, and free its slot (FORMAT.md sections 9 and 10).

A slot is dead when its entry is claimed and its SLOT lock can be taken. The reaper takes that lock
(so two reapers never settle one slot), hands the blocks whose meta names the slot as owner to the
allocator (`resolve_owned`: unpublished blocks are freed, published ones disowned), then retires the
slot under PROC.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import LOCK_PROC, META_OWNER_OFF, META_SIZE, SLOT_LOCK_BASE
from ..locking.ofd import ofd_trylock, ofd_unlock


class Reaper:
    def __init__(self, att, procs, counters):
        self.att, self.procs, self.counters = att, procs, counters

    def reap_dead(self) -> int:
        """Reclaim the slots and unpublished blocks of processes that died; returns slots reaped."""
        att, procs = self.att, self.procs
        reaped = 0
        for slot in range(att.geo.proc_slots):
            if slot == procs.slot or not procs.claimed(slot):
                continue
            if not ofd_trylock(att.locks.fd, SLOT_LOCK_BASE + slot):
                continue  # alive (or being reaped by someone else)
            try:
                if _cp.ARMED is not None:
                    _cp.hit_lock("SLOT")
                if not procs.claimed(slot):
                    continue
                self._reap_slot(slot)
                reaped += 1
            finally:
                ofd_unlock(att.locks.fd, SLOT_LOCK_BASE + slot)
        return reaped

    def _reap_slot(self, slot: int) -> None:
        self.settle(slot)
        with self.att.locks.hold(LOCK_PROC):
            self.procs.retire(slot)
        self.counters.count(repairs=1)

    def settle(self, slot: int, blocks=None, busy=None, unindexed=frozenset()) -> None:
        """Hand the blocks `slot` still owns to the allocator: every one (a dead slot's; our own, when we
        detach), or only those at `blocks` (what a call that an exception ended still held: calls.public_call),
        but for those `busy(offset)` says another holder in this process has; `unindexed` ones no index
        entry can name."""
        self.att.alloc.resolve_owned(self.owned_blocks(slot) if blocks is None else blocks, slot + 1, busy,
                                     unindexed)

    def owned_blocks(self, slot: int) -> list[int]:
        """Data offsets of the blocks whose meta names `slot` as owner."""
        att = self.att
        geo, alloc = att.geo, att.alloc
        owners = np.ndarray((geo.n_granules,), dtype="<u2", buffer=att.mm,
                            offset=geo.off_blockmeta + META_OWNER_OFF, strides=(META_SIZE,))
        try:
            granules = np.flatnonzero(owners == slot + 1)
        finally:
            del owners
        blocks = []
        for g in granules.tolist():
            # a block starts in this granule; recover its exact offset from its slab
            h, info = alloc.head_of(g * geo.granule)
            if info is None:
                continue
            rel = g * geo.granule - geo.unit_offset(h)
            i = -(-rel // info.block)
            off = geo.block_offset(h, i, info.block)
            if off // geo.granule == g:
                blocks.append(off)
        return blocks
