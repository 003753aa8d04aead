"""The public Store API, single process."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import numpy as np
import pytest

from maru_shm import PoolClosedError, Store, ValueTooLargeError, pool_processes
from maru_shm.format.layout import COUNTER_NAMES, ENTRY_STRUCT, FLAG_PINNED, META_FLAGS_OFF, length_flags
from maru_shm.index import key_digest

from ..conftest import assert_clean, check_value, make_value

STATS_KEYS = {"entries", "live_bytes", "file_bytes", "data_bytes", "evictions", "hits", "misses",
              "load_factor", "probe_mean", "probe_max"}


@pytest.fixture
def store(open_store):
    return open_store("16M")


def pieces_of(arrays):
    return [(a.ctypes.data, a.nbytes) for a in arrays]


def test_put_get_round_trip(store):
    v = make_value("a", 1, 10_000)
    assert store.put("a", v)
    assert store.get("a") == v
    assert store.get(b"a") == v  # str and bytes keys are the same key
    assert store.length_of("a") == len(v)
    assert store.get("missing") is None
    assert store.length_of("missing") is None
    assert store.length_of(digest=key_digest("a")) == len(v)
    with pytest.raises(ValueError, match="16 bytes"):
        store.length_of(digest=key_digest("a")[:8])


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy"])
def test_put_accepts_any_contiguous_buffer(store, kind):
    v = make_value("k", 1, 7777)
    src = {"bytes": v, "bytearray": bytearray(v), "memoryview": memoryview(v),
           "numpy": np.frombuffer(v, dtype=np.uint8).copy()}[kind]
    assert store.put("k", src)
    assert store.get("k") == v


def test_empty_and_tiny_values(store):
    assert store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.exists("empty")
    assert store.put("one", b"x")
    assert store.get("one") == b"x"


def test_overwrite_replaces_and_frees(store):
    for version, size in enumerate([5000, 200_000, 5000, 64, 5000]):
        v = make_value("k", version, max(size, 32))
        assert store.put("k", v)
        assert store.get("k") == v
    st = store.stats()
    assert st["entries"] == 1 and st["live_blocks"] == 1
    assert_clean(store)


def test_get_into(store):
    v = make_value("k", 1, 3000)
    store.put("k", v)
    buf = bytearray(4096)
    assert store.get_into("k", buf) == 3000
    assert bytes(buf[:3000]) == v
    exact = np.zeros(3000, dtype=np.uint8)
    assert store.get_into("k", exact) == 3000 and exact.tobytes() == v
    small = bytearray(b"\xee" * 2999)
    assert store.get_into("k", small) is None
    assert small == bytearray(b"\xee" * 2999)  # untouched
    assert store.get_into("missing", buf) is None
    with pytest.raises(TypeError):
        store.get_into("k", bytes(4096))  # read-only destination


def test_get_into_any_writable_layout(open_store):
    """A single-key get copies into any C-contiguous writable buffer by its bytes, whatever its shape and
    item type; a value the copy engine splits over threads (2 MiB, two copy threads) lands whole."""
    s = open_store("64M", copy_threads=2)
    small, large = make_value("s", 1, 4096), make_value("l", 1, 2 << 20)
    assert s.put("s", small) and s.put("l", large)
    floats = np.zeros((32, 32), dtype=np.float32)
    assert s.get_into("s", floats) == 4096 and floats.tobytes() == small
    view = memoryview(bytearray(5000))[100:4196]
    assert s.get_into("s", view) == 4096 and view.tobytes() == small
    buf = (ctypes.c_char * 4096)()
    assert s.get_into("s", buf) == 4096 and bytes(buf) == small
    out = np.zeros(2 << 20, dtype=np.uint8)
    assert s.get_into("l", out) == 2 << 20 and out.tobytes() == large
    assert s.batch_get_into(["l", "s"], [bytearray(2 << 20), floats]) == [2 << 20, 4096]
    with pytest.raises(TypeError, match="contiguous"):
        s.get_into("s", np.zeros((64, 128), dtype=np.uint8)[:, :64])
    with pytest.raises(TypeError, match="read-only"):
        s.get_into("s", np.frombuffer(bytes(4096), dtype=np.uint8))


def test_counters_publish_per_call_and_wrap_past_2_64(store):
    """Every call publishes this process's counters (a single-key get only the ones it changes); a
    count past 2**64 wraps in the slot instead of failing the call."""
    store.put("k", b"v" * 100)
    store.get_into("k", bytearray(100))
    store.get_into("missing", bytearray(100))
    st = store.stats()
    assert (st["puts"], st["hits"], st["misses"], st["bytes_read"]) == (1, 1, 1, 100)
    store._counters.values[COUNTER_NAMES.index("bytes_written")] += 2**64
    assert store.put("k2", b"w" * 10)
    assert store.stats()["bytes_written"] == 110


def test_exists_and_delete(store):
    store.put("k", b"v" * 100)
    assert store.exists("k") and store.batch_exists(["k", "x", "k"]) == [True, False, True]
    assert store.delete("k") is True
    assert store.delete("k") is False
    assert not store.exists("k") and store.get("k") is None
    assert store.stats()["live_blocks"] == 0
    assert_clean(store)


def test_batch_put_and_get(store):
    keys = [f"k{i}" for i in range(50)]
    values = [make_value(k, 1) for k in keys]
    assert store.batch_put(keys, values) == [True] * 50
    outs = [bytearray(len(v)) for v in values]
    assert store.batch_get_into(keys, outs) == [len(v) for v in values]
    assert all(bytes(o) == v for o, v in zip(outs, values))
    res = store.batch_get_into(["k0", "nope", "k1"], [bytearray(1 << 17), bytearray(8), bytearray(3)])
    assert res[0] == len(values[0]) and res[1] is None and res[2] is None
    assert store.batch_exists(keys + ["nope"]) == [True] * 50 + [False]


def test_batch_put_of_interleaved_sizes_indexes_every_key_under_its_own_digest(store):
    """A batch whose keys fall into several classes is placed class by class (not in key order): every
    key must still be published under its own digest, in its own shard."""
    keys = [f"mixed-{i}" for i in range(40)]
    values = [make_value(k, 1, 3000 if i % 3 else 9000) for i, k in enumerate(keys)]
    assert store.batch_put(keys, values) == [True] * 40
    assert all(store.get(k) == v for k, v in zip(keys, values))
    assert store.leading_hits(keys) == 40
    assert_clean(store)


def test_batch_put_skip_existing(store):
    assert store.put("old", make_value("old", 1, 1000))
    res = store.batch_put(["old", "new"], [make_value("old", 2, 1000), make_value("new", 2, 1000)],
                          skip_existing=True)
    assert res == [True, True]
    assert store.get("old") == make_value("old", 1, 1000)  # kept
    assert store.get("new") == make_value("new", 2, 1000)
    res = store.batch_put(["old"], [make_value("old", 3, 1000)])  # default overwrites
    assert res == [True] and store.get("old") == make_value("old", 3, 1000)


@pytest.mark.parametrize("n", [3, 40])  # the scalar and the vector path
def test_batch_put_pieces_tells_how_many_values_it_published(store, n):
    """With skip_existing and assume_absent a present key is skipped at publication, after its copy: the
    call still answers True for it, and `written` is how a caller counts what it really stored (the
    backend's bytes_written once counted a present key displaced from its home slot as written)."""
    keys = [f"w{i}" for i in range(n)]
    bufs = [np.frombuffer(make_value(k, 1, 4096), dtype=np.uint8) for k in keys]
    pieces = [[(b.ctypes.data, b.nbytes)] for b in bufs]
    half = n // 2
    assert store.batch_put(keys[:half], [b.tobytes() for b in bufs[:half]]) == [True] * half
    written: list = []
    res = store.batch_put_pieces(keys, pieces, skip_existing=True, assume_absent=True, written=written)
    assert res == [True] * n and written == [n - half]
    written = []
    assert store.batch_put_pieces(keys, pieces, skip_existing=True, assume_absent=True, written=written) == [True] * n
    assert written == [0]


def test_batch_put_same_key_twice(store):
    assert store.batch_put(["d", "d"], [make_value("d", 1, 900), make_value("d", 2, 900)]) == [True, True]
    assert store.get("d") == make_value("d", 2, 900)
    assert store.stats()["live_blocks"] == 1
    assert_clean(store)


def test_put_pieces_get_pieces(store):
    v = make_value("p", 1, 3 * 4096 + 100)
    parts = [np.frombuffer(v[:4096], np.uint8), np.frombuffer(v[4096:4096 * 3], np.uint8),
             np.frombuffer(v[4096 * 3:], np.uint8)]
    assert store.put_pieces("p", pieces_of(parts))
    assert store.get("p") == v
    dst = [np.zeros(1000, np.uint8), np.zeros(len(v) - 1000, np.uint8)]
    assert store.get_pieces("p", pieces_of(dst)) is True
    assert dst[0].tobytes() + dst[1].tobytes() == v


@pytest.mark.parametrize("delta", [-1, +1, -100, +4096])
def test_get_pieces_needs_the_exact_length(store, delta):
    v = make_value("p", 1, 10_000)
    store.put("p", v)
    dst = [np.full(5000, 0xAB, np.uint8), np.full(5000 + delta, 0xAB, np.uint8)]
    assert store.get_pieces("p", pieces_of(dst)) is False
    assert (dst[0] == 0xAB).all() and (dst[1] == 0xAB).all()  # nothing copied
    assert store.get_pieces("missing", pieces_of(dst)) is False
    assert store.batch_get_pieces(["p", "p"], [pieces_of(dst), [(dst[0].ctypes.data, 5000)] * 2]) == [False, True]


def test_value_too_large(open_store):
    s = open_store("16M", max_value="1M")
    assert s.max_value == 1 << 20
    assert s.put("max", b"m" * (1 << 20))
    assert s.get("max") == b"m" * (1 << 20)
    with pytest.raises(ValueTooLargeError):
        s.put("big", b"b" * ((1 << 20) + 1))
    assert s.get("big") is None
    # the batch path reports it per key instead of raising
    assert s.batch_put(["big", "ok"], [b"b" * ((1 << 20) + 1), b"ok"]) == [False, True]
    assert_clean(s)


def test_stats_keys_and_counts(store):
    st = store.stats()
    assert STATS_KEYS <= st.keys()
    assert st["entries"] == 0 and st["live_bytes"] == 0
    assert st["file_bytes"] == 16 << 20 and 0 < st["data_bytes"] < st["file_bytes"]
    store.put("a", b"x" * 5000)
    store.put("b", b"y" * 3000)
    store.get("a")
    store.get("zzz")
    store.get_into("b", bytearray(3000))
    st = store.stats()
    assert st["entries"] == 2 and st["live_bytes"] == 8000
    assert st["hits"] == 2 and st["misses"] == 1
    assert 0 < st["load_factor"] < 1 and st["probe_mean"] >= 1 and st["probe_max"] >= 1
    assert st["evictions"] == 0
    counts = store.counts()  # the counters alone, without the scan of the pool
    assert counts == {k: st[k] for k in counts} and {"hits", "misses", "puts", "evictions", "heals"} <= counts.keys()


def test_check_clean_after_mixed_use(store):
    for i in range(300):
        k = f"k{i % 70}"
        store.put(k, make_value(k, i, 100 + (i * 7919) % 60_000))
        if i % 7 == 0:
            store.delete(f"k{(i * 3) % 70}")
    report = store.check()
    assert report.ok, report.problems
    assert report.checked_entries == store.stats()["entries"]
    report = store.check(repair=True)
    assert report.ok and store.check().ok


def test_values_survive_reopen(pool_path):
    with Store.open(pool_path, "8M", create=True) as s:
        s.put("k", make_value("k", 4, 2000))
    with Store.open(pool_path) as s:
        assert s.get("k") == make_value("k", 4, 2000)
        assert s.stats()["processes"] == 1


def test_closed_store_refuses_everything(open_store):
    s = open_store("4M")
    s.put("k", b"v")
    s.close()
    s.close()  # idempotent
    calls = [lambda: s.put("k", b"v"), lambda: s.get("k"), lambda: s.get_into("k", bytearray(8)),
             lambda: s.exists("k"), lambda: s.delete("k"), lambda: s.batch_put(["k"], [b"v"]),
             lambda: s.batch_get_into(["k"], [bytearray(8)]), lambda: s.batch_exists(["k"]),
             lambda: s.put_pieces("k", []), lambda: s.get_pieces("k", []), lambda: s.stats(), lambda: s.counts(),
             lambda: s.check(), lambda: s.declare_size(8192)]
    for call in calls:
        with pytest.raises(PoolClosedError):
            call()


def test_detached_process_leaves_the_table(pool_path):
    with Store.open(pool_path, "8M", create=True) as a:
        with Store.open(pool_path) as b:
            assert a.stats()["processes"] == 2
            b.put("x", b"1" * 10)
        st = a.stats()
        assert st["processes"] == 1
        assert st["puts"] >= 1  # a detached process's counters are kept (retired)


# ---------------------------------------------------------------- untrusted input (FORMAT.md section 11)

def test_index_entry_not_naming_a_block_start_is_a_miss(store):
    """An entry whose offset is moved inside the block must not serve shifted bytes."""
    v = make_value("k", 1, 12_000)
    store.put("k", v)
    d = key_digest("k")
    s = store.index.shard_of(d)
    found, pos = store.index._find_pos(s, d)
    word, off = found
    ENTRY_STRUCT.pack_into(store.mm, store.index.entry_off(s, pos), d, word, off + 64)
    got = store.get("k")
    assert got is None or check_value("k", got)
    assert store.get_into("k", bytearray(20_000)) is None


@pytest.mark.parametrize("offset", [-1 & (2**64 - 1), 1 << 62, None])
def test_index_entry_outside_the_data_area_is_a_miss(store, offset):
    store.put("k", make_value("k", 1, 5000))
    d = key_digest("k")
    s = store.index.shard_of(d)
    found, pos = store.index._find_pos(s, d)
    off = store.geo.data_bytes - 1 if offset is None else offset
    ENTRY_STRUCT.pack_into(store.mm, store.index.entry_off(s, pos), d, found[0], off)
    assert store.get("k") is None and not store.exists("k")
    report = store.check()
    assert not report.ok
    assert store.check(repair=True).ok
    assert store.check().ok
    assert store.put("k", make_value("k", 2, 5000)) and check_value("k", store.get("k"))


def test_block_meta_length_beyond_the_block_is_a_miss(store):
    store.put("k", make_value("k", 1, 5000))
    off = store.index.find(key_digest("k"))[1]
    m = store.alloc.meta_off(off)
    store.mm[m + 24:m + 28] = (store.geo.data_bytes).to_bytes(4, "little")  # runs past the data area
    store.mm[m + META_FLAGS_OFF] = length_flags(store.geo.data_bytes)  # with a check that agrees
    assert store.get("k") is None
    assert store.get_into("k", bytearray(1 << 24)) is None


def test_a_forked_child_cannot_use_the_parents_store(store):
    """fork() copies an open Store with the parent's slot, SLOT lock and lock descriptions: the child
    cannot act as the parent (every call raises PoolClosedError), and its close() leaves the parent
    attached and its pool clean."""
    import os
    v = make_value("a", 1, 5000)
    assert store.put("a", v)
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what went wrong
        code = 0
        try:
            try:
                store.get("a")
                code = 1
            except PoolClosedError:
                pass
            store.close()
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("a") == v and store.put("b", make_value("b", 1, 5000))
    assert store.stats()["processes"] == 1
    assert_clean(store, reap=False)


def test_pool_processes_tell_the_live_from_the_dead(store):
    """pool_processes(): the claimed slots, alive while their process lives. A SIGKILLed process is dead at
    once (the kernel drops its SLOT lock), before anything reaps its slot."""
    def attached():
        return sum(1 for p in pool_processes(store) if p["alive"])
    assert attached() == 1
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            Store.open(store.path)
            os.write(ready_w, b"1")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    assert attached() == 2 and len(pool_processes(store)) == 2
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert attached() == 1 and len(pool_processes(store)) == 2  # dead, not yet reaped
    assert store.reap_dead() == 1 and attached() == 1 and len(pool_processes(store)) == 1


# ---------------------------------------------------------------- bad input is refused, never half-honoured

@pytest.mark.parametrize("make", [lambda: np.zeros((64, 8), np.uint8)[:, 2],            # a column slice
                                  lambda: np.zeros((16, 32), np.uint8, order="F"),        # Fortran order
                                  lambda: memoryview(bytearray(256))[::2]])               # strided memoryview
def test_non_contiguous_buffers_are_refused_not_silently_copied(open_store, make):
    s = open_store()
    s.put("k", bytes(range(64)))
    for call in (lambda b: s.get_into("k", b), lambda b: s.batch_get_into(["k"], [b]), lambda b: s.put("k2", b)):
        with pytest.raises(TypeError, match="contiguous"):
            call(make())


def test_batch_get_into_needs_one_buffer_per_key(open_store):
    s = open_store()
    s.put("a", b"1")
    s.put("b", b"2")
    with pytest.raises(ValueError, match="1 destination buffers for 2 keys"):
        s.batch_get_into(["a", "b"], [bytearray(1)])


@pytest.mark.parametrize("pieces", [[("a", 5)], [(b"xyzzy", 5)], [(1.5, 5)], [(0, 5)], [(12345, -1)]])
def test_pieces_that_are_not_integer_pointers_are_refused(open_store, pieces):
    s = open_store()
    with pytest.raises((TypeError, ValueError)):
        s.put_pieces("k", pieces)
    with pytest.raises((TypeError, ValueError)):
        s.batch_put_pieces([f"k{i}" for i in range(40)], [pieces] * 40)  # the vector path too
    assert s.get("k") is None


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 1e400, 0, -1, "soon", 10 ** 7])
def test_lock_timeouts_that_would_wait_forever_are_refused(pool_path, timeout):
    with pytest.raises(ValueError, match="timeout"):
        Store.open(pool_path, "4M", create=True, timeout=timeout)
    assert not os.path.exists(pool_path)


