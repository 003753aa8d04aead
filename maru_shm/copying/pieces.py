"""Scatter/gather lists of a batch of values, flattened once for the copy loops.

A value is copied to or from caller memory as pieces: (address, nbytes)
pairs in order (SGLang's host pools describe a KV page as its K and V
parts, or one part per layer). Callers give them as a list per value, or,
for a batch of pages that all have the same number of pieces, as one
(n, pieces per value, 2) integer array, which is flattened without a Python
step per piece. Either way the sizes are checked once here: a negative size
would make a value's length smaller than the bytes its pieces copy, and the
copy would overrun its block. A Python buffer becomes one piece (`buffer_address`), never through a
silent copy.
"""

from __future__ import annotations

import ctypes
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


def buffer_address(buf, writable: bool) -> tuple[int, int, object]:
    """(address, nbytes, keepalive) of a C-contiguous buffer; anything else is refused.

    Never a silent copy: reshaping a non-contiguous array (a column slice, Fortran order) makes one, and a
    value loaded into it would be lost while the call reported a hit. `bytes` find their payload at a fixed
    distance from id() (measured against ctypes at import, `_bytes_payload_offset`); other writable
    buffers take ctypes' `from_buffer` (a fifth of numpy's cost), which refuses a non-contiguous one itself.
    """
    if type(buf) is bytes and not writable:
        return (id(buf) + _BYTES_PAYLOAD if _BYTES_PAYLOAD is not None else _bytes_address(buf)), len(buf), buf
    try:
        view = memoryview(buf)
    except TypeError:
        view = None
    if view is not None and view.nbytes and not view.readonly:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes, view
        except TypeError:
            pass  # not C-contiguous: numpy below says so
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as e:
            raise TypeError(f"expected a C-contiguous buffer (bytes, bytearray, memoryview, numpy array): {e}") from None
    if not arr.flags.c_contiguous:
        raise TypeError("buffer must be C-contiguous (not a strided slice or a Fortran-order array); "
                        "pass np.ascontiguousarray(...) and copy back")
    if writable and not arr.flags.writeable:
        raise TypeError("destination buffer is read-only")
    arr = arr.reshape(-1).view(np.uint8)
    return arr.ctypes.data, arr.nbytes, arr


def writable_bytes(buf) -> memoryview:
    """A writable 1-D byte view of a C-contiguous buffer, for the single-key gets that copy into it by
    slice assignment; anything else is refused with buffer_address's errors (never a silent copy)."""
    try:
        view = memoryview(buf)
    except TypeError:
        view = None
    if view is not None and not view.readonly and view.c_contiguous:
        return view if view.ndim == 1 and view.format == "B" else view.cast("B")
    _, _, arr = buffer_address(buf, writable=True)  # raises, or gives a uint8 array over buf's bytes
    return memoryview(arr).cast("B")


def _bytes_address(b: bytes) -> int:
    """Address of an immutable bytes object's payload (valid while `b` lives)."""
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value or 0


def _bytes_payload_offset() -> int | None:
    """Where this interpreter keeps a bytes object's payload from its id(), measured against ctypes on two
    objects; None where id() is not an address. With it a put of bytes finds its source without
    ctypes.cast, a fiftieth of a 4 KiB put."""
    samples = (b"maru-shm bytes payload", bytes(range(256)) * 3)
    offsets = {_bytes_address(b) - id(b) for b in samples}
    return offsets.pop() if len(offsets) == 1 else None


_BYTES_PAYLOAD = _bytes_payload_offset()
