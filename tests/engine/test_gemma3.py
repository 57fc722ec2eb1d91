"""Gemma 3 270M through the paged engine: greedy output equal to HF transformers (eager) on the reference cases of
tests/data/gemma3_greedy.json, under a roomy cache, a prefix-cache rerun, and recompute / swap preemption in a small
cache; its tokenizer reproduces the reference prompt ids; the sliding-window semantics are pinned.

CI runs a representative subset of the reference cases (:data:`CI_CASES`: the case that must recall a paragraph from
more than 512 tokens back, which only the full-attention layers can see, and a multiplication table longer than the
window; :data:`CI_PREEMPTION_CASES` for the preemption tests; chunked prefill with its budget, a rerun and a
preemption in the middle of a prefill, by recompute in CI, by swap too with ``PAGEDKV_GEMMA3_FULL=1``); ``PAGEDKV_GEMMA3_FULL=1`` runs every case in every configuration (a few minutes on 2 cores), and the CLI
with ``--model gemma-3-270m``. The storage tiers on the KV cache groups (:data:`TIER_CASES`): the disk tier after an
LLM restart and after a server restart, a shared directory and Redis between two replicas, corrupt values refused and
computed; each counts the blocks every group loaded (a sliding group only its window's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.engine

REFERENCE_JSON = Path(__file__).resolve().parents[1] / "data" / "gemma3_greedy.json"
FULL = os.environ.get("PAGEDKV_GEMMA3_FULL") == "1"
#: case 3 repeats a paragraph from > 512 tokens back; case 5 (783 tokens) continues a table past the window
CI_CASES = (3, 5)
#: the preemption tests in CI: case 5 and the shortest case (423 tokens), so the re-prefills stay cheap
CI_PREEMPTION_CASES = (4, 5)
BLOCK = 16


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE_JSON.read_text())


@pytest.fixture(scope="module")
def cases(reference) -> list[dict]:
    picked = range(len(reference["cases"])) if FULL else CI_CASES
    return [reference["cases"][i] for i in picked]


@pytest.fixture(scope="module")
def preemption_cases(reference) -> list[dict]:
    picked = range(len(reference["cases"])) if FULL else CI_PREEMPTION_CASES
    return [reference["cases"][i] for i in picked]


def make_llm(model, **kw):
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM

    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 4096)
    return LLM(model, block_size=BLOCK, **engine_configs(**kw))


def run(llm, cases):
    from pagedkv.engine.sampling import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=c["max_tokens"], ignore_eos=True) for c in cases]
    return llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)


def gen(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


# ---------------------------------------------------------------------------------------------- no model needed


def _meta(q_lens, ctx_lens, tables):
    from pagedkv.engine.model import build_attention_metadata

    new = [[0] * q for q in q_lens]
    computed = [c - q for c, q in zip(ctx_lens, q_lens)]
    slots = []
    for q, c, t in zip(q_lens, ctx_lens, tables):
        for p in range(c - q, c):
            slots.append(t[p // BLOCK] * BLOCK + p % BLOCK)
    return build_attention_metadata(new, computed, slots, tables, block_size=BLOCK)


def _dense_reference(q, k, v, positions, window, scale):
    """Attention of queries at ``positions`` over keys 0..len(k)-1 with HF's sliding_window_overlay rule: key kv is
    seen iff kv <= p and kv > p - W (W keys, itself included). Explicit scores, float64."""
    n_head, n_kv = q.shape[1], k.shape[1]
    kv_pos = torch.arange(k.shape[0])[None, :]
    p = torch.as_tensor(positions)[:, None]
    allowed = kv_pos <= p
    if window is not None:
        allowed &= kv_pos > p - window
    kk = k.double().repeat_interleave(n_head // n_kv, dim=1)  # (K, n_head, d)
    vv = v.double().repeat_interleave(n_head // n_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)
    return out.reshape(len(positions), -1), allowed


@pytest.mark.parametrize("window", [512, 5, None])
def test_sliding_window_semantics_match_hf(window):
    """The engine's paged attention (the path Gemma 3's layers take) against HF's sliding_window_overlay rule on
    random keys: a whole new prompt of 700 tokens, decodes at 513 and 1040 tokens, and a 40-token chunk after 560
    cached tokens (window edges inside earlier blocks), in one step. An off-by-one window changes the outputs."""
    from pagedkv.engine.paged_attention import AttentionWorkspace, paged_attention, plan_paged_attention

    gen = torch.Generator().manual_seed(0)
    n_head, n_kv, d, scale = 4, 1, 16, 0.25
    q_lens, ctx = [700, 1, 1, 40], [700, 513, 1040, 600]
    tables = [list(range(i * 70, i * 70 + blocks(c))) for i, c in enumerate(ctx)]
    kv_cache = torch.zeros(2, 4 * 70, BLOCK, n_kv, d)
    seq_k = [torch.randn(c, n_kv, d, generator=gen) for c in ctx]
    seq_v = [torch.randn(c, n_kv, d, generator=gen) for c in ctx]
    seq_q = [torch.randn(q, n_head, d, generator=gen) for q in q_lens]
    for t, kk, vv, c, q in zip(tables, seq_k, seq_v, ctx, q_lens):  # the cached tokens, written before the step
        for pos in range(c - q):
            kv_cache[0, t[pos // BLOCK], pos % BLOCK] = kk[pos]
            kv_cache[1, t[pos // BLOCK], pos % BLOCK] = vv[pos]
    meta = _meta(q_lens, ctx, tables)
    plan = plan_paged_attention(meta, BLOCK, sliding_window=window)
    new = [slice(c - q, c) for c, q in zip(ctx, q_lens)]
    out = paged_attention(torch.cat([x for x in seq_q]), torch.cat([kk[s] for kk, s in zip(seq_k, new)]),
                          torch.cat([vv[s] for vv, s in zip(seq_v, new)]), kv_cache, plan, scale=scale,
                          workspace=AttentionWorkspace())
    start = 0
    for b, (c, q) in enumerate(zip(ctx, q_lens)):
        want, allowed = _dense_reference(seq_q[b], seq_k[b], seq_v[b], list(range(c - q, c)), window, scale)
        assert torch.allclose(out[start:start + q].double(), want, atol=1e-5), (b, window)
        # the last query sees min(W, p + 1) keys
        assert int(allowed[-1].sum()) == (min(window, c) if window is not None else c)
        start += q


def test_sliding_window_skips_blocks_before_the_window():
    """A decode at position 1039 with W = 512 sees keys 528..1039: the blocks before block 33 are not gathered (the
    gathering path: mode "bucketed"; the "ragged" kernel reads each key range as it is, tested in
    test_ragged_attention.py)."""
    from pagedkv.engine.paged_attention import plan_paged_attention

    table = list(range(100, 100 + blocks(1040)))
    (g,) = plan_paged_attention(_meta([1], [1040], [table]), BLOCK, sliding_window=512, mode="bucketed").groups
    assert g.block_ids.tolist() == table[33:]
    assert g.num_keys == 512 and bool((g.mask == 0).all())  # block 33 starts at key 528: exactly the window
    (g,) = plan_paged_attention(_meta([1], [1041], [table + [200]]), BLOCK, sliding_window=512,
                                mode="bucketed").groups
    assert g.block_ids.tolist() == table[33:] + [200]  # position 1040 sees 529..1040: key 528 is masked
    assert torch.isfinite(g.mask[0, 0, 0]).tolist() == [False] + [True] * 512 + [False] * 15


def test_released_block_inside_the_window_is_an_error_and_outside_is_fine():
    from pagedkv.engine.model import NULL_BLOCK
    from pagedkv.engine.paged_attention import plan_paged_attention

    ctx = 600  # one decode at position 599 with window 512 sees keys 88..599: blocks 5.. (block 5 = keys 80..95)
    table = list(range(blocks(ctx)))
    ok = [NULL_BLOCK] * 5 + table[5:]
    plan_paged_attention(_meta([1], [ctx], [ok]), BLOCK, sliding_window=512)
    bad = [NULL_BLOCK] * 6 + table[6:]
    with pytest.raises(RuntimeError, match="NULL_BLOCK"):
        plan_paged_attention(_meta([1], [ctx], [bad]), BLOCK, sliding_window=512)
    with pytest.raises(RuntimeError, match="NULL_BLOCK"):  # a global layer needs every block
        plan_paged_attention(_meta([1], [ctx], [ok]), BLOCK, sliding_window=None)


def test_layer_pattern_five_local_to_one_global():
    from pagedkv.engine.gemma3 import Gemma3Config

    c = Gemma3Config(arch="gemma3", name="", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048,
                     vocab_size=262144, context_length=32768, rope_freq_base=1e6, rope_freq_base_swa=1e4,
                     rms_eps=1e-6, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256)
    assert [i for i, w in enumerate(c.layer_windows) if w is None] == [5, 11, 17]
    assert {w for w in c.layer_windows if w is not None} == {512}


def test_registry_names_and_architectures(tmp_path):
    from pagedkv.engine.registry import model_class, read_architecture, resolve_model_path

    with pytest.raises(FileNotFoundError, match="gemma-3-270m"):
        resolve_model_path(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        model_class("mamba")
    # a minimal GGUF header whose first key is general.architecture
    import struct

    key, val = b"general.architecture", b"gemma3"
    blob = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
    blob += struct.pack("<Q", len(val)) + val
    f = tmp_path / "tiny.gguf"
    f.write_bytes(blob)
    assert read_architecture(f) == "gemma3"
    assert resolve_model_path(f) == f


# ---------------------------------------------------------------------------------------------- the real model


def test_model_file_facts(gemma):
    """What the GGUF holds, as the implementation assumes it: the architecture's shape, norms stored as the (1 + w)
    multipliers (mean near 1, not near 0), the output embedding tied, no soft-capping."""
    from pagedkv.engine.registry import find_gemma3_model, read_architecture, resolve_model_path

    assert resolve_model_path("gemma-3-270m") == find_gemma3_model()
    assert read_architecture(find_gemma3_model()) == "gemma3"
    c = gemma.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert (c.sliding_window, c.rope_freq_base, c.rope_freq_base_swa) == (512, 1e6, 1e4)
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    assert gemma.lm_head is gemma.tok_embd
    assert float(gemma.out_norm.mean()) > 0.5  # stored as 1 + w


def test_tokenizer_reproduces_reference_prompt_ids(gemma, reference):
    from pagedkv.engine.registry import make_tokenizer
    from pagedkv.engine.spm_tokenizer import SentencePieceTokenizer

    tok = make_tokenizer(gemma.tokenizer_metadata)
    assert isinstance(tok, SentencePieceTokenizer)
    for c in reference["cases"]:
        assert tok.encode(c["prompt"], add_special_tokens=True) == c["prompt_ids"]
        assert tok.decode(c["gen_ids"], skip_special_tokens=True) == c["text"]
    # special and user-defined tokens are single ids; runs of spaces use Gemma's whitespace pieces
    ids = tok.encode("<start_of_turn>user\n    x<end_of_turn><eos>")
    assert ids[0] == tok.token_to_id("<start_of_turn>") and ids[-1] == tok.eos_token_id
    assert tok.token_to_id("<end_of_turn>") in ids and 140 in ids  # 140: four spaces
    assert tok.decode(ids) == "<start_of_turn>user\n    x<end_of_turn><eos>"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat[0] == tok.bos_token_id and tok.decode(chat).endswith("<start_of_turn>model\n")


def test_llm_rejects_a_global_sliding_window(gemma):
    from pagedkv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="per-layer sliding windows"):
        make_llm(gemma, num_gpu_blocks=8, sliding_window=512)


#: KV cache groups of Gemma 3 270M in the engine: 1 full-attention group + 5 sliding-window groups of 3 layers
GROUPS = 6


@pytest.mark.parametrize("groups", [True, False], ids=["groups", "one-table"])
def test_roomy_cache_then_prefix_cache_rerun(gemma, cases, groups):
    n_groups = GROUPS if groups else 1
    llm = make_llm(gemma, kv_cache_groups=groups,
                   num_gpu_blocks=n_groups * sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases) * 2)
    assert (llm.kv_cache_groups is not None) == groups
    assert llm.kv_cache.shape[0] == 18 // n_groups  # a KV tensor slot per layer of a group
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"] for c in cases]
    assert [o.num_cached_tokens for o in outs] == [0] * len(cases)
    again = run(llm, cases)
    assert gen(again) == [c["gen_ids"] for c in cases]
    # all full blocks of each prompt (the last prompt token is always recomputed) come from the prefix cache: with
    # groups, the full-attention group's blocks and each sliding group's last window before the hit point
    assert [o.num_cached_tokens for o in again] == [(len(c["prompt_ids"]) - 1) // BLOCK * BLOCK for c in cases]
    llm.block_manager.check_invariants()


def test_fast_lm_head_is_used_and_equals_the_float32_head(gemma, cases):
    """Gemma 3's 262,144 x 640 tied output table through the exact fast LM head (the default, as in every test
    here) against the float32 head: the reference tokens both ways, the bounded products (bf16, or the quantized
    Q8_0 table's float32 products for steps of up to LMHead.QUANT_ROWS greedy rows) for every greedy step."""
    head = gemma.head
    approx = lambda st: st["bf16"] + st["quantized"]  # noqa: E731
    outs = {}
    for fast in (True, False):
        before = dict(head.stats)
        llm = make_llm(gemma, fast_lm_head=fast,
                       num_gpu_blocks=GROUPS * sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases))
        outs[fast] = gen(run(llm, cases))
        assert (approx(head.stats) > approx(before)) is fast
        assert (head.stats["exact"] > before["exact"]) is not fast
        assert head.stats["fallback_rows"] == before["fallback_rows"]
    assert outs[True] == outs[False] == [c["gen_ids"] for c in cases]
    assert head.extra_bytes == 262144 * 640 * 2  # the bf16 copy; the float32 table is the embedding (tied)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_a_small_cache(gemma, preemption_cases, mode):
    """One block table for all layers: the sequences outgrow the cache while decoding, so some are preempted."""
    cases = preemption_cases
    # room for every prompt plus one block, all admitted in the first step: the sequences outgrow the cache while
    # decoding, so some are preempted
    prompt_blocks = sum(blocks(len(c["prompt_ids"])) for c in cases)
    num_blocks = prompt_blocks + 1
    while num_blocks - prompt_blocks < int(0.01 * num_blocks):  # admission keeps the 1 % watermark free
        num_blocks += 1
    growth = sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) - blocks(len(c["prompt_ids"])) for c in cases)
    assert growth > num_blocks - prompt_blocks
    need = max(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases)
    llm = make_llm(gemma, num_gpu_blocks=max(num_blocks, need), preemption_mode=mode, enable_prefix_caching=False,
                   num_cpu_blocks=num_blocks if mode == "swap" else 0, kv_cache_groups=False,
                   max_num_batched_tokens=sum(len(c["prompt_ids"]) for c in cases))
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"] for c in cases]
    st = llm.scheduler.stats
    assert st.prefills > len(cases) if mode == "recompute" else st.prefills == len(cases)
    assert st.preemptions > 0
    if mode == "swap":
        assert st.swap_outs > 0 and st.swap_ins > 0
    llm.block_manager.check_invariants()


