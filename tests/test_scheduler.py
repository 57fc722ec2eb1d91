"""Scheduler tests against pagedkv's real BlockManager, with a deterministic fake model.

The fake model's next token is a function of (sequence id, position, previous token) only, so a request's output
does not depend on how it was batched, preempted, swapped, recomputed or speculated: every constrained run must
reproduce the outputs of an unconstrained one. Every step also checks the plan against the block manager
(positions, slots, block tables, token counts) and runs ``bm.check_invariants()``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedkv import NULL_BLOCK, BlockManager, CopyKind
from pagedkv.scheduler import (
    FINISH_ABORT,
    FINISH_IGNORED,
    FINISH_LENGTH,
    FINISH_STOP,
    Scheduler,
    StepPlan,
)

VOCAB = 97
EOS = 0


def next_token(seq_id: int, pos: int, last: int, *, allow_eos: bool = False) -> int:
    """Token at position ``pos`` of sequence ``seq_id`` after token ``last``."""
    x = (seq_id * 1_000_003 + pos * 7919 + last * 104_729 + 12345) % 2_147_483_647
    x = (x * 48271) % 2_147_483_647
    if allow_eos:
        return x % VOCAB
    return 1 + x % (VOCAB - 1)


class FakeModel:
    """Samples for a plan; optionally speculative (accepts 0..k drafts, deterministic per position)."""

    def __init__(self, *, spec_k: int = 0, allow_eos: bool = False) -> None:
        self.spec_k = spec_k
        self.allow_eos = allow_eos

    def sample(self, plan: StepPlan) -> list:
        out: list = []
        for pw in plan.prefills:
            last = int(pw.token_ids[-1])
            toks = [next_token(pw.seq_id + k, pw.seq_len, last, allow_eos=self.allow_eos) for k in range(pw.num_samples)]
            out.append(toks if pw.num_samples > 1 else toks[0])
        d = plan.decode
        if d is not None:
            ends = np.cumsum(d.query_lens)
            for j, sid in enumerate(d.seq_ids.tolist()):
                last = int(d.input_tokens[ends[j] - 1])
                pos = int(d.positions[ends[j] - 1]) + 1
                if self.spec_k:
                    acc = (sid * 31 + pos) % (self.spec_k + 1)
                    toks = []
                    for _ in range(acc + 1):
                        last = next_token(sid, pos, last, allow_eos=self.allow_eos)
                        toks.append(last)
                        pos += 1
                    out.append(toks)
                else:
                    out.append(next_token(sid, pos, last, allow_eos=self.allow_eos))
        return out


class EngineTables:
    """An engine's own block tables for ``Scheduler(..., incremental_tables=True)``: whole rows for prefills and
    ``DecodeBatch.table_loads``, then the decode step's ``table_updates`` (docs/engine-contract.md)."""

    def __init__(self) -> None:
        self.t = np.full((4, 4), NULL_BLOCK, dtype=np.int32)
        self.loads = 0  # whole rows loaded by table_loads (forks, swap-ins)

    def _fit(self, rows: int, cols: int) -> None:
        r, c = self.t.shape
        if rows > r or cols > c:
            t = np.full((max(rows, 2 * r), max(cols, 2 * c)), NULL_BLOCK, dtype=np.int32)
            t[:r, :c] = self.t
            self.t = t

    def load(self, row: int, table: np.ndarray) -> None:
        self._fit(row + 1, len(table))
        self.t[row] = NULL_BLOCK
        self.t[row, : len(table)] = table

    def apply(self, plan: StepPlan) -> None:
        for pw in plan.prefills:
            self.load(pw.table_row, pw.block_table)
        if plan.decode is not None:
            for _, row, table in plan.decode.table_loads:
                self.load(row, table)
                self.loads += 1
            upd = plan.decode.result.table_updates
            if upd.rows.size:
                self._fit(int(upd.rows.max()) + 1, int(upd.cols.max()) + 1)
            upd.apply(self.t)


