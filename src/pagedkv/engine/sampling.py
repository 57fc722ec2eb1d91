"""Sampling parameters (in the style of vLLM's ``SamplingParams``) and the sampler.

The sampler draws by inverse CDF: one uniform number per sample from the request's own generator, located by
``searchsorted`` in the cumulative probabilities, instead of ``torch.multinomial`` (which draws one exponential
per vocabulary entry: 49k random numbers per token for SmolLM2). It touches only what a request needs:

* greedy (``temperature == 0``): ``argmax``, batched over every greedy row;
* top-k: ``topk`` first, then softmax / top-p / draw over those ``k`` values only;
* top-p alone: the smallest ``topk`` (64, 256, ... entries) whose probability mass reaches ``top_p``, found by
  growing ``k`` (usually one round), then the draw among those;
* plain sampling: one softmax + cumulative sum over the rows that share a temperature, batched.

Determinism: a row's draws come only from its own ``torch.Generator`` (one ``torch.rand`` of ``num`` values per
row and step), so a seeded request gives the same tokens whatever else shares its batch.

:func:`sample_bounded` draws the same tokens from *bounded approximate* logits (:mod:`pagedkv.engine.lm_head`:
low-precision logits ``l~`` with ``|l - l~| <= E`` per row) without computing the float32 logits ``l`` of the whole
vocabulary: greedy and top-k rows rescore in float32 only the entries whose interval reaches the best (the k-th
best) lower bound; plain sampling over the whole vocabulary is rejection sampling; top-p alone computes its row's
float32 logits (the nucleus needs the exact distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgumentError

__all__ = ["SamplingParams", "sample", "sample_batch", "sample_bounded"]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate from one prompt.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k, ``top_p == 1`` disables nucleus
    sampling. ``seed`` makes a request's samples reproducible whatever else runs in the batch. Generation stops
    at ``max_tokens`` new tokens, at end-of-sequence (unless ``ignore_eos``), at a token of ``stop_token_ids``, or
    when the text contains one of ``stop`` (the stop string is not included in the text).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidArgumentError(f"SamplingParams: {msg}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            bad(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            bad(f"seed must be an int or None, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


#: inverse-CDF sampling in two levels: entries per chunk (the chunk sums are one vectorized reduction, the
#: cumulative sums run over the chunk sums and within one chunk only). A full-vocabulary ``cumsum`` in float64 is
#: sequential: 0.6-0.8 s for 32 x 262,144 entries (Gemma 3's vocabulary) on the shared 2-core machine, against
#: ~0.05 s for the chunk sums, in the same process.
_CHUNK = 256


def _chunk_cdf(probs: torch.Tensor) -> torch.Tensor:
    """Cumulative float64 sums of consecutive ``_CHUNK``-entry chunks of the last dimension (the last chunk may be
    shorter): ``(..., ceil(V / _CHUNK))``; each chunk summed in the weights' dtype (one vectorized reduction), the
    running sum over chunks in float64. The same for a row alone and in a batch. O(V)."""
    v = probs.shape[-1]
    full = v // _CHUNK * _CHUNK
    parts = [probs[..., :full].unflatten(-1, (full // _CHUNK, _CHUNK)).sum(-1).double()]
    if full < v:
        parts.append(probs[..., full:].sum(-1, keepdim=True).double())
    sums = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    return torch.cumsum(sums, dim=-1)


def _draw_cdf(probs: torch.Tensor, ccdf: torch.Tensor, num: int, generator: torch.Generator | None) -> list[int]:
    """``num`` indices drawn from the non-negative weights ``probs`` (one row) with ``ccdf = _chunk_cdf(probs)``:
    ``u`` uniform in [0, total), the chunk whose cumulative sum first exceeds ``u``, then the entry within that
    chunk (the first whose cumulative weight exceeds the rest of ``u``): a zero-weight entry is never chosen. One
    uniform number per draw from ``generator``."""
    u = torch.rand(num, generator=generator, dtype=torch.float64) * ccdf[-1]
    chunks = torch.searchsorted(ccdf, u, right=True).clamp_(max=ccdf.shape[-1] - 1).tolist()
    out = []
    for c, x in zip(chunks, u.tolist()):
        lo = c * _CHUNK
        within = torch.cumsum(probs[lo:lo + _CHUNK].double(), dim=-1)
        rest = torch.tensor([x - (float(ccdf[c - 1]) if c else 0.0)], dtype=torch.float64)
        # rounding (the chunk sum and the cumulative sum round differently) must not step past the last weight
        rest = torch.minimum(rest, torch.nextafter(within[-1:], torch.zeros(1, dtype=torch.float64)))
        out.append(lo + int(torch.searchsorted(within, rest, right=True)))
    return out


def _draw(probs: torch.Tensor, num: int, generator: torch.Generator | None) -> list[int]:
    """``num`` indices drawn from the (unnormalized, non-negative) weights ``probs`` of one row."""
    return _draw_cdf(probs, _chunk_cdf(probs), num, generator)


def _nucleus(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely entries of descending probabilities ``sorted_p`` until their mass reaches
    ``top_p`` (the first entry always stays); the rest become 0."""
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    keep[..., 0] = True  # always keep the most likely token (a denormal top_p rounds to 0 in float32)
    return sorted_p * keep


