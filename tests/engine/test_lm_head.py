"""The exact fast LM head (src/pagedkv/engine/sampling.py) and the sampler on its bounds (sample_bounded).

* the bound holds against float64 on random tables, tables with outlier rows, hidden states with outliers and
  huge norms, for one row and many (both product layouts);
* greedy and top-k from the bounds equal greedy / top-k on the float32 logits, on near-ties built on purpose;
* rejection sampling draws from the float32 distribution (a chi-square test, fixed seeds), also when it gives up
  and falls back; seeded rows are reproducible whatever shares their batch.
Small tables (no model file needed).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine.sampling import LMHead  # noqa: E402
from pagedkv.engine.sampling import SamplingParams, sample_batch, sample_bounded  # noqa: E402


def _table(vocab: int, hidden: int, seed: int, outliers: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    if outliers:
        w[::97] *= 40.0  # a few rows with a much larger norm
        w[:, 3] += 2.0  # one dimension large in every row
    return w


def _hidden(rows: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * scale
    x[:, 5] *= 50.0  # a massive activation, as real hidden states have
    return x


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("outliers", [False, True])
def test_bound_holds_against_float64(rows, outliers):
    w = _table(4096, 96, seed=rows, outliers=outliers)
    head = LMHead(w)
    for scale in (1.0, 30.0, 1e-3):
        h = _hidden(rows, 96, seed=7 * rows, scale=scale)
        ap = head.approx(h)
        exact = h.double() @ w.double().t()
        err = (ap.values.double() - exact).abs().amax(dim=1)
        assert torch.all(err <= ap.bound), (err, ap.bound)
        assert torch.all(ap.bound < 0.1 * exact.abs().amax(dim=1) + 1e-20)  # and it is not vacuous
        assert torch.all(err > 0)  # the approximation really is approximate (the test can fail)


def test_block_diagonal_product_equals_the_plain_one():
    w = _table(1024, 64, seed=3)
    head = LMHead(w)
    head.prepare()
    widths = set()
    for rows in (1, 2, 5, 8, 9, 16, 17, 33):
        xt = _hidden(rows, 64, seed=rows).to(torch.bfloat16)
        plain = torch.nn.functional.linear(xt, head._bf16)
        widths.add(head.block_diagonal_width(rows))
        assert torch.allclose(head._bf16_product(xt), plain.float(), rtol=2 ** -7, atol=1e-6)
    assert widths == {1, 2, 4}


def _near_tie_head(vocab: int = 2048, hidden: int = 64, seed: int = 0) -> tuple[LMHead, torch.Tensor]:
    """A table whose rows 10, 500 and 1500 give logits within ~1e-6 of each other (and of the best) for the
    hidden states returned, closer than bf16 can resolve."""
    w = _table(vocab, hidden, seed)
    h = _hidden(4, hidden, seed + 1)
    d = h[0] / h[0].norm()
    for i, eps in ((10, 0.0), (500, 3e-6), (1500, -3e-6)):
        w[i] = w[0] - (w[0] @ d) * d + (2.0 + eps) * d / h[0].norm() * 10  # same logit ~20 + eps-ish for row 0
    return LMHead(w), h


def test_greedy_from_bounds_equals_float32_argmax_on_near_ties():
    head, h = _near_tie_head()
    exact = head.logits(h)
    params = [SamplingParams(temperature=0)] * h.shape[0]
    got = sample_bounded(head, h, params, [1] * h.shape[0], [None] * h.shape[0])
    assert [g[0] for g in got] == torch.argmax(exact, dim=1).tolist()
    assert head.stats["rescored"] >= 3  # row 0's near-tie needed rescoring
    for seed in range(20):  # random tables and states: the same argmax
        w = _table(3000, 48, seed=100 + seed, outliers=seed % 2 == 1)
        hd = LMHead(w)
        x = _hidden(5, 48, seed=200 + seed, scale=10.0)
        got = sample_bounded(hd, x, [SamplingParams(temperature=0)] * 5, [2] * 5, [None] * 5)
        assert got == [[t, t] for t in torch.argmax(hd.logits(x), dim=1).tolist()]


def test_top_k_from_bounds_draws_what_float32_logits_draw():
    head, h = _near_tie_head()
    exact = head.logits(h)
    for k, top_p in ((1, 1.0), (3, 1.0), (50, 1.0), (50, 0.8)):
        params = [SamplingParams(temperature=0.7, top_k=k, top_p=top_p)] * h.shape[0]
        a = sample_bounded(head, h, params, [3] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
        b = sample_batch(exact, params, [3] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
        assert a == b


def test_top_p_alone_uses_float32_logits():
    head, h = _near_tie_head()
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 4
    a = sample_bounded(head, h, params, [2] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
    b = sample_batch(head.logits(h), params, [2] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
    assert a == b
    assert head.stats["fallback_rows"] == 4


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    exp = probs * counts.sum()
    keep = exp >= 5
    rest = (~keep).any()
    o = torch.cat([counts[keep], counts[~keep].sum().reshape(1)]) if rest else counts[keep]
    e = torch.cat([exp[keep], exp[~keep].sum().reshape(1)]) if rest else exp[keep]
    return float(((o - e) ** 2 / e).sum()), int(o.numel() - 1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rejection_sampling_matches_the_float32_distribution(temperature):
    vocab, hidden = 64, 32
    w = _table(vocab, hidden, seed=11)
    w[7] = w[3] * 1.001  # a near-tie
    head = LMHead(w)
    x = _hidden(1, hidden, seed=12, scale=6.0)
    probs = torch.softmax(head.logits(x)[0].double() / temperature, dim=0)
    gen = torch.Generator().manual_seed(5)
    draws = 6000
    toks = sample_bounded(head, x, [SamplingParams(temperature=temperature)], [draws], [gen])[0]
    counts = torch.bincount(torch.tensor(toks), minlength=vocab).double()
    stat, dof = _chi2(counts, probs)
    # 99.9% quantile of chi-square (Wilson-Hilferty); a fixed seed, so the test is deterministic
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit)
    assert head.stats["rejections"] > 0  # the rejection step did run


def test_rejection_sampling_gives_up_exactly():
    """A temperature so low that proposals are all but always rejected: the row falls back to float32 logits and
    the samples still have the float32 distribution (here: nearly all the argmax)."""
    w = _table(256, 32, seed=21)
    head = LMHead(w)
    x = _hidden(2, 32, seed=22, scale=4.0)
    exact = head.logits(x)
    got = sample_bounded(head, x, [SamplingParams(temperature=1e-4)] * 2, [5, 5],
                         [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert got == [[int(t)] * 5 for t in torch.argmax(exact, dim=1)]
    assert head.stats["fallback_rows"] == 2


def test_seeded_plain_sampling_is_the_same_in_any_batch():
    w = _table(4096, 64, seed=31)
    head = LMHead(w)
    x = _hidden(6, 64, seed=32, scale=3.0)
    p = SamplingParams(temperature=1.0, seed=9)
    alone = sample_bounded(head, x[2:3], [p], [4], [torch.Generator().manual_seed(9)])[0]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5), p, SamplingParams(top_k=5),
              SamplingParams(temperature=1.0), SamplingParams(top_p=0.9)]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(6)]
    gens[2] = torch.Generator().manual_seed(9)
    batch = sample_bounded(head, x, params, [1, 2, 4, 1, 3, 1], gens)
    assert batch[2] == alone
    assert [len(t) for t in batch] == [1, 2, 4, 1, 3, 1]


def test_softcap_keeps_the_bound():
    w = _table(1024, 32, seed=41)
    head = LMHead(w, softcap=3.0)
    x = _hidden(3, 32, seed=42, scale=20.0)
    ap = head.approx(x)
    exact = torch.tanh((x.double() @ w.double().t()) / 3.0) * 3.0
    assert torch.all((ap.values.double() - exact).abs().amax(dim=1) <= ap.bound)
    got = sample_bounded(head, x, [SamplingParams(temperature=0)] * 3, [1] * 3, [None] * 3)
    assert [g[0] for g in got] == torch.argmax(head.logits(x), dim=1).tolist()


def test_a_row_that_cannot_be_bounded_falls_back():
    w = _table(512, 16, seed=51)
    head = LMHead(w)
    x = _hidden(2, 16, seed=52)
    x[1, 0] = float("nan")
    got = sample_bounded(head, x, [SamplingParams(temperature=0)] * 2, [1, 1], [None, None])
    assert got[0] == [int(torch.argmax(head.logits(x[:1])))]
    assert head.stats["fallback_rows"] == 1


class _PerturbedHead:
    """An LM head that keeps the contract of LMHead.approx with a coarse approximation: exact logits ``L`` plus a
    perturbation of up to ``bound`` (adversarial: the largest logits pushed down, the rest up), so the sampler's
    logic is tested where the proposal is far from the target. ``h[:, 0]`` holds the row of ``L``."""

    def __init__(self, logits: torch.Tensor, bound: float, seed: int) -> None:
        from pagedkv.engine.sampling import ApproxLogits

        self._A = ApproxLogits
        self.L = logits
        g = torch.Generator().manual_seed(seed)
        p = (torch.rand(logits.shape, generator=g) * 2 - 1) * bound
        top = logits >= logits.quantile(0.8, dim=1, keepdim=True)
        self.P = torch.where(top, -p.abs(), p.abs())
        self.E = bound
        self.vocab_size = logits.shape[1]
        self.stats = {"bf16": 0, "exact": 0, "fallback_rows": 0, "rescored": 0, "rejections": 0}
        self.buffer = LMHead(torch.zeros(1, 1)).buffer

    def approx(self, h, proposals=True):
        rows = h[:, 0].long()
        return self._A(self.L[rows] + self.P[rows], torch.full((len(rows),), self.E, dtype=torch.float64), "bf16")

    def exact_at(self, h, rows, idx):
        return self.L[h[rows, 0].long(), idx]

    def logits(self, h):
        return self.L[h[:, 0].long()]


def test_rejection_sampling_is_exact_with_a_coarse_adversarial_approximation():
    vocab = 40
    g = torch.Generator().manual_seed(61)
    L = torch.randn(2, vocab, generator=g) * 2
    head = _PerturbedHead(L, bound=0.9, seed=62)
    h = torch.tensor([[0.0], [1.0]])
    draws = 5000
    toks = sample_bounded(head, h, [SamplingParams(temperature=1.0)] * 2, [draws, 1],
                          [torch.Generator().manual_seed(63), None])[0]
    counts = torch.bincount(torch.tensor(toks), minlength=vocab).double()
    target = torch.softmax(L[0].double(), dim=0)
    proposal = torch.softmax((L[0] + head.P[0]).double(), dim=0)
    stat, dof = _chi2(counts, target)
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit)
    wrong, _ = _chi2(counts, proposal)  # the proposal alone is far off: the test has the power to fail
    assert wrong > 3 * limit, (wrong, limit)
    assert head.stats["rejections"] > 0.3 * draws


def test_greedy_and_top_k_with_a_coarse_adversarial_approximation():
    g = torch.Generator().manual_seed(71)
    L = torch.randn(6, 300, generator=g)
    L[0, 17] = L[0].max() + 1e-6  # near-ties at the top
    L[1, :5] = 4.0  # exact ties: the first index wins
    head = _PerturbedHead(L, bound=0.7, seed=72)
    h = torch.arange(6, dtype=torch.float32)[:, None]
    got = sample_bounded(head, h, [SamplingParams(temperature=0)] * 6, [1] * 6, [None] * 6)
    assert [t[0] for t in got] == torch.argmax(L, dim=1).tolist()
    params = [SamplingParams(temperature=0.9, top_k=7)] * 6
    a = sample_bounded(head, h, params, [4] * 6, [torch.Generator().manual_seed(s) for s in range(6)])
    b = sample_batch(L, params, [4] * 6, [torch.Generator().manual_seed(s) for s in range(6)])
    assert a == b
