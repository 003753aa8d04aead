"""The copy engine (maru_shm/copying/copyengine.py) and the idle-core reading that sizes it (idlecores.py).

Every test checks bytes: what the pieces name is copied exactly once, and nothing around them changes.
"""

from __future__ import annotations

import os
import queue

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_shm.copying import copyengine, copyplan, idlecores
from maru_shm.copying.copyengine import CUT, MIN_THREADED_BYTES, MIN_THREADED_PIECE, CopyEngine, merge_runs
from maru_shm.copying.idlecores import IdleCores

KiB = 1024


def _buffers(nbytes: int, seed: int):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 2 * 4096, dtype=np.uint8)  # a guard page each side
    return src, dst


def _scattered_plan(nbytes: int, piece: int, seed: int):
    """Pieces of `piece` bytes taking the source in a random order to random destination slots."""
    n = nbytes // piece
    rng = np.random.default_rng(seed)
    return rng.permutation(n) * piece, rng.permutation(n) * piece, np.full(n, piece, dtype=np.int64)


def _expected(src, dst, d_off, s_off, nb):
    want = dst.copy()
    for d, s, n in zip(d_off.tolist(), s_off.tolist(), nb.tolist()):
        want[4096 + d:4096 + d + n] = src[s:s + n]
    return want


def _always_free(engine: CopyEngine) -> CopyEngine:
    """The policy answers 'every core is idle', so the threaded path is the one under test."""
    engine.cores.free = lambda: engine.threads
    return engine


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("piece", [4 * KiB, 64 * KiB, 1 << 20])
def test_copies_exactly_the_pieces(threads, piece):
    src, dst = _buffers(8 << 20, seed=piece + threads)
    d_off, s_off, nb = _scattered_plan(6 << 20, piece, seed=threads)
    want = _expected(src, dst, d_off, s_off, nb)
    engine = _always_free(CopyEngine(threads))
    try:
        for _ in range(3):
            engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
        assert np.array_equal(dst, want)
        if threads > 1 and piece >= MIN_THREADED_PIECE:
            assert engine.batches_threaded >= 1  # later ones may run alone if a worker was slow to wake
        else:
            assert engine.batches_threaded == 0, "small pieces copy on the caller (GIL hand-offs cost more)"
    finally:
        engine.close()


def test_merge_runs_joins_only_runs_contiguous_on_both_sides():
    dst = np.array([0, 10, 20, 100, 110], dtype=np.int64)
    src = np.array([500, 510, 900, 910, 920], dtype=np.int64)
    nb = np.full(5, 10, dtype=np.int64)
    d, s, n = merge_runs(dst, src, nb)
    assert (d.tolist(), s.tolist(), n.tolist()) == ([0, 20, 100], [500, 900, 910], [20, 10, 20])


def test_merge_runs_cuts_huge_pieces_into_parts_that_cover_them():
    d, s, n = merge_runs(np.array([0, 10 * CUT], dtype=np.int64), np.array([0, 20 * CUT], dtype=np.int64),
                         np.array([2 * CUT + 5, 3], dtype=np.int64))
    assert n.tolist() == [CUT, CUT, 5, 3]
    assert d.tolist() == [0, CUT, 2 * CUT, 10 * CUT] and s.tolist() == [0, CUT, 2 * CUT, 20 * CUT]


def test_one_huge_piece_is_shared_and_copied_whole():
    src, dst = _buffers(3 * CUT, seed=7)
    engine = _always_free(CopyEngine(2))
    try:
        engine.run([dst.ctypes.data + 4096], [src.ctypes.data], [3 * CUT - 3])
    finally:
        engine.close()
    assert np.array_equal(dst[4096:4096 + 3 * CUT - 3], src[:3 * CUT - 3])
    assert not dst[:4096].any() and not dst[4096 + 3 * CUT - 3:].any()
    assert engine.batches_threaded == 1


