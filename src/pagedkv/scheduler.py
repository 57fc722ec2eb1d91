"""Continuous-batching scheduler over a BlockManager-like object (no torch).

The scheduler turns a queue of requests into a sequence of *steps*. Each :meth:`Scheduler.schedule` call makes the
block-manager calls of one step and returns a :class:`StepPlan` that says what the model must compute; the caller
runs the model and hands the sampled tokens back through :meth:`Scheduler.update`, which appends them, stops
finished sequences and returns the finished requests. ``schedule`` and ``update`` alternate strictly.

Policy (the one of vLLM's first-generation scheduler, with prefills and decodes in the same step):

1. **Decode** every running sequence. When the block manager cannot append the slots of the whole batch
   (``can_append_slots`` is False, or ``decode_step`` raises :class:`~pagedkv.errors.OutOfBlocksError`), the most
   recently admitted running request is preempted, with all of its sequences, and the check is repeated. (With
   speculative decoding the check counts the batch's largest number of new tokens for every sequence.) A request
   that cannot go on even alone with the whole pool is finished with reason ``"ignored"``.
   ``"recompute"`` frees its blocks and puts it back at the *front* of the waiting queue, prompt plus generated
   tokens becoming its new prompt; ``"swap"`` moves its blocks to the CPU pool (``swap_out``) and falls back to
   recompute when the CPU pool is full.
2. **Swap in** swapped-out requests, oldest first, while ``can_swap_in`` is OK (only in a step without
   preemption). They decode from the next step on, or in this step if nothing else decodes (then without
   preemption: a block is never swapped in and out in one step).
3. **Admit** waiting requests first come, first served, while ``can_allocate`` is OK, ``max_num_seqs`` and
   ``max_num_batched_tokens`` allow (only in a step without preemption and with nothing left swapped out).
   ``LATER`` stops admission; ``NEVER`` finishes the request at once with finish reason ``"ignored"``. A prompt
   longer than ``max_num_batched_tokens`` is admitted alone in a step. The token budget counts whole prompts
   (the prefix-cache hit is only known once the blocks are allocated). With chunked prefill, below, admission
   and the budget work by chunks instead.

**Chunked prefill** (``enable_chunked_prefill=True``; vLLM V1's order). Each step has a budget of
``max_num_batched_tokens`` tokens, filled in this order:

1. **decodes**: one token (or the accepted tokens) per running sequence, preempting as above; decodes are
   never cut by the budget (keep ``max_num_batched_tokens >= max_num_seqs``). Swapped-out requests come back
   as above (no budget) and then take part like any running request;
2. **partly prefilled prompts**, oldest admission first: each gets its next chunk, at most the budget left and
   at most ``long_prefill_token_threshold`` tokens (0: no cap), appended with one multi-token ``decode_step``
   for all of them. When the chunks do not fit in the free blocks, the most recently admitted of these
   requests is preempted (recompute or swap, like a decode's victim) and the rest tried again;
3. **new admissions** first come, first served while the budget lasts: ``allocate(...,
   num_new_tokens=chunk)`` after one prefix lookup on the whole prompt (the hit is free; the chunk is charged),
   ``can_allocate`` counting the chunk's blocks only.

A partly prefilled sequence samples nothing: its :class:`PrefillWork` has ``num_samples == 0`` until the chunk
that ends the prompt (whose last logits give the first token, as an unchunked prefill's do). Every full block a
chunk fills is in the prefix cache when the call returns, so an identical prompt admitted later (even in the same
step) starts from there. Without chunking the budget counts whole prompts, and decodes are not charged.

Sequence ids are ints handed out by the scheduler: a request with ``n`` samples owns the consecutive ids
``base .. base + n - 1`` (sample ``i`` is ``base + i``, sample 0 is the parent). A fresh request is prefilled once,
as sample 0; the caller samples ``n`` tokens from the prompt's last logits and the scheduler then forks samples
1..n-1 from sample 0 so that they share the prompt's blocks (the partial last block is copied on write at their
first decode). A request preempted by recompute after its fork re-prefills each live sample on its own.

Correctness rule the plans follow: the KV of a token is computed in the step in which it is input. A prefill
inputs the prompt from the prefix-cache hit on (positions ``[start, len(prompt))``); the first decode of a
prefilled sequence inputs the token sampled from the prefill (position ``len(prompt)``); a decode inputs the
tokens sampled in the previous step (one, or the accepted tokens of speculative decoding), at positions
``num_tokens - q .. num_tokens - 1`` after the append. Positions and slots are exactly those of the block manager.

The engine executes a plan this way: every copy of ``plan.copies`` (a :class:`~pagedkv.CopyPlan`: swap-outs,
swap-ins, copy-on-writes and the CPU tier's demotions and promotions, in the order the block-manager calls handed
them out), in order, then the forward pass over ``prefills`` and ``decode``. The plan comes from the block
manager's ``take_copy_plan()``, called once per step at the end of :meth:`Scheduler.schedule` (for a block manager
without it, the scheduler builds the same call-ordered plan from the calls' return values). ``swap_out``,
``swap_in`` and ``copy_on_write`` are the same copies by kind, for statistics: executed kind after kind they can
corrupt KV (a swap-out frees GPU blocks that a later call of the step hands out again; see docs/engine-contract.md).
Within the forward pass, each layer writes the K/V of every new token of the step before any attention of the
step reads the cache, and a plan is always executed in full, even if one of its requests is aborted meanwhile:
with prefix caching a prompt admitted in the same step as an identical one reads the blocks the other writes
(the block manager's burst sharing), so the KV of a prefill is computed once per step, not once per request.

Bookkeeping is O(batch) per step: running requests live in an insertion-ordered dict (the most recently admitted
is the last key), waiting requests in a deque, swapped requests in a heap keyed by arrival.

The block manager may be :class:`pagedkv.BlockManager` or any object with the same methods (benchmark adapters of
other block managers); if it has a ``prepare_step(seq_ids, token_ids)`` method, it is called right before every
``decode_step``.

**Incremental block tables** (``incremental_tables=True``, what :class:`pagedkv.engine.LLM` uses): the decode asks
``decode_step(..., block_tables=False)``, so ``DecodeBatch.result`` is a :class:`~pagedkv.StepDelta` whose cost
does not grow with context length, and the engine keeps the tables itself, one row per sequence
(``table_rows``)::

    the engine's table                 per step, before the forward
    row 0  [ 17  3 42 .. ]   <-- a prefill: PrefillWork.block_table at PrefillWork.table_row (the whole row)
    row 1  [  5  9 -1 .. ]   <-- DecodeBatch.table_loads: (seq_id, row, table) of sequences whose row is new to
    row 2  [ 11 12 .. .. ]       the engine (a forked sample's first decode, a sequence swapped in), whole rows
                             <-- DecodeBatch.result.table_updates: the step's changed entries, applied after those

and the decode's tables are then rows ``result.table_rows`` of it (docs/engine-contract.md). With a
:class:`~pagedkv.HybridBlockManager` the result is a :class:`~pagedkv.HybridStepDelta`, the engine keeps one such
matrix per KV cache group (same rows), and the whole tables it loads are tuples of one table per group.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import chain
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence as Seq

import numpy as np

from .errors import OutOfBlocksError
from .types import CopyKind, CopyPlan

__all__ = [
    "Scheduler",
    "SchedulerStats",
    "StepPlan",
    "PrefillWork",
    "DecodeBatch",
    "Preemption",
    "RequestOutput",
    "SequenceView",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_IGNORED",
    "FINISH_ABORT",
]

FINISH_STOP = "stop"  # EOS or a stop token (the token is included in the output)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_IGNORED = "ignored"  # the request can never fit in the pool (can_allocate said NEVER)
FINISH_ABORT = "abort"  # abort_request

_EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int64)
_EMPTY_PAIRS.setflags(write=False)

# sequence states
_WAITING, _RUNNING, _SWAPPED, _FINISHED = 0, 1, 2, 3


def _status_name(status: Any) -> str:
    """'OK' / 'LATER' / 'NEVER' for pagedkv's AllocStatus and for look-alike enums of benchmark adapters."""
    name = getattr(status, "name", None)
    return name if isinstance(name, str) else str(status)


