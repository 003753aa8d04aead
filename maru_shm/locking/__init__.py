"""Locks: thread mutexes, the one timed wait, the pool's OFD record locks, and who may reach them.

guard: thread mutexes an exception never leaves held; lockwait: try, back off, give up; locks: the lock
table (OFD locks, dirty records, lock order); access: who may open a pool; lockfile: the lock file.
"""
