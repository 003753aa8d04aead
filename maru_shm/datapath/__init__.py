"""The data path of a get and a put: lock-free reads, reserve-copy-commit-publish writes.

validity: when a lock-free hit is believable; resolve: batched lookups; readpath: copies out;
writepath: a put end to end; putbatch: its blocks between reservation and publication; publish:
everything under SHARD locks.
"""
