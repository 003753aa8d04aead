"""Argument types of the command line and the benchmarks: each turns one option's text into its value or
an argparse error naming what is wrong (the one reading of a size, a size list, a mode, a duration)."""

from __future__ import annotations

import argparse


def size(text: str) -> int:
    """A size: "4G", "512M", 4096 (maru_shm.parse_size, the one parser of sizes)."""
    from maru_shm import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sizes(text: str) -> list[int]:
    """Comma-separated sizes, in the order given: "256M,512M,1G"."""
    return [size(x) for x in text.split(",") if x.strip()]


def octal_mode(text: str) -> int:
    """A file mode in octal: "0660"."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r} (e.g. 0660)") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"mode out of range: {text!r}")
    return mode


def positive_float(text: str) -> float:
    """A number of seconds, more than zero."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v
