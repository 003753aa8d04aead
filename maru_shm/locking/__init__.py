"""Locks: thread mutexes, the one timed wait, the pool's OFD record locks, and who may reach them.

guard: thread mutexes an exception never leaves held; lockwait: try, back off, give up; ofd: OFD record
locks, one fcntl per run of ids; locks: the lock table (dirty records, threads, lock order); access:
who may open a pool; lockfile: the lock file.
"""
