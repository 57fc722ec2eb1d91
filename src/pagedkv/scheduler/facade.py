"""The scheduler's facade: :class:`Scheduler` checks its arguments, owns the settings, the queues and the parts,
and runs a step in the policy's order (:mod:`pagedkv.scheduler`)::

    schedule():  Decoder --> Preemptor.swap_in --> Chunker --> Admitter --> progress guard --> StepPlan
                 (decode)    (preempt)             (chunks)    (prefill)
                    |
                    +-- Preemptor.preempt: the victims (recompute or swap); the Chunker's too
    update():    Updater (update): append, stop, fork samples, finish

    every part works on:  Config, Queues (state) | BlockCalls (calls) | the plan types (plan)

A part receives at construction the objects it works on and keeps them as its own attributes; nothing reaches a
part through the facade, and a part knows only the parts below it (the decoder and the chunker call the
preemptor).
"""

from __future__ import annotations

import heapq
from typing import Any, Hashable, Sequence as Seq

import numpy as np

from ..errors import InvalidArgumentError
from .calls import BlockCalls
from .chunks import Chunker
from .decode import Decoder
from .plan import (
    EMPTY_PAIRS,
    FINISH_ABORT,
    FINISH_STOP,
    PrefillWork,
    Preemption,
    RequestOutput,
    SchedulerStats,
    SequenceView,
    StepPlan,
    concat_pairs,
    pairs,
)
from .preempt import Preemptor
from .prefill import Admitter
from .state import FETCHING, FINISHED, LOADING, RUNNING, SWAPPED, WAITING, Config, Queues
from .update import Updater


