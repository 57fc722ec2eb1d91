"""Public result types of the block manager."""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

__all__ = ["AllocStatus", "CacheCopies", "NULL_BLOCK", "PrefillBatch", "PrefixHit", "StepResult", "Stats"]


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


class CacheCopies(NamedTuple):
    """The CPU tier's copies of one step (see :meth:`BlockManager.take_copies`), to execute in this order."""

    demotions: np.ndarray  #: int64 (m, 2): (gpu, cpu) pairs, GPU -> CPU, first
    promotions: np.ndarray  #: int64 (k, 2): (cpu, gpu) pairs, CPU -> GPU, then


class Stats(NamedTuple):
    """Counters since construction (a snapshot; ``BlockManager.stats`` builds a new one on each read). Block
    counts are in blocks of ``block_size`` tokens; nothing here is reset except by building a new manager."""

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

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache (0.0 when nothing was queried)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
