"""Human sizes ("4G", "500M", 4096) to bytes and back: the one parser and formatter of sizes."""

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_LADDER = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")  # binary units, smallest first
STYLES = ("fixed", "short", "exact")


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


def format_size(n: float, style: str = "fixed") -> str:
    """Bytes in the largest binary unit under 1024 of it (bytes always as a whole number), in one style:

    - "fixed" (messages and logs): one decimal, 131072 -> '128.0 KiB', 4480 -> '4.4 KiB'
    - "short" (tables and chart labels): three significant digits, 131072 -> '128 KiB', 4480 -> '4.38 KiB',
      whole units from 1000 on, 1047552 -> '1023 KiB'
    - "exact" (block sizes, where a rounded figure would hide the size): a whole number of the largest unit
      that divides it, else bytes with thousands separators, 16384 -> '16 KiB', 4480 -> '4,480 B'
    """
    if style == "exact":
        n = int(n)
        for i in range(len(_LADDER) - 1, 0, -1):
            if n >= 1024 ** i and n % 1024 ** i == 0:
                return f"{n // 1024 ** i} {_LADDER[i]}"
        return f"{n:,} B"
    if style not in STYLES:
        raise ValueError(f"unknown size style {style!r} (one of {', '.join(STYLES)})")
    n = float(n)
    unit = _LADDER[0]
    for unit in _LADDER:
        if abs(n) < 1024 or unit == _LADDER[-1]:
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    if style == "fixed":
        return f"{n:.1f} {unit}"
    return f"{n:.3g} {unit}" if abs(n) < 1000 else f"{n:.0f} {unit}"
