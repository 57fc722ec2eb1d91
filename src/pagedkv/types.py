"""Public result types of the block manager."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["AllocStatus", "CacheCopies", "CopyKind", "CopyPlan", "NULL_BLOCK", "StepResult", "Stats"]


NULL_BLOCK = -1
"""Pads batch block tables and marks table positions released by the sliding window."""


class AllocStatus(enum.Enum):
    """Answer of :meth:`BlockManager.can_allocate` and :meth:`BlockManager.can_swap_in`."""

    OK = "ok"  #: fits now
    LATER = "later"  #: does not fit now, may after other sequences free blocks
    NEVER = "never"  #: can never fit (more blocks than the pool minus the watermark)


class StepResult(NamedTuple):
    """What the engine needs for one batched append (see :meth:`BlockManager.decode_step`)."""

    slot_mapping: np.ndarray  #: int64 (total new tokens,): physical slot of each new token, batch order
    block_tables: np.ndarray  #: int32 (B, max_blocks): block tables padded with NULL_BLOCK
    seq_lens: np.ndarray  #: int32 (B,): tokens of each sequence after the append
    cow: np.ndarray  #: int64 (m, 2): copy-on-write pairs (src, dst) to copy before writing the new KV


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
    """Counters since construction (a snapshot; ``BlockManager.stats`` builds a new one on each read)."""

    prefix_query_tokens: int  #: prompt tokens looked up in the prefix cache by allocate()
    prefix_hit_tokens: int  #: of which were already cached
    prefix_query_blocks: int
    prefix_hit_blocks: int
    evictions: int  #: cached blocks evicted to make room
    cow_copies: int  #: copy-on-write pairs handed out
    swapped_out_blocks: int
    swapped_in_blocks: int  #: blocks brought back (copies plus cache reuses)
    cpu_hit_tokens: int = 0  #: of prefix_hit_tokens, served from the CPU tier (promoted)
    cpu_hit_blocks: int = 0
    demotions: int = 0  #: evicted GPU blocks copied to the CPU tier
    promotions: int = 0  #: CPU-tier blocks copied back to the GPU for a hit
    cpu_evictions: int = 0  #: CPU-tier blocks evicted (for a demotion or for swap)
    dropped_demotions: int = 0  #: evicted GPU blocks not demoted: every CPU block held or pinned

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache (0.0 when nothing was queried)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

