"""Chunked prefill's second stage: the next chunk of every partly prefilled prompt, appended by one multi-token
``decode_step`` (the first chunk comes with the admission, :class:`pagedkv.scheduler.core.Admitter`). A prompt that
fits the step's token budget never comes here: the per-step loop calls :class:`Chunker` only when
:meth:`~pagedkv.scheduler.state.Queues.chunks_due` finds a partly prefilled sequence."""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError
from ..types import CopyKind
from .preempt import Preemptor
from .config import Config
from .state import EMPTY_PAIRS, BlockCalls, Part, PrefillWork, Queues, pairs


class Chunker(Part):
    """Schedules the chunks of partly prefilled prompts. O(running sequences) per step plus one block-manager
    call (one more per preemption)."""

    __slots__ = ("preemptor",)

    def __init__(self, cfg: Config, q: Queues, calls: BlockCalls, preemptor: Preemptor) -> None:
        super().__init__(cfg, q, calls)
        self.preemptor = preemptor

    def schedule(self, items: list, prefills: list, budget: int, swap_out: list, preempted: list,
                 swapped_in: set) -> tuple[int, np.ndarray]:
        """The chunks ``items`` (``(group, seq, tokens)`` of partly prefilled sequences, oldest admission first:
        ``Queues.chunks_due``), appended by one multi-token ``decode_step``. When they do not fit, the most recently
        admitted of them is preempted (or only left out of this step if it was swapped in in this step or also
        decodes in it) and the rest is tried again. Appends a :class:`~pagedkv.scheduler.PrefillWork` per chunk to
        ``prefills``; returns the budget left (``budget``: what the chunks left, plus any left out) and the
        call's copy-on-write pairs."""
        cfg = self.cfg
        calls = self.calls
        bm = calls.bm
        result = None
        while items:
            ids = [s.seq_id for _, s, _ in items]
            counts = np.array([c for _, _, c in items], dtype=np.int64)
            flat = np.concatenate([s.prefill[s.num_computed : s.num_computed + c] for _, s, c in items])
            ok = True
            if cfg.precheck_append:
                ok = bm.can_append_slots(ids, 0, num_new_tokens=int(counts.max()))
            if ok:
                try:
                    result = bm.decode_step(ids, flat, 0, num_new_tokens=counts)
                    break
                except OutOfBlocksError:
                    pass
            victim = items[-1][0]  # the most recently admitted of them (items follow admission order)
            if self.q.by_priority:  # or the one of the largest (priority, arrival)
                victim = max((g for g, _, _ in items), key=lambda g: (g.priority, g.arrival))
            budget += sum(c for g, _, c in items if g is victim)
            items = [it for it in items if it[0] is not victim]
            if victim.arrival not in swapped_in and all(s.prefill is not None for s in victim.live):
                self.preemptor.preempt(victim, swap_out, preempted)
        if result is None:
            return budget, EMPTY_PAIRS
        cow = pairs(result.cow)
        calls.record(CopyKind.GPU_TO_GPU, cow)
        slots = np.asarray(result.slot_mapping, dtype=np.int64)
        off = 0
        st = self.stats
        has_slots = calls.has_slots
        rows = cfg.incremental_tables
        for g, s, c in items:
            start = s.num_computed
            end = start + c
            last = end == len(s.prefill)
            prefills.append(PrefillWork(
                request_id=g.request_id, seq_id=s.seq_id, sample_index=s.index,
                token_ids=s.prefill[start:end], positions=np.arange(start, end, dtype=np.int64),
                slot_mapping=slots[..., off : off + c], block_table=calls.table(s.seq_id) if has_slots else None,
                num_cached_tokens=start, seq_len=end, num_samples=(1 if g.forked else g.n) if last else 0,
                table_row=calls.table_row(s.seq_id) if rows else None,
            ))
            off += c
            s.num_computed = end
            if last:
                s.prefill = None
            st.computed_prefill_tokens += c
            st.prefill_chunks += 1
        return budget, cow