@pytest.mark.parametrize("slots", [-1, 0, 1.5])
def test_bad_index_slots_are_refused(pool_path, slots):
    with pytest.raises(ValueError, match="index_slots"):
        Store.open(pool_path, "4M", create=True, index_slots=slots)


@pytest.mark.parametrize("path", ["", "/nonexistent-dir-maru/pool"])
def test_a_path_that_cannot_be_a_pool_is_a_store_error(path):
    from maru_shm import StoreError
    with pytest.raises(StoreError):
        Store.open(path, "4M", create=True)
    with pytest.raises(StoreError):
        Store.open(path)


# ---------------------------------------------------------------- pinned values survive eviction

def test_a_pinned_value_survives_a_pool_that_evicts_everything_else(open_store):
    s = open_store("8M")
    assert s.put("__ns__", b"nonce-0123456789") and s.pin("__ns__")
    assert not s.pin("absent")
    for i in range(3000):  # 4 KiB and 128 KiB values: many times the pool, in the pinned value's class too
        s.put(f"filler{i}", bytes([i % 251]) * (4096 if i % 3 else 131072))
    st = s.stats()
    assert st["evictions"] > 1000
    assert s.get("__ns__") == b"nonce-0123456789"
    assert s.check().ok


def test_a_pin_ends_with_its_value_and_is_bounded(open_store):
    from maru_shm import StoreError
    from maru_shm.store import PIN_LIMIT
    s = open_store("8M")
    s.put("k", b"v1")
    assert s.pin("k")
    s.put("k", b"v2")  # a new lifetime: not pinned until pinned again
    d = key_digest("k")
    m = s.alloc.meta_off(s.index.find(d)[1])
    assert not s.mm[m + META_FLAGS_OFF] & FLAG_PINNED  # the flags byte also holds the length's check
    with pytest.raises(ValueTooLargeError):
        s.put("big", bytes(8192)) and s.pin("big")
    for i in range(PIN_LIMIT - 1):
        s.put(f"p{i}", b"x")
        assert s.pin(f"p{i}")
    s.put("one-too-many", b"x")
    with pytest.raises(StoreError, match="pinned"):
        s.pin("one-too-many")
    assert s.pin("k")  # re-pinning a key already counted is fine


