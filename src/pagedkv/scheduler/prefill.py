"""Admission: waiting requests become running, first come first served, while the block manager, ``max_num_seqs``
and the step's token budget allow. Each admitted sequence is allocated (the prefix-cache hit comes back) and gets
its :class:`~pagedkv.scheduler.PrefillWork`: the whole prompt from the hit on, or its first chunk."""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError
from .calls import status_name
from .plan import KVLoad, PrefillWork
from .state import FETCHING, RUNNING, WAITING, Group, Seq
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
            fetch = None  # the ExternalLoad of a request admitted with reserved blocks (reserve)
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
                reserve = bool(extra) and g.reserve
                if reserve:  # admission counts the external blocks and one chunk; allocate reserves them
                    if chunked:
                        kw["num_new_tokens"] = extra + cap
                    st = status_name(bm.can_allocate(toks, k, **kw))
                    if chunked:
                        kw["num_new_tokens"] = cap
                    kw["num_external_tokens"] = extra
                    if getattr(bm, "num_groups", 1) > 1:  # a sliding group reserves only its window's blocks
                        kw["external_window_only"] = True
                else:
                    if chunked:  # the hit plus one chunk, leaving a token of budget for each later sequence
                        kw["num_new_tokens"] = extra + min(cap, budget - used - (m - 1 - i))
                    st = status_name(bm.can_allocate(toks, k, **kw))
                if st != "OK":
                    verdict = st
                    reason = f"{len(toks)} tokens can never fit in the pool"
                    break
                try:
                    if extra and not reserve and getattr(bm, "num_groups", 1) > 1:  # (P/D: staged, window-only)
                        hit, extra = self.allocate_loaded(bm, s.seq_id, toks, cur, extra, kw)
                    else:
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
                if reserve:
                    fetch = bm.external_blocks(s.seq_id)  # (None: allocate kept no external token)
                    if fetch is not None:
                        ends.append(0)
                        exts.append(0)
                        done.append((s, toks, int(hit)))
                        continue
                    kw.pop("num_external_tokens")
                    kw.pop("external_window_only", None)
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
                    ignored.append(q.ignore(g, reason))
                    continue
                break
            waiting.popleft()
            if fetch is not None:  # FETCHING: its blocks reserved, its prefill once the load is reported
                (s, _, _), = done
                g.fetch = fetch
                g.external = None
                g.status = FETCHING
                s.status = FETCHING
                q.fetching[g.request_id] = g
                q.num_running_seqs += new_seqs
                if loads is not None:
                    loads.append(KVLoad(g.request_id, s.seq_id, fetch))
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

    def finish_loads(self, prefills: list) -> int:
        """The loads reported since the last step (``Scheduler.kv_loaded``, and those of requests aborted while
        FETCHING): one ``finish_external`` call, then each live request runs: its prefill from the tokens that
        arrived to what it holds (a failed load's missing blocks are computed here). Returns the tokens these
        prefills compute. O(reported requests + their blocks)."""
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
        got = bm.finish_external(done=done, failed=failed)
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
            prefills.append(self.work(g, s, g.prompt, h, g.n, end, int(n) - h))
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
        q.to_waiting_front(g)
        g.reserve = False
        self.stats.requeued_window_loads += 1

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
        ext = bm.external_blocks(seq_id)
        if ext is not None and ext.start_token == cur and ext.num_tokens == extra:
            bm.finish_external(done=[seq_id])
            return cur, extra
        self.stats.stale_external_loads += 1
        if ext is None:  # (nothing loaded: a plain allocation, its hit)
            return int(got), 0
        bm.free(seq_id)  # (aborted while loading: its blocks parked, released at once: nothing writes them)
        bm.finish_external(done=[seq_id])
        return bm.allocate(seq_id, toks, **kw), 0

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


def _is_cut(fetch) -> bool:
    """Whether a reserved load holds NULL_BLOCK positions in a group (cut to a sliding window). O(blocks)."""
    return fetch is not None and any(b < 0 for ids in fetch.group_block_ids[1:] for b in ids)
