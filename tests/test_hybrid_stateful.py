"""Stateful property test of HybridBlockManager against a simple reference model, check_invariants() after every
step.

The model keeps each live sequence's tokens, table length, swap state and whether it was handed slots in the
current step. From it follow, without looking inside the manager: which calls succeed or which exception they
raise (unknown, duplicate, swapped, same-step refusals), token counts, every group's table length, that a
full-attention group's table never holds NULL_BLOCK while a sliding group's holds it only before every future
query's window, and that a refused call changes nothing (every group's tables, free counts, cached blocks).
``lookup_prefix`` must predict ``allocate`` exactly (hit and blocks consumed), and ``can_append_slots`` must
predict whether ``decode_step`` fits. Admissions are often chunked prefills (``num_new_tokens=``: the sequence
holds the hit plus one chunk, the rest comes by multi-token ``decode_step``; fork refused until then). The KV content itself is checked by tests/test_kv_content.py's hybrid runs.

More examples: PAGEDKV_STATEFUL_EXAMPLES=2000 PAGEDKV_STATEFUL_STEPS=80 pytest tests/test_hybrid_stateful.py
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import NULL_BLOCK, AllocStatus, FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import (DuplicateSequenceError, OutOfBlocksError, PromptTooLongError, SequenceStateError,
                            UnknownSequenceError)

EXAMPLES = int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "60"))
STEPS = int(os.environ.get("PAGEDKV_STATEFUL_STEPS", "40"))
BS = 4
VOCAB = st.integers(0, 2)
PROMPT = st.lists(VOCAB, min_size=1, max_size=22)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HybridMachine(RuleBasedStateMachine):
    cache = True

    @initialize(groups=st.lists(st.one_of(st.none(), st.integers(1, 14)), min_size=1, max_size=4),
                pool=st.integers(6, 40), cpu=st.integers(0, 24), tier=st.booleans(), small=st.booleans())
    def setup(self, groups, pool, cpu, tier, small):
        self.windows = groups
        self.G = len(groups)
        tier = tier and self.cache and cpu > 0
        self.m = BlockManager(
            pool, BS, kv_cache_groups=[FullAttentionSpec() if w is None else SlidingWindowSpec(w) for w in groups],
            num_cpu_blocks=cpu, enable_prefix_caching=self.cache, cpu_prefix_cache=tier, watermark=0,
            enable_kv_events=self.cache, grouped_results=True)
        if not small:
            self.m._step.small_batch = 0  # every batch takes the numpy step
        self.seqs: dict = {}  # seq -> [tokens, table length, swapped]
        self.rest: dict = {}  # chunked prefill: seq -> the prompt tokens not appended yet (never empty)
        self.touched: set = set()
        self.stepping = False
        self.next_id = 0

    # ------------------------------------------------------------------ helpers
    def snap(self):
        m = self.m
        return (m.num_free_gpu_blocks, m.stats.num_free_cpu_blocks, m.stats.num_cached_blocks,
                {s: (m.num_tokens(s), m.is_swapped(s), [m.block_table(s, g).tolist() for g in range(self.G)])
                 for s in m.seq_ids}, [dict(g._t.partial) for g in m._g])

    def live(self, swapped=False):
        return sorted(s for s, v in self.seqs.items() if v[2] == swapped)

    def _new(self, seq, toks, la):
        self.seqs[seq] = [list(toks), cdiv(len(toks) + la, BS), False]
        self.touched.add(seq)

    # ------------------------------------------------------------------ rules
    @rule(toks=PROMPT, la=st.sampled_from([0, 0, 1, 3]), ns=st.sampled_from([None, None, "t"]),
          chunk=st.one_of(st.none(), st.integers(1, 9)))
    def allocate(self, toks, la, ns, chunk):
        m = self.m
        seq = self.next_id
        self.next_id += 1
        hit = m.lookup_prefix(toks, la, namespace=ns, num_new_tokens=chunk)
        status = m.can_allocate(toks, la, namespace=ns, num_new_tokens=chunk)
        before = self.snap()
        try:
            got = m.allocate(seq, toks, la, namespace=ns, num_new_tokens=chunk)
        except PromptTooLongError:
            assert self.G * cdiv(len(toks) + la, BS) > m.config.num_gpu_blocks and status == AllocStatus.NEVER
            assert self.snap() == before
            return
        except OutOfBlocksError:
            assert hit.num_new_blocks > before[0] and status == AllocStatus.LATER
            assert self.snap() == before
            return
        assert status == AllocStatus.OK
        assert got == hit.num_cached_tokens and got % BS == 0 and got < len(toks)
        assert before[0] - m.num_free_gpu_blocks == hit.num_new_blocks
        held = len(toks) if chunk is None else min(len(toks), got + chunk)
        assert m.num_tokens(seq) == held
        for g, w in enumerate(self.windows):
            t = m.block_table(seq, g)
            assert len(t) == cdiv(held + la, BS)
            nnull = 0 if w is None or not got else max(0, got - w + 1) // BS  # (the window (L - W, L) only)
            assert (t[:nnull] == NULL_BLOCK).all() and (t[nnull:] >= 0).all()
        if m.config.enable_prefix_caching:  # findability: every full block the call holds is found (issue 23 A)
            want = min(held // BS, (len(toks) - 1) // BS) * BS
            assert m.lookup_prefix(toks, namespace=ns).num_cached_tokens >= want
        self._new(seq, toks[:held], la)
        if held < len(toks):
            self.rest[seq] = list(toks[held:])

    @rule(ps=st.lists(PROMPT, min_size=1, max_size=3), data=st.data())
    def allocate_batch(self, ps, data):
        m = self.m
        ids = list(range(self.next_id, self.next_id + len(ps)))
        self.next_id += len(ps)
        chunks = data.draw(st.one_of(st.none(), st.lists(st.integers(1, 9), min_size=len(ps), max_size=len(ps))))
        before = self.snap()
        try:
            pb = m.allocate_batch(ids, ps, num_new_tokens=chunks)
        except OutOfBlocksError:
            assert self.snap() == before
            return
        held = [len(p) if chunks is None else min(len(p), int(h) + c)
                for p, h, c in zip(ps, pb.num_cached_tokens, chunks or [0] * len(ps))]
        assert pb.seq_lens.tolist() == held
        assert pb.slot_mapping.shape == (self.G, sum(held) - int(pb.num_cached_tokens.sum()))
        for s, p, n in zip(ids, ps, held):
            self._new(s, p[:n], 0)
            if n < len(p):
                self.rest[s] = list(p[n:])

    @rule(data=st.data())
    def prefill(self, data):
        """The next chunk of some partly prefilled prompts: one multi-token decode_step."""
        cand = [s for s in self.live() if s in self.rest]
        if not cand:
            return
        batch = data.draw(st.lists(st.sampled_from(cand), min_size=1, max_size=len(cand), unique=True))
        counts = [min(len(self.rest[s]), data.draw(st.integers(1, 9))) for s in batch]
        flat = [t for s, c in zip(batch, counts) for t in self.rest[s][:c]]
        before = self.snap()
        try:
            r = self.m.decode_step(batch, np.array(flat), num_new_tokens=np.array(counts))
        except OutOfBlocksError:
            assert self.snap() == before
            return
        assert r.slot_mapping.shape == (self.G, sum(counts))
        pos = 0
        for s, c in zip(batch, counts):
            v = self.seqs[s]
            n = len(v[0])
            for g in range(self.G):
                assert r.slot_mapping[g, pos : pos + c].tolist() == self.m.slot_mapping(s, n, n + c, g).tolist()
            pos += c
            v[0] += self.rest[s][:c]
            del self.rest[s][:c]
            if not self.rest[s]:
                del self.rest[s]
            v[1] = max(v[1], cdiv(len(v[0]), BS))
            self.touched.add(s)

    @rule(data=st.data(), la=st.sampled_from([0, 0, 1, 2]), k=st.sampled_from([1, 1, 2]))
    def decode(self, data, la, k):
        live = [s for s in self.live() if s not in self.rest]  # (a partly prefilled prompt gets chunks instead)
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        toks = [[1] * k for _ in batch]
        fits = self.m.can_append_slots(batch, la, num_new_tokens=k)
        before = self.snap()
        try:
            r = self.m.decode_step(batch, np.array([t[0] for t in toks]) if k == 1 else toks, la)
        except OutOfBlocksError:
            assert not fits and self.snap() == before
            return
        assert fits
        assert r.slot_mapping.shape == (self.G, k * len(batch)) and len(r.block_tables) == self.G
        for s, t in zip(batch, toks):
            v = self.seqs[s]
            v[0] += t
            v[1] = max(v[1], cdiv(len(v[0]) + la, BS))
            self.touched.add(s)
        assert r.seq_lens.tolist() == [len(self.seqs[s][0]) for s in batch]

    @rule(data=st.data())
    def fork(self, data):
        live = list(self.seqs)
        if not live:
            return
        p = data.draw(st.sampled_from(live))
        c = self.next_id
        self.next_id += 1
        before = self.snap()
        try:
            self.m.fork(p, c)
        except SequenceStateError:  # (refused in every group or in none)
            assert (p in self.rest or self.stepping and p in self.touched) and self.snap() == before
            return
        assert not (self.stepping and p in self.touched) and p not in self.rest
        v = self.seqs[p]
        self.seqs[c] = [list(v[0]), v[1], v[2]]

    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        if not self.seqs:
            with_unknown = self.next_id + 100
            try:
                self.m.free(with_unknown)
            except UnknownSequenceError:
                return
            raise AssertionError("freeing an unknown sequence did not raise")
        s = data.draw(st.sampled_from(sorted(self.seqs)))
        before = self.snap()
        try:
            self.m.free(s, cache=cache)
        except SequenceStateError:
            # cache=False: others hold its unwritten blocks; cache=True: it was handed slots in this step (issue 23 B)
            assert (not cache or (self.m.config.enable_prefix_caching and self.stepping and s in self.touched)) \
                and self.snap() == before
            return
        if cache and self.m.config.enable_prefix_caching:
            assert not (self.stepping and s in self.touched), "free of a sequence handed slots in this step passed"
        del self.seqs[s]
        self.rest.pop(s, None)

    @rule(data=st.data())
    def swap_out(self, data):
        live = self.live()
        if not live:
            return
        s = data.draw(st.sampled_from(live))
        before = self.snap()
        try:
            self.m.swap_out([s])
        except SequenceStateError:
            assert self.stepping and s in self.touched and self.snap() == before
            return
        except OutOfBlocksError:
            assert self.snap() == before
            return
        self.seqs[s][2] = True

    @rule(data=st.data())
    def swap_in(self, data):
        sw = self.live(swapped=True)
        if not sw:
            return
        s = data.draw(st.sampled_from(sw))
        before = self.snap()
        try:
            self.m.swap_in([s])
        except OutOfBlocksError:
            assert self.snap() == before
            return
        self.seqs[s][2] = False

    @rule()
    def step(self):
        self.m.take_copy_plan()
        self.m.events.take()
        self.touched.clear()
        self.stepping = True

    @precondition(lambda self: self.cache)
    @rule()
    def reset(self):
        self.m.reset_prefix_cache()
        assert self.m.stats.num_cached_blocks == 0

    @rule()
    def duplicate(self):
        if self.seqs:
            s = next(iter(self.seqs))
            try:
                self.m.allocate(s, [1])
            except DuplicateSequenceError:
                return
            raise AssertionError("a duplicate allocate did not raise")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()
        assert set(m.seq_ids) == set(self.seqs)
        for s, rest in self.rest.items():  # every group records the prompt length of a partly prefilled sequence
            assert all(g._t.partial.get(s) == len(self.seqs[s][0]) + len(rest) for g in m._g)
        for s, (toks, nblk, swapped) in self.seqs.items():
            n = len(toks)
            assert m.num_tokens(s) == n and m.is_swapped(s) == swapped
            for g, w in enumerate(self.windows):
                t = m.block_table(s, g)
                assert len(t) == nblk
                live = t >= 0
                if w is None:
                    assert live.all()
                else:  # NULL only before the window, and the window is held
                    first = int(np.argmax(live)) if live.any() else len(t)
                    assert live[first:].all() and first * BS <= max(n - w, 0)


class HybridNoCacheMachine(HybridMachine):
    cache = False


_settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
HybridMachine.TestCase.settings = _settings
HybridNoCacheMachine.TestCase.settings = _settings
TestHybridCache = HybridMachine.TestCase
TestHybridNoCache = HybridNoCacheMachine.TestCase
