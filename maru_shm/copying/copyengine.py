"""The copy engine: one batch of raw copies (destination, source, nbytes), on several threads at once.

Why threads: one thread copies a batch of 64 KiB pieces at about two thirds of what the machine's cores
copy together (BENCHMARKS.md, "The data path"), and a prefix hit waits for that copy. `ctypes.memmove`
releases the GIL, so threads of this process copy in parallel with no code of our own.

The rules (FORMAT.md section 8 relies on the first two):
- The engine copies exactly the pieces it is given, nothing else. Callers bounds-check every piece
  against the block it belongs to before calling; the engine never reads the pool's metadata.
- `run` returns only after every piece is copied: no worker touches a piece after it returns, so the
  caller's commit (put) or word re-check (get) follows the whole copy. The same holds when it raises:
  an exception in the caller (Ctrl-C) is held until every worker that joined the batch has finished,
  since the caller gives the batch's blocks back next.
- Workers are used only on cores nothing but the engine's own copying keeps busy (idlecores.py decides;
  the engine copies and counts the CPU time it spends copying, `copy_seconds`).
  Every thread, the caller's included, takes the next piece from one shared iterator, so a worker that
  is not running takes nothing and the caller copies what is left. A batch in which the workers helped
  little twice in a row (a CPU quota the kernel's counters do not show) runs the next BACKOFF batches alone: a busy
  machine degrades to the one-thread path, never far below it.
- One batch at a time uses the workers; a concurrent batch (another SGLang thread) copies on its caller.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time

import numpy as np

from .copyplan import copy_job, plain_jobs, plan, split
from .idlecores import IdleCores

MIN_THREADED_BYTES = 2 << 20  # below this, waking a worker costs more than it saves (about 20 us)
# Threads take the GIL back after every job; a contended hand-off wakes the other thread (tens of
# microseconds on a virtual machine whose idle vCPU halted). Measured here, jobs of 64 KiB (128 KiB pages
# whose pieces form no strided run) ran at 0.75-0.9 of one thread, of 1 MiB at 1.2-1.3 times: threads only
# when the jobs average this size.
MIN_THREADED_PIECE = 256 << 10
CUT = 4 << 20                 # pieces above this are cut into CUT-byte parts, so that threads share them
PLAN_BYTES = 1 << 20          # smaller batches are copied piece by piece (planning costs 20-40 us)
BACKOFF = 32                  # batches run alone after two in a row in which the workers barely helped
MAX_THREADS = 64


def default_threads() -> int:
    """Copy threads when none are asked for: every core this process may run on, at most 4.

    Four threads copy about 40-60 GB/s on a server socket, the rate of the PCIe Gen5 link that the
    pages cross next, and leave the other cores of a GPU's share to SGLang's own threads.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def check_threads(threads) -> int:
    if threads is None:
        return default_threads()
    if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"copy_threads must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
    return threads


