"""Slabs and blocks: allocation, freeing, slab CLOCK eviction, class/pool repair, reaping.

Truth lives in two places only: slab HEAD entries (which units form a slab
of which class) and block metas (state and owner of every block). Bitmaps,
free counts, partial lists and TAIL entries are derived and are rebuilt by
`repair_class` / `repair_pool` when a holder died inside a section.
"""

from __future__ import annotations

import bisect
import struct
import threading
import time

import numpy as np

from ..format import (CLASS_ENTRY, CLASS_LOCK_BASE, CLASS_STRUCT, CLASSES_VERSION_OFF, CLS_DEMAND,
                      CLS_DEMAND_EPOCH, CLS_HAND, CLS_NSLABS, CLS_PARTIAL, CLS_USED, DEMAND_ACC_OFF,
                      DEMAND_EPOCH_OFF, FREE, FREE_FLOOR_OFF, KIND_EXACT, KIND_GEOMETRIC, KIND_UNUSED, LIVE,
                      FLAG_PINNED, LOCK_CLASSTAB, LOCK_POOL, META_FLAGS_OFF, META_LENGTH_OFF, META_OWNER_OFF, META_SIZE, META_STRUCT, RESERVED, SHARD_LOCK_BASE, SLAB_BITMAP,
                      SLAB_ENTRY, SLAB_INPARTIAL, SLAB_NBLOCKS, SLAB_NEXT, SLAB_NFREE, SLAB_PREV,
                      SLAB_REF, SLAB_HAND_OFF, U16, U32, U64, UNIT_FREE, UNIT_HEAD, UNIT_TAIL, next_word,
                      store_u64)
from .. import crashpoints as _cp
from .classes import exact_slab_floor, planned_geometric, slab_shape
from .host import AllocatorHost

# Demand counters (FORMAT.md section 4): every class's counter halves each time the pool has allocated
# data_bytes / DEMAND_EPOCH_DIV bytes (an epoch).
DEMAND_EPOCH_DIV = 4
# A class that must evict takes a slab from the pool (slab CLOCK) instead of evicting its own blocks
# while it is short of its share of demand d (a fraction) by more than min(MOVE_RATIO x d, MOVE_ABS)
# of the slab bytes (FORMAT.md section 8).
MOVE_RATIO = 0.5
MOVE_ABS = 0.05


# Batches up to this many blocks take scalar paths (reserve here; commit, index, disown in the Store):
# a numpy call costs a few microseconds whatever its length, which only pays off over many keys.
SMALL_BATCH = 8

# Blocks a process keeps per class, owned and unindexed, for its own next allocations of the class
# (Allocator.free_blocks(keep=True), Allocator.allocate): at most KEEP_MAX blocks and KEEP_BYTES bytes
# (at least one block), so an idle process holds back little of the pool.
KEEP_MAX = 16
KEEP_BYTES = 4 << 20
_REST = struct.Struct("<16sIHB")  # meta bytes 8..30: digest, length, owner, ref (META_STRUCT after the word)


class ClassInfo:
    __slots__ = ("cid", "kind", "k", "block", "bps")

    def __init__(self, cid, kind, k, block, bps):
        self.cid, self.kind, self.k, self.block, self.bps = cid, kind, k, block, bps


