"""The scheduler's results: a step's plan (:class:`StepPlan` with its :class:`PrefillWork`, :class:`DecodeBatch`
and :class:`Preemption` parts), a finished request (:class:`RequestOutput`), a sequence's view, the statistics and
the finish reasons. Plain immutable values (NamedTuple, frozen dataclass), except the counters of
:class:`SchedulerStats`; nothing here knows the scheduler's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple

import numpy as np

from ..types import CopyPlan

FINISH_STOP = "stop"  # EOS or a stop token (the token is included in the output)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_IGNORED = "ignored"  # the request can never fit in the pool (can_allocate said NEVER)
FINISH_ABORT = "abort"  # abort_request

EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int64)
EMPTY_PAIRS.setflags(write=False)


def pairs(p: Any) -> np.ndarray:
    """A call's (src, dst) block pairs as an int64 (m, 2) array (the shared empty one for none)."""
    if p is None:
        return EMPTY_PAIRS
    a = np.asarray(p, dtype=np.int64)
    if a.size == 0:
        return EMPTY_PAIRS
    return a.reshape(-1, 2)


def concat_pairs(parts: list) -> np.ndarray:
    """Several (m, 2) pair arrays as one, in order (no copy for none or one)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return EMPTY_PAIRS
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts)


# ----------------------------------------------------------------------------------------------------- plan types


class PrefillWork(NamedTuple):
    """One sequence's prefill in a step: the whole prompt from its prefix-cache hit on, or one chunk of it
    (chunked prefill)."""

    request_id: Hashable
    seq_id: int
    sample_index: int
    token_ids: np.ndarray  # int64 (T,): the tokens to compute, prompt[start:seq_len]
    positions: np.ndarray  # int64 (T,): start .. seq_len - 1
    slot_mapping: np.ndarray  # int64 (T,): slot of each computed token (None if the bm has no slot_mapping);
    #                           (G, T) with a HybridBlockManager: the slots in each KV cache group
    block_table: Any  # int32: the sequence's block table, read-only (None likewise); a tuple of G tables, one
    #                    per KV cache group, with a HybridBlockManager
    num_cached_tokens: int  # == start: tokens whose KV is already in the cache (prefix hit, earlier chunks)
    seq_len: int  # tokens of the sequence after this step (attention context length of the last token)
    num_samples: int  # tokens to sample from the last logits (n for a fresh request, else 1; 0: a chunk that
    #                   does not end the prompt: sample nothing, its entry in update() is ignored)
    table_row: int | None = None  # incremental_tables: the sequence's table row (block_table goes there whole)
    # KV loaded from a storage tier: positions [num_cached_tokens - num_external_tokens, num_cached_tokens) are
    # not computed; the engine writes their blocks from the load's payloads before the step's forward
    num_external_tokens: int = 0


class DecodeBatch(NamedTuple):
    """The decode part of a step: every running sequence, in batch order."""

    seq_ids: np.ndarray  # int64 (B,)
    input_tokens: np.ndarray  # int64 (T,): flat, sequence 0's tokens first (T == B without speculation)
    positions: np.ndarray  # int64 (T,): aligned with input_tokens and result.slot_mapping
    query_lens: np.ndarray  # int32 (B,): tokens input per sequence (1, or accepted + 1 with speculation)
    num_lookahead_slots: int
    result: Any  # the StepResult of decode_step: slot_mapping, block_tables, seq_lens, cow (HybridStepResult:
    #              per KV cache group; StepDelta with incremental tables: see below)
    # incremental_tables: (seq_id, table_row, block_table) of the batch's sequences whose whole row the engine
    # loads before applying result.table_updates (a forked sample's first decode, a sequence swapped in since);
    # block_table is a tuple of one table per group with KV cache groups
    table_loads: tuple = ()


class KVLoad(NamedTuple):
    """A request admitted in this step with GPU blocks reserved for KV that a storage tier holds
    (``Scheduler.kv_ready(..., reserve=True)``): ``load`` is the block manager's
    :class:`~pagedkv.manager._external.ExternalLoad` (``block_ids``, ``keys``, ``start_token``, ``num_tokens``).
    The engine reads that KV off the step loop, writes it into ``load.block_ids`` once this step's copy plan
    has run, and reports it with ``Scheduler.kv_loaded``; the request is left out of every batch meanwhile."""

    request_id: Hashable
    seq_id: int
    load: Any


class Preemption(NamedTuple):
    request_id: Hashable
    seq_ids: tuple
    mode: str  # "recompute" or "swap"


class StepPlan(NamedTuple):
    """What one step computes. Execute every copy of ``copies`` in order (:meth:`CopyPlan.batches`), then the
    forward pass. ``swap_out``, ``swap_in`` and ``copy_on_write`` list the same copies by kind (statistics only)."""

    step: int
    swap_out: np.ndarray  # int64 (m, 2): (gpu_block, cpu_block) of the requests swapped out (in copies too)
    swap_in: np.ndarray  # int64 (m, 2): (cpu_block, gpu_block) of the requests swapped in (in copies too)
    copy_on_write: np.ndarray  # int64 (m, 2): (src, dst) of the decode's copy-on-writes (in copies too)
    prefills: tuple  # tuple[PrefillWork, ...]
    decode: DecodeBatch | None
    preempted: tuple  # tuple[Preemption, ...]
    ignored: tuple  # tuple[RequestOutput, ...]: requests finished as "ignored" in this step
    copies: CopyPlan = CopyPlan.build([])  # every copy of the step (CPU tier included), in execution order
    kv_loads: tuple = ()  # tuple[KVLoad, ...]: requests admitted with reserved blocks for KV a tier holds

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prefills)

    @property
    def num_decode_seqs(self) -> int:
        return 0 if self.decode is None else len(self.decode.seq_ids)

    @property
    def num_samples_expected(self) -> int:
        """Length of the ``sampled`` argument :meth:`Scheduler.update` expects."""
        return len(self.prefills) + self.num_decode_seqs

    @property
    def has_forward(self) -> bool:
        """Whether the model runs (prefills or a decode batch). A plan without a forward pass can still carry
        swap copies (e.g. a swap-out whose request then could not run), which the engine must execute."""
        return bool(self.prefills) or self.decode is not None

    @property
    def is_empty(self) -> bool:
        """Nothing at all to do: no forward pass, no copies, no preemption, nothing ignored."""
        return (not self.prefills and self.decode is None and not len(self.copies) and not len(self.swap_out)
                and not len(self.swap_in) and not len(self.copy_on_write) and not self.preempted and not self.ignored
                and not self.kv_loads)


@dataclass(frozen=True)
class RequestOutput:
    """A finished request."""

    request_id: Hashable
    prompt_token_ids: tuple
    outputs: tuple  # tuple[tuple[int, ...], ...]: generated token ids of each sample, by sample index
    finish_reasons: tuple  # tuple[str, ...]: per sample, FINISH_*
    num_cached_tokens: int  # prefix-cache hit (tokens) of the request's first prefill
    num_preemptions: int = 0
    error: str | None = None

    @property
    def finish_reason(self) -> str:
        """The finish reason of sample 0 (all samples share it for "ignored" and "abort")."""
        return self.finish_reasons[0]


class SequenceView(NamedTuple):
    request_id: Hashable
    sample_index: int
    prompt_len: int
    output: tuple
    num_computed: int  # tokens whose KV is in the block manager


@dataclass
class SchedulerStats:
    steps: int = 0
    prefills: int = 0  # sequence prefills (re-prefills after recompute included)
    prompt_tokens: int = 0  # tokens passed to allocate
    cached_tokens: int = 0  # prefix-cache hits returned by allocate
    external_tokens: int = 0  # prompt tokens past the hit whose KV came from a storage tier (not computed)
    stale_external_loads: int = 0  # loads not used: the hit they continued was evicted before admission
    # KV cache groups: reserved loads cut to the sliding windows that arrived short: their reservation freed, the
    # request queued again and computed (no shorter end of such a load is usable; Admitter.requeue_cut)
    requeued_window_loads: int = 0
    computed_prefill_tokens: int = 0
    prefill_chunks: int = 0  # chunked prefill: chunks scheduled (a prompt prefilled in one step counts one)
    decode_tokens: int = 0
    preemptions: int = 0  # request preemptions (recompute + swap)
    recompute_preemptions: int = 0
    swap_outs: int = 0  # request swap-outs
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    copy_on_writes: int = 0
    forks: int = 0
    ignored: int = 0
    finished: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hit_rate
        return d
