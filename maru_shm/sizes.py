"""Human sizes ("4G", "500M", 4096) to bytes and back."""

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(value) -> int:
    """Return bytes for an int or a string like "4G", "500M", "64KiB" (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if isinstance(value, str):
        m = _RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ValueError(f"not a size: {value!r} (use bytes or a number with K, M, G or T)")


def format_size(n: float) -> str:
    """Short binary-unit string: 131072 -> '128.0 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
