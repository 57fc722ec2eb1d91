"""The fused few-row Llama step (``pkv_llama_step``: every layer of a decode step in one C call, model.PagedLlama
._hidden_fused): the same hidden states as the torch path within float32 rounding, the same KV cache written, the
greedy references of the other engine tests, and the torch path wherever it does not apply."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.engine

from pagedkv.engine import cpu  # noqa: E402
from pagedkv.engine.model import DenseLinear, build_attention_metadata  # noqa: E402


@pytest.fixture
def paged(engine):
    if cpu.step_kernel("pkv_llama_step") is None:
        pytest.skip(f"kernels: {cpu.kernel_status()}")
    assert engine.paged._fused_table is not None
    return engine.paged


def _torch_path(monkeypatch):
    monkeypatch.setitem(cpu._state, "pkv_llama_step", None)  # step_kernel() -> None: the torch path


def _prefill(model, kv, prompts, bs):
    tables, slots, starts = [], [], 0
    for p in prompts:
        nb = -(-(len(p) + 8) // bs)
        tables.append(list(range(starts, starts + nb)))
        slots += [starts * bs + i for i in range(len(p))]
        starts += nb
    model.hidden(build_attention_metadata(prompts, [0] * len(prompts), slots, tables, block_size=bs), kv)
    return tables


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_equals_the_torch_path(paged, monkeypatch, batch):
    bs = 4
    prompts = [[1, 504, 3458, 282, 4077, 30, 216][: 7 - b] for b in range(batch)]
    kv_a, kv_b = paged.allocate_kv_cache(32, bs), paged.allocate_kv_cache(32, bs)
    tables = _prefill(paged, kv_a, prompts, bs)
    with monkeypatch.context() as m:
        _torch_path(m)
        _prefill(paged, kv_b, prompts, bs)
    assert torch.equal(kv_a, kv_b)  # prefill: the torch path in both
    n = [len(p) for p in prompts]
    slots = [tables[b][n[b] // bs] * bs + n[b] % bs for b in range(batch)]
    meta = build_attention_metadata([[42 + b] for b in range(batch)], n, slots, tables, block_size=bs)
    calls = []
    fused = paged._hidden_fused
    monkeypatch.setattr(paged, "_hidden_fused", lambda *a: calls.append(1) or fused(*a))
    ha = paged.hidden(meta, kv_a)
    assert calls == [1]
    with monkeypatch.context() as m:
        _torch_path(m)
        hb = paged.hidden(meta, kv_b)
    assert ha.shape == hb.shape == (batch, paged.config.n_embd)
    rel = float((ha - hb).norm() / hb.norm())
    assert 0 <= rel < 1e-5, rel
    kv_rel = float((kv_a - kv_b).norm() / kv_b.norm())
    assert 0 <= kv_rel < 1e-5, kv_rel
    written = kv_a.flatten(2, 3)[:, :, slots]  # the new keys and values were written, in every layer
    assert bool((written != 0).any(dim=-1).any(dim=-1).all())


def test_explicit_logits_rows_and_short_queries(paged):
    """Queries of up to 4 tokens after cached ones run fused too; ``logits_indices`` picks the rows asked for."""
    bs = 4
    kv = paged.allocate_kv_cache(16, bs)
    table = _prefill(paged, kv, [[1, 504, 3458, 282, 4077]], bs)
    meta = build_attention_metadata([[30, 216, 99]], [5], [5, 6, 7], table, block_size=bs, logits=[2, 0])
    assert meta.num_tokens <= paged._fused_rows
    kv_copy = kv.clone()
    h = paged.hidden(meta, kv)
    every = build_attention_metadata([[30, 216, 99]], [5], [5, 6, 7], table, block_size=bs, logits="all")
    with torch.inference_mode():  # (as hidden() runs it)
        full = paged._hidden_fused(every, kv_copy, _plan(paged, every, bs))
    assert full.shape[0] == 3 and torch.equal(h, full[[2, 0]])


def _plan(model, meta, bs):
    from pagedkv.engine.paged_attention import plan_paged_attention

    return plan_paged_attention(meta, bs, dtype=model.dtype)


def test_replaced_products_take_the_torch_path(paged, monkeypatch):
    """A model whose products were replaced (benchmarks/qmatmul_ab.py's dense side) does not run the fused table."""
    bs = 4
    kv = paged.allocate_kv_cache(16, bs)
    table = _prefill(paged, kv, [[1, 504, 3458]], bs)
    meta = build_attention_metadata([[42]], [3], [3], table, block_size=bs)
    monkeypatch.setattr(paged, "linears", [tuple(DenseLinear(lin.weight) for lin in layer) for layer in paged.linears])
    assert paged._hidden_fused(meta, kv, _plan(paged, meta, bs)) is None


@pytest.mark.parametrize("fused", [True, False])
def test_greedy_reference_with_and_without_the_fused_step(paged, engine, reference_case, monkeypatch, fused):
    """The independent HF greedy reference, token for token, with the fused step on (counted: every decode step of
    the request runs it) and off."""
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    if not fused:
        _torch_path(monkeypatch)
    calls = []
    inner = paged._hidden_fused
    monkeypatch.setattr(paged, "_hidden_fused", lambda *a: calls.append(1) or inner(*a))
    llm = LLM(paged, **engine_configs(num_gpu_blocks=32, max_num_seqs=8))
    n = reference_case["max_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.chat(reference_case["messages"], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference_case["gen_ids"]
    assert len(calls) == n - 1  # every step after the prompt's (a decode) tried the fused path


@pytest.mark.parametrize("groups", [False, True])
def test_gemma3_fused_step_equals_the_torch_path(gemma, monkeypatch, groups):
    """Gemma 3's fused step (``pkv_gemma3_step``: per-layer windows, rotary tables and, with KV cache groups, each
    layer's own slot, tables and slots): the greedy tokens and the final hidden states of the torch path, and it
    runs on every decode step (the greedy references of tests/engine/test_gemma3.py run on it too)."""
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    if cpu.step_kernel("pkv_gemma3_step") is None or gemma._fused_table is None:
        pytest.skip(f"kernels: {cpu.kernel_status()}")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    calls, hidden = [], []
    inner = gemma._hidden_fused
    monkeypatch.setattr(gemma, "_hidden_fused", lambda *a: calls.append(inner(*a)) or calls[-1])
    real_hidden = type(gemma).hidden
    monkeypatch.setattr(gemma, "hidden", lambda meta, kv: hidden.append(real_hidden(gemma, meta, kv)) or hidden[-1])
    got = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setitem(cpu._state, "pkv_gemma3_step", None)
            llm = LLM(gemma, block_size=16, **engine_configs(num_gpu_blocks=64, max_num_seqs=4,
                                                              kv_cache_groups=groups))
            assert (llm.kv_cache_groups is not None) == groups
            calls.clear(), hidden.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[fused] = ([list(o.outputs[0].token_ids) for o in outs], [h.clone() for h in hidden])
            assert len(calls) == 11  # every decode step (both prompts decode together) tried it, and ran it
            assert all((c is not None) == fused for c in calls)
    assert got[True][0] == got[False][0]
    for a, b in zip(got[True][1], got[False][1]):
        assert float((a - b).norm() / b.norm()) < 1e-5
