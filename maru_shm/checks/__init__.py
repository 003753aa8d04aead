"""Looking at a whole pool from outside the data path: the check, the repair, the read-only view.

check: the consistency check of a live pool (read-only); repair: whole-pool repair; rules: what both
share; view: a pool mapped read-only, never attached; figures: what inspect, watch and stats show,
computed without taking locks.
"""