def test_chunked_prefill_through_the_scheduler(gemma, cases):
    """Chunked prefill (issue 17) through LLM: a 250-token budget with a 128-token cap per prompt, so chunks end on
    block edges (128) and inside blocks (the budget's remainder beside the other prompt and the decodes), and the
    sliding layers' window edges fall inside earlier chunks; then a rerun from the prefix cache."""
    llm = make_llm(gemma, num_gpu_blocks=GROUPS * sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases) * 2,
                   enable_chunked_prefill=True, max_num_batched_tokens=250, long_prefill_token_threshold=128)
    assert llm.kv_cache_groups is not None  # chunked prefill with KV cache groups
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"] for c in cases]
    st = llm.scheduler.stats
    assert st.prefill_chunks >= sum(-(-len(c["prompt_ids"]) // 128) for c in cases)
    again = run(llm, cases)
    assert gen(again) == [c["gen_ids"] for c in cases]
    assert [o.num_cached_tokens for o in again] == [(len(c["prompt_ids"]) - 1) // BLOCK * BLOCK for c in cases]
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.opt_in("PAGEDKV_GEMMA3_FULL"))])
def test_chunked_prefill_preempted_in_the_middle(gemma, preemption_cases, mode):
    """A cache too small for both prompts: the second prompt's chunks cannot all fit beside the first request, so
    it is preempted (recompute or swap) while partly prefilled, and later finishes; the reference ids."""
    cases = preemption_cases
    need = max(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases)
    total = sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases)
    llm = make_llm(gemma, num_gpu_blocks=max(need + 8, total - 12), preemption_mode=mode, kv_cache_groups=False,
                   num_cpu_blocks=total if mode == "swap" else 0, enable_chunked_prefill=True,
                   max_num_batched_tokens=256)
    sched = llm.scheduler
    schedule, mid = sched.schedule, []

    def record():
        partial = {s.group.request_id for s in sched._seqs.values() if s.prefill is not None}
        plan = schedule()
        mid.extend(p for p in plan.preempted if p.request_id in partial)
        return plan

    sched.schedule = record
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"] for c in cases]
    assert mid and all(p.mode == mode for p in mid)
    llm.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_kv_cache_groups(gemma, reference, mode):
    """KV cache groups in a small cache: three copies of the 423-token case (inside the window, so no group
    releases a block) admitted together with one block to spare; at position 432 each needs a new block in all
    six groups at once, so some are preempted (recomputed, or swapped out with every group's blocks and back)."""
    c = reference["cases"][4]
    cases = [c] * 3
    n = len(c["prompt_ids"])
    assert n + c["max_tokens"] <= 512 < 783  # inside the window
    prompt_blocks = GROUPS * blocks(n) * len(cases)
    num_blocks = prompt_blocks + 1
    while num_blocks - prompt_blocks < int(0.01 * num_blocks):  # admission keeps the 1 % watermark free
        num_blocks += 1
    assert GROUPS * len(cases) * (blocks(n + c["max_tokens"]) - blocks(n)) > num_blocks - prompt_blocks
    llm = make_llm(gemma, num_gpu_blocks=num_blocks, preemption_mode=mode, enable_prefix_caching=False,
                   num_cpu_blocks=num_blocks if mode == "swap" else 0, max_num_batched_tokens=n * len(cases))
    assert llm.kv_cache_groups is not None
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"]] * len(cases)
    st = llm.scheduler.stats
    assert st.preemptions > 0
    assert st.prefills > len(cases) if mode == "recompute" else (st.swap_outs > 0 and st.swap_ins > 0)
    llm.block_manager.check_invariants()