def test_a_worker_that_never_runs_costs_the_copy_nothing_and_backs_off():
    """A worker that is not scheduled never joins: the caller copies every piece and does not wait for it;
    after two such batches the next ones run alone."""
    src, dst = _buffers(MIN_THREADED_BYTES * 2, seed=3)
    d_off, s_off, nb = _scattered_plan(MIN_THREADED_BYTES * 2, MIN_THREADED_PIECE, seed=3)
    engine = _always_free(CopyEngine(2))
    asleep = [queue.SimpleQueue()]  # an inbox nobody reads
    engine._workers = lambda: asleep
    engine._pid = os.getpid()  # as if started earlier
    for _ in range(2):
        dst[:] = 0
        engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
        assert np.array_equal(dst, _expected(src, dst * 0, d_off, s_off, nb))
    assert engine.batches_threaded == 2
    engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
    assert engine.batches_threaded == 2 and engine.batches_alone == 1, "the next batch runs alone"


def test_small_batches_and_busy_cores_copy_on_the_caller():
    src, dst = _buffers(4 << 20, seed=5)
    d_off, s_off, nb = _scattered_plan(MIN_THREADED_BYTES // 2, 64 * KiB, seed=5)
    engine = CopyEngine(4)
    engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
    d_off, s_off, nb = _scattered_plan(4 << 20, 1 << 20, seed=6)
    engine.cores.free = lambda: 1  # every other core is busy
    engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
    assert (engine.batches_threaded, engine.batches_alone) == (0, 2)
    assert engine._inboxes == [], "no worker was started"


def test_a_forked_child_starts_its_own_workers():
    src, dst = _buffers(4 << 20, seed=9)
    d_off, s_off, nb = _scattered_plan(4 << 20, 1 << 20, seed=9)
    engine = _always_free(CopyEngine(2))
    engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)  # workers of the parent
    pid = os.fork()
    if pid == 0:
        try:
            dst[:] = 0
            engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
            ok = np.array_equal(dst, _expected(src, dst * 0, d_off, s_off, nb)) and engine.batches_threaded == 2
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    engine.close()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, "2", True])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match="copy_threads"):
        CopyEngine(bad)


def test_default_threads_is_every_allowed_core_at_most_four():
    assert copyengine.default_threads() == max(1, min(4, len(os.sched_getaffinity(0))))


def test_idle_cores_stay_within_the_affinity():
    cores = IdleCores()
    first = cores.free()
    cores._at -= 1.0  # the next call reads /proc/stat again
    second = cores.free()
    assert 1 <= first <= cores.allowed and 1 <= second <= cores.allowed


def test_idle_cores_count_everything_but_the_engines_copying_as_busy(monkeypatch):
    """Busy time of the allowed cores counts against the workers, this process's own included (an SGLang
    scheduler's model forward keeps its cores busy, and a copy thread there stalls its OpenMP team); only
    the CPU time the engine spent copying does not."""
    busy, copied = [100.0], [0.0]
    monkeypatch.setattr(idlecores, "_busy_seconds", lambda cpus: busy[0])
    monkeypatch.setattr(idlecores, "_allowed", lambda: frozenset(range(4)))
    cores = IdleCores(lambda: copied[0])
    assert cores.free() == 4  # the first reading only takes a baseline

    def window(busy_cores: float, copying_cores: float) -> int:
        cores._at -= 1.0  # one second later
        busy[0] += busy_cores
        copied[0] += copying_cores
        return cores.free()

    assert window(3.0, 2.0) == 3, "two of the three busy cores were our copies"
    assert window(3.0, 0.0) == 1, "three cores busy with anything else leave one"
    assert window(0.0, 0.0) == 4


def test_busy_seconds_read_only_the_allowed_cores():
    allowed = frozenset(os.sched_getaffinity(0))
    assert idlecores._busy_seconds(allowed) > 0
    assert idlecores._busy_seconds(frozenset({10 ** 6})) is None  # no such core: nothing to say


