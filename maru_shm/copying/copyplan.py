"""A batch of raw copies planned as few calls: evenly strided runs of pieces become one 2-D numpy copy each.

Why: a batch of 128 KiB pages is 256 pieces of 64 KiB (each page's K and V). One `ctypes.memmove` per
piece holds the GIL between pieces, so two copy threads pass the GIL back and forth after every piece and
run slower than one. But the pieces of a batch are regular: page i's K lies at a fixed distance from page
i-1's on both sides (consecutive blocks of a slab; consecutive pages of SGLang's host pool). Such a run is
one numpy copy of a (rows, nbytes) array whose row strides are those distances: numpy releases the GIL for
the whole copy, so threads copy in parallel, and one thread skips the per-piece Python call. Measured here
(16 MiB, 64 KiB pieces, pool mapping <- host memory): memmove per piece 10.3 GB/s, one strided copy per run
11.9, the runs cut in two halves on two threads 15.5 (BENCHMARKS.md, "The data path").

A plan is a list of jobs `(dst, src, nbytes, rows, dst_stride, src_stride)`; rows == 1 is a plain piece.
The rules:
- The jobs copy exactly the bytes of the pieces, each once; only the order changes (callers never give
  pieces whose destinations overlap, and a copy's source is never its destination).
- A run's destination rows never overlap each other (|dst_stride| >= nbytes): otherwise which piece wins
  would depend on numpy's order of rows, so such pieces stay plain.
- Planning reads only the integers it is given; callers bounds-check every piece first, as before.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np

MIN_ROWS = 4        # a shorter run is copied piece by piece (building two arrays costs about 5 us)
MAX_JOB_SHARE = 4   # planning gives up when it would make more than pieces / MAX_JOB_SHARE jobs


class _Raw:
    """Memory at an address as a (rows, nbytes) uint8 array with a row stride (numpy's array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, rows: int, nbytes: int, stride: int, readonly: bool):
        self.__array_interface__ = {"data": (addr, readonly), "shape": (rows, nbytes), "strides": (stride, 1),
                                    "typestr": "|u1", "version": 3}


def copy_job(dst: int, src: int, nbytes: int, rows: int, dst_stride: int, src_stride: int) -> None:
    """Copy one job: a piece by memmove, a strided run by one numpy copy (which releases the GIL)."""
    if rows == 1:
        ctypes.memmove(dst, src, nbytes)
    else:
        np.copyto(np.asarray(_Raw(dst, rows, nbytes, dst_stride, False)),
                  np.asarray(_Raw(src, rows, nbytes, src_stride, True)))


def plain_jobs(dst: np.ndarray, src: np.ndarray, nb: np.ndarray):
    """Pieces (int64 arrays) as jobs of one row each, unplanned."""
    return zip(dst.tolist(), src.tolist(), nb.tolist(), itertools.repeat(1), itertools.repeat(0), itertools.repeat(0))


def plan(dst: np.ndarray, src: np.ndarray, nb: np.ndarray, period: int = 1) -> list[tuple] | None:
    """Jobs for pieces (int64 arrays) that come `period` to a value (a page's K and V: 2), or None when the
    pieces have too little structure to gain from it (then copy them one by one).

    The pieces are read as `period` columns (piece j of every value); each column is cut greedily into
    runs in which the distance between successive pieces is the same on both sides and the size too.
    """
    n = len(nb)
    if period < 1 or n % period or n < MIN_ROWS:
        return None
    jobs: list[tuple] = []
    limit = n // MAX_JOB_SHARE
    for c in range(period):
        d, s, b = dst[c::period], src[c::period], nb[c::period]
        if not _column(d, s, b, jobs) or len(jobs) > limit:
            return None
    return jobs


def _column(d: np.ndarray, s: np.ndarray, b: np.ndarray, jobs: list) -> bool:
    """Append the jobs of one column; False when it has too many breaks to be worth planning."""
    m = len(d)
    if m < MIN_ROWS:
        jobs.extend(plain_jobs(d, s, b))
        return True
    dd, ds = np.diff(d), np.diff(s)
    # link j joins pieces j and j+1 of one run: same size, destinations apart by at least that size
    link = (b[1:] == b[:-1]) & (np.abs(dd) >= b[:-1])
    # consecutive links continue one run when both distances stay the same
    same = link[1:] & link[:-1] & (dd[1:] == dd[:-1]) & (ds[1:] == ds[:-1])
    breaks = np.flatnonzero(~same)
    if len(breaks) > m // MIN_ROWS:
        return False
    dl, sl, bl, ddl, dsl = d.tolist(), s.tolist(), b.tolist(), dd.tolist(), ds.tolist()
    linkl = link.tolist()
    start, k = 0, 0
    while start < m:
        if start == m - 1 or not linkl[start]:
            jobs.append((dl[start], sl[start], bl[start], 1, 0, 0))
            start += 1
            continue
        while k < len(breaks) and breaks[k] < start:
            k += 1
        last_link = int(breaks[k]) if k < len(breaks) else m - 2  # the run's links are start .. last_link
        rows = last_link - start + 2
        if rows < MIN_ROWS:  # too short: this piece alone, and a run may start at the next
            jobs.append((dl[start], sl[start], bl[start], 1, 0, 0))
            start += 1
            continue
        if ddl[start] == bl[start] and dsl[start] == bl[start]:
            jobs.append((dl[start], sl[start], bl[start] * rows, 1, 0, 0))  # contiguous on both sides: one piece
        else:
            jobs.append((dl[start], sl[start], bl[start], rows, ddl[start], dsl[start]))
        start += rows
    return True


def split(jobs: list[tuple], part: int) -> list[tuple]:
    """Jobs cut so that none copies much more than `part` bytes (threads then share them): a run by rows,
    a plain piece by bytes."""
    out = []
    for d, s, n, rows, dst_stride, src_stride in jobs:
        size = n * rows
        if size <= part * 3 // 2:
            out.append((d, s, n, rows, dst_stride, src_stride))
        elif rows == 1:
            out.extend((d + o, s + o, min(part, n - o), 1, 0, 0) for o in range(0, n, part))
        else:
            step = max(1, part // n)
            for r in range(0, rows, step):
                k = min(step, rows - r)
                out.append((d + r * dst_stride, s + r * src_stride, n, k, dst_stride, src_stride))
    return out


__all__ = ["copy_job", "plain_jobs", "plan", "split"]