def merge_runs(dst: np.ndarray, src: np.ndarray, nb: np.ndarray):
    """Pieces contiguous on both sides with their successor become one copy; huge pieces are cut in parts.

    int64 arrays in, int64 arrays out; the bytes copied are exactly the same.
    """
    if len(nb) > 1:
        end_d, end_s = dst[:-1] + nb[:-1], src[:-1] + nb[:-1]
        starts = np.flatnonzero(np.concatenate(([True], (end_d != dst[1:]) | (end_s != src[1:]))))
        if len(starts) < len(nb):
            dst, src, nb = dst[starts], src[starts], np.add.reduceat(nb, starts)
    big = nb > CUT
    if big.any():
        parts = np.where(big, (nb + CUT - 1) // CUT, 1)
        first = np.repeat(np.cumsum(parts) - parts, parts)
        k = (np.arange(int(parts.sum())) - first) * CUT  # byte offset of each part within its piece
        owner = np.repeat(np.arange(len(nb)), parts)
        dst, src = dst[owner] + k, src[owner] + k
        nb = np.minimum(nb[owner] - k, CUT)
    return dst, src, nb


class _Job:
    """One batch shared with the workers: the iterator they take pieces from and who joined it.

    The caller never holds a lock of the job's: a lock it holds is one more thing an exception (Ctrl-C)
    between two lines could leave held, and a worker would wait on it forever. Joining and finishing are
    list appends, atomic under the GIL, and a worker joins before it reads `closed`: once the caller has
    set `closed`, every worker that may still copy is in `joined`.
    """

    __slots__ = ("pieces", "closed", "joined", "finished", "seconds", "bell")

    def __init__(self, pieces):
        self.pieces = pieces
        self.closed = False  # set by the caller once the iterator is empty: a late worker stays out
        self.joined: list[int] = []  # one entry per worker that joined
        self.finished: list[int] = []  # pieces copied, one entry per worker that joined and is done
        self.seconds: list[float] = []  # CPU seconds each worker spent copying
        self.bell: queue.SimpleQueue = queue.SimpleQueue()  # rung by each worker that is done

    def in_flight(self) -> int:
        return len(self.joined) - len(self.finished)

    def close_and_wait(self) -> None:
        """Keep late workers out and wait for every worker that joined: the pieces they copy lie in blocks
        the caller commits or gives back next. An exception raised meanwhile is held until then; the
        counts live in the job, so a wait cut short is simply redone."""
        held = None
        while True:
            try:
                self.closed = True
                while len(self.finished) < len(self.joined):
                    try:
                        self.bell.get(timeout=0.05)
                    except queue.Empty:
                        pass
                break
            except BaseException as e:
                held = e
        if held is not None:
            raise held


def _copy_all(jobs) -> int:
    """Copy (dst, src, nbytes, rows, dst_stride, src_stride) jobs (copyplan.py); the number copied."""
    memmove, n = ctypes.memmove, 0
    for d, s, b, rows, dst_stride, src_stride in jobs:
        if rows == 1:
            memmove(d, s, b)
        else:
            copy_job(d, s, b, rows, dst_stride, src_stride)
        n += 1
    return n


def _worker(inbox: queue.SimpleQueue) -> None:
    while True:
        job = inbox.get()
        if job is None:
            return
        job.joined.append(1)
        if job.closed:
            job.finished.append(0)
            continue
        n, t0 = 0, time.thread_time()
        try:
            n = _copy_all(job.pieces)
        finally:
            job.seconds.append(time.thread_time() - t0)  # before `finished`: the caller sums them once all are in
            job.finished.append(n)
            job.bell.put(None)


class CopyEngine:
    """Copies batches of pieces on up to `threads` threads (the caller's and threads - 1 workers)."""

    def __init__(self, threads: int | None = None):
        self.threads = check_threads(threads)
        self.min_threaded = MIN_THREADED_BYTES if self.threads > 1 else 1 << 62  # callers' shortcut
        self._inboxes: list[queue.SimpleQueue] = []
        self._pid = 0
        self._busy = 0  # batches left to run alone
        self._idle_workers = 0  # threaded batches in a row in which the workers barely helped
        self._use = threading.Lock()  # held by the batch that uses the workers
        self._job: _Job | None = None  # the last batch given to the workers
        self.copy_seconds = 0.0  # CPU seconds spent copying large batches, by every thread (idlecores.py)
        self.cores = IdleCores(lambda: self.copy_seconds)
        self.batches_threaded = 0
        self.batches_alone = 0

    def run(self, dst, src, nb, period: int = 1) -> None:
        """Copy nb[i] bytes from src[i] to dst[i] for every i (sequences or int64 arrays of equal length).
        `period`: pieces per value, when every value has that many (a page's K and V: 2); it lets the plan
        find the runs of each piece of a value (copyplan.py)."""
        dst, src, nb = (np.asarray(a, dtype=np.int64) for a in (dst, src, nb))
        n = len(nb)
        if n < 2 and (not n or nb[0] <= CUT):
            _copy_all(plain_jobs(dst, src, nb))
            return
        total = int(nb.sum())
        jobs = plan(dst, src, nb, period) if total >= PLAN_BYTES else None
        if jobs is None:
            if self.threads == 1:
                _copy_all(plain_jobs(dst, src, nb))
                return
            dst, src, nb = merge_runs(dst, src, nb)
            jobs = list(plain_jobs(dst, src, nb))
        helpers = 0
        if self.threads > 1 and self._busy > 0:
            self._busy -= 1
        elif self.threads > 1 and (len(jobs) > 1 or total > CUT):
            if total >= max(MIN_THREADED_BYTES, MIN_THREADED_PIECE * len(jobs)):
                helpers = min(self.threads, self.cores.free()) - 1
        # The workers' lock and its record change on one line each, and the release is the try's last
        # line, not a `finally`: an exception landing between two lines finds them in step.
        using = False
        try:
            using = helpers >= 1 and self._use.acquire(blocking=False)
            if using:
                part = min(CUT, max(MIN_THREADED_PIECE, total // (4 * (helpers + 1))))
                self._threaded(iter(split(jobs, part)), helpers)
                using = self._use.release()
                return
        except BaseException:
            if using:
                self._use.release()
            raise
        if self.threads > 1:
            self.batches_alone += 1
        t0 = time.thread_time()
        _copy_all(jobs)
        self._copied(time.thread_time() - t0)

    def _copied(self, seconds: float) -> None:
        # Concurrent batches (SGLang's threads) may lose an update here: the copying then counts as other
        # work, and idlecores gives fewer workers, never more.
        self.copy_seconds += seconds

    def _threaded(self, pieces, helpers: int) -> None:
        job = self._job = _Job(pieces)
        started = self._pid != os.getpid()
        # The wait is the try's last line, not a `finally`: an exception landing on the line that would
        # start it (between two bytecodes) is inside the try, so the handler waits instead.
        try:
            for inbox in self._workers()[:helpers]:
                inbox.put(job)
            t0 = time.thread_time()
            mine = _copy_all(pieces)
            t0 = time.thread_time() - t0
            job.close_and_wait()
        except BaseException:
            job.close_and_wait()
            raise
        self._copied(t0 + sum(job.seconds))
        helped = sum(job.finished)
        self.batches_threaded += 1
        if started:
            return  # threads just started may miss their first batch: no verdict
        if helped * 4 >= (mine + helped) * helpers // (helpers + 1):  # at least a quarter of their share
            self._idle_workers = 0
        else:
            self._idle_workers += 1
            if self._idle_workers >= 2:
                self._busy, self._idle_workers = BACKOFF, 0

    def in_flight(self) -> int:
        """Workers still copying pieces of the last threaded batch: 0 whenever `run` has returned or raised."""
        job = self._job
        return 0 if job is None else job.in_flight()

    def _workers(self) -> list[queue.SimpleQueue]:
        """The worker inboxes, started on first use and again in a forked child (threads do not survive fork)."""
        if self._pid != os.getpid():
            self._inboxes = []
            for _ in range(self.threads - 1):
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=_worker, args=(inbox,), name="maru-copy", daemon=True).start()
                self._inboxes.append(inbox)
            self._pid = os.getpid()
        return self._inboxes

    def close(self) -> None:
        """Stop the workers (idempotent); a later batch starts them again."""
        if self._pid == os.getpid():
            for inbox in self._inboxes:
                inbox.put(None)
        self._inboxes, self._pid = [], 0


__all__ = ["CopyEngine", "check_threads", "default_threads", "merge_runs"]