def test_the_engine_counts_its_copying_time():
    src, dst = _buffers(4 << 20, seed=8)
    d_off, s_off, nb = _scattered_plan(4 << 20, 1 << 20, seed=8)
    alone = CopyEngine(2)
    alone.cores.free = lambda: 1  # the caller copies by itself
    for engine in (_always_free(CopyEngine(2)), alone):
        engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
        assert engine.copy_seconds > 0
        engine.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_store_batches_and_large_values_round_trip_on_any_thread_count(open_store, threads):
    """Pages through the vector paths, and single values large enough for the engine on the scalar paths."""
    store = open_store("96M", copy_threads=threads)
    _always_free(store._engine)
    rng = np.random.default_rng(threads)
    pages = rng.integers(0, 256, (64, 2, 32 * KiB), dtype=np.uint8)
    pieces = np.array([[[int(p[0].ctypes.data), 32 * KiB], [int(p[1].ctypes.data), 32 * KiB]] for p in pages])
    keys = [f"page-{i}" for i in range(64)]
    assert store.batch_put_pieces(keys, pieces) == [True] * 64
    out = np.zeros_like(pages)
    dst = np.array([[[int(p[0].ctypes.data), 32 * KiB], [int(p[1].ctypes.data), 32 * KiB]] for p in out])
    assert store.batch_get_pieces(keys, dst) == [True] * 64
    assert np.array_equal(out, pages)
    big = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    half = len(big) // 2
    store.put_pieces("big", [(big.ctypes.data, half), (big.ctypes.data + half, len(big) - half)])
    got = np.zeros(len(big) + 8192, dtype=np.uint8)
    assert store.get_pieces("big", [(got.ctypes.data + 4096, len(big))])
    assert np.array_equal(got[4096:-4096], big) and not got[:4096].any() and not got[-4096:].any()
    assert store.batch_get_pieces(["big"], [[(got.ctypes.data + 4096, len(big))]]) == [True]
    assert (store._engine.batches_threaded > 0) == (threads > 1)


# ---------------------------------------------------------------- the copy plan (copyplan.py)

def _page_batch(n: int, piece: int, block_order, host_order):
    """A batch of n pages of two pieces each (K, V) as the data path makes it: page i's K and V go to the two
    halves of block block_order[i]; its K comes from host row host_order[i] of the K area, its V from the
    same row of the V area."""
    d = np.empty(2 * n, dtype=np.int64)
    s = np.empty(2 * n, dtype=np.int64)
    d[0::2] = np.asarray(block_order) * 2 * piece
    d[1::2] = d[0::2] + piece
    s[0::2] = np.asarray(host_order) * piece
    s[1::2] = s[0::2] + n * piece
    return d, s, np.full(2 * n, piece, dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["consecutive", "two_slabs", "descending", "scattered", "contiguous"])
def test_planned_batches_copy_exactly_the_pieces(threads, layout):
    """Every layout of a page batch, planned into strided runs or not, copies exactly its pieces."""
    n, piece = 64, 16 * KiB
    rng = np.random.default_rng(len(layout))
    blocks = {"consecutive": np.arange(n), "two_slabs": np.r_[np.arange(40), 100 + np.arange(n - 40)],
              "descending": np.arange(n)[::-1], "scattered": rng.permutation(2 * n)[:n],
              "contiguous": np.arange(n)}[layout]
    d_off, s_off, nb = _page_batch(n, piece, blocks, np.arange(n))
    if layout == "contiguous":  # one piece per page, contiguous on both sides: one merged copy
        d_off, s_off, nb = np.arange(n) * piece, np.arange(n) * piece, np.full(n, piece, dtype=np.int64)
    src, dst = _buffers(4 * n * piece, seed=n)
    want = _expected(src, dst, d_off, s_off, nb)
    engine = _always_free(CopyEngine(threads))
    try:
        engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb, period=1 if layout == "contiguous" else 2)
    finally:
        engine.close()
    assert np.array_equal(dst, want)


