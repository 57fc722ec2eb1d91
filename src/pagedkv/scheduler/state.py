"""The scheduler's state: its settings (:class:`Config`), the requests and their sequences (:class:`Group`,
:class:`Seq`) and where they are (:class:`Queues`)::

    add_request --> waiting (deque) --admit--> running (dict, admission order) --finish--> RequestOutput
      |               ^   ^   ^                  |    |
      |               |   |   +--- recompute ----+    +--- swap --> swapped (heap by arrival) --swap in--+
      |               |   +---------- recompute (a swap-in that can never fit) ----------------------------+
      +--(wait_for_kv)--> loading (dict by request id) --kv_ready (lookup or load done)--+
                                                                                          |
      kv_ready(reserve=True) --> waiting --admit (allocate(num_external_tokens=E))--> fetching (dict by request id:
      its GPU blocks reserved, the block manager's LOADING) --kv_loaded + finish_external--> running (prefill rest)

A request is a :class:`Group` of ``n`` samples, each a :class:`Seq` with a scheduler-assigned id. Every part of
the scheduler works on the one :class:`Queues` object it is given; the queue operations shared by several parts
(back to the front of the waiting queue, finish a request, ignore one) live here.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Hashable

import numpy as np

from .plan import FINISH_IGNORED, RequestOutput, SchedulerStats

# sequence (and request) states; LOADING: a request waiting for its KV from a storage tier (not admitted yet);
# FETCHING: admitted with its GPU blocks reserved, its KV arriving into them (the block manager's LOADING)
WAITING, RUNNING, SWAPPED, FINISHED, LOADING, FETCHING = 0, 1, 2, 3, 4, 5


class Config:
    """The scheduler's settings (the public attributes of :class:`~pagedkv.scheduler.Scheduler`, which reads and
    writes them here; the parts read them at every step, so a change applies from the next step on)."""

    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "preemption_mode", "num_lookahead_slots",
                 "precheck_append", "incremental_tables", "enable_chunked_prefill", "long_prefill_token_threshold")

    def __init__(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


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

    def add(self, request_id: Hashable, prompt: np.ndarray, n: int, max_tokens: int, eos: int | None,
            ignore_eos: bool, stop_ids: frozenset, namespace: Any, priority: int = 0,
            wait_for_kv: bool = False) -> None:
        """A new request (checked by the caller) at the back of the waiting queue, with ``n`` sequences of
        consecutive ids (sample 0 live, the others until the fork)."""
        g = Group()
        g.request_id = request_id
        g.arrival = self.next_arrival
        self.next_arrival += 1
        g.prompt = prompt
        g.n = n
        g.max_tokens = max_tokens
        g.eos = eos
        g.ignore_eos = ignore_eos
        g.stop_ids = stop_ids
        g.namespace = namespace
        g.priority = priority
        base = self.next_seq_id
        self.next_seq_id += n
        for i in range(n):
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

    def enqueue_by_arrival(self, g: Group) -> None:
        """Into the waiting queue at its place by arrival (a request whose KV load finished: it keeps its turn
        among the requests that came after it). O(queue)."""
        if self.by_priority:
            self.enqueue_by_priority(g)
            return
        for i, o in enumerate(self.waiting):
            if o.arrival > g.arrival:
                self.waiting.insert(i, g)
                return
        self.waiting.append(g)

    def enqueue_by_priority(self, g: Group) -> None:
        """Into the waiting queue at its place by (priority, arrival) (scheduling_policy="priority"). O(queue)."""
        key = (g.priority, g.arrival)
        for i, o in enumerate(self.waiting):
            if (o.priority, o.arrival) > key:
                self.waiting.insert(i, g)
                return
        self.waiting.append(g)

    def victim(self) -> Group:
        """The running request to preempt: the most recently admitted one, or with scheduling_policy="priority"
        the one of the largest (priority, arrival) (vLLM's order). O(1), O(running) by priority."""
        r = self.running
        if self.by_priority:
            return max(r.values(), key=lambda g: (g.priority, g.arrival))
        return r[next(reversed(r))]

    def unqueue(self, g: Group) -> None:
        """Take a swapped or waiting request out of its queue (O(queue length): aborts and stops only)."""
        if g.status == SWAPPED:
            self.swapped.remove(g)
            heapq.heapify(self.swapped)
        elif g.status == LOADING:
            del self.loading[g.request_id]
        elif g.status == FETCHING:
            del self.fetching[g.request_id]
        else:
            self.waiting.remove(g)

    def to_waiting_front(self, g: Group) -> None:
        """Back to the front of the waiting queue, to be prefilled again from scratch (recompute)."""
        g.status = WAITING
        g.external = None  # (its blocks are recomputed, or found in the prefix cache)
        for s in g.live:
            self.row_loads.pop(s.seq_id, None)  # (its prefill hands over the whole row)
            s.status = WAITING
            s.num_computed = 0
            s.num_pending = 0
            s.prefill = None
        if self.by_priority:
            self.enqueue_by_priority(g)
        else:
            self.waiting.appendleft(g)

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

    def ignore(self, g: Group, reason: str) -> RequestOutput:
        """Finish a request that can never run (out of every queue, blocks freed) as ``"ignored"``."""
        self.stats.ignored += 1
        for s in g.live:
            s.status = FINISHED
            s.finish = FINISH_IGNORED
        if not g.forked:
            for s in g.seqs:
                s.finish = FINISH_IGNORED
        g.live = []
        return self.finish_group(g, FINISH_IGNORED, error=f"request {g.request_id!r} ignored: {reason}")
