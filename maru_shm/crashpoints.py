"""Deterministic crash points: kill -9 this process at a named instruction, for crash-recovery tests.

Set the environment variable ``MARU_SHM_CRASH_AT`` to ``name`` or ``name:N``
before the process starts: the N-th time (default 1) that the process reaches
the point `name`, it sends itself SIGKILL. Nothing runs after that instruction
(no ``finally``, no ``atexit``, no lock release but the kernel's), exactly as if
an operator had typed ``kill -9`` at that moment. Only hits of the armed point
count towards N.

The variable is read once, when this module is imported. When it is unset,
``ARMED`` is None and every hook in the code is a single ``is not None`` test
(the write path copies ``ARMED`` into a local first). An unknown point name, or
an N that is not a positive integer, raises ValueError at import: a typo must
not silently test nothing.

The points, and the row of the crash table in docs/FORMAT.md (section 9) each
one exercises:

==========================  ==========================================================  ==========================
point                       where the process dies                                      crash-table row
==========================  ==========================================================  ==========================
``put.after_alloc``         a put has RESERVED its blocks (CLASS lock released), before  after reserving, before
                            copying anything                                             commit
``alloc.mid_reuse``         a put reusing a block its process kept (an overwritten     after reserving, before
                            block) has bumped its word to RESERVED, before rewriting    commit
                            digest and length (no lock held)
``put.mid_copy``            after each source piece is copied into a RESERVED block     after reserving, before
                            (N counts pieces: a two-piece put dies half copied)          commit
``put.before_index``        every block of the put is committed (LIVE, owned), before   after commit, before
                            the first shard lock                                         publish
``index.mid_insert``        SHARD held: a new entry's word is stored (published), the   after publish, before
                            shard count is not yet updated                               clearing owner
``index.mid_replace``       SHARD held: an overwrite has stored the new offset in the   torn replace (new offset,
                            entry but not the new word                                   old word)
``put.before_disown``       SHARD held: the entry is in the index, the block's owner    after publish, before
                            is not yet cleared                                           clearing owner
``put.before_free``         after publishing, before freeing the replaced/evicted        after unpublish, before
                            blocks (owned by this process, not indexed)                  free
``delete.before_free``      a delete has unpublished its entry (SHARD released), before  after unpublish, before
                            freeing the block under the class lock                       free
``index.mid_shift``         SHARD held: a backward-shift delete has copied one entry    mid backward shift
                            into the hole, the source is not yet emptied
``evict.mid``               CLASS + POOL held: slab CLOCK eviction has unpublished the   orphan (LIVE, unowned,
                            first LIVE block of a slab, before freeing it and before     unindexed) + formatting or
                            returning the slab's units (also reached, with CLASS held    freeing a slab
                            only, by eviction within a class: evict.block_mid's path)
``evict.block_mid``         CLASS held: eviction within a class (block CLOCK) has         after unpublish, before
                            unpublished its victims (one round of shard locks) and      free / orphan (LIVE,
                            freed the first N of them; the rest are LIVE, unowned,      unowned, unindexed)
                            unindexed (more than 8 victims: all words FREE, bitmaps
                            and counts not yet updated)
``slab.mid_move``           CLASS + POOL held: a slab of another class was evicted (its  formatting or freeing a
                            units are FREE), the new slab is not yet formatted           slab
``slab.mid_format``         CLASS + POOL held: a new slab's TAILs and then its HEAD are  formatting or freeing a
                            written, its slab count and partial list are not             slab
``slab.mid_free``          CLASS + POOL held: an evicted slab's HEAD is FREE, its TAIL   formatting or freeing a
                            entries are not (they point at a unit that is no HEAD)       slab
``reap.mid``                settling a dead slot's blocks: the first one is settled,     reaper dies mid-reap
                            the CLASS lock is held, the slot is not yet retired
``classtab.mid_declare``    CLASSTAB held: an exact-fit class entry is complete (kind   class declaration
                            written), ``classes_version`` not yet bumped
``create.lock_file``        a creator has made the lock file (O_EXCL), before INIT       creating: the lock file
                                                                                         made, before INIT
``init.mid_header``         INIT held: a creator has written magic and the superblock   creating: building the
                            body (of its temporary file, or in place), the class table  pool; formatting in place
                            and ``state = ready`` are not written
``create.before_publish``   INIT held: the pool is built, READY, under its temporary    creating: building the
                            name, not yet at its path                                   pool
``create.published``        INIT held: the pool is at its path                          creating: published
``lock.held.INIT``          right after taking INIT (opening or creating a pool)        holding any lock
``lock.held.PROC``          right after taking PROC (N=1: attach, N=2: detach)          holding any lock
``lock.held.CLASSTAB``      right after taking CLASSTAB (``declare_size``)              holding any lock
``lock.held.POOL``          right after taking POOL (formatting a new slab)             holding any lock
``lock.held.CLASS``         right after taking any CLASS[c] (allocate, free, reap)      holding any lock
``lock.held.SHARD``         right after taking any SHARD[s] (publish, delete, repair)   holding any lock
``lock.held.SLOT``          right after claiming a process slot at attach (its SLOT     holding any lock
                            lock held, PROC too), or taking a dead slot's SLOT lock
                            to reap it
==========================  ==========================================================  ==========================

``lock.held.*`` fire inside ``LockTable.acquire`` after the dirty record is
written (and for INIT and SLOT, which are plain OFD locks, right after the
trylock succeeds), so they test the dirty-lock repair of each domain.

tests/maru_shm/test_crashpoints.py has one test per point.
"""

