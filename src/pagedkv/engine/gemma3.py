"""Gemma 3 (text) forward over the paged KV cache, loaded from a GGUF file (``general.architecture == "gemma3"``).

Architecture (Gemma 3 270M: 18 layers, 640 hidden, 4 query heads and 1 KV head of 256 dims, 262,144 tokens)::

    x = embed[ids] * sqrt(hidden)                          scaled embeddings
    per layer i:                                            sliding unless (i + 1) % pattern == 0 (pattern 6:
        h = norm(x); q, k, v = h Wq, h Wk, h Wv             five local layers for each global one)
        q, k = q_norm(q), k_norm(k)                         RMSNorm per head, before RoPE
        q, k = rope(q, k; base_local | base_global)         10k on local layers, freq_base (1M) on global ones
        write k, v to the paged cache; attend               scale query_pre_attn_scalar ** -0.5; a local layer
        x = x + post_attn_norm(o Wo)                        sees only the last W keys: (p - W, p]
        x = x + post_ffw_norm(W_down(gelu_tanh(h W_gate) * h W_up)),  h = ffn_norm(x)
    logits = final_norm(x) E^T                              tied output embedding; soft-capped when configured

Every RMSNorm multiplies by ``(1 + w)`` in Hugging Face's Gemma; llama.cpp's converter stores ``1 + w`` in the
GGUF, so the stored value is the multiplier (computed here as ``1 + (stored - 1)`` in float32, exactly what the
Hugging Face GGUF loader and Gemma's norm compute). Q/K rows are *not* permuted in a Gemma GGUF (llama.cpp's
Gemma converters leave them as they are and use the "rotate half" rotary layout), so nothing is un-permuted.

Sliding-window semantics (Hugging Face's ``sliding_window_overlay``: ``kv_idx > q_idx - W``): the query at
position ``p`` of a local layer attends keys ``p - W + 1 .. p``, ``W`` keys itself included. Pinned by
``tests/engine/test_gemma3.py``.

Paged KV cache and attention: :class:`~pagedkv.engine.model.PagedDecoder`'s layout
(``(n_layer, 2, num_blocks, block_size, n_kv, d)``, so ``copy_blocks`` / ``swap_blocks`` and the ``LLM`` loop work
unchanged) and the engine's fast path, :mod:`pagedkv.engine.paged_attention`: one
:func:`~pagedkv.engine.paged_attention.plan_paged_attention` per step and distinct window (the 15 local layers share
one plan, the 3 global ones another), :func:`~pagedkv.engine.paged_attention.paged_attention` per layer with one
workspace reused by every layer and step. A local layer gathers only the blocks that hold its window. Q/K/V are one
matmul, gate/up another; the q and k norms and the rotary embedding of q and k are one op each.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_loader import ArchMetadata, HeadShapes, TokenizerMetadata, check_shapes, inv_freq, load_tensors, open_gguf
from .cpu import layer_table, step_kernel
from .gguf_loader import read_tokenizer_metadata
from .model import AttentionMetadata, PagedDecoder, _rotate_half, head_linear
from .paged_attention import paged_attention, plan_paged_attention
from .quant_blocks import QuantBlocks, load_blocks
from .sampling import LMHead

__all__ = ["ARCHITECTURE", "Gemma3Config", "PagedGemma3", "load_gemma3", "read_gemma3_config"]

ARCHITECTURE = "gemma3"


@dataclass(frozen=True)
class Gemma3Config(HeadShapes):
    """Hyper-parameters of a Gemma 3 text model, read from GGUF metadata (defaults: Gemma 3's published ones for
    keys a GGUF may omit: local RoPE base 10,000, pattern 6, query_pre_attn_scalar = head_dim, no soft-capping).

    ``layer_windows[i]`` is ``sliding_window`` for a local layer and ``None`` for a global one.
    """

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    context_length: int
    rope_freq_base: float  # global layers
    rope_freq_base_swa: float  # local (sliding-window) layers
    rms_eps: float
    sliding_window: int
    sliding_window_pattern: int
    query_pre_attn_scalar: float
    rope_scaling_type: str | None = None  # global layers only (Gemma 3 4B+: linear, factor 8)
    rope_scaling_factor: float = 1.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tied_embeddings: bool = True
    file_type: int | None = None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        p = self.sliding_window_pattern
        return tuple(None if (i + 1) % p == 0 else self.sliding_window for i in range(self.n_layer))

    @property
    def rope_dim(self) -> int:
        return self.head_dim



def read_gemma3_config(reader: Any) -> Gemma3Config:
    """:class:`Gemma3Config` from an open ``gguf.GGUFReader``; ``ValueError`` for another architecture or a
    missing required key."""
    arch = ArchMetadata(reader, "general").opt("architecture", None)
    if arch != ARCHITECTURE:
        raise ValueError(f"not a Gemma 3 GGUF file (general.architecture is {arch!r})")
    meta = ArchMetadata(reader, arch)
    opt = meta.opt
    common = meta.common(context_length=32768, rms_eps=1e-6)
    return Gemma3Config(
        **common,
        rope_freq_base=float(opt("rope.freq_base", 1_000_000.0)),
        rope_freq_base_swa=float(opt("rope.freq_base_swa", 10_000.0)),
        sliding_window=int(opt("attention.sliding_window", 4096)),
        sliding_window_pattern=int(opt("attention.sliding_window_pattern", 6)),
        query_pre_attn_scalar=float(opt("attention.query_pre_attn_scalar", common["head_dim"])),
        final_logit_softcapping=float(opt("final_logit_softcapping", 0.0) or 0.0) or None,
        attn_logit_softcapping=float(opt("attn_logit_softcapping", 0.0) or 0.0) or None,
    )


def load_gemma3(
    path: str | os.PathLike[str] | None = None,
    *,
    reader: Any = None,
    num_threads: int | None = None,
) -> tuple[Gemma3Config, dict[str, torch.Tensor], TokenizerMetadata]:
    """Read a Gemma 3 GGUF file (or an already open ``gguf.GGUFReader``) into ``(config, float32 weights,
    tokenizer metadata)``; weights keyed by their GGUF names, norm weights already the ``(1 + w)`` multipliers,
    ``output.weight`` the very tensor ``token_embd.weight`` when the output embedding is tied. Q4_K / Q6_K /
    Q5_0 / Q8_0 tensors are dequantized with ``gguf.quants`` on a few threads."""
    if reader is None:
        if path is None:
            raise ValueError("load_gemma3 needs a path or a reader")
        reader = open_gguf(path)
    config = read_gemma3_config(reader)
    tok_meta = read_tokenizer_metadata(reader)

    def convert(name: str, arr: np.ndarray) -> np.ndarray:
        if name.endswith("norm.weight"):
            # HF's GGUF loader stores stored - 1 and Gemma's norm multiplies by 1 + w: the same float32 steps
            return np.float32(1.0) + (arr - np.float32(1.0))
        return arr

    weights = load_tensors(reader, convert, num_threads=num_threads)
    c = config
    check_shapes(c, weights, {"attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,),
                              "post_attention_norm": (c.n_embd,), "post_ffw_norm": (c.n_embd,)})
    return config, weights, tok_meta


def _kv_cache_groups(c: Gemma3Config) -> tuple[tuple, tuple[tuple[int, int], ...]]:
    """The model's KV cache groups and each layer's ``(group, slot)``: groups of equal size, the full-attention
    layers first (Gemma 3 270M: 18 layers, 3 global + 15 local of W = 512 -> group 0 = the global layers 5, 11, 17
    in slots 0..2; groups 1..5 = the local layers in order, three each). ``(None, ...)`` when the layers do not
    split into equal groups of one kind (the engine then uses one block table for all layers)."""
    from pagedkv import FullAttentionSpec, SlidingWindowSpec

    full = [i for i, w in enumerate(c.layer_windows) if w is None]
    local = [i for i, w in enumerate(c.layer_windows) if w is not None]
    size = math.gcd(len(full), len(local))
    if size == 0:
        return None, ()
    where = [(0, 0)] * c.n_layer
    for k, i in enumerate(full):
        where[i] = (k // size, k % size)
    for k, i in enumerate(local):
        where[i] = (len(full) // size + k // size, k % size)
    specs = (FullAttentionSpec(),) * (len(full) // size) + (SlidingWindowSpec(c.sliding_window),) * (len(local) // size)
    return specs, tuple(where)


def _norm(x: torch.Tensor, mult: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dimension in float32; ``mult`` (the ``(1 + w)`` multiplier) broadcasts against
    the normalized ``x`` (a ``(n_heads, head_dim)`` one normalizes each head with its own weights)."""
    if x.dtype == torch.float32 and mult.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps) * mult  # one fused kernel, then the multiplier
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * mult.float()).to(x.dtype)


