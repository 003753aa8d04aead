"""When a lock-free hit is believable: the read rule of docs/FORMAT.md section 8, in one place.

An index entry (digest d, word w, offset o) read without a lock names the committed value of d only if

  1. o lies inside the data area;
  2. the block meta at o holds word w (the same block lifetime: every reuse bumps the word) and w is LIVE;
  3. the block meta's digest is d;
  4. the stored length agrees with its check (meta flags, FORMAT.md section 6), and o + the length stays
     inside the data area;

and, before bytes are copied out of the block (`block_start_problem`):

  5. o is a block start of a formatted slab, and the stored length fits its block.

After a copy the reader re-reads the meta word: unchanged means the bytes were not torn by a reuse.
Rule 2 against the *entry's* word makes the entry's own digest redundant: a meta of that lifetime that
holds d was published for d.

Each rule exists here in the forms its callers need, side by side: scalar (`check_entry`, `lookup`,
`entry_problem`) for a few keys, batch (`check_entries`, `leading_mismatch`, `block_starts_ok`) for
numpy passes over 128 keys. A change to a rule changes every form in this module, and nowhere else.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..format.layout import (ENTRY_COL_OFFSET, ENTRY_COL_WORD, LENGTH_CHECK_BITS, LENGTH_CHECK_MOD, LENGTH_CHECK_MUL,
                             LENGTH_CHECK_SHIFT, LIVE, META_COL_DIGEST, META_COL_TAIL, META_COL_WORD, META_STRUCT,
                             META_TAIL_FLAGS_SHIFT, META_TAIL_LENGTH_MASK, UNIT_HEAD, UNIT_TAIL, length_check,
                             length_flags, length_sound)

# columns of index entries and block metas as rows of u64, and fields of a meta's tail u64
_E_WORD, _E_OFFSET = ENTRY_COL_WORD, ENTRY_COL_OFFSET
_M_WORD, _M_D0, _M_D1, _M_TAIL = META_COL_WORD, META_COL_DIGEST, META_COL_DIGEST + 1, META_COL_TAIL
_LENGTH = np.uint64(META_TAIL_LENGTH_MASK)  # the value's length
_FLAGS_AT = META_TAIL_FLAGS_SHIFT  # the flags byte (pinned, the length check)
_CHECK_AT = np.uint64(_FLAGS_AT + LENGTH_CHECK_SHIFT)  # the length check: the top bits of the tail
_MUL, _MOD = np.uint64(LENGTH_CHECK_MUL), np.uint64(LENGTH_CHECK_MOD)  # format.length_check on u64 arrays
_LENGTH_AND_CHECK = _LENGTH | np.uint64(LENGTH_CHECK_BITS << _FLAGS_AT)
_STATE, _LIVE = np.uint64(3), np.uint64(LIVE)  # a word's low two bits: its state


class Hit(NamedTuple):
    """A committed value found by a lock-free lookup."""
    offset: int   # data offset of its block
    word: int     # the block meta word of its lifetime (re-read after a copy)
    length: int   # stored length
    meta: int     # file offset of its block meta


_new_hit = tuple.__new__  # Hit's own __new__ is a Python function: a third of a lookup's cost on a get


# ----------------------------------------------------------------- scalar forms
def check_entry(mm, geo, d: bytes, word: int, offset: int) -> Hit | None:
    """Rules 1-4 for one entry: the Hit it names, or None."""
    if not 0 <= offset < geo.data_bytes:
        return None
    m = geo.meta_of(offset)
    w, md, length, _, _, flags = META_STRUCT.unpack_from(mm, m)  # one read of the meta's fields, not four
    if w != word or w & 3 != LIVE or md != d or flags >> LENGTH_CHECK_SHIFT != length_check(length) \
            or offset + length > geo.data_bytes:
        return None
    return _new_hit(Hit, (offset, w, length, m))


def lookup(index, mm, geo, d: bytes) -> Hit | None:
    """The committed value of d by a bounded probe of the index, or None (rules 1-4)."""
    found = index.find(d)
    if found is None:
        return None
    return check_entry(mm, geo, d, found[0], found[1])


def names_lifetime(mm, geo, d: bytes, word: int, offset: int) -> bool:
    """Rules 1-3 without LIVE, and the length's check: the entry names this lifetime of a block holding d.

    What shard repair keeps while a publication may be in flight (the entry's word is the block's whatever
    its state), and what a write that skips existing keys takes as present; readers add LIVE on top. A
    length its check refutes names nothing: such a block is never read, so a write must replace it.
    """
    if not 0 <= offset < geo.data_bytes:
        return False
    w, md, length, _, _, flags = META_STRUCT.unpack_from(mm, geo.meta_of(offset))
    return w == word and md == d and length_sound(length, flags)


def block_start_problem(alloc, offset: int, length: int) -> str | None:
    """Rule 5 for one block: why a copy must not start at `offset` for `length` bytes, or None."""
    loc = alloc.block_index(offset)
    if loc is None:
        return f"offset {offset} is not a block start in the data area"
    if length > loc[1].block:
        return f"block at {offset} holds {length} bytes, more than its {loc[1].block}-byte block"
    return None


def entry_problem(mm, geo, alloc, d: bytes, word: int, offset: int) -> str | None:
    """Rules 1-5 for one entry, as the checks report them: why a reader would refuse it, or None."""
    if not 0 <= offset < geo.data_bytes or alloc.block_index(offset) is None:
        return f"offset {offset} is not a block start in the data area"
    mword, md, length, _, _, flags = META_STRUCT.unpack_from(mm, geo.meta_of(offset))
    if mword != word or word & 3 != LIVE or md != d:
        return f"block at {offset} does not hold this committed value"
    if not length_sound(length, flags):
        return f"block at {offset}: length {length} disagrees with its check"
    if block_start_problem(alloc, offset, length):
        return f"block at {offset} does not hold this committed value"
    return None


# ----------------------------------------------------------------- batch forms
def check_entries(meta_q: np.ndarray, geo, e: np.ndarray, h0: np.ndarray, h1: np.ndarray):
    """Rules 1-4 for index entries `e` (rows of 4 u64) of digests (h0, h1): (offsets, words, lengths, ok)."""
    words = e[:, _E_WORD]
    inside = e[:, _E_OFFSET] < np.uint64(geo.data_bytes)
    offs = (e[:, _E_OFFSET] * inside).astype(np.intp)  # out-of-range offsets read meta 0 and fail below
    m = meta_q[offs >> geo.granule_shift]
    m3 = m[:, _M_TAIL]
    stored = m3 & _LENGTH
    lengths = stored.astype(np.intp)
    check = (m3 >> _CHECK_AT) ^ stored * _MUL % _MOD  # zero where the length agrees with its check
    ok = (((m[:, _M_WORD] ^ words) | (m[:, _M_D0] ^ h0) | (m[:, _M_D1] ^ h1) | check) == 0) \
        & inside & ((words & _STATE) == _LIVE) & (offs + lengths <= geo.data_bytes)
    return offs, words, lengths, ok


def leading_mismatch(meta_q: np.ndarray, geo, e: np.ndarray, halves: np.ndarray, length: int | None) -> np.ndarray:
    """Rules 1-4 (and a stored length equal to `length`, if given) fused into one u64 per entry, zero only
    for a hit: the fast form for the hit query, where most batches are all hits.

    `length`, if given, must be in 0..min(data_bytes, 2**32 - 1) (the caller answers 0 hits otherwise).
    """
    # an offset outside the data area reads a clipped meta, and fails its own check below
    e3 = e[:, _E_OFFSET]
    m = meta_q.take((e3 >> np.uint64(geo.granule_shift)).view(np.int64), axis=0, mode="clip")
    m0, m3 = m[:, _M_WORD], m[:, _M_TAIL]
    d = m[:, _M_D0:_M_D1 + 1] ^ halves
    bad = (m0 ^ e[:, _E_WORD]) | d[:, 0] | d[:, 1] | ((m0 & _STATE) ^ _LIVE)
    if length is None:
        lengths = m3 & _LENGTH
        bad |= (e3 >= np.uint64(geo.data_bytes)) | (e3 + lengths > np.uint64(geo.data_bytes))
        bad |= (m3 >> _CHECK_AT) ^ lengths * _MUL % _MOD
    else:  # the length and its check both as expected; offset + length <= data_bytes, and offset inside it
        want = np.uint64(length | length_flags(length) << _FLAGS_AT)
        bad |= ((m3 ^ want) & _LENGTH_AND_CHECK) | (e3 > np.uint64(geo.data_bytes - max(length, 1)))
    return bad


def block_starts_ok(alloc, geo, offs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rule 5 for a batch: is each offset a block start of a formatted slab, with its length inside that block?"""
    unit = offs // geo.unit_size
    st = alloc.states[unit]
    cls_u = alloc.clsfield[unit].astype(np.int64)
    head = np.where(st == UNIT_TAIL, np.minimum(cls_u, geo.n_units - 1), unit)
    cid = np.minimum(alloc.clsfield[head].astype(np.int64), geo.class_cap - 1)
    block, per_slab = alloc.class_arrays()
    blk = block[cid]
    rel = offs - geo.unit_offset(head)
    safe_blk = np.maximum(blk, 1)
    return ((st == UNIT_HEAD) | (st == UNIT_TAIL)) & (alloc.states[head] == UNIT_HEAD) & (blk > 0) \
        & (rel >= 0) & (rel % safe_blk == 0) & (rel // safe_blk < per_slab[cid]) & (lengths <= blk)
