"""paged_attention on random tensors against a dense per-sequence attention, and the batched sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_helpers import ScrambledPager

torch = pytest.importorskip("torch")

N_HEAD, N_KV, D, BS = 4, 2, 8, 4


def dense(q, k, v, q_pos, window):
    """Attention of queries at ``q_pos`` over keys 0..len(k)-1 of one sequence, causal (+ window)."""
    kh = k.repeat_interleave(N_HEAD // N_KV, dim=1)  # (keys, n_head, d)
    vh = v.repeat_interleave(N_HEAD // N_KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kh) / math.sqrt(D)
    kp = torch.arange(k.shape[0])
    allowed = kp[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= kp[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh).reshape(len(q_pos), N_HEAD * D)


def run_steps(steps, window, plan_window="meta"):
    """Run steps of ``{seq: n_new}`` through paged_attention; compare every output row with ``dense``."""
    from pagedkv.engine.model import build_attention_metadata
    from pagedkv.engine.paged_attention import AttentionWorkspace, paged_attention, plan_paged_attention

    g = torch.Generator().manual_seed(0)
    pager = ScrambledPager(64, BS, seed=1)
    cache = torch.zeros(2, 64, BS, N_KV, D)
    hist: dict[str, tuple[list, list]] = {}
    ws = AttentionWorkspace()
    for step in steps:
        seqs = list(step)
        computed = [pager.lens.get(s, 0) for s in seqs]
        slots = [x for s in seqs for x in pager.append(s, step[s])]
        meta = build_attention_metadata([[1] * step[s] for s in seqs], computed, slots,
                                        [pager.tables[s] for s in seqs], block_size=BS, sliding_window=window)
        t = meta.num_tokens
        q = torch.randn(t, N_HEAD, D, generator=g)
        kv = torch.randn(t, 2 * N_KV, D, generator=g)
        k, v = kv[:, :N_KV], kv[:, N_KV:]  # strided views, as a fused projection gives them
        plan = plan_paged_attention(meta, BS, sliding_window=plan_window)
        out = paged_attention(q, k, v, cache, plan, scale=1 / math.sqrt(D), workspace=ws)
        row = 0
        for s, c in zip(seqs, computed):
            n = step[s]
            ks, vs = hist.setdefault(s, ([], []))
            ks.append(k[row:row + n])
            vs.append(v[row:row + n])
            want = dense(q[row:row + n], torch.cat(ks), torch.cat(vs), torch.arange(c, c + n),
                         window if plan_window == "meta" else plan_window)
            torch.testing.assert_close(out[row:row + n], want, atol=1e-5, rtol=1e-5)
            row += n


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_steps_match_dense_attention(window):
    # fresh prompts of several lengths, then decodes at equal and unequal contexts, a chunk, a new prompt
    run_steps([{"a": 7, "b": 7, "c": 3}, {"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 6, "d": 9},
               {"a": 1, "b": 1, "c": 1, "d": 1}, {"d": 1}], window)


def test_the_plan_takes_a_window_per_call():
    """A model with per-layer windows plans each window from the same metadata (Gemma 3's local layers)."""
    run_steps([{"a": 9, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 1}], None, plan_window=3)


# ------------------------------------------------------------------------------------------------ sampling


def gens(seed, n):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_sample_batch_rows_equal_single_rows_and_batch_composition_does_not_matter():
    from pagedkv.engine.sampling import SamplingParams, sample, sample_batch

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
          SamplingParams(top_p=0.5), SamplingParams(temperature=0.7)]
    batch = sample_batch(logits, ps, [1, 3, 2, 2, 1], gens(10, 5))
    single = [sample(logits[i], ps[i], n, g) for i, (n, g) in enumerate(zip([1, 3, 2, 2, 1], gens(10, 5)))]
    assert batch == single
    assert batch[0] == [int(logits[0].argmax())]
    # row 4 alone, with the same generator state, draws the same tokens
    assert sample_batch(logits[4:], ps[4:], [1], gens(14, 1)) == [batch[4]]


def test_draws_follow_the_distribution_and_respect_top_k_and_top_p():
    from pagedkv.engine.sampling import SamplingParams, sample

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log()
    n = 20000
    draws = np.bincount(sample(logits, SamplingParams(), n, torch.Generator().manual_seed(0)), minlength=5) / n
    assert np.abs(draws - probs.numpy()).max() < 0.015
    assert draws[4] == 0  # a zero-probability token is never drawn
    top2 = set(sample(logits, SamplingParams(top_k=2), 2000, torch.Generator().manual_seed(1)))
    assert top2 == {0, 1}
    # nucleus 0.75: 0.5 + 0.3 reach it, 0.15 and 0.05 are cut
    nucleus = np.bincount(sample(logits, SamplingParams(top_p=0.75), n, torch.Generator().manual_seed(2)),
                          minlength=5) / n
    assert nucleus[2:].sum() == 0 and abs(nucleus[0] - 0.5 / 0.8) < 0.015
    # a nucleus wider than the first top-k probed (64 entries) over a flat vocabulary
    flat = torch.zeros(1000)
    wide = set(sample(flat, SamplingParams(top_p=0.5), 4000, torch.Generator().manual_seed(3)))
    assert 400 < len(wide) <= 500