class Allocator:
    """Allocator over one mapped pool; `host` answers what only the layer above knows (host.AllocatorHost)."""

    def __init__(self, host: AllocatorHost):
        self.host = host
        self.mm = host.mm
        g = host.geo
        self.geo = g
        self.U = g.unit_size
        self.G = g.granule
        self.n_units = g.n_units
        self.off_slabs = g.off_slabs
        self.off_meta = g.off_blockmeta
        self.off_classes = g.off_classes
        self.states = np.ndarray((g.n_units,), dtype="<u4", buffer=self.mm, offset=g.off_slabs, strides=(SLAB_ENTRY,))
        self.clsfield = np.ndarray((g.n_units,), dtype="<u4", buffer=self.mm, offset=g.off_slabs + 4,
                                   strides=(SLAB_ENTRY,))
        # block meta words and owners, one per granule (vectorised commit / disown of a batch)
        n_gran = g.n_granules
        self.meta_q = np.ndarray((n_gran, 4), dtype="<u8", buffer=self.mm, offset=g.off_blockmeta,
                                 strides=(META_SIZE, 8))  # word, digest lo, digest hi, length|owner|ref|spare
        self.meta_words = self.meta_q[:, 0]
        self.meta_owners = np.ndarray((n_gran,), dtype="<u2", buffer=self.mm, offset=g.off_blockmeta + META_OWNER_OFF,
                                      strides=(META_SIZE,))
        self.meta_refs = np.ndarray((n_gran,), dtype=np.uint8, buffer=self.mm, offset=g.off_blockmeta + 30,
                                    strides=(META_SIZE,))
        # slab ref bits, one per unit (a batch of reads marks its slabs recently used in one pass)
        self.unit_refs = np.ndarray((g.n_units,), dtype=np.uint8, buffer=self.mm, offset=g.off_slabs + SLAB_REF,
                                    strides=(SLAB_ENTRY,))
        # class table columns (slab moves compare every class's slab bytes and demand)
        cap, oc = g.class_cap, g.off_classes
        self.cls_k = np.ndarray((cap,), dtype="<u4", buffer=self.mm, offset=oc + 4, strides=(CLASS_ENTRY,))
        self.cls_nslabs = np.ndarray((cap,), dtype="<u4", buffer=self.mm, offset=oc + CLS_NSLABS,
                                     strides=(CLASS_ENTRY,))
        self.cls_demand = np.ndarray((cap,), dtype="<u8", buffer=self.mm, offset=oc + CLS_DEMAND,
                                     strides=(CLASS_ENTRY,))
        self.cls_epoch = np.ndarray((cap,), dtype="<u4", buffer=self.mm, offset=oc + CLS_DEMAND_EPOCH,
                                    strides=(CLASS_ENTRY,))
        self.classes: list[ClassInfo | None] = []
        self.geo_sizes: list[int] = []  # block sizes of the usable geometric classes, ascending
        self.geo_cids: list[int] = []   # their class ids (not the list position: unusable classes are skipped)
        self.exact: dict[int, int] = {}
        self._classes_version = -1
        self.refresh_classes()
        self.kept: dict[int, list[tuple[int, int]]] = {}  # class id -> (offset, word) kept for reuse
        self._kept_guard = threading.Lock()  # threads of this process share `kept`

    def release_views(self) -> None:
        """Drop numpy views so the mapping can be closed."""
        self.states = self.clsfield = self.meta_q = self.meta_words = self.meta_owners = None
        self.meta_refs = self.unit_refs = self.cls_k = self.cls_nslabs = self.cls_demand = self.cls_epoch = None

    # -- class table -----------------------------------------------------------
    def refresh_classes(self) -> None:
        (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
        if ver == self._classes_version:
            return
        classes, geo, exact = [], [], {}
        planned = planned_geometric(self.G, self.U, self.geo.max_value)
        for cid in range(self.geo.class_cap):
            kind, k, block, bps = CLASS_STRUCT.unpack_from(self.mm, self.off_classes + cid * CLASS_ENTRY)[:4]
            valid = (kind in (KIND_GEOMETRIC, KIND_EXACT) and 0 < k <= self.n_units and 0 < block <= k * self.U
                     and 0 < bps <= 256 and bps * block <= k * self.U and block >= self.G)
            if cid < self.geo.n_geo_classes and cid < len(planned):
                valid = valid and (kind, k, block, bps) == planned[cid]  # fixed at creation: damage = unusable
            info = ClassInfo(cid, kind, k, block, bps) if valid else None
            classes.append(info)
            if info and kind == KIND_GEOMETRIC and cid < self.geo.n_geo_classes:
                geo.append((block, cid))
            elif info and kind == KIND_EXACT:
                exact[block] = cid
        geo.sort()  # ascending by construction; sorted anyway so bisect holds whatever the table says
        self.geo_sizes, self.geo_cids = [b for b, _ in geo], [c for _, c in geo]
        self.classes, self.exact = classes, exact
        # units per slab by class id (0: unusable), for finding slabs that reach into a run of units
        self._kvec = np.array([c.k if c else 0 for c in classes] + [0], dtype=np.int64)
        self._kmax = int(self._kvec.max())
        self._classes_version = ver

    def class_arrays(self):
        """(block sizes, blocks per slab) indexed by class id, 0 for unused classes (for numpy checks)."""
        (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
        if ver != self._classes_version:
            self.refresh_classes()
        if getattr(self, "_arrays_version", None) != self._classes_version:
            block = np.zeros(self.geo.class_cap, dtype=np.int64)
            bps = np.zeros(self.geo.class_cap, dtype=np.int64)
            for c in self.classes:
                if c is not None:
                    block[c.cid], bps[c.cid] = c.block, c.bps
            self._arrays = (block, bps)
            self._arrays_version = self._classes_version
        return self._arrays

    def class_for(self, n: int) -> ClassInfo | None:
        """Exact-fit class of exactly n bytes if declared, else the smallest geometric class >= n."""
        cid = self.exact.get(n)
        if cid is None:
            (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
            if ver != self._classes_version:
                self.refresh_classes()
                cid = self.exact.get(n)
        if cid is not None:
            return self.classes[cid]
        i = bisect.bisect_left(self.geo_sizes, max(n, 1))
        if i >= len(self.geo_sizes):
            return None
        return self.classes[self.geo_cids[i]]  # by class id: position i is not class i once one is skipped

    def declare_exact(self, n: int) -> ClassInfo:
        """Give block size n its own class (idempotent); geometric fallback when the table is full."""
        self.refresh_classes()
        if n in self.exact:
            return self.classes[self.exact[n]]
        if n < self.G or n > self.geo.max_value:
            raise ValueError(f"exact size {n} outside [{self.G}, {self.geo.max_value}]")
        with self.host.locks.hold(LOCK_CLASSTAB):
            self._classes_version = -1
            self.refresh_classes()
            if n in self.exact:
                return self.classes[self.exact[n]]
            for cid in range(self.geo.n_geo_classes, self.geo.class_cap):
                off = self.off_classes + cid * CLASS_ENTRY
                if U32.unpack_from(self.mm, off)[0] == KIND_UNUSED:
                    # Never more than a quarter of the units: a slab of more units than the pool has would make
                    # the entry invalid (refresh_classes drops it, and declare_size raised KeyError).
                    k, bps = slab_shape(n, self.U, max_units=min(64, max(1, self.n_units // 4)),
                                        min_bytes=exact_slab_floor(self.geo.data_bytes))
                    CLASS_STRUCT.pack_into(self.mm, off, KIND_UNUSED, k, n, bps, 0, 0, 0, time.time_ns())
                    U32.pack_into(self.mm, off, KIND_EXACT)  # kind last: the entry is complete
                    if _cp.ARMED is not None:
                        _cp.hit("classtab.mid_declare")
                    (ver,) = U32.unpack_from(self.mm, CLASSES_VERSION_OFF)
                    U32.pack_into(self.mm, CLASSES_VERSION_OFF, (ver + 1) & 0xFFFFFFFF)
                    break
            else:
                return self.class_for(n)
        self.refresh_classes()
        return self.classes[self.exact[n]]

    # -- small accessors -----------------------------------------------------------
    def _slab(self, u: int) -> int:
        return self.off_slabs + u * SLAB_ENTRY

    def _cls_off(self, cid: int) -> int:
        return self.off_classes + cid * CLASS_ENTRY

    def _get32(self, off: int) -> int:
        return U32.unpack_from(self.mm, off)[0]

    def _set32(self, off: int, v: int) -> None:
        U32.pack_into(self.mm, off, v & 0xFFFFFFFF)  # a damaged counter + 1 wraps (repair recounts)

    def meta_off(self, offset: int) -> int:
        return self.off_meta + (offset // self.G) * META_SIZE

    def head_of(self, offset: int):
        """(head unit, ClassInfo) of the slab containing data offset, or (None, None)."""
        u = offset // self.U
        if not 0 <= u < self.n_units:
            return None, None
        st, c = U32.unpack_from(self.mm, self._slab(u))[0], self._get32(self._slab(u) + 4)
        if st == UNIT_TAIL:
            u = c
            if not 0 <= u < self.n_units or self._get32(self._slab(u)) != UNIT_HEAD:
                return None, None
            c = self._get32(self._slab(u) + 4)
        elif st != UNIT_HEAD:
            return None, None
        info = self.classes[c] if 0 <= c < len(self.classes) else None
        if info is None:
            self.refresh_classes()
            info = self.classes[c] if 0 <= c < len(self.classes) else None
        return (u, info) if info else (None, None)

    def block_index(self, offset: int):
        """(head, ClassInfo, block index) if offset is a block start of a slab, else None."""
        h, info = self.head_of(offset)
        if h is None:
            return None
        rel = offset - h * self.U
        i, r = divmod(rel, info.block)
        if r or not 0 <= i < info.bps:  # i < 0: a damaged TAIL named a later HEAD
            return None
        return h, info, i

    def is_pinned(self, offset: int) -> bool:
        """Is the block at this data offset pinned (Store.pin)? Out of range: no."""
        return 0 <= offset < self.geo.data_bytes and bool(self.mm[self.meta_off(offset) + META_FLAGS_OFF] & FLAG_PINNED)

    def is_referenced(self, offset: int, clear: bool = False) -> bool:
        """Block ref bit (for index-pressure CLOCK); optionally clear it."""
        if not 0 <= offset < self.geo.data_bytes:
            return False
        r = self.meta_off(offset) + 30
        if self.mm[r + 1] & FLAG_PINNED:
            return True  # pinned: always a second chance
        ref = self.mm[r]
        if ref and clear:
            self.mm[r] = 0
        return bool(ref)

    # -- bitmap / partial list (CLASS lock held) ----------------------------------
    def _bit(self, h: int, i: int) -> bool:
        return bool(self.mm[self._slab(h) + SLAB_BITMAP + (i >> 3)] & (1 << (i & 7)))

    def _set_bit(self, h: int, i: int, on: bool) -> None:
        o = self._slab(h) + SLAB_BITMAP + (i >> 3)
        b = self.mm[o]
        self.mm[o] = (b | (1 << (i & 7))) if on else (b & ~(1 << (i & 7)) & 0xFF)

    def _partial_push(self, cid: int, h: int) -> None:
        s = self._slab(h)
        if self.mm[s + SLAB_INPARTIAL]:
            return
        head = self._get32(self._cls_off(cid) + CLS_PARTIAL)
        self._set32(s + SLAB_NEXT, head)
        self._set32(s + SLAB_PREV, 0)
        if head and head - 1 < self.n_units:
            self._set32(self._slab(head - 1) + SLAB_PREV, h + 1)
        self.mm[s + SLAB_INPARTIAL] = 1
        self._set32(self._cls_off(cid) + CLS_PARTIAL, h + 1)

    def _partial_remove(self, cid: int, h: int) -> None:
        s = self._slab(h)
        if not self.mm[s + SLAB_INPARTIAL]:
            return
        nxt, prv = self._get32(s + SLAB_NEXT), self._get32(s + SLAB_PREV)
        if prv and prv - 1 < self.n_units:
            self._set32(self._slab(prv - 1) + SLAB_NEXT, nxt)
        else:
            self._set32(self._cls_off(cid) + CLS_PARTIAL, nxt)
        if nxt and nxt - 1 < self.n_units:
            self._set32(self._slab(nxt - 1) + SLAB_PREV, prv)
        self._set32(s + SLAB_NEXT, 0)
        self._set32(s + SLAB_PREV, 0)
        self.mm[s + SLAB_INPARTIAL] = 0

    def _add_used(self, cid: int, delta: int) -> None:
        o = self._cls_off(cid) + CLS_USED
        self._set32(o, max(0, self._get32(o) + delta))

    # -- allocation ---------------------------------------------------------------
    def allocate(self, info: ClassInfo, digests: np.ndarray, lengths: np.ndarray, owner: int) -> list[int]:
        """Reserve one block per value; return their data offsets.

        `digests` are the keys' digests as (m, 2) little-endian u64 halves, `lengths`
        the values' lengths (m,).

        Fewer offsets than items means the pool could not make room (every
        candidate slab busy with writers). Each block is RESERVED with `owner`.
        Blocks are taken from the partial slabs first and reserved together
        (one numpy pass) before anything that may evict or repair this class:
        a taken block must carry its owner by then, or the eviction that makes
        room for the rest could free the slab under it. Blocks this process
        keeps for the class (`free_blocks(keep=True)`) are reused first, without
        the class lock (`_reuse_kept`); the lock is taken only for the rest.
        """
        cid = info.cid
        m = len(lengths)
        out: list[int] = self._reuse_kept(info, digests, lengths, owner) if self.kept.get(cid) else []
        reused = len(out)
        if reused == m:
            return out
        if out:
            try:
                return self._allocate_locked(info, digests, lengths, owner, out)
            except BaseException:  # reused blocks go back to the list (RESERVED, still ours) for the next put
                with self._kept_guard:
                    self.kept.setdefault(cid, []).extend(
                        (off, U64.unpack_from(self.mm, self.meta_off(off))[0]) for off in out[:reused])
                raise
        return self._allocate_locked(info, digests, lengths, owner, out)

    def _allocate_locked(self, info: ClassInfo, digests, lengths, owner: int, out: list[int]) -> list[int]:
        """The part of `allocate` under the class lock: values len(out) .. m-1 (out holds blocks reused)."""
        cid = info.cid
        m = len(lengths)
        small = m <= SMALL_BATCH  # scalar bitmap and meta writes
        pending: list[int] = []

        def reserve_pending():
            if pending:
                k = len(out)
                if small:
                    for j, off in enumerate(pending):
                        mo = self.meta_off(off)
                        (word,) = U64.unpack_from(self.mm, mo)
                        # FREE -> RESERVED in one write of the whole meta (flags 0: a new lifetime is not pinned)
                        self.mm[mo:mo + META_SIZE] = META_STRUCT.pack(
                            next_word(word, RESERVED), digests[k + j].tobytes(), int(lengths[k + j]), owner, 0) + b"\0"
                else:
                    self._reserve_many(pending, digests[k:k + len(pending)], lengths[k:k + len(pending)], owner)
                out.extend(pending)
                pending.clear()

        rebuilt = False
        # Bounded: each round takes blocks, takes a slab off the partial list, makes room or rebuilds once.
        rounds = m + 2 * self.n_units + 4
        with self.host.locks.hold(CLASS_LOCK_BASE + cid, repair=lambda: self.repair_class(cid)):
            self._add_demand(cid, (m - len(out)) * info.block)
            while len(out) + len(pending) < m and rounds > 0:
                rounds -= 1
                head = self._get32(self._cls_off(cid) + CLS_PARTIAL)
                if head == 0:
                    reserve_pending()
                    if not self._make_room(info, m - len(out)):
                        break
                    continue
                h = head - 1
                s = self._slab(h)
                if (h >= self.n_units or self._get32(s) != UNIT_HEAD or self._get32(s + 4) != cid
                        or h + info.k > self.n_units or not self.mm[s + SLAB_INPARTIAL]
                        or self._get32(s + SLAB_NBLOCKS) != info.bps
                        or (info.k > 1 and not ((self.states[h + 1:h + info.k] == UNIT_TAIL).all()
                                                and (self.clsfield[h + 1:h + info.k] == h).all()))):
                    # The list names no partial slab of this class, or a slab whose extent or shape is not
                    # the class's (damage): blocks reserved there would overlap another slab's values.
                    # Rebuild the class from the slab table, once (blocks taken so far are reserved first:
                    # the rebuild derives the bitmaps from the block metas).
                    reserve_pending()
                    if rebuilt:
                        break
                    self.repair_class(cid)
                    rebuilt = True
                    continue
                nfree = self._get32(s + SLAB_NFREE)
                want = m - len(out) - len(pending)
                if small or info.bps <= 32:  # few bits: a Python int beats numpy's fixed cost per call
                    bm = int.from_bytes(self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32], "little")
                    free_bits = ~bm & ((1 << info.bps) - 1)
                    got = 0
                    while free_bits and got < want:
                        low = free_bits & -free_bits
                        free_bits ^= low
                        bm |= low
                        pending.append(h * self.U + (low.bit_length() - 1) * info.block)
                        got += 1
                    if got:
                        self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32] = bm.to_bytes(32, "little")
                else:
                    bits = np.unpackbits(np.frombuffer(self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32], np.uint8),
                                         bitorder="little")
                    free = np.flatnonzero(bits[:info.bps] == 0)[:want]
                    got = len(free)
                    if got:
                        bits[free] = 1
                        self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32] = np.packbits(bits, bitorder="little").tobytes()
                        pending += (h * self.U + free * info.block).tolist()
                nfree = max(0, nfree - got)
                if got == 0:
                    nfree = 0  # bitmap says full: the count was stale
                self._set32(s + SLAB_NFREE, nfree)
                self._add_used(cid, got)
                if nfree == 0:
                    self._partial_remove(cid, h)
                self.mm[s + SLAB_REF] = 1
            reserve_pending()
        return out

    def _reuse_kept(self, info: ClassInfo, digests: np.ndarray, lengths: np.ndarray, owner: int) -> list[int]:
        """Re-reserve blocks this process keeps for the class for the first values of a batch; no lock.

        A kept block is LIVE, owned by this process and unindexed (an overwrite's old
        block, or one of ours that lost its publication): no reader can reach it
        through the index, no other process frees or evicts a block a live process
        owns, and its bitmap bit and the class counts already say "used". So the
        owner moves it LIVE -> RESERVED itself, as it moves RESERVED -> LIVE at
        commit: the word first (the next sequence: a reader still holding the old
        word fails validation from then on), then digest, length, owner, ref. A
        block whose word or owner is not what was kept (the pool was cleared) is
        dropped from the list and left alone. No demand is counted: the class does
        not grow. FORMAT.md section 8, put step 6.
        """
        m = len(lengths)
        with self._kept_guard:
            lst = self.kept.get(info.cid)
            if not lst:
                return []
            take = lst[-m:]
            del lst[-m:]
        out: list[int] = []
        mm = self.mm
        for off, word in take:
            if not self._ours_to_keep(info.cid, off, word, owner):
                continue
            mo = self.meta_off(off)
            j = len(out)
            store_u64(mm, mo, next_word(word, RESERVED))
            if _cp.ARMED is not None:
                _cp.hit("alloc.mid_reuse")  # RESERVED, still the old digest and length
            _REST.pack_into(mm, mo + 8, digests[j].tobytes(), int(lengths[j]), owner, 0)
            mm[mo + META_FLAGS_OFF] = 0  # a new lifetime is not pinned
            out.append(off)
        return out

    def _reserve_many(self, offsets: list[int], dig: np.ndarray, lengths: np.ndarray, owner: int) -> None:
        """FREE -> RESERVED for a batch of blocks (CLASS lock held), one numpy pass per field.

        `dig` holds the digests as (n, 2) little-endian u64 halves, `lengths` the value lengths.
        The word (state RESERVED, next sequence) is written first: a reader still
        holding the old LIVE word then fails validation before digest or length
        change. A crash midway leaves RESERVED blocks of a dead or absent owner,
        which class repair frees (section 9 of FORMAT.md).
        """
        g = np.asarray(offsets, dtype=np.int64) // self.G
        q = self.meta_q
        q[g, 0] = (((q[g, 0] >> 2) + 1) << 2) | RESERVED
        q[g, 1] = dig[:, 0]
        q[g, 2] = dig[:, 1]
        q[g, 3] = lengths | np.uint64(owner << 32)  # ref 0, flags 0 (a new lifetime is not pinned)

    # -- making room: new slab, slab move, or eviction within the class ------------------------
    def _add_demand(self, cid: int, nbytes: int) -> None:
        """CLASS[cid] held: add an allocation's bytes to the class's decayed demand (FORMAT.md section 4).

        The pool-wide epoch and its byte accumulator are hints written without a lock (a lost update
        only shifts when the next halving happens). The class counter is decayed lazily: it holds its
        value as of `epoch`, and is halved once per epoch passed since.
        """
        (epoch,) = U32.unpack_from(self.mm, DEMAND_EPOCH_OFF)
        (acc,) = U64.unpack_from(self.mm, DEMAND_ACC_OFF)
        acc += nbytes
        if acc >= max(1, self.geo.data_bytes // DEMAND_EPOCH_DIV):
            epoch = (epoch + 1) & 0xFFFFFFFF
            U32.pack_into(self.mm, DEMAND_EPOCH_OFF, epoch)
            acc = 0
        U64.pack_into(self.mm, DEMAND_ACC_OFF, acc)
        co = self._cls_off(cid)
        (dem,) = U64.unpack_from(self.mm, co + CLS_DEMAND)
        (ep,) = U32.unpack_from(self.mm, co + CLS_DEMAND_EPOCH)
        dem >>= min(63, (epoch - ep) & 0xFFFFFFFF)
        U64.pack_into(self.mm, co + CLS_DEMAND, min(dem + nbytes, 2**63))
        U32.pack_into(self.mm, co + CLS_DEMAND_EPOCH, epoch)

    def should_move(self, info: ClassInfo) -> bool:
        """The rule (FORMAT.md section 8): take a slab from the pool rather than evict within the class?

        Yes when the class has no slab, or when its share of the bytes in slabs falls short of its
        share d of the (decayed) demand of all classes by more than min(MOVE_RATIO x d, MOVE_ABS):
        by more than half for a class with a small share (noise in a small class's demand must not
        trade slabs back and forth: every move evicts a whole window and leaves a slab to fill), by
        more than 5 % of the pool for a class with a large share. Other classes' counters are read
        without their locks: a stale value only shifts one decision.
        """
        cid = info.cid
        nslabs = self.cls_nslabs.astype(np.float64)
        if nslabs[cid] == 0:
            return True
        (epoch,) = U32.unpack_from(self.mm, DEMAND_EPOCH_OFF)
        age = (np.uint32(epoch) - self.cls_epoch).astype(np.int64)
        dem = self.cls_demand.astype(np.float64) * np.exp2(-np.clip(age, 0, 63))
        slab = nslabs * self.cls_k
        total_dem, total_slab = float(dem.sum()), float(slab.sum())
        if total_dem <= 0 or total_slab <= 0:
            return False
        d = dem[cid] / total_dem
        return d - slab[cid] / total_slab > min(MOVE_RATIO * d, MOVE_ABS)

    def _make_room(self, info: ClassInfo, nblocks: int) -> bool:
        """CLASS[c] held, the class has no free block: make room for up to `nblocks` more.

        Free units first (new slabs, one POOL round). Without them: a slab move (slab CLOCK) if
        `should_move` says so, else evict blocks of this class (block CLOCK); whichever is tried
        first, the other is the fallback. False if no room could be made.
        """
        need = -(-nblocks // info.bps)
        if nblocks >= info.bps:
            need += 1  # a batch that fills whole slabs formats one more: the next batch finds it partial
        with self.host.locks.hold(LOCK_POOL, repair=self.repair_pool):
            runs = self.find_free_runs(info.k, need)
            for u in runs:
                self._format_slab(u, info)
            if runs:
                return True
            move = self.should_move(info)
            if move and self._move_slab(info):
                return True
        if self.evict_blocks(info, nblocks):
            return True
        if not move:
            with self.host.locks.hold(LOCK_POOL, repair=self.repair_pool):
                return self._move_slab(info)
        return False

    def _move_slab(self, info: ClassInfo) -> bool:
        """CLASS[c] and POOL held: evict a slab-CLOCK window and format a slab of the class there."""
        u = self._evict_for(info)
        if u is None:
            return False
        if _cp.ARMED is not None:
            _cp.hit("slab.mid_move")
        self._format_slab(u, info)
        return True

    def evict_blocks(self, info: ClassInfo, m: int) -> int:
        """CLASS[c] held: evict up to m blocks of the class chosen by the class's block CLOCK.

        The hand (class entry `hand`) walks the class's blocks in address order (slabs by head unit,
        blocks by index). A LIVE block without owner whose `ref` is clear is a victim; a set `ref` is
        cleared as the hand passes. One sweep of at most two passes over the class's blocks (read in
        chunks from the hand, stopping at the m-th victim) collects the victims (the second pass takes the blocks whose `ref` the first cleared); RESERVED, FREE
        and owned blocks are skipped. The victims are unpublished in one round of their shard locks
        (CLASS -> SHARD is the lock order), then freed: word bumped first, so a reader that found the
        entry before it went fails its second word check. Returns the number of blocks freed.
        """
        cid, bps = info.cid, info.bps
        heads = np.asarray(self.class_slabs(cid), dtype=np.int64)
        if m <= 0 or not len(heads):
            return 0
        n = len(heads) * bps
        co = self._cls_off(cid)
        (hand,) = U64.unpack_from(self.mm, co + CLS_HAND)
        j = int(np.searchsorted(heads, hand >> 8))
        p = j * bps + ((hand & 0xFF) if j < len(heads) and heads[j] == hand >> 8 and (hand & 0xFF) < bps else 0)
        p %= n
        # The ring is read in chunks from the hand (a large class is not read whole to find a few
        # victims); a chunk never spans the end of the first pass, so the second pass re-reads the
        # ref bits the first one cleared. Positions t in [0, 2n): ring index (p + t) mod n.
        chunk = max(4 * m, 512)
        picked: list[np.ndarray] = []
        vq_parts: list[np.ndarray] = []
        got = t = 0
        while t < 2 * n and got < m:
            t1 = min(t + chunk, n if t < n else 2 * n)
            ring = (p + np.arange(t, t1, dtype=np.int64)) % n
            g = (heads[ring // bps] * self.U + (ring % bps) * info.block) // self.G
            q = self.meta_q[g]
            w3 = q[:, 3]
            owner = (w3 >> np.uint64(32)) & np.uint64(0xFFFF)
            ref = ((w3 >> np.uint64(48)) & np.uint64(0xFF)) != 0
            pinned = ((w3 >> np.uint64(56)) & np.uint64(FLAG_PINNED)) != 0
            elig = ((q[:, 0] & np.uint64(3)) == LIVE) & (owner == 0) & ~pinned
            if t >= n and picked:
                elig &= ~np.isin(ring, np.concatenate(picked))  # taken in the first pass already
            vict = np.flatnonzero(elig & ~ref)[:m - got]
            got += len(vict)
            end = int(vict[-1]) + 1 if got == m else len(ring)
            passed = (elig & ref)[:end]  # second chances: cleared as the hand passes
            self.meta_refs[g[:end][passed]] = 0
            if len(vict):
                picked.append(ring[vict])
                vq_parts.append(q[vict])
            t += end
        pos = (p + t) % n
        U64.pack_into(self.mm, co + CLS_HAND, (int(heads[pos // bps]) << 8) | (pos % bps))
        if not got:
            return 0
        idx = np.concatenate(picked)
        vq = np.concatenate(vq_parts)
        vheads, vindex = heads[idx // bps], idx % bps
        voffs = vheads * self.U + vindex * info.block
        vwords = vq[:, 0]
        lens = vq[:, 3] & np.uint64(0xFFFFFFFF)
        gone = self.host.unpublish_many(vq[:, 1:3], voffs.astype(np.uint64), vwords)
        # Free what we unpublished, and orphans (LIVE, unowned, not indexed); a block whose word moved on,
        # or that another process claimed by unpublishing it first, is not ours to free.
        freed = evicted = evicted_bytes = 0
        if len(voffs) > SMALL_BATCH:
            g = voffs // self.G
            now = self.meta_q[g]
            mine = (now[:, 0] == vwords) & (gone | (((now[:, 3] >> np.uint64(32)) & np.uint64(0xFFFF)) == 0))
            sel = np.flatnonzero(mine)
            if sel.size:
                self._free_many(info, vheads[sel], vindex[sel], g[sel])
                freed, evicted = int(sel.size), int(gone[sel].sum())
                evicted_bytes = int(lens[sel][gone[sel]].sum())
        else:
            for off, h, i, w, n_bytes, g_ in zip(voffs.tolist(), vheads.tolist(), vindex.tolist(), vwords.tolist(),
                                                 lens.tolist(), gone.tolist()):
                mo = self.meta_off(off)
                if U64.unpack_from(self.mm, mo)[0] != w:
                    continue
                if not g_ and U16.unpack_from(self.mm, mo + 28)[0]:
                    continue  # claimed by a process that unpublished it first: it frees it
                self._free_block(h, info, i, off)
                freed += 1
                if g_:
                    evicted += 1
                    evicted_bytes += n_bytes
                if _cp.ARMED is not None:
                    _cp.hit("evict.block_mid")
        self.host.count(evictions=evicted, evicted_bytes=evicted_bytes, orphans_freed=freed - evicted)
        return freed

    def find_free_run(self, k: int) -> int | None:
        runs = self.find_free_runs(k, 1)
        return runs[0] if runs else None

    def find_free_runs(self, k: int, count: int) -> list[int]:
        """POOL held: starts of up to `count` non-overlapping runs of k FREE units, lowest first.

        The search starts at the free floor (superblock `free_floor`: no unit below
        it is FREE) and reads the slab table in windows, stopping once it has
        enough runs: a full pool, which has no free unit, costs nothing to ask, and
        a filling pool reads a window, not the whole table (one 64-byte entry per
        unit). It then raises the floor to the first FREE unit it saw.
        """
        n = self.n_units
        if k > n or count <= 0:
            return []
        floor = U32.unpack_from(self.mm, FREE_FLOOR_OFF)[0]
        lo = min(floor, n)
        if n - lo < k:  # the free units left at the end (if any) are too few for one slab
            return []
        # The slab table is 64 bytes per unit and cold after a large copy: read what a filling pool needs
        # (its runs sit right at the floor), doubling the window while runs are missing.
        window = max(64, 2 * k * count)
        out: list[int] = []
        first_free = None
        nxt = lo  # no run may start before this (the end of the last run taken)
        while lo < n and len(out) < count:
            hi = min(n, lo + window)
            free = self.states[lo:hi] == UNIT_FREE
            bounds = (np.flatnonzero(free[1:] != free[:-1]) + (lo + 1)).tolist()  # segment starts, ends
            if free[0]:
                bounds.insert(0, lo)
            if free[-1]:
                bounds.append(hi)
            if first_free is None and bounds:
                first_free = bounds[0]
            resume = hi
            for s, e in zip(bounds[0::2], bounds[1::2]):
                # Maximal segments of FREE units [s, e), runs taken greedily from each start: the same runs
                # as trying every start in turn, without a Python step per unit of a large free area.
                u = max(s, nxt)
                if u + k <= e:
                    u = max(u, self._reach_before(s))  # past a damaged extent that runs into the segment
                while u + k <= e:
                    out.append(u)
                    if len(out) == count:
                        break
                    u += k
                nxt = max(nxt, u)
                if len(out) == count:
                    break
                if e == hi < n:  # the segment may go on past the window: resume where its runs stopped
                    resume = max(u, s)
            lo = resume if resume > lo else hi  # always forward
            window = min(2 * window, 1 << 16)
        new_floor = first_free if first_free is not None else lo
        if new_floor != floor:
            U32.pack_into(self.mm, FREE_FLOOR_OFF, new_floor)
        return out

    def lower_free_floor(self, u: int) -> None:
        """POOL held: unit u is about to become FREE; lower the floor first so the search reaches it (a crash
        in between leaves the floor low: a longer search, never a unit it skips)."""
        if u < U32.unpack_from(self.mm, FREE_FLOOR_OFF)[0]:
            U32.pack_into(self.mm, FREE_FLOOR_OFF, max(0, u))

    def _reach_before(self, s: int) -> int:
        """The first unit at or after s that no slab whose HEAD is before s extends over (s if none does).

        For a segment of FREE units starting at s, no HEAD lies inside the segment, so one read of the
        kmax units before s clears every start in it (the per-start `_reached_by_earlier_slab`, once).
        """
        lo = max(0, s - self._kmax + 1)
        heads = np.flatnonzero(self.states[lo:s] == UNIT_HEAD) + lo
        if not heads.size:
            return s
        cls = np.minimum(self.clsfield[heads], len(self._kvec) - 1).astype(np.int64)
        return max(s, int((heads + self._kvec[cls]).max()))

    def _reached_by_earlier_slab(self, u: int) -> bool:
        """Does a slab whose HEAD is before unit u extend to u or beyond?

        HEAD entries are the truth and TAIL entries derived, so a unit inside a slab's extent is not
        free whatever its own (damaged) entry says; a slab formatted there would overwrite that slab's
        values.
        """
        lo = max(0, u - self._kmax + 1)
        heads = np.flatnonzero(self.states[lo:u] == UNIT_HEAD) + lo
        if not heads.size:
            return False
        cls = np.minimum(self.clsfield[heads], len(self._kvec) - 1).astype(np.int64)
        return bool((heads + self._kvec[cls] > u).any())

    def _format_slab(self, h: int, info: ClassInfo) -> None:
        """CLASS and POOL held: make units h .. h+k-1 a slab of the class.

        TAILs are written before the HEAD: once the HEAD exists, every block of the slab, including
        those starting in a tail unit, must resolve (readers, free_blocks and reaping find a block's
        slab through its unit). A crash before the HEAD leaves TAILs of a unit that is not a HEAD,
        which POOL repair clears; a crash after it leaves only class-derived state (count, partial
        list) stale, which class repair rebuilds.
        """
        if info.k > 1:  # tails: head pointer first, then the state (numpy: one pass each)
            self.clsfield[h + 1:h + info.k] = h
            self.states[h + 1:h + info.k] = UNIT_TAIL
        s = self._slab(h)
        self.mm[s:s + SLAB_ENTRY] = bytes(SLAB_ENTRY)
        self._set32(s + 4, info.cid)
        self._set32(s + SLAB_NFREE, info.bps)
        self._set32(s + SLAB_NBLOCKS, info.bps)
        self.mm[s + SLAB_REF] = 1
        self._set32(s, UNIT_HEAD)  # commit point: the units now belong to the class
        if _cp.ARMED is not None:
            _cp.hit("slab.mid_format")
        o = self._cls_off(info.cid) + CLS_NSLABS
        self._set32(o, self._get32(o) + 1)
        self._partial_push(info.cid, h)

    # -- freeing ------------------------------------------------------------------
    def free_blocks(self, blocks, keep: int = 0) -> int:
        """Free blocks given as (offset, word) if their word is unchanged; returns how many were freed.

        With `keep` (this process's owner value, slot + 1; the blocks must be unindexed: an overwrite's
        old block, claimed when it was unpublished, or one of ours that was not published), each class
        first keeps up to `keep_limit` of those still owned by `keep` with that word for this
        process's next allocations of the class (`allocate` reuses them without the class lock). They stay LIVE, owned and unindexed, which every reader,
        `check` and eviction treat as in flight; `close` and a reaper settle them like any block a
        process still owns. So an overwrite-heavy process takes the class lock neither to free its old
        blocks nor to allocate new ones. Only the rest is freed, under the class lock.
        """
        by_class: dict[int, list] = {}
        infos: dict[int, ClassInfo] = {}
        for off, word in blocks:
            h, info = self.head_of(off)
            if info is not None:
                by_class.setdefault(info.cid, []).append((off, word))
                infos[info.cid] = info
        freed = 0
        for cid, items in by_class.items():
            if keep:
                room = self.keep_limit(infos[cid]) - len(self.kept.get(cid, ()))
                if room > 0:
                    mine, rest = [], []
                    for off, word in items:
                        # Kept only if still ours with that word (a block published by this batch and then
                        # evicted by it is not: freed) and a block start of the class (trust no offset).
                        if len(mine) < room and self._ours_to_keep(cid, off, word, keep):
                            mine.append((off, word))
                        else:
                            rest.append((off, word))
                    with self._kept_guard:
                        self.kept.setdefault(cid, []).extend(mine)
                    items = rest
                if not items:
                    continue
            with self.host.locks.hold(CLASS_LOCK_BASE + cid, repair=lambda c=cid: self.repair_class(c)):
                freed += self._free_listed(cid, items)
        return freed

    def _owned_by_live(self, meta_off: int) -> bool:
        owner = U16.unpack_from(self.mm, meta_off + META_OWNER_OFF)[0]
        return bool(owner) and self.host.slot_alive(owner)

    def _ours_to_keep(self, cid: int, off: int, word: int, owner: int) -> bool:
        """Is `off` a block start of a slab of class cid whose meta still has this word and owner?"""
        loc = self.block_index(off)
        if loc is None or loc[1].cid != cid:
            return False
        mo = self.meta_off(off)
        return (U64.unpack_from(self.mm, mo)[0] == word and U16.unpack_from(self.mm, mo + META_OWNER_OFF)[0] == owner
                and U32.unpack_from(self.mm, mo + META_LENGTH_OFF)[0] <= loc[1].block)

    @staticmethod
    def keep_limit(info: ClassInfo) -> int:
        """Blocks of a class a process keeps for reuse (KEEP_MAX, KEEP_BYTES, at least one)."""
        return max(1, min(KEEP_MAX, KEEP_BYTES // info.block))

    def _free_listed(self, cid: int, items) -> int:
        """CLASS[cid] held: free each (offset, word) that is still a block of the class with that word."""
        freed = 0
        for off, word in items:
            loc = self.block_index(off)
            if loc is None or loc[1].cid != cid:
                continue
            if U64.unpack_from(self.mm, self.meta_off(off))[0] == word:
                self._free_block(loc[0], loc[1], loc[2], off)
                freed += 1
        return freed

    def _free_block(self, h: int, info: ClassInfo, i: int, off: int) -> None:
        """CLASS lock held: mark a block FREE (word bumped first, so readers miss) and update derived state."""
        m = self.meta_off(off)
        (word,) = U64.unpack_from(self.mm, m)
        store_u64(self.mm, m, next_word(word, FREE))
        U16.pack_into(self.mm, m + 28, 0)
        self.mm[m + 30] = 0
        if self._bit(h, i):
            self._set_bit(h, i, False)
            s = self._slab(h)
            self._set32(s + SLAB_NFREE, min(info.bps, self._get32(s + SLAB_NFREE) + 1))
            self._add_used(info.cid, -1)
            self._partial_push(info.cid, h)

    def _free_many(self, info: ClassInfo, heads: np.ndarray, index: np.ndarray, g: np.ndarray) -> None:
        """CLASS lock held: mark a batch of blocks of one class FREE (blocks `index` of slabs `heads`, block
        metas `g`; their words checked by the caller), then update the derived state once per slab.

        Every word is bumped first (readers miss from then on), then owner and ref cleared; a crash
        before the bitmaps, counts and partial list agree leaves them to class repair, which derives
        them from the block metas.
        """
        q = self.meta_q
        q[g, 0] = (((q[g, 0] >> np.uint64(2)) + np.uint64(1)) << np.uint64(2)) | np.uint64(FREE)
        q[g, 3] &= np.uint64(0xFFFFFFFF)  # owner, ref and flags 0; length kept
        if _cp.ARMED is not None:
            _cp.hit("evict.block_mid")
        order = np.argsort(heads, kind="stable")
        hs, ix = heads[order].tolist(), index[order].tolist()
        j = 0
        while j < len(hs):
            h, bits = hs[j], 0
            while j < len(hs) and hs[j] == h:
                bits |= 1 << ix[j]
                j += 1
            s = self._slab(h)
            bm = int.from_bytes(self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32], "little")
            cleared = (bm & bits).bit_count()
            if cleared:
                self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32] = (bm & ~bits).to_bytes(32, "little")
                self._set32(s + SLAB_NFREE, min(info.bps, self._get32(s + SLAB_NFREE) + cleared))
                self._add_used(info.cid, -cleared)
                self._partial_push(info.cid, h)

    # -- eviction -----------------------------------------------------------------
    def _slab_referenced(self, h: int, k: int, clear: bool) -> bool:
        hit = False
        for u in range(h, min(h + k, self.n_units)):
            r = self._slab(u) + SLAB_REF
            if self.mm[r]:
                hit = True
                if clear:
                    self.mm[r] = 0
        return hit

    def _heads_in(self, w0: int, k: int) -> list[int] | None:
        """Heads of the slabs overlapping units [w0, w0 + k); None if a TAIL there names no HEAD before it."""
        heads: list[int] = []
        for u in range(w0, w0 + k):
            st = self._get32(self._slab(u))
            h = u if st == UNIT_HEAD else (self._get32(self._slab(u) + 4) if st == UNIT_TAIL else None)
            if h is not None and st == UNIT_TAIL and not (0 <= h < u and self._get32(self._slab(h)) == UNIT_HEAD):
                return None  # damaged (repair_pool rewrites tails): not a window to evict
            if h is not None and (not heads or heads[-1] != h):
                heads.append(h)
        return heads

    def _evict_for(self, info: ClassInfo) -> int | None:
        """Slab CLOCK: free a window of info.k units by evicting the slabs in it. CLASS+POOL held."""
        n, k = self.n_units, info.k
        if k > n:
            return None
        (hand,) = U32.unpack_from(self.mm, SLAB_HAND_OFF)
        hand %= n
        for sweep in range(3):
            for step in range(n):
                u = (hand + step) % n
                if self._get32(self._slab(u)) != UNIT_HEAD:
                    continue
                c = self._get32(self._slab(u) + 4)
                cinfo = self.classes[c] if c < len(self.classes) else None
                if cinfo is None:
                    continue
                if sweep < 2 and self._slab_referenced(u, cinfo.k, clear=True):
                    continue
                w0 = min(u, n - k)
                if self._evict_window(w0, k, info.cid):
                    U32.pack_into(self.mm, SLAB_HAND_OFF, (u + 1) % n)
                    run = self.find_free_run(k)
                    if run is not None:
                        return run
        return None

    def _evict_window(self, w0: int, k: int, my_cid: int) -> bool:
        heads = self._heads_in(w0, k)
        if heads is None:
            return False
        locked: list[int] = []
        try:
            infos = []
            for h in heads:
                c = self._get32(self._slab(h) + 4)
                cinfo = self.classes[c] if c < len(self.classes) else None
                if cinfo is None or h + cinfo.k > self.n_units:
                    return False
                if c != my_cid and c not in locked:
                    r = self.host.locks.acquire(CLASS_LOCK_BASE + c, blocking=False)
                    if r is None:
                        return False
                    locked.append(c)
                    if r:
                        self.repair_class(c)
                    if self._get32(self._slab(h)) != UNIT_HEAD:
                        return False
                if not self._slab_evictable(h, cinfo):
                    return False
                infos.append((h, cinfo))
            self._evict_slabs(infos)
            return True
        finally:
            for c in locked:
                self.host.locks.release(CLASS_LOCK_BASE + c)

    def _slab_evictable(self, h: int, info: ClassInfo) -> bool:
        """No block of the slab is owned by a live process or pinned (LIVE with FLAG_PINNED)."""
        for i in range(info.bps):
            m = self.meta_off(h * self.U + i * info.block)
            state = U64.unpack_from(self.mm, m)[0] & 3
            if state == LIVE and self.mm[m + META_FLAGS_OFF] & FLAG_PINNED:
                return False
            owner = U16.unpack_from(self.mm, m + 28)[0]
            if owner and state != FREE and self.host.slot_alive(owner):
                return False
        return True

    def _evict_slabs(self, slabs: list[tuple[int, ClassInfo]]) -> None:
        """Holding the slabs' CLASS locks and POOL: unpublish and free every block, return the units.

        The LIVE blocks of all slabs are unpublished in one round of their shard
        locks (Store.unpublish_many), not one lock round per block. A slab one of
        whose blocks a live process claimed meanwhile is not freed (the window
        then stays short of free units: the caller looks for a free run anyway).
        """
        host = self.host
        live, live_len = [], []
        for h, info in slabs:
            for i in range(info.bps):
                off = h * self.U + i * info.block
                word, d, length, _, _ = META_STRUCT.unpack_from(self.mm, self.meta_off(off))
                if word & 3 == LIVE:
                    live.append((d, off, word))
                    live_len.append(length)
        gone = []
        if live:
            halves = np.frombuffer(b"".join([d for d, _, _ in live]), dtype="<u8").reshape(-1, 2)
            gone = host.unpublish_many(halves, np.array([o for _, o, _ in live], dtype=np.uint64),
                                      np.array([w for _, _, w in live], dtype=np.uint64)).tolist()
        evicted = sum(gone)
        evicted_bytes = sum(n for n, g in zip(live_len, gone) if g)
        q = self.meta_q
        moved = 0
        for h, info in slabs:
            if not self._slab_evictable(h, info):
                # While we unpublished, a live process claimed a block here first (it replaced or deleted
                # the block's entry under the shard lock): that block is its own now, and it may keep it
                # for reuse without a class lock (free_blocks(keep=...)), so the slab stays. The blocks we
                # did unpublish are freed one by one. No new claim can follow: no entry names a block of
                # this slab any more, and we hold its class lock.
                end = h * self.U + info.bps * info.block
                for (_, off, word), g_ in zip(live, gone):
                    if g_ and h * self.U <= off < end and U64.unpack_from(self.mm, self.meta_off(off))[0] == word:
                        self._free_block(h, info, (off - h * self.U) // info.block, off)
                continue
            moved += 1
            # every block FREE at once (word bumped first, so readers miss), then owner and ref cleared;
            # bitmap and free count need no upkeep: the slab leaves the class and is reformatted on reuse
            g = (h * self.U + np.arange(info.bps, dtype=np.int64) * info.block) // self.G
            words = q[g, 0]
            busy = (words & np.uint64(3)) != FREE
            if busy.any():
                gb = g[busy]
                q[gb, 0] = (((words[busy] >> 2) + 1) << 2) | FREE
                q[gb, 3] &= np.uint64(0xFFFFFFFF)  # owner, ref and flags 0; length kept
                self._add_used(info.cid, -int(busy.sum()))
            self._partial_remove(info.cid, h)
            s = self._slab(h)
            self.lower_free_floor(h)
            self._set32(s, UNIT_FREE)  # commit point: the units are free
            if _cp.ARMED is not None:
                _cp.hit("slab.mid_free")
            for t in range(h + 1, min(h + info.k, self.n_units)):
                if self._get32(self._slab(t)) == UNIT_TAIL:
                    self._set32(self._slab(t), UNIT_FREE)
            o = self._cls_off(info.cid) + CLS_NSLABS
            self._set32(o, max(0, self._get32(o) - 1))
        host.count(evictions=evicted, evicted_bytes=evicted_bytes, slab_moves=moved,
                  orphans_freed=len(live) - evicted)

    # -- repair -------------------------------------------------------------------
    def repair_pool(self) -> int:
        """POOL was left dirty: rewrite TAIL entries from HEAD entries, restart the free floor; returns fixes made."""
        fixes = 0
        U32.pack_into(self.mm, FREE_FLOOR_OFF, 0)  # whatever a dead holder left there, the search starts at 0
        covered = np.zeros(self.n_units, dtype=bool)
        for h in np.flatnonzero(self.states == UNIT_HEAD):
            h = int(h)
            if covered[h]:
                continue
            c = self._get32(self._slab(h) + 4)
            info = self.classes[c] if c < len(self.classes) else None
            if info is None or h + info.k > self.n_units:
                continue  # left to check(); class repair ignores unknown classes
            covered[h:h + info.k] = True
            for t in range(h + 1, h + info.k):
                if self._get32(self._slab(t)) != UNIT_TAIL or self._get32(self._slab(t) + 4) != h:
                    self._set32(self._slab(t) + 4, h)
                    self._set32(self._slab(t), UNIT_TAIL)
                    fixes += 1
        for t in np.flatnonzero((self.states == UNIT_TAIL) & ~covered):
            self._set32(self._slab(int(t)), UNIT_FREE)
            fixes += 1
        self.host.count(repairs=1)
        return fixes

    def class_slabs(self, cid: int) -> list[int]:
        return [int(h) for h in np.flatnonzero((self.states == UNIT_HEAD) & (self.clsfield == cid))]

    def repair_class(self, cid: int) -> int:
        """CLASS[cid] was left dirty (or `check --repair`): rebuild the class from block metas.

        Frees blocks of dead owners that never got published and LIVE blocks
        the index does not point at; returns the number of blocks freed. The
        index is asked under each shard's lock (Store.indexed_many), once per
        shard, after a first pass has picked the LIVE blocks whose fate depends
        on it. Holding CLASS[cid], no block of the class changes between FREE
        and not FREE meanwhile. A LIVE block can still become owned: a live
        process that replaced or deleted its entry (under the shard lock, before
        the index was asked) claimed it, and may keep it and reuse it without
        this lock. So the owner is read again just before a block is freed: a
        block a live process owns is its own to settle, and stays used.
        """
        info = self.classes[cid] if cid < len(self.classes) else None
        if info is None:
            return 0
        heads = [h for h in self.class_slabs(cid) if h + info.k <= self.n_units]  # not past the data area
        drop: set[int] = set()
        damaged: set[int] = set()  # freed whoever owns them
        ask = []  # LIVE blocks kept only if indexed: (digest, offset, word, dead owner to clear or 0)
        for h in heads:
            for i in range(info.bps):
                off = h * self.U + i * info.block
                word, d, length, owner, _ = META_STRUCT.unpack_from(self.mm, self.meta_off(off))
                state = word & 3
                if state == FREE:
                    continue
                if state not in (RESERVED, LIVE) or length > info.block:
                    damaged.add(off)
                elif owner and self.host.slot_alive(owner):
                    continue  # a live writer's block (in flight or being unpublished): it settles it
                elif state == RESERVED:
                    drop.add(off)
                else:
                    ask.append((d, off, word, owner))
        if ask:
            for (_, off, _, _), indexed in zip(ask, self.host.indexed_many(ask)):
                if not indexed:
                    drop.add(off)
        freed = 0
        co = self._cls_off(cid)
        self._set32(co + CLS_PARTIAL, 0)
        used_total = 0
        for h in heads:
            s = self._slab(h)
            self._set32(s + SLAB_NEXT, 0)
            self._set32(s + SLAB_PREV, 0)
            self.mm[s + SLAB_INPARTIAL] = 0
            bitmap = bytearray(32)
            used = 0
            for i in range(info.bps):
                off = h * self.U + i * info.block
                m = self.meta_off(off)
                (word,) = U64.unpack_from(self.mm, m)
                if word & 3 == FREE:
                    continue
                if off in damaged or (off in drop and not self._owned_by_live(m)):
                    store_u64(self.mm, m, next_word(word, FREE))
                    U16.pack_into(self.mm, m + 28, 0)
                    freed += 1
                    continue
                bitmap[i >> 3] |= 1 << (i & 7)
                used += 1
            self.mm[s + SLAB_BITMAP:s + SLAB_BITMAP + 32] = bytes(bitmap)
            self._set32(s + SLAB_NBLOCKS, info.bps)
            self._set32(s + SLAB_NFREE, info.bps - used)
            used_total += used
            if used < info.bps:
                self._partial_push(cid, h)
        self._set32(co + CLS_NSLABS, len(heads))
        self._set32(co + CLS_USED, used_total)
        self.host.count(repairs=1, orphans_freed=freed)
        return freed

    def resolve_owned(self, blocks, dead_owner: int) -> int:
        """Reaping: settle blocks whose owner slot died. Returns blocks freed.

        RESERVED blocks are freed; a LIVE block is kept (its owner cleared, under
        the shard lock that pins its entry) if the index points at it, else freed.
        """
        by_class: dict[int, list[int]] = {}
        for off in blocks:
            h, info = self.head_of(off)
            if info is not None:
                by_class.setdefault(info.cid, []).append(off)
        freed = 0
        for cid, offs in by_class.items():
            with self.host.locks.hold(CLASS_LOCK_BASE + cid, repair=lambda c=cid: self.repair_class(c)):
                settle = []  # (offset, block location, keep)
                ask, where = [], {}
                for off in offs:
                    loc = self.block_index(off)
                    if loc is None:
                        continue
                    m = self.meta_off(off)
                    word = U64.unpack_from(self.mm, m)[0]
                    owner = U16.unpack_from(self.mm, m + 28)[0]
                    if owner != dead_owner or word & 3 == FREE:
                        continue
                    if word & 3 == LIVE:
                        ask.append((bytes(self.mm[m + 8:m + 24]), off, word, dead_owner))
                        where[off] = loc
                    else:
                        settle.append((off, loc, False))
                if ask:
                    kept = self.host.indexed_many(ask)  # clears the owner of the indexed ones
                    settle += [(off, where[off], k) for (_, off, _, _), k in zip(ask, kept)]
                for off, loc, keep in settle:
                    if not keep:
                        self._free_block(loc[0], loc[1], loc[2], off)
                        freed += 1
                    if _cp.ARMED is not None:
                        _cp.hit("reap.mid")
        return freed


__all__ = ["Allocator", "ClassInfo", "SHARD_LOCK_BASE"]