def test_reference_cases_complete_in_a_40_mib_kv_cache_through_llm(gemma, reference):
    """Issue 16 item 4 through the engine: ``kv_cache_gib=40/1024`` gives 426 block ids with KV cache groups; with
    chunked prefill (the default) a sliding group never holds more than its window and one chunk, so the
    1,540-token case is admitted (one table for all 18 layers can never hold it) and completes greedy equal to HF.
    CI runs the two longest cases (1,540 and 1,341 tokens, together more than the pool: preemption);
    PAGEDKV_GEMMA3_FULL=1 all six."""
    from pagedkv.engine.llm import LLM, CacheConfig

    llm = LLM(gemma, block_size=BLOCK, max_num_seqs=8, cache_config=CacheConfig(kv_cache_gib=40 / 1024))
    assert llm.kv_cache_groups is not None and llm.enable_chunked_prefill
    assert llm.block_manager.config.num_gpu_blocks == 426
    cases = reference["cases"] if FULL else sorted(reference["cases"], key=lambda c: -len(c["prompt_ids"]))[:2]
    outs = run(llm, cases)
    assert gen(outs) == [c["gen_ids"] for c in cases]
    llm.block_manager.check_invariants()


@pytest.mark.opt_in("PAGEDKV_GEMMA3_FULL")
def test_reference_cases_complete_in_a_40_mib_kv_cache_with_groups(gemma, reference):
    """Issue 16 item 4: with a 40 MiB fp32 KV cache (426 block ids of 96 KiB with groups) every reference case
    completes, greedy equal to HF, through the real HybridBlockManager and the model: the prompt in chunks of 256
    tokens (allocate the first, then multi-token decode_step appends, as chunked prefill drives them), each
    sliding group releasing the blocks its window left behind. One table for all 18 layers (71 block ids of
    576 KiB) can never hold the 1,540-token case. CI runs the longest case; PAGEDKV_GEMMA3_FULL=1 all six."""
    import numpy as np

    from pagedkv import AllocStatus, BlockManager, HybridBlockManager
    from pagedkv.engine.model import build_group_attention_metadata

    budget = int(40 / 1024 * 2**30)
    num_blocks = budget // gemma.kv_cache_bytes_per_block(BLOCK, grouped=True)
    assert num_blocks == 426
    longest = max(reference["cases"], key=lambda c: len(c["prompt_ids"]))
    one_table = BlockManager(budget // gemma.kv_cache_bytes_per_block(BLOCK), BLOCK)
    assert one_table.can_allocate(longest["prompt_ids"]) is AllocStatus.NEVER
    bm = BlockManager(num_blocks, BLOCK, kv_cache_groups=gemma.kv_cache_groups, grouped_results=True)
    kv = gemma.allocate_kv_cache(num_blocks, BLOCK, grouped=True)
    n_groups = len(gemma.kv_cache_groups)
    chunk = 256

    def forward(new, done, slots, tables):
        meta = build_group_attention_metadata([new], [done], slots, [[t] for t in tables], block_size=BLOCK)
        return int(gemma(meta, kv)[0].argmax())

    picked = reference["cases"] if FULL else [longest]
    peak = 0
    for sid, c in enumerate(picked):
        ids = c["prompt_ids"]
        bm.allocate(sid, ids[:chunk])
        first = ids[:chunk]
        tok = forward(first, 0, [bm.slot_mapping(sid, 0, len(first), g) for g in range(n_groups)],
                      [bm.block_table(sid, g) for g in range(n_groups)])
        done = len(first)
        pending = list(ids[chunk:])
        out = []
        while True:
            if not pending:  # the prompt is in: decode
                out.append(tok)
                if len(out) == c["max_tokens"]:
                    break
                pending = [tok]
            new, pending = pending[:chunk], pending[chunk:]
            r = bm.decode_step([sid], np.asarray(new, dtype=np.int64).reshape(1, -1))
            tok = forward(new, done, r.slot_mapping, [t[0] for t in r.block_tables])
            done += len(new)
            peak = max(peak, num_blocks - bm.num_free_gpu_blocks)
        assert out == c["gen_ids"], c["prompt"][:40]
        bm.free(sid, cache=False)
        bm.check_invariants()
    assert peak <= num_blocks


@pytest.mark.opt_in("PAGEDKV_GEMMA3_FULL")  # loads the model in a subprocess (~30 s); deselected unless set
def test_cli_generate_with_model_name(gemma, reference):
    c = reference["cases"][4]
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--raw", "--model", "gemma-3-270m",
                          "--max-tokens", "5", c["prompt"]], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert c["text"][:10].strip() in out.stdout


