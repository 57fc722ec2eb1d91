"""Requests whose prompt KV comes from a storage tier or a prefill replica (docs/tiers.md, docs/external-kv.md):
``Scheduler.kv_ready`` (a lookup or a load finished: back to the waiting queue), ``Scheduler.kv_loaded`` (KV arrived
into reserved blocks), the next step's ``finish_external`` and the prefill of the rest (:class:`Loads`). A plain
request never comes here; the admission (:mod:`pagedkv.scheduler.core`) calls in only for a request with a load."""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple

import numpy as np

from ..errors import InvalidArgumentError
from .preempt import Preemptor
from .config import Config, bm_setting
from .state import FETCHING, LOADING, RUNNING, WAITING, BlockCalls, Group, Part, Queues, status_name


class KVLoad(NamedTuple):
    """A request admitted in this step with GPU blocks reserved for KV that a storage tier holds
    (``Scheduler.kv_ready(..., reserve=True)``): ``load`` is the block manager's
    :class:`~pagedkv.manager._external.ExternalLoad` (``block_ids``, ``keys``, ``start_token``, ``num_tokens``).
    The engine reads that KV off the step loop, writes it into ``load.block_ids`` once this step's copy plan
    has run, and reports it with ``Scheduler.kv_loaded``; the request is left out of every batch meanwhile."""

    request_id: Hashable
    seq_id: int
    load: Any


