"""HiCache v2 storage API (hybrid models) on MaruStorage, checked against SGLang's own HiCacheFile.

Every pool here is a real SGLang host pool over a real SGLang device pool built on CPU
(hicache_helpers): MHA / MLA KV, MambaPoolHost over MambaPool, MHA sliding-window and draft pools,
DSAIndexerPoolHost over DSATokenToKVPool, DeepSeek-V4's DeepSeekV4PagedHostPool over
DeepSeekV4SingleKVPool (compressed c4 / c128 KV and the SWA pool) and its LogicalHostPool KV anchor.
SGLang builds all of them without a GPU, so no stand-in pool is used. Not covered: DeepSeek-V4's
compress-state pools (DeepSeekV4StateHostPool, TRAILING sidecars of SWA: the same code path as swa here).

The differential tests run the same sequence of batch_set_v2 / batch_exists_v2 / batch_get_v2, and of
the KV page calls SGLang's cache controller makes around them, against HiCacheFile and MaruStorage,
with gaps, partial writes and evictions, and compare every result field by field. HiCacheFile 0.5.23
raises on BLOCK_GROUPS, so that policy is checked against its docstring (PoolHitPolicy in
hicache_storage.py) and through the hybrid controller's own hit query.
"""

from __future__ import annotations

import inspect
import os
import random

import pytest

pytest.importorskip("sglang", exc_type=ImportError,
                    reason="sglang cannot be imported: these tests need real SGLang 0.5.23 host pools and its backend "
                           "factory (pip install -r requirements.txt)")

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (PrefetchOperation,  # noqa: E402
                                                                       StorageOperation)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import hicache_helpers as hh  # noqa: E402
from hicache_helpers import prompt_keys, slot_indices  # noqa: E402
from maru_sglang import hybrid  # noqa: E402
from maru_shm import Store  # noqa: E402
from maru_shm.format.layout import KIND_EXACT  # noqa: E402

pytestmark = pytest.mark.sglang

ALL, TRAIL, BLOCKS = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.BLOCK_GROUPS
P = 8  # pages [0, P) of every host pool are write sources, pages [P, 2P) read destinations


# --------------------------------------------------------------------------- scenarios
def build(scenario: str):
    """(anchor, pools, shape, device, mla). shape[name] = (hit policy, trailing window, "kv" if KV-derived else
    "own"); device: the device KV pool the cache controller is built over."""
    if scenario == "mamba_swa":  # MHA KV + Mamba state (Qwen3-Next-like) + a sliding window + an MHA draft pool
        anchor = hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=2, head_num=2, head_dim=64)
        device = hh.make_mha_device(4, 4 * 2 * P, layer_num=2, head_num=2, head_dim=64)
        pools = {"mamba": hh.make_mamba_host(2 * P),
                 "swa": hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=1, head_num=2,
                                         head_dim=64),
                 "draft": hh.make_mha_host("page_first_direct", page_size=4, pages=2 * P, layer_num=1, head_num=1,
                                           head_dim=64)}
        shape = {"mamba": (TRAIL, 1, "own"), "swa": (TRAIL, 3, "own"), "draft": (ALL, 0, "kv")}
        return anchor, pools, shape, device, False
    if scenario == "dsv4":  # DeepSeek-V4: logical KV anchor, compressed KV at two ratios, SWA with its own page
        anchor = hh.make_logical_anchor(256, 2 * P)
        pools = {"deepseek_v4_c4": hh.make_v4_host("deepseek_v4_c4", 4, pages=2 * P, layers=3),
                 "deepseek_v4_c128": hh.make_v4_host("deepseek_v4_c128", 128, pages=2 * P, layers=3),
                 "swa": hh.make_v4_host("swa", 1, page_size=128, pages=2 * P, layers=3)}
        shape = {"deepseek_v4_c4": (ALL, 0, "kv"), "deepseek_v4_c128": (ALL, 0, "kv"), "swa": (TRAIL, 2, "own")}
        return anchor, pools, shape, hh.make_v4_device(256, 2 * P, layers=3), True
    if scenario == "dsa":  # MLA KV + DSA indexer (KV-derived) + Mamba state (Kimi-like)
        anchor = hh.make_mla_host("page_first_direct", page_size=64, pages=2 * P, layer_num=2)
        pools = {"indexer": hh.make_dsa_indexer_host(anchor), "mamba": hh.make_mamba_host(2 * P)}
        shape = {"indexer": (ALL, 0, "kv"), "mamba": (TRAIL, 1, "own")}
        return anchor, pools, shape, hh.make_mla_device(64, 64 * 2 * P, layer_num=2), True
    raise ValueError(scenario)


def _result(r):
    return r.kv_hit_pages, dict(r.extra_pool_hit_pages), r.restorable_prefix_pages