def test_chunked_prefill_then_decode(gemma, reference):
    """The forward computes a prompt in chunks (each chunk's queries read the earlier chunks' KV through the block
    table, a sliding layer only its window, which spans chunk edges) and decodes after it: the reference ids. The
    scheduler's chunked prefill drives these steps (test_chunked_prefill_through_the_scheduler)."""
    from pagedkv.engine.model import build_attention_metadata

    c = reference["cases"][5]  # 783 tokens: chunks of 300 put window edges inside earlier chunks
    ids, n_new = c["prompt_ids"], 4
    table = list(range(blocks(len(ids) + n_new)))[::-1]  # any block order
    kv = gemma.allocate_kv_cache(len(table), BLOCK)

    def step(new, done):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(done, done + len(new))]
        return gemma(build_attention_metadata([new], [done], slots, [table], block_size=BLOCK), kv)

    for start in range(0, len(ids), 300):
        logits = step(ids[start:start + 300], start)
    out = [int(logits[0].argmax())]
    while len(out) < n_new:
        out.append(int(step([out[-1]], len(ids) + len(out) - 1)[0].argmax()))
    assert out == c["gen_ids"][:n_new]


def test_gguf_layout_facts_decide_the_reference(gemma, reference):
    """The two GGUF facts the loader relies on, shown to matter: with the stored norm values taken as ``w`` (so
    ``2 + w``), or with llama.cpp's Llama Q/K row permutation undone, the first token of a reference case changes."""
    import numpy as np

    from pagedkv.engine.gemma3 import PagedGemma3
    from pagedkv.engine.gguf_loader import unpermute_qk
    from pagedkv.engine.model import build_attention_metadata

    c = reference["cases"][4]  # the shortest prompt (423 tokens)
    ids = c["prompt_ids"]
    weights = {k: v for k, v in gemma.gguf_weights().items() if k != "output.weight"}

    def first_token(w):
        w = {**w, "output.weight": w["token_embd.weight"]}
        m = PagedGemma3(gemma.config, w, tokenizer_metadata=gemma.tokenizer_metadata)
        n = blocks(len(ids))
        meta = build_attention_metadata([ids], [0], np.arange(len(ids)), [list(range(n))], block_size=BLOCK)
        return int(m(meta, m.allocate_kv_cache(n, BLOCK))[0].argmax())

    assert first_token(weights) == c["gen_ids"][0]
    assert first_token({k: v + 1 if k.endswith("norm.weight") else v for k, v in weights.items()}) != c["gen_ids"][0]
    cfg = gemma.config
    permuted = {k: torch.from_numpy(np.ascontiguousarray(
        unpermute_qk(v.numpy(), cfg.n_head if k.endswith("attn_q.weight") else cfg.n_head_kv)))
        if k.endswith(("attn_q.weight", "attn_k.weight")) else v for k, v in weights.items()}
    assert first_token(permuted) != c["gen_ids"][0]


