"""Piece tables: the flattening every batch copy loop runs on (maru_shm/copying/pieces.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from maru_shm.copying.pieces import PieceTable, piece_lengths


def _lists(t, rows, bases):
    """PieceTable.into as (destination, source, nbytes) lists."""
    return tuple(a.tolist() for a in t.into(rows, bases))


def test_lists_and_array_give_the_same_table():
    lists = [[(1000, 5), (2000, 7)], [(3000, 3), (4000, 1)], [(5000, 0), (6000, 9)]]
    for t in (PieceTable.of(lists, 3), PieceTable.of(np.array(lists), 3)):
        assert t.lengths.tolist() == [12, 4, 9]
        assert t.within.tolist() == [0, 5, 0, 3, 0, 0]
        assert _lists(t, [0, 2], [10_000, 20_000]) == ([10_000, 10_005, 20_000, 20_000],
                                                       [1000, 2000, 5000, 6000], [5, 7, 0, 9])
        at, pieces, nb = _lists(t, [1], [700])  # copying value 1 out of memory at 700: into its pieces
        assert (pieces, at, nb) == ([3000, 4000], [700, 703], [3, 1])


def test_values_with_different_piece_counts():
    t = PieceTable.of([[(1, 4)], [], [(2, 1), (3, 2), (4, 3)]], 3)
    assert t.lengths.tolist() == [4, 0, 6]
    assert _lists(t, [2], [100]) == ([100, 101, 103], [2, 3, 4], [1, 2, 3])
    assert _lists(t, [1], [100]) == ([], [], [])


@pytest.mark.parametrize("bad", [[[(1, 8), (2, -4)]], np.array([[[1, 8], [2, -4]]])])
def test_a_negative_size_is_refused(bad):
    """A negative piece would shrink the value's length below the bytes its pieces copy: an overrun."""
    with pytest.raises(ValueError, match="negative"):
        PieceTable.of(bad, 1)
    with pytest.raises(ValueError, match="negative"):
        piece_lengths(bad)


def test_shape_mismatches_are_refused():
    with pytest.raises(ValueError):
        PieceTable.of(np.zeros((2, 3, 2), dtype=np.int64), 3)
    with pytest.raises(ValueError):
        PieceTable.of([[(1, 2)]], 2)


def test_scatter_copies_land_where_the_scalar_loop_puts_them():
    """Copying with the table's lists equals copying value by value, piece after piece."""
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (5, 11, 3, 8)]
    pieces = [[(src[0].ctypes.data, 5), (src[1].ctypes.data, 11)], [(src[2].ctypes.data, 3), (src[3].ctypes.data, 8)]]
    out = np.zeros(64, dtype=np.uint8)
    t = PieceTable.of(pieces, 2)
    for d, s, n in zip(*_lists(t, [0, 1], [out.ctypes.data, out.ctypes.data + 32])):
        ctypes.memmove(d, s, n)
    assert out[:16].tolist() == src[0].tolist() + src[1].tolist()
    assert out[32:43].tolist() == src[2].tolist() + src[3].tolist()