def check_plan(bm: BlockManager, sched: Scheduler, plan: StepPlan, tables: EngineTables | None = None) -> None:
    """The plan is exactly consistent with the block manager (``tables``: the engine's own tables, for a scheduler
    with incremental tables)."""
    bs = bm.block_size
    if sched.incremental_tables:
        tables.apply(plan)
    assert plan.has_forward == bool(plan.prefills or plan.decode is not None)
    copies = len(plan.swap_out) + len(plan.swap_in) + len(plan.copy_on_write)
    assert plan.is_empty == (not plan.has_forward and not copies and not plan.preempted and not plan.ignored)
    if len(plan.swap_in) and len(plan.swap_out):
        assert not set(plan.swap_in[:, 1].tolist()) & set(plan.swap_out[:, 0].tolist())
    if not bm.config.cpu_prefix_cache:  # the copy plan holds exactly the step's swaps and copy-on-writes
        c = plan.copies
        assert len(c) == copies
        for kind, pairs in ((CopyKind.GPU_TO_CPU, plan.swap_out), (CopyKind.CPU_TO_GPU, plan.swap_in),
                            (CopyKind.GPU_TO_GPU, plan.copy_on_write)):
            np.testing.assert_array_equal(c.pairs(kind).reshape(-1, 2), np.asarray(pairs).reshape(-1, 2))
    for pw in plan.prefills:
        L = pw.seq_len
        assert bm.num_tokens(pw.seq_id) == L
        assert len(pw.token_ids) == len(pw.positions) == len(pw.slot_mapping) == L - pw.num_cached_tokens
        np.testing.assert_array_equal(pw.positions, np.arange(pw.num_cached_tokens, L))
        np.testing.assert_array_equal(pw.slot_mapping, bm.slot_mapping(pw.seq_id, pw.num_cached_tokens, L))
        table = bm.block_table(pw.seq_id)
        np.testing.assert_array_equal(pw.block_table, table)
        np.testing.assert_array_equal(pw.slot_mapping // bs, table[pw.positions // bs])
        assert pw.table_row == (int(bm.table_rows([pw.seq_id])[0]) if sched.incremental_tables else None)
        view = sched.sequence(pw.seq_id)
        full = np.concatenate([np.zeros(0, np.int64), pw.token_ids])
        assert view.num_computed == L
        assert len(full) <= L
    d = plan.decode
    if d is not None:
        res = d.result
        B = len(d.seq_ids)
        assert len(d.query_lens) == B and int(d.query_lens.sum()) == len(d.input_tokens) == len(d.positions)
        assert len(res.slot_mapping) == len(d.positions)
        ends = np.cumsum(d.query_lens)
        for j, sid in enumerate(d.seq_ids.tolist()):
            n = bm.num_tokens(sid)
            assert res.seq_lens[j] == n
            q = int(d.query_lens[j])
            pos = d.positions[ends[j] - q : ends[j]]
            # a decode covers the last q positions after the append
            np.testing.assert_array_equal(pos, np.arange(n - q, n))
            table = bm.block_table(sid)
            assert len(table) * bs >= n + d.num_lookahead_slots  # lookahead slots reserved
            if sched.incremental_tables:
                assert res.table_rows[j] == bm.table_rows([sid])[0]
                row = tables.t[res.table_rows[j]]
            else:
                row = res.block_tables[j]
            np.testing.assert_array_equal(row[: len(table)], table)
            assert (row[len(table) :] == NULL_BLOCK).all()
            slots = res.slot_mapping[ends[j] - q : ends[j]]
            np.testing.assert_array_equal(slots, bm.slot_mapping(sid, n - q, n))
            # the input tokens are the ones the scheduler holds at those positions
            view = sched.sequence(sid)
            toks = list(view.output)
            np.testing.assert_array_equal(d.input_tokens[ends[j] - q : ends[j]], toks[n - view.prompt_len - q : n - view.prompt_len])
        assert plan.copy_on_write.shape[1] == 2
        np.testing.assert_array_equal(plan.copy_on_write, res.cow)
    for p in plan.preempted:
        for sid in p.seq_ids:
            if p.mode == "swap":
                assert bm.is_swapped(sid)
            else:
                assert sid not in bm


def drive(sched: Scheduler, bm: BlockManager, model: FakeModel | None = None, *, max_steps: int = 100_000):
    """Run to completion; return ({request_id: RequestOutput}, [plans summary])."""
    model = model or FakeModel(spec_k=sched.num_lookahead_slots)
    tables = sched.test_tables = EngineTables() if sched.incremental_tables else None
    outs = {}
    plans = []
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        check_plan(bm, sched, plan, tables)
        bm.check_invariants()
        for o in sched.update(plan, model.sample(plan)):
            assert o.request_id not in outs
            outs[o.request_id] = o
        bm.check_invariants()
        plans.append(plan)
        steps += 1
        assert steps < max_steps, "the scheduler does not make progress"
    assert len(bm) == 0, "every sequence is freed at the end"
    assert sched.num_running == sched.num_waiting == sched.num_swapped == 0
    return outs, plans


def make_requests(seed: int, count: int, *, min_prompt=3, max_prompt=24, max_out=30, n=1, shared_prefix=()):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(count):
        p = list(shared_prefix) + rng.integers(1, VOCAB, size=int(rng.integers(min_prompt, max_prompt + 1))).tolist()
        reqs.append(dict(request_id=f"r{i}", prompt=p, n=n, max_tokens=int(rng.integers(1, max_out + 1))))
    return reqs


def run(reqs, *, num_gpu_blocks=10_000, block_size=4, num_cpu_blocks=0, prefix_caching=False, mode="recompute",
        max_num_seqs=64, max_num_batched_tokens=64, lookahead=0, eos=None, ignore_eos=True, model=None, namespace=None,
        max_steps=100_000, precheck=True, incremental=False):
    bm = BlockManager(num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      preemption_mode=mode, num_lookahead_slots=lookahead, precheck_append=precheck,
                      incremental_tables=incremental)
    for r in reqs:
        sched.add_request(r["request_id"], r["prompt"], n=r["n"], max_tokens=r["max_tokens"], eos_token_id=eos,
                          ignore_eos=ignore_eos, namespace=r.get("namespace", namespace))
    outs, plans = drive(sched, bm, model, max_steps=max_steps)
    return outs, plans, sched, bm


def outputs(outs):
    return {k: (o.outputs, o.finish_reasons) for k, o in outs.items()}


# --------------------------------------------------------------------------------------------- admission, budgets


def test_fcfs_admission_and_token_budget():
    reqs = [dict(request_id=i, prompt=list(range(1, 11)), n=1, max_tokens=5) for i in range(7)]
    outs, plans, sched, _ = run(reqs, max_num_batched_tokens=25)
    admitted = [[pw.request_id for pw in p.prefills] for p in plans]
    assert admitted[:4] == [[0, 1], [2, 3], [4, 5], [6]]  # 2 prompts of 10 tokens fit in 25, FCFS
    for p in plans:
        assert p.num_prefill_tokens <= 25
    assert all(o.finish_reason == FINISH_LENGTH and len(o.outputs[0]) == 5 for o in outs.values())


def test_max_num_seqs_limits_the_batch():
    reqs = [dict(request_id=i, prompt=[1, 2, 3], n=1, max_tokens=6) for i in range(10)]
    outs, plans, _, _ = run(reqs, max_num_seqs=3)
    for p in plans:
        assert p.num_decode_seqs + len(p.prefills) <= 3
    assert max(p.num_decode_seqs for p in plans) == 3
    assert len(outs) == 10


def test_settings_changed_after_construction_apply_from_the_next_step():
    # the scheduler's settings live in one object its parts read at every step
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8)
    for i in range(4):
        sched.add_request(i, [1, 2, 3], max_tokens=4)
    sched.max_num_seqs = 2
    sched.max_num_batched_tokens = 3
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2, 3)
    plan = sched.schedule()
    assert [pw.request_id for pw in plan.prefills] == [0]  # one prompt of 3 tokens: the budget is full
    sched.update(plan, [5])
    sched.max_num_batched_tokens = 100
    plan = sched.schedule()
    assert [pw.request_id for pw in plan.prefills] == [1] and plan.num_decode_seqs == 1  # max_num_seqs 2
    assert sched.num_running_seqs == 2 and sched.num_waiting == 2


