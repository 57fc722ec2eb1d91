"""The paged engine end to end: greedy output through LLM equals the contiguous reference, token for token,
under prefix caching, preemption (recompute and swap), parallel sampling with copy-on-write, lookahead slots
and a sliding window."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

GREEDY = None


def greedy(max_tokens, n=1):
    from pagedkv.engine.sampling import SamplingParams

    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(engine, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    kw.setdefault("max_num_seqs", 8)
    return LLM(engine.paged, **engine_configs(**kw))


def ids(out, i=0):
    return list(out.outputs[i].token_ids)


PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575, 282, 4649, 314, 30],
    [1, 520, 9531, 198, 57, 5248],
    list(range(200, 240)),
]


def test_reference_json_through_the_paged_engine(engine, reference_case):
    llm = make_llm(engine, num_gpu_blocks=32)
    out = llm.chat(reference_case["messages"], greedy(reference_case["max_tokens"]), use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == reference_case["prompt_ids"]
    assert ids(out) == reference_case["gen_ids"]
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("fast", [True, False], ids=["fast-lm-head", "float32-lm-head"])
def test_fast_lm_head_gives_the_reference_and_is_used(engine, reference_case, fast):
    """The exact fast LM head (on by default) and the float32 one give the reference's greedy tokens, and the
    fast one really runs (no float32 fallback for greedy rows): one greedy row takes the quantized table's float32
    products where the kernels are built (the tied Q8_0 table), the bf16 product otherwise."""
    head = engine.paged.head
    before = dict(head.stats)
    llm = make_llm(engine, num_gpu_blocks=32, fast_lm_head=fast)
    assert llm.fast_lm_head is fast
    out = llm.chat(reference_case["messages"], greedy(reference_case["max_tokens"]), use_tqdm=False)[0]
    assert ids(out) == reference_case["gen_ids"]
    path = "quantized" if head.quantized is not None else "bf16"
    steps = head.stats[path] - before[path]
    assert steps == (reference_case["max_tokens"] if fast else 0)
    assert head.stats["bf16"] + head.stats["quantized"] - before["bf16"] - before["quantized"] == steps
    assert head.stats["exact"] - before["exact"] == (0 if fast else reference_case["max_tokens"])
    assert head.stats["fallback_rows"] == before["fallback_rows"]


def test_batch_of_mixed_lengths_and_prefix_cache_rerun(engine):
    n_new = 8
    expected = [engine.reference_greedy(tuple(p), n_new).token_ids for p in PROMPTS]
    llm = make_llm(engine, num_gpu_blocks=64, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(n_new), use_tqdm=False)
    assert [ids(o) for o in outs] == [list(e) for e in expected]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(n_new), use_tqdm=False)
    assert [ids(o) for o in again] == [list(e) for e in expected]
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_then_resume_gives_the_same_tokens(engine, mode):
    n_new = 10
    expected = [engine.reference_greedy(tuple(p), n_new).token_ids for p in PROMPTS]
    # 4 tokens a block: the first three prompts are admitted (3+6+2 blocks) and grow to 5+8+4 = 17 > 14 blocks
    llm = make_llm(engine, num_gpu_blocks=14, block_size=4, num_cpu_blocks=32 if mode == "swap" else 0,
                   preemption_mode=mode, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(n_new), use_tqdm=False)
    assert [ids(o) for o in outs] == [list(e) for e in expected]
    st = llm.scheduler.stats
    assert st.preemptions > 0
    if mode == "swap":
        assert st.swap_outs > 0 and st.swap_ins > 0
    llm.block_manager.check_invariants()


def test_parallel_sampling_copies_the_shared_partial_block(engine):
    prompt = PROMPTS[1]  # 22 tokens: the last block (block_size 8) is shared and partly filled
    expected = list(engine.reference_greedy(tuple(prompt), 6).token_ids)
    llm = make_llm(engine, num_gpu_blocks=32, block_size=8)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(6, n=4), use_tqdm=False)[0]
    assert [ids(out, i) for i in range(4)] == [expected] * 4
    assert llm.block_manager.stats.cow_copies >= 3
    llm.block_manager.check_invariants()


def test_lookahead_slots(engine):
    expected = [list(engine.reference_greedy(tuple(p), 6).token_ids) for p in PROMPTS[:3]]
    llm = make_llm(engine, num_gpu_blocks=64, block_size=4, num_lookahead_slots=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy(6), use_tqdm=False)
    assert [ids(o) for o in outs] == expected


def test_sliding_window_matches_a_windowed_reference(engine):
    window = 12
    prompt = PROMPTS[3]  # 40 tokens > window
    expected = list(engine.reference_greedy(tuple(prompt), 8, window=window).token_ids)
    llm = make_llm(engine, num_gpu_blocks=32, block_size=4, sliding_window=window, enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(8), use_tqdm=False)[0]
    assert ids(out) == expected
    assert llm.block_manager.num_free_gpu_blocks == 32


def test_sampling_is_reproducible_with_a_seed(engine):
    from pagedkv.engine.sampling import SamplingParams

    llm = make_llm(engine, num_gpu_blocks=64)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=6)
    a = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)[1]
    assert ids(a) == ids(b)


def test_user_errors_have_clear_messages(engine, tmp_path):
    from pagedkv.errors import InvalidArgumentError, PromptTooLongError
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "missing.gguf"))
    llm = make_llm(engine, num_gpu_blocks=16, max_num_seqs=2)
    with pytest.raises(PromptTooLongError, match="context"):
        llm.generate({"prompt_token_ids": [5] * llm.max_model_len}, greedy(4), use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="never fit"):
        llm.generate({"prompt_token_ids": [5] * 300}, greedy(4), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        llm.generate({"prompt_token_ids": [5, 6]}, greedy(4, n=3), use_tqdm=False)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(max_tokens=0), dict(n=0)):
        with pytest.raises(InvalidArgumentError, match="SamplingParams"):
            SamplingParams(**bad)
    import torch

    if not torch.cuda.is_available():  # (where CUDA is present the constructor is fine: nothing to refuse)
        with pytest.raises(InvalidArgumentError, match="CUDA"):
            LLM(engine.paged, device="cuda")


def test_stop_string_and_streaming(engine, reference_case):
    from pagedkv.engine.sampling import SamplingParams

    llm = make_llm(engine, num_gpu_blocks=32)
    prompt = {"prompt_token_ids": reference_case["prompt_ids"]}
    full = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    assert full.text.startswith("The capital of France is Paris.")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=" Paris"), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is"
    assert out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < 12
    pieces = list(llm.stream(prompt, greedy(12)))
    assert len(pieces) > 1 and "".join(pieces) == full.text
    llm.block_manager.check_invariants()
    assert llm.block_manager.num_free_gpu_blocks == 32


def test_public_names_are_exported_lazily():
    import subprocess
    import sys

    pytest.importorskip("torch")  # (the names below need it; this module's other tests do too)
    code = ("import sys, pagedkv.engine as e; assert 'torch' not in sys.modules, 'torch imported'; "
            "from pagedkv.engine import LLM, SamplingParams, RequestOutput, CompletionOutput; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("copies", [2, 8])
def test_identical_prompts_admitted_in_one_step_share_blocks_computed_once(engine, reference_case, copies):
    """Burst sharing: the copies of one prompt, admitted in the same step, share its full blocks from the first
    allocation on; the prompt's full blocks are computed once in that step and every copy reproduces the
    independent reference output."""
    prompt = reference_case["prompt_ids"]
    bs = 16
    llm = make_llm(engine, num_gpu_blocks=64, block_size=bs, max_num_seqs=copies)
    outs = llm.generate([{"prompt_token_ids": prompt}] * copies, greedy(reference_case["max_tokens"]), use_tqdm=False)
    assert all(ids(o) == reference_case["gen_ids"] for o in outs)
    shared = (len(prompt) - 1) // bs * bs
    assert [o.num_cached_tokens for o in outs] == [0] + [shared] * (copies - 1)
    st, sched = llm.block_manager.stats, llm.scheduler.stats
    assert st.prefix_hit_tokens == (copies - 1) * shared
    assert sched.steps == reference_case["max_tokens"]  # all copies prefilled in step 1 (its first token), then decodes
    assert sched.computed_prefill_tokens == len(prompt) + (copies - 1) * (len(prompt) - shared)
    llm.block_manager.check_invariants()


def test_cpu_tier_hits_reproduce_the_reference(engine):
    """A GPU pool too small to keep every prompt cached: evicted blocks are demoted to the CPU tier, and a
    prompt seen again gets them back (promoted) as part of its hit; the output still equals the reference."""
    n_new = 6
    llm = make_llm(engine, num_gpu_blocks=16, block_size=4, num_cpu_blocks=64, cpu_prefix_cache=True)
    order = [3, 1, 0, 2, 3, 1]  # 3 and 1 come back after the others pushed them out of the GPU
    for i in order:
        out = llm.generate([{"prompt_token_ids": PROMPTS[i]}], greedy(n_new), use_tqdm=False)[0]
        assert ids(out) == list(engine.reference_greedy(tuple(PROMPTS[i]), n_new).token_ids)
        llm.block_manager.check_invariants()
    st = llm.block_manager.stats
    assert st.demotions > 0 and st.promotions > 0 and st.cpu_hit_tokens > 0
    assert st.cpu_hit_tokens <= st.prefix_hit_tokens


@pytest.mark.parametrize("incremental", [True, False])
def test_engine_tables_incremental_or_padded_give_the_reference(engine, incremental):
    """The engine keeps its own block tables from the steps' changes (decode_step(..., block_tables=False)); with a
    block manager without that form it takes the padded tables: both reproduce the reference through swaps and
    the copy-on-write of forked samples."""
    n_new = 8
    expected = [list(engine.reference_greedy(tuple(p), n_new).token_ids) for p in PROMPTS[:3]]
    llm = make_llm(engine, num_gpu_blocks=14, block_size=4, num_cpu_blocks=32, preemption_mode="swap",
                   enable_prefix_caching=False)
    assert llm.scheduler.incremental_tables
    llm.scheduler.incremental_tables = incremental
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy(n_new, n=2), use_tqdm=False)
    assert [[ids(o, 0), ids(o, 1)] for o in outs] == [[e, e] for e in expected]
    assert llm.scheduler.stats.swap_ins > 0 and llm.block_manager.stats.cow_copies > 0
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("policy", ["slru", "session", "arc"])
def test_priority_scheduling_eviction_policy_and_pins_give_the_reference(engine, policy):
    """scheduling_policy="priority" with per-prompt priorities under preemption, an eviction policy and a pinned
    prefix: the same tokens as the reference, and the pin survives the preemptions."""
    n_new = 10
    expected = [engine.reference_greedy(tuple(p), n_new).token_ids for p in PROMPTS]
    llm = make_llm(engine, num_gpu_blocks=20, block_size=4, scheduling_policy="priority", eviction_policy=policy,
                   pin_budget_blocks=4)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(1), use_tqdm=False)
    pin = llm.block_manager.retention.pin_prefix(PROMPTS[1][:16])
    assert pin.num_tokens == 16
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(n_new), use_tqdm=False,
                        priority=[3, 0, 2, 1])
    assert [ids(o) for o in outs] == [list(e) for e in expected]
    assert outs[1].num_cached_tokens == 20  # the pinned 16 tokens and the rest of its first run
    assert llm.scheduler.stats.preemptions > 0
    assert llm.block_manager.lookup_prefix(PROMPTS[1][:16] + [0]).num_cached_tokens == 16
    llm.block_manager.check_invariants()


def test_llm_pin_prefix_computes_pins_and_survives_pressure(engine):
    """LLM.pin_prefix computes a prefix that is not cached (a one-token generation), pins its full blocks, and the
    pin keeps them through a workload that evicts everything else; the rerun hits them and gives the reference."""
    from pagedkv.errors import InvalidArgumentError, PinBudgetError, UnknownPinError

    n_new = 6
    llm = make_llm(engine, num_gpu_blocks=18, block_size=4, pin_budget_blocks=5)
    system = PROMPTS[1]  # 22 tokens: 5 full blocks
    pin = llm.pin_prefix({"prompt_token_ids": system}, ttl=3600)
    assert (pin.num_tokens, pin.num_blocks, pin.ttl) == (20, 5, 3600) and llm.pins == (pin,)
    assert llm.block_manager.retention.num_pinned_blocks == 5
    assert llm.pin_prefix(system).num_blocks == 5  # pinned again: nested, no budget spent
    with pytest.raises(PinBudgetError):  # a prefix whose blocks would pass the budget: nothing pinned
        llm.pin_prefix(PROMPTS[3])
    assert llm.block_manager.retention.num_pinned_blocks == 5 and len(llm.pins) == 2
    evictions = llm.block_manager.stats.evictions
    others = [list(range(1000 + 50 * i, 1030 + 50 * i)) for i in range(4)]  # 4 x 30 tokens through 18 blocks
    llm.generate([{"prompt_token_ids": p} for p in others], greedy(n_new), use_tqdm=False)
    assert llm.block_manager.stats.evictions > evictions
    again = llm.generate([{"prompt_token_ids": system + [5, 6]}], greedy(n_new), use_tqdm=False)[0]
    assert again.num_cached_tokens == 20
    assert ids(again) == list(engine.reference_greedy(tuple(system + [5, 6]), n_new).token_ids)
    for p in llm.pins:
        llm.unpin(p.pin_id)
    assert llm.pins == () and llm.block_manager.retention.num_pinned_blocks == 0
    with pytest.raises(UnknownPinError):
        llm.unpin(pin.pin_id)
    assert llm.pin_prefix([1, 2, 3]).pin_id == 0  # shorter than a block: nothing to pin
    with pytest.raises(InvalidArgumentError):
        make_llm(engine, num_gpu_blocks=18, block_size=4).pin_prefix(system)  # no pin budget
    llm.block_manager.check_invariants()


def test_forked_samples_inherit_the_request_priority(engine):
    """n = 2 samples of a request of priority 5: the forked sample's blocks are evicted in the request's class
    (5), as the parent's, not in the default class; the tokens are the reference's."""
    n_new = 9
    llm = make_llm(engine, num_gpu_blocks=40, block_size=4)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(n_new, n=2), use_tqdm=False, priority=5)[0]
    expected = list(engine.reference_greedy(tuple(PROMPTS[1]), n_new).token_ids)
    assert [ids(out, 0), ids(out, 1)] == [expected, expected]
    ev = llm.block_manager._cache.evictor
    # every cached idle block sits in class 5: the prompt's and each sample's own full decode blocks
    assert set(ev.classes) >= {5} and len(ev.classes[5]) == len(list(ev)) > 22 // 4
    assert len(ev.classes[0]) == 0
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("policy, kept", [("lru", [0, 2]), ("session", [2, 0])])
def test_session_hint_through_llm_gives_the_golden_eviction_order(engine, policy, kept):
    """LLM.generate(session=...): the scheduler hands each request's conversation to the block manager; with the
    session policy the conversation (two requests, the second a hit) outlives a newer one-off, LRU does the
    opposite (the manager-level golden of tests/test_eviction_policies.py, through the model)."""
    llm = make_llm(engine, num_gpu_blocks=3, block_size=2, eviction_policy=policy)
    for prompt, session in (([1, 2, 7], "chat"), ([1, 2, 8], "chat"), ([3, 4, 9], "one-off")):
        llm.generate([{"prompt_token_ids": prompt}], greedy(1), use_tqdm=False, session=session)
    llm.generate([{"prompt_token_ids": [5, 6, 11]}], greedy(1), use_tqdm=False)  # takes one cached block
    bm = llm.block_manager
    assert [bm.lookup_prefix([1, 2, 0]).num_cached_tokens, bm.lookup_prefix([3, 4, 0]).num_cached_tokens] == kept
    bm.check_invariants()


def test_session_argument_forms_and_errors(engine):
    from pagedkv.errors import InvalidArgumentError

    llm = make_llm(engine, num_gpu_blocks=16, block_size=4, eviction_policy="session")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    with pytest.raises(InvalidArgumentError, match="2 prompts"):
        llm.generate(prompts, greedy(1), use_tqdm=False, session=["a"])
    with pytest.raises(InvalidArgumentError, match="hashable"):
        llm.generate(prompts, greedy(1), use_tqdm=False, session=[{"a": 1}, None])
    assert llm.scheduler.stats.prefills == 0  # refused before anything ran
    llm.generate(prompts, greedy(1), use_tqdm=False, session=["a", None])
    llm.generate(prompts, greedy(1), use_tqdm=False, session=7)  # one hint for both prompts
    assert dict(llm.block_manager._cache.evictor.sessions) == {"a": 1, 7: 2}
    llm.block_manager.check_invariants()


def test_kv_retention_pins_the_prompt_once_computed(engine):
    """kv_retention on generate: the first 22 tokens of a prompt (5 whole blocks) pinned once its last chunk is
    computed (chunks of 8 tokens), the pin listed in llm.pins and kept through pressure that evicts everything
    else; a second request asking the same reuses the pin and refreshes its TTL by its hit; every error is raised
    before anything runs."""
    from pagedkv.errors import InvalidArgumentError, PinBudgetError

    n_new = 4
    llm = make_llm(engine, num_gpu_blocks=18, block_size=4, pin_budget_blocks=5, max_num_batched_tokens=8)
    system = PROMPTS[1]  # 22 tokens
    keep = {"pin_tokens": 22, "ttl": 600}
    out = llm.generate([{"prompt_token_ids": system + [5, 6]}], greedy(n_new), use_tqdm=False, kv_retention=keep)[0]
    assert (out.pin.num_tokens, out.pin.num_blocks, out.pin.ttl, out.pin_error) == (20, 5, 600.0, None)
    assert llm.pins == (out.pin,) and llm.block_manager.retention.num_pinned_blocks == 5
    assert ids(out) == list(engine.reference_greedy(tuple(system + [5, 6]), n_new).token_ids)
    others = [list(range(1000 + 50 * i, 1030 + 50 * i)) for i in range(3)]  # 3 x 30 tokens through 18 blocks
    evictions = llm.block_manager.stats.evictions
    outs = llm.generate([{"prompt_token_ids": p} for p in others], greedy(n_new), use_tqdm=False)
    assert llm.block_manager.stats.evictions > evictions and all(o.pin is None for o in outs)
    ev = llm.block_manager._cache.evictor
    deadline = ev.pins[out.pin.pin_id][2]
    again = llm.generate([{"prompt_token_ids": system + [7]}], greedy(n_new), use_tqdm=False,
                         kv_retention=[keep])[0]
    assert again.num_cached_tokens == 20 and again.pin == out.pin and len(llm.pins) == 1  # reused
    assert ev.pins[out.pin.pin_id][2] > deadline  # the hit refreshed the TTL
    assert ids(again) == list(engine.reference_greedy(tuple(system + [7]), n_new).token_ids)
    unpinned = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(1), use_tqdm=False,
                            kv_retention={"pin_tokens": "prompt"})[0]
    assert unpinned.pin.pin_id == 0 and unpinned.pin_error is None  # shorter than a block: nothing to pin
    before = llm.scheduler.stats.prefills
    with pytest.raises(PinBudgetError):  # 10 blocks: past the budget of 5
        llm.generate([{"prompt_token_ids": PROMPTS[3]}], greedy(1), use_tqdm=False, kv_retention={"pin_tokens": 40})
    with pytest.raises(PinBudgetError):  # 2 blocks, but the pin above holds all 5 of the budget now
        llm.generate([{"prompt_token_ids": others[0]}], greedy(1), use_tqdm=False, kv_retention={"pin_tokens": 8})
    with pytest.raises(InvalidArgumentError, match="longer than the prompt"):
        llm.generate([{"prompt_token_ids": system}], greedy(1), use_tqdm=False, kv_retention={"pin_tokens": 23})
    with pytest.raises(InvalidArgumentError):
        llm.generate([{"prompt_token_ids": system}], greedy(1), use_tqdm=False, kv_retention={"pin": 8})
    assert llm.scheduler.stats.prefills == before  # nothing ran
    assert not llm.scheduler.has_unfinished() and llm.pins == (out.pin,)
    admin = llm.pin_prefix({"prompt_token_ids": system})  # the same 5 blocks, no TTL: nothing more of the budget
    forever = llm.generate([{"prompt_token_ids": system + [9]}], greedy(1), use_tqdm=False,
                           kv_retention={"pin_tokens": "prompt"})[0]  # admitted: its blocks are pinned already
    assert (forever.pin.num_tokens, forever.pin.ttl, forever.pin_error) == (20, None, None)
    assert forever.pin.pin_id not in (out.pin.pin_id, admin.pin_id) and llm.block_manager.retention.num_pinned_blocks == 5
    with pytest.raises(InvalidArgumentError, match="pin budget"):
        make_llm(engine, num_gpu_blocks=18, block_size=4).generate(
            [{"prompt_token_ids": system}], greedy(1), use_tqdm=False, kv_retention=keep)
    llm.block_manager.check_invariants()