from __future__ import annotations

import os
import signal

ENV = "MARU_SHM_CRASH_AT"

POINTS = (
    "put.after_alloc",
    "alloc.mid_reuse",
    "put.mid_copy",
    "put.before_index",
    "index.mid_insert",
    "index.mid_replace",
    "put.before_disown",
    "put.before_free",
    "delete.before_free",
    "index.mid_shift",
    "evict.mid",
    "evict.block_mid",
    "slab.mid_move",
    "slab.mid_format",
    "slab.mid_free",
    "reap.mid",
    "classtab.mid_declare",
    "create.lock_file",
    "init.mid_header",
    "create.before_publish",
    "create.published",
    "lock.held.INIT",
    "lock.held.PROC",
    "lock.held.CLASSTAB",
    "lock.held.POOL",
    "lock.held.CLASS",
    "lock.held.SHARD",
    "lock.held.SLOT",
)


def parse(value: str) -> tuple[str, int]:
    """``name`` or ``name:N`` -> (name, N); ValueError for an unknown point or a bad N."""
    name, sep, count = value.strip().partition(":")
    n = 1
    if sep:
        try:
            n = int(count)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV}={value!r}: the count after ':' must be a positive integer")
    if name not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown crash point {name!r}; known points: {', '.join(POINTS)}")
    return name, n


ARMED: str | None = None  # the armed point's name; None (the hot-path test) when MARU_SHM_CRASH_AT is unset
_remaining = 0


def _arm_from_env() -> None:
    global ARMED, _remaining
    value = os.environ.get(ENV)
    if value:
        ARMED, _remaining = parse(value)


def hit(name: str) -> None:
    """The process reached point `name` (callers test ``ARMED is not None`` first): die if it is due."""
    global _remaining
    if name != ARMED:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
        while True:  # SIGKILL is delivered before kill() returns to a single-threaded caller; never go on
            signal.pause()


def hit_lock(kind: str) -> None:
    """A lock of `kind` (INIT, PROC, CLASSTAB, POOL, CLASS, SHARD, SLOT) was just taken."""
    if ARMED is not None and ARMED.startswith("lock.held."):
        hit("lock.held." + kind)


_arm_from_env()
