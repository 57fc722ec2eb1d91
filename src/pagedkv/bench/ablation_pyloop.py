"""The pure-Python variants of the decode-step ablation (:mod:`pagedkv.bench.ablation`): ``py-list``,
``py-dict``, ``py-objects`` and ``py-accessors``, each a small block manager with ``allocate``, ``fork``, ``free``
and ``step`` over the same per-step semantics as :meth:`pagedkv.BlockManager.decode_step` (one token per
sequence, no prefix caching, sliding window or lookahead). What each variant isolates, and why each has its own
copy of the hot loop: the docstring of :mod:`pagedkv.bench.ablation`. ``step`` is O(batch) Python statements.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Sequence

from pagedkv.errors import DuplicateSequenceError, InvalidTokensError, OutOfBlocksError, UnknownSequenceError

__all__ = ["PyList", "PyDict", "PyObjects", "PyAccessors", "PyBlock"]


class _Seq:
    """Per-sequence state of the Python variants, read by attribute."""

    __slots__ = ("ntok", "table")

    def __init__(self, ntok: int, table: list) -> None:
        self.ntok = ntok
        self.table = table


class _PyBase:
    """Plumbing shared by the Python variants (none of it on the timed path except the memo hit):
    sequence registry, batch memo, and allocate/fork/free for int ids over ``self._ref`` / ``self._free``."""

    name = "?"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seqs: dict = {}
        self._memo_ids: list | None = None
        self._memo_batch: list = []

    def _new_seq(self, seq_id: Hashable, ntok: int, table: list) -> None:
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        self._seqs[seq_id] = self._seq_cls(ntok, table)
        self._memo_ids = None

    _seq_cls = _Seq

    def _get(self, seq_id: Hashable):
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def _batch(self, seq_ids: list, n_tokens: int) -> list:
        """The batch's sequence objects; the last batch is memoised (one list compare), as in pagedkv."""
        if type(seq_ids) is not list:
            seq_ids = list(seq_ids)
        if seq_ids == self._memo_ids:
            batch = self._memo_batch
        else:
            batch = [self._get(s) for s in seq_ids]
            if len(set(map(id, batch))) != len(batch):
                raise DuplicateSequenceError("a sequence appears twice in one batch")
            self._memo_ids, self._memo_batch = seq_ids.copy(), batch
        if n_tokens != len(batch):
            raise InvalidTokensError(f"got {n_tokens} tokens for a batch of {len(batch)}")
        return batch

    # int-id plumbing (py-list, py-dict, py-accessors); py-objects overrides it
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        nb = -(-n // self.block_size)
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        if nb > len(self._free):
            raise OutOfBlocksError(f"prompt needs {nb} blocks; {len(self._free)} are free")
        ref, free = self._ref, self._free
        table = []
        for _ in range(nb):
            b = free.popleft()
            ref[b] = 1
            table.append(b)
        self._new_seq(seq_id, n, table)

    @staticmethod
    def _state(seq) -> tuple[int, list]:
        """(tokens, table) of a sequence object, for the untimed plumbing."""
        return seq.ntok, seq.table

    def fork(self, parent: Hashable, child: Hashable) -> None:
        ntok, table = self._state(self._get(parent))
        table = list(table)
        self._new_seq(child, ntok, table)
        ref = self._ref
        for b in table:
            ref[b] += 1

    def free(self, seq_id: Hashable) -> None:
        _, table = self._state(self._get(seq_id))
        ref, free = self._ref, self._free
        for b in reversed(table):
            ref[b] -= 1
            if ref[b] == 0:
                free.append(b)
        del self._seqs[seq_id]
        self._memo_ids = None

    def _needed(self, batch: list) -> int:
        """Exact blocks a one-token step needs (new blocks + copy-on-write copies, the last writer of a fully
        shared block keeping it). Only called when the free list is shorter than the batch."""
        bs, ref = self.block_size, self._ref
        need = 0
        writers: dict = {}
        for seq in batch:
            ntok, table = self._state(seq)
            if ntok % bs == 0:
                need += 1
            elif ref[table[-1]] > 1:
                writers[table[-1]] = writers.get(table[-1], 0) + 1
        for b, w in writers.items():
            need += w if w < ref[b] else w - 1
        return need

    def free_ids(self) -> list[int]:
        return list(self._free)

    def refcounts(self) -> list[int]:
        return [self._ref[b] for b in range(self._num_blocks)]


class PyList(_PyBase):
    """Pure-Python loop; refcounts in a flat list indexed by block id; int ids; internal attribute access."""

    name = "py-list"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free = deque(range(num_blocks))

    def step(self, seq_ids: list, token_ids, tables: bool = True):
        batch = self._batch(seq_ids, len(token_ids))
        ref, free, bs = self._ref, self._free, self.block_size
        if len(free) < len(batch):
            need = self._needed(batch)
            if need > len(free):
                raise OutOfBlocksError(f"the step needs {need} new blocks; {len(free)} are free")
        slots = []
        cow = []
        grow = []
        for seq in batch:
            n = seq.ntok
            off = n % bs
            if off:
                t = seq.table
                b = t[-1]
                if ref[b] > 1:  # copy-on-write
                    ref[b] -= 1
                    d = free.popleft()
                    ref[d] = 1
                    t[-1] = d
                    cow.append((b, d))
                    b = d
                slots.append(b * bs + off)
            else:  # all blocks full: a new block, taken after every copy-on-write destination
                grow.append(len(slots))
                slots.append(0)
            seq.ntok = n + 1
        for i in grow:
            d = free.popleft()
            ref[d] = 1
            batch[i].table.append(d)
            slots[i] = d * bs
        if not tables:
            return slots, None, None, cow
        return slots, [s.table for s in batch], [s.ntok for s in batch], cow


class PyDict(_PyBase):
    """``py-list`` with the refcounts in a dict keyed by block id."""

    name = "py-dict"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._num_blocks = num_blocks
        self._ref = {b: 0 for b in range(num_blocks)}
        self._free = deque(range(num_blocks))

    def step(self, seq_ids: list, token_ids, tables: bool = True):
        batch = self._batch(seq_ids, len(token_ids))
        ref, free, bs = self._ref, self._free, self.block_size
        if len(free) < len(batch):
            need = self._needed(batch)
            if need > len(free):
                raise OutOfBlocksError(f"the step needs {need} new blocks; {len(free)} are free")
        slots = []
        cow = []
        grow = []
        for seq in batch:
            n = seq.ntok
            off = n % bs
            if off:
                t = seq.table
                b = t[-1]
                if ref[b] > 1:  # copy-on-write
                    ref[b] -= 1
                    d = free.popleft()
                    ref[d] = 1
                    t[-1] = d
                    cow.append((b, d))
                    b = d
                slots.append(b * bs + off)
            else:
                grow.append(len(slots))
                slots.append(0)
            seq.ntok = n + 1
        for i in grow:
            d = free.popleft()
            ref[d] = 1
            batch[i].table.append(d)
            slots[i] = d * bs
        if not tables:
            return slots, None, None, cow
        return slots, [s.table for s in batch], [s.ntok for s in batch], cow


class PyBlock:
    """A block as an object (py-objects)."""

    __slots__ = ("id", "refcount")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.refcount = 0


class PyObjects(_PyBase):
    """``py-list`` with one object per block; the free list and the tables hold the objects."""

    name = "py-objects"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._blocks = [PyBlock(i) for i in range(num_blocks)]
        self._free = deque(self._blocks)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        nb = -(-n // self.block_size)
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        if nb > len(self._free):
            raise OutOfBlocksError(f"prompt needs {nb} blocks; {len(self._free)} are free")
        table = []
        for _ in range(nb):
            blk = self._free.popleft()
            blk.refcount = 1
            table.append(blk)
        self._new_seq(seq_id, n, table)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        p = self._get(parent)
        self._new_seq(child, p.ntok, list(p.table))
        for blk in p.table:
            blk.refcount += 1

    def free(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        for blk in reversed(seq.table):
            blk.refcount -= 1
            if blk.refcount == 0:
                self._free.append(blk)
        del self._seqs[seq_id]
        self._memo_ids = None

    def _needed(self, batch: list) -> int:
        bs = self.block_size
        need = 0
        writers: dict = {}
        for seq in batch:
            if seq.ntok % bs == 0:
                need += 1
            elif seq.table[-1].refcount > 1:
                blk = seq.table[-1]
                writers[blk] = writers.get(blk, 0) + 1
        for blk, w in writers.items():
            need += w if w < blk.refcount else w - 1
        return need

    def step(self, seq_ids: list, token_ids, tables: bool = True):
        batch = self._batch(seq_ids, len(token_ids))
        free, bs = self._free, self.block_size
        if len(free) < len(batch):
            need = self._needed(batch)
            if need > len(free):
                raise OutOfBlocksError(f"the step needs {need} new blocks; {len(free)} are free")
        slots = []
        cow = []
        grow = []
        for seq in batch:
            n = seq.ntok
            off = n % bs
            if off:
                t = seq.table
                blk = t[-1]
                if blk.refcount > 1:  # copy-on-write
                    blk.refcount -= 1
                    d = free.popleft()
                    d.refcount = 1
                    t[-1] = d
                    cow.append((blk.id, d.id))
                    blk = d
                slots.append(blk.id * bs + off)
            else:
                grow.append(len(slots))
                slots.append(0)
            seq.ntok = n + 1
        for i in grow:
            d = free.popleft()
            d.refcount = 1
            batch[i].table.append(d)
            slots[i] = d.id * bs
        if not tables:
            return slots, None, None, cow
        return slots, [[blk.id for blk in s.table] for s in batch], [s.ntok for s in batch], cow

    def free_ids(self) -> list[int]:
        return [blk.id for blk in self._free]

    def refcounts(self) -> list[int]:
        return [blk.refcount for blk in self._blocks]


class _PubSeq:
    """Per-sequence state behind public read-only accessors (py-accessors)."""

    __slots__ = ("_ntok", "_table")

    def __init__(self, ntok: int, table: list) -> None:
        self._ntok = ntok
        self._table = table

    @property
    def num_tokens(self) -> int:
        return self._ntok

    @property
    def num_blocks(self) -> int:
        return len(self._table)

    @property
    def last_block(self) -> int:
        return self._table[-1]

    @property
    def block_table(self) -> tuple:
        """Read-only: an immutable snapshot the caller may keep."""
        return tuple(self._table)


class _PubPool:
    """Refcounts and free list behind public read-only accessors (py-accessors)."""

    __slots__ = ("_ref", "_free")

    def __init__(self, num_blocks: int) -> None:
        self._ref = [0] * num_blocks
        self._free = deque(range(num_blocks))

    def refcount(self, block: int) -> int:
        return self._ref[block]

    @property
    def num_free(self) -> int:
        return len(self._free)


class PyAccessors(_PyBase):
    """``py-list`` whose hot loop reads through public read-only accessors (writes unchanged)."""

    name = "py-accessors"
    _seq_cls = _PubSeq

    @staticmethod
    def _state(seq) -> tuple[int, list]:
        return seq._ntok, seq._table

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._num_blocks = num_blocks
        self.pool = _PubPool(num_blocks)
        self._ref = self.pool._ref  # for the shared (untimed) plumbing
        self._free = self.pool._free

    def step(self, seq_ids: list, token_ids, tables: bool = True):
        batch = self._batch(seq_ids, len(token_ids))
        pool, bs = self.pool, self.block_size
        ref, free = pool._ref, pool._free  # writes only
        if pool.num_free < len(batch):
            need = self._needed(batch)
            if need > pool.num_free:
                raise OutOfBlocksError(f"the step needs {need} new blocks; {pool.num_free} are free")
        slots = []
        cow = []
        grow = []
        for seq in batch:
            n = seq.num_tokens
            off = n % bs
            if off:
                b = seq.last_block
                if pool.refcount(b) > 1:  # copy-on-write
                    ref[b] -= 1
                    d = free.popleft()
                    ref[d] = 1
                    seq._table[-1] = d
                    cow.append((b, d))
                    b = d
                slots.append(b * bs + off)
            else:
                grow.append(len(slots))
                slots.append(0)
            seq._ntok = n + 1
        for i in grow:
            d = free.popleft()
            ref[d] = 1
            batch[i]._table.append(d)
            slots[i] = d * bs
        if not tables:
            return slots, None, None, cow
        return slots, [s.block_table for s in batch], [s.num_tokens for s in batch], cow

