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

**Waiting for KV** (storage tiers, docs/tiers.md): a request added with ``wait_for_kv=True`` waits in the
*loading* set, outside every queue and batch, while the engine loads its prompt's KV from a disk or shared tier;
``kv_ready(request_id, start_token, num_tokens)`` puts it back in the waiting queue at its arrival's place with
the loaded run. At admission the run is used from the prefix-cache hit on (only if it continues the hit): the
allocation covers it (``num_new_tokens`` = loaded + chunk), the :class:`PrefillWork` starts after it and says how
many tokens the engine writes from the load instead of computing (``num_external_tokens``; not charged to the
budget). A failed load hands over fewer tokens: the rest is computed.

**Loads into reserved blocks** (the block manager's external-KV contract, docs/external-kv.md; what the engine's
storage tiers use): ``kv_ready(request_id, start, n, reserve=True)`` says a tier *holds* that run. At admission
the request is allocated with ``allocate(..., num_external_tokens=E)`` (E: the run past the hit; admission counts
those blocks and one chunk) and becomes **FETCHING**: its blocks reserved (the manager's LOADING), out of every
batch, counted against ``max_num_seqs``, listed once in ``StepPlan.kv_loads`` (:class:`KVLoad`). The engine reads
the KV off the step loop, writes it into the reserved blocks after that step's copy plan, and reports it with
``kv_loaded(request_id)`` (all) or ``kv_loaded(request_id, tokens)`` (the good leading part). The next
``schedule`` calls ``finish_external`` (before its copy plan) and prefills the rest in that step, its tokens
charged to the step's budget (a failed load's missing blocks and the chunk held since admission may exceed what
is left of it). ``abort_request`` while FETCHING frees the sequence: the manager parks the arriving blocks until
the engine reports the transfer ended (``kv_loaded`` of the aborted request); meanwhile a request that does not
fit waits for them (it is not ignored as never fitting). With KV cache groups every reserved load
(``kv_ready(..., reserve=True)``: the tiers' and the P/D split's decode side) allocates with
``external_window_only``: a load the manager cut to the sliding windows completes whole, or, reported short, has
its blocks freed and its request queued again at the front, computed from its hit.

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

**Modules** (one job each; every import points down, none back up). A plain request goes through two::

    core.py      Scheduler: the public API, a step in the order above; Decoder (the decode batch), Admitter
       |         (admissions and their PrefillWork)
       '-- state.py   Queues, Group, Seq (the requests and the queues), BlockCalls (the block manager's optional
                      parts), Updater (update(): append, stop, fork samples, finish), the result types: StepPlan,
                      PrefillWork, DecodeBatch, Preemption, RequestOutput, SequenceView, SchedulerStats, FINISH_*

and the rest, each called only when it happens::

    preempt.py   Preemptor: preemption by recompute or swap, swap-in, abort, early stops, ignored requests
    chunks.py    Chunker: the later chunks of a prompt longer than the step's budget
    loads.py     Loads: storage-tier loads (kv_ready, kv_loaded, finish_external, reserved admissions); KVLoad
    config.py    Config: the settings, checked once

Every public name is importable from ``pagedkv.scheduler``.
"""

from .state import (  # (in this order in the API reference)
    FINISH_ABORT,
    FINISH_IGNORED,
    FINISH_LENGTH,
    FINISH_STOP,
    PrefillWork,
    DecodeBatch,
    Preemption,
    StepPlan,
    RequestOutput,
    SequenceView,
    SchedulerStats,
)
from .loads import KVLoad
from .core import Scheduler

__all__ = [
    "Scheduler",
    "SchedulerStats",
    "StepPlan",
    "PrefillWork",
    "KVLoad",
    "DecodeBatch",
    "Preemption",
    "RequestOutput",
    "SequenceView",
    "FINISH_STOP",
    "FINISH_LENGTH",
    "FINISH_IGNORED",
    "FINISH_ABORT",
]
