"""The slab table: one 64-byte entry per unit (FORMAT.md section 5), and the derived state kept in it.

A HEAD entry (state, class) is one of the two sources of truth: it says which units form a slab of
which class. TAIL entries, bitmaps, free counts, the partial list links and the ref bit are derived and
are rebuilt by repair (repair.py) when a holder died mid-section. Every method here that writes expects
the CLASS lock of the slab's class (and POOL where it changes a unit's state).
"""

from __future__ import annotations

import struct

import numpy as np

from .. import crashpoints as _cp
from ..format.layout import (BITMAP_BYTES, CLS_NSLABS, CLS_PARTIAL, CLS_USED, SLAB_BITMAP, SLAB_CLS, SLAB_ENTRY,
                             SLAB_INPARTIAL, SLAB_NBLOCKS, SLAB_NEXT, SLAB_NFREE, SLAB_PREV, SLAB_REF, SLAB_STATE,
                             U32, UNIT_HEAD, UNIT_TAIL)
from .classtable import ClassInfo, ClassTable


_STATE_CLS = struct.Struct("<II")  # a slab entry's first two fields (SLAB_STATE, SLAB_CLS): one read on hot paths


def get32(mm, off: int) -> int:
    return U32.unpack_from(mm, off)[0]


def set32(mm, off: int, v: int) -> None:
    U32.pack_into(mm, off, v & 0xFFFFFFFF)  # a damaged counter + 1 wraps (repair recounts)