def test_n_counts_against_max_num_seqs():
    reqs = [dict(request_id=i, prompt=[1, 2, 3, 4, 5], n=3, max_tokens=4) for i in range(3)]
    outs, plans, _, _ = run(reqs, max_num_seqs=4)
    assert max(p.num_decode_seqs for p in plans) == 3  # two requests of n=3 never run together
    with pytest.raises(ValueError):
        Scheduler(BlockManager(10, 4), max_num_seqs=2).add_request("x", [1], n=3)


def test_prompt_longer_than_budget_is_admitted_alone():
    reqs = [dict(request_id="short", prompt=[1, 2, 3], n=1, max_tokens=3),
            dict(request_id="long", prompt=list(range(1, 41)), n=1, max_tokens=3),
            dict(request_id="short2", prompt=[4, 5], n=1, max_tokens=3)]
    outs, plans, _, _ = run(reqs, max_num_batched_tokens=16)
    admitted = [[pw.request_id for pw in p.prefills] for p in plans if p.prefills]
    assert admitted == [["short"], ["long"], ["short2"]]
    assert len(outs) == 3


def test_never_prompt_is_ignored_and_others_run():
    # 10 blocks of 4 tokens, watermark 0: a 60-token prompt can never fit
    reqs = [dict(request_id="a", prompt=[1, 2, 3], n=1, max_tokens=3),
            dict(request_id="huge", prompt=list(range(1, 61)), n=1, max_tokens=3),
            dict(request_id="b", prompt=[4, 5], n=1, max_tokens=3)]
    outs, plans, _, _ = run(reqs, num_gpu_blocks=10)
    assert outs["huge"].finish_reason == FINISH_IGNORED and outs["huge"].outputs == ((),)
    assert outs["huge"].error
    assert outs["a"].finish_reason == outs["b"].finish_reason == FINISH_LENGTH
    assert sum(len(p.ignored) for p in plans) == 1