class Twin:
    """One set of real host pools and two of SGLang's HybridCacheControllers on it, one attaching MaruStorage
    ("dynamic"), one SGLang's HiCacheFile ("file"); each controller made its backend itself."""

    def __init__(self, scenario: str, pool_path: str, file_dir: str, *, size="64M", maru: dict | None = None):
        self.anchor, self.pools, self.shape, device, mla = build(scenario)
        self.logical = self.anchor.kv_buffer is None
        if not self.logical:
            hh.fill_random_pages(self.anchor, P, seed=11)
        for i, host in enumerate(self.pools.values()):
            hh.fill_random_pages(host, P, seed=20 + i)
        group = hh.host_pool_group(self.anchor, self.pools)
        os.makedirs(file_dir, exist_ok=True)
        model = hh.DEEPSEEK if mla else hh.LLAMA
        extra = {"maru": ("dynamic", hh.extra_config(pool_path, size, **(maru or {}))),
                 "file": ("file", {"file_storage_path": file_dir})}
        self.ctrl = {side: hh.hybrid_controller(device, group, kind, cfg, model=model)
                     for side, (kind, cfg) in extra.items()}
        self.maru, self.file = self.ctrl["maru"].storage_backend, self.ctrl["file"].storage_backend
        self.log: list[str] = []

    def close(self):
        for ctrl in self.ctrl.values():
            ctrl.detach_storage_backend()  # stops its storage threads, closes its backend

    def host(self, name):
        return self.anchor if name == "kv" else self.pools[name]

    # ---- operations, each run on both backends and compared
    def same(self, what, m, f):
        self.log.append(f"{what} -> {m}")
        assert m == f, f"MaruStorage and HiCacheFile differ on {what}:\n  maru {m}\n  file {f}\n" + \
            "\n".join(self.log[-12:])

    def set_kv(self, keys):
        idx = slot_indices(self.anchor, 0, len(keys))
        self.same(f"KV set {len(keys)}", self.ctrl["maru"].page_set_func(keys, idx),
                  self.ctrl["file"].page_set_func(keys, idx))

    def transfer(self, name, keys, first_page, *, policy=None, read=False):
        pol, _, src = self.shape[name]
        idx = slot_indices(self.pools[name], first_page + (P if read else 0), len(keys))
        return PoolTransfer(name=PoolName(name), host_indices=idx, keys=list(keys), hit_policy=policy or pol,
                            indices_from_pool=PoolName.KV if src == "kv" else None)

    def set_v2(self, specs):
        """specs: [(name, keys, first source page)] in one batch_set_v2 call."""
        calls = {side: getattr(self, side).batch_set_v2([self.transfer(*s) for s in specs])
                 for side in ("maru", "file")}
        self.same(f"batch_set_v2 {[(n, len(k), p) for n, k, p in specs]}", calls["maru"], calls["file"])
        return calls["maru"]

    def exists_v2(self, keys, transfers):
        r = {side: _result(getattr(self, side).batch_exists_v2(keys, transfers, None)) for side in ("maru", "file")}
        self.same(f"batch_exists_v2 {len(keys)} pages {[(pool_name(t.name), t.hit_policy.value) for t in transfers]}",
                  r["maru"], r["file"])
        return r["maru"]

    def query(self, names=None, order=None):
        out = []
        for name in names or self.shape:
            pol, w, _ = self.shape[name]
            out.append(PoolTransfer(name=PoolName(name), keys=["__placeholder__"] * w if pol == TRAIL else None,
                                    hit_policy=pol))
        return out

    def get_v2(self, name, keys, dest_page=0):
        t_host = self.pools[name]
        res, data = {}, {}
        for side in ("maru", "file"):
            t = self.transfer(name, keys, dest_page, read=True)
            hh.zero_pool_pages(t_host, t.host_indices, len(keys))
            res[side] = getattr(self, side).batch_get_v2([t])
            data[side] = hh.pool_page_bytes(t_host, t.host_indices, len(keys))
        self.same(f"batch_get_v2 {name} {len(keys)}", res["maru"], res["file"])
        self.same(f"bytes loaded by batch_get_v2 {name}", hh.digests(data["maru"]), hh.digests(data["file"]))
        return res["maru"][PoolName(name)], data["maru"]

    def get_kv(self, keys):
        idx = slot_indices(self.anchor, P, len(keys))
        res, data = {}, {}
        for side in ("maru", "file"):
            if not self.logical:
                hh.zero_pool_pages(self.anchor, idx, len(keys))
            op = PrefetchOperation(CacheRequestHandle("r", 0), [])
            res[side] = self.ctrl[side].page_get_func(op, keys, idx)
            data[side] = [] if self.logical else hh.digests(hh.pool_page_bytes(self.anchor, idx, len(keys)))
        self.same(f"KV get {len(keys)}", res["maru"], res["file"])
        # the controller uses the leading run only (the generic path stops at the first miss, v1 does not)
        self.same("bytes loaded by KV get", data["maru"][:res["maru"]], data["file"][:res["file"]])

    def evict(self, name, key):
        """Remove one page of one pool from both backends; both must have held it or neither."""
        d = self.maru.hybrid.store_digests(PoolName(name), [key])[0]
        had_m = hh.delete_digest(self.maru.store, d.tobytes())
        path = os.path.join(self.file.file_path, self.file._get_component_key(key, PoolName(name)) + ".bin")
        had_f = os.path.exists(path)
        if had_f:
            os.remove(path)
        self.same(f"evict {name} page", had_m, had_f)


def pool_name(n):
    return hybrid.pool_name(n)


