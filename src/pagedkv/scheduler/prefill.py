"""Admission: waiting requests become running, first come first served, while the block manager, ``max_num_seqs``
and the step's token budget allow. Each admitted sequence is allocated (the prefix-cache hit comes back) and gets
its :class:`~pagedkv.scheduler.PrefillWork`: the whole prompt from the hit on, or its first chunk."""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError
from .calls import status_name
from .plan import PrefillWork
from .state import RUNNING, Group, Seq
from .part import Part


def full_tokens(s: Seq) -> np.ndarray:
    """The sequence's prompt plus its generated tokens (a recomputed sample's new prompt)."""
    if not s.output:
        return s.group.prompt
    return np.concatenate((s.group.prompt, np.array(s.output, dtype=np.int64)))


class Admitter(Part):
    """Admits waiting requests. O(admitted sequences) per step plus the block manager's calls; a request is
    admitted with all of its sequences or not at all (a partial admission is freed in reverse order)."""

    __slots__ = ()

    def schedule(self, prefills: list, ignored: list, budget: int | None = None) -> None:
        """Admit from the front of the waiting queue, appending to ``prefills``; a request that can never fit is
        finished as ignored (``ignored``). ``budget``: prefill tokens left in the step (chunked prefill; else
        ``max_num_batched_tokens`` of whole prompts, a longer prompt admitted alone)."""
        cfg = self.cfg
        q = self.q
        calls = self.calls
        bm = calls.bm
        k = cfg.num_lookahead_slots
        chunked = cfg.enable_chunked_prefill
        if budget is None or not chunked:
            budget = cfg.max_num_batched_tokens
        cap = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
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
                token_lists = [full_tokens(s) for s in g.live]
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
            for i, (s, toks) in enumerate(zip(g.live, token_lists)):
                kw: dict = {} if g.namespace is None else {"namespace": g.namespace}
                extra = 0  # prompt tokens past the hit whose KV a storage tier loaded (not computed, not charged)
                if fresh and g.external is not None:
                    xs, xn = g.external
                    cur = int(bm.lookup_prefix(toks, k, **kw).num_cached_tokens)
                    if xs <= cur < xs + xn:
                        extra = xs + xn - cur
                    elif cur < xs:  # the hit the load continued is gone (evicted meanwhile): compute it all
                        self.stats.stale_external_loads += 1
                if chunked:  # the hit plus one chunk, leaving a token of budget for each later sequence
                    kw["num_new_tokens"] = extra + min(cap, budget - used - (m - 1 - i))
                st = status_name(bm.can_allocate(toks, k, **kw))
                if st != "OK":
                    verdict = st
                    reason = f"{len(toks)} tokens can never fit in the pool"
                    break
                try:
                    hit = bm.allocate(s.seq_id, toks, **kw)
                except OutOfBlocksError as e:
                    verdict = "NEVER" if type(e).__name__ == "PromptTooLongError" else "LATER"
                    reason = str(e)
                    break
                # its cached blocks' eviction class, and the conversation hint (once per request: sample 0's)
                session = g.session if i == 0 else None
                if (g.priority or session is not None) and getattr(bm, "enable_prefix_caching", False) \
                        and hasattr(bm, "set_retention"):
                    bm.set_retention(s.seq_id, priority=g.priority, session=session)
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
                    ignored.append(q.ignore(g, reason))
                    continue
                break
            waiting.popleft()
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
        :class:`~pagedkv.scheduler.chunks.Chunker`'s job). ``extra``: tokens past the hit whose KV the engine
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
