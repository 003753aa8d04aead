"""Looking at a whole pool from outside the data path: the check, the repair, the read-only view.

check: the consistency check of a live pool (read-only); repair: whole-pool repair; rules: what both
share; view: read-only figures about a pool, computed without taking locks.
"""