@pytest.fixture
def twin(pool_path, tmp_path):
    made = []

    def make(scenario, **kw):
        t = Twin(scenario, pool_path, str(tmp_path / "hicache_file"), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


# --------------------------------------------------------------------------- 1. page sizes and size classes
def _exact_class_in_file(path: str, nbytes: int) -> bool:
    with Store.open(path) as s:
        info = s.alloc.class_for(nbytes)
        return info is not None and info.kind == KIND_EXACT and info.block == nbytes


@pytest.mark.parametrize("scenario", ["dsv4", "mamba_swa", "dsa"])
def test_every_pool_page_size_comes_from_its_host_pool(twin, pool_path, scenario):
    t = twin(scenario)
    for name, host in t.pools.items():
        spec = t.maru.hybrid.pools[name]
        ptrs, sizes = host.get_page_buffer_meta(slot_indices(host, 0, 1))
        assert spec.page_bytes == sum(sizes) and spec.pieces_per_page == len(ptrs), name
        assert spec.page_size == host.page_size
        if spec.page_bytes >= t.maru.store.geo.granule:
            assert _exact_class_in_file(pool_path, spec.page_bytes), name
    if scenario == "dsv4":
        c4, c128 = t.pools["deepseek_v4_c4"], t.pools["deepseek_v4_c128"]
        # SGLang's V4 pools report the bytes of one page row per layer as "size per token": the page size
        # must come from the pieces, not from get_size_per_token() * page_size
        assert c4.get_size_per_token() * c4.page_size != t.maru.hybrid.pools["deepseek_v4_c4"].page_bytes
        assert t.maru.page_bytes == 0  # logical anchor: a KV page is an empty value, as HiCacheFile's empty file
        sizes = sorted(s.page_bytes for s in t.maru.hybrid.pools.values())
        assert sizes[-1] / sizes[0] >= 20  # several size classes in one request
        assert c128.page_size == c4.page_size == t.anchor.page_size  # KV-derived: FULL logical indices


def test_pool_that_cannot_address_its_pages_is_refused_at_registration(make_instance):
    host, backend = make_instance(kind="mha", page_size=1, pages=4)
    side = hh.make_mamba_host(4, side_state=True)  # a Mamba pool with a slot side state
    with pytest.raises(ValueError, match=r"pool 'mamba' \(MambaPoolHost.*cannot describe its pages.*side states"):
        backend.register_mem_host_pool_v2(side, PoolName.MAMBA)
    with pytest.raises(ValueError, match=r"pool 'swa' \(LogicalHostPool.*holds no page buffers"):
        backend.register_mem_host_pool_v2(hh.make_logical_anchor(4, 4), PoolName.SWA)
    assert backend.hybrid.pools == {}
    ok = hh.make_mamba_host(4)
    backend.register_mem_host_pool_v2(ok, PoolName.MAMBA)
    assert backend.hybrid.pools["mamba"].page_bytes == ok.get_size_per_token()


# --------------------------------------------------------------------------- 2. keys and namespaces
def test_pools_sharing_page_hashes_never_collide(twin):
    t = twin("mamba_swa")
    keys = prompt_keys(3, "shared")
    t.set_kv(keys)
    # the same three hashes in three pools, from different bytes
    t.set_v2([("draft", keys, 0), ("swa", keys, 3), ("mamba", keys[2:], 5)])
    t.set_v2([("mamba", keys[:1], 6)])
    got, data = t.get_v2("swa", keys)
    assert got == [True] * 3 and data == hh.pool_page_bytes(t.pools["swa"], slot_indices(t.pools["swa"], 3, 3), 3)
    got, data = t.get_v2("draft", keys)
    assert got == [True] * 3 and data == hh.pool_page_bytes(t.pools["draft"], slot_indices(t.pools["draft"], 0, 3), 3)
    got, data = t.get_v2("mamba", [keys[2], keys[1], keys[0]])
    mamba = t.pools["mamba"]
    assert got == [True, False, True]
    assert [data[0], data[2]] == hh.pool_page_bytes(mamba, torch.tensor([5, 6]), 2)
    digests = [d.tobytes() for n in ("kv", *t.pools) for d in t.maru.hybrid.store_digests(PoolName(n), keys)]
    assert len(set(digests)) == 3 * 4


def test_mamba_state_is_per_tp_rank_even_for_mla(pool_path, tmp_path):
    """MLA KV and the DSA indexer are shared by the TP ranks; Mamba state is not (HiCacheFile keys it with the
    TP suffix, HybridCacheController.should_backup writes it on every rank). Same answers as HiCacheFile."""
    made = []
    try:
        ranks = []
        for rank in (0, 1):
            anchor = hh.make_mla_host("page_first_direct", page_size=64, pages=2 * P, layer_num=2)
            pools = {"indexer": hh.make_dsa_indexer_host(anchor), "mamba": hh.make_mamba_host(2 * P)}
            for i, h in enumerate([anchor, *pools.values()]):
                hh.fill_random_pages(h, P, seed=100 * rank + i)
            m = hh.create_hybrid_maru(pool_path, anchor, pools, mla=True, tp_rank=rank, tp_size=2)
            made.append(m)
            f = hh.create_hybrid_file(str(tmp_path / "f"), anchor, pools, mla=True, tp_rank=rank, tp_size=2)
            ranks.append((anchor, pools, m, f))
        assert [m.is_writer for _, _, m, _ in ranks] == [True, False]
        keys = prompt_keys(4, "kimi")
        def mamba_t(key, slot):
            return PoolTransfer(name=PoolName.MAMBA, keys=[key], hit_policy=TRAIL, host_indices=torch.tensor([slot]))

        (a0, p0, m0, f0), (a1, p1, m1, f1) = ranks
        # rank 0 (the storage writer) backs up KV, indexer and its Mamba state at page 4
        for b in (m0, f0):
            if b is m0:
                assert b.batch_set_v1(keys, slot_indices(a0, 0, 4)) == [True] * 4
            else:
                assert b.batch_set(keys, [a0.get_data_page(i * 64) for i in range(4)])
            res = b.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys, host_indices=slot_indices(a0, 0, 4),
                                               indices_from_pool=PoolName.KV), mamba_t(keys[3], 1)])
            assert res == {PoolName.INDEXER: [True] * 4, PoolName.MAMBA: [True]}
        def q():
            return [PoolTransfer(name=PoolName.INDEXER),
                    PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAIL)]

        r0 = [_result(b.batch_exists_v2(keys, q())) for b in (m0, f0)]
        assert r0[0] == r0[1] == (4, {"kv": 4, "indexer": 4, "mamba": 4}, [4])
        # rank 1 sees the shared KV and indexer pages, but not rank 0's Mamba state
        r1 = [_result(b.batch_exists_v2(keys, q())) for b in (m1, f1)]
        assert r1[0] == r1[1] == (0, {"kv": 4, "indexer": 4}, [])
        # rank 1 writes its own Mamba state (the only write should_backup leaves to a non-writer MLA rank)
        assert m1.batch_set_v2([mamba_t(keys[1], 2)]) == f1.batch_set_v2([mamba_t(keys[1], 2)])
        r1 = [_result(b.batch_exists_v2(keys, q())) for b in (m1, f1)]
        assert r1[0] == r1[1] == (2, {"kv": 4, "indexer": 4, "mamba": 2}, [2])
        # a non-writer's write of a shared pool is acknowledged without writing (as batch_set_v1 for MLA KV)
        other = prompt_keys(2, "other")
        assert m1.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=other, host_indices=slot_indices(a1, 0, 2),
                                             indices_from_pool=PoolName.KV)]) == {PoolName.INDEXER: [True, True]}
        assert m0.batch_exists_v2(other, q()).extra_pool_hit_pages == {}
        got = m1.batch_get_v2([mamba_t(keys[1], P)])
        assert got == {PoolName.MAMBA: [True]}
        assert hh.pool_page_bytes(p1["mamba"], torch.tensor([P]), 1) == \
            hh.pool_page_bytes(p1["mamba"], torch.tensor([2]), 1)
    finally:
        for m in made:
            m.close()


