"""The moves a plain request never makes: preemption (a running request leaves the batch by recompute, its blocks
freed and the request back at the front of the waiting queue, or by swap, its blocks to the CPU pool and the
request onto the swapped heap; recompute when the CPU pool is full), swap-in (swapped requests come back oldest
first while ``can_swap_in`` says OK), aborts and early stops out of any queue, and requests finished as
``"ignored"`` because they can never fit (:class:`Preemptor`). The per-step loop (:mod:`pagedkv.scheduler.core`)
calls in here only when one of these happens."""

from __future__ import annotations

import heapq

import numpy as np

from ..types import CopyKind
from .state import (FETCHING, FINISH_ABORT, FINISH_IGNORED, FINISHED, LOADING, RUNNING, SWAPPED, WAITING, Group,
                    Part, Preemption, RequestOutput, Seq, pairs, status_name)


def full_tokens(s: Seq) -> np.ndarray:
    """The sequence's prompt plus its generated tokens (a recomputed sample's new prompt)."""
    if not s.output:
        return s.group.prompt
    return np.concatenate((s.group.prompt, np.array(s.output, dtype=np.int64)))


class Preemptor(Part):
    """Moves requests between running, swapped and waiting, and out of them. Works on the queues, the block calls
    and the settings it is given; O(sequences of the request) per call plus the block manager's calls, except
    taking a request out of the middle of a queue (O(queue length): aborts and stops only)."""

    __slots__ = ()

    def preempt(self, g: Group, swap_out: list, preempted: list) -> None:
        """Take running request ``g`` out of the batch: swap it out (mode "swap" and the CPU pool has room),
        else recompute it. Appends its swap pairs to ``swap_out`` and a :class:`Preemption` to ``preempted``."""
        q = self.q
        del q.running[g.arrival]
        ids = [s.seq_id for s in g.live]
        q.num_running_seqs -= len(ids)
        g.num_preemptions += 1
        st = self.stats
        st.preemptions += 1
        bm = self.calls.bm
        if self.cfg.preemption_mode == "swap" and bm.can_swap_out(ids):
            p = pairs(bm.swap_out(ids))
            swap_out.append(p)
            self.calls.record(CopyKind.GPU_TO_CPU, p)
            st.swap_outs += 1
            st.swapped_out_blocks += len(p)
            g.status = SWAPPED
            for s in g.live:
                s.status = SWAPPED
            heapq.heappush(q.swapped, g)
            preempted.append(Preemption(g.request_id, tuple(ids), "swap"))
            return
        for sid in ids:
            bm.free(sid)
        st.recompute_preemptions += 1
        self.to_waiting_front(g)
        preempted.append(Preemption(g.request_id, tuple(ids), "recompute"))

    def recompute(self, g: Group) -> None:
        """A swapped request that cannot come back: free its CPU blocks and queue it for a new prefill."""
        for s in g.live:
            self.calls.free(s.seq_id, True)
        self.to_waiting_front(g)

    def swap_in(self, swap_in: list, swapped_in: set | None = None) -> bool:
        """Swap requests in, oldest first, while they fit (``max_num_seqs``, ``can_swap_in``); one that can
        never fit is recomputed instead. Appends the pairs to ``swap_in`` and the requests' arrivals to
        ``swapped_in``; returns whether any came back."""
        q = self.q
        cfg = self.cfg
        calls = self.calls
        bm = calls.bm
        k = cfg.num_lookahead_slots
        st = self.stats
        swapped = q.swapped
        any_in = False
        while swapped:
            g = swapped[0]
            m = len(g.live)
            if q.num_running_seqs + m > cfg.max_num_seqs:
                break
            ids = [s.seq_id for s in g.live]
            verdict = status_name(bm.can_swap_in(ids, k))
            if verdict == "OK":
                heapq.heappop(swapped)
                p = pairs(bm.swap_in(ids))
                swap_in.append(p)
                calls.record(CopyKind.CPU_TO_GPU, p)
                st.swap_ins += 1
                st.swapped_in_blocks += len(p)
                g.status = RUNNING
                for s in g.live:
                    s.status = RUNNING
                    if cfg.incremental_tables:
                        q.row_loads[s.seq_id] = None
                q.running[g.arrival] = g
                q.num_running_seqs += m
                any_in = True
                if swapped_in is not None:
                    swapped_in.add(g.arrival)
            elif verdict == "NEVER":  # it can never come back: recompute it (and maybe finish it as ignored later)
                heapq.heappop(swapped)
                self.recompute(g)
            else:
                break
        return any_in

    def decode_victim(self, ids: list, starts: list, qs: list, toks: list, swap_out: list, preempted: list,
                      ignored: list) -> tuple:
        """The decode batch does not fit: preempt the most recently admitted running request (all of its decoding
        sequences are at the batch's end), or by priority the one of the largest (priority, arrival), and drop
        its sequences from the batch lists. A request alone with the whole pool (the free blocks and every
        evictable cached block) that still cannot grow can never finish (preempting it would only bring it back
        to the same point): it is finished as ignored (``ignored``). Returns the lists, maybe rebuilt."""
        q = self.q
        running = q.running
        g = self.victim()
        m = sum(1 for s in g.live if s.prefill is None)  # its decoding sequences: the batch's last
        if m and (not q.by_priority or g is running[next(reversed(running))]):
            del ids[-m:], starts[-m:], qs[-m:], toks[-m:]
        elif m:
            mine = {s.seq_id for s in g.live}
            keep = [i for i, sid in enumerate(ids) if sid not in mine]
            ids, starts, qs = [ids[i] for i in keep], [starts[i] for i in keep], [qs[i] for i in keep]
            toks = [toks[i] for i in keep]
        m = len(g.live)
        if len(running) == 1:
            del running[g.arrival]
            q.num_running_seqs -= m
            for s in g.live:
                self.calls.free(s.seq_id, True)
            ignored.append(self.ignore(
                g, f"its {m} sequence(s) need more blocks than the whole pool has to go on decoding"))
        else:
            self.preempt(g, swap_out, preempted)
        return ids, starts, qs, toks

    def unstick(self, ignored: list) -> None:
        """The progress guard: nothing runs and nothing could be started although work is queued. A swapped
        request that cannot come back even into an empty pool is recomputed; else the head of the waiting queue
        can never fit (LATER with an empty pool means never) and is finished as ignored."""
        q = self.q
        if q.swapped:
            self.recompute(heapq.heappop(q.swapped))
        elif q.waiting:
            g = q.waiting.popleft()
            if g.forked and len(g.live) > 1:
                why = (f"its {len(g.live)} samples, preempted by recompute, no longer share their prompt "
                       f"blocks and do not fit in the pool together")
            else:
                why = "the prompt does not fit in the pool even when it is empty"
            ignored.append(self.ignore(g, why))

    # ----------------------------------------------------------------------------------------- the queues

    def victim(self) -> Group:
        """The running request to preempt: the most recently admitted one, or with scheduling_policy="priority"
        the one of the largest (priority, arrival) (vLLM's order). O(1), O(running) by priority."""
        r = self.q.running
        if self.q.by_priority:
            return max(r.values(), key=lambda g: (g.priority, g.arrival))
        return r[next(reversed(r))]

    def unqueue(self, g: Group) -> None:
        """Take a swapped or waiting request out of its queue (O(queue length): aborts and stops only)."""
        q = self.q
        if g.status == SWAPPED:
            q.swapped.remove(g)
            heapq.heapify(q.swapped)
        elif g.status == LOADING:
            del q.loading[g.request_id]
        elif g.status == FETCHING:
            del q.fetching[g.request_id]
        else:
            q.waiting.remove(g)

    def to_waiting_front(self, g: Group) -> None:
        """Back to the front of the waiting queue, to be prefilled again from scratch (recompute)."""
        q = self.q
        g.status = WAITING
        g.external = None  # (its blocks are recomputed, or found in the prefix cache)
        for s in g.live:
            q.row_loads.pop(s.seq_id, None)  # (its prefill hands over the whole row)
            s.status = WAITING
            s.num_computed = 0
            s.num_pending = 0
            s.prefill = None
        if q.by_priority:
            q.enqueue_by_priority(g)
        else:
            q.waiting.appendleft(g)

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
        return self.q.finish_group(g, FINISH_IGNORED, error=f"request {g.request_id!r} ignored: {reason}")

    def abort(self, g: Group) -> RequestOutput:
        """:meth:`pagedkv.scheduler.Scheduler.abort_request` of the unfinished request ``g``."""
        q = self.q
        free = self.calls.free
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
            self.unqueue(g)
        elif g.status == FETCHING:  # the block manager parks its arriving blocks until kv_loaded reports it
            s0 = g.live[0].seq_id
            free(s0, True)
            self.unqueue(g)
            q.num_running_seqs -= g.n
            if s0 in q.loaded:
                q.loaded[s0] = None  # (its transfer ended already: finish_external frees the parked blocks)
            else:
                q.parked[g.request_id] = s0
            g.fetch = None
        elif g.status in (WAITING, LOADING):
            self.unqueue(g)
        for s in g.live:
            s.status = FINISHED
            s.finish = FINISH_ABORT
        g.live = []
        return q.finish_group(g, FINISH_ABORT)

    def stop_queued(self, s, reason: str) -> RequestOutput | None:
        """:meth:`pagedkv.scheduler.Scheduler.finish_sequence` of a sample that is not running: nothing to stop
        before its request generated anything; else the sample is finished (its CPU blocks freed if swapped), and
        its request's output returned if it was the last one."""
        g = s.group
        if s.status in (WAITING, LOADING, FETCHING) and not g.forked:
            return None  # nothing generated yet: there is nothing to stop
        if s.status == SWAPPED:
            self.calls.free(s.seq_id, True)
        s.status = FINISHED
        s.finish = reason
        g.live.remove(s)
        if g.live:
            return None
        self.unqueue(g)
        return self.q.finish_group(g, reason)
