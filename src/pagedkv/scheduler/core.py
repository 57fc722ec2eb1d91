"""The scheduler's per-step loop: :class:`Scheduler` (the public API, a step in the policy's order of
:mod:`pagedkv.scheduler`) and the parts that make a plain request's block-manager calls::

    schedule():  Decoder --> [Preemptor.swap_in] --> [Chunker] --> [Loads.finish_loads] --> Admitter --> StepPlan
    update():    Updater (state.py): append the sampled tokens, stop, fork samples, finish

Every part works on the state of state.py (Queues, BlockCalls, the result types) and the settings (config.py); the
bracketed ones, and the Preemptor's victims, run only when there is such work: preempt.py (preemption, swap,
abort, ignore), chunks.py (a prompt longer than the step's budget), loads.py (storage-tier loads). A part keeps
the objects it is given at construction; nothing reaches a part through the facade.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import OutOfBlocksError
from ..types import CopyKind
from .chunks import Chunker
from .loads import Loads
from .config import Config, bm_setting
from .preempt import Preemptor, full_tokens
from .state import (EMPTY_PAIRS, FINISH_STOP, FINISHED, RUNNING, WAITING, BlockCalls, DecodeBatch, Group, Part,
                    PrefillWork, Queues, RequestOutput, SchedulerStats, Seq, SequenceView, StepPlan, Updater,
                    _Setting, concat_pairs, pairs, status_name)


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
        self._cfg = cfg = Config(block_manager, max_num_seqs, max_num_batched_tokens, preemption_mode,
                                 num_lookahead_slots, precheck_append, incremental_tables, enable_chunked_prefill,
                                 long_prefill_token_threshold, scheduling_policy)
        self.bm = block_manager
        self.stats = SchedulerStats()
        # the state (state.py) and the parts (here; preempt.py, loads.py)
        self._q = q = Queues(self.stats)
        q.by_priority = scheduling_policy == "priority"
        self.scheduling_policy = scheduling_policy
        self._calls = calls = BlockCalls(block_manager)
        self._preemptor = preemptor = Preemptor(cfg, q, calls)
        self._loads = loads = Loads(cfg, q, calls, preemptor)
        self._decoder = Decoder(cfg, q, calls, preemptor)
        self._chunker = Chunker(cfg, q, calls, preemptor)
        self._admitter = Admitter(cfg, q, calls, preemptor, loads)
        self._updater = Updater(cfg, q, calls)
        self._outstanding: StepPlan | None = None
        self._seqs, self._requests, self._row_loads = q.seqs, q.requests, q.row_loads  # (for tests, benchmarks)

    # -------------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        n: int = 1,
        max_tokens: int = 16,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        namespace: Any = None,
        priority: int = 0,
        wait_for_kv: bool = False,
        session: Hashable = None,
    ) -> None:
        """Queue a request. ``max_tokens`` counts generated tokens per sample; generation stops after EOS
        (unless ``ignore_eos``) or a token of ``stop_token_ids``; ``namespace`` isolates its prefix-cache
        entries. ``priority`` (vLLM's field, lower is more urgent): with ``scheduling_policy="priority"`` requests
        are admitted by (priority, arrival) and preempted from the largest (priority, arrival) first; with any
        policy the block manager (if it has a ``retention`` part, prefix caching on) evicts the cached blocks of a
        request of a larger value first. ``session`` (any hashable; None: no hint): the conversation the request
        belongs to, passed to the block manager's ``retention.set_retention`` with sample 0's allocation (a forked sample's
        blocks carry none), for the ``"session"`` and ``"density"`` eviction policies; a request readmitted after a
        recompute preemption passes it again (its preempted run counts as one more request of the conversation).

        ``wait_for_kv``: the request waits in the *loading* set (not admitted, steps go on for the others) until
        :meth:`kv_ready` says its load from a storage tier finished; it then joins the waiting queue at its
        arrival's place."""
        self._q.add(request_id, prompt_token_ids, n, max_tokens, eos_token_id, ignore_eos, stop_token_ids, namespace,
                    priority, wait_for_kv, session, self._cfg.max_num_seqs)

    def kv_ready(self, request_id: Hashable, start_token: int = 0, num_tokens: int = 0, *,
                 reserve: bool = False, window_only: bool = False) -> bool:
        """The storage-tier load of a request added with ``wait_for_kv=True`` finished: it holds the KV of prompt
        positions ``[start_token, start_token + num_tokens)`` (block multiples; 0: computed), or with
        ``reserve=True`` a tier *holds* that run: the request is admitted with those blocks reserved (FETCHING,
        ``StepPlan.kv_loads``) and the engine reports their arrival with :meth:`kv_loaded`. The request joins the
        waiting queue at its arrival's place. False, changing nothing, for an unknown request;
        ``InvalidArgumentError`` (state unchanged) for one that is not loading, or a bad range. The whole contract
        (failed loads, KV cache groups, ``window_only``): :meth:`pagedkv.scheduler.loads.Loads.ready`. O(waiting)."""
        return self._loads.ready(request_id, start_token, num_tokens, reserve, window_only)

    def kv_loaded(self, request_id: Hashable, num_tokens: int | None = None) -> bool:
        """The KV of a FETCHING request (``StepPlan.kv_loads``) arrived in its reserved blocks: all of it
        (``num_tokens`` None), or the first ``num_tokens`` of its external range (the rest is computed). The next
        :meth:`schedule` reports it to the block manager and prefills the request from there. False for an unknown
        or aborted request; the whole contract: :meth:`pagedkv.scheduler.loads.Loads.loaded`. O(1)."""
        return self._loads.loaded(request_id, num_tokens)

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
        g = self._q.requests.get(request_id)
        return None if g is None else self._preemptor.abort(g)

    def finish_sequence(self, seq_id: int, reason: str = FINISH_STOP) -> RequestOutput | None:
        """Finish one sample now (e.g. the engine found a stop string in its text) and free its blocks. Returns
        the request's output if that was its last unfinished sample, else None (also for an unknown or finished
        sequence). Call it between ``update`` and the next ``schedule``."""
        if self._outstanding is not None:
            raise RuntimeError("finish_sequence() between schedule() and update(): call update() first")
        s = self._q.seqs.get(seq_id)
        if s is None or s.status == FINISHED:
            return None
        if s.status != RUNNING:
            return self._preemptor.stop_queued(s, reason)
        out: list[RequestOutput] = []
        self._updater.finish_seq(s, reason, out)
        return out[0] if out else None

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
        preempted: list = []
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
                items, budget = q.chunks_due(budget, cfg.long_prefill_token_threshold)
                if items:
                    budget, chunk_cow = self._chunker.schedule(items, prefills, budget, swap_out, preempted,
                                                               swapped_in)
        used = 0
        if q.loaded:  # KV arrived in reserved blocks: finish_external, then prefill the rest in this step
            used = self._loads.finish_loads(prefills, self._admitter.work)
            budget -= used
        kv_loads: list = []
        if not preempted and not q.swapped and q.waiting:
            self._admitter.schedule(prefills, ignored, budget, kv_loads, used)

        # progress guard: nothing runs and nothing could be started although work is queued
        # (blocks parked for an aborted load come back once its transfer ends: not "never fits" meanwhile)
        if not q.running and not prefills and not swapped_in_any and not preempted and not q.fetching \
                and not q.parked:
            self._preemptor.unstick(ignored)

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


class Decoder(Part):
    """Builds the step's :class:`~pagedkv.scheduler.DecodeBatch`. O(batch) Python per step plus the block
    manager's call; a preemption drops the victim's sequences from the end of the batch lists and retries."""

    __slots__ = ("preemptor",)

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls, preemptor: Preemptor) -> None:
        super().__init__(cfg, q, calls)
        self.preemptor = preemptor

    def schedule(self, swap_out: list, preempted: list, ignored: list,
                 allow_preempt: bool = True) -> DecodeBatch | None:
        """Append the sequences' pending tokens (plus ``num_lookahead_slots``) and return the batch, or None when
        nothing decodes. Victims go to ``swap_out`` / ``preempted``; a request that cannot grow even alone with
        the whole pool is finished as ignored (``ignored``). With ``allow_preempt=False`` a batch that does not
        fit is not scheduled at all."""
        q = self.q
        running = q.running
        ids: list[int] = []
        starts: list[int] = []
        qs: list[int] = []
        toks: list = []
        uniform = True
        for g in running.values():
            for s in g.live:
                if s.prefill is not None:  # partly prefilled: its next chunk comes after the decodes
                    continue
                ids.append(s.seq_id)
                starts.append(s.num_computed)
                n = s.num_pending
                qs.append(n)
                if n == 1:
                    toks.append(s.output[-1])
                else:
                    uniform = False
                    toks.append(s.output[-n:])
        cfg = self.cfg
        calls = self.calls
        bm = calls.bm
        k = cfg.num_lookahead_slots
        precheck = cfg.precheck_append
        result = None
        while ids:
            # with speculation a sequence appends up to k + 1 tokens: check the batch's largest count for all
            # (adapters of other block managers are not all-or-nothing across a batch)
            if not precheck:
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
                    if q0 > 0 and all(n == q0 for n in qs):
                        token_arg = np.array(ragged, dtype=np.int64).reshape(len(ids), q0)
                    else:  # flat tokens + counts: the block manager need not convert Python lists
                        token_arg = np.fromiter(chain.from_iterable(ragged), dtype=np.int64, count=sum(qs))
                        counts_arg = np.array(qs, dtype=np.int64)
                if calls.prepare is not None:
                    calls.prepare(ids, token_arg if counts_arg is None else ragged)
                kw = {} if counts_arg is None else {"num_new_tokens": counts_arg}
                if cfg.incremental_tables:
                    kw["block_tables"] = False
                try:
                    result = bm.decode_step(ids, token_arg, k, **kw)
                    if calls.own_plan:
                        calls.record(CopyKind.GPU_TO_GPU, pairs(result.cow))
                    break
                except OutOfBlocksError:
                    pass
            if not allow_preempt:
                return None
            ids, starts, qs, toks = self.preemptor.decode_victim(ids, starts, qs, toks, swap_out, preempted, ignored)
            if not uniform:
                uniform = all(n == 1 for n in qs)
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
        seqs = q.seqs
        total = 0
        for sid, n in zip(ids, qs):
            s = seqs[sid]
            s.num_computed += n
            s.num_pending = 0
            total += n
        self.stats.decode_tokens += total
        loads = ()
        pending = q.row_loads
        if pending:
            todo = [sid for sid in ids if sid in pending]
            if todo:
                rows = bm.table_rows(todo).tolist()
                loads = tuple((sid, row, calls.table(sid)) for sid, row in zip(todo, rows))
                for sid in todo:
                    del pending[sid]
        return DecodeBatch(seq_ids, input_tokens, positions, query_lens, k, result, loads)