class SlabTable:
    def __init__(self, mm, geo, classes: ClassTable):
        self.mm, self.geo, self.class_table = mm, geo, classes
        n, base = geo.n_units, geo.off_slabs
        self.states = np.ndarray((n,), dtype="<u4", buffer=mm, offset=base + SLAB_STATE, strides=(SLAB_ENTRY,))
        self.clsfield = np.ndarray((n,), dtype="<u4", buffer=mm, offset=base + SLAB_CLS, strides=(SLAB_ENTRY,))
        # slab ref bits, one per unit (a batch of reads marks its slabs recently used in one pass)
        self.unit_refs = np.ndarray((n,), dtype=np.uint8, buffer=mm, offset=base + SLAB_REF, strides=(SLAB_ENTRY,))

    def release_views(self) -> None:
        self.states = self.clsfield = self.unit_refs = None

    # ---------------------------------------------------------------- locating
    def state(self, u: int) -> int:
        return get32(self.mm, self.geo.slab_entry(u))

    def cls(self, u: int) -> int:
        """The class of a HEAD, or the head unit a TAIL names."""
        return get32(self.mm, self.geo.slab_entry(u) + SLAB_CLS)

    def state_and_cls(self, u: int) -> tuple[int, int]:
        return _STATE_CLS.unpack_from(self.mm, self.geo.off_slabs + u * SLAB_ENTRY)

    def head_of(self, offset: int):
        """(head unit, ClassInfo) of the slab containing data offset, or (None, None)."""
        geo = self.geo
        n = geo.n_units
        u = offset // geo.unit_size
        if not 0 <= u < n:
            return None, None
        read = _STATE_CLS.unpack_from
        st, c = read(self.mm, geo.off_slabs + u * SLAB_ENTRY)
        if st == UNIT_TAIL:
            u = c
            if not 0 <= u < n:
                return None, None
            st, c = read(self.mm, geo.off_slabs + u * SLAB_ENTRY)
            if st != UNIT_HEAD:
                return None, None
        elif st != UNIT_HEAD:
            return None, None
        classes = self.class_table.classes
        info = classes[c] if c < len(classes) else None
        if info is None:
            self.class_table.refresh()
            info = self.class_table.info(c)
        return (u, info) if info else (None, None)

    def block_index(self, offset: int):
        """(head, ClassInfo, block index) if offset is a block start of a slab, else None.

        The head's class alone does not make a block: a damaged class or count would lay the class's blocks
        over a neighbour's. So the slab must have the class's block count, and the unit of the block's last
        byte must be the head or one of its TAILs; a block failing either is no block (never copied into,
        never kept, never freed: check() reports it and repair settles it)."""
        h, info = self.head_of(offset)
        if h is None:
            return None
        geo = self.geo
        i, r = divmod(offset - geo.unit_offset(h), info.block)
        if r or not 0 <= i < info.bps:  # i < 0: a damaged TAIL named a later HEAD
            return None
        if get32(self.mm, geo.slab_entry(h) + SLAB_NBLOCKS) != info.bps:
            return None
        last = (offset + info.block - 1) // geo.unit_size
        if last != h and (last >= geo.n_units or _STATE_CLS.unpack_from(self.mm, geo.slab_entry(last)) != (UNIT_TAIL, h)):
            return None
        return h, info, i

    def class_slabs(self, cid: int) -> list[int]:
        """Heads of the class's slabs, lowest first: those that fit in the data area (Geometry.slab_fits)."""
        info = self.class_table.info(cid)
        if info is None:
            return []
        heads = np.flatnonzero((self.states == UNIT_HEAD) & (self.clsfield == cid))
        return heads[self.geo.slab_fits(heads, info.k)].tolist()

    def heads_in(self, w0: int, k: int) -> list[int] | None:
        """Heads of the slabs overlapping units [w0, w0 + k); None if a TAIL there names no HEAD before it."""
        heads: list[int] = []
        for u in range(w0, w0 + k):
            st = self.state(u)
            h = u if st == UNIT_HEAD else (self.cls(u) if st == UNIT_TAIL else None)
            if h is not None and st == UNIT_TAIL and not (0 <= h < u and self.state(h) == UNIT_HEAD):
                return None  # damaged (repair_pool rewrites tails): not a window to evict
            if h is not None and (not heads or heads[-1] != h):
                heads.append(h)
        return heads

    def referenced(self, h: int, k: int, clear: bool) -> bool:
        """Is a ref bit set on units h .. h+k-1 (the slab CLOCK's second chance)? Clear them if asked."""
        hit = False
        for u in range(h, min(h + k, self.geo.n_units)):
            r = self.geo.slab_entry(u) + SLAB_REF
            if self.mm[r]:
                hit = True
                if clear:
                    self.mm[r] = 0
        return hit

    # ---------------------------------------------------------------- bitmap (CLASS held)
    def bitmap(self, h: int) -> int:
        s = self.geo.slab_entry(h) + SLAB_BITMAP
        return int.from_bytes(self.mm[s:s + BITMAP_BYTES], "little")

    def set_bitmap(self, h: int, bits: int) -> None:
        s = self.geo.slab_entry(h) + SLAB_BITMAP
        self.mm[s:s + BITMAP_BYTES] = bits.to_bytes(BITMAP_BYTES, "little")

    def bit(self, h: int, i: int) -> bool:
        return bool(self.mm[self.geo.slab_entry(h) + SLAB_BITMAP + (i >> 3)] & (1 << (i & 7)))

    def set_bit(self, h: int, i: int, on: bool) -> None:
        o = self.geo.slab_entry(h) + SLAB_BITMAP + (i >> 3)
        b = self.mm[o]
        self.mm[o] = (b | (1 << (i & 7))) if on else (b & ~(1 << (i & 7)) & 0xFF)

    def nfree(self, h: int) -> int:
        return get32(self.mm, self.geo.slab_entry(h) + SLAB_NFREE)

    def set_nfree(self, h: int, n: int) -> None:
        set32(self.mm, self.geo.slab_entry(h) + SLAB_NFREE, n)

    def blocks_freed(self, h: int, info: ClassInfo, n: int) -> None:
        """CLASS held: n blocks of slab h went back to free: count them and put the slab on the partial list."""
        self.set_nfree(h, min(info.bps, self.nfree(h) + n))
        self.add_used(info.cid, -n)
        self.partial_push(info.cid, h)

    def usable_partial(self, h: int, info: ClassInfo) -> bool:
        """Is h a HEAD of this class, on the partial list, with the class's extent and shape?"""
        if h >= self.geo.n_units:
            return False
        s = self.geo.slab_entry(h)
        mm = self.mm
        state, cid = self.state_and_cls(h)
        return (state == UNIT_HEAD and cid == info.cid and self.geo.slab_fits(h, info.k)
                and bool(mm[s + SLAB_INPARTIAL]) and get32(mm, s + SLAB_NBLOCKS) == info.bps
                and (info.k == 1 or ((self.states[h + 1:h + info.k] == UNIT_TAIL).all()
                                     and (self.clsfield[h + 1:h + info.k] == h).all())))

    def take_free(self, h: int, info: ClassInfo, want: int, small: bool, pending: list[int]) -> None:
        """CLASS held: set up to `want` free bits of partial slab h, adding their offsets to `pending`."""
        base = self.geo.unit_offset(h)
        nfree = self.nfree(h)
        if small or info.bps <= 32:  # few bits: a Python int beats numpy's fixed cost per call
            bm = self.bitmap(h)
            free_bits = ~bm & ((1 << info.bps) - 1)
            got = 0
            while free_bits and got < want:
                low = free_bits & -free_bits
                free_bits ^= low
                bm |= low
                pending.append(base + (low.bit_length() - 1) * info.block)
                got += 1
            if got:
                self.set_bitmap(h, bm)
        else:
            bits = np.unpackbits(np.frombuffer(self.bitmap(h).to_bytes(32, "little"), np.uint8), bitorder="little")
            free = np.flatnonzero(bits[:info.bps] == 0)[:want]
            got = len(free)
            if got:
                bits[free] = 1
                self.set_bitmap(h, int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little"))
                pending += (base + free * info.block).tolist()
        nfree = 0 if got == 0 else max(0, nfree - got)  # no free bit: the count was stale
        self.set_nfree(h, nfree)
        self.add_used(info.cid, got)
        if nfree == 0:
            self.partial_remove(info.cid, h)
        self.mm[self.geo.slab_entry(h) + SLAB_REF] = 1

    # ---------------------------------------------------------------- class counters and partial list (CLASS held)
    def add_used(self, cid: int, delta: int) -> None:
        o = self.geo.class_entry(cid) + CLS_USED
        set32(self.mm, o, max(0, get32(self.mm, o) + delta))

    def add_slabs(self, cid: int, delta: int) -> None:
        o = self.geo.class_entry(cid) + CLS_NSLABS
        set32(self.mm, o, max(0, get32(self.mm, o) + delta))

    def partial_head(self, cid: int) -> int:
        """Head unit + 1 of the first slab on the class's partial list, 0 if it is empty."""
        return get32(self.mm, self.geo.class_entry(cid) + CLS_PARTIAL)

    def partial_push(self, cid: int, h: int) -> None:
        mm, geo = self.mm, self.geo
        s = geo.slab_entry(h)
        if mm[s + SLAB_INPARTIAL]:
            return
        head = self.partial_head(cid)
        set32(mm, s + SLAB_NEXT, head)
        set32(mm, s + SLAB_PREV, 0)
        if head and head - 1 < geo.n_units:
            set32(mm, geo.slab_entry(head - 1) + SLAB_PREV, h + 1)
        mm[s + SLAB_INPARTIAL] = 1
        set32(mm, geo.class_entry(cid) + CLS_PARTIAL, h + 1)

    def partial_remove(self, cid: int, h: int) -> None:
        mm, geo = self.mm, self.geo
        s = geo.slab_entry(h)
        if not mm[s + SLAB_INPARTIAL]:
            return
        nxt, prv = get32(mm, s + SLAB_NEXT), get32(mm, s + SLAB_PREV)
        if prv and prv - 1 < geo.n_units:
            set32(mm, geo.slab_entry(prv - 1) + SLAB_NEXT, nxt)
        else:
            set32(mm, geo.class_entry(cid) + CLS_PARTIAL, nxt)
        if nxt and nxt - 1 < geo.n_units:
            set32(mm, geo.slab_entry(nxt - 1) + SLAB_PREV, prv)
        set32(mm, s + SLAB_NEXT, 0)
        set32(mm, s + SLAB_PREV, 0)
        mm[s + SLAB_INPARTIAL] = 0

    def unlink_all(self, cid: int, h: int) -> None:
        """Repair: forget slab h's partial-list links (the list is rebuilt from scratch)."""
        s = self.geo.slab_entry(h)
        set32(self.mm, s + SLAB_NEXT, 0)
        set32(self.mm, s + SLAB_PREV, 0)
        self.mm[s + SLAB_INPARTIAL] = 0

    # ---------------------------------------------------------------- formatting (CLASS and POOL held)
    def format(self, h: int, info: ClassInfo) -> None:
        """Make units h .. h+k-1 a slab of the class.

        TAILs are written before the HEAD: once the HEAD exists, every block of the slab, including
        those starting in a tail unit, must resolve (readers, free_blocks and reaping find a block's
        slab through its unit). A crash before the HEAD leaves TAILs of a unit that is not a HEAD,
        which POOL repair clears; a crash after it leaves only class-derived state (count, partial
        list) stale, which class repair rebuilds.
        """
        mm = self.mm
        if info.k > 1:  # tails: head pointer first, then the state (numpy: one pass each)
            self.clsfield[h + 1:h + info.k] = h
            self.states[h + 1:h + info.k] = UNIT_TAIL
        s = self.geo.slab_entry(h)
        mm[s:s + SLAB_ENTRY] = bytes(SLAB_ENTRY)
        set32(mm, s + SLAB_CLS, info.cid)
        set32(mm, s + SLAB_NFREE, info.bps)
        set32(mm, s + SLAB_NBLOCKS, info.bps)
        mm[s + SLAB_REF] = 1
        set32(mm, s + SLAB_STATE, UNIT_HEAD)  # commit point: the units now belong to the class
        if _cp.ARMED is not None:
            _cp.hit("slab.mid_format")
        self.add_slabs(info.cid, 1)
        self.partial_push(info.cid, h)