def _pairs(pairs: Any) -> np.ndarray:
    if pairs is None:
        return _EMPTY_PAIRS
    a = np.asarray(pairs, dtype=np.int64)
    if a.size == 0:
        return _EMPTY_PAIRS
    return a.reshape(-1, 2)


def _concat_pairs(parts: list) -> np.ndarray:
    parts = [p for p in parts if len(p)]
    if not parts:
        return _EMPTY_PAIRS
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


class Preemption(NamedTuple):
    request_id: Hashable
    seq_ids: tuple
    mode: str  # "recompute" or "swap"


_NO_PAIRS = np.zeros((0, 2), dtype=np.int64)
_NO_PAIRS.flags.writeable = False


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
                and not len(self.swap_in) and not len(self.copy_on_write) and not self.preempted and not self.ignored)


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


# ------------------------------------------------------------------------------------------------ internal state


class _Seq:
    __slots__ = ("seq_id", "group", "index", "output", "num_computed", "num_pending", "status", "finish",
                 "prefill")

    def __init__(self, seq_id: int, group: "_Group", index: int) -> None:
        self.seq_id = seq_id
        self.group = group
        self.index = index
        self.output: list[int] = []
        self.num_computed = 0  # tokens appended to the block manager (== bm.num_tokens while allocated)
        self.num_pending = 0  # trailing output tokens not input yet
        self.status = _WAITING
        self.finish: str | None = None
        self.prefill: np.ndarray | None = None  # chunked prefill: the tokens being prefilled, until the last chunk


class _Group:
    __slots__ = (
        "request_id", "arrival", "prompt", "n", "max_tokens", "eos", "ignore_eos", "stop_ids",
        "namespace", "seqs", "live", "forked", "num_cached_tokens", "num_preemptions", "status",
    )

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.live: list[_Seq] = []
        self.forked = False
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = _WAITING

    def __lt__(self, other: "_Group") -> bool:  # heap order of the swapped queue
        return self.arrival < other.arrival


# ------------------------------------------------------------------------------------------------------ scheduler