def _sample_row(logits: torch.Tensor, params: SamplingParams, num: int,
                generator: torch.Generator | None) -> list[int]:
    """One row of float32 logits ``(vocab,)``, non-greedy."""
    vocab = logits.shape[-1]
    inv_t = 1.0 / params.temperature
    if 0 < params.top_k < vocab:
        vals, idx = torch.topk(logits, params.top_k)  # sorted, descending
        p = torch.softmax(vals * inv_t, dim=-1)
        if params.top_p < 1.0:
            p = _nucleus(p, params.top_p)
        return idx[_draw(p, num, generator)].tolist()
    probs = torch.softmax(logits * inv_t, dim=-1)
    if params.top_p < 1.0:
        k = min(64, vocab)
        while True:  # the smallest top-k holding the nucleus: the rest of the vocabulary is never sorted
            vals, idx = torch.topk(probs, k)
            if k == vocab or float(vals.sum()) >= params.top_p:
                break
            k = min(4 * k, vocab)
        return idx[_draw(_nucleus(vals, params.top_p), num, generator)].tolist()
    return _draw(probs, num, generator)


def sample(logits: torch.Tensor, params: SamplingParams, num: int, generator: torch.Generator | None) -> list[int]:
    """Draw ``num`` tokens from one row of float32 logits ``(vocab,)`` (independently, with replacement)."""
    if params.temperature == 0:
        return [int(torch.argmax(logits))] * num
    return _sample_row(logits, params, num, generator)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], nums: list[int],
                 generators: list[torch.Generator | None]) -> list[list[int]]:
    """Row ``i`` of float32 logits ``(R, vocab)`` gives ``nums[i]`` tokens drawn with ``params[i]`` from
    ``generators[i]``; the same draws as :func:`sample` row by row, with the greedy rows (one ``argmax``) and the
    plain-sampling rows of equal temperature (one softmax) batched. O(R * vocab)."""
    out: list[list[int] | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        best = torch.argmax(logits[greedy] if len(greedy) < len(params) else logits, dim=-1).tolist()
        for i, t in zip(greedy, best):
            out[i] = [int(t)] * nums[i]
    plain: dict[float, list[int]] = {}
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        if p.top_p >= 1.0 and not 0 < p.top_k < logits.shape[-1]:
            plain.setdefault(float(p.temperature), []).append(i)
        else:
            out[i] = _sample_row(logits[i], p, nums[i], generators[i])
    for temp, rows in plain.items():
        sub = logits[rows] if len(rows) < logits.shape[0] else logits
        probs = torch.softmax(sub * (1.0 / temp), dim=-1)
        ccdf = _chunk_cdf(probs)  # one reduction for every row
        for r, i in enumerate(rows):
            out[i] = _draw_cdf(probs[r], ccdf[r], nums[i], generators[i])
    return out  # type: ignore[return-value]


#: a greedy / top-k row with more candidates than this computes its whole float32 row instead
_MAX_CANDIDATES = 4096
#: rejection sampling: proposals tried per sample before the row's float32 logits are computed (exact either way).
#: A proposal costs a draw and one hidden-size dot product (~0.1 ms); the float32 row costs a read of the whole
#: table (Gemma 3: ~50-90 ms), so trying a few hundred proposals first pays off
_MAX_TRIALS = 256
#: rejection sampling is skipped (float32 row at once) when bound / temperature exceeds this (acceptance below
#: ~1 %: the expected proposals would cost about the float32 row)
_MAX_BOUND_OVER_T = 5.0


def _trials_per_round(bound_over_t: float) -> int:
    """Proposals drawn, rescored and tested together (one gather, one ``rand``) per round: about two expected
    acceptances' worth (acceptance is at least ``exp(-2 E / T)``, typically ``exp(-E / T)``)."""
    return int(min(64, max(2, math.ceil(2.0 * math.exp(bound_over_t)))))


def _kind(p: SamplingParams, vocab: int) -> str:
    if p.temperature == 0:
        return "greedy"
    if 0 < p.top_k < vocab:
        return "topk"
    if p.top_p < 1.0:
        return "exact"  # top-p alone: the nucleus needs the whole distribution
    return "plain"


def sample_bounded(head, h: torch.Tensor, params: list[SamplingParams], nums: list[int],
                   generators: list[torch.Generator | None]) -> list[list[int]]:
    """Tokens drawn as :func:`sample_batch` draws them from ``head.logits(h)`` (float32 logits of the hidden states
    ``h`` ``(R, hidden)``; greedy, top-k and top-p rows: the very same tokens; plain sampling: the same
    distribution), computed from ``head.approx(h)`` (bounded low-precision logits, :class:`pagedkv.engine.lm_head.
    LMHead`) and exact float32 logits of few entries (``head.exact_at``):

    * greedy: the entries whose upper bound ``l~_i + E`` reaches the best lower bound ``max(l~) - E`` (usually one:
      then it is the argmax without rescoring), rescored; their argmax (the first on a tie, as ``argmax``);
    * top-k: the entries whose upper bound reaches the k-th best lower bound hold the exact top k; rescored, then
      :func:`sample`'s top-k draw (top-p within the k included) on them;
    * plain sampling (whole vocabulary, no top-p): rejection sampling. A proposal ``i`` is drawn from
      ``softmax(l~ / T)`` by the inverse-CDF draw and accepted with probability ``exp((l_i - l~_i - E) / T) <= 1``
      (``l_i`` rescored): an accepted ``i`` has exactly the distribution ``softmax(l / T)``. Proposals go in
      rounds (:func:`_trials_per_round`), the first accepted of a round being the sample. After
      ``_MAX_TRIALS`` rejections (or at once when ``E / T`` is large) the row's float32 logits are computed and the
      sample drawn from them, which keeps the result exact;
    * top-p alone, a row that cannot be bounded, or too many candidates: the row's float32 logits and
      :func:`sample_batch`.

    Draws come from each row's own generator, and a row's approximate logits and bound depend on that row alone
    (up to the bf16 product's summation order, as the float32 logits), so a seeded request gives the same tokens
    whatever else shares its batch. Plain sampling draws other random numbers than :func:`sample_batch` (the
    proposals and acceptance tests): the same distribution, another sequence for a given seed. O(R x vocab) besides
    the low-precision product; O(candidates x hidden) rescoring.
    """
    n_rows = h.shape[0]
    vocab = head.vocab_size
    out: list[list[int] | None] = [None] * n_rows
    kinds = [_kind(p, vocab) for p in params]
    fallback: list[int] = [i for i, k in enumerate(kinds) if k == "exact"]
    todo = [i for i, k in enumerate(kinds) if k != "exact"]
    if todo:
        hs = h if len(todo) == n_rows else h[todo]
        # (no plain-sampling row: the tokens do not depend on the approximate values, which may then come from the
        # quantized table's float32 products; a plain row's proposals always come from the bf16 product)
        ap = head.approx(hs, proposals=any(kinds[i] == "plain" for i in todo))
        vals, bound = ap.values, ap.bound.tolist()
        finite = [math.isfinite(b) for b in bound]
        greedy = [j for j, i in enumerate(todo) if kinds[i] == "greedy" and finite[j]]
        if greedy:
            _greedy_rows(head, hs, vals, bound, todo, greedy, out, nums, fallback)
        for j, i in enumerate(todo):
            if kinds[i] == "topk" and finite[j]:
                _topk_row(head, hs, vals, bound, j, params[i], nums[i], generators[i], out, i, fallback)
        plain: dict[float, list[int]] = {}
        for j, i in enumerate(todo):
            if kinds[i] == "plain" and finite[j]:
                if bound[j] / params[i].temperature > _MAX_BOUND_OVER_T:
                    fallback.append(i)
                else:
                    plain.setdefault(float(params[i].temperature), []).append(j)
        for temp, js in plain.items():
            _plain_rows(head, hs, vals, bound, temp, js, todo, nums, generators, out, fallback)
        fallback += [i for j, i in enumerate(todo) if not finite[j]]
    if fallback:
        fallback.sort()
        head.stats["fallback_rows"] += len(fallback)
        exact = head.logits(h[fallback])
        drawn = sample_batch(exact, [params[i] for i in fallback], [nums[i] for i in fallback],
                             [generators[i] for i in fallback])
        for i, d in zip(fallback, drawn):
            if out[i] is None:
                out[i] = d
            else:  # a plain row that gave up part-way: its remaining samples from the exact logits
                out[i] = out[i] + d[: nums[i] - len(out[i])]
    return out  # type: ignore[return-value]


#: greedy: entries per chunk of the chunk maxima (one vectorized ``amax`` over the rows; the candidates are looked
#: for only in the chunks whose maximum reaches the threshold, usually one)
_GREEDY_CHUNK = 256


def _greedy_rows(head, hs, vals, bound, todo, rows, out, nums, fallback) -> None:
    sub = vals[rows] if len(rows) < vals.shape[0] else vals
    n, vocab = sub.shape
    full = vocab // _GREEDY_CHUNK * _GREEDY_CHUNK
    cmax = sub[:, :full].unflatten(1, (full // _GREEDY_CHUNK, _GREEDY_CHUNK)).amax(dim=2)
    if full < vocab:
        cmax = torch.cat([cmax, sub[:, full:].amax(dim=1, keepdim=True)], dim=1)
    thr = cmax.amax(dim=1).double() - 2.0 * torch.tensor([bound[j] for j in rows], dtype=torch.float64)
    # the float64 threshold rounded to float32 and lowered one ulp: no candidate is lost to the rounding
    thr32 = torch.nextafter(thr.to(torch.float32), torch.tensor(-math.inf))
    hot = (cmax >= thr32[:, None]).nonzero().tolist()  # (row, chunk), ascending
    by_row: dict[int, list[int]] = {}
    for r, c in hot:
        by_row.setdefault(r, []).append(c)
    pair_rows: list[int] = []
    pair_idx: list[torch.Tensor] = []
    owners: list[int] = []
    for k in range(n):
        i = todo[rows[k]]
        chunks = by_row[k]
        if len(chunks) * _GREEDY_CHUNK > 4 * _MAX_CANDIDATES:
            fallback.append(i)
            continue
        cand = torch.cat([(sub[k, c * _GREEDY_CHUNK:(c + 1) * _GREEDY_CHUNK] >= thr32[k]).nonzero()[:, 0]
                          + c * _GREEDY_CHUNK for c in chunks])
        if cand.numel() == 1:  # one candidate: the argmax, nothing to rescore
            out[i] = [int(cand[0])] * nums[i]
        elif cand.numel() > _MAX_CANDIDATES:
            fallback.append(i)
        else:
            pair_rows.append(rows[k])
            pair_idx.append(cand)
            owners.append(i)
    if not owners:
        return
    local = torch.cat([torch.full_like(c, r) for r, c in zip(pair_rows, pair_idx)])
    exact = head.exact_at(hs, local, torch.cat(pair_idx))
    for i, c, e in zip(owners, pair_idx, torch.split(exact, [len(c) for c in pair_idx])):
        out[i] = [int(c[int(torch.argmax(e))])] * nums[i]  # candidates ascending: argmax's first max wins a tie


def _topk_row(head, hs, vals, bound, j, p, num, gen, out, i, fallback) -> None:
    row = vals[j]
    kth = torch.topk(row, p.top_k).values[-1].double() - 2.0 * bound[j]
    thr = torch.nextafter(kth.to(torch.float32), torch.tensor(-math.inf))
    cand = (row >= thr).nonzero()[:, 0]
    if cand.numel() > p.top_k + _MAX_CANDIDATES:
        fallback.append(i)
        return
    full = torch.full((row.shape[0],), -math.inf, dtype=torch.float32)
    full[cand] = head.exact_at(hs, torch.full_like(cand, j), cand)
    out[i] = _sample_row(full, p, num, gen)


def _plain_rows(head, hs, vals, bound, temp, js, todo, nums, generators, out, fallback) -> None:
    sub = vals[js] if len(js) < vals.shape[0] else vals
    probs = head.buffer("probs", tuple(sub.shape))  # (reused: a fresh tensor costs page faults)
    scaled = sub if temp == 1.0 else torch.mul(sub, 1.0 / temp, out=head.buffer("scaled", tuple(sub.shape)))
    torch.ops.aten._softmax.out(scaled, -1, False, out=probs)
    ccdf = _chunk_cdf(probs)
    for r, j in enumerate(js):
        i = todo[j]
        gen = generators[i]
        got: list[int] = []
        per_round = _trials_per_round(bound[j] / temp)
        row = torch.tensor([j])
        while len(got) < nums[i]:
            tried = 0
            while tried < _MAX_TRIALS:  # proposals in rounds; the first accepted one of a round is the sample
                m = min(per_round, _MAX_TRIALS - tried)
                toks = torch.tensor(_draw_cdf(probs[r], ccdf[r], m, gen), dtype=torch.int64)
                exact = head.exact_at(hs, row.expand(m), toks).double()
                log_acc = (exact - sub[r, toks].double() - bound[j]) / temp
                u = torch.rand(m, generator=gen, dtype=torch.float64)
                ok = (u < torch.exp(log_acc.clamp(max=0.0))).nonzero()
                if ok.numel():
                    k = int(ok[0, 0])
                    head.stats["rejections"] += k
                    got.append(int(toks[k]))
                    break
                head.stats["rejections"] += m
                tried += m
            else:
                break  # give up: the remaining samples come from the exact logits (sample_bounded)
        out[i] = got
        if len(got) < nums[i]:
            fallback.append(i)