#: the storage-tier tests: case 4 (423 tokens, inside the 512-token window: a load reserves every position) and case
#: 5 (783 tokens: a load of its 48 blocks is cut to the windows, each sliding group reading blocks 16-47 only)
TIER_CASES = (4, 5)


def _tier_cases(reference):
    return [reference["cases"][i] for i in TIER_CASES]


def _loadable(c):
    return (len(c["prompt_ids"]) - 1) // BLOCK  # what a tier can serve: the last token is always computed


def _group_loads(llm, cases):
    """Per KV cache group, the blocks a load of each case's loadable blocks reads (group_block_ranges)."""
    from pagedkv.tiers.connector import group_block_ranges

    windows = [getattr(g, "window", None) for g in llm.kv_cache_groups]
    out = [0] * len(windows)
    for c in cases:
        for g, (a, z) in enumerate(group_block_ranges(_loadable(c), BLOCK, windows)):
            out[g] += z - a
    return out


def _assert_all_loaded(llm, outs, cases):
    """The reference tokens, every loadable block loaded (nothing computed for it), and each group read exactly
    what group_block_ranges says (a sliding group only its window's blocks)."""
    assert gen(outs) == [c["gen_ids"] for c in cases]
    full = [_loadable(c) * BLOCK for c in cases]
    assert [o.num_cached_tokens for o in outs] == full
    st = llm.scheduler.stats
    assert st.external_tokens == sum(full) and st.cached_tokens == 0
    assert st.computed_prefill_tokens == sum(len(c["prompt_ids"]) for c in cases) - sum(full)
    want = _group_loads(llm, cases)
    assert llm.kv_tiers.group_loaded_blocks == want
    assert want[0] == sum(_loadable(c) for c in cases) and all(0 < w < want[0] for w in want[1:])
    assert llm.kv_tiers.stats["loads_failed"] == 0
    llm.block_manager.check_invariants()


