"""Slab moves that relocate (allocator/relocation.py): a slab leaving its class takes its live values to
free blocks of the class elsewhere instead of evicting them (DESIGN.md section 7)."""

from __future__ import annotations

import threading
import time

import numpy as np

from maru_shm import chain_relations
from maru_shm.index import key_digest
from maru_shm.sizeclasses import geometric_sizes

from ...conftest import assert_clean, make_value

KiB = 1 << 10


def _full_with_holes(s, size: int, parent: int = 0):
    """Fill the pool with one class (no free unit), then delete every fourth value: the class's slabs are
    three quarters full. Segments of 16 values continue segment `parent`. Returns (class, surviving keys,
    deleted keys)."""
    info = s.alloc.class_for(size)
    n = s.geo.n_units // info.k * info.bps
    keys = [f"a{i}" for i in range(n)]
    for start in range(0, n, 16):
        part = keys[start:start + 16]
        rel = chain_relations(len(part), group=start + 1, parent=parent)
        bufs = [np.frombuffer(make_value(k, 1, size), dtype=np.uint8) for k in part]
        assert all(s.batch_put_pieces(part, [[(b.ctypes.data, len(b))] for b in bufs], relations=rel))
    assert s.alloc.find_free_run(info.k) is None
    gone = keys[::4]
    for k in gone:
        assert s.delete(k)
    return info, [k for k in keys if k not in set(gone)], gone


def _sizes(s):
    sizes = geometric_sizes(s.geo.granule, s.geo.max_value)
    return next(b for b in sizes if b >= 20 * KiB), next(b for b in sizes if b >= 40 * KiB)


def test_a_slab_move_relocates_what_fits_and_evicts_nothing(open_store):
    """A class without a slab takes one from a class whose slabs have room: the window's live values move
    to free blocks of their class, keep their bytes and their relation records, and nothing is evicted."""
    s = open_store("16M")
    small, other = _sizes(s)
    info, alive, _ = _full_with_holes(s, small)
    before = {k: s.relation_of(key_digest(k)) for k in alive}
    offsets = {k: s.index.find(key_digest(k))[1] for k in alive}
    for i in range(3):
        k = f"b{i}"
        assert s.put(k, make_value(k, 1, other))
    st = s.stats()
    assert st["slab_moves"] >= 1 and st["evictions"] == 0, st
    assert all(s.get(k) == make_value(k, 1, small) for k in alive), "a relocated value changed or went"
    assert {k: s.relation_of(key_digest(k)) for k in alive} == before, "a record was lost on the way"
    moved = [k for k in alive if s.index.find(key_digest(k))[1] != offsets[k]]
    assert moved, "no value moved: the test did not exercise relocation"
    assert all(s.get(f"b{i}") == make_value(f"b{i}", 1, other) for i in range(3))
    assert_clean(s)


