"""Public result types of the block manager."""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

__all__ = ["AllocStatus", "CacheCopies", "NULL_BLOCK", "StepResult", "Stats"]


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
    """The CPU tier's copies of one step (see :meth:`BlockManager.take_copies`), to execute in this order."""

    demotions: np.ndarray  #: int64 (m, 2): (gpu, cpu) pairs, GPU -> CPU, first
    promotions: np.ndarray  #: int64 (k, 2): (cpu, gpu) pairs, CPU -> GPU, then


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

