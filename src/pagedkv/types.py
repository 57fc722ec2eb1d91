"""Public result types of the block manager."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["AllocStatus", "CacheCopies", "CopyKind", "CopyPlan", "NULL_BLOCK", "PrefillBatch", "PrefixHit", "StepDelta",
           "StepResult", "Stats", "TableUpdates"]


NULL_BLOCK = -1
"""Pads batch block tables and marks table positions released by the sliding window."""


class AllocStatus(enum.Enum):
    """Answer of :meth:`BlockManager.can_allocate` and :meth:`BlockManager.can_swap_in`."""

    OK = "ok"  #: fits now
    LATER = "later"  #: does not fit now, may after other sequences free blocks
    NEVER = "never"  #: can never fit (more blocks than the pool minus the watermark)


class StepResult(NamedTuple):
    """What the engine needs for one batched append (see :meth:`BlockManager.decode_step`).

    A *slot* is ``block_id * block_size + offset``: the row of the token in the engine's KV tensors viewed as
    ``(num_gpu_blocks * block_size, ...)`` (docs/engine-contract.md, "KV layout")."""

    slot_mapping: np.ndarray  #: int64 (total new tokens,): physical slot of each new token, batch order
    block_tables: np.ndarray  #: int32 (B, width): block tables padded with NULL_BLOCK (width: the longest, or the manager's block_table_width)
    seq_lens: np.ndarray  #: int32 (B,): tokens of each sequence after the append (KV positions 0 .. seq_len - 1; lookahead slots not counted)
    cow: np.ndarray  #: int64 (m, 2): copy-on-write pairs (src, dst) to copy before writing the new KV

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """int64 (G, T) with G = 1: ``slot_mapping`` as the one KV cache group's row, the shape
        :class:`pagedkv.HybridStepResult` has for G groups (one engine code path for every manager:
        docs/engine-contract.md, "One API for one group or many"). O(1): a view, built only when read."""
        return self.slot_mapping[None]

    @property
    def group_block_tables(self) -> tuple:
        """``(block_tables,)``: one table matrix per KV cache group, as :class:`pagedkv.HybridStepResult`'s. O(1)."""
        return (self.block_tables,)


class TableUpdates(NamedTuple):
    """The block-table entries one call changed, flat: after the call ``table[rows[i], cols[i]] == blocks[i]``
    for every ``i``, and every other entry of every table is as before. ``rows`` are table rows
    (:meth:`BlockManager.table_rows`), ``cols`` block positions in the sequence; no entry appears twice, so the
    order does not matter. ``blocks[i]`` is a new block (appended, or the copy-on-write destination that
    replaces a shared block) or ``NULL_BLOCK`` (released by the sliding window). The arrays are read-only."""

    rows: np.ndarray  #: int64 (k,): table row of each changed entry
    cols: np.ndarray  #: int64 (k,): its column (block position: tokens ``cols * block_size ..`` of the sequence)
    blocks: np.ndarray  #: int32 (k,): its new value

    def apply(self, table: object) -> None:
        """Write the changes into an engine-side table (a 2-D numpy array indexed ``[row, column]``, at least as
        large as the rows and columns named here): ``table[rows, cols] = blocks``. O(k)."""
        table[self.rows, self.cols] = self.blocks


class StepDelta(NamedTuple):
    """What :meth:`BlockManager.decode_step` returns with ``block_tables=False``: :class:`StepResult` with the
    batch's block tables given as the step's changes instead of in full, so that the step costs O(batch +
    changed entries) whatever the context length (docs/engine-contract.md, "Incremental block tables").

    The engine keeps one table per sequence in a matrix of its own, row ``table_rows[i]`` for sequence ``i``
    (stable from ``allocate`` / ``fork`` to ``free``, swaps included), loads the whole row after ``allocate``,
    ``fork`` and ``swap_in`` (``block_table(seq)``), and applies ``table_updates`` after each step: its row
    ``table_rows[i]`` then equals ``block_table(seq_ids[i])`` (the block tables ``decode_step`` would have
    returned, without the padding)."""

    slot_mapping: np.ndarray  #: int64 (total new tokens,): as StepResult.slot_mapping
    seq_lens: np.ndarray  #: int32 (B,): as StepResult.seq_lens
    cow: np.ndarray  #: int64 (m, 2): as StepResult.cow
    table_rows: np.ndarray  #: int64 (B,): the table row of each sequence of the batch
    table_updates: TableUpdates  #: the table entries this step changed (appends, copy-on-write, window releases)

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """int64 (1, T): ``slot_mapping`` as the one group's row, as :class:`pagedkv.HybridStepDelta`'s (G, T). O(1)."""
        return self.slot_mapping[None]

    @property
    def group_table_updates(self) -> tuple:
        """``(table_updates,)``: one :class:`TableUpdates` per KV cache group, as
        :class:`pagedkv.HybridStepDelta`'s. O(1)."""
        return (self.table_updates,)


