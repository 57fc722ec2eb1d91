"""Chunked prefill through ``LLM`` (SmolLM2): greedy output equal to the contiguous reference and to the
independent HF reference, with budgets that end chunks mid-block and on block boundaries, a cap on one prompt's
share of a step, prefix hits on a rerun, and preemption (recompute and swap) in the middle of a prefill. Every
plan the scheduler makes is recorded, to show that these situations really happen."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

PROMPTS = [  # (the prompts of test_llm.py: their reference generations are computed once per session)
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575, 282, 4649, 314, 30],
    [1, 520, 9531, 198, 57, 5248],
    list(range(200, 240)),
]


def greedy(max_tokens):
    from pagedkv.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def recording_llm(engine, **kw):
    """An LLM whose scheduler records, per step, the partly prefilled requests before it and its plan."""
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    llm = LLM(engine.paged, **engine_configs(max_num_seqs=8, enable_chunked_prefill=True, **kw))
    sched = llm.scheduler
    llm.steps = []
    schedule = sched.schedule

    def record():
        partial = {s.group.request_id for s in sched._seqs.values() if s.prefill is not None}
        plan = schedule()
        llm.steps.append((partial, plan))
        return plan

    sched.schedule = record
    return llm


def outputs(llm, prompts, n_new):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n_new), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("budget,threshold", [(7, 0), (13, 8)])
def test_chunked_equals_the_reference_mid_block_at_block_edges_and_on_a_rerun(engine, budget, threshold):
    n_new, bs = 8, 4
    expected = [list(engine.reference_greedy(tuple(p), n_new).token_ids) for p in PROMPTS]
    llm = recording_llm(engine, num_gpu_blocks=64, block_size=bs, max_num_batched_tokens=budget,
                        long_prefill_token_threshold=threshold)
    got, hits = outputs(llm, PROMPTS, n_new)
    assert got == expected and hits == [0, 0, 0, 0]
    got, hits = outputs(llm, PROMPTS, n_new)  # the rerun starts from the blocks the chunks cached
    assert got == expected and hits == [(len(p) - 1) // bs * bs for p in PROMPTS]
    chunks = [pw for _, plan in llm.steps for pw in plan.prefills]
    ends = {"mid": 0, "edge": 0}
    for pw in chunks:
        if pw.num_samples == 0:
            ends["edge" if pw.seq_len % bs == 0 else "mid"] += 1
        assert len(pw.token_ids) <= (threshold or budget)
    for _, plan in llm.steps:
        assert plan.num_prefill_tokens + plan.num_decode_seqs <= budget
    assert ends["mid"] > 0 and ends["edge"] > 0, ends
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_a_prefill(engine, mode):
    n_new = 10
    expected = [list(engine.reference_greedy(tuple(p), n_new).token_ids) for p in PROMPTS]
    llm = recording_llm(engine, num_gpu_blocks=14, block_size=4, num_cpu_blocks=32 if mode == "swap" else 0,
                        preemption_mode=mode, max_num_batched_tokens=6)
    got, _ = outputs(llm, PROMPTS, n_new)
    assert got == expected
    mid = [p for partial, plan in llm.steps for p in plan.preempted if p.request_id in partial]
    assert mid and all(p.mode == mode for p in mid), [plan.preempted for _, plan in llm.steps if plan.preempted]
    llm.block_manager.check_invariants()


def test_the_independent_reference_in_chunks_of_five(engine, reference_case):
    """tests/data/smollm2_greedy.json (HF transformers' greedy output) with the prompt prefilled five tokens a
    step (block size 16: every chunk but one ends inside a block)."""
    llm = recording_llm(engine, num_gpu_blocks=32, max_num_batched_tokens=5)
    out = llm.chat(reference_case["messages"], greedy(reference_case["max_tokens"]), use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == reference_case["prompt_ids"]
    assert list(out.outputs[0].token_ids) == reference_case["gen_ids"]
    assert sum(len(plan.prefills) for _, plan in llm.steps) == -(-len(reference_case["prompt_ids"]) // 5)


def test_sliding_window_releases_blocks_between_chunks(engine):
    """A global sliding window of 12 tokens with chunks of 5: each chunk's queries see the last 12 positions,
    which reach into earlier chunks; blocks entirely before every later query's window are released as the
    chunks advance, and the output equals the windowed reference."""
    window = 12
    prompt = PROMPTS[3]  # 40 tokens
    expected = list(engine.reference_greedy(tuple(prompt), 8, window=window).token_ids)
    llm = recording_llm(engine, num_gpu_blocks=32, block_size=4, sliding_window=window, enable_prefix_caching=False,
                        max_num_batched_tokens=5)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(8), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected
    tables = [pw.block_table for _, plan in llm.steps for pw in plan.prefills]
    assert len(tables) == 8 and (tables[-1] == -1).sum() > 0  # released by the window before the last chunk
    assert llm.block_manager.num_free_gpu_blocks == 32