def test_other_models_and_pool_formats_see_no_pool_pages(twin, pool_path, tmp_path):
    t = twin("mamba_swa")
    keys = prompt_keys(4, "fmt")
    t.set_kv(keys)
    t.set_v2([("mamba", keys[3:], 0)])
    t.set_v2([("draft", keys, 0)])
    assert t.exists_v2(keys, t.query(["draft", "mamba"]))[:2] == (4, {"kv": 4, "draft": 4, "mamba": 4})
    anchor, pools, *_ = build("mamba_swa")
    other = hh.create_hybrid_maru(pool_path, anchor, pools, mla=False, model="Qwen/Qwen3-Next-80B-A3B-Instruct")
    wider = hh.create_hybrid_maru(pool_path, anchor, dict(pools, mamba=hh.make_mamba_host(2 * P, layers=3)),
                                  mla=False)
    try:
        assert _result(other.batch_exists_v2(keys, t.query(["draft", "mamba"]))) == (0, {}, [])
        # same model and KV format, Mamba state of another layer count: KV and draft pages hit, Mamba never
        assert _result(wider.batch_exists_v2(keys, t.query(["draft", "mamba"]))) == (0, {"kv": 4, "draft": 4}, [])
    finally:
        other.close()
        wider.close()


# --------------------------------------------------------------------------- 3. differential sequences
def _run_random_sequence(t: Twin, seed: int, n_ops: int) -> None:
    rnd = random.Random(seed)
    base = prompt_keys(P, f"chain-{seed}")
    cut = rnd.randint(2, P - 2)
    chains = [base, base[:cut] + prompt_keys(P - cut, f"branch-{seed}"), prompt_keys(P, f"other-{seed}")]
    names = list(t.shape)
    for _ in range(n_ops):
        c = rnd.choice(chains)
        op = rnd.random()
        if op < 0.35:  # backup: KV (sometimes only a part), then every pool with gaps / partial windows
            n = rnd.randint(1, len(c))
            kv_n = n if rnd.random() < 0.75 else rnd.randint(0, n)
            if kv_n:
                t.set_kv(c[:kv_n])
            calls = []
            for name in names:
                pol, w, src = t.shape[name]
                if rnd.random() < 0.2:
                    continue  # this pool is not written at all
                if pol == ALL:
                    pos = [i for i in range(n) if rnd.random() < 0.85]
                    runs, start = [], None
                    for i in range(n + 1):
                        if i in pos and start is None:
                            start = i
                        elif i not in pos and start is not None:
                            runs.append((start, i))
                            start = None
                    calls += [[(name, c[a:b], a)] for a, b in runs]
                else:
                    for k in sorted(rnd.sample(range(1, n + 1), min(n, rnd.randint(1, 2)))):
                        lo = max(0, k - w)
                        calls.append([(name, c[lo:k], lo)])
            if len(calls) > 1 and rnd.random() < 0.5:  # several pools in one call, at most one transfer each
                merged, seen, rest = [], set(), []
                for call in calls:
                    (merged if call[0][0] not in seen else rest).append(call[0])
                    seen.add(call[0][0])
                calls = [merged] + [[x] for x in rest]
            rnd.shuffle(calls)
            for call in calls:
                t.set_v2(call)
        elif op < 0.65:  # hit query over a prefix, pools in a random order, sometimes not all of them
            m = rnd.randint(1, len(c))
            chosen = [n for n in names if rnd.random() < 0.85] or names[:1]
            rnd.shuffle(chosen)
            transfers = t.query(chosen)
            if rnd.random() < 0.15:
                transfers.insert(rnd.randint(0, len(transfers)), PoolTransfer(name=PoolName.KV, hit_policy=ALL))
            t.exists_v2(c[:m], transfers)
        elif op < 0.85:  # loads, including keys that were never written or were evicted
            name = rnd.choice(names + ["kv"])
            if name == "kv":
                t.get_kv(c[:rnd.randint(1, len(c))])
                continue
            pol, w, _ = t.shape[name]
            if pol == ALL:
                a = rnd.randint(0, len(c) - 1)
                keys = c[a:rnd.randint(a + 1, len(c))]
            else:
                k = rnd.randint(1, len(c))
                keys = c[max(0, k - w):k]
            t.get_v2(name, keys)
        else:  # eviction of one page of one pool (KV included)
            t.evict(rnd.choice(names + ["kv", "kv"]), rnd.choice(c))
    # final sweep: every prefix of every chain, every pool
    for c in chains:
        for m in range(1, len(c) + 1):
            t.exists_v2(c[:m], t.query())


