"""The output projection (LM head) with an exact fast path: bf16 logits with a rigorous error bound, the few
entries that matter rescored in float32.

Why: the LM head reads the whole ``(vocab, hidden)`` table every decode step (Gemma 3 270M: 262,144 x 640 =
671 MB in float32, more than the rest of the model). A bf16 copy is read at half the cost, but its logits are
only approximate, and the engine must give the same tokens as the float32 model. So the approximate logits come
with a bound, and only what the bound cannot decide is computed in float32.

The bound (per batch row ``r``, the same for every vocabulary entry ``i``)::

    W~ = bf16(W),  x~ = bf16(x),  dx = x - x~ (exact in float32),  dW_i = W_i - W~_i
    l_i = W_i . x  (real arithmetic)           s_i = W~_i . x~  (real arithmetic)
    l_i - s_i = -dW_i . x - W~_i . dx          |.| <= A ||x|| + B ||dx||          (Cauchy-Schwarz)
    computed s^_i (float32 accumulation of n = hidden terms):  |s^_i - s_i| <= g_n B ||x~||
    output rounded to bf16:  |l~_i - s^_i| <= u / (1 - u) |l~_i|                  (u = 2^-8)
    E_r = (A ||x|| + B (||dx|| + g_n ||x~||) + g_n C ||x||) (1 + 1e-6) + u / (1 - u) max_i |l~_i| + 1e-30

with ``A = max_i ||dW_i||``, ``B = max_i ||W~_i||``, ``C = max_i ||W_i||`` (float64, rounded up, computed once
at load), ``g_n = 1.01 (n + 2) 2^-24 / (1 - (n + 2) 2^-24)`` (float32 accumulation in any order); the
``g_n C ||x||`` term also covers the float32 rounding of the logits the engine computed before (so the candidates
hold their argmax too), the small absolute term flushed denormals. It assumes what the CPU kernel does: bf16
products accumulated in float32 (oneDNN's AVX-512 bf16 / AMX kernels); the tests check the bound against float64
on random and adversarial data (``tests/engine/test_lm_head.py``). A soft-cap ``c tanh(l / c)`` is 1-Lipschitz,
so the bound holds after it unchanged. Measured: Gemma 3 270M bound 0.5-1.7 against a largest actual error of
0.1-0.5 (hidden norms 100-460); SmolLM2 1.1-1.5 against 0.1-0.2.

Every exact logit ``l_i`` then lies in ``[l~_i - E_r, l~_i + E_r]``: :func:`pagedkv.engine.sampling.
sample_bounded` decides greedy and top-k from these intervals and rescores the candidates in float32, and samples
the whole vocabulary by rejection (proposal ``softmax(l~ / T)``, acceptance ``exp((l_i - l~_i - E_r) / T)``), so the
tokens are those of float32 logits (up to float32 summation order, which the engine already differs from the
reference in).

Kernel: oneDNN's bf16 product of ``(R, hidden) x (hidden, vocab)`` is slow with few rows (one thread, 262,144 x
640, a loaded machine: bf16 ``F.linear`` 77-82 ms at one row against 91-93 ms in float32); the same products as
``(vocab / k, k hidden) x (k hidden, k R)`` against ``x~^T`` repeated on a block diagonal take 42-48 ms (k = 4) at
one to four rows; k = 4 up to 8 rows, k = 2 up to 16 (:meth:`LMHead.block_diagonal_width`). (int8 with one scale per row,
``_weight_int8pack_mm``, is faster still at one row, 23-27 ms, but its bound is 15x looser: Gemma 3 6-25 logits,
too wide to decide anything.) Memory: the float32 table stays (it is the embedding table when tied, and it
rescores), plus the bf16 copy, half of it: Gemma 3 270M +335 MB, SmolLM2-135M +57 MB, built on first use
(:meth:`LMHead.prepare`).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["ApproxLogits", "LMHead"]

_U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significant bits)
_U_F32 = 2.0 ** -24


class ApproxLogits(NamedTuple):
    """Approximate logits ``values`` (float32 ``(R, vocab)``, soft-capped like the exact ones; a per-thread buffer
    of the head, valid until its next :meth:`LMHead.approx`) and ``bound``
    (float64 ``(R,)``): ``|exact[r, i] - values[r, i]| <= bound[r]`` for every ``i``; ``inf`` where the row could
    not be bounded (then nothing is decided from it). ``kernel``: ``"bf16"`` or ``"quantized"`` (the float32
    products of the file's quantized table, few greedy / top-k rows)."""

    values: torch.Tensor
    bound: torch.Tensor
    kernel: str


def _up(x: float) -> float:
    """``x`` rounded up a little (float64 norms of float32 data are accurate to ~1e-15 relative)."""
    return float(x) * (1.0 + 1e-9) + 1e-300


class LMHead:
    """``logits = softcap(h W^T)`` with ``W`` the float32 ``(vocab, hidden)`` output table.

    :meth:`logits` is the exact float32 product. :meth:`approx` gives low-precision logits with a per-row bound
    (module docstring) and :meth:`exact_at` exact logits of chosen entries, for
    :func:`pagedkv.engine.sampling.sample_bounded`. ``supports_approx`` says whether the fast path applies (a
    float32 table on the CPU); :meth:`prepare` builds the low-precision copies (O(vocab x hidden), once).
    """

    #: rows up to which greedy / top-k steps take the quantized kernel's float32 logits (:meth:`approx`); measured
    #: (benchmarks/qmatmul_ab.py --head): SmolLM2's Q8_0 table 1.7 / 2.4 ms at 1 / 4 rows against 2.5 / 2.6 ms
    #: for the bf16 product, 4.5 against 2.8 at 8
    QUANT_ROWS = 4

    def __init__(self, weight: torch.Tensor, *, softcap: float | None = None, quantized: Any = None) -> None:
        self.weight = weight
        self.softcap = softcap
        #: the table's quantized blocks (a :class:`pagedkv.engine.qmatmul.QuantLinear` of the file's Q8_0 / ...
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
        """A per-thread scratch tensor of ``shape`` reused from call to call (grown as needed): a fresh 30 MB
        tensor every step costs more in page faults than the arithmetic done in it (measured: a softmax of
        32 x 262,144 into a new tensor 113 ms, into a reused one 17 ms). Valid until the next call for ``name``
        on this thread."""
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
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

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
        """``k`` of :meth:`_bf16_product` for ``num_rows`` rows (measured on this CPU, module docstring)."""
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
        """Approximate logits of ``h`` ``(R, hidden)`` (float32) with their per-row bound (module docstring).
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