class PagedGemma3(PagedDecoder):
    """A Gemma 3 decoder whose attention reads and writes a paged KV cache.

    ``forward(meta, kv_cache)`` has the contract of :meth:`pagedkv.engine.model.PagedLlama.forward`:
    ``meta.sliding_window`` is ignored (each layer has its own window, ``config.layer_windows``). ``layers[i]`` is
    ``(attn_norm, w_qkv, qk_norm, attn_output, post_attention_norm, ffn_norm, w_gate_up, ffn_down, post_ffw_norm)``
    with ``w_qkv`` the fused Q/K/V projection, ``qk_norm`` the ``(n_head + n_head_kv, head_dim)`` norm multipliers
    of the query heads then the KV heads, ``w_gate_up`` the fused gate/up projection.
    """

    def __init__(
        self,
        config: Gemma3Config,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tokenizer_metadata: TokenizerMetadata | None = None,
        quantized: dict[str, QuantBlocks] | None = None,
    ) -> None:
        if config.attn_logit_softcapping is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        self.config = config
        self.tokenizer_metadata = tokenizer_metadata
        self._init_common(weights, device, dtype)
        w, fused = self._w, self._fused
        c = config
        self.tok_embd = w("token_embd.weight")
        self.device = self.tok_embd.device
        self.lm_head = w("output.weight")
        # exact float32 logits (soft-capped when configured), and the bounded fast path (sampling.py)
        self.head = LMHead(self.lm_head, softcap=c.final_logit_softcapping,
                           quantized=head_linear(self.lm_head, quantized, max_rows=LMHead.QUANT_ROWS))
        self.out_norm = w("output_norm.weight")

        def qk_norm(i: int) -> torch.Tensor:
            q, k = w(f"blk.{i}.attn_q_norm.weight"), w(f"blk.{i}.attn_k_norm.weight")
            return torch.cat([q.expand(c.n_head, -1), k.expand(c.n_head_kv, -1)]).contiguous()

        self.layers = [
            (
                w(f"blk.{i}.attn_norm.weight"),
                fused(f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"),
                qk_norm(i),
                w(f"blk.{i}.attn_output.weight"),
                w(f"blk.{i}.post_attention_norm.weight"),
                w(f"blk.{i}.ffn_norm.weight"),
                fused(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                w(f"blk.{i}.ffn_down.weight"),
                w(f"blk.{i}.post_ffw_norm.weight"),
            )
            for i in range(c.n_layer)
        ]
        del self._weights, self._moved  # the model holds only what it uses
        #: per layer, its four products (:meth:`PagedDecoder._make_linears`; Gemma 3 270M Q4_K_M: Q5_0 / Q8_0 Q, K,
        #: V, gate and up projections, Q4_K / Q6_K attention output and down, all read quantized in few-row steps)
        self.linears = self._make_linears((1, 3, 6, 7), quantized)
        # the fused few-row step (one C call for every layer) where every product reads quantized blocks
        fusable = self.dtype == torch.float32 and all(lin.uses_kernel for layer in self.linears for lin in layer)
        self._fused_table = layer_table(
            [(*(layer[j].data_ptr() for j in (0, 2, 4, 5, 8)), *(lin.part_pointers() for lin in lins))
             for layer, lins in zip(self.layers, self.linears)], gemma3=True) if fusable and self.linears else None
        self._fused_linears = self.linears  # (a model whose products are replaced afterwards takes the torch path)
        self._fused_rows = min((lin.max_rows for layer in self.linears for lin in layer), default=0) if fusable else 0
        self.layer_windows = c.layer_windows
        self.kv_cache_groups, self.layer_groups = _kv_cache_groups(c)
        # sqrt(hidden) as a float32 tensor cast to the model dtype (as Gemma's scaled embedding does)
        self.embed_scale = torch.tensor(c.n_embd ** 0.5, dtype=torch.float32).to(self.dtype)
        self.scale = c.query_pre_attn_scalar ** -0.5
        global_factor = c.rope_scaling_factor if c.rope_scaling_type == "linear" else 1.0
        self._inv_freq = {None: inv_freq(c.rope_freq_base, c.head_dim, global_factor),
                          "local": inv_freq(c.rope_freq_base_swa, c.head_dim)}

    @classmethod
    def from_gguf(cls, path: Any = None, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32, reader: Any = None, quant_kernels: bool = True) -> PagedGemma3:
        """Load a Gemma 3 GGUF file (or an open reader); ``quant_kernels`` as :meth:`PagedLlama.from_gguf`."""
        if reader is None and path is not None:
            reader = open_gguf(path)
        config, weights, tok_meta = load_gemma3(path, reader=reader)
        quantized = load_blocks(reader) if reader is not None and quant_kernels else None
        return cls(config, weights, device=device, dtype=dtype, tokenizer_metadata=tok_meta, quantized=quantized)

    def gguf_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights under their GGUF names (views of the fused tensors, no copy)."""
        c = self.config
        out = {"token_embd.weight": self.tok_embd, "output_norm.weight": self.out_norm, "output.weight": self.lm_head}
        for i, (an, qkv, qkn, wo, pan, fn, gu, wd, pfn) in enumerate(self.layers):
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size])
            g, u = gu.split([c.n_ff, c.n_ff])
            named = {"attn_norm": an, "attn_q": q, "attn_k": k, "attn_v": v, "attn_q_norm": qkn[0],
                     "attn_k_norm": qkn[c.n_head], "attn_output": wo, "post_attention_norm": pan, "ffn_norm": fn,
                     "ffn_gate": g, "ffn_up": u, "ffn_down": wd, "post_ffw_norm": pfn}
            out.update({f"blk.{i}.{n}.weight": t for n, t in named.items()})
        return out

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step; float32 logits ``(R, vocab)`` for ``meta.logits_indices`` (default: the last new token
        of each sequence), soft-capped when the model says so."""
        return self.head.logits(self.hidden(meta, kv_cache))

    @torch.inference_mode()
    def hidden(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step up to the LM head: the final-normed hidden states ``(R, n_embd)`` of
        ``meta.logits_indices`` (``forward`` is ``self.head.logits(self.hidden(...))``)."""
        c = self.config
        grouped = meta.groups is not None
        self._check_kv_cache(kv_cache, grouped)
        block_size = kv_cache.shape[3]
        n_tok = meta.num_tokens
        n_head, n_kv, d, n_ff, eps = c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.rms_eps
        max_pos = max(meta.context_lens_host, default=0)
        windows = set(self.layer_windows)
        if grouped:  # one plan per group (its own block tables), layer i -> (group, slot)
            if len(meta.groups) != len(self.kv_cache_groups):
                raise ValueError(f"metadata has {len(meta.groups)} KV cache groups, the model "
                                 f"{len(self.kv_cache_groups)}")
            plans = [plan_paged_attention(gm, block_size, sliding_window=spec.window, dtype=self.dtype)
                     for gm, spec in zip(meta.groups, self.kv_cache_groups)]
            where = [(plans[g], kv_cache[j]) for g, j in self.layer_groups]
        else:  # one table for every layer: one plan per distinct window
            by_window = {w: plan_paged_attention(meta, block_size, sliding_window=w, dtype=self.dtype)
                         for w in windows}
            where = [(by_window[w], kv_cache[i]) for i, w in enumerate(self.layer_windows)]
        if n_tok <= self._fused_rows and all(p.ragged is not None and not p.groups for p, _ in where):
            fused = self._hidden_fused(meta, kv_cache, where, max_pos)
            if fused is not None:
                return fused
        ropes = {w: self._rope(None if w is None else "local", self._inv_freq[None if w is None else "local"],
                               meta.positions, max_pos) for w in windows}
        ws = self._workspace()

        x = self.tok_embd.index_select(0, meta.input_ids) * self.embed_scale
        for layer, (attn_norm, _, qk_norm, _, post_attn_norm, ffn_norm, _, _,
                    post_ffw_norm) in enumerate(self.layers):
            window = self.layer_windows[layer]
            h = _norm(x, attn_norm, eps)
            lin_qkv, lin_o, lin_gu, lin_down = self.linears[layer]
            qkv = lin_qkv(h).view(n_tok, n_head + 2 * n_kv, d)
            qk = _norm(qkv[:, : n_head + n_kv], qk_norm, eps)  # q and k norms, per head, in one op
            cos, sin = ropes[window]
            qk = qk * cos + _rotate_half(qk) * sin
            plan, kv_layer = where[layer]
            attn = paged_attention(qk[:, :n_head], qk[:, n_head:], qkv[:, n_head + n_kv:], kv_layer, plan,
                                   scale=self.scale, workspace=ws)
            x = x + _norm(lin_o(attn.to(x.dtype)), post_attn_norm, eps)

            h = _norm(x, ffn_norm, eps)
            gu = lin_gu(h)
            mlp = lin_down(F.gelu(gu[:, :n_ff], approximate="tanh") * gu[:, n_ff:])
            x = x + _norm(mlp, post_ffw_norm, eps)

        idx = meta.logits_indices
        if idx is None:
            idx = meta.query_start_loc[1:] - 1
        return _norm(x.index_select(0, idx), self.out_norm, eps)

    def _hidden_fused(self, meta: AttentionMetadata, kv_cache: torch.Tensor, where: list, max_pos: int) -> Any:
        """:meth:`hidden` of a step whose attention is all ragged and whose products all read quantized blocks, as
        one C call over every layer (``pkv_gemma3_step``, :mod:`pagedkv.engine.cpu`); ``None`` where it does not
        apply (then the torch path runs). ``where``: each layer's plan and KV slot. Buffers reused per thread."""
        fn, table = step_kernel("pkv_gemma3_step"), self._fused_table
        if (fn is None or table is None or self.linears is not self._fused_linears or kv_cache.dtype != torch.float32
                or not kv_cache.is_contiguous()):
            return None
        c, n_tok = self.config, meta.num_tokens
        bufs = getattr(self._local, "fused", None)
        if bufs is None:
            bufs = self._local.fused = {}
        b = bufs.get(n_tok)
        if b is None:  # x, h, qkv, attn, tmp, gu, act, out
            widths = (c.n_embd, c.n_embd, (c.n_head + 2 * c.n_head_kv) * c.head_dim, c.n_head * c.head_dim,
                      c.n_embd, 2 * c.n_ff, c.n_ff, c.n_embd)
            b = bufs[n_tok] = [torch.empty(n_tok, w) for w in widths]
        x, out = b[0], b[7]
        torch.mul(self.tok_embd.index_select(0, meta.input_ids), self.embed_scale, out=x)
        tables = {w: self._rope_table(None if w is None else "local", self._inv_freq[None if w is None else "local"],
                                      max_pos) for w in set(self.layer_windows)}
        lay = []
        for (plan, kv_layer), w in zip(where, self.layer_windows):
            rag, (cos, sin) = plan.ragged, tables[w]
            lay += [kv_layer.data_ptr(), cos.data_ptr(), sin.data_ptr(), rag.tables.data_ptr(), rag.tables.shape[1],
                    rag.seqs.data_ptr(), rag.seqs.shape[0], rag.window, plan.slot_mapping.data_ptr()]
        _, _, num_blocks, bs, _, _ = kv_cache.shape
        bad = fn(table, (ctypes.c_int64 * len(lay))(*lay), c.n_layer, n_tok, c.n_embd, c.n_head, c.n_head_kv,
                 c.head_dim, c.n_ff, c.rms_eps, self.scale, *(t.data_ptr() for t in b[:7]), meta.positions.data_ptr(),
                 num_blocks, bs, self.out_norm.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if bad:
            raise RuntimeError(f"the fused step read {bad} keys through a NULL_BLOCK or out-of-range block id")
        idx = meta.logits_indices
        return out.index_select(0, meta.query_start_loc[1:] - 1 if idx is None else idx)

    __call__ = forward