@pytest.mark.parametrize("scenario, seed", [("mamba_swa", 1), ("mamba_swa", 2), ("dsv4", 3), ("dsv4", 4),
                                            ("dsa", 5)])
def test_same_answers_as_hicache_file_on_random_sequences(twin, scenario, seed):
    _run_random_sequence(twin(scenario), seed, n_ops=45)


def test_trailing_window_holes_and_the_restorable_set(twin):
    """A TRAILING pool restores only where its window is complete: 5 can be restorable while 4 is not."""
    t = twin("mamba_swa")
    keys = prompt_keys(8, "holes")
    t.set_kv(keys)
    t.set_v2([("mamba", keys[1:2], 1)])
    t.set_v2([("mamba", keys[4:5], 4)])
    t.set_v2([("mamba", keys[7:8], 7)])
    t.set_v2([("swa", keys[0:3], 0)])
    t.set_v2([("swa", keys[2:5], 2)])
    t.set_v2([("draft", keys[:6], 0)])
    assert t.exists_v2(keys, t.query(["mamba"])) == (8, {"kv": 8, "mamba": 8}, [2, 5, 8])
    assert t.exists_v2(keys, t.query(["mamba", "swa"])) == (5, {"kv": 8, "mamba": 8, "swa": 5}, [2, 5])
    assert t.exists_v2(keys, t.query(["mamba", "swa", "draft"])) == (5, {"kv": 8, "mamba": 8, "swa": 5, "draft": 6},
                                                                      [2, 5])
    assert t.exists_v2(keys, t.query(["draft", "mamba"])) == (5, {"kv": 8, "draft": 6, "mamba": 8}, [2, 5])
    # a pool that leaves nothing restorable stops the walk: later pools get no verdict at all
    t.evict("mamba", keys[1])
    t.evict("mamba", keys[4])
    assert t.exists_v2(keys[:6], t.query(["mamba", "draft"])) == (0, {"kv": 6}, [])


# --------------------------------------------------------------------------- 5. eviction is pool-aware
def test_evicted_kv_page_ends_the_prefix_and_orphans_never_count(twin):
    t = twin("mamba_swa")
    keys = prompt_keys(8, "orphans")
    t.set_kv(keys)
    t.set_v2([("draft", keys, 0), ("mamba", keys[3:4], 3)])
    t.set_v2([("mamba", keys[7:8], 7)])
    t.set_v2([("swa", keys[5:8], 5)])
    full = t.exists_v2(keys, t.query())
    assert full == (8, {"kv": 8, "mamba": 8, "swa": 8, "draft": 8}, [8])
    t.evict("kv", keys[5])  # the KV page goes; draft, swa and mamba pages after it become orphans
    assert t.exists_v2(keys, t.query(["mamba", "draft"])) == (4, {"kv": 5, "mamba": 4, "draft": 5}, [4])
    # swa's only window [5, 8) lies beyond the KV prefix: no prefix is restorable, and no later pool is asked
    assert t.exists_v2(keys, t.query(["swa", "mamba"])) == (0, {"kv": 5}, [])
    assert hh.digests_present(t.maru.store, t.maru.hybrid.store_digests(PoolName.MAMBA, [keys[7]]))[0]  # orphans
    assert hh.digests_present(t.maru.store, t.maru.hybrid.store_digests(PoolName.SWA, [keys[6]]))[0]
    t.evict("draft", keys[2])  # an evicted pool page cuts that pool's prefix
    assert t.exists_v2(keys, t.query(["mamba", "draft"])) == (0, {"kv": 5, "mamba": 4, "draft": 2}, [])
    t.set_v2([("draft", keys[2:3], 2), ("mamba", keys[1:2], 1)])
    assert t.exists_v2(keys, t.query(["mamba", "draft"])) == (4, {"kv": 5, "mamba": 4, "draft": 5}, [2, 4])