def test_values_of_the_size_a_pool_is_created_for_fill_its_data_area_before_its_index(pool_path):
    """1 KiB values in a pool created for them: 95 % of the data area is written and nothing is evicted (a pool
    with the default index, one slot per 16 KiB, evicts from a full shard at about a twentieth of it)."""
    with Store.open(pool_path, "16M", create=True, value_size=1024) as s:
        s.declare_size(1024)
        n = s.geo.data_bytes // 1024 * 95 // 100
        value = os.urandom(1024)
        for i in range(0, n, 512):
            keys = [f"v{j}" for j in range(i, min(n, i + 512))]
            assert all(s.batch_put(keys, [value] * len(keys)))
        st = s.stats()
        assert st["evictions"] == 0 and st["entries"] >= n
        assert st["live_bytes"] == n * 1024 and s.batch_exists([f"v{j}" for j in range(n)]) == [True] * n


# The Store's face: the calls SGLang's backend, the command line and the benchmarks make, and read-only
# views of the attached pool (its geometry, and for the store's own modules and the tests the mapping, lock
# table, index and allocator, and slot_alive: what the checks ask of the pool they check). Its parts (`_att`, `_procs`, `_reader`, ...) are internal.
STORE_FACE = {
    "open", "close", "populate", "lost", "count_heal", "reap_dead", "declare_size",
    "get", "get_into", "get_pieces", "batch_get_into", "batch_get_pieces", "exists", "batch_exists",
    "leading_hits", "length_of", "maybe_present", "resolve", "touch",
    "put", "put_pieces", "batch_put", "batch_put_pieces", "delete", "pin",
    "check", "counts", "stats", "slot_alive",
    "path", "created", "slot", "timeout", "max_value", "geo", "policy", "mm", "locks", "index", "alloc",
}


def test_the_store_face_is_what_its_clients_call(store):
    public = {n for n in set(dir(Store)) | set(vars(store)) if not n.startswith("_")}
    assert public == STORE_FACE, (sorted(public - STORE_FACE), sorted(STORE_FACE - public))
