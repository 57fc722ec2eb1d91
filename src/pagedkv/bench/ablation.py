"""Ablation of the decode hot path: what do flat refcount arrays, int block ids and internal access buy?

The question (from a discussion of vLLM's block allocator): is a flat list of reference counts indexed by block
id better than a dict, are int block ids better than per-block objects, and does reading state through public
read-only accessors on the hot path cost anything measurable? This module answers it with data: the same decode
workload run through small block managers that differ in exactly one of those choices.

Every variant implements the same per-step semantics as :meth:`pagedkv.BlockManager.decode_step` with one new
token per sequence and no prefix caching, sliding window or lookahead:

- the token goes to position ``num_tokens`` of each sequence; its slot is ``block * block_size + offset``;
- a sequence whose blocks are all full takes a new block from a FIFO free list (oldest free block first);
- a sequence writing into a block it shares (refcount > 1) first copies it (copy-on-write): the destination
  comes from the free list, the source loses one reference; when every holder of a shared block writes it in
  the same step the last writer in batch order keeps the original (pagedkv's batch semantics, which a
  sequential loop gets for free);
- copy-on-write destinations are taken before new blocks, each group in batch order (so block ids match pagedkv
  exactly);
- all or nothing: a step that needs more blocks than are free raises OutOfBlocksError and changes nothing;
- ``free`` drops one reference per block, tail first; blocks reaching zero join the tail of the free list.

The variants (each a small class with ``allocate``, ``fork``, ``free`` and ``step``):

``pagedkv``
    The real :class:`~pagedkv.BlockManager` (vectorised numpy over the whole batch). The baseline.
``pagedkv-accessors``
    pagedkv's step, but the engine-facing output is built through the public read-only API, per sequence:
    ``block_table(seq_id)`` (a read-only copy) and ``num_tokens(seq_id)``, padded into the batch matrix, where
    the real step does one fancy index into its internal table matrix. The bookkeeping itself (refcounts, free
    ring, copy-on-write) cannot be done through read-only accessors at all in a vectorised design: there is no
    per-block public read it could use that would not turn the batch operation back into a Python loop, which
    is what the ``py-*`` variants measure. So this is the closest honest equivalent for the vectorised side:
    "a clean public API on the hot path" means per-sequence public reads, and this variant pays for them.
``py-list``
    A straightforward pure-Python loop over the batch: refcounts in a flat Python list indexed by block id, int
    block ids, a deque as the free list, per-sequence state in a ``__slots__`` object read by attribute. This
    isolates "vectorised batch vs Python loop".
``py-dict``
    ``py-list`` with the refcounts in a dict keyed by block id (pre-filled for every block, like vLLM's
    ``RefCounter``). Same statements, only the container differs.
``py-objects``
    ``py-list`` with one ``__slots__`` object per block (``id``, ``refcount``): the free list and the tables hold
    the objects, the refcount is an attribute, slots are computed from ``block.id``. The engine needs int ids,
    so the step's block tables are built as ``[b.id for b in table]``.
``py-accessors``
    ``py-list`` whose hot loop reads state through public read-only accessors, as a clean public API would
    expose them: ``pool.refcount(block)``, ``pool.num_free``, properties ``seq.num_tokens`` and
    ``seq.last_block``, and ``seq.block_table`` returning an immutable tuple (the read-only view a caller may
    keep). Writes are the same statements as ``py-list``, so the difference is the cost of the reads alone.

Each step is timed in two modes:

``step``
    the full engine-facing result: slot mapping, batch block tables, sequence lengths, copy-on-write pairs
    (``decode_step``'s :class:`~pagedkv.StepResult`; the ``py-*`` variants return Python lists, the int-id ones
    handing out their live table lists without a copy, the cheapest a Python manager can do);
``append``
    the bookkeeping only: slot mapping and copy-on-write pairs, no tables (pagedkv's internal
    ``_append(..., tables=False)``, the path behind ``append_slots``). ``pagedkv-accessors`` is identical to
    ``pagedkv`` here and is not run.

Method notes. The workload is the seed decode workload: ``batch`` sequences with ``prompt_len``-token prompts,
then ``steps`` decode steps over the whole batch, pool sized so nothing runs out. Each timed call is wrapped in
``time.perf_counter_ns``; a repeat's figure is the median over its steps. One step in ``block_size`` is a "fill
step" where every sequence takes a new block (the free-list pop and refcount write); the median over those is
kept too. The mean over steps is in the JSON only: on a shared machine it is dominated by a few preempted steps
(scheduler ticks of several milliseconds), which the medians ignore. Repeats interleave the variants (ABCABC, with the starting
variant rotated), so slow drift of this shared machine hits all of them alike; the first ``warmup`` rounds are
dropped. The cyclic GC is collected before and disabled during each timed run, as ``timeit`` does (the GC cost
of per-block objects is measured separately with the memory figures). Every ``py-*`` variant has its own copy of
the hot loop on purpose: CPython 3.11 specialises bytecode per code object (``BINARY_SUBSCR_LIST_INT`` vs
``BINARY_SUBSCR_DICT``), and one loop shared by the list and dict variants would be respecialised back and
forth as the runs interleave. All ``py-*`` variants memoise the last batch's sequence lookup as pagedkv does,
so the loop itself is what differs.

Run ``python -m pagedkv.bench.ablation [--quick] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections import deque
from typing import Callable, Hashable, Sequence

import numpy as np

from pagedkv import NULL_BLOCK, BlockManager
from pagedkv.errors import DuplicateSequenceError, InvalidTokensError, OutOfBlocksError, UnknownSequenceError

__all__ = [
    "VARIANTS",
    "MODES",
    "PagedKV",
    "PagedKVAccessors",
    "PyList",
    "PyDict",
    "PyObjects",
    "PyAccessors",
    "normalize",
    "run_ablation",
    "measure_memory",
    "format_table",
    "main",
]

MODES = ("step", "append")


# ---------------------------------------------------------------------------------------------- pagedkv itself
class PagedKV:
    """The real BlockManager (baseline)."""

    name = "pagedkv"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.bm = BlockManager(num_blocks, block_size, watermark=0.0)
        self.block_size = block_size

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.bm.allocate(seq_id, token_ids)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        self.bm.fork(parent, child)

    def free(self, seq_id: Hashable) -> None:
        self.bm.free(seq_id)

    def step(self, seq_ids: list, token_ids: np.ndarray, tables: bool = True):
        bm = self.bm
        if tables:
            return bm.decode_step(seq_ids, token_ids)
        # the bookkeeping alone: what decode_step does minus the batch tables (append_slots' path)
        rows = bm._t.rows(seq_ids)
        if len(token_ids) != rows.size:
            raise InvalidTokensError(f"got {len(token_ids)} tokens for a batch of {rows.size}")
        return bm._step.append(rows, np.ones(rows.size, dtype=np.int64), token_ids, 0, tables=False)

    def free_ids(self) -> list[int]:
        return self.bm._gpu.free_ids().tolist()

    def refcounts(self) -> list[int]:
        return self.bm._gpu.ref.tolist()


class _PublicReadsManager(BlockManager):
    """BlockManager whose decode_step builds the engine-facing output through the public read-only API."""

    def decode_step(self, seq_ids, token_ids, num_lookahead_slots=0):
        rows = self._t.rows(seq_ids)
        b = rows.size
        if len(token_ids) != b:
            raise InvalidTokensError(f"got {len(token_ids)} tokens for a batch of {b}")
        res = self._step.append(rows, np.ones(b, dtype=np.int64), token_ids, num_lookahead_slots, tables=False)
        tabs = [self.block_table(s) for s in seq_ids]  # public: read-only copy per sequence
        lens = np.fromiter((self.num_tokens(s) for s in seq_ids), dtype=np.int32, count=b)
        out = np.full((b, max(t.size for t in tabs)), NULL_BLOCK, dtype=np.int32)
        for i, t in enumerate(tabs):
            out[i, : t.size] = t
        return res._replace(block_tables=out, seq_lens=lens)


class PagedKVAccessors(PagedKV):
    """pagedkv's step with the batch tables and lengths gathered via ``block_table(seq_id)`` /
    ``num_tokens(seq_id)`` per sequence instead of one fancy index (see the module docstring)."""

    name = "pagedkv-accessors"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.bm = _PublicReadsManager(num_blocks, block_size, watermark=0.0)
        self.block_size = block_size


# ---------------------------------------------------------------------------------------------- pure Python
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


class _Block:
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
        self._blocks = [_Block(i) for i in range(num_blocks)]
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


VARIANTS: dict[str, type] = {
    "pagedkv": PagedKV,
    "pagedkv-accessors": PagedKVAccessors,
    "py-list": PyList,
    "py-dict": PyDict,
    "py-objects": PyObjects,
    "py-accessors": PyAccessors,
}
"""Variant name -> class, baseline first."""

_APPEND_SKIP = {"pagedkv-accessors"}  # identical to pagedkv in append mode

# (label, variant, reference, modes): the questions the ablation answers
QUESTIONS = (
    ("vectorised batch vs Python loop", "py-list", "pagedkv", MODES),
    ("dict vs list refcounts", "py-dict", "py-list", MODES),
    ("per-block objects vs int ids", "py-objects", "py-list", MODES),
    ("public accessors vs internal access (Python loop)", "py-accessors", "py-list", MODES),
    ("public accessors vs internal access (vectorised)", "pagedkv-accessors", "pagedkv", ("step",)),
)


def normalize(result) -> tuple:
    """A step result as plain tuples (slots, tables or None, seq_lens or None, cow pairs), for comparing variants:
    padded numpy tables lose their NULL_BLOCK padding, block objects were already turned into ids."""
    slots, tables, lens, cow = result
    slots = tuple(int(x) for x in slots)
    cow = tuple((int(s), int(d)) for s, d in cow)
    if tables is None:
        return slots, None, None, cow
    if isinstance(tables, np.ndarray):
        rows = tuple(tuple(int(b) for b in row if b != NULL_BLOCK) for row in tables)
    else:
        rows = tuple(tuple(int(b) for b in t) for t in tables)
    return slots, rows, tuple(int(x) for x in lens), cow


# ---------------------------------------------------------------------------------------------- timing
def _timed_run(cls: type, tables: bool, batch: int, steps: int, prompt_len: int, block_size: int) -> list[int]:
    """One run of the seed workload; nanoseconds of each decode step."""
    num_blocks = batch * -(-(prompt_len + steps) // block_size) + 64
    mgr = cls(num_blocks, block_size)
    prompt = np.ones(prompt_len, dtype=np.int32)
    for i in range(batch):
        mgr.allocate(i, prompt)
    ids = list(range(batch))
    toks = np.full(batch, 7, dtype=np.int32)
    step = mgr.step
    clock = time.perf_counter_ns
    times = []
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            t0 = clock()
            step(ids, toks, tables)
            times.append(clock() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return times


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ratio(a: list[float], b: list[float]) -> dict:
    """Ratio of medians of a to b, with bounds min(a)/max(b) .. max(a)/min(b) (the ranges overlap iff the
    bounds contain 1), and the paired per-repeat ratios (the rounds are interleaved)."""
    paired = [x / y for x, y in zip(a, b)]
    lo, hi = min(a) / max(b), max(a) / min(b)
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "lo": lo,
        "hi": hi,
        "paired": _spread(paired),
        "outside_noise": lo > 1.0 or hi < 1.0,
    }


def _pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def _verdict_text(label: str, a: str, b: str, cmp: dict) -> str:
    r, lo, hi = cmp["ratio"], cmp["lo"], cmp["hi"]
    if r >= 2:
        size = f"{r:.2f}x slower [{lo:.2f}x .. {hi:.2f}x]"
    elif r <= 0.5:
        size = f"{1 / r:.2f}x faster [{1 / hi:.2f}x .. {1 / lo:.2f}x]"
    else:
        size = f"{_pct(r)} time [{_pct(lo)} .. {_pct(hi)}]"
    noise = "outside noise" if cmp["outside_noise"] else "inside noise"
    return f"{label}: {a} vs {b} {size}, {noise}"


def run_ablation(
    repeats: int = 5,
    warmup: int = 1,
    batch: int = 1000,
    steps: int = 256,
    prompt_len: int = 256,
    block_size: int = 16,
    quick: bool = False,
    memory_blocks: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Time every variant in both modes on the seed decode workload and answer the questions.

    ``quick`` shrinks the workload (64 sequences, 64-token prompts, 48 steps, 3 repeats, 10k-block memory
    probe) for a smoke run of a few seconds. Returns a JSON-serialisable dict: ``config``, ``results[mode]
    [variant]`` (per-repeat medians and means in microseconds, their min/median/max, ratios to pagedkv and
    py-list), ``verdicts[mode]`` and ``memory`` (see :func:`measure_memory`).
    """
    if quick:
        repeats, warmup, batch, steps, prompt_len = min(repeats, 3), min(warmup, 1), 64, 48, 64
    if memory_blocks is None:
        memory_blocks = 10_000 if quick else 100_000
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    units = [(m, v) for m in MODES for v in VARIANTS if not (m == "append" and v in _APPEND_SKIP)]
    med: dict = {u: [] for u in units}
    mean: dict = {u: [] for u in units}
    fill: dict = {u: [] for u in units}
    fill_steps = [i for i in range(steps) if (prompt_len + i) % block_size == 0]  # every sequence takes a block
    t_start = time.perf_counter()
    for r in range(warmup + repeats):
        k = r % len(units)
        for mode, name in units[k:] + units[:k]:  # interleaved, start rotated each round
            ns = _timed_run(VARIANTS[name], mode == "step", batch, steps, prompt_len, block_size)
            if r >= warmup:
                med[(mode, name)].append(statistics.median(ns) / 1e3)
                mean[(mode, name)].append(statistics.fmean(ns) / 1e3)
                if fill_steps:
                    fill[(mode, name)].append(statistics.median(ns[i] for i in fill_steps) / 1e3)
        if progress:
            kind = "warmup" if r < warmup else "repeat"
            progress(f"{kind} {r + 1 - (warmup if r >= warmup else 0)} done ({time.perf_counter() - t_start:.0f} s)")
    results: dict = {m: {} for m in MODES}
    for mode, name in units:
        results[mode][name] = {
            "median_us": med[(mode, name)],
            "mean_us": mean[(mode, name)],
            **_spread(med[(mode, name)]),
            "mean": _spread(mean[(mode, name)]),
            "fill_median_us": fill[(mode, name)],
            "fill": _spread(fill[(mode, name)]) if fill_steps else None,
        }
    for mode in MODES:
        for name, row in results[mode].items():
            for ref in ("pagedkv", "py-list"):
                row[f"vs_{ref}"] = _ratio(row["median_us"], results[mode][ref]["median_us"])
    verdicts: dict = {m: [] for m in MODES}
    for label, a, b, modes in QUESTIONS:
        for mode in modes:
            cmp = _ratio(results[mode][a]["median_us"], results[mode][b]["median_us"])
            delta = statistics.median(results[mode][a]["median_us"]) - statistics.median(results[mode][b]["median_us"])
            verdicts[mode].append(
                {"question": label, "variant": a, "reference": b, **cmp, "delta_us": delta,
                 "text": _verdict_text(label, a, b, cmp)}
            )
    return {
        "config": {
            "repeats": repeats, "warmup": warmup, "batch": batch, "steps": steps, "prompt_len": prompt_len,
            "block_size": block_size, "quick": quick,
            "num_blocks": batch * -(-(prompt_len + steps) // block_size) + 64,
        },
        "environment": {
            "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "results": results,
        "verdicts": verdicts,
        "memory": measure_memory(memory_blocks),
        "elapsed_s": time.perf_counter() - t_start,
    }


# ---------------------------------------------------------------------------------------------- memory
def _traced(build: Callable[[], object]) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        obj = build()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used, obj


def _gc_ms(repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        gc.collect()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def _gc_cost(build: Callable[[], object]) -> tuple[int, float]:
    """(GC-tracked objects the built structure adds, extra ms a full gc.collect() takes while it is alive)."""
    gc.collect()
    before = len(gc.get_objects())
    obj = build()
    tracked = len(gc.get_objects()) - before
    with_obj = _gc_ms()
    del obj
    return tracked, with_obj - _gc_ms()


def measure_memory(num_blocks: int = 100_000) -> dict:
    """Bookkeeping bytes per block (tracemalloc) of each design, for a fresh pool of ``num_blocks`` blocks:

    - ``refcounts``: the refcount store alone (numpy int32 array / list of ints / dict id -> count with its
      key objects / the block objects with their id ints and the list holding them);
    - ``pool``: a whole fresh manager of the variant (refcounts + free list + block objects + empty tables);
    - ``gc_tracked_per_block`` and ``gc_ms``: GC-tracked objects the manager adds per block, and how much longer
      a full ``gc.collect()`` takes while it is alive (per-block ``__slots__`` objects are tracked containers
      the collector traverses; a list or deque of ints is one tracked object, though its items are still
      visited, a dict holding only ints is untracked, a numpy array is untracked). The time is a difference
      of two medians, only indicative on a noisy machine, and can be slightly negative when there is nothing.
    """
    n = num_blocks
    refcount_builders = {
        "pagedkv": lambda: np.zeros(n, dtype=np.int32),
        "py-list": lambda: [0] * n,
        "py-dict": lambda: {b: 0 for b in range(n)},
        "py-objects": lambda: [_Block(b) for b in range(n)],
    }
    rows = []
    for name, build in refcount_builders.items():
        ref_bytes, obj = _traced(build)
        del obj
        pool_bytes, mgr = _traced(lambda: VARIANTS[name](n, 16))
        del mgr
        tracked, gc_ms = _gc_cost(lambda: VARIANTS[name](n, 16))
        rows.append(
            {"design": name, "refcounts_bytes_per_block": ref_bytes / n, "pool_bytes_per_block": pool_bytes / n,
             "gc_tracked_per_block": tracked / n, "gc_ms": gc_ms}
        )
    return {"num_blocks": n, "rows": rows}


# ---------------------------------------------------------------------------------------------- report
_MODE_TITLES = {
    "step": "step: slot mapping + batch block tables + seq lens + CoW (what the engine needs)",
    "append": "append: bookkeeping only (slot mapping + CoW, no tables)",
}


def format_table(result: dict) -> str:
    """The result of :func:`run_ablation` as a text report."""
    c = result["config"]
    out = [
        f"pagedkv ablation: decode step, batch {c['batch']}, prompt {c['prompt_len']}, {c['steps']} steps, "
        f"block_size {c['block_size']}, pool {c['num_blocks']} blocks",
        f"{c['repeats']} repeats (+{c['warmup']} warmup), variants interleaved; per repeat the median us over the "
        "steps; across repeats min / median / max",
        "fill-step: median over repeats of the median us of the steps where every sequence takes a new block",
        "ratios: ratio of medians [min/max .. max/min]; 'noise' = the two min..max ranges overlap",
    ]
    hdr = f"{'variant':<18} {'min':>9} {'median':>9} {'max':>9} {'fill-step':>10}   {'x pagedkv':<22} {'x py-list':<22}"
    for mode in MODES:
        out += ["", _MODE_TITLES[mode], hdr, "-" * len(hdr)]
        for name, row in result["results"][mode].items():
            cells = []
            for ref in ("pagedkv", "py-list"):
                cmp = row[f"vs_{ref}"]
                if name == ref:
                    cells.append("1")
                else:
                    star = "" if cmp["outside_noise"] else " ~"
                    cells.append(f"{cmp['ratio']:.3g} [{cmp['lo']:.3g}..{cmp['hi']:.3g}]{star}")
            fill = f"{row['fill']['median']:.1f}" if row["fill"] else "-"
            out.append(
                f"{name:<18} {row['min']:>9.1f} {row['median']:>9.1f} {row['max']:>9.1f} "
                f"{fill:>10}   {cells[0]:<22} {cells[1]:<22}"
            )
    out += ["", "verdicts (~ marks ratios inside noise):"]
    for mode in MODES:
        for v in result["verdicts"][mode]:
            out.append(f"  [{mode:<6}] {v['text']} ({v['delta_us']:+.1f} us/step)")
    mem = result["memory"]
    out += [
        "",
        f"bookkeeping per block, fresh pool of {mem['num_blocks']} blocks (tracemalloc); pool = whole manager "
        "(refcounts + free list + block objects); gc = tracked objects per block and extra ms per full gc.collect()",
        f"{'design':<12} {'refcounts B/block':>18} {'pool B/block':>13} {'gc objs/block':>14} {'gc ms':>7}",
    ]
    for row in mem["rows"]:
        out.append(
            f"{row['design']:<12} {row['refcounts_bytes_per_block']:>18.1f} {row['pool_bytes_per_block']:>13.1f} "
            f"{row['gc_tracked_per_block']:>14.2f} {row['gc_ms']:>7.2f}"
        )
    e = result["environment"]
    out += ["", f"python {e['python']}, numpy {e['numpy']}, {e['machine']}, {e['cpus']} cpus; "
            f"{result['elapsed_s']:.0f} s"]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv bench ablation", description=plain(__doc__.split("\n\n")[0]),
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="small workload, a few seconds (smoke test)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved measured repeats")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--batch", type=int, default=1000, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=256, help="decode steps per run")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--json", metavar="PATH", help="also write the full result as JSON")
    a = p.parse_args(argv)
    result = run_ablation(
        repeats=a.repeats, warmup=a.warmup, batch=a.batch, steps=a.steps, prompt_len=a.prompt_len,
        block_size=a.block_size, quick=a.quick, progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