def test_real_store_eviction_keeps_hicache_file_semantics(pool_path, tmp_path):
    """Fill a small pool to 3x its size so the store itself evicts pages of every pool; then HiCacheFile holding
    exactly the pages that survived gives the same answers, KV-less orphans included."""
    _, pools, *_ = build("mamba_swa")
    anchor = hh.make_mha_host("page_first_direct", page_size=16, pages=2 * P, layer_num=2, head_num=2, head_dim=64)
    pools["draft"] = hh.make_mha_host("page_first_direct", page_size=16, pages=2 * P, layer_num=2, head_num=1,
                                      head_dim=64)
    pools["swa"] = hh.make_mha_host("page_first_direct", page_size=16, pages=2 * P, layer_num=1, head_num=2,
                                    head_dim=64)
    for i, h in enumerate([anchor, *pools.values()]):
        hh.fill_random_pages(h, P, seed=40 + i)
    maru = hh.create_hybrid_maru(pool_path, anchor, pools, mla=False, size="16M")
    try:
        chains = [prompt_keys(P, f"ev{i}") for i in range(220)]
        late = 40  # a chain's second half is written 40 chains after its first: the halves age apart

        def backup(c, half):
            lo, hi = (0, 4) if half == 0 else (4, P)
            assert maru.batch_set_v1(c[lo:hi], slot_indices(anchor, lo, hi - lo)) == [True] * (hi - lo)
            transfers = [PoolTransfer(name=PoolName.DRAFT, keys=c[lo:hi],
                                      host_indices=slot_indices(anchor, lo, hi - lo), indices_from_pool=PoolName.KV),
                         PoolTransfer(name=PoolName.MAMBA, keys=c[hi - 1:hi], host_indices=torch.tensor([hi - 1]),
                                      hit_policy=TRAIL)]
            if half:
                transfers.append(PoolTransfer(name=PoolName.SWA, keys=c[5:8],
                                              host_indices=slot_indices(pools["swa"], 5, 3), hit_policy=TRAIL))
            maru.batch_set_v2(transfers)

        for i in range(len(chains) + late):
            if i < len(chains):
                backup(chains[i], 0)
            if i >= late:
                backup(chains[i - late], 1)
        assert maru.store.stats()["evictions"] > 0
        # mirror the survivors into HiCacheFile
        f = hh.create_hybrid_file(str(tmp_path / "f"), anchor, pools, mla=False)
        orphans = cut_prefixes = hits = 0
        for c in chains:
            have = {n: hh.digests_present(maru.store, maru.hybrid.store_digests(PoolName(n), c))
                    for n in ("kv", "draft", "mamba", "swa")}
            kv_prefix = have["kv"].index(False) if False in have["kv"] else P
            cut_prefixes += 0 < kv_prefix < P or (kv_prefix == 0 and any(have["kv"]))
            orphans += any(any(v[kv_prefix:]) for n, v in have.items() if n != "kv")
            if any(have["kv"]):
                f.batch_set([k for k, h in zip(c, have["kv"]) if h],
                            [anchor.get_data_page(i * 16) for i, h in enumerate(have["kv"]) if h])
            for n in ("draft", "mamba", "swa"):
                for i, h in enumerate(have[n]):
                    if h:
                        f.batch_set_v2([PoolTransfer(name=PoolName(n), keys=[c[i]],
                                                     host_indices=slot_indices(pools[n], i, 1))])
            q = [PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL),
                 PoolTransfer(name=PoolName.SWA, keys=["x"] * 3, hit_policy=TRAIL), PoolTransfer(name=PoolName.DRAFT)]
            for m in (4, P):
                r = _result(maru.batch_exists_v2(c[:m], q))
                assert r == _result(f.batch_exists_v2(c[:m], q))
                hits += r[0] > 0
        assert cut_prefixes > 0 and orphans > 0  # the store did cut KV prefixes and leave pool pages behind
        assert hits > 0
    finally:
        maru.close()


# --------------------------------------------------------------------------- 4. BLOCK_GROUPS
def _blocks_oracle(present: list[bool], block: int, group: int, span: int) -> int:
    """PoolHitPolicy.BLOCK_GROUPS, from its docstring: the pages the leading complete key groups cover."""
    groups = 0
    for g in range(len(present) // group):
        if not all(present[g * group:(g + 1) * group]):
            break
        groups += 1
    return min(groups * block, span)


@pytest.mark.parametrize("block, group", [(2, 2), (4, 1), (1, 1)])
def test_block_groups_follows_its_docstring_and_never_gates_the_kv_hit(twin, block, group):
    t = twin("dsv4")
    keys = prompt_keys(8, f"blocks-{block}-{group}")
    t.set_kv(keys)
    t.set_v2([("deepseek_v4_c4", keys, 0)])
    n_keys = len(keys) // block * group
    gkeys = [f"{keys[g]}.group{g}" for g in range(n_keys)]  # the pool's own keys, group after group
    rnd = random.Random(block * 10 + group)
    for trial in range(6):
        present = [rnd.random() < 0.8 for _ in gkeys] if trial else [True] * len(gkeys)
        for d in t.maru.hybrid.store_digests(PoolName.DEEPSEEK_V4_C128, gkeys):
            hh.delete_digest(t.maru.store, d.tobytes())
        for i, k in enumerate(gkeys):
            if present[i]:
                assert t.maru.batch_set_v2([t.transfer("deepseek_v4_c128", [k], i % P)]) == \
                    {PoolName.DEEPSEEK_V4_C128: [True]}
        blocks = PoolTransfer(name=PoolName.DEEPSEEK_V4_C128, keys=gkeys, hit_policy=BLOCKS, block_pages=block,
                              group_pages=group)
        plain = _result(t.maru.batch_exists_v2(keys, t.query(["deepseek_v4_c4"])))
        got = _result(t.maru.batch_exists_v2(keys, t.query(["deepseek_v4_c4"]) + [blocks]))
        verdict = _blocks_oracle(present, block, group, len(keys))
        expected_hits = dict(plain[1], **({"deepseek_v4_c128": verdict} if verdict else {}))
        assert got == (plain[0], expected_hits, plain[2])  # own verdict; KV hit and restorable untouched
        got = _result(t.maru.batch_exists_v2(keys, [blocks] + t.query(["deepseek_v4_c4"])))
        assert got == (plain[0], expected_hits, plain[2])
    # a partial trailing group never counts; no geometry gives no verdict
    assert t.maru.batch_set_v2([t.transfer("deepseek_v4_c128", gkeys, 0)]) == {PoolName.DEEPSEEK_V4_C128:
                                                                              [True] * len(gkeys)}
    part = PoolTransfer(name=PoolName.DEEPSEEK_V4_C128, keys=gkeys[:2 * group - 1], hit_policy=BLOCKS,
                        block_pages=block, group_pages=group)
    assert t.maru.batch_exists_v2(keys, [part]).extra_pool_hit_pages["deepseek_v4_c128"] == block
    nogeo = PoolTransfer(name=PoolName.DEEPSEEK_V4_C128, keys=gkeys, hit_policy=BLOCKS)
    assert "deepseek_v4_c128" not in t.maru.batch_exists_v2(keys, [nogeo]).extra_pool_hit_pages
    # SGLang 0.5.23's own file backend has no BLOCK_GROUPS branch (hicache_storage.py, HiCacheFile.batch_exists_v2)
    with pytest.raises(ValueError, match="Unsupported pool hit policy"):
        t.file.batch_exists_v2(keys, [blocks])


def test_hybrid_controller_consumes_the_block_groups_verdict(twin):
    """HybridCacheController._storage_hit_query / _sync_prefetch_hit_query, SGLang's own code, on MaruStorage:
    the pool's verdict becomes query_pool_hit_pages[pool]; the storage hit stays the KV hit."""
    t = twin("dsv4")
    ctrl = t.ctrl["maru"]
    ps = t.anchor.page_size
    tokens = list(range(6 * ps))
    hashes = get_storage_hash_str(tokens, None, page_size=ps)
    t.set_kv(hashes[:5])
    t.set_v2([("deepseek_v4_c4", hashes[:4], 0)])
    gkeys = [f"{h}.c128" for h in hashes[:6]]
    t.maru.batch_set_v2([t.transfer("deepseek_v4_c128", gkeys[:3], 0)])  # groups of 2: one complete, one not
    for with_trailing in (False, True):
        transfers = [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4),
                     PoolTransfer(name=PoolName.DEEPSEEK_V4_C128, keys=gkeys, hit_policy=BLOCKS, block_pages=2,
                                  group_pages=2)]
        if with_trailing:
            t.set_v2([("swa", hashes[2:4], 2)])
            transfers.append(PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAIL))
        op = PrefetchOperation(CacheRequestHandle("r", 0), tokens, pool_transfers=transfers)
        hash_value, hit = ctrl._storage_hit_query(op)
        assert hit == 4 * ps and hash_value == hashes[:4]  # c4 gates at 4 pages; c128's groups do not gate
        assert op.query_pool_hit_pages[PoolName.DEEPSEEK_V4_C128] == 2
        assert ctrl._sync_prefetch_hit_query(op, hit) == 4 * ps
        assert op.query_pool_hit_pages[PoolName.DEEPSEEK_V4_C128] == 2


