"""The write path: reserve (CLASS locks), copy and commit (no lock), publish (SHARD locks), free what lost.

Per-key Python is the cost on small pages, so every step that can be is one numpy operation over the
batch (putbatch.VectorPut); a few keys take the scalar form (putbatch.ScalarPut). FORMAT.md section 8
gives the order of stores and what a death after each leaves behind.

Every block the call makes its own is in its ledger first (allocator/keptblocks.py): if the call raises, its
public entry settles them (calls.py `public_call`); a death leaves them to a reaper.
"""

from __future__ import annotations

import numpy as np

from .. import crashpoints as _cp
from ..batching import SMALL_BATCH
from ..errors import StoreError
from ..index import digest_array
from ..copying.pieces import PieceTable, piece_lengths
from .putbatch import ScalarPut, VectorPut
from .resolve import resolve


class WritePath:
    def __init__(self, att, engine, procs, counters, publisher, reap):
        self.att, self.engine, self.procs, self.counters, self.publisher = att, engine, procs, counters, publisher
        self.reap = reap  # () -> slots reaped: run when a class is out of room

    def put_batch(self, digests, pieces_list, skip_existing: bool, assume_absent: bool,
                  published_out: list | None = None) -> list[bool]:
        """Store one value per digest ((n, 16) uint8 array, or a list of 16-byte digests); the number of
        values published is appended to `published_out` when given."""
        n = len(digests)
        small = n <= SMALL_BATCH
        if small:  # the scalar path works on Python ints and bytes: a numpy call costs more than the key
            if isinstance(pieces_list, np.ndarray):
                pieces_list = pieces_list.tolist()
            darr = digests if isinstance(digests, list) else [row.tobytes() for row in digests]
        else:
            darr = digest_array(digests)
        pieces = pieces_list if small else PieceTable.of(pieces_list, n)
        lengths = piece_lengths(pieces_list) if small else pieces.lengths.tolist()
        res = [False] * n
        present = None
        if skip_existing and not assume_absent:
            present = resolve(self.att, digest_array(darr), full=False).ok.tolist()
        groups = self._by_class(lengths, present, res, one_class=not small and present is None)
        placed_i, placed_off = self._reserve(groups, darr, lengths, small)
        kind = ScalarPut if small else VectorPut
        in_order = len(groups) == 1 and len(placed_i) == n
        batch = kind(self.att, self.engine, darr, pieces, lengths, placed_i, placed_off, in_key_order=in_order)
        published, to_free, evicted, evicted_bytes = self._write(batch, skip_existing, res)
        if not all(published):
            # still owned by us until freed: a crash here is reaped
            to_free += [(off, w) for off, w, p in zip(placed_off, batch.lives, published) if not p]
        if _cp.ARMED is not None:
            _cp.hit("put.before_free")
        if to_free:
            self.att.alloc.free_blocks(to_free, keep=self.procs.owner)  # ours kept for our next puts of the class
        ok = sum(res)
        if len(placed_i) == n and all(published):  # the common case: every value placed and published
            written = sum(lengths)
            if published_out is not None:
                published_out.append(n)
        else:
            written = sum([lengths[i] for i, p in zip(placed_i, published) if p])
            if published_out is not None:
                published_out.append(sum(map(bool, published)))
        self.counters.count_put(ok, n - ok, evicted, evicted_bytes, written)
        return res

    def _by_class(self, lengths: list, present, res: list, one_class: bool) -> dict:
        """class id -> (ClassInfo, positions of the keys it stores); keys already present are answered in res."""
        alloc, max_value = self.att.alloc, self.att.geo.max_value
        groups: dict[int, tuple] = {}
        if one_class and min(lengths) == max(lengths):  # a batch of pages: one class
            info = alloc.class_for(lengths[0]) if lengths[0] <= max_value else None
            if info is not None:
                _check_fits(info, lengths[0])
                groups[info.cid] = (info, list(range(len(lengths))))
            return groups
        class_of: dict[int, object] = {}  # one class lookup per distinct length
        for i, length in enumerate(lengths):
            if present is not None and present[i]:
                res[i] = True
                continue
            info = class_of.get(length, False)
            if info is False:
                info = class_of[length] = alloc.class_for(length) if length <= max_value else None
            if info is not None:
                _check_fits(info, length)
                groups.setdefault(info.cid, (info, []))[1].append(i)
        return groups

    def _reserve(self, groups: dict, darr, lengths: list, small: bool) -> tuple[list[int], list[int]]:
        """Reserve a block per key, class by class; a class out of room frees the blocks this process keeps
        and reaps dead processes (owned blocks pin their slabs), then tries once more.
        (positions placed, their offsets): a key the pool cannot place is left out.

        A small batch hands the allocator lists (digests as bytes, lengths as ints), a large one numpy
        arrays ((m, 2) u64 halves, u64 lengths)."""
        alloc, owner = self.att.alloc, self.procs.owner
        if small:
            def of(positions):
                return [darr[i] for i in positions], [lengths[i] for i in positions]
        else:
            halves, lens_u = darr.view("<u8"), np.asarray(lengths, dtype=np.uint64)

            def of(positions):
                return halves[positions], lens_u[positions]
        placed_i: list[int] = []
        placed_off: list[int] = []
        for info, positions in groups.values():
            offs = alloc.allocate(info, *of(positions), owner)
            if len(offs) < len(positions) and alloc.free_kept() + self.reap():
                rest = positions[len(offs):]
                offs += alloc.allocate(info, *of(rest), owner)
            placed_i += positions[:len(offs)]
            placed_off += offs
            if _cp.ARMED is not None:
                _cp.hit("put.after_alloc")
        return placed_i, placed_off

    def _write(self, batch, skip_existing: bool, res: list):
        """Copy, commit and publish the placed blocks: (published flags, to free, evictions, evicted bytes)."""
        if not len(batch):
            return [], [], 0, 0
        batch.reserved()  # bounds-checks every block, computes what the commit and the publication need
        batch.copy()
        batch.commit()
        if _cp.ARMED is not None:
            _cp.hit("put.before_index")
        return self.publisher.publish(batch, skip_existing, res)


def _check_fits(info, length: int) -> None:
    """Never copy past a block: it would overwrite its neighbours."""
    if length > info.block:
        raise StoreError(f"internal error: class {info.cid} ({info.block}-byte blocks) chosen for a {length}-byte value")