def test_the_plan_makes_one_strided_job_per_piece_of_a_page():
    d, s, nb = _page_batch(128, 64 * KiB, np.arange(128), np.arange(128))
    jobs = copyplan.plan(d + 4096, s + 8192, nb, period=2)
    assert [j[2:] for j in jobs] == [(64 * KiB, 128, 128 * KiB, 64 * KiB)] * 2
    assert [j[:2] for j in jobs] == [(4096, 8192), (4096 + 64 * KiB, 8192 + 128 * 64 * KiB)]
    # a batch in two slabs: two runs per column
    d, s, nb = _page_batch(128, 64 * KiB, np.r_[np.arange(100), 500 + np.arange(28)], np.arange(128))
    assert [j[3] for j in copyplan.plan(d, s, nb, period=2)] == [100, 28, 100, 28]


def test_the_plan_keeps_pieces_whose_destinations_overlap_plain():
    """Destinations closer than a piece's size would overlap: numpy's row order must not decide what wins."""
    d = np.r_[np.arange(8) * 100, 4096 + np.arange(64) * 200].astype(np.int64)
    s = np.arange(72, dtype=np.int64) * 1000
    nb = np.full(72, 150, dtype=np.int64)
    jobs = copyplan.plan(d, s, nb, period=1)
    assert jobs is not None
    assert [j[3] for j in jobs] == [1] * 8 + [64], "the overlapping pieces stay plain, the rest is one run"
    src, dst = _buffers(80 * KiB, seed=1)
    want = _expected(src, dst, d, s, nb)
    for j in jobs:
        copyplan.copy_job(dst.ctypes.data + 4096 + j[0], src.ctypes.data + j[1], *j[2:])
    assert np.array_equal(dst, want), "later pieces win, as with memmove in order"


def test_the_plan_gives_up_on_pieces_without_structure():
    d, s, nb = _scattered_plan(4 << 20, 64 * KiB, seed=4)
    assert copyplan.plan(d, s, nb, period=1) is None
    assert copyplan.plan(d, s, nb, period=3) is None, "a period that does not divide the batch"


def test_split_cuts_runs_by_rows_and_pieces_by_bytes_and_covers_them():
    jobs = [(0, 0, 64 * KiB, 128, 128 * KiB, 64 * KiB), (1 << 30, 1 << 31, 10 << 20, 1, 0, 0)]
    parts = copyplan.split(jobs, 1 << 20)
    runs = [p for p in parts if p[3] > 1 or p[0] < 1 << 30]
    assert sum(p[3] for p in runs) == 128 and all(p[3] == 16 for p in runs)
    assert [p[0] for p in runs] == [r * 128 * KiB for r in range(0, 128, 16)]
    pieces = [p for p in parts if p[0] >= 1 << 30]
    assert sum(p[2] for p in pieces) == 10 << 20 and max(p[2] for p in pieces) == 1 << 20


@st.composite
def _piece_batches(draw):
    """A batch mixing strided runs (ascending or descending on either side) and loose pieces of any size,
    zero included; destinations never overlap (the engine's rule), sources may."""
    d, s, nb = [], [], []
    at = 0  # the destination space is handed out segment by segment
    for _ in range(draw(st.integers(1, 5))):
        rows = draw(st.integers(1, 24))
        size = draw(st.sampled_from([0, 1, 100, 4096, 5000, 16 * KiB]))
        kind = draw(st.sampled_from(["run", "run, sources scattered", "loose"]))
        if kind != "loose":  # a run of destinations at a constant distance; sources too, or anywhere
            gap = draw(st.sampled_from([0, 8, 4096]))
            step = size + gap
            order = range(rows) if draw(st.booleans()) else range(rows - 1, -1, -1)
            sstep = draw(st.sampled_from([size, -size, 2 * size + 64, 0]))
            s0 = draw(st.integers(0, 64)) + (rows * abs(sstep) if sstep < 0 else 0)
            for r in order:
                d.append(at + r * step)
                s.append(s0 + r * sstep if kind == "run" else draw(st.integers(0, 1 << 16)))
                nb.append(size)
            at += rows * step + draw(st.integers(0, 4096))
        else:  # loose pieces of mixed sizes in a shuffled order
            sizes = [draw(st.sampled_from([0, 7, 4096, 9000])) for _ in range(rows)]
            slots = list(range(rows))
            draw(st.randoms(use_true_random=False)).shuffle(slots)
            offs = np.cumsum([0] + sizes[:-1])
            for r in slots:
                d.append(at + int(offs[r]))
                s.append(draw(st.integers(0, 1 << 16)))
                nb.append(sizes[r])
            at += int(sum(sizes)) + 64
    return np.array(d, dtype=np.int64), np.array(s, dtype=np.int64), np.array(nb, dtype=np.int64), at