class PrefixHit(NamedTuple):
    """What :meth:`BlockManager.lookup_prefix` predicts for a prompt, without changing anything: exactly what
    :meth:`BlockManager.allocate` would do if called now with the same arguments."""

    num_cached_tokens: int  #: tokens allocate would return as cached (a multiple of block_size, < len(prompt))
    num_cached_blocks: int  #: num_cached_tokens // block_size, both tiers together
    num_cpu_blocks: int  #: of which found in the CPU tier (each a promotion copy CPU -> GPU in take_copies)
    num_new_blocks: int  #: free GPU blocks the allocation would consume (num_free_gpu_blocks drops by this)


class PrefillBatch(NamedTuple):
    """Result of :meth:`BlockManager.allocate_batch`: the prefill metadata of B new sequences, flat, in batch
    order. Sequence ``i`` computes its prompt positions ``num_cached_tokens[i] .. seq_lens[i] - 1``: the
    flat tokens ``query_start_loc[i] .. query_start_loc[i + 1] - 1`` of ``token_ids`` / ``positions`` /
    ``slot_mapping``. Every array is read-only. ::

        prompts      A: a0 a1 a2 a3 a4 a5          B: b0 b1 b2 b3 b4   (block_size 2; A's first block cached)
        cached       2                             0
        token_ids    a2 a3 a4 a5 | b0 b1 b2 b3 b4
        positions     2  3  4  5 |  0  1  2  3  4
        query_start_loc  [0, 4, 9]
    """

    seq_ids: tuple  #: the sequences, in batch order
    num_cached_tokens: np.ndarray  #: int32 (B,): leading prompt tokens already cached (allocate's return value)
    query_start_loc: np.ndarray  #: int32 (B + 1,): offsets of each sequence's tokens to compute in the flat arrays
    token_ids: np.ndarray  #: int32 (T,): the tokens to compute (the prompts from their cached prefix on)
    positions: np.ndarray  #: int64 (T,): the position of each of them in its sequence
    slot_mapping: np.ndarray  #: int64 (T,): the slot each token's K/V is written to
    block_tables: np.ndarray  #: int32 (B, width) padded with NULL_BLOCK (width: the longest, or block_table_width)
    seq_lens: np.ndarray  #: int32 (B,): prompt lengths (tokens whose KV exists after the prefill)

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """int64 (1, T): ``slot_mapping`` as the one group's row, as :class:`pagedkv.HybridPrefillBatch`'s (G, T).
        O(1)."""
        return self.slot_mapping[None]

    @property
    def group_block_tables(self) -> tuple:
        """``(block_tables,)``: one table matrix per KV cache group, as :class:`pagedkv.HybridPrefillBatch`'s. O(1)."""
        return (self.block_tables,)


class CacheCopies(NamedTuple):
    """The CPU tier's copies of one step (deprecated :meth:`BlockManager.take_copies`; execute
    :meth:`BlockManager.take_copy_plan` instead: these lists are not in a safe order when a step also swaps)."""

    demotions: np.ndarray  #: int64 (m, 2): (gpu, cpu) pairs, GPU -> CPU, first
    promotions: np.ndarray  #: int64 (k, 2): (cpu, gpu) pairs, CPU -> GPU, then