class Admitter(Part):
    """Admits waiting requests. O(admitted sequences) per step plus the block manager's calls; a request is
    admitted with all of its sequences or not at all (a partial admission is freed in reverse order). A request
    with a storage-tier load goes through ``tier`` (:class:`~pagedkv.scheduler.loads.Loads`); one that can never
    fit through ``preemptor`` (its ``ignore``)."""

    __slots__ = ("preemptor", "tier")

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls, preemptor: Preemptor, tier: Loads) -> None:
        super().__init__(cfg, q, calls)
        self.preemptor = preemptor
        self.tier = tier

    def schedule(self, prefills: list, ignored: list, budget: int | None = None, loads: list | None = None,
                 used: int = 0) -> None:
        """Admit from the front of the waiting queue, appending to ``prefills``; a request that can never fit is
        finished as ignored (``ignored``). ``budget``: prefill tokens left in the step (chunked prefill; else
        ``max_num_batched_tokens`` of whole prompts, a longer prompt admitted alone, ``used`` of them taken
        already). A request whose KV a tier holds (``kv_ready(..., reserve=True)``) is allocated with
        ``num_external_tokens`` and becomes FETCHING (appended to ``loads``, no prefill yet, nothing charged)."""
        cfg = self.cfg
        q = self.q
        calls = self.calls
        bm = calls.bm
        k = cfg.num_lookahead_slots
        chunked = cfg.enable_chunked_prefill
        if budget is None or not chunked:
            budget = cfg.max_num_batched_tokens
        cap = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
        if chunked:
            used = 0
        waiting = q.waiting
        while waiting:
            g = waiting[0]
            fresh = not g.forked
            new_seqs = g.n if fresh else len(g.live)
            if q.num_running_seqs + new_seqs > cfg.max_num_seqs:
                break
            if chunked and budget - used < len(g.live):  # (at least one token for each of its sequences)
                break
            if fresh:
                token_lists = [g.prompt]
            else:
                token_lists = [full_tokens(s) for s in g.live]  # (re-admitted after a recompute)
            ntok = sum(len(t) for t in token_lists)
            if not chunked and used + ntok > budget and prefills:
                break
            # all sequences of the request or none
            done: list[tuple[Seq, np.ndarray, int]] = []
            verdict = "OK"
            reason = ""
            m = len(token_lists)
            ends: list[int] = []
            exts: list[int] = []
            fetch = None  # the ExternalLoad of a request admitted with reserved blocks (reserve)
            for i, (s, toks) in enumerate(zip(g.live, token_lists)):
                kw: dict = {} if g.namespace is None else {"namespace": g.namespace}
                extra = 0  # prompt tokens past the hit whose KV a storage tier loaded (not computed, not charged)
                if fresh and g.external is not None:
                    extra, cur = self.tier.external_run(g, toks, k, kw)
                reserve = bool(extra) and g.reserve
                if reserve:  # admission counts the external blocks and one chunk; allocate reserves them
                    st = self.tier.can_reserve(toks, k, kw, extra, cap if chunked else None)
                else:
                    if chunked:  # the hit plus one chunk, leaving a token of budget for each later sequence
                        kw["num_new_tokens"] = extra + min(cap, budget - used - (m - 1 - i))
                    st = status_name(bm.can_allocate(toks, k, **kw))
                if st != "OK":
                    verdict = st
                    reason = f"{len(toks)} tokens can never fit in the pool"
                    break
                try:
                    if extra and not reserve and bm_setting(bm, "num_groups", 1) > 1:  # (P/D: staged, window-only)
                        hit, extra = self.tier.allocate_loaded(bm, s.seq_id, toks, cur, extra, kw)
                    else:
                        hit = bm.allocate(s.seq_id, toks, **kw)
                except OutOfBlocksError as e:
                    verdict = "NEVER" if type(e).__name__ == "PromptTooLongError" else "LATER"
                    reason = str(e)
                    break
                # its cached blocks' eviction class, and the conversation hint (once per request: sample 0's)
                session = g.session if i == 0 else None
                if (g.priority or session is not None) and bm_setting(bm, "enable_prefix_caching", False):
                    retention = getattr(bm, "retention", None)  # (the part is built on each read: read it once)
                    if retention is not None:
                        retention.set_retention(s.seq_id, priority=g.priority, session=session)
                if reserve:
                    fetch = self.tier.reserved(s.seq_id, kw)  # (None: allocate kept no external token)
                    if fetch is not None:
                        ends.append(0)
                        exts.append(0)
                        done.append((s, toks, int(hit)))
                        continue
                    extra = 0
                end = len(toks)
                if chunked:
                    end = min(end, int(hit) + kw["num_new_tokens"])
                if extra:  # the loaded run as allocate placed it: [hit, xs + xn), only if it continues the hit
                    xs, xn = g.external
                    extra = max(0, min(xs + xn, end) - int(hit)) if xs <= int(hit) else 0
                if chunked:
                    used += end - int(hit) - extra
                ends.append(end)
                exts.append(extra)
                done.append((s, toks, int(hit)))
            if verdict != "OK":
                for s, _, _ in reversed(done):  # later samples may share earlier ones' unwritten blocks
                    calls.free(s.seq_id, False)
                if verdict == "NEVER":
                    waiting.popleft()
                    ignored.append(self.preemptor.ignore(g, reason))
                    continue
                break
            waiting.popleft()
            if fetch is not None:  # FETCHING: its blocks reserved, its prefill once the load is reported
                self.tier.admit_fetching(g, done[0][0], fetch, new_seqs, loads)
                continue
            if not chunked:
                used += ntok
            for (s, toks, hit), end, extra in zip(done, ends, exts):
                prefills.append(self.work(g, s, toks, hit, g.n if fresh else 1, end, extra))
            if g.num_cached_tokens is None:
                g.num_cached_tokens = done[0][2] + exts[0]
            g.external = None
            g.status = RUNNING
            for s in g.live:
                s.status = RUNNING
            q.running[g.arrival] = g
            q.num_running_seqs += new_seqs

    def work(self, g: Group, s: Seq, toks: np.ndarray, hit: int, num_samples: int,
             end: int | None = None, extra: int = 0) -> PrefillWork:
        """The prefill of a just allocated sequence: prompt positions ``[hit + extra, end)`` (``end`` < len: the
        first chunk of a chunked prefill, which samples nothing; the rest is
        :class:`Chunker`'s job). ``extra``: tokens past the hit whose KV the engine
        writes from a storage tier's load before the step's forward (``PrefillWork.num_external_tokens``)."""
        L = len(toks)
        end = L if end is None else end
        # the last prompt token is always computed: its logits give the next token
        start = min(hit + extra, L - 1)
        extra = max(0, start - hit)
        calls = self.calls
        if calls.has_slots:
            slots = calls.slots(s.seq_id, start, end)
            table = calls.table(s.seq_id)
        else:
            slots = table = None
        row = calls.table_row(s.seq_id) if self.cfg.incremental_tables else None
        s.num_computed = end
        s.num_pending = 0
        s.prefill = toks if end < L else None
        st = self.stats
        st.prefills += 1
        st.prompt_tokens += L
        st.cached_tokens += hit
        st.external_tokens += extra
        st.computed_prefill_tokens += end - start
        if self.cfg.enable_chunked_prefill:
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
            num_external_tokens=extra,
        )
