"""Block metas: one 32-byte record per granule, the other source of truth (FORMAT.md section 6).

The meta of a block's first granule holds its word (lifetime counter << 2 | state), the key's digest,
the value's length, the owner (slot + 1 of the process that holds it, 0 for none), the ref count for the
block CLOCK and the flags byte (pinned, and the length's check: every reservation writes the check with
the length, in the same store). A lifetime begins FREE -> RESERVED with the next word, and every change
of state writes the word first, so a lock-free reader holding the old word fails its check from then on.
"""

from __future__ import annotations

import numpy as np

from ..format.layout import (FLAG_PINNED, FREE, META_COLS, META_COL_DIGEST, META_COL_TAIL, META_COL_WORD,
                             META_DIGEST_OFF, META_FLAGS_OFF, META_OWNER_OFF, META_LAYOUT, META_REF_OFF, META_SIZE,
                             META_STRUCT, META_TAIL_FLAGS_SHIFT, META_TAIL_LENGTH_MASK, META_TAIL_OWNER_SHIFT,
                             META_TAIL_REF_SHIFT, RESERVED, U16, U64, length_flags, next_word, next_words, store_u64)
from ..format.records import record_struct

def digest_bytes(d) -> bytes:
    """One digest as 16 bytes: small batches pass them so, batch paths as rows of (m, 2) u64 halves."""
    return d if type(d) is bytes else d.tobytes()

_REST = record_struct(META_LAYOUT, "digest", "flags")  # the meta after its word
_OWNER_SHIFT, _REF_SHIFT, _FLAGS_SHIFT = META_TAIL_OWNER_SHIFT, META_TAIL_REF_SHIFT, META_TAIL_FLAGS_SHIFT
_WORD, _D0, _D1, _TAIL = META_COL_WORD, META_COL_DIGEST, META_COL_DIGEST + 1, META_COL_TAIL  # meta_q columns


class BlockMetas:
    def __init__(self, mm, geo):
        self.mm, self.geo = mm, geo
        n, base = geo.n_granules, geo.off_blockmeta
        # word, digest lo, digest hi, length|owner|ref|flags: one row of u64 per granule (vectorised batches)
        self.meta_q = np.ndarray((n, META_COLS), dtype="<u8", buffer=mm, offset=base, strides=(META_SIZE, 8))
        self.meta_words = self.meta_q[:, _WORD]
        self.meta_owners = np.ndarray((n,), dtype="<u2", buffer=mm, offset=base + META_OWNER_OFF,
                                      strides=(META_SIZE,))
        self.meta_refs = np.ndarray((n,), dtype=np.uint8, buffer=mm, offset=base + META_REF_OFF,
                                    strides=(META_SIZE,))
        self.shift = geo.granule_shift

    def release_views(self) -> None:
        self.meta_q = self.meta_words = self.meta_owners = self.meta_refs = None

    def meta_off(self, offset: int) -> int:
        return self.geo.meta_of(offset)

    def word(self, m: int) -> int:
        return U64.unpack_from(self.mm, m)[0]

    def owner(self, m: int) -> int:
        return U16.unpack_from(self.mm, m + META_OWNER_OFF)[0]

    def read(self, offset: int):
        """(word, digest, length, owner, ref, flags) of the block at data offset `offset`."""
        return META_STRUCT.unpack_from(self.mm, self.geo.meta_of(offset))

    # ---------------------------------------------------------------- CLOCK bits
    def is_pinned(self, offset: int) -> bool:
        """Is the block at this data offset pinned (Store.pin)? Out of range: no."""
        return 0 <= offset < self.geo.data_bytes and bool(self.mm[self.meta_off(offset) + META_FLAGS_OFF] & FLAG_PINNED)

    @staticmethod
    def columns(q: np.ndarray):
        """(owner, ref count above 0, pinned) of meta rows q (numpy)."""
        w3 = q[:, _TAIL]
        owner = (w3 >> np.uint64(_OWNER_SHIFT)) & np.uint64(0xFFFF)
        ref = ((w3 >> np.uint64(_REF_SHIFT)) & np.uint64(0xFF)) != 0
        pinned = ((w3 >> np.uint64(_FLAGS_SHIFT)) & np.uint64(FLAG_PINNED)) != 0
        return owner, ref, pinned

    # ---------------------------------------------------------------- lifetimes
    def reserve(self, offset: int, digest: bytes, length: int, owner: int, ref: int = 0) -> None:
        """FREE -> RESERVED in one write of the whole meta (flags: the length's check; not pinned). `ref`: the
        eviction policy's value for a new lifetime."""
        m = self.meta_off(offset)
        word = U64.unpack_from(self.mm, m)[0]
        self.mm[m:m + META_SIZE] = META_STRUCT.pack(next_word(word, RESERVED), digest, length, owner, ref,
                                                    length_flags(length))

    def reserve_many(self, offsets: list[int], dig: np.ndarray, lengths: np.ndarray, owner: int,
                     ref: int = 0) -> None:
        """FREE -> RESERVED for a batch of blocks (CLASS lock held), one numpy pass per field.

        `dig` holds the digests as (n, 2) little-endian u64 halves, `lengths` the value lengths (u64).
        The word (state RESERVED, next sequence) is written first: a reader still
        holding the old LIVE word then fails validation before digest or length
        change. A crash midway leaves RESERVED blocks of a dead or absent owner,
        which class repair frees (section 9 of FORMAT.md).
        """
        g = np.asarray(offsets, dtype=np.int64) >> self.shift
        q = self.meta_q
        q[g, _WORD] = next_words(q[g, _WORD], RESERVED)
        q[g, _D0] = dig[:, 0]
        q[g, _D1] = dig[:, 1]
        flags = length_flags(lengths) << np.uint64(_FLAGS_SHIFT)
        q[g, _TAIL] = lengths | flags | np.uint64(owner << _OWNER_SHIFT | ref << _REF_SHIFT)  # flags: the check, not pinned

    def re_reserve(self, m: int, word: int, digest: bytes, length: int, owner: int, ref: int, crash_point) -> None:
        """A kept block (LIVE, ours, unindexed) starts a new lifetime: the word first, then the rest."""
        mm = self.mm
        store_u64(mm, m, next_word(word, RESERVED))
        crash_point()  # RESERVED, still the old digest and length
        # One copy of the packed bytes, never struct.pack_into on the mapping: it zero-fills its target
        # before packing, and the live check, which reads this meta without the class lock we do not
        # hold here, would see a RESERVED block owned by nobody.
        mm[m + META_DIGEST_OFF:m + META_SIZE] = _REST.pack(digest, length, owner, ref, length_flags(length))  # not pinned

    def free(self, m: int) -> None:
        """End a lifetime: word bumped to FREE first (readers miss from then on), then owner and ref cleared."""
        mm = self.mm
        store_u64(mm, m, next_word(U64.unpack_from(mm, m)[0], FREE))
        U16.pack_into(mm, m + META_OWNER_OFF, 0)
        mm[m + META_REF_OFF] = 0

    def free_many(self, g: np.ndarray) -> None:
        """End the lifetimes of a batch of granules' blocks: every word first, then owner, ref and flags."""
        q = self.meta_q
        q[g, _WORD] = next_words(q[g, _WORD], FREE)
        q[g, _TAIL] &= np.uint64(META_TAIL_LENGTH_MASK)  # owner, ref and flags 0; length kept (never read when FREE)