class Scheduler:
    """Continuous batching over ``block_manager`` (see the module docstring for the policy).

    Args:
        block_manager: a :class:`pagedkv.BlockManager`, a :class:`pagedkv.HybridBlockManager` (its prefills then
            carry a slot mapping and a block table per KV cache group, its decodes its per-group step result) or an
            object with the same methods.
        max_num_seqs: most sequences running at once (a request with ``n`` samples counts ``n``).
        max_num_batched_tokens: prefill tokens admitted per step (a longer prompt is admitted alone); with
            chunked prefill, the step's token budget (decodes plus prompt chunks).
        preemption_mode: ``"recompute"`` or ``"swap"`` (swap falls back to recompute when the CPU pool is full).
        num_lookahead_slots: slots reserved past the last token at every decode (speculative decoding); a
            decode then takes between 1 and ``num_lookahead_slots + 1`` sampled tokens per sequence.
        enable_chunked_prefill: schedule by a token budget with prompts prefilled in chunks (see the module
            docstring); needs a block manager whose ``allocate``, ``can_allocate`` and ``decode_step`` take
            ``num_new_tokens`` (:class:`pagedkv.BlockManager`).
        long_prefill_token_threshold: with chunked prefill, the most tokens one prompt gets in one step, so that
            several long prompts progress together (0: no cap besides the budget).
        precheck_append: ask ``can_append_slots`` before every ``decode_step`` (vLLM's call pattern, needed by
            block managers whose batched append is not all-or-nothing). With False the scheduler calls
            ``decode_step`` directly and preempts when it raises OutOfBlocksError, which saves a pass over the
            batch but is only correct for all-or-nothing managers such as :class:`pagedkv.BlockManager`.
            None (default): False when the manager declares ``atomic_append = True``, else True.
        incremental_tables: decode with ``decode_step(..., block_tables=False)``: ``DecodeBatch.result`` is a
            :class:`~pagedkv.StepDelta` (the step's table changes, at a cost independent of context length) and
            the plan says which whole rows the engine loads (``PrefillWork.table_row``,
            ``DecodeBatch.table_loads``); see the module docstring. Needs a manager with ``table_rows``.
    """

    def __init__(
        self,
        block_manager: Any,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        preemption_mode: str = "recompute",
        num_lookahead_slots: int = 0,
        precheck_append: bool | None = None,
        incremental_tables: bool = False,
        enable_chunked_prefill: bool = False,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {num_lookahead_slots}")
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.long_prefill_token_threshold = int(long_prefill_token_threshold)
        self.bm = block_manager
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.preemption_mode = preemption_mode
        self.num_lookahead_slots = int(num_lookahead_slots)
        if precheck_append is None:
            precheck_append = not getattr(block_manager, "atomic_append", False)
        self.precheck_append = bool(precheck_append)
        self._prepare = getattr(block_manager, "prepare_step", None)
        if incremental_tables and getattr(block_manager, "table_rows", None) is None:
            raise ValueError("incremental_tables needs a block manager with table_rows (decode_step(..., "
                             "block_tables=False)), such as pagedkv.BlockManager")
        self.incremental_tables = bool(incremental_tables)
        # incremental tables: sequences whose whole row the engine has not seen yet (forked, swapped in)
        self._row_loads: dict[int, None] = {}
        # benchmark adapters of other block managers have no slot_mapping: their prefills carry no metadata
        self._has_slots = getattr(block_manager, "slot_mapping", None) is not None
        # a HybridBlockManager (KV cache groups): prefill slots (G, T) and one block table per group
        self._num_groups = getattr(block_manager, "num_groups", None)
        self._waiting: deque[_Group] = deque()
        self._running: dict[int, _Group] = {}  # arrival -> group, insertion order = admission order
        self._swapped: list[_Group] = []  # heap by arrival
        self._requests: dict[Hashable, _Group] = {}
        self._seqs: dict[int, _Seq] = {}
        self._num_running_seqs = 0  # sequences of running requests (a fresh request counts n)
        self._next_seq_id = 0
        self._next_arrival = 0
        self._outstanding: StepPlan | None = None
        # a block manager without take_copy_plan (another's adapter): the scheduler orders the calls' copies
        self._own_plan = getattr(block_manager, "take_copy_plan", None) is None
        self._step_copies: list = []
        self.stats = SchedulerStats()

    # -------------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Seq[int] | np.ndarray,
        *,
        n: int = 1,
        max_tokens: int = 16,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Seq[int] = (),
        namespace: Any = None,
    ) -> None:
        """Queue a request. ``max_tokens`` counts generated tokens per sample; generation stops after EOS
        (unless ``ignore_eos``) or a token of ``stop_token_ids``; ``namespace`` isolates its prefix-cache
        entries."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        prompt = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if n < 1:
            raise ValueError(f"request {request_id!r}: n must be >= 1, got {n}")
        if n > self.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={n} exceeds max_num_seqs={self.max_num_seqs}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        prompt.setflags(write=False)
        g = _Group()
        g.request_id = request_id
        g.arrival = self._next_arrival
        self._next_arrival += 1
        g.prompt = prompt
        g.n = int(n)
        g.max_tokens = int(max_tokens)
        g.eos = None if eos_token_id is None else int(eos_token_id)
        g.ignore_eos = bool(ignore_eos)
        g.stop_ids = frozenset(int(t) for t in stop_token_ids)
        g.namespace = namespace
        base = self._next_seq_id
        self._next_seq_id += n
        for i in range(n):
            s = _Seq(base + i, g, i)
            g.seqs.append(s)
            self._seqs[base + i] = s
        g.live = [g.seqs[0]]
        self._requests[request_id] = g
        self._waiting.append(g)

    def abort_request(self, request_id: Hashable) -> RequestOutput | None:
        """Drop a request wherever it is; returns its output (finish reason "abort"), None if unknown."""
        g = self._requests.get(request_id)
        if g is None:
            return None
        if g.status == _RUNNING:
            # a scheduled plan is executed in full (other requests of the step may read this one's blocks:
            # burst sharing), so its KV is written even when the request is aborted in between
            for s in g.live:
                self._free(s.seq_id, True)
            del self._running[g.arrival]
            self._num_running_seqs -= len(g.live) if g.forked else g.n
        elif g.status == _SWAPPED:
            for s in g.live:
                self._free(s.seq_id, True)
            self._swapped.remove(g)
            heapq.heapify(self._swapped)
        elif g.status == _WAITING:
            self._waiting.remove(g)
        for s in g.live:
            s.status = _FINISHED
            s.finish = FINISH_ABORT
        g.live = []
        return self._finish_group(g, FINISH_ABORT)

    def finish_sequence(self, seq_id: int, reason: str = FINISH_STOP) -> RequestOutput | None:
        """Finish one sample now (e.g. the engine found a stop string in its text) and free its blocks. Returns
        the request's output if that was its last unfinished sample, else None (also for an unknown or finished
        sequence). Call it between ``update`` and the next ``schedule``."""
        if self._outstanding is not None:
            raise RuntimeError("finish_sequence() between schedule() and update(): call update() first")
        s = self._seqs.get(seq_id)
        if s is None or s.status == _FINISHED:
            return None
        g = s.group
        if s.status == _RUNNING:
            out: list[RequestOutput] = []
            self._finish_seq(s, reason, out)
            return out[0] if out else None
        if s.status == _WAITING and not g.forked:
            return None  # nothing generated yet: there is nothing to stop
        if s.status == _SWAPPED:
            self._free(s.seq_id, True)
        s.status = _FINISHED
        s.finish = reason
        g.live.remove(s)
        if g.live:
            return None
        if g.status == _SWAPPED:
            self._swapped.remove(g)
            heapq.heapify(self._swapped)
        else:
            self._waiting.remove(g)
        return self._finish_group(g, reason)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Running requests."""
        return len(self._running)

    @property
    def num_running_seqs(self) -> int:
        return self._num_running_seqs

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def sequence(self, seq_id: int) -> SequenceView:
        """Read-only view of a sequence (request, sample index, generated tokens)."""
        s = self._seqs[seq_id]
        g = s.group
        return SequenceView(g.request_id, s.index, len(g.prompt), tuple(s.output), s.num_computed)

    # -------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        """Make the block-manager calls of the next step and return its plan."""
        if self._outstanding is not None:
            raise RuntimeError("schedule() called twice without update(): pass the sampled tokens first")
        self.stats.steps += 1
        self._step_copies: list = []  # (kind, pairs) in call order, for a block manager without take_copy_plan
        swap_out: list[np.ndarray] = []
        swap_in: list[np.ndarray] = []
        preempted: list[Preemption] = []
        ignored: list[RequestOutput] = []

        decode = self._schedule_decode(swap_out, preempted, ignored) if self._running else None

        swapped_in_any = False
        swapped_in: set = set()
        if not preempted and self._swapped:
            swapped_in_any = self._schedule_swap_in(swap_in, swapped_in)
            if swapped_in_any and decode is None:
                # nothing else decodes this step: decode the swapped-in requests now (without preempting, so a
                # block is never swapped in and out in the same step)
                decode = self._schedule_decode(swap_out, preempted, ignored, allow_preempt=False)

        prefills: list[PrefillWork] = []
        chunk_cow = _EMPTY_PAIRS
        budget = self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            if decode is not None:
                budget -= int(decode.query_lens.sum())
            if self._running:  # the next chunk of each partly prefilled prompt
                budget, chunk_cow = self._schedule_chunks(prefills, budget, swap_out, preempted, swapped_in)
        if not preempted and not self._swapped and self._waiting:
            self._schedule_prefills(prefills, ignored, budget)

        # progress guard: nothing runs and nothing could be started although work is queued
        if not self._running and not prefills and not swapped_in_any and not preempted:
            if self._swapped:  # cannot swap in even into an empty pool: recompute it instead
                g = heapq.heappop(self._swapped)
                for s in g.live:
                    self._free(s.seq_id, True)
                self._to_waiting_front(g)
            elif self._waiting:  # LATER with an empty pool means never
                g = self._waiting.popleft()
                if g.forked and len(g.live) > 1:
                    why = (f"its {len(g.live)} samples, preempted by recompute, no longer share their prompt "
                           f"blocks and do not fit in the pool together")
                else:
                    why = "the prompt does not fit in the pool even when it is empty"
                ignored.append(self._ignore(g, why))

        cow = decode.result.cow if decode is not None else None  # (the plan's GPU -> GPU copies)
        cow = _concat_pairs([_pairs(cow), chunk_cow])
        if len(cow):
            self.stats.copy_on_writes += len(cow)
        plan = StepPlan(
            step=self.stats.steps,
            swap_out=_concat_pairs(swap_out),
            swap_in=_concat_pairs(swap_in),
            copy_on_write=cow,
            prefills=tuple(prefills),
            decode=decode,
            preempted=tuple(preempted),
            ignored=tuple(ignored),
            copies=self._take_copy_plan(),
        )
        self._outstanding = plan
        return plan

    def _take_copy_plan(self) -> CopyPlan:
        """The step's copies in call order: the block manager's own plan, or one built from the calls' results."""
        if not self._own_plan:
            return self.bm.take_copy_plan()
        return CopyPlan.build([(k, p[:, 0], p[:, 1]) for k, p in self._step_copies if len(p)])

    def _schedule_decode(self, swap_out: list, preempted: list, ignored: list,
                         allow_preempt: bool = True) -> DecodeBatch | None:
        ids: list[int] = []
        starts: list[int] = []
        qs: list[int] = []
        toks: list = []
        uniform = True
        for g in self._running.values():
            for s in g.live:
                if s.prefill is not None:  # partly prefilled: its next chunk comes after the decodes
                    continue
                ids.append(s.seq_id)
                starts.append(s.num_computed)
                q = s.num_pending
                qs.append(q)
                if q == 1:
                    toks.append(s.output[-1])
                else:
                    uniform = False
                    toks.append(s.output[-q:])
        bm = self.bm
        k = self.num_lookahead_slots
        result = None
        while ids:
            # with speculation a sequence appends up to k + 1 tokens: check the batch's largest count for all
            # (adapters of other block managers are not all-or-nothing across a batch)
            if not self.precheck_append:
                ok = True
            elif uniform:
                ok = bm.can_append_slots(ids, k)
            else:
                ok = bm.can_append_slots(ids, k, num_new_tokens=max(qs))
            if ok:
                counts_arg = None
                if uniform:
                    token_arg: Any = np.array(toks, dtype=np.int64)
                else:
                    ragged = [[t] if isinstance(t, int) else t for t in toks]
                    q0 = qs[0]
                    if q0 > 0 and all(q == q0 for q in qs):
                        token_arg = np.array(ragged, dtype=np.int64).reshape(len(ids), q0)
                    else:  # flat tokens + counts: the block manager need not convert Python lists
                        token_arg = np.fromiter(chain.from_iterable(ragged), dtype=np.int64, count=sum(qs))
                        counts_arg = np.array(qs, dtype=np.int64)
                if self._prepare is not None:
                    self._prepare(ids, token_arg if counts_arg is None else ragged)
                kw = {} if counts_arg is None else {"num_new_tokens": counts_arg}
                if self.incremental_tables:
                    kw["block_tables"] = False
                try:
                    result = bm.decode_step(ids, token_arg, k, **kw)
                    if self._own_plan:
                        self._step_copies.append((CopyKind.GPU_TO_GPU, _pairs(result.cow)))
                    break
                except OutOfBlocksError:
                    pass
            if not allow_preempt:
                return None
            # preempt the most recently admitted running request (all of its sequences are at the batch's end)
            g = self._running[next(reversed(self._running))]
            m = sum(1 for s in g.live if s.prefill is None)  # its decoding sequences: the batch's last
            if m:
                del ids[-m:], starts[-m:], qs[-m:], toks[-m:]
            m = len(g.live)
            if not uniform:
                uniform = all(q == 1 for q in qs)
            if len(self._running) == 1:
                # alone with the whole pool (the free blocks and every evictable cached block) and still unable
                # to grow: it can never finish; preempting it would only bring it back to the same point
                del self._running[g.arrival]
                self._num_running_seqs -= m
                for s in g.live:
                    self._free(s.seq_id, True)
                ignored.append(self._ignore(
                    g, f"its {m} sequence(s) need more blocks than the whole pool has to go on decoding"))
            else:
                self._preempt(g, swap_out, preempted)
        if result is None:
            return None
        B = len(ids)
        seq_ids = np.array(ids, dtype=np.int64)
        if uniform:
            input_tokens = token_arg if isinstance(token_arg, np.ndarray) else np.array(toks, dtype=np.int64)
            input_tokens = input_tokens.reshape(-1)
            positions = np.array(starts, dtype=np.int64)
            query_lens = np.ones(B, dtype=np.int32)
        else:
            query_lens = np.array(qs, dtype=np.int32)
            input_tokens = token_arg.reshape(-1)  # (B, q) or already flat
            T = input_tokens.size
            offsets = np.cumsum(query_lens, dtype=np.int64) - query_lens
            positions = (np.arange(T, dtype=np.int64) - np.repeat(offsets, query_lens)
                         + np.repeat(np.array(starts, dtype=np.int64), query_lens))
        # the tokens are in the block manager now
        seqs = self._seqs
        total = 0
        for sid, q in zip(ids, qs):
            s = seqs[sid]
            s.num_computed += q
            s.num_pending = 0
            total += q
        self.stats.decode_tokens += total
        loads = ()
        if self._row_loads:
            pending = self._row_loads
            todo = [sid for sid in ids if sid in pending]
            if todo:
                rows = bm.table_rows(todo).tolist()
                loads = tuple((sid, row, self._table(sid)) for sid, row in zip(todo, rows))
                for sid in todo:
                    del pending[sid]
        return DecodeBatch(seq_ids, input_tokens, positions, query_lens, k, result, loads)

    def _preempt(self, g: _Group, swap_out: list, preempted: list) -> None:
        del self._running[g.arrival]
        ids = [s.seq_id for s in g.live]
        self._num_running_seqs -= len(ids)
        g.num_preemptions += 1
        self.stats.preemptions += 1
        bm = self.bm
        if self.preemption_mode == "swap" and bm.can_swap_out(ids):
            pairs = _pairs(bm.swap_out(ids))
            swap_out.append(pairs)
            self._step_copies.append((CopyKind.GPU_TO_CPU, pairs))
            self.stats.swap_outs += 1
            self.stats.swapped_out_blocks += len(pairs)
            g.status = _SWAPPED
            for s in g.live:
                s.status = _SWAPPED
            heapq.heappush(self._swapped, g)
            preempted.append(Preemption(g.request_id, tuple(ids), "swap"))
            return
        for sid in ids:
            bm.free(sid)
        self.stats.recompute_preemptions += 1
        self._to_waiting_front(g)
        preempted.append(Preemption(g.request_id, tuple(ids), "recompute"))

    def _to_waiting_front(self, g: _Group) -> None:
        g.status = _WAITING
        for s in g.live:
            self._row_loads.pop(s.seq_id, None)  # (its prefill hands over the whole row)
            s.status = _WAITING
            s.num_computed = 0
            s.num_pending = 0
            s.prefill = None
        self._waiting.appendleft(g)

    def _schedule_swap_in(self, swap_in: list, swapped_in: set | None = None) -> bool:
        bm = self.bm
        k = self.num_lookahead_slots
        any_in = False
        while self._swapped:
            g = self._swapped[0]
            m = len(g.live)
            if self._num_running_seqs + m > self.max_num_seqs:
                break
            ids = [s.seq_id for s in g.live]
            st = _status_name(bm.can_swap_in(ids, k))
            if st == "OK":
                heapq.heappop(self._swapped)
                pairs = _pairs(bm.swap_in(ids))
                swap_in.append(pairs)
                self._step_copies.append((CopyKind.CPU_TO_GPU, pairs))
                self.stats.swap_ins += 1
                self.stats.swapped_in_blocks += len(pairs)
                g.status = _RUNNING
                for s in g.live:
                    s.status = _RUNNING
                    if self.incremental_tables:
                        self._row_loads[s.seq_id] = None
                self._running[g.arrival] = g
                self._num_running_seqs += m
                any_in = True
                if swapped_in is not None:
                    swapped_in.add(g.arrival)
            elif st == "NEVER":  # it can never come back: recompute it (and maybe finish it as ignored later)
                heapq.heappop(self._swapped)
                for sid in ids:
                    self._free(sid, True)
                self._to_waiting_front(g)
            else:
                break
        return any_in

    def _schedule_chunks(self, prefills: list, budget: int, swap_out: list, preempted: list,
                         swapped_in: set) -> tuple[int, np.ndarray]:
        """Chunked prefill: the next chunk of every partly prefilled sequence (oldest admission first) while the
        budget lasts, appended by one multi-token ``decode_step``. When they do not fit, the most recently
        admitted of them is preempted (or only left out of this step if it was swapped in in this step or also
        decodes in it) and the rest is tried again. Returns the budget left and the call's copy-on-write pairs."""
        cap = self.long_prefill_token_threshold or budget
        items: list[tuple[_Group, _Seq, int]] = []
        for g in self._running.values():
            for s in g.live:
                if s.prefill is None:
                    continue
                if budget <= 0:
                    break
                c = min(len(s.prefill) - s.num_computed, budget, cap)
                items.append((g, s, c))
                budget -= c
        bm = self.bm
        result = None
        while items:
            ids = [s.seq_id for _, s, _ in items]
            counts = np.array([c for _, _, c in items], dtype=np.int64)
            flat = np.concatenate([s.prefill[s.num_computed : s.num_computed + c] for _, s, c in items])
            ok = True
            if self.precheck_append:
                ok = bm.can_append_slots(ids, 0, num_new_tokens=int(counts.max()))
            if ok:
                try:
                    result = bm.decode_step(ids, flat, 0, num_new_tokens=counts)
                    break
                except OutOfBlocksError:
                    pass
            victim = items[-1][0]  # the most recently admitted of them (items follow admission order)
            budget += sum(c for g, _, c in items if g is victim)
            items = [it for it in items if it[0] is not victim]
            if victim.arrival not in swapped_in and all(s.prefill is not None for s in victim.live):
                self._preempt(victim, swap_out, preempted)
        if result is None:
            return budget, _EMPTY_PAIRS
        cow = _pairs(result.cow)
        if self._own_plan:
            self._step_copies.append((CopyKind.GPU_TO_GPU, cow))
        slots = np.asarray(result.slot_mapping, dtype=np.int64)
        off = 0
        st = self.stats
        for g, s, c in items:
            start = s.num_computed
            end = start + c
            last = end == len(s.prefill)
            prefills.append(PrefillWork(
                request_id=g.request_id, seq_id=s.seq_id, sample_index=s.index,
                token_ids=s.prefill[start:end], positions=np.arange(start, end, dtype=np.int64),
                slot_mapping=slots[..., off : off + c], block_table=self._table(s.seq_id) if self._has_slots else None,
                num_cached_tokens=start, seq_len=end, num_samples=(1 if g.forked else g.n) if last else 0,
                table_row=int(bm.table_rows([s.seq_id])[0]) if self.incremental_tables else None,
            ))
            off += c
            s.num_computed = end
            if last:
                s.prefill = None
            st.computed_prefill_tokens += c
            st.prefill_chunks += 1
        return budget, cow

    def _schedule_prefills(self, prefills: list, ignored: list, budget: int | None = None) -> None:
        bm = self.bm
        k = self.num_lookahead_slots
        chunked = self.enable_chunked_prefill
        if budget is None or not chunked:
            budget = self.max_num_batched_tokens
        cap = self.long_prefill_token_threshold or self.max_num_batched_tokens
        used = 0
        waiting = self._waiting
        while waiting:
            g = waiting[0]
            fresh = not g.forked
            new_seqs = g.n if fresh else len(g.live)
            if self._num_running_seqs + new_seqs > self.max_num_seqs:
                break
            if chunked and budget - used < len(g.live):  # (at least one token for each of its sequences)
                break
            if fresh:
                token_lists = [g.prompt]
            else:
                token_lists = [self._full_tokens(s) for s in g.live]
            ntok = sum(len(t) for t in token_lists)
            if not chunked and used + ntok > budget and prefills:
                break
            # all sequences of the request or none
            done: list[tuple[_Seq, np.ndarray, int]] = []
            verdict = "OK"
            reason = ""
            m = len(token_lists)
            ends: list[int] = []
            for i, (s, toks) in enumerate(zip(g.live, token_lists)):
                kw: dict = {} if g.namespace is None else {"namespace": g.namespace}
                if chunked:  # the hit plus one chunk, leaving a token of budget for each later sequence
                    kw["num_new_tokens"] = min(cap, budget - used - (m - 1 - i))
                st = _status_name(bm.can_allocate(toks, k, **kw))
                if st != "OK":
                    verdict = st
                    reason = f"{len(toks)} tokens can never fit in the pool"
                    break
                try:
                    hit = bm.allocate(s.seq_id, toks, **kw)
                except OutOfBlocksError as e:
                    verdict = "NEVER" if type(e).__name__ == "PromptTooLongError" else "LATER"
                    reason = str(e)
                    break
                end = len(toks)
                if chunked:
                    end = min(end, int(hit) + kw["num_new_tokens"])
                    used += end - int(hit)
                ends.append(end)
                done.append((s, toks, int(hit)))
            if verdict != "OK":
                for s, _, _ in reversed(done):  # later samples may share earlier ones' unwritten blocks
                    self._free(s.seq_id, False)
                if verdict == "NEVER":
                    waiting.popleft()
                    ignored.append(self._ignore(g, reason))
                    continue
                break
            waiting.popleft()
            if not chunked:
                used += ntok
            for (s, toks, hit), end in zip(done, ends):
                prefills.append(self._prefill_work(g, s, toks, hit, g.n if fresh else 1, end))
            if g.num_cached_tokens is None:
                g.num_cached_tokens = done[0][2]
            g.status = _RUNNING
            for s in g.live:
                s.status = _RUNNING
            self._running[g.arrival] = g
            self._num_running_seqs += new_seqs

    def _full_tokens(self, s: _Seq) -> np.ndarray:
        if not s.output:
            return s.group.prompt
        return np.concatenate((s.group.prompt, np.array(s.output, dtype=np.int64)))

    def _table(self, seq_id: int):
        """The sequence's block table (a tuple of one per group for a HybridBlockManager)."""
        if self._num_groups is None:
            return self.bm.block_table(seq_id)
        return tuple(self.bm.block_table(seq_id, g) for g in range(self._num_groups))

    def _prefill_work(self, g: _Group, s: _Seq, toks: np.ndarray, hit: int, num_samples: int,
                      end: int | None = None) -> PrefillWork:
        """The prefill of a just allocated sequence: prompt positions ``[hit, end)`` (``end`` < len: the first
        chunk of a chunked prefill, which samples nothing; the rest is :meth:`_schedule_chunks`' job)."""
        L = len(toks)
        end = L if end is None else end
        # the last prompt token is always computed: its logits give the next token
        start = min(hit, L - 1)
        if self._has_slots:
            bm = self.bm
            if self._num_groups is None:
                slots = np.asarray(bm.slot_mapping(s.seq_id, start, end), dtype=np.int64)
            else:
                slots = np.stack([np.asarray(bm.slot_mapping(s.seq_id, start, end, g), dtype=np.int64)
                                  for g in range(self._num_groups)])
            table = self._table(s.seq_id)
        else:
            slots = table = None
        row = int(self.bm.table_rows([s.seq_id])[0]) if self.incremental_tables else None
        s.num_computed = end
        s.num_pending = 0
        s.prefill = toks if end < L else None
        st = self.stats
        st.prefills += 1
        st.prompt_tokens += L
        st.cached_tokens += hit
        st.computed_prefill_tokens += end - start
        if self.enable_chunked_prefill:
            st.prefill_chunks += 1
        return PrefillWork(
            request_id=g.request_id,
            seq_id=s.seq_id,
            sample_index=s.index,
            token_ids=toks[start:end],
            positions=np.arange(start, end, dtype=np.int64),
            slot_mapping=slots,
            block_table=table,
            num_cached_tokens=start,
            seq_len=end,
            num_samples=num_samples if end == L else 0,
            table_row=row,
        )

    def _ignore(self, g: _Group, reason: str) -> RequestOutput:
        self.stats.ignored += 1
        for s in g.live:
            s.status = _FINISHED
            s.finish = FINISH_IGNORED
        if not g.forked:
            for s in g.seqs:
                s.finish = FINISH_IGNORED
        g.live = []
        return self._finish_group(g, FINISH_IGNORED, error=f"request {g.request_id!r} ignored: {reason}")

    def _free(self, seq_id: int, cache: bool) -> None:
        if cache:
            self.bm.free(seq_id)
            return
        try:
            self.bm.free(seq_id, cache=False)
        except TypeError:  # an adapter without the keyword
            self.bm.free(seq_id)

    # ---------------------------------------------------------------------------------------------- update

    def update(self, plan: StepPlan, sampled: Any) -> list[RequestOutput]:
        """Hand back the tokens sampled for ``plan`` and return the requests that finished.

        ``sampled`` has one entry per prefill (in ``plan.prefills`` order) followed by one entry per decoded
        sequence (in ``plan.decode.seq_ids`` order). A prefill entry is a token, or ``num_samples`` tokens
        (ignored, e.g. None, for a chunk with ``num_samples == 0``); a
        decode entry is a token, or the 1 .. ``num_lookahead_slots + 1`` tokens accepted by speculative decoding.
        A 1-D integer array works when every entry is one token.
        """
        if plan is not self._outstanding:
            raise RuntimeError("update() must be given the plan returned by the last schedule()")
        self._outstanding = None
        if isinstance(sampled, np.ndarray):
            sampled = sampled.tolist()
        expected = len(plan.prefills) + (0 if plan.decode is None else len(plan.decode.seq_ids))
        if len(sampled) != expected:
            raise ValueError(f"expected {expected} sampled entries (prefills then decodes), got {len(sampled)}")
        finished: list[RequestOutput] = list(plan.ignored)
        seqs = self._seqs
        bm = self.bm
        i = 0
        for pw in plan.prefills:
            entry = sampled[i]
            i += 1
            s = seqs.get(pw.seq_id)
            if s is None or s.status != _RUNNING:  # aborted meanwhile
                continue
            if pw.num_samples == 0:  # a chunk that does not end the prompt: nothing was sampled
                continue
            g = s.group
            toks = [int(entry)] if isinstance(entry, (int, np.integer)) else [int(t) for t in entry]
            if len(toks) != pw.num_samples:
                raise ValueError(f"prefill of seq {pw.seq_id} needs {pw.num_samples} sampled tokens, got {len(toks)}")
            if pw.num_samples > 1:
                # fork samples 1..n-1 from the parent: they share the prompt's blocks
                for child in g.seqs[1:]:
                    bm.fork(s.seq_id, child.seq_id)
                    child.num_computed = s.num_computed
                    child.status = _RUNNING
                    if self.incremental_tables:
                        self._row_loads[child.seq_id] = None
                self.stats.forks += len(g.seqs) - 1
                g.live = list(g.seqs)
                g.forked = True
                for child, t in zip(g.seqs, toks):
                    self._append(child, (t,), finished)
            else:
                if not g.forked:
                    g.forked = True  # n == 1: nothing to fork
                self._append(s, toks, finished)
        if plan.decode is not None:
            maxq = self.num_lookahead_slots + 1
            for sid, entry in zip(plan.decode.seq_ids.tolist(), sampled[i:]):
                s = seqs.get(sid)
                if s is None or s.status != _RUNNING:  # aborted meanwhile
                    continue
                if isinstance(entry, (int, np.integer)):
                    self._append1(s, int(entry), finished)
                else:
                    toks = [int(t) for t in entry]
                    if not 1 <= len(toks) <= maxq:
                        raise ValueError(f"decode of seq {sid} takes 1..{maxq} tokens, got {len(toks)}")
                    self._append(s, toks, finished)
        return finished

    def _append1(self, s: _Seq, t: int, finished: list) -> None:
        g = s.group
        out = s.output
        out.append(t)
        s.num_pending = 1
        if len(out) >= g.max_tokens:
            self._finish_seq(s, FINISH_LENGTH, finished)
        elif not g.ignore_eos and (t == g.eos or t in g.stop_ids):
            self._finish_seq(s, FINISH_STOP, finished)

    def _append(self, s: _Seq, toks: Seq[int], finished: list) -> None:
        g = s.group
        out = s.output
        q = 0
        for t in toks:
            out.append(t)
            q += 1
            if len(out) >= g.max_tokens:
                s.num_pending = q
                self._finish_seq(s, FINISH_LENGTH, finished)
                return
            if not g.ignore_eos and (t == g.eos or t in g.stop_ids):
                s.num_pending = q
                self._finish_seq(s, FINISH_STOP, finished)
                return
        s.num_pending = q

    def _finish_seq(self, s: _Seq, reason: str, finished: list) -> None:
        g = s.group
        s.status = _FINISHED
        s.finish = reason
        self.bm.free(s.seq_id)
        g.live.remove(s)
        self._num_running_seqs -= 1
        if not g.live:
            del self._running[g.arrival]
            finished.append(self._finish_group(g, reason))

    def _finish_group(self, g: _Group, reason: str, error: str | None = None) -> RequestOutput:
        g.status = _FINISHED
        del self._requests[g.request_id]
        for s in g.seqs:
            del self._seqs[s.seq_id]
            if self._row_loads:
                self._row_loads.pop(s.seq_id, None)
        self.stats.finished += 1
        return RequestOutput(
            request_id=g.request_id,
            prompt_token_ids=tuple(g.prompt.tolist()),
            outputs=tuple(tuple(s.output) for s in g.seqs),
            finish_reasons=tuple(s.finish or reason for s in g.seqs),
            num_cached_tokens=g.num_cached_tokens or 0,
            num_preemptions=g.num_preemptions,
            error=error,
        )
