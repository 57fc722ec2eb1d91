"""The scheduler's state and its results: the requests and their sequences
(:class:`Group`, :class:`Seq`), where they are (:class:`Queues`), what the block manager can do
(:class:`BlockCalls`), and what a step returns (:class:`StepPlan` with its :class:`PrefillWork`,
:class:`DecodeBatch` and :class:`Preemption` parts; :class:`RequestOutput`, :class:`SequenceView`,
:class:`SchedulerStats`, the finish reasons)::

    add_request --> waiting (deque) --admit--> running (dict, admission order) --finish--> RequestOutput
      |               ^   ^   ^                  |    |
      |               |   |   +--- recompute ----+    +--- swap --> swapped (heap by arrival) --swap in--+
      |               |   +---------- recompute (a swap-in that can never fit) ----------------------------+
      +--(wait_for_kv)--> loading (dict by request id) --kv_ready (lookup or load done)--+
                                                                                          |
      kv_ready(reserve=True) --> waiting --admit (allocate(num_external_tokens=E))--> fetching (dict by request id:
      its GPU blocks reserved, the block manager's LOADING) --kv_loaded + finish_external--> running (prefill rest)

A request is a :class:`Group` of ``n`` samples, each a :class:`Seq` with a scheduler-assigned id. Every part of
the scheduler (:class:`Part`) works on the one :class:`Queues` object it is given. The moves a plain request never
makes (preemption, swap, abort, a request that can never fit) are in :mod:`pagedkv.scheduler.preempt`, the
storage-tier loads in :mod:`pagedkv.scheduler.loads`. The result types are plain immutable values (NamedTuple,
frozen dataclass), except the counters of :class:`SchedulerStats`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

from ..types import CopyPlan
from .config import Config, bm_setting

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

# sequence (and request) states; LOADING: a request waiting for its KV from a storage tier (not admitted yet);
# FETCHING: admitted with its GPU blocks reserved, its KV arriving into them (the block manager's LOADING)
WAITING, RUNNING, SWAPPED, FINISHED, LOADING, FETCHING = 0, 1, 2, 3, 4, 5


class Seq:
    """One sample of a request."""

    __slots__ = ("seq_id", "group", "index", "output", "num_computed", "num_pending", "status", "finish",
                 "prefill")

    def __init__(self, seq_id: int, group: "Group", index: int) -> None:
        self.seq_id = seq_id
        self.group = group
        self.index = index
        self.output: list[int] = []
        self.num_computed = 0  # tokens appended to the block manager (== bm.num_tokens while allocated)
        self.num_pending = 0  # trailing output tokens not input yet
        self.status = WAITING
        self.finish: str | None = None
        self.prefill: np.ndarray | None = None  # chunked prefill: the tokens being prefilled, until the last chunk


class Group:
    """One request: its prompt, sampling limits and samples (``seqs``; ``live``: those not finished)."""

    __slots__ = (
        "request_id", "arrival", "prompt", "n", "max_tokens", "eos", "ignore_eos", "stop_ids",
        "namespace", "seqs", "live", "forked", "num_cached_tokens", "num_preemptions", "status", "priority",
        "external", "reserve", "window_only", "fetch", "session",
    )

    def __init__(self) -> None:
        self.seqs: list[Seq] = []
        self.live: list[Seq] = []
        self.forked = False
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = WAITING
        self.priority = 0  # vLLM's request priority: lower is served first (scheduling_policy="priority")
        self.session = None  # the conversation it belongs to: the eviction policy's hint (set_retention's session)
        # (start_token, num_tokens) of prompt KV loaded from a storage tier, waiting for admission (Scheduler.kv_ready)
        self.external: tuple | None = None
        self.reserve = False  # kv_ready(reserve=True): admit with allocate(num_external_tokens=) (FETCHING)
        self.window_only = False  # kv_ready(window_only=True): allocate(..., external_window_only=True) (KV groups)
        self.fetch = None  # the ExternalLoad of a FETCHING request (its reserved blocks), until its load ends

    def __lt__(self, other: "Group") -> bool:  # heap order of the swapped queue
        return self.arrival < other.arrival


class Queues:
    """The requests and their sequences, and the three queues.

    ``waiting``: a deque, first come first served (a preempted request goes back to the front); ``running``: a
    dict arrival -> group, insertion order = admission order (the last key is the next preemption victim);
    ``swapped``: a heap by arrival. ``requests`` and ``seqs`` index every unfinished request and its sequences;
    ``num_running_seqs`` counts the running requests' sequences (a fresh request counts ``n``); ``row_loads``
    (incremental tables) holds the sequences whose whole table row the engine has not seen yet (forked, swapped
    in). All O(1) per request, except removing a request from the middle of a queue (aborts)."""

    __slots__ = ("by_priority", "waiting", "running", "swapped", "requests", "seqs", "num_running_seqs", "row_loads", "stats",
                 "next_seq_id", "next_arrival", "loading", "fetching", "parked", "loaded")

    def __init__(self, stats: SchedulerStats) -> None:
        self.waiting: deque[Group] = deque()
        self.by_priority = False  # scheduling_policy="priority": waiting by (priority, arrival)
        self.running: dict[int, Group] = {}
        self.swapped: list[Group] = []
        self.loading: dict[Hashable, Group] = {}  # waiting for KV from a storage tier: request id -> group
        self.fetching: dict[Hashable, Group] = {}  # admitted, KV arriving into reserved blocks: request id -> group
        self.parked: dict[Hashable, int] = {}  # aborted while FETCHING: request id -> seq id (blocks parked)
        self.loaded: dict[int, int | None] = {}  # seq id -> tokens arrived (None: all), reported by kv_loaded
        self.requests: dict[Hashable, Group] = {}
        self.seqs: dict[int, Seq] = {}
        self.num_running_seqs = 0
        self.row_loads: dict[int, None] = {}
        self.stats = stats
        self.next_seq_id = 0
        self.next_arrival = 0

    def add(self, request_id: Hashable, prompt_token_ids: Any, n: int, max_tokens: int, eos: int | None,
            ignore_eos: bool, stop_ids: Sequence[int], namespace: Any, priority: int, wait_for_kv: bool,
            session: Hashable, max_num_seqs: int) -> None:
        """:meth:`pagedkv.scheduler.Scheduler.add_request`: the arguments checked (ValueError, nothing changed),
        the request at the back of the waiting queue, with ``n`` sequences of consecutive ids (sample 0 live, the
        others until the fork)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        try:
            hash(session)
        except TypeError:
            raise ValueError(f"request {request_id!r}: session must be hashable, got {type(session).__name__}") \
                from None
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        prompt = np.array(prompt_token_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if n < 1:
            raise ValueError(f"request {request_id!r}: n must be >= 1, got {n}")
        if n > max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={n} exceeds max_num_seqs={max_num_seqs}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        prompt.setflags(write=False)
        g = Group()
        g.request_id = request_id
        g.arrival = self.next_arrival
        self.next_arrival += 1
        g.prompt = prompt
        g.n, g.max_tokens = int(n), int(max_tokens)
        g.eos = None if eos is None else int(eos)
        g.ignore_eos = bool(ignore_eos)
        g.stop_ids = frozenset(int(t) for t in stop_ids)
        g.namespace = namespace
        g.priority = int(priority)
        g.session = session
        base = self.next_seq_id
        self.next_seq_id += g.n
        for i in range(g.n):
            s = Seq(base + i, g, i)
            g.seqs.append(s)
            self.seqs[base + i] = s
        g.live = [g.seqs[0]]
        self.requests[request_id] = g
        if wait_for_kv:
            g.status = LOADING
            self.loading[request_id] = g
        elif self.by_priority:
            self.enqueue_by_priority(g)
        else:
            self.waiting.append(g)

    def enqueue_by_priority(self, g: Group) -> None:
        """Into the waiting queue at its place by (priority, arrival) (scheduling_policy="priority"). O(queue)."""
        key = (g.priority, g.arrival)
        for i, o in enumerate(self.waiting):
            if (o.priority, o.arrival) > key:
                self.waiting.insert(i, g)
                return
        self.waiting.append(g)

    def chunks_due(self, budget: int, cap: int) -> tuple[list, int]:
        """``(items, budget left)``: the next chunk, ``(group, seq, tokens)``, of every partly prefilled sequence of
        the running requests (oldest admission first) while ``budget`` lasts, at most ``cap`` tokens each (0: the
        budget): chunked prefill's work after the step's decodes. O(running sequences)."""
        cap = cap or budget
        items: list = []
        for g in self.running.values():
            for s in g.live:
                if s.prefill is None:
                    continue
                if budget <= 0:
                    break
                c = min(len(s.prefill) - s.num_computed, budget, cap)
                items.append((g, s, c))
                budget -= c
        return items, budget

    def finish_group(self, g: Group, reason: str, error: str | None = None) -> RequestOutput:
        """Forget a request (its blocks are already freed) and return its output."""
        g.status = FINISHED
        del self.requests[g.request_id]
        for s in g.seqs:
            del self.seqs[s.seq_id]
            if self.row_loads:
                self.row_loads.pop(s.seq_id, None)
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


# ----------------------------------------------------------------------------------------------------- results

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
    kv_loads: tuple = ()  # tuple[loads.KVLoad, ...]: requests admitted with reserved blocks for KV a tier holds

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


# ---------------------------------------------------------------------------------------------- the block manager

def status_name(status: Any) -> str:
    """'OK' / 'LATER' / 'NEVER' for pagedkv's AllocStatus and for look-alike enums of benchmark adapters."""
    name = getattr(status, "name", None)
    return name if isinstance(name, str) else str(status)


class BlockCalls:
    """The block manager ``bm`` and what it can do.

    ``prepare``: its ``prepare_step`` (called before every ``decode_step``) or None; ``has_slots``: it has
    ``slot_mapping`` / ``block_table`` (prefills carry them); ``num_groups``: KV cache groups (None: one, plain
    arrays); ``own_plan``: it has no ``take_copy_plan``, so the step's copies are recorded here (``record``) in
    call order and :meth:`take_copy_plan` builds the plan from them."""

    __slots__ = ("bm", "prepare", "has_slots", "num_groups", "own_plan", "step_copies")

    def __init__(self, bm: Any) -> None:
        self.bm = bm
        self.prepare = getattr(bm, "prepare_step", None)
        self.has_slots = getattr(bm, "slot_mapping", None) is not None
        # per-group shapes when the manager's plain result names are per group (grouped_results; an adapter
        # without it: when it has num_groups); a BlockManager (num_groups 1) keeps the plain (T,) / one table
        grouped = bm_setting(bm, "grouped_results", None)
        self.num_groups = None if grouped is False else bm_setting(bm, "num_groups", None)
        self.own_plan = getattr(bm, "take_copy_plan", None) is None
        self.step_copies: list = []  # (kind, pairs) in call order (own_plan only)

    def begin_step(self) -> None:
        """A new step: nothing recorded yet."""
        self.step_copies = []

    def record(self, kind: Any, pairs: np.ndarray) -> None:
        """A call's copies of ``kind`` (own_plan only; the block manager keeps its own plan otherwise)."""
        if self.own_plan:
            self.step_copies.append((kind, pairs))

    def take_copy_plan(self) -> CopyPlan:
        """The step's copies in call order: the block manager's own plan, or one built from the recorded calls."""
        if not self.own_plan:
            return self.bm.take_copy_plan()
        return CopyPlan.build([(k, p[:, 0], p[:, 1]) for k, p in self.step_copies if len(p)])

    def free(self, seq_id: int, cache: bool) -> None:
        """``free(seq_id)``, or ``free(seq_id, cache=False)`` where the adapter takes the keyword."""
        if cache:
            self.bm.free(seq_id)
            return
        try:
            self.bm.free(seq_id, cache=False)
        except TypeError:  # an adapter without the keyword
            self.bm.free(seq_id)

    def table(self, seq_id: int):
        """The sequence's block table (a tuple of one per group for a HybridBlockManager)."""
        if self.num_groups is None:
            return self.bm.block_table(seq_id)
        return tuple(self.bm.block_table(seq_id, g) for g in range(self.num_groups))

    def slots(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """Slots of positions ``[start, end)``: int64 (T,), or (G, T) with KV cache groups."""
        bm = self.bm
        if self.num_groups is None:
            return np.asarray(bm.slot_mapping(seq_id, start, end), dtype=np.int64)
        return np.stack([np.asarray(bm.slot_mapping(seq_id, start, end, g), dtype=np.int64)
                         for g in range(self.num_groups)])

    def table_row(self, seq_id: int) -> int:
        """The sequence's row in the block manager's table matrix (incremental tables)."""
        return int(self.bm.table_rows([seq_id])[0])


class Part:
    """Base of the scheduler's parts (:class:`~pagedkv.scheduler.preempt.Preemptor`, ``Decoder``, ``Chunker``,
    ``Admitter``, ``Updater``): holds the objects given at construction, nothing else. O(1)."""

    __slots__ = ("cfg", "q", "calls", "stats")

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls) -> None:
        self.cfg = cfg
        self.q = q
        self.calls = calls
        self.stats = q.stats


class _Setting:
    """A setting of the scheduler, kept in its :class:`~pagedkv.scheduler.state.Config` (which the parts read):
    reading or writing ``scheduler.name`` reads or writes it there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._cfg, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._cfg, self.name, value)


class Updater(Part):
    """Applies a step's sampled tokens. O(sampled tokens) per step plus one ``free`` per finished sequence and one
    ``fork`` per new sample."""

    __slots__ = ()

    def update(self, plan: StepPlan, sampled: Any) -> list[RequestOutput]:
        """:meth:`pagedkv.scheduler.Scheduler.update` once the plan is checked: the finished requests."""
        if isinstance(sampled, np.ndarray):
            sampled = sampled.tolist()
        expected = len(plan.prefills) + (0 if plan.decode is None else len(plan.decode.seq_ids))
        if len(sampled) != expected:
            raise ValueError(f"expected {expected} sampled entries (prefills then decodes), got {len(sampled)}")
        finished: list[RequestOutput] = list(plan.ignored)
        q = self.q
        seqs = q.seqs
        bm = self.calls.bm
        i = 0
        for pw in plan.prefills:
            entry = sampled[i]
            i += 1
            s = seqs.get(pw.seq_id)
            if s is None or s.status != RUNNING:  # aborted meanwhile
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
                    child.status = RUNNING
                    if self.cfg.incremental_tables:
                        q.row_loads[child.seq_id] = None
                self.stats.forks += len(g.seqs) - 1
                g.live = list(g.seqs)
                g.forked = True
                for child, t in zip(g.seqs, toks):
                    self.append(child, (t,), finished)
            else:
                if not g.forked:
                    g.forked = True  # n == 1: nothing to fork
                self.append(s, toks, finished)
        if plan.decode is not None:
            maxq = self.cfg.num_lookahead_slots + 1
            for sid, entry in zip(plan.decode.seq_ids.tolist(), sampled[i:]):
                s = seqs.get(sid)
                if s is None or s.status != RUNNING:  # aborted meanwhile
                    continue
                if isinstance(entry, (int, np.integer)):  # one token: the common decode, inline
                    t = int(entry)
                    out = s.output
                    out.append(t)
                    s.num_pending = 1
                    g = s.group
                    if len(out) >= g.max_tokens:
                        self.finish_seq(s, FINISH_LENGTH, finished)
                    elif not g.ignore_eos and (t == g.eos or t in g.stop_ids):
                        self.finish_seq(s, FINISH_STOP, finished)
                else:
                    toks = [int(t) for t in entry]
                    if not 1 <= len(toks) <= maxq:
                        raise ValueError(f"decode of seq {sid} takes 1..{maxq} tokens, got {len(toks)}")
                    self.append(s, toks, finished)
        return finished

    def append(self, s: Seq, toks: Sequence[int], finished: list) -> None:
        """Sampled tokens (a prefill's, or speculative decoding's accepted ones), up to the first that stops."""
        g = s.group
        out = s.output
        n = 0
        for t in toks:
            out.append(t)
            n += 1
            if len(out) >= g.max_tokens:
                s.num_pending = n
                self.finish_seq(s, FINISH_LENGTH, finished)
                return
            if not g.ignore_eos and (t == g.eos or t in g.stop_ids):
                s.num_pending = n
                self.finish_seq(s, FINISH_STOP, finished)
                return
        s.num_pending = n

    def finish_seq(self, s: Seq, reason: str, finished: list) -> None:
        """Stop a running sequence and free its blocks; its request's output goes to ``finished`` when it was the
        last sample running."""
        g = s.group
        s.status = FINISHED
        s.finish = reason
        self.calls.bm.free(s.seq_id)
        g.live.remove(s)
        q = self.q
        q.num_running_seqs -= 1
        if not g.live:
            del q.running[g.arrival]
            finished.append(q.finish_group(g, reason))
