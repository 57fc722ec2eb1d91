"""From the last hidden states to the next tokens: the LM head (exact, or bounded fast) and the sampler.

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

**The LM head** (:class:`LMHead`) reads the whole ``(vocab, hidden)`` table every decode step (Gemma 3 270M: 671 MB
in float32, more than the rest of the model). :meth:`LMHead.approx` gives bf16 logits ``l~`` (or, for a few greedy /
top-k rows, the float32 products of the file's quantized table) with a rigorous per-row bound ``E_r``, every exact
logit lying in ``[l~_i - E_r, l~_i + E_r]`` (the derivation: docs/engine-speed.md, "an exact fast LM head")::

    E_r = (A ||x|| + B (||dx|| + g_n ||x~||) + g_n C ||x||) (1 + 1e-6) + u / (1 - u) max_i |l~_i| + 1e-30

with ``x~ = bf16(x)``, ``dx = x - x~``, ``A``, ``B``, ``C`` the largest row norms of ``W - bf16(W)``, ``bf16(W)``
and ``W`` (float64, rounded up, once at load), ``u = 2^-8``, ``g_n = 1.01 (n + 2) 2^-24 / (1 - (n + 2) 2^-24)``
(bf16 products summed in float32 in any order, as oneDNN's kernels do), after a soft-cap too (1-Lipschitz).
:func:`sample_bounded` then draws the tokens of the float32 logits without computing them for the whole vocabulary:
greedy and top-k rows rescore in float32 only the entries whose interval reaches the best (the k-th best) lower
bound; plain sampling over the whole vocabulary is rejection sampling (proposal ``softmax(l~ / T)``, acceptance
``exp((l_i - l~_i - E_r) / T)``); top-p alone computes its row's float32 logits.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError

__all__ = ["ApproxLogits", "LMHead", "SamplingParams", "sample", "sample_batch", "sample_bounded"]


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
    distribution), computed from ``head.approx(h)`` (bounded low-precision logits, :class:`LMHead`) and exact
    float32 logits of few entries (``head.exact_at``):

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


# --------------------------------------------------------------------------------------------------- the LM head

_U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits)
_U_F32 = 2.0 ** -24


class ApproxLogits(NamedTuple):
    """Approximate logits ``values`` (float32 ``(R, vocab)``, soft-capped like the exact ones; a per-thread buffer
    of the head, valid until its next :meth:`LMHead.approx`) and ``bound`` (float64 ``(R,)``): ``|exact[r, i] -
    values[r, i]| <= bound[r]`` for every ``i``; ``inf`` where the row could not be bounded. ``kernel``: ``"bf16"``
    or ``"quantized"`` (the float32 products of the file's quantized table, few greedy / top-k rows)."""

    values: torch.Tensor
    bound: torch.Tensor
    kernel: str


def _up(x: float) -> float:
    """``x`` rounded up a little (float64 norms of float32 data are accurate to ~1e-15 relative)."""
    return float(x) * (1.0 + 1e-9) + 1e-300


class LMHead:
    """``logits = softcap(h W^T)`` with ``W`` the float32 ``(vocab, hidden)`` output table.

    :meth:`logits` is the exact float32 product. :meth:`approx` gives low-precision logits with a per-row bound
    (the module docstring) and :meth:`exact_at` exact logits of chosen entries, for :func:`sample_bounded`.
    ``supports_approx`` says whether the fast path applies (a
    float32 table on the CPU); :meth:`prepare` builds the low-precision copies (O(vocab x hidden), once).
    """

    #: rows up to which greedy / top-k steps take the quantized kernel's float32 logits (:meth:`approx`); measured
    #: (benchmarks/qmatmul_ab.py --head): SmolLM2's Q8_0 table 1.7 / 2.4 ms at 1 / 4 rows against 2.5 / 2.6 ms
    #: for the bf16 product, 4.5 against 2.8 at 8
    QUANT_ROWS = 4

    def __init__(self, weight: torch.Tensor, *, softcap: float | None = None, quantized: Any = None) -> None:
        self.weight = weight
        self.softcap = softcap
        #: the table's quantized blocks (a :class:`pagedkv.engine.model.QuantLinear` of the file's Q8_0 / ...
        #: table) or ``None``: few greedy / top-k rows read it instead of the bf16 copy (:meth:`approx`)
        self.quantized = quantized if getattr(quantized, "uses_kernel", False) else None
        self._bf16: torch.Tensor | None = None
        self._consts: dict[str, tuple[float, float]] = {}  # kernel -> (A, B)
        self._c_norm = 0.0
        n = weight.shape[1]
        self._gamma = 1.01 * (n + 2) * _U_F32 / (1 - (n + 2) * _U_F32)
        #: how often each path ran (for tests and profiling): approx calls per kernel, rows rescored, fallbacks
        self.stats = {"bf16": 0, "quantized": 0, "exact": 0, "fallback_rows": 0, "rescored": 0, "rejections": 0}
        #: wall seconds spent in the products (:meth:`logits`, :meth:`approx`, :meth:`exact_at`)
        self.seconds = 0.0
        self._local = threading.local()  # per-thread buffers (a model may be shared by replica threads)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A per-thread scratch tensor of ``shape`` reused from call to call (grown as needed; a fresh 30 MB tensor
        per step costs more in page faults than its arithmetic: a softmax of 32 x 262,144 into a new tensor 113 ms,
        into a reused one 17 ms). Valid until the next call for ``name`` on this thread."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        n = math.prod(shape)
        b = bufs.get((name, dtype))
        if b is None or b.numel() < n:
            b = bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
        return b[:n].view(shape)

    @property
    def supports_approx(self) -> bool:
        return self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def extra_bytes(self) -> int:
        """Bytes held by the low-precision copies (0 before :meth:`prepare`)."""
        return self._bf16.numel() * 2 if self._bf16 is not None else 0

    # ------------------------------------------------------------------ exact
    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Exact float32 logits ``(R, vocab)`` of hidden states ``h`` ``(R, hidden)``. O(R x vocab x hidden)."""
        self.stats["exact"] += 1
        t = time.perf_counter()
        out = self._cap(F.linear(h, self.weight).float())
        self.seconds += time.perf_counter() - t
        return out

    def exact_at(self, h: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Exact float32 logits of the pairs ``(rows[k], idx[k])`` (int64 tensors of equal length): the table rows
        gathered and multiplied in float32. O(len(idx) x hidden)."""
        self.stats["rescored"] += int(idx.numel())
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.float32)
        t = time.perf_counter()
        w = self.weight.index_select(0, idx)
        x = h.index_select(0, rows) if h.shape[0] > 1 else h.expand(idx.numel(), -1)
        out = self._cap(torch.linalg.vecdot(w, x.to(w.dtype)).float())
        self.seconds += time.perf_counter() - t
        return out

    # ------------------------------------------------------------------ approximate
    @torch.inference_mode()
    def prepare(self) -> None:
        """Build the bf16 copy and its norm constants (once; about a second for Gemma 3's table)."""
        if self._bf16 is not None or not self.supports_approx:
            return
        w = self.weight
        a16 = b16 = c = 0.0
        w16 = torch.empty(w.shape, dtype=torch.bfloat16)
        step = 16384
        for lo in range(0, w.shape[0], step):  # chunked: float64 temporaries of 16k rows at a time
            wc = w[lo:lo + step]
            w16[lo:lo + step] = wc
            wd = wc.double()
            t16 = w16[lo:lo + step].double()
            c = max(c, float(wd.norm(dim=1).max()))
            a16 = max(a16, float((wd - t16).norm(dim=1).max()))
            b16 = max(b16, float(t16.norm(dim=1).max()))
        self._consts = {"bf16": (_up(a16), _up(b16))}
        self._c_norm = _up(c)
        self._bf16 = w16

    @staticmethod
    def block_diagonal_width(num_rows: int) -> int:
        """``k`` of :meth:`_bf16_product` for ``num_rows`` rows. Measured (Gemma 3's 262,144 x 640, one thread, a
        loaded machine): bf16 ``F.linear`` 77-82 ms at one row against 91-93 ms in float32; the block diagonal 42-48
        ms (k = 4) at one to four rows. (int8 ``_weight_int8pack_mm``: 23-27 ms, but its bound is 15x looser.)"""
        return 4 if num_rows <= 8 else 2 if num_rows <= 16 else 1

    def _bf16_product(self, xt: torch.Tensor) -> torch.Tensor:
        """``xt @ W~^T`` in bf16 (float32 accumulation), ``(R, vocab)`` (the bf16 results as float32). With few rows oneDNN's bf16 kernel for
        ``(R, hidden) x (hidden, vocab)`` is slow (no faster than float32 at one row); the same products as one
        ``(vocab / k, k hidden) x (k hidden, k R)`` GEMM against ``k`` copies of ``xt^T`` on a block diagonal run
        at the memory's speed: entry ``[a, b R + m]`` is ``W~_{a k + b} . x_m`` (the zeros add nothing, exactly)."""
        w = self._bf16
        n_rows, hidden = xt.shape
        vocab = w.shape[0]
        k = self.block_diagonal_width(n_rows)
        res = self.buffer("approx", (n_rows, vocab))
        if k == 1 or vocab % k:
            out = torch.mm(xt, w.t(), out=self.buffer("product", (n_rows, vocab), torch.bfloat16))
            return res.copy_(out)
        blocks = torch.zeros(k, hidden, k, n_rows, dtype=torch.bfloat16)
        for b in range(k):
            blocks[b, :, b, :] = xt.t()
        out = torch.mm(w.view(vocab // k, k * hidden), blocks.view(k * hidden, k * n_rows),
                       out=self.buffer("product", (vocab // k, k * n_rows), torch.bfloat16))
        res.view(n_rows, vocab // k, k).copy_(out.view(vocab // k, k, n_rows).permute(2, 0, 1))  # float32, (R, V)
        return res

    @torch.inference_mode()
    def approx(self, h: torch.Tensor, *, proposals: bool = True) -> ApproxLogits:
        """Approximate logits of ``h`` ``(R, hidden)`` (float32) with their per-row bound (the module docstring).
        O(R x vocab x hidden) in bf16, O(R x vocab) more.

        ``proposals=False`` (no row draws rejection-sampling proposals from the values: greedy and top-k only, whose
        tokens do not depend on the approximate values as long as the bound holds) lets up to :attr:`QUANT_ROWS`
        rows take the quantized table's float32 products instead (``kernel == "quantized"``): the float32 logits up
        to summation order, bound ``2 gamma_n C ||x||`` (its float32 rounding and that of the rescoring products). A
        sampling row keeps the bf16 values at every batch size, so a seeded request draws the same tokens whatever
        shares its batch."""
        self.prepare()
        if not proposals and self.quantized is not None and 0 < h.shape[0] <= self.QUANT_ROWS:
            return self._quantized_approx(h)
        kernel = "bf16"
        self.stats[kernel] += 1
        t = time.perf_counter()
        x = h.float()
        xt = x.to(torch.bfloat16)
        raw = self._bf16_product(xt)
        self.seconds += time.perf_counter() - t
        a, b = self._consts[kernel]
        xd = x.double()
        nx = xd.norm(dim=1)
        ndx = (xd - xt.double()).norm(dim=1)
        nxt = xt.double().norm(dim=1)
        # (raw: float32, exactly the bf16 outputs; amax/amin are vectorized, aminmax is not)
        big = torch.maximum(raw.amax(dim=1).double().abs(), raw.amin(dim=1).double().abs())
        g = self._gamma
        bound = ((a * nx + b * (ndx + g * nxt) + g * self._c_norm * nx) * (1 + 1e-6)
                 + (_U_BF16 / (1 - _U_BF16)) * big + 1e-30)
        bound = torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))
        return ApproxLogits(self._cap(raw), bound, kernel)

    def _quantized_approx(self, h: torch.Tensor) -> ApproxLogits:
        self.stats["quantized"] += 1
        t = time.perf_counter()
        x = h.float()
        values = self.quantized(x)
        self.seconds += time.perf_counter() - t
        bound = 2.0 * self._gamma * self._c_norm * x.double().norm(dim=1) * (1 + 1e-6) + 1e-30
        bound = torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))
        return ApproxLogits(self._cap(values), bound, "quantized")