class CopyKind(enum.IntEnum):
    """Direction of one copy of a :class:`CopyPlan` (the values of ``CopyPlan.kind``)."""

    GPU_TO_CPU = 0  #: a swap-out, or a demotion into the CPU tier of the prefix cache
    CPU_TO_GPU = 1  #: a swap-in, or a promotion from the CPU tier
    GPU_TO_GPU = 2  #: a copy-on-write


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Every KV block copy of one step, in the order the engine executes them
    (:meth:`BlockManager.take_copy_plan`; the contract is in docs/engine-contract.md).

    Copy ``i`` copies block ``src[i]`` of one device to block ``dst[i]`` of the other (or the same) device, in
    every layer, K and V, whole blocks; ``kind[i]`` (a :class:`CopyKind`) says which devices::

        i      0        1        2        3        4
        kind   GPU>CPU  CPU>GPU  CPU>GPU  GPU>CPU  GPU>GPU
        src    17       3        4        9        12       block ids of the source device
        dst    5        17       2        3        30       block ids of the destination device

    Execute the copies in index order, all of them before the step's forward. (Here copy 1 writes GPU block 17
    after copy 0 has read it, and copy 3 writes CPU block 3 after copy 1 has read it: any other order is wrong.)
    :meth:`batches` groups consecutive copies that may run as one gather-then-scatter each.

    The arrays are read-only: ``src`` and ``dst`` int64, ``kind`` int8, all of length ``len(plan)``.
    """

    src: np.ndarray
    dst: np.ndarray
    kind: np.ndarray

    def __len__(self) -> int:
        """Number of copies."""
        return self.src.shape[0]

    def batches(self) -> list[tuple[CopyKind, np.ndarray, np.ndarray]]:
        """The plan as runs of consecutive copies, ``(kind, src, dst)`` each, in order. Within a run all copies
        have the same kind, none reads a block that an earlier copy of the run writes and no block is written
        twice, so a run may be executed as one batched copy (read every source, then write every destination:
        ``dst_cache[:, :, dst] = src_cache[:, :, src]``). Executing the runs in order equals executing the copies
        one by one. O(len(self))."""
        n = len(self)
        if n == 0:
            return []
        src, dst, kind = self.src.tolist(), self.dst.tolist(), self.kind.tolist()
        out = []
        start, k0, written = 0, kind[0], set()
        for i in range(n):
            k = kind[i]
            s_key, d_key = (k == CopyKind.CPU_TO_GPU, src[i]), (k == CopyKind.GPU_TO_CPU, dst[i])
            if k != k0 or s_key in written or d_key in written:
                out.append((CopyKind(k0), self.src[start:i], self.dst[start:i]))
                start, k0, written = i, k, set()
            written.add(d_key)
        out.append((CopyKind(k0), self.src[start:], self.dst[start:]))
        return out

    def pairs(self, kind: CopyKind) -> np.ndarray:
        """The ``(src, dst)`` pairs of one kind, in plan order, as an int64 (m, 2) array (for inspection and
        statistics: executing the kinds one after the other is not the plan's order). O(len(self))."""
        m = self.kind == kind
        return np.stack((self.src[m], self.dst[m]), axis=1)

    @staticmethod
    def build(parts: list) -> "CopyPlan":
        """A plan from ``(kind, src, dst)`` parts in order (internal: sequences of ints or int arrays)."""
        if not parts:
            return _EMPTY_PLAN
        src = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for _, s, _ in parts])
        dst = np.concatenate([np.asarray(d, dtype=np.int64).reshape(-1) for _, _, d in parts])
        kind = np.concatenate([np.full(len(s), int(k), dtype=np.int8) for k, s, _ in parts])
        for a in (src, dst, kind):
            a.flags.writeable = False
        return CopyPlan(src, dst, kind)


def _empty_plan() -> CopyPlan:
    src, dst, kind = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int8)
    for a in (src, dst, kind):
        a.flags.writeable = False
    return CopyPlan(src, dst, kind)


_EMPTY_PLAN = _empty_plan()


class Stats(NamedTuple):
    """Counters since construction, and the pools' readings at the time (a snapshot; ``BlockManager.stats``
    builds a new one on each read). Block counts are in blocks of ``block_size`` tokens; no counter is reset
    except by building a new manager."""

    prefix_query_tokens: int
    """Prompt tokens passed to allocate() (and allocate_batch()) with prefix caching on; 0 without it."""
    prefix_hit_tokens: int
    """Of those, the tokens allocate() returned as cached (GPU and CPU tier together)."""
    prefix_query_blocks: int
    """Prompt blocks that could have been hits: ``(len(prompt) - 1) // block_size`` per allocate (the last
    token is always computed)."""
    prefix_hit_blocks: int
    """Of those, the blocks that were hits (``prefix_hit_tokens // block_size``)."""
    evictions: int
    """Unreferenced cached GPU blocks evicted (uncached) to hand their block to someone else."""
    cow_copies: int
    """Copy-on-write (src, dst) pairs handed out by decode_step / append_slots."""
    swapped_out_blocks: int
    """Distinct GPU blocks moved to the CPU pool by swap_out (one per (gpu, cpu) pair returned)."""
    swapped_in_blocks: int
    """Distinct CPU blocks brought back by swap_in: copies plus blocks whose content was still cached on the
    GPU and was reused without a copy."""
    cpu_hit_tokens: int = 0
    """Of prefix_hit_tokens, those served from the CPU tier (promoted); 0 without the tier."""
    cpu_hit_blocks: int = 0
    """Of prefix_hit_blocks, those served from the CPU tier."""
    demotions: int = 0
    """Evicted GPU blocks copied to the CPU tier (demotion pairs handed out by take_copies)."""
    promotions: int = 0
    """CPU-tier blocks copied back into a new GPU block for a hit (promotion pairs handed out by take_copies)."""
    cpu_evictions: int = 0
    """CPU-tier blocks uncached to make room for a demotion or for a swap_out."""
    dropped_demotions: int = 0
    """Evicted GPU blocks not demoted because every CPU block was held by swapped sequences or pinned by the
    step's pending copies (blocks cached in the current step are never demoted and are not counted here)."""
    num_cached_blocks: int = 0
    """GPU blocks whose content is in the prefix cache (referenced or not), every group's (a reading, not a
    counter)."""
    num_cpu_cached_blocks: int = 0
    """CPU blocks whose content is in the CPU tier of the prefix cache."""
    num_free_cpu_blocks: int = 0
    """Plain free CPU blocks plus the CPU tier's evictable cached ones (swap evicts them on demand)."""
    gpu_usage: float = 0.0
    """Fraction of GPU blocks held by sequences (``1 - num_free_gpu_blocks / num_gpu_blocks``)."""

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache (0.0 when nothing was queried)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