def test_a_move_frees_stranded_values_and_carries_only_the_others(open_store):
    """A value a doom has stranded can serve no hit: a move frees it instead of copying it, so it cannot land
    in a window the search for stranded values has already passed (DESIGN.md section 8). The others move as before."""
    s = open_store("16M")
    small, other = _sizes(s)
    _, alive, _ = _full_with_holes(s, small)
    n = len(alive) + len(alive) // 3 + 1
    doomed = {f"a{i}" for i in range(n) if (i // 16) % 2 == 0}  # every other group of 16 (group = start + 1)
    for start in range(0, n, 32):
        s.doom_segment(start + 1)
    offsets = {k: s.index.find(key_digest(k))[1] for k in alive}
    for i in range(3):
        assert s.put(f"b{i}", make_value(f"b{i}", 1, other))
    assert s.stats()["slab_moves"] >= 1
    where = {k: s.index.find(key_digest(k)) for k in alive}
    dead = [k for k in alive if k in doomed]
    assert all(where[k] is None or where[k][1] == offsets[k] for k in dead), "a stranded value was carried"
    assert any(where[k] is None for k in dead), "no stranded value was in the window: the test proves nothing"
    kept = [k for k in alive if k not in doomed]
    assert all(s.get(k) == make_value(k, 1, small) for k in kept), "a value with a future was evicted"
    assert any(where[k][1] != offsets[k] for k in kept), "nothing moved: the test did not exercise relocation"
    assert_clean(s)


def test_a_move_dooms_a_value_stranded_through_its_parent_with_its_whole_segment(open_store):
    """As the block CLOCK does: a value stranded through its parent dooms its segment from position 0, so
    every segment continuing it is stranded, wherever it branched."""
    s = open_store("16M")
    small, other = _sizes(s)
    _full_with_holes(s, small, parent=999)
    s.doom_segment(999)  # every value of the class is now stranded through its parent
    rel, whole = s.alloc.relations, []
    real = rel.doom
    rel.doom = lambda rows, by_parent: whole.append(bool(by_parent.all())) or real(rows, by_parent)
    assert s.put("b0", make_value("b0", 1, other))
    assert s.stats()["slab_moves"] >= 1 and whole, "no move doomed anything: the test proves nothing"
    assert whole[0], "the move doomed a stranded value's segment from its own position only"
    assert_clean(s)


def test_an_entry_that_changed_before_the_switch_keeps_its_block_and_the_copy_is_freed(open_store):
    """The entry switch is conditional: an entry that no longer names the block the mover copied (a writer
    replaced or deleted the key meanwhile, under the shard lock) is left as it is, and the mover frees its
    copy. Here the mover is told a stale word for the first value: that value stays where it was, its
    slab stays in its class (a relocating move evicts nothing), and no block leaks."""
    s = open_store("16M")
    small, other = _sizes(s)
    _, alive, _ = _full_with_holes(s, small)
    host = s.alloc.host
    real = host.repoint_many
    calls = []

    def stale_first(halves, offsets, words, new_offsets, new_words):
        if not calls:
            words = words.copy()
            words[0] ^= np.uint64(4)  # another lifetime of the block: the entry does not name it
        calls.append((halves[0].tobytes(), int(offsets[0])))
        return real(halves, offsets, words, new_offsets, new_words)

    host.repoint_many = stale_first
    try:
        assert s.put("b0", make_value("b0", 1, other))
    finally:
        host.repoint_many = real
    assert calls, "no relocation happened"
    digest, offset = calls[0]
    assert s.index.find(digest)[1] == offset, "the entry was switched although it named another lifetime"
    assert all(s.get(k) == make_value(k, 1, small) for k in alive)
    assert s.stats()["evictions"] == 0
    assert_clean(s)


def test_relocating_moves_under_concurrent_readers_never_return_wrong_bytes(open_store):
    """Readers on other threads read values while slabs move to a new class, each move relocating the
    leaving slab's values: a read returns the exact value or a miss, never other bytes; at the end every
    value is readable unless it was evicted (once the old class's free blocks run out)."""
    s = open_store("16M")
    small, other = _sizes(s)
    _, alive, _ = _full_with_holes(s, small)
    stop, wrong, reads = threading.Event(), [], [0]

    def reader(seed: int):
        rnd = np.random.default_rng(seed)
        while not stop.is_set():
            k = alive[int(rnd.integers(len(alive)))]
            v = s.get(k)
            reads[0] += 1
            if v is not None and v != make_value(k, 1, small):
                wrong.append(k)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        while reads[0] < 200:
            time.sleep(0.001)
        for i in range(40):  # the new class keeps asking for slabs; each move relocates a slab of values
            k = f"b{i}"
            assert s.put(k, make_value(k, 1, other))
            time.sleep(0.001)  # let the readers in
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not wrong, wrong[:5]
    st = s.stats()
    assert st["slab_moves"] >= 3, st
    present = sum(s.get(k) == make_value(k, 1, small) for k in alive)
    assert present + st["evictions"] == len(alive), "a value neither readable nor evicted"
    assert_clean(s)
