"""The contiguous-cache reference forward reproduces the independent HF greedy output."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.engine


def test_reference_greedy_matches_hf(engine, reference_case):
    prompt = reference_case["prompt_ids"]
    result = engine.reference_greedy(tuple(prompt), len(reference_case["gen_ids"]))
    assert result.token_ids == reference_case["gen_ids"]


def test_reference_prefill_equals_incremental_decode(engine, reference_case):
    """Logits of a prompt computed in one pass equal those computed token by token."""
    ref = engine.reference
    prompt = reference_case["prompt_ids"][:12]
    whole = ref.forward(prompt, ref.new_cache(16))
    cache = ref.new_cache(16)
    stepwise = torch.cat([ref.forward([t], cache) for t in prompt])
    torch.testing.assert_close(stepwise, whole, atol=1e-4, rtol=1e-5)


def test_sliding_window_mask():
    from pagedkv.engine.reference import ReferenceLlama

    pos = torch.arange(6)
    full = ReferenceLlama.attention_mask(pos, pos, None)
    assert torch.equal(full, torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    win = ReferenceLlama.attention_mask(pos, pos, 2)
    assert win[5].tolist() == [False, False, False, False, True, True]
    assert win.sum(1).tolist() == [1, 2, 2, 2, 2, 2]
