"""The end of a step: the sampled tokens go into the sequences (samples forked after a fresh prompt's prefill),
finished sequences are stopped and freed, finished requests come back as :class:`~pagedkv.scheduler.RequestOutput`."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .plan import FINISH_LENGTH, FINISH_STOP, RequestOutput, StepPlan
from .state import FINISHED, RUNNING, Seq
from .part import Part


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
