"""The pool file and this process's mapping of it.

creation: building a pool across its lock file and pool file; poolfile: opening and mapping it;
attachment: the mapping and the views every part reads it through; faultguard: a SIGBUS in the mapping
as an error; fence: the calls in flight, so close() never unmaps under a copy.
"""