def test_disk_tier_after_a_restart_with_kv_cache_groups(gemma, reference, tmp_path):
    """The disk KV tier (docs/tiers.md#kv-cache-groups): Gemma 3 on its KV cache groups stores each group's blocks
    under its own fingerprint; a restarted LLM over the same directory loads, per group, the blocks a load needs
    (case 5: the full-attention group its 48 blocks, each sliding group the 32 its window sees), computes only
    the last token's block, and gives the reference. With one block table (every layer's KV per block) too."""
    cases = _tier_cases(reference)
    n = sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases) * 8
    for restart in (False, True):
        with make_llm(gemma, num_gpu_blocks=n, kv_disk_dir=tmp_path / "g", kv_disk_gib=0.2) as llm:
            assert llm.kv_cache_groups is not None
            outs = run(llm, cases)
            if not restart:
                assert gen(outs) == [c["gen_ids"] for c in cases]
                llm.kv_tiers.connector.flush(60)
                puts = [s.stats.puts for s in llm.kv_tiers.connector.group_stores()[0]]
                assert all(p >= sum(_loadable(c) for c in cases) for p in puts)  # every group stored
            else:
                _assert_all_loaded(llm, outs, cases)
    for restart in (False, True):
        with make_llm(gemma, kv_cache_groups=False, num_gpu_blocks=n, kv_disk_dir=tmp_path / "d",
                      kv_disk_gib=0.2) as llm:
            outs = run(llm, cases)
            assert gen(outs) == [c["gen_ids"] for c in cases]
            full = [_loadable(c) * BLOCK for c in cases]
            assert [o.num_cached_tokens for o in outs] == (full if restart else [0] * len(cases))
            assert llm.scheduler.stats.external_tokens == (sum(full) if restart else 0)
            llm.block_manager.check_invariants()


