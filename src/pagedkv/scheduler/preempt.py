"""Preemption and the swapped queue: a running request leaves the batch by recompute (blocks freed, back to the
front of the waiting queue) or by swap (blocks to the CPU pool, onto the swapped heap; recompute when the CPU pool
is full), and swapped requests come back oldest first while ``can_swap_in`` says OK."""

from __future__ import annotations

import heapq

from ..types import CopyKind
from .calls import status_name
from .plan import Preemption, pairs
from .state import RUNNING, SWAPPED, Group
from .part import Part


class Preemptor(Part):
    """Moves requests between running, swapped and waiting. Works on the queues, the block calls and the settings
    it is given; O(sequences of the request) per call plus the block manager's calls."""

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
        q.to_waiting_front(g)
        preempted.append(Preemption(g.request_id, tuple(ids), "recompute"))

    def recompute(self, g: Group) -> None:
        """A swapped request that cannot come back: free its CPU blocks and queue it for a new prefill."""
        for s in g.live:
            self.calls.free(s.seq_id, True)
        self.q.to_waiting_front(g)

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
