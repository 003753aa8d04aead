"""Scatter/gather lists of a batch of values, flattened once for the copy loops.

A value is copied to or from caller memory as pieces: (address, nbytes)
pairs in order (SGLang's host pools describe a KV page as its K and V
parts, or one part per layer). Callers give them as a list per value, or,
for a batch of pages that all have the same number of pieces, as one
(n, pieces per value, 2) integer array, which is flattened without a Python
step per piece. Either way the sizes are checked once here: a negative size
would make a value's length smaller than the bytes its pieces copy, and the
copy would overrun its block.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np

Pieces = Sequence[tuple[int, int]]  # (address, nbytes) of one value's pieces, in order


class PieceTable:
    """Every piece of a batch: address, size and value, flat; and each value's length in bytes."""

    __slots__ = ("n", "addrs", "sizes", "value", "within", "lengths", "period")

    def __init__(self, addrs: np.ndarray, sizes: np.ndarray, value: np.ndarray, within: np.ndarray,
                 lengths: np.ndarray, period: int = 1):
        self.n = len(lengths)
        self.addrs, self.sizes, self.value, self.within, self.lengths = addrs, sizes, value, within, lengths
        self.period = period  # pieces per value when every value has as many (the copy plan's columns), else 1

    @classmethod
    def of(cls, pieces_list, n: int) -> "PieceTable":
        """From an (n, k, 2) array of [address, nbytes] rows, or a sequence of n lists of (address, nbytes)."""
        if isinstance(pieces_list, np.ndarray):
            if pieces_list.ndim != 3 or pieces_list.shape[0] != n or pieces_list.shape[2] != 2:
                raise ValueError(f"pieces array of shape {pieces_list.shape}; expected ({n}, pieces, 2)")
            if pieces_list.dtype.kind not in "iu":
                raise TypeError(f"pieces array of dtype {pieces_list.dtype}; expected integers")
            a = pieces_list.astype(np.int64, copy=False)
            _check_table(a.reshape(-1, 2))
            sizes = a[:, :, 1]
            ends = np.cumsum(sizes, axis=1)
            k = a.shape[1]
            return cls(a[:, :, 0].reshape(-1), sizes.reshape(-1), np.repeat(np.arange(n), k),
                       (ends - sizes).reshape(-1), ends[:, -1] if k else np.zeros(n, dtype=np.int64), max(1, k))
        if len(pieces_list) != n:
            raise ValueError(f"{len(pieces_list)} piece lists for {n} values")
        counts = [len(p) for p in pieces_list]
        flat = [x for p in pieces_list for pair in p for x in pair]
        a = np.array(flat).reshape(-1, 2) if flat else np.zeros((0, 2), dtype=np.int64)
        if a.dtype.kind not in "iu":
            raise TypeError("a piece must be (address, nbytes), two integers")
        a = a.astype(np.int64, copy=False)
        _check_table(a)
        sizes = a[:, 1]
        value = np.repeat(np.arange(n), counts)
        ends = np.cumsum(sizes)
        lengths = np.bincount(value, weights=sizes, minlength=n).astype(np.int64)
        starts = np.cumsum(lengths) - lengths  # where each value's pieces begin in the running total
        period = counts[0] if counts and counts[0] and counts.count(counts[0]) == n else 1
        return cls(a[:, 0], sizes, value, ends - sizes - starts[value], lengths, period)

    def into(self, rows, bases) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destination, source, nbytes) int64 arrays, for copying values `rows` into memory at `bases`."""
        base = np.full(self.n, -1, dtype=np.int64)
        base[np.asarray(rows, dtype=np.int64)] = bases
        per = base[self.value]
        sel = np.flatnonzero(per >= 0)
        return per[sel] + self.within[sel], self.addrs[sel], self.sizes[sel]


def _check_table(a: np.ndarray) -> None:
    """Rows of [address, nbytes]: a size is never negative, and a piece of any size has an address."""
    if a.size and (int(a[:, 1].min()) < 0 or bool(((a[:, 0] <= 0) & (a[:, 1] > 0)).any())):
        raise ValueError("a piece has a negative size or a null address")


def piece_lengths(pieces_list) -> list[int]:
    """Length in bytes of each value (the small-batch paths, which do not build a table).

    Pieces are raw pointers: an address that is an integer but not memory of this process cannot be
    detected and will crash the process (ctypes.memmove). What is checked is what can be: both are
    integers (ctypes would take a str or bytes as a pointer to its own buffer), a size is not negative,
    an address is not null.
    """
    if isinstance(pieces_list, np.ndarray):
        return PieceTable.of(pieces_list, len(pieces_list)).lengths.tolist()
    out = []
    for p in pieces_list:
        n = 0
        for addr, nb in p:
            if type(addr) is not int or type(nb) is not int:
                addr, nb = _as_ints(addr, nb)
            if nb < 0 or (addr <= 0 and nb):
                raise ValueError("a piece has a negative size or a null address")
            n += nb
        out.append(n)
    return out


def _as_ints(addr, nb) -> tuple[int, int]:
    try:
        return operator.index(addr), operator.index(nb)
    except TypeError:
        raise TypeError(f"a piece must be (address, nbytes), two integers; got ({addr!r}, {nb!r})") from None