def test_a_request_too_big_to_grow_ends_ignored_instead_of_looping():
    # fits as a prompt, but its 3 + 100 tokens can never fit in 8 blocks of 4
    reqs = [dict(request_id="x", prompt=[1, 2, 3], n=1, max_tokens=100)]
    outs, _, _, _ = run(reqs, num_gpu_blocks=8)
    o = outs["x"]
    assert o.finish_reason == FINISH_IGNORED
    assert 20 <= len(o.outputs[0]) < 100  # it generated as long as it could


# --------------------------------------------------------------------------------------------------- stopping


def test_stop_on_eos_and_max_tokens():
    model = FakeModel(allow_eos=True)
    reqs = make_requests(1, 40, max_out=40)
    outs, _, _, _ = run(reqs, eos=EOS, ignore_eos=False, model=model)
    saw_stop = False
    for r in reqs:
        o = outs[r["request_id"]]
        toks = o.outputs[0]
        assert EOS not in toks[:-1]
        if o.finish_reason == FINISH_STOP:
            saw_stop = True
            assert toks[-1] == EOS and len(toks) <= r["max_tokens"]
        else:
            assert o.finish_reason == FINISH_LENGTH and len(toks) == r["max_tokens"]
    assert saw_stop
    # ignore_eos: every request runs to max_tokens
    outs2, _, _, _ = run(reqs, eos=EOS, ignore_eos=True, model=model)
    for r in reqs:
        assert len(outs2[r["request_id"]].outputs[0]) == r["max_tokens"]
        assert outs2[r["request_id"]].finish_reason == FINISH_LENGTH


def test_stop_inside_accepted_speculative_tokens_truncates():
    reqs = make_requests(2, 30, max_out=25)
    model = FakeModel(spec_k=3, allow_eos=True)
    outs, _, _, _ = run(reqs, lookahead=3, eos=EOS, ignore_eos=False, model=model)
    ref, _, _, _ = run(reqs, eos=EOS, ignore_eos=False, model=FakeModel(allow_eos=True))
    assert outputs(outs) == outputs(ref)
    for r in reqs:
        assert len(outs[r["request_id"]].outputs[0]) <= r["max_tokens"]


def test_first_decode_inputs_the_prefill_sample():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    sched.add_request("r", [5, 6, 7, 8, 9], max_tokens=4)
    p1 = sched.schedule()
    (pw,) = p1.prefills
    assert pw.num_cached_tokens == 0 and pw.seq_len == 5 and p1.decode is None
    sched.update(p1, [42])
    p2 = sched.schedule()
    assert not p2.prefills
    np.testing.assert_array_equal(p2.decode.input_tokens, [42])
    np.testing.assert_array_equal(p2.decode.positions, [5])
    assert bm.num_tokens(pw.seq_id) == 6
    sched.update(p2, [43])
    p3 = sched.schedule()
    np.testing.assert_array_equal(p3.decode.input_tokens, [43])
    np.testing.assert_array_equal(p3.decode.positions, [6])
    assert sched.update(p3, [44]) == []
    p4 = sched.schedule()
    (out,) = sched.update(p4, [45])
    assert out.outputs == ((42, 43, 44, 45),) and out.finish_reason == FINISH_LENGTH


# ------------------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_recompute_preemption_gives_unconstrained_outputs(prefix_caching):
    reqs = make_requests(3, 24)
    ref, _, _, _ = run(reqs)
    outs, plans, sched, bm = run(reqs, num_gpu_blocks=24, prefix_caching=prefix_caching)
    assert sched.stats.recompute_preemptions > 0
    assert any(p.mode == "recompute" for pl in plans for p in pl.preempted)
    assert outputs(outs) == outputs(ref)
    assert any(o.num_preemptions for o in outs.values())