class _Setting:
    """A setting of the scheduler, kept in its :class:`~pagedkv.scheduler.state.Config` (which the parts read):
    reading or writing ``scheduler.name`` reads or writes it there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._cfg, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._cfg, self.name, value)


class Scheduler:
    """Continuous batching over ``block_manager`` (see :mod:`pagedkv.scheduler` for the policy).

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
        enable_chunked_prefill: schedule by a token budget with prompts prefilled in chunks (see
            :mod:`pagedkv.scheduler`); needs a block manager whose ``allocate``, ``can_allocate`` and
            ``decode_step`` take ``num_new_tokens`` (:class:`pagedkv.BlockManager`).
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
            ``DecodeBatch.table_loads``); see :mod:`pagedkv.scheduler`. Needs a manager with ``table_rows``.
    """

    max_num_seqs = _Setting()
    max_num_batched_tokens = _Setting()
    preemption_mode = _Setting()
    num_lookahead_slots = _Setting()
    precheck_append = _Setting()
    incremental_tables = _Setting()
    enable_chunked_prefill = _Setting()
    long_prefill_token_threshold = _Setting()

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
        scheduling_policy: str = "fcfs",
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
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        if precheck_append is None:
            precheck_append = not getattr(block_manager, "atomic_append", False)
        if incremental_tables and getattr(block_manager, "table_rows", None) is None:
            raise ValueError("incremental_tables needs a block manager with table_rows (decode_step(..., "
                             "block_tables=False)), such as pagedkv.BlockManager")
        self._cfg = cfg = Config(
            max_num_seqs=int(max_num_seqs),
            max_num_batched_tokens=int(max_num_batched_tokens),
            preemption_mode=preemption_mode,
            num_lookahead_slots=int(num_lookahead_slots),
            precheck_append=bool(precheck_append),
            incremental_tables=bool(incremental_tables),
            enable_chunked_prefill=bool(enable_chunked_prefill),
            long_prefill_token_threshold=int(long_prefill_token_threshold),
        )
        self.bm = block_manager
        self.stats = SchedulerStats()
        # the state and the parts (state.py; calls.py; preempt.py, decode.py, chunks.py, prefill.py, update.py)
        self._q = q = Queues(self.stats)
        q.by_priority = scheduling_policy == "priority"
        self.scheduling_policy = scheduling_policy
        self._calls = calls = BlockCalls(block_manager)
        self._preemptor = preemptor = Preemptor(cfg, q, calls)
        self._decoder = Decoder(cfg, q, calls, preemptor)
        self._chunker = Chunker(cfg, q, calls, preemptor)
        self._admitter = Admitter(cfg, q, calls)
        self._updater = Updater(cfg, q, calls)
        self._outstanding: StepPlan | None = None
        # the same dicts, for tests and benchmarks that look inside
        self._seqs = q.seqs
        self._requests = q.requests
        self._row_loads = q.row_loads

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
        priority: int = 0,
        wait_for_kv: bool = False,
        session: Hashable = None,
    ) -> None:
        """Queue a request. ``max_tokens`` counts generated tokens per sample; generation stops after EOS
        (unless ``ignore_eos``) or a token of ``stop_token_ids``; ``namespace`` isolates its prefix-cache
        entries. ``priority`` (vLLM's field, lower is more urgent): with ``scheduling_policy="priority"`` requests
        are admitted by (priority, arrival) and preempted from the largest (priority, arrival) first; with any
        policy the block manager (if it has ``set_retention``, prefix caching on) evicts the cached blocks of a
        request of a larger value first. ``session`` (any hashable; None: no hint): the conversation the request
        belongs to, passed to the block manager's ``set_retention`` with sample 0's allocation (a forked sample's
        blocks carry none), for the ``"session"`` and ``"density"`` eviction policies; a request readmitted after a
        recompute preemption passes it again (its preempted run counts as one more request of the conversation).

        ``wait_for_kv``: the request waits in the *loading* set (not admitted, steps go on for the others) until
        :meth:`kv_ready` says its load from a storage tier finished; it then joins the waiting queue at its
        arrival's place."""
        q = self._q
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        try:
            hash(session)
        except TypeError:
            raise ValueError(f"request {request_id!r}: session must be hashable, got {type(session).__name__}") \
                from None
        if request_id in q.requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        prompt = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if n < 1:
            raise ValueError(f"request {request_id!r}: n must be >= 1, got {n}")
        if n > self._cfg.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={n} exceeds max_num_seqs={self._cfg.max_num_seqs}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        prompt.setflags(write=False)
        q.add(request_id, prompt, int(n), int(max_tokens), None if eos_token_id is None else int(eos_token_id),
              bool(ignore_eos), frozenset(int(t) for t in stop_token_ids), namespace, int(priority),
              bool(wait_for_kv))
        q.requests[request_id].session = session

    def kv_ready(self, request_id: Hashable, start_token: int = 0, num_tokens: int = 0, *,
                 reserve: bool = False, window_only: bool = False) -> bool:
        """The storage-tier load of a request added with ``wait_for_kv=True`` finished: it holds the KV of prompt
        positions ``[start_token, start_token + num_tokens)`` (block multiples; ``num_tokens`` 0: nothing was
        loaded, or the load failed at once: the prompt is computed). The request joins the waiting queue at its
        arrival's place; at admission the loaded run is used from the prefix-cache hit on if it continues the
        hit (``PrefillWork.num_external_tokens``), else computed (``stats.stale_external_loads``). A failed load
        passes the good leading blocks only: the rest is computed, never skipped.

        ``reserve=True`` (the tiers' path, docs/tiers.md): ``[start_token, start_token + num_tokens)`` is what a
        tier *holds*, not loaded yet. At admission the request is allocated with ``num_external_tokens`` = the
        part of that run past the hit (admission counts those blocks), becomes FETCHING (its blocks reserved,
        the block manager's LOADING; out of every batch) and is listed in ``StepPlan.kv_loads``; the engine
        loads the KV into ``load.block_ids`` and reports it with :meth:`kv_loaded`; the next step prefills the
        rest.

        With KV cache groups (a manager with ``num_groups > 1``) every reserved load is ``external_window_only`` (a
        sliding group reserves only the blocks its window sees at the run's end: docs/external-kv.md);
        ``window_only=True`` says so explicitly and changes nothing else (kept for the P/D split's callers). A load
        cut that way completes whole or not at all: a :meth:`kv_loaded` of fewer tokens than reserved (a transfer
        cut short) frees the request's blocks and puts it back at the front of the waiting queue, to be computed
        from its prefix-cache hit (``stats.requeued_window_loads``). A load the windows see whole keeps its good
        leading blocks, as a plain load.

        Returns False, changing nothing, for an unknown request (aborted meanwhile: a documented no-op). Raises
        ``InvalidArgumentError`` (state unchanged) for a request that is not loading, or a bad range. O(waiting)."""
        q = self._q
        g = q.requests.get(request_id)
        if g is None:
            return False
        if g.status != LOADING:
            raise InvalidArgumentError(f"request {request_id!r} is not waiting for KV")
        bs = getattr(self.bm, "block_size", 1)
        for name, v in (("start_token", start_token), ("num_tokens", num_tokens)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 or v % bs:
                raise InvalidArgumentError(f"{name} must be an int >= 0 and a multiple of {bs}, got {v!r}")
        if num_tokens and start_token + num_tokens > len(g.prompt) - 1:
            raise InvalidArgumentError(f"request {request_id!r}: loaded KV up to {start_token + num_tokens} tokens "
                                       f"leaves no prompt token to compute ({len(g.prompt)} tokens)")
        del q.loading[request_id]
        g.status = WAITING
        g.external = (int(start_token), int(num_tokens)) if num_tokens else None
        g.reserve = bool(reserve)
        g.window_only = bool(reserve and window_only)
        q.enqueue_by_arrival(g)
        return True

    def kv_loaded(self, request_id: Hashable, num_tokens: int | None = None) -> bool:
        """The KV of a FETCHING request (``StepPlan.kv_loads``) arrived in its reserved blocks: all of it
        (``num_tokens`` None), or only the first ``num_tokens`` of its external range (a failed or timed-out
        load: a multiple of ``block_size``, from ``load.start_token`` on; the rest is computed). The engine
        writes no more into those blocks. The next :meth:`schedule` reports it to the block manager
        (``finish_external``, before the step's copy plan) and prefills the request from there in that step.

        A request aborted while FETCHING (its blocks parked by the block manager) is reported the same way once
        its transfer ended: its blocks are freed then, and False is returned. False, changing nothing, for an
        unknown request. ``InvalidArgumentError`` (state unchanged) for a request that is not FETCHING, one
        reported twice, or a bad ``num_tokens``. O(1)."""
        q = self._q
        sid = q.parked.pop(request_id, None)
        if sid is not None:
            q.loaded[sid] = None  # (parked: the block manager frees its blocks)
            return False
        g = q.requests.get(request_id)
        if g is None:
            return False
        if g.status != FETCHING:
            raise InvalidArgumentError(f"request {request_id!r} has no KV load into reserved blocks")
        sid = g.live[0].seq_id
        if sid in q.loaded:
            raise InvalidArgumentError(f"request {request_id!r}: its load was reported already")
        e = g.fetch.num_tokens
        if num_tokens is not None:
            bs = getattr(self.bm, "block_size", 1)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or \
                    not 0 <= num_tokens <= e or num_tokens % bs:
                raise InvalidArgumentError(f"num_tokens must be None or a multiple of {bs} in [0, {e}], "
                                           f"got {num_tokens!r}")
            if num_tokens == e:
                num_tokens = None
        q.loaded[sid] = None if num_tokens is None else int(num_tokens)
        return True

    def is_fetching(self, request_id: Hashable) -> bool:
        """Whether the request waits for KV arriving into its reserved blocks (not reported yet). O(1)."""
        g = self._q.fetching.get(request_id)
        return g is not None and g.live[0].seq_id not in self._q.loaded

    def is_waiting(self, request_id: Hashable) -> bool:
        """Whether the request waits in the queue for its admission (not loading, not yet allocated). O(1)."""
        g = self._q.requests.get(request_id)
        return g is not None and g.status == WAITING

    @property
    def num_loading(self) -> int:
        """Requests waiting for their KV from a storage tier: looked up (``add_request(..., wait_for_kv=True)``)
        or arriving into reserved blocks (FETCHING)."""
        return len(self._q.loading) + len(self._q.fetching)

    @property
    def num_parked(self) -> int:
        """Requests aborted while FETCHING whose transfer has not been reported ended (:meth:`kv_loaded`)."""
        return len(self._q.parked)

    def abort_request(self, request_id: Hashable) -> RequestOutput | None:
        """Drop a request wherever it is; returns its output (finish reason "abort"), None if unknown."""
        q = self._q
        g = q.requests.get(request_id)
        if g is None:
            return None
        free = self._calls.free
        if g.status == RUNNING:
            # a scheduled plan is executed in full (other requests of the step may read this one's blocks:
            # burst sharing), so its KV is written even when the request is aborted in between
            for s in g.live:
                free(s.seq_id, True)
            del q.running[g.arrival]
            q.num_running_seqs -= len(g.live) if g.forked else g.n
        elif g.status == SWAPPED:
            for s in g.live:
                free(s.seq_id, True)
            q.unqueue(g)
        elif g.status == FETCHING:  # the block manager parks its arriving blocks until kv_loaded reports it
            s0 = g.live[0].seq_id
            free(s0, True)
            q.unqueue(g)
            q.num_running_seqs -= g.n
            if s0 in q.loaded:
                q.loaded[s0] = None  # (its transfer ended already: finish_external frees the parked blocks)
            else:
                q.parked[request_id] = s0
            g.fetch = None
        elif g.status in (WAITING, LOADING):
            q.unqueue(g)
        for s in g.live:
            s.status = FINISHED
            s.finish = FINISH_ABORT
        g.live = []
        return q.finish_group(g, FINISH_ABORT)

    def finish_sequence(self, seq_id: int, reason: str = FINISH_STOP) -> RequestOutput | None:
        """Finish one sample now (e.g. the engine found a stop string in its text) and free its blocks. Returns
        the request's output if that was its last unfinished sample, else None (also for an unknown or finished
        sequence). Call it between ``update`` and the next ``schedule``."""
        if self._outstanding is not None:
            raise RuntimeError("finish_sequence() between schedule() and update(): call update() first")
        q = self._q
        s = q.seqs.get(seq_id)
        if s is None or s.status == FINISHED:
            return None
        g = s.group
        if s.status == RUNNING:
            out: list[RequestOutput] = []
            self._updater.finish_seq(s, reason, out)
            return out[0] if out else None
        if s.status in (WAITING, LOADING, FETCHING) and not g.forked:
            return None  # nothing generated yet: there is nothing to stop
        if s.status == SWAPPED:
            self._calls.free(s.seq_id, True)
        s.status = FINISHED
        s.finish = reason
        g.live.remove(s)
        if g.live:
            return None
        q.unqueue(g)
        return q.finish_group(g, reason)

    def has_unfinished(self) -> bool:
        return bool(self._q.requests)

    def has_request(self, request_id: Hashable) -> bool:
        """Whether ``request_id`` is queued, loading, running or swapped (not finished). O(1)."""
        return request_id in self._q.requests

    @property
    def num_waiting(self) -> int:
        return len(self._q.waiting)

    @property
    def num_running(self) -> int:
        """Running requests."""
        return len(self._q.running)

    @property
    def num_running_seqs(self) -> int:
        return self._q.num_running_seqs

    @property
    def num_swapped(self) -> int:
        return len(self._q.swapped)

    def sequence(self, seq_id: int) -> SequenceView:
        """Read-only view of a sequence (request, sample index, generated tokens)."""
        s = self._q.seqs[seq_id]
        g = s.group
        return SequenceView(g.request_id, s.index, len(g.prompt), tuple(s.output), s.num_computed)

    # -------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        """Make the block-manager calls of the next step and return its plan."""
        if self._outstanding is not None:
            raise RuntimeError("schedule() called twice without update(): pass the sampled tokens first")
        st = self.stats
        st.steps += 1
        q = self._q
        cfg = self._cfg
        calls = self._calls
        calls.begin_step()
        swap_out: list[np.ndarray] = []
        swap_in: list[np.ndarray] = []
        preempted: list[Preemption] = []
        ignored: list[RequestOutput] = []

        decode = self._decoder.schedule(swap_out, preempted, ignored) if q.running else None

        swapped_in_any = False
        swapped_in: set = set()
        if not preempted and q.swapped:
            swapped_in_any = self._preemptor.swap_in(swap_in, swapped_in)
            if swapped_in_any and decode is None:
                # nothing else decodes this step: decode the swapped-in requests now (without preempting, so a
                # block is never swapped in and out in the same step)
                decode = self._decoder.schedule(swap_out, preempted, ignored, allow_preempt=False)

        prefills: list[PrefillWork] = []
        chunk_cow = EMPTY_PAIRS
        budget = cfg.max_num_batched_tokens
        if cfg.enable_chunked_prefill:
            if decode is not None:
                budget -= int(decode.query_lens.sum())
            if q.running:  # the next chunk of each partly prefilled prompt
                budget, chunk_cow = self._chunker.schedule(prefills, budget, swap_out, preempted, swapped_in)
        used = 0
        if q.loaded:  # KV arrived in reserved blocks: finish_external, then prefill the rest in this step
            used = self._admitter.finish_loads(prefills)
            budget -= used
        kv_loads: list = []
        if not preempted and not q.swapped and q.waiting:
            self._admitter.schedule(prefills, ignored, budget, kv_loads, used)

        # progress guard: nothing runs and nothing could be started although work is queued
        # (blocks parked for an aborted load come back once its transfer ends: not "never fits" meanwhile)
        if not q.running and not prefills and not swapped_in_any and not preempted and not q.fetching \
                and not q.parked:
            if q.swapped:  # cannot swap in even into an empty pool: recompute it instead
                self._preemptor.recompute(heapq.heappop(q.swapped))
            elif q.waiting:  # LATER with an empty pool means never
                g = q.waiting.popleft()
                if g.forked and len(g.live) > 1:
                    why = (f"its {len(g.live)} samples, preempted by recompute, no longer share their prompt "
                           f"blocks and do not fit in the pool together")
                else:
                    why = "the prompt does not fit in the pool even when it is empty"
                ignored.append(q.ignore(g, why))

        cow = decode.result.cow if decode is not None else None  # (the plan's GPU -> GPU copies)
        cow = concat_pairs([pairs(cow), chunk_cow])
        if len(cow):
            st.copy_on_writes += len(cow)
        plan = StepPlan(
            step=st.steps,
            swap_out=concat_pairs(swap_out),
            swap_in=concat_pairs(swap_in),
            copy_on_write=cow,
            prefills=tuple(prefills),
            decode=decode,
            preempted=tuple(preempted),
            ignored=tuple(ignored),
            copies=calls.take_copy_plan(),
            kv_loads=tuple(kv_loads),
        )
        self._outstanding = plan
        return plan

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
        return self._updater.update(plan, sampled)
