"""The command line's grammar: every `maru-shm` command, its options and their types (docs/CLI.md).

cli.py runs the command the parser names; the options' defaults for creating a pool are read from
Store.open, so the command cannot drift from the library.
"""

from __future__ import annotations

import argparse

from . import argtypes

PROG = "maru-shm"
PLAN_KNOBS = ("granule", "unit_size", "max_value", "index_slots", "index_shards", "proc_slots", "value_size")


def open_defaults() -> dict:
    """Store.open's defaults for the creation knobs (so the command cannot drift from the library)."""
    import inspect as pyinspect

    from maru_shm import Store
    return {k: p.default for k, p in pyinspect.signature(Store.open).parameters.items() if k in PLAN_KNOBS}


def build_parser() -> argparse.ArgumentParser:
    from maru_shm import __version__
    p = argparse.ArgumentParser(
        prog=PROG, description="Look inside, check and manage a maru_shm shared-memory pool file.",
        epilog="exit status: 0 ok; 1 problems found (check) or refused (destroy with live processes); "
               "2 could not run (not a pool, no such file, permission, bad arguments). See docs/CLI.md.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("create", help="create a pool file ahead of time",
                       description="Create and initialise a pool (a regular file, or a DAX device in place).")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--size", type=argtypes.size, help="pool size, e.g. 4G, 512M (required for a regular file)")
    c.add_argument("--mode", type=argtypes.octal_mode, default=0o600, help="octal file mode (default 0600), e.g. 0660")
    d = open_defaults()
    c.add_argument("--value-size", type=argtypes.size, help="smallest value (KV page) to hold densely: the granule "
                                                        "and the index are sized for it unless given")
    c.add_argument("--granule", type=argtypes.size, help="smallest block (default 4K, or below a smaller --value-size)")
    c.add_argument("--unit-size", type=argtypes.size, help="slab unit (default 256K, at most 256 granules)")
    c.add_argument("--max-value", type=argtypes.size, help=f"largest value (default {d.get('max_value')})")
    c.add_argument("--index-slots", type=int, help="index slots, rounded up to a power of two (default: one "
                                                   "per 16 KiB of data, more for a smaller --value-size)")
    c.add_argument("--index-shards", type=int, help=f"index shards, a power of two (default {d.get('index_shards')})")
    c.add_argument("--proc-slots", type=int, help=f"process table slots (default {d.get('proc_slots')})")
    c.add_argument("--eviction", choices=("count", "age"), default="count",
                   help="the pool's ref rule: count (the CLOCK, default; a hybrid model's) or age (age stamps: "
                        "what MaruStorage creates for a plain model)")

    i = sub.add_parser("inspect", help="show geometry, size classes, index, processes and counters",
                       description="Show what is inside a pool, read-only, without attaching to it or taking "
                                   "any lock.")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--json", action="store_true", help="print one JSON object (keys in docs/CLI.md)")

    k = sub.add_parser("check", help="full consistency check (exit 1 if problems are found)",
                       description="Verify every rule of docs/FORMAT.md, one lock domain at a time: read-only, "
                                   "writers keep working. What exited processes left for the next opener to "
                                   "reap is reported as a note. With --repair, reap, rebuild derived state "
                                   "and free orphans while holding every lock, then check again.")
    k.add_argument("path", metavar="PATH")
    k.add_argument("--repair", action="store_true", help="repair what the check finds")
    k.add_argument("--timeout", type=argtypes.positive_float, default=10.0,
                   help="seconds to wait for each lock (default 10)")

    w = sub.add_parser("watch", help="live view of the inspect summary",
                       description="Refresh the inspect summary in place (read-only; Ctrl-C to quit). When the "
                                   "output is not a terminal, print one summary per interval.")
    w.add_argument("path", metavar="PATH")
    w.add_argument("--interval", type=argtypes.positive_float, default=1.0, help="seconds between refreshes (default 1)")
    w.add_argument("--count", type=int, default=0, help="stop after N refreshes (default: until Ctrl-C)")
    w.add_argument("--json", action="store_true", help="print one JSON object per refresh, one per line")

    d = sub.add_parser("destroy", help="remove a pool (refuses while live processes are attached)",
                       description="Unlink a pool file (a DAX device: zero its superblock). Refuses, exit 1, "
                                   "while live processes are attached unless --force.")
    d.add_argument("path", metavar="PATH")
    d.add_argument("--force", action="store_true",
                   help="destroy even with live processes attached, or with a damaged header")
    d.add_argument("--timeout", type=argtypes.positive_float, default=5.0,
                   help="seconds to wait for the process-table lock (default 5)")

    sub.add_parser("bench", help="run the benchmarks (tools/benchmarks/; arguments are passed to it)", add_help=False)
    return p