def test_recompute_victim_is_most_recent_and_returns_to_front():
    reqs = [dict(request_id=i, prompt=[1 + i, 2, 3, 4], n=1, max_tokens=12) for i in range(4)]
    outs, plans, _, _ = run(reqs, num_gpu_blocks=9)
    pre = [p for pl in plans for p in pl.preempted]
    assert pre and pre[0].request_id == 3  # the last admitted goes first
    # after its preemption the next admission is the preempted request (front of the queue)
    i = next(k for k, pl in enumerate(plans) if pl.preempted)
    nxt = next(pl for pl in plans[i + 1 :] if pl.prefills)
    assert nxt.prefills[0].request_id == pre[-1].request_id
    # its new prompt is prompt + generated tokens
    assert nxt.prefills[0].seq_len > 4


def test_swap_preemption_gives_unconstrained_outputs():
    reqs = make_requests(4, 24)
    ref, _, _, _ = run(reqs)
    outs, plans, sched, bm = run(reqs, num_gpu_blocks=24, num_cpu_blocks=200, mode="swap")
    assert sched.stats.swap_outs > 0 and sched.stats.swap_ins > 0 and sched.stats.recompute_preemptions == 0
    assert sum(len(p.swap_out) for p in plans) == sched.stats.swapped_out_blocks > 0
    assert sum(len(p.swap_in) for p in plans) > 0
    assert outputs(outs) == outputs(ref)


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    reqs = make_requests(5, 24)
    ref, _, _, _ = run(reqs)
    outs, _, sched, _ = run(reqs, num_gpu_blocks=24, num_cpu_blocks=6, mode="swap")
    assert sched.stats.recompute_preemptions > 0
    assert outputs(outs) == outputs(ref)


def test_swapped_requests_come_back_before_new_admissions():
    reqs = make_requests(6, 30)
    bm = BlockManager(24, 4, num_cpu_blocks=500)
    sched = Scheduler(bm, preemption_mode="swap", max_num_batched_tokens=64)
    for r in reqs:
        sched.add_request(r["request_id"], r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True)
    model = FakeModel()
    saw_swapped = False
    while sched.has_unfinished():
        plan = sched.schedule()
        check_plan(bm, sched, plan)
        if plan.prefills:
            assert sched.num_swapped == 0, "no admission while requests are swapped out"
        if plan.preempted:
            assert not plan.prefills and not len(plan.swap_in), "no admission or swap-in in a step that preempts"
        saw_swapped |= sched.num_swapped > 0
        sched.update(plan, model.sample(plan))
        bm.check_invariants()
    assert saw_swapped


# --------------------------------------------------------------------------------------------- parallel sampling


def test_parallel_sampling_forks_and_copies_on_write():
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a partial one of 2 tokens (block size 4)
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    sched.add_request("r", prompt, n=3, max_tokens=6)
    p1 = sched.schedule()
    (pw,) = p1.prefills
    assert pw.num_samples == 3 and pw.sample_index == 0
    sched.update(p1, [[11, 12, 13]])
    assert len(bm) == 3
    tables = [bm.block_table(s) for s in range(pw.seq_id, pw.seq_id + 3)]
    for t in tables[1:]:
        np.testing.assert_array_equal(t, tables[0])  # the samples share the prompt's blocks
    p2 = sched.schedule()
    assert len(p2.copy_on_write) == 2  # two writers copy the shared partial block, the last keeps it
    np.testing.assert_array_equal(p2.decode.input_tokens, [11, 12, 13])
    bm.check_invariants()
    outs = sched.update(p2, [1, 2, 3])
    assert not outs
    model = FakeModel()
    while sched.has_unfinished():
        plan = sched.schedule()
        outs = sched.update(plan, model.sample(plan)) or outs
    (o,) = outs
    assert [t[:2] for t in o.outputs] == [(11, 1), (12, 2), (13, 3)]
    assert all(len(t) == 6 for t in o.outputs)