# --------------------------------------------------------------------------- the controller's own paths
def test_controller_backup_and_prefetch_paths_agree_with_hicache_file(twin):
    """HybridCacheController._page_backup_with_stable_layout and the prefetch path (_storage_hit_query,
    _sync_prefetch_hit_query, _page_transfer_with_stable_layout: KV, KV-derived and trailing sidecars) run
    unchanged on both backends: same completed tokens, pool hits, ACKs and loaded bytes."""
    t = twin("mamba_swa")
    ps = t.anchor.page_size
    n = 6
    tokens = list(range(n * ps))
    hashes = get_storage_hash_str(tokens, None, page_size=ps)
    out = {}
    for side in ("maru", "file"):
        ctrl = t.ctrl[side]
        op = StorageOperation(slot_indices(t.anchor, 0, n), tokens, hash_value=list(hashes), prefix_keys=[],
                              pool_transfers=[
                                  PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV),
                                  PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=hashes[-1:],
                                               hit_policy=TRAIL),
                                  PoolTransfer(name=PoolName.SWA, host_indices=slot_indices(t.pools["swa"], 3, 3),
                                               keys=hashes[-3:], hit_policy=TRAIL)])
        ctrl._page_backup_with_stable_layout(op)
        backup = (op.completed_tokens, dict(op.pool_storage_result.extra_pool_hit_pages))
        pf = PrefetchOperation(CacheRequestHandle("r", 0), tokens, prefix_keys=[], pool_transfers=[
            PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV),
            PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAIL,
                         host_indices=torch.tensor([P + 5])),
            PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * 3, hit_policy=TRAIL,
                         host_indices=slot_indices(t.pools["swa"], P + 3, 3))])
        hash_value, hit = ctrl._storage_hit_query(pf)
        hit = ctrl._sync_prefetch_hit_query(pf, hit)
        query = (hash_value, hit, dict(pf.query_pool_hit_pages))
        pf.hash_value = hash_value[:hit // ps]
        pf.host_indices = slot_indices(t.anchor, P, hit // ps)
        pf.storage_hit_count = hit
        dest = {"kv": (t.anchor, pf.host_indices, hit // ps), "draft": (t.pools["draft"], pf.host_indices, hit // ps),
                "mamba": (t.pools["mamba"], torch.tensor([P + 5]), 1),
                "swa": (t.pools["swa"], slot_indices(t.pools["swa"], P + 3, 3), 3)}
        for host, idx, k in dest.values():
            hh.zero_pool_pages(host, idx, k)
        ctrl._page_transfer_with_stable_layout(pf)  # as the io thread runs it; the sync thread forwards the acks
        acks = []
        while not acks or acks[-1][1] == {}:  # up to the sidecars' ack, the last the transfer emits
            a = ctrl.ack_prefetch_queue.get(timeout=60)
            acks.append((a.completed_tokens, dict(a.pool_hits or {}), a.completed_req))
        loaded = {name: hh.pool_page_bytes(host, idx, k) for name, (host, idx, k) in dest.items()}
        out[side] = (backup, query, acks, loaded)
    assert out["maru"][:3] == out["file"][:3]
    assert out["maru"][3] == out["file"][3]
    backup, query, acks, loaded = out["maru"]
    assert backup == (n * ps, {"draft": n, "mamba": 1, "swa": 3})
    assert query[1] == n * ps and query[2] == {"kv": n, "draft": n, "mamba": n, "swa": n}
    assert loaded["mamba"] == hh.pool_page_bytes(t.pools["mamba"], torch.tensor([5]), 1)
    assert loaded["swa"] == hh.pool_page_bytes(t.pools["swa"], slot_indices(t.pools["swa"], 3, 3), 3)
    assert loaded["draft"] == hh.pool_page_bytes(t.pools["draft"], slot_indices(t.pools["draft"], 0, n), n)


# --------------------------------------------------------------------------- never raise
def test_v2_calls_fail_softly(twin, caplog):
    t = twin("mamba_swa")
    keys = prompt_keys(3, "soft")
    bad = PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=slot_indices(t.pools["swa"], 0, 2))  # 2 for 3
    unknown = PoolTransfer(name=PoolName.INDEXER, keys=keys, host_indices=slot_indices(t.anchor, 0, 3))
    assert t.maru.batch_set_v2([bad, unknown]) == {PoolName.SWA: [False] * 3, PoolName.INDEXER: [False] * 3}
    assert t.file.batch_set_v2([bad]) == {PoolName.SWA: [False] * 3}  # HiCacheFile: the same for the mismatch
    assert t.maru.batch_get_v2([bad]) == {PoolName.SWA: [False] * 3}
    weird = PoolTransfer(name=PoolName.SWA, hit_policy="sideways")
    t.set_kv(keys)
    assert _result(t.maru.batch_exists_v2(keys, [weird])) == (0, {}, [])
    t.maru.store.close()
    assert _result(t.maru.batch_exists_v2(keys, t.query())) == (0, {}, [])
    assert t.maru.batch_set_v2([t.transfer("draft", keys, 0)]) == {PoolName.DRAFT: [False] * 3}


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "legacy"])
def test_v2_host_indices_outside_their_pool_are_refused(twin, v1):
    """pages.check_host_indices guards the v2 pools and a 'kv' transfer's pages (legacy flat pages too): a page
    whose indices leave its host pool answers False. The keys are stored first, so that a backend without the
    check skips the present pages and answers True without copying from outside the buffers."""
    t = twin("mamba_swa", maru={"interface_v1": int(v1)})
    keys = prompt_keys(2, f"oob-v2-{v1}")
    swa = t.pools["swa"]

    def transfers(kv_idx, swa_idx):
        return [PoolTransfer(name=PoolName.KV, keys=keys, host_indices=kv_idx),
                PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=swa_idx)]

    good = transfers(slot_indices(t.anchor, 0, 2), slot_indices(swa, 0, 2))
    assert t.maru.batch_set_v2(good) == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    kv_bad = torch.cat([slot_indices(t.anchor, 0, 1), torch.full((t.anchor.page_size,), -1, dtype=torch.int64)])
    swa_bad = torch.cat([slot_indices(swa, 0, 1), torch.arange(swa.size, swa.size + swa.page_size)])
    assert t.maru.batch_set_v2(transfers(kv_bad, swa_bad)) == {PoolName.KV: [False, False],
                                                               PoolName.SWA: [False, False]}


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "legacy"])
def test_a_transfer_named_kv_moves_the_kv_pages_themselves(twin, v1):
    """HiCacheFile._log_key leaves a 'kv' transfer's keys unsuffixed: it reads and writes the KV pages. MaruStorage
    does the same, under the very keys of its v1 (or legacy) KV calls."""
    t = twin("mamba_swa", maru={"interface_v1": int(v1)})
    keys = prompt_keys(4, f"kv-v2-{v1}")
    src = slot_indices(t.anchor, 0, 3)
    res = {side: getattr(t, side).batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys[:3], host_indices=src)])
           for side in ("maru", "file")}
    assert res["maru"] == res["file"] == {PoolName.KV: [True] * 3}
    assert t.maru.batch_exists(keys) == t.file.batch_exists(keys) == 3
    loaded = {}
    for side in ("maru", "file"):
        dst = slot_indices(t.anchor, P, 4)
        hh.zero_pool_pages(t.anchor, dst, 4)
        got = getattr(t, side).batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=dst)])
        loaded[side] = (got, hh.pool_page_bytes(t.anchor, dst, 4))
    assert loaded["maru"] == loaded["file"]
    assert loaded["maru"][0] == {PoolName.KV: [True, True, True, False]}
    assert loaded["maru"][1][:3] == hh.pool_page_bytes(t.anchor, src, 3)