class Loads(Part):
    """The storage-tier loads' side of the scheduler; ``preemptor`` (its ``to_waiting_front``) is the part it
    uses. O(1) per call unless stated, plus the block manager's calls."""

    __slots__ = ("preemptor",)

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls, preemptor: Preemptor) -> None:
        super().__init__(cfg, q, calls)
        self.preemptor = preemptor

    def ready(self, request_id: Hashable, start_token: int, num_tokens: int, reserve: bool,
              window_only: bool) -> bool:
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
        loads the KV into ``load.block_ids`` and reports it with ``Scheduler.kv_loaded``; the next step prefills the
        rest.

        With KV cache groups (a manager with ``num_groups > 1``) every reserved load is ``external_window_only`` (a
        sliding group reserves only the blocks its window sees at the run's end: docs/external-kv.md);
        ``window_only=True`` says so explicitly and changes nothing else (kept for the P/D split's callers). A load
        cut that way completes whole or not at all: a ``Scheduler.kv_loaded`` of fewer tokens than reserved (a transfer
        cut short) frees the request's blocks and puts it back at the front of the waiting queue, to be computed
        from its prefix-cache hit (``stats.requeued_window_loads``). A load the windows see whole keeps its good
        leading blocks, as a plain load.

        Returns False, changing nothing, for an unknown request (aborted meanwhile: a documented no-op). Raises
        ``InvalidArgumentError`` (state unchanged) for a request that is not loading, or a bad range. O(waiting)."""
        q = self.q
        g = q.requests.get(request_id)
        if g is None:
            return False
        if g.status != LOADING:
            raise InvalidArgumentError(f"request {request_id!r} is not waiting for KV")
        bs = getattr(self.calls.bm, "block_size", 1)
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
        self.enqueue_by_arrival(g)
        return True

    def enqueue_by_arrival(self, g: Group) -> None:
        """Into the waiting queue at its place by arrival (a request whose KV load finished: it keeps its turn
        among the requests that came after it). O(queue)."""
        q = self.q
        if q.by_priority:
            q.enqueue_by_priority(g)
            return
        for i, o in enumerate(q.waiting):
            if o.arrival > g.arrival:
                q.waiting.insert(i, g)
                return
        q.waiting.append(g)

    def loaded(self, request_id: Hashable, num_tokens: int | None) -> bool:
        """The KV of a FETCHING request (``StepPlan.kv_loads``) arrived in its reserved blocks: all of it
        (``num_tokens`` None), or only the first ``num_tokens`` of its external range (a failed or timed-out
        load: a multiple of ``block_size``, from ``load.start_token`` on; the rest is computed). The engine
        writes no more into those blocks. The next ``Scheduler.schedule`` reports it to the block manager
        (``finish_external``, before the step's copy plan) and prefills the request from there in that step.

        A request aborted while FETCHING (its blocks parked by the block manager) is reported the same way once
        its transfer ended: its blocks are freed then, and False is returned. False, changing nothing, for an
        unknown request. ``InvalidArgumentError`` (state unchanged) for a request that is not FETCHING, one
        reported twice, or a bad ``num_tokens``. O(1)."""
        q = self.q
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
            bs = getattr(self.calls.bm, "block_size", 1)
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or \
                    not 0 <= num_tokens <= e or num_tokens % bs:
                raise InvalidArgumentError(f"num_tokens must be None or a multiple of {bs} in [0, {e}], "
                                           f"got {num_tokens!r}")
            if num_tokens == e:
                num_tokens = None
        q.loaded[sid] = None if num_tokens is None else int(num_tokens)
        return True

    def finish_loads(self, prefills: list, work: Callable) -> int:
        """The loads reported since the last step (``Scheduler.kv_loaded``, and those of requests aborted while
        FETCHING): one ``finish_external`` call, then each live request runs: its prefill (``work``: the
        admission's :class:`~pagedkv.scheduler.PrefillWork` maker) from the tokens that arrived to what it holds (a
        failed load's missing blocks are computed here). Returns the tokens these prefills compute.
        O(reported requests + their blocks)."""
        q = self.q
        rep, q.loaded = q.loaded, {}
        done = [s for s, ok in rep.items() if ok is None]
        failed = {s: ok for s, ok in rep.items() if ok is not None}
        bm = self.calls.bm
        cut = [s for s in failed if s in q.seqs and _is_cut(q.seqs[s].group.fetch)]
        for s in cut:  # (KV cache groups) a short load cut to the windows cannot end partly: queued again
            del failed[s]
            self.requeue_cut(s)
            done.append(s)  # (freed while LOADING: its parked blocks are released by this report)
        got = bm.external.finish_external(done=done, failed=failed)
        for s in cut:
            got.pop(s, None)
        computed = 0
        for sid, n in got.items():
            s = q.seqs[sid]
            g = s.group
            del q.fetching[g.request_id]
            h = g.fetch.start_token
            g.fetch = None
            end = int(bm.num_tokens(sid))
            prefills.append(work(g, s, g.prompt, h, g.n, end, int(n) - h))
            computed += end - min(int(n), len(g.prompt) - 1)
            g.num_cached_tokens = int(n)
            g.status = RUNNING
            s.status = RUNNING
            q.running[g.arrival] = g
        return computed

    def requeue_cut(self, sid: int) -> None:
        """A FETCHING request whose reserved load was cut to the sliding windows (``external_window_only``: a
        sliding group holds only the blocks its window sees at the load's end) and arrived short: no shorter
        end is usable (its windows would need blocks before the first one reserved), and the manager cannot end
        such a load partly, so the sequence is freed (its blocks parked until this step's ``finish_external``
        report) and the request queued again at the front, to be computed from its prefix-cache hit. O(prompt
        blocks x groups)."""
        q = self.q
        g = q.seqs[sid].group
        del q.fetching[g.request_id]
        g.fetch = None
        q.num_running_seqs -= g.n
        self.calls.free(sid, True)
        self.preemptor.to_waiting_front(g)
        g.reserve = False
        self.stats.requeued_window_loads += 1

    def external_run(self, g: Group, toks: np.ndarray, k: int, kw: dict) -> tuple[int, int]:
        """At admission, a fresh request with a loaded (or held) run ``g.external``: ``(extra, cur)``, the run's
        tokens past the prefix-cache hit ``cur`` (0 when the run does not continue the hit; a hit that the run
        continued and that was evicted meanwhile counts ``stats.stale_external_loads``)."""
        xs, xn = g.external
        cur = int(self.calls.bm.lookup_prefix(toks, k, **kw).num_cached_tokens)
        if xs <= cur < xs + xn:
            return xs + xn - cur, cur
        if cur < xs:  # the hit the load continued is gone (evicted meanwhile): compute it all
            self.stats.stale_external_loads += 1
        return 0, cur

    def can_reserve(self, toks: np.ndarray, k: int, kw: dict, extra: int, cap: int | None) -> str:
        """Admission of a request whose KV a tier holds (``kv_ready(..., reserve=True)``): ``can_allocate`` counting
        the ``extra`` external blocks and one chunk (``cap``; None: not chunked), then ``kw`` set for the
        allocation that reserves them (``num_external_tokens``; with KV cache groups ``external_window_only``: a
        sliding group reserves only its window's blocks). Returns the verdict's name."""
        bm = self.calls.bm
        if cap is not None:
            kw["num_new_tokens"] = extra + cap
        st = status_name(bm.can_allocate(toks, k, **kw))
        if cap is not None:
            kw["num_new_tokens"] = cap
        kw["num_external_tokens"] = extra
        if bm_setting(bm, "num_groups", 1) > 1:
            kw["external_window_only"] = True
        return st

    def reserved(self, seq_id: int, kw: dict) -> Any:
        """After the allocation of :meth:`can_reserve`: the manager's ExternalLoad of the sequence (its reserved
        blocks), or None when allocate kept no external token (``kw`` is then a plain allocation's again)."""
        fetch = self.calls.bm.external.external_blocks(seq_id)
        if fetch is None:
            kw.pop("num_external_tokens")
            kw.pop("external_window_only", None)
        return fetch

    def admit_fetching(self, g: Group, s, fetch: Any, new_seqs: int, loads: list | None) -> None:
        """A request admitted with its blocks reserved for a tier's KV (``fetch``: the manager's ExternalLoad)
        becomes FETCHING: out of every batch, counted against ``max_num_seqs``, listed in ``loads``; its prefill
        comes once the load is reported (:meth:`finish_loads`)."""
        q = self.q
        g.fetch = fetch
        g.external = None
        g.status = FETCHING
        s.status = FETCHING
        q.fetching[g.request_id] = g
        q.num_running_seqs += new_seqs
        if loads is not None:
            loads.append(KVLoad(g.request_id, s.seq_id, fetch))

    def allocate_loaded(self, bm, seq_id, toks: np.ndarray, cur: int, extra: int, kw: dict) -> tuple:
        """Allocate a prompt whose tokens ``[cur, cur + extra)`` arrived loaded, on a manager with KV cache groups
        (docs/external-kv.md): ``allocate(..., num_external_tokens=extra, external_window_only=True)``, so that
        a sliding group reserves only the blocks its window sees at ``cur + extra`` (the KV handed over holds only
        those), then ``finish_external(done=)`` at once (the payloads are in memory; the engine writes them after
        the step's copy plan, before its forward, as for any load). Returns ``(hit, extra)``. When the manager's
        hit is not the lookup's ``cur`` (the range would not match the payloads), the load is aborted, the prompt
        allocated plainly and ``extra`` is 0 (``stats.stale_external_loads``). Raises what allocate raises
        (nothing changed then). O(prompt blocks x groups)."""
        kx = dict(kw)
        if "num_new_tokens" in kx:  # (a chunk past the external tokens)
            kx["num_new_tokens"] = max(1, kx["num_new_tokens"] - extra)
        got = bm.allocate(seq_id, toks, num_external_tokens=extra, external_window_only=True, **kx)
        ext = bm.external.external_blocks(seq_id)
        if ext is not None and ext.start_token == cur and ext.num_tokens == extra:
            bm.external.finish_external(done=[seq_id])
            return cur, extra
        self.stats.stale_external_loads += 1
        if ext is None:  # (nothing loaded: a plain allocation, its hit)
            return int(got), 0
        bm.free(seq_id)  # (aborted while loading: its blocks parked, released at once: nothing writes them)
        bm.external.finish_external(done=[seq_id])
        return bm.allocate(seq_id, toks, **kw), 0


def _is_cut(fetch) -> bool:
    """Whether a reserved load holds NULL_BLOCK positions in a group (cut to a sliding window). O(blocks)."""
    return fetch is not None and any(b < 0 for ids in fetch.group_block_ids[1:] for b in ids)
