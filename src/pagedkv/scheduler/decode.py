"""The decode part of a step: one ``decode_step`` over every running sequence that has finished its prompt,
preempting the most recently admitted request while the batch does not fit."""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from ..errors import OutOfBlocksError
from ..types import CopyKind
from .calls import BlockCalls
from .plan import DecodeBatch, pairs
from .preempt import Preemptor
from .state import Config, Queues
from .part import Part


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
            # preempt the most recently admitted running request (all of its sequences are at the batch's end),
            # or by priority the one of the largest (priority, arrival)
            g = q.victim()
            m = sum(1 for s in g.live if s.prefill is None)  # its decoding sequences: the batch's last
            if m and (not q.by_priority or g is running[next(reversed(running))]):
                del ids[-m:], starts[-m:], qs[-m:], toks[-m:]
            elif m:
                mine = {s.seq_id for s in g.live}
                keep = [i for i, sid in enumerate(ids) if sid not in mine]
                ids, starts, qs = [ids[i] for i in keep], [starts[i] for i in keep], [qs[i] for i in keep]
                toks = [toks[i] for i in keep]
            m = len(g.live)
            if not uniform:
                uniform = all(n == 1 for n in qs)
            if len(running) == 1:
                # alone with the whole pool (the free blocks and every evictable cached block) and still unable
                # to grow: it can never finish; preempting it would only bring it back to the same point
                del running[g.arrival]
                q.num_running_seqs -= m
                for s in g.live:
                    calls.free(s.seq_id, True)
                ignored.append(q.ignore(
                    g, f"its {m} sequence(s) need more blocks than the whole pool has to go on decoding"))
            else:
                self.preemptor.preempt(g, swap_out, preempted)
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