@settings(max_examples=150, deadline=None)
@given(batch=_piece_batches(), period=st.sampled_from([1, 2, 3]), threads=st.sampled_from([1, 2]))
def test_any_batch_copies_exactly_its_pieces(batch, period, threads):
    """Whatever the layout, planned or not, on one thread or two: each destination piece ends up holding its
    source bytes, and no byte outside the pieces changes (guard bytes around and between them)."""
    d_off, s_off, nb, span = batch
    rng = np.random.default_rng(len(nb))
    src = rng.integers(0, 256, int((s_off + nb).max()) + 1, dtype=np.uint8)
    dst = np.full(span + 2 * 4096, 0xEE, dtype=np.uint8)
    want = _expected(src, dst, d_off, s_off, nb)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(copyengine, "PLAN_BYTES", 0)  # plan every batch, however small
        mp.setattr(copyengine, "MIN_THREADED_BYTES", 0)
        mp.setattr(copyengine, "MIN_THREADED_PIECE", 1)  # parts of at least one byte
        mp.setattr(copyplan, "MAX_JOB_SHARE", 1)  # and keep the plan whatever its share of breaks
        engine = _always_free(CopyEngine(threads))
        try:
            engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb, period=period)
        finally:
            engine.close()
    assert np.array_equal(dst, want)


def test_an_exception_at_any_line_of_a_threaded_batch_waits_for_the_workers(monkeypatch):
    """A KeyboardInterrupt at each line event of the caller's part of a threaded batch in turn (as Ctrl-C
    lands between two bytecodes): when `run` raises, no worker still copies a piece (the caller gives the
    batch's blocks back next, and a later writer may reuse them), the workers stay usable, and the next
    batch copies exactly its pieces. The backoff is off: on a loaded machine the workers barely help, and
    the batches would then run alone, untested."""
    import sys

    monkeypatch.setattr(copyengine, "BACKOFF", 0)

    from ..conftest import interrupt_at_line

    def tracer_at(n, seen):
        return interrupt_at_line(n, (copyengine.__file__,), seen)

    src, dst = _buffers(32 << 20, seed=11)
    d_off, s_off, nb = _scattered_plan(32 << 20, 1 << 20, seed=11)
    engine = _always_free(CopyEngine(3))
    outer = sys.gettrace()
    try:
        engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)  # starts the workers
        seen = [0]
        sys.settrace(tracer_at(None, seen))
        try:
            engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
        finally:
            sys.settrace(outer)
        events, interrupted = seen[0], 0
        assert events > 20, events
        for n in range(1, events + 1):
            sys.settrace(tracer_at(n, [0]))
            try:
                engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
            except KeyboardInterrupt as e:
                sys.settrace(outer)
                interrupted += 1
                assert engine.in_flight() == 0, f"a worker still copies after the interrupt at {e}"
                assert not engine._use.locked(), f"the workers stay taken after the interrupt at {e}"
            finally:
                sys.settrace(outer)
            dst[:] = 0
            engine.run(dst.ctypes.data + 4096 + d_off, src.ctypes.data + s_off, nb)
            assert np.array_equal(dst, _expected(src, dst * 0, d_off, s_off, nb)), n
        # The caller's share of the pieces, and so its line events, varies with the workers' timing.
        assert interrupted >= events // 3, (interrupted, events)
        assert engine.batches_threaded > events // 2
    finally:
        sys.settrace(outer)
        engine.close()