def test_decode_filled_blocks_with_kv_cache_groups_load_after_a_restart(gemma, reference, tmp_path):
    """Issue 24 with KV cache groups: the blocks a decode fills are chained in every group (each group's key and
    check digest from its own root) and stored under that group's fingerprint, so a next turn continuing the
    first answer loads the answer's blocks from the disk tier after a restart: case 5 (783 tokens) and its 24
    generated tokens fill 50 blocks (48 and 49 by decode); the next turn (810 tokens) loads all 50 in the
    full-attention group and the window's 32 (blocks 18..49) in each sliding group, greedy equal to a run
    without tiers, nothing skipped unchecked."""
    import pagedkv
    from pagedkv.engine.sampling import SamplingParams
    from pagedkv.tiers.connector import group_block_ranges

    c = reference["cases"][5]
    p, answer = list(c["prompt_ids"]), list(c["gen_ids"])
    fed = len(p) + len(answer) - 1  # (the last sampled token is never fed)
    turn2 = p + answer + [236761, 108, 818]
    n = blocks(len(turn2) + 8) * 8
    with make_llm(gemma, num_gpu_blocks=n, kv_disk_dir=tmp_path, kv_disk_gib=0.3) as a:
        assert gen(run(a, [c])) == [answer]
        a.kv_tiers.connector.flush(60)
        assert a.kv_tiers.stats["store_skipped_unchecked"] == 0
        for g, st in enumerate(a.kv_tiers.connector.group_stores()[0]):  # every group holds the answer's blocks
            keys = pagedkv.block_hashes(p + answer[:fed - len(p)], BLOCK, None, g)
            assert len(keys) == fed // BLOCK == 50 and st.contains_many(keys[48:]) == (True, True)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with make_llm(gemma, num_gpu_blocks=n) as ref:
        (want,) = ref.generate([{"prompt_token_ids": turn2}], sp, use_tqdm=False)
    with make_llm(gemma, num_gpu_blocks=n, kv_disk_dir=tmp_path, kv_disk_gib=0.3) as b:  # a restart
        (o,) = b.generate([{"prompt_token_ids": turn2}], sp, use_tqdm=False)
        assert list(o.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        assert o.num_cached_tokens == b.scheduler.stats.external_tokens == 50 * BLOCK  # the answer's blocks too
        windows = [getattr(g, "window", None) for g in b.kv_cache_groups]
        assert b.kv_tiers.group_loaded_blocks == [z - a for a, z in group_block_ranges(50, BLOCK, windows)] \
            == [50] + [32] * 5
        b.kv_tiers.connector.flush(60)
        assert b.kv_tiers.stats["store_skipped_unchecked"] == 0 and b.kv_tiers.stats["loads_failed"] == 0
        b.block_manager.check_invariants()


def _flip(root, name, at=1000):
    from pagedkv.tiers import _files

    with open(_files.value_path(str(root), name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def test_shared_tier_between_replicas_with_kv_cache_groups_and_a_corrupt_value(gemma, reference, tmp_path):
    """A shared directory tier (``kv_shared="file:///..."``) written by replica A, read by replica B (both open at
    once): B loads every group's needed blocks and gives the reference. Then one byte flipped in two values: case
    4's full-attention block 10 (a load that reserves every position: the first 10 blocks are used, the rest
    computed) and case 5's sliding group 2 block 20 (a load cut to the windows: no shorter end is usable, so the
    request is queued again and computed, ``requeued_window_loads``): both refused and counted as corrupt, the
    output of replica C still the reference."""
    import pagedkv

    cases = _tier_cases(reference)
    root = tmp_path / "shared"
    url = f"file://{root}"
    n = sum(blocks(len(c["prompt_ids"]) + c["max_tokens"]) for c in cases) * 8
    with make_llm(gemma, num_gpu_blocks=n, kv_shared=url) as a, make_llm(gemma, num_gpu_blocks=n, kv_shared=url) as b:
        assert gen(run(a, cases)) == [c["gen_ids"] for c in cases]
        a.kv_tiers.connector.flush(60)
        _assert_all_loaded(b, run(b, cases), cases)
        assert [c.medium for c in b.kv_tiers.connector.counters()] == ["SHARED"]
        stores = b.kv_tiers.connector.group_stores()[0]
    c4, c5 = cases
    _flip(root, stores[0].names(pagedkv.block_hashes(c4["prompt_ids"][:11 * BLOCK], BLOCK))[10])
    _flip(root, stores[2].names(pagedkv.block_hashes(c5["prompt_ids"][:21 * BLOCK], BLOCK, None, 2))[20])
    with make_llm(gemma, num_gpu_blocks=n, kv_shared=url) as c:
        outs = run(c, cases)
        assert gen(outs) == [x["gen_ids"] for x in cases]  # never served: computed
        assert [o.num_cached_tokens for o in outs] == [10 * BLOCK, 0]
        st = c.scheduler.stats
        assert st.external_tokens == 10 * BLOCK and st.requeued_window_loads == 1
        assert c.kv_tiers.stats["loads_failed"] == 2
        assert sum(s.stats.corrupt for s in c.kv_tiers.connector.group_stores()[0]) == 2
        assert c.kv_tiers.group_loaded_blocks == [10] + [10] * (len(c.kv_cache_groups) - 1)
        c.block_manager.check_invariants()


def test_redis_tier_between_replicas_with_kv_cache_groups(gemma, reference, redis_url):
    """The shared tier on Redis: case 5 computed by replica A, loaded by replica B (a sliding group only its
    window's 32 blocks), the reference tokens."""
    cases = [reference["cases"][5]]
    n = blocks(len(cases[0]["prompt_ids"]) + 24) * 8
    with make_llm(gemma, num_gpu_blocks=n, kv_shared=redis_url) as a:
        assert gen(run(a, cases)) == [c["gen_ids"] for c in cases]
        a.kv_tiers.connector.flush(60)
    with make_llm(gemma, num_gpu_blocks=n, kv_shared=redis_url) as b:
        _assert_all_loaded(b, run(b, cases), cases)
        assert b.kv_tiers.group_loaded_blocks[1] == 32


def test_server_restarted_over_its_disk_tier_with_kv_cache_groups(gemma, reference, tmp_path):
    """``pagedkv serve``'s server over Gemma 3 on its KV cache groups with a disk tier: it answers case 4's prompt
    (token ids) with the reference tokens, stops; a new server over the same directory answers it again from
    every group's loaded blocks, the same text."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from pagedkv.server.launch import make_server

    c = reference["cases"][4]
    texts = []
    for i in range(2):
        llm = make_llm(gemma, num_gpu_blocks=400, kv_disk_dir=tmp_path, kv_disk_gib=0.1)
        srv = make_server(llm, model_name="m", max_waiting=8).start_in_thread()
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": c["prompt_ids"], "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True}, timeout=300)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        finally:
            srv.close()
            llm.close()
        tiers = getattr(llm.kv_tiers, "inner", None) or llm.kv_tiers  # (the server wraps them in its KV port)
        loaded = llm.scheduler.stats.external_tokens
        assert loaded == (_loadable(c) * BLOCK if i else 0)
        assert tiers.group_loaded_blocks == ([_loadable(c)] * len(llm.kv_cache_groups) if i
                                             else [0] * len(llm.kv_cache_groups))
    assert texts[0] == texts[1] and texts[0]


def test_retention_with_kv_cache_groups_pins_priorities_and_a_policy(gemma, reference):
    """Gemma 3 on KV cache groups with an eviction policy, priority scheduling and a pin (issue 23 item 4): the pin
    (through LLM.pin_prefix) holds the full-attention group's blocks and each sliding group's last window of the
    783-token case, the other cases evict everything else, and the rerun hits the pinned prefix and gives the
    reference tokens."""
    c5, others = reference["cases"][5], [reference["cases"][i] for i in (3, 4)]
    n5 = len(c5["prompt_ids"])
    window_blocks = blocks(512) + 1  # a window of 512 tokens ending anywhere inside a block
    budget = n5 // BLOCK + 5 * window_blocks
    # room for case 3 (945 tokens: 6 x 60 blocks) beside the pin; cases 3 and 4 together need more than is left
    llm = make_llm(gemma, num_gpu_blocks=budget + 420, eviction_policy="slru", pin_budget_blocks=budget,
                   scheduling_policy="priority", max_num_batched_tokens=1024)
    assert llm.kv_cache_groups is not None and llm.block_manager.config.eviction_policy == "slru"
    pin = llm.pin_prefix({"prompt_token_ids": c5["prompt_ids"]})
    assert pin.num_tokens == n5 // BLOCK * BLOCK and n5 // BLOCK < pin.num_blocks <= budget
    evictions = llm.block_manager.stats.evictions
    outs = run(llm, others)
    assert gen(outs) == [c["gen_ids"] for c in others]
    assert llm.block_manager.stats.evictions > evictions
    from pagedkv.engine.sampling import SamplingParams

    again = llm.generate([{"prompt_token_ids": c5["prompt_ids"]}],
                         SamplingParams(temperature=0, max_tokens=c5["max_tokens"], ignore_eos=True),
                         use_tqdm=False, priority=-1)[0]
    assert again.num_cached_tokens == (n5 - 1) // BLOCK * BLOCK
    assert list(again.outputs[0].token_ids) == c5["gen_ids"]
    llm.unpin(pin.pin_id)
    llm.block_manager.check_invariants()
