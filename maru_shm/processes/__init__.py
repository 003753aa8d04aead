"""The processes that share a pool: who is attached, what a dead one or a cut-short call left behind.

proctable: one slot per process, proved alive by its SLOT lock; reaper: settling a dead process's blocks;
counters: per-process operation counters; cutcall: what a call an exception ended leaves, put right.
"""