def _handles_on(backend) -> list[str]:
    """Paths, from the backend's attributes through every maru_sglang object they hold, that lead back to the
    backend itself or to one of its methods other than log_once (a store getter closure is not followed)."""
    seen, found = set(), []

    def walk(obj, path):
        if obj is backend:
            found.append(path)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if inspect.ismethod(obj):
            if obj.__self__ is backend and obj.__name__ != "log_once":
                found.append(f"{path} (MaruStorage.{obj.__name__})")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif type(obj).__module__.startswith("maru_sglang."):
            attrs = dict(getattr(obj, "__dict__", {}))
            attrs.update({s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)})
            for k, v in attrs.items():
                walk(v, f"{path}.{k}")

    for name, part in vars(backend).items():
        walk(part, name)
    return found


def test_a_hybrid_models_pool_gets_the_count_clock_and_no_prefix_mark(twin):
    """A pool a hybrid model creates keeps the per-class count CLOCK (DESIGN.md section 8): where a host cache
    filters the hits, age order loses tokens to it (BENCHMARKS.md, the prefix-tree family)."""
    t = twin("mamba_swa")
    t.set_kv(prompt_keys(2, "rule"))
    assert not t.maru.store.policy.age and not t.maru.store.policy.prefix_mark


def test_no_part_of_the_backend_holds_a_handle_on_it(twin):
    """Calls go one way (maru_storage.py): MaruStorage gives the parts it builds what they use (a store getter,
    the key space, the parts below, flags, log_once), never itself; tests/test_layering.py checks the source."""
    t = twin("mamba_swa")
    t.set_kv(prompt_keys(2, "one-way"))
    t.set_v2([("swa", prompt_keys(2, "one-way"), 0)])
    assert t.maru.hybrid.pools  # the parts are built and in use
    assert _handles_on(t.maru) == []