@pytest.mark.parametrize("mode,cpu,blocks", [("swap", 400, 40), ("recompute", 0, 40), ("swap", 8, 40)])
def test_parallel_sampling_under_preemption_gives_unconstrained_outputs(mode, cpu, blocks):
    reqs = make_requests(7, 10, max_prompt=14, max_out=20, n=3)
    ref, _, _, _ = run(reqs)
    outs, plans, sched, _ = run(reqs, num_gpu_blocks=blocks, num_cpu_blocks=cpu, mode=mode)
    assert sched.stats.preemptions > 0
    assert sched.stats.forks > 0 and sched.stats.copy_on_writes > 0
    # a preempted request is preempted as a unit: all of its live samples
    for pl in plans:
        for p in pl.preempted:
            assert len(p.seq_ids) == len({sid // 1 for sid in p.seq_ids}) >= 1
    for k, o in outs.items():
        if o.finish_reason != FINISH_IGNORED:
            assert (o.outputs, o.finish_reasons) == (ref[k].outputs, ref[k].finish_reasons)
    assert sum(o.finish_reason != FINISH_IGNORED for o in outs.values()) >= 8


def test_parallel_samples_finish_independently():
    model = FakeModel(allow_eos=True)
    reqs = make_requests(8, 20, max_out=30, n=4)
    outs, _, _, _ = run(reqs, eos=EOS, ignore_eos=False, model=model)
    for r in reqs:
        o = outs[r["request_id"]]
        assert len(o.outputs) == 4
        for toks, why in zip(o.outputs, o.finish_reasons):
            assert (why == FINISH_STOP and toks[-1] == EOS) or (why == FINISH_LENGTH and len(toks) == r["max_tokens"])


# ------------------------------------------------------------------------------------------------ lookahead


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_decoding_matches_plain_decoding(k):
    reqs = make_requests(9, 20, max_out=40)
    ref, _, _, _ = run(reqs)
    outs, plans, sched, _ = run(reqs, lookahead=k)
    assert outputs(outs) == outputs(ref)
    ragged = [pl for pl in plans if pl.decode is not None and len(set(pl.decode.query_lens.tolist())) > 1]
    assert ragged, "some steps append a different number of tokens per sequence"
    assert max(int(pl.decode.query_lens.max()) for pl in plans if pl.decode is not None) == k + 1
    assert sum(len(pl.decode.seq_ids) for pl in plans if pl.decode is not None) < sum(
        len(o.outputs[0]) for o in outs.values())  # fewer decode slots than tokens: speculation helped


@pytest.mark.parametrize("mode,cpu", [("recompute", 0), ("swap", 300)])
def test_speculative_decoding_under_preemption(mode, cpu):
    reqs = make_requests(10, 20, max_out=40)
    ref, _, _, _ = run(reqs)
    outs, _, sched, _ = run(reqs, lookahead=3, num_gpu_blocks=30, num_cpu_blocks=cpu, mode=mode)
    assert sched.stats.preemptions > 0
    assert outputs(outs) == outputs(ref)


def test_update_rejects_too_many_accepted_tokens():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm, num_lookahead_slots=2)
    sched.add_request("r", [1, 2, 3], max_tokens=20)
    p = sched.schedule()
    sched.update(p, [4])
    p = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(p, [[5, 6, 7, 8]])


# ------------------------------------------------------------------------------------------------ prefix caching


def test_prefix_cache_hits_and_namespaces():
    prefix = list(range(1, 33))  # 8 full blocks of 4
    reqs = make_requests(11, 12, shared_prefix=prefix, max_out=8)
    outs, plans, sched, bm = run(reqs, prefix_caching=True, max_num_batched_tokens=60)
    ref, _, _, _ = run(reqs)
    assert outputs(outs) == outputs(ref)
    hits = [outs[r["request_id"]].num_cached_tokens for r in reqs]
    assert hits[0] == 0 and max(hits) >= 32 and sum(h > 0 for h in hits) >= 10
    assert sched.stats.cached_tokens == sum(pw.num_cached_tokens for pl in plans for pw in pl.prefills)
    # every request in its own namespace: no sharing at all
    for i, r in enumerate(reqs):
        r["namespace"] = f"tenant{i}"
    outs2, _, sched2, _ = run(reqs, prefix_caching=True, max_num_batched_tokens=60)
    assert sched2.stats.cached_tokens == 0
    assert outputs(outs2) == outputs(ref)


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(100, 4, enable_prefix_caching=True)
    sched = Scheduler(bm)
    model = FakeModel()
    prompt = list(range(1, 9))  # exactly two blocks
    sched.add_request("a", prompt, max_tokens=3)
    drive(sched, bm, model)
    sched.add_request("b", prompt, max_tokens=3)
    p = sched.schedule()
    (pw,) = p.prefills
    assert 0 <= pw.num_cached_tokens < 8 and len(pw.token_ids) >= 1 and pw.positions[-1] == 7


# --------------------------------------------------------------------------------------------------- API misuse


def test_schedule_update_must_alternate_and_sampled_length_is_checked():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    sched.add_request("r", [1, 2, 3], max_tokens=5)
    p = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.update(p, [1, 2])
    p_other = p._replace(step=99)
    with pytest.raises(RuntimeError):
        sched.update(p_other, [1])
    with pytest.raises(ValueError):
        sched.add_request("r", [1])
    with pytest.raises(ValueError):
        sched.add_request("empty", [])
    with pytest.raises(ValueError):
        Scheduler(bm, preemption_mode="drop")


def test_abort_frees_everything():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    model = FakeModel()
    for i in range(4):
        sched.add_request(i, [1, 2, 3, 4, 5], n=2, max_tokens=50)
    for _ in range(3):
        p = sched.schedule()
        sched.update(p, model.sample(p))
    o = sched.abort_request(0)
    assert o.finish_reason == FINISH_ABORT and len(o.outputs) == 2
    p = sched.schedule()  # abort between schedule and update
    assert sched.abort_request(1).finish_reason == FINISH_ABORT
    sched.update(p, model.sample(p))
    bm.check_invariants()
    assert sched.abort_request("nope") is None
    for rid in (2, 3):
        sched.abort_request(rid)
    assert not sched.has_unfinished() and len(bm) == 0
    bm.check_invariants()


def test_numpy_sampled_array_is_accepted():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    for i in range(3):
        sched.add_request(i, [1, 2, 3], max_tokens=2)
    p = sched.schedule()
    sched.update(p, np.array([7, 8, 9]))
    p = sched.schedule()
    done = sched.update(p, np.array([1, 2, 3]))
    assert sorted(o.outputs[0] for o in done) == [(7, 1), (8, 2), (9, 3)]


# ------------------------------------------------------------------------------------------------ property test


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 12),
    n=st.integers(1, 3),
    blocks=st.integers(12, 60),
    mode=st.sampled_from(["recompute", "swap"]),
    cpu=st.sampled_from([0, 10, 400]),
    lookahead=st.sampled_from([0, 0, 2]),
    prefix=st.booleans(),
    budget=st.sampled_from([8, 32, 256]),
    max_seqs=st.sampled_from([3, 8, 64]),
    incremental=st.booleans(),
)
def test_random_workloads_match_unconstrained_run(seed, count, n, blocks, mode, cpu, lookahead, prefix, budget, max_seqs,
                                                  incremental):
    n = min(n, max_seqs)
    reqs = make_requests(seed, count, max_prompt=16, max_out=24, n=n,
                         shared_prefix=list(range(1, 9)) if prefix else ())
    ref, _, _, _ = run(reqs)
    outs, _, _, _ = run(reqs, num_gpu_blocks=blocks, num_cpu_blocks=cpu, mode=mode, lookahead=lookahead,
                        prefix_caching=prefix, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_steps=3000,
                        incremental=incremental)
    assert outs.keys() == ref.keys()
    for k, o in outs.items():
        if o.finish_reason == FINISH_IGNORED:
            continue  # did not fit this pool (checked below for single prompts)
        assert (o.outputs, o.finish_reasons) == (ref[k].outputs, ref[k].finish_reasons)
    for r in reqs:
        if outs[r["request_id"]].finish_reason == FINISH_IGNORED and r["n"] == 1:
            need = -(-(len(r["prompt"]) + r["max_tokens"] - 1 + lookahead) // 4)
            assert need > blocks  # only a request that can never fit is ignored


@pytest.mark.parametrize("mode,cpu,lookahead,precheck", [("swap", 400, 0, True), ("swap", 400, 2, False),
                                                         ("recompute", 0, 0, True)])
def test_incremental_tables_keep_the_engine_tables_exact(mode, cpu, lookahead, precheck):
    """With incremental tables the engine's own tables equal the manager's at every step (check_plan), through
    forks, swaps, preemption and lookahead, and the outputs are the unconstrained run's."""
    reqs = make_requests(7, 12, max_prompt=20, max_out=30, n=2, shared_prefix=list(range(1, 9)))
    ref, _, _, _ = run(reqs)
    outs, plans, sched, _ = run(reqs, num_gpu_blocks=40, num_cpu_blocks=cpu, mode=mode, lookahead=lookahead,
                                prefix_caching=True, precheck=precheck, incremental=True)
    assert outputs(outs) == outputs(ref)
    assert all(type(p.decode.result).__name__ == "StepDelta" for p in plans if p.decode is not None)
    assert sched.test_tables.loads > 0  # forked samples (and swapped-in sequences) were loaded whole
    if mode == "swap":
        assert any(p.preempted for p in plans) and any(len(p.swap_in) for p in plans)
    assert not sched._row_loads  # nothing left pending once every request finished


def test_incremental_tables_need_a_manager_with_table_rows():
    class NoRows:
        table_rows = None

    with pytest.raises(ValueError, match="table_rows"):
        Scheduler(NoRows(), incremental_tables=True)


def test_finish_sequence_stops_one_sample():
    bm = BlockManager(100, 4)
    sched = Scheduler(bm)
    model = FakeModel()
    sched.add_request("r", [1, 2, 3, 4, 5], n=2, max_tokens=50)
    p = sched.schedule()
    sched.update(p, model.sample(p))
    p = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.finish_sequence(p.decode.seq_ids[0])
    sched.update(p, model.sample(p))
    a, b = p.decode.seq_ids.tolist()
    assert sched.finish_sequence(b) is None  # sample 0 still runs
    assert b not in bm and len(bm) == 1
    assert sched.finish_sequence(b) is None  # already finished
    p = sched.schedule()
    assert p.decode.seq_ids.tolist() == [a]
    sched.update(p, model.sample(p))
    out = sched.finish_sequence(a, FINISH_STOP)
    assert out is not None and out.finish_reasons == (FINISH_STOP, FINISH_STOP)
    assert len(out.outputs[0]) == 3 and len(out.outputs[1]) == 2
    assert not sched.has_unfinished() and len(bm) == 0
    bm.check_invariants()


@pytest.mark.parametrize("mode,cpu,lookahead,n", [("recompute", 0, 0, 1), ("swap", 300, 0, 2), ("recompute", 0, 3, 1)])
def test_without_precheck_decode_step_failure_preempts(mode, cpu, lookahead, n):
    """precheck_append=False relies on decode_step being all-or-nothing: same outputs, same preemptions."""
    reqs = make_requests(12, 20, max_out=30, n=n)
    ref, _, _, _ = run(reqs)
    a, _, sa, _ = run(reqs, num_gpu_blocks=36, num_cpu_blocks=cpu, mode=mode, lookahead=lookahead)
    b, _, sb, _ = run(reqs, num_gpu_blocks=36, num_cpu_blocks=cpu, mode=mode, lookahead=lookahead, precheck=False)
    assert sb.stats.preemptions > 0
    assert outputs(b) == outputs(a)
    for k, o in b.items():
        if o.finish_reason != FINISH_IGNORED:
            assert o.outputs == ref[k].outputs
    if lookahead == 0:
        assert sb.stats.preemptions == sa.stats.preemptions


def test_swap_in_with_nothing_running_decodes_in_the_same_step():
    bm = BlockManager(12, 4, num_cpu_blocks=100)
    sched = Scheduler(bm, preemption_mode="swap")
    model = FakeModel()
    sched.add_request("long", [1, 2, 3, 4], max_tokens=6)
    sched.add_request("b", [5, 6, 7, 8], max_tokens=30)
    sched.add_request("c", [9, 10, 11, 12], max_tokens=30)
    saw = False
    while sched.has_unfinished():
        plan = sched.schedule()
        check_plan(bm, sched, plan)
        if len(plan.swap_in):
            assert plan.has_forward
            if plan.decode is not None:
                saw |= plan.num_decode_seqs > 0
        sched.update(plan, model.sample(plan))
        bm.check_invariants()
    assert sched.stats.swap_ins > 0 and saw


class _NoPlan:
    """A block manager without take_copy_plan (as another project's adapter): the scheduler orders the copies."""

    def __init__(self, bm):
        self._bm = bm

    def __getattr__(self, name):
        if name == "take_copy_plan":
            raise AttributeError(name)
        return getattr(self._bm, name)


def test_scheduler_orders_the_copies_of_a_manager_without_a_plan():
    reqs = make_requests(7, 12, max_out=20, n=2)
    plans = {}
    for wrap in (False, True):
        bm = BlockManager(24, 4, num_cpu_blocks=64)
        sched = Scheduler(_NoPlan(bm) if wrap else bm, max_num_seqs=8, preemption_mode="swap")
        for r in reqs:
            sched.add_request(r["request_id"], r["prompt"], n=r["n"], max_tokens=r["max_tokens"], ignore_eos=True)
        plans[wrap] = [(p.copies.src.tolist(), p.copies.dst.tolist(), p.copies.kind.tolist())
                       for p in drive(sched, bm)[1]]
    assert plans[False] == plans[True]
    kinds = {k for _, _, ks in plans[True] for k in ks}
    assert kinds == {0, 1, 2}  # swaps both ways and copy-on-write happened
