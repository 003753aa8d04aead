"""How a mapped record of the pool file is declared: once, as a numpy structured dtype of its fields in
file order (reserved bytes included), from which every offset, size, struct and column is derived.

layout.py declares the records (docs/FORMAT.md's tables); the code reads them through what is derived
here, never through an offset written by hand.
"""

from __future__ import annotations

import struct

import numpy as np


def record(size: int, *fields) -> np.dtype:
    """A record of `size` bytes: `fields` are (name, numpy type) in file order, packed."""
    dt = np.dtype(list(fields))
    if dt.itemsize != size:
        raise AssertionError(f"record fields take {dt.itemsize} bytes, not {size}")
    return dt


def field_off(layout: np.dtype, name: str) -> int:
    """Byte offset of a field within its record."""
    return layout.fields[name][1]


def field_size(layout: np.dtype, name: str) -> int:
    """Bytes of a field."""
    return layout.fields[name][0].itemsize


def field_column(layout: np.dtype, name: str, width: int) -> int:
    """Column of a field in a view of the records as rows of `width`-byte words (numpy batch passes)."""
    off = field_off(layout, name)
    if off % width or field_size(layout, name) % width:
        raise AssertionError(f"field {name} is not a whole number of {width}-byte words")
    return off // width


_STRUCT_CODES = {"<u8": "Q", "<u4": "I", "<u2": "H", "|u1": "B"}


def record_struct(layout: np.dtype, first: str, last: str) -> struct.Struct:
    """The struct of the fields `first` .. `last` of a record (contiguous, in file order, reserved bytes as
    pad bytes): the scalar form of the declaration, for the code that reads a few fields at a time."""
    names = list(layout.names)
    fmt, end = "<", field_off(layout, first)
    for name in names[names.index(first):names.index(last) + 1]:
        t, off = layout.fields[name][:2]
        if t.subdtype is not None:
            code = "%d%s" % (t.shape[0], _STRUCT_CODES[t.subdtype[0].str])
        elif t.kind == "S":
            code = "%ds" % t.itemsize
        elif t.kind == "V":
            code = "%dx" % t.itemsize
        else:
            code = _STRUCT_CODES[t.str]
        if off != end:
            raise AssertionError(f"fields {first} .. {last} are not in file order")
        fmt, end = fmt + code, off + t.itemsize
    return struct.Struct(fmt)
