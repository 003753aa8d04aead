"""What a public call an exception ended (KeyboardInterrupt, a signal handler's exception, a lock timeout)
leaves behind, put right before the exception leaves the store (DESIGN.md section 9).

A live process is no dead one: nothing else would settle its blocks or repair its domains soon. A domain
whose lock the call left dirty may hold what a dead holder's would (victims an eviction unpublished and
had not freed yet: LIVE, unowned, unindexed), and its next holder may never come (a class nobody writes
any more): so the call settles its ledger, then is the next holder of every lock it left dirty.
"""

from __future__ import annotations

from ..format.layout import CLASS_LOCK_BASE, LOCK_POOL, SHARD_LOCK_BASE


def settle_cut_call(store) -> None:
    """Settle what the call's ledger still holds, as a reaper settles a dead slot's blocks (FORMAT.md section
    9), without asking the index about blocks it cannot name (a put that timed out on a shard lock frees its
    blocks at once). If that fails too (a lock timeout, a damaged pool), they stay held, by the kept blocks'
    strays, until close()."""
    kept = store._kept
    blocks, unindexed = kept.held_by_call()
    if not blocks:
        return
    try:
        if store._att.damage is not None:
            raise store._att.damage  # never write into a damaged mapping
        store._reaper.settle(store._procs.slot, blocks, kept.held_elsewhere, unindexed)
    except Exception:
        kept.to_strays(blocks)
    except BaseException:  # cut short itself (a second KeyboardInterrupt): what is left stays held
        kept.to_strays(blocks)
        raise


def repair_left_dirty(store) -> None:
    """Be the next holder of every lock whose record this process marked and nobody holds now, in lock order:
    its domain is repaired and its record cleared. A lock another holder has (another thread of ours inside
    its section, another process) is left to that holder; a repair that fails leaves the mark for the next."""
    if store._att.damage is not None:
        return  # never write into a damaged mapping
    locks = store.locks
    for lock_id in sorted(locks.marked_by_this_process(), key=_lock_order):
        dirty = locks.acquire(lock_id, blocking=False)
        if dirty is None:
            continue
        clean = False
        try:
            if dirty:
                _repair(store, lock_id)
            clean = True
        except Exception:
            pass
        finally:
            locks.release(lock_id, clean=clean)


def _lock_order(lock_id: int) -> tuple[int, int]:
    """CLASSTAB (and INIT, PROC), CLASS by id, POOL, SHARD by id (locks.py)."""
    if lock_id == LOCK_POOL:
        return 1, 0
    return (2 if lock_id >= SHARD_LOCK_BASE else 0), lock_id


def _repair(store, lock_id: int) -> None:
    """A lock's domain repair (FORMAT.md section 9); INIT, PROC and CLASSTAB have none."""
    if lock_id >= SHARD_LOCK_BASE:
        store._publisher.repair_shard_lock(lock_id)
    elif lock_id >= CLASS_LOCK_BASE:
        store.alloc.repair_class(lock_id - CLASS_LOCK_BASE)
    elif lock_id == LOCK_POOL:
        store.alloc.repair_pool()
