"""A deliberately simple Llama reference: one sequence, a contiguous KV cache, greedy decoding.

Nothing here knows about blocks, slot mappings or batching. Keys and values of token ``j`` live in
row ``j`` of a per-layer ``(max_len, n_head_kv, head_dim)`` tensor, attention repeats the KV heads
for every query head and applies an explicit causal (optionally sliding-window) mask. It exists to
check the paged model (:mod:`pagedkv.engine.model`), so its attention code is written
independently; only the GGUF loading (:mod:`pagedkv.engine.gguf_loader`) is shared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .gguf_loader import ModelConfig, TokenizerMetadata, load_gguf, rope_inv_freq

__all__ = ["ContiguousKVCache", "GreedyResult", "ReferenceLlama"]


@dataclass
class ContiguousKVCache:
    """Keys/values of one sequence: ``k[layer, j]`` and ``v[layer, j]`` belong to token ``j``."""

    k: torch.Tensor  # (n_layer, max_len, n_head_kv, head_dim)
    v: torch.Tensor  # (n_layer, max_len, n_head_kv, head_dim)
    length: int = 0  # tokens stored so far

    @property
    def capacity(self) -> int:
        return int(self.k.shape[1])


@dataclass
class GreedyResult:
    """Output of :meth:`ReferenceLlama.generate_greedy`.

    ``logits[i]`` is the float32 logit vector from which ``token_ids[i]`` was picked (row 0 comes
    from the last prompt token); ``None`` unless ``return_logits`` was set.
    """

    token_ids: list[int]
    logits: torch.Tensor | None = None


class ReferenceLlama:
    """Plain single-sequence Llama forward (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer_metadata: TokenizerMetadata | None = None
    ) -> None:
        self.config = config
        self.w = weights
        self.tokenizer_metadata = tokenizer_metadata
        self.inv_freq = rope_inv_freq(config, weights.get("rope_freqs.weight"))

    @classmethod
    def from_gguf(cls, path: Any = None) -> ReferenceLlama:
        config, weights, tok_meta = load_gguf(path)
        return cls(config, weights, tok_meta)

    def new_cache(self, max_len: int) -> ContiguousKVCache:
        c = self.config
        dtype = self.w["token_embd.weight"].dtype
        shape = (c.n_layer, max_len, c.n_head_kv, c.head_dim)
        return ContiguousKVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    # ------------------------------------------------------------------ building blocks
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(dim=-1, keepdim=True)
        return weight * (x.float() / torch.sqrt(variance + self.config.rms_eps)).to(weight.dtype)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (n, heads, head_dim): dimension i pairs with i + head_dim/2 ("rotate half")."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (n, head_dim/2)
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def attention_mask(
        q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None
    ) -> torch.Tensor:
        """Boolean (n_q, n_k) mask: query at p sees keys at j with j <= p (and j > p - W with a window)."""
        allowed = k_positions[None, :] <= q_positions[:, None]
        if sliding_window is not None:
            allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
        return allowed

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self, token_ids: Sequence[int], cache: ContiguousKVCache, *, sliding_window: int | None = None
    ) -> torch.Tensor:
        """Append ``token_ids`` to the sequence in ``cache``; return float32 logits (n, vocab) for each."""
        c, w = self.config, self.w
        n = len(token_ids)
        start, end = cache.length, cache.length + n
        if end > cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens, {end} needed")
        positions = torch.arange(start, end)
        mask = self.attention_mask(positions, torch.arange(end), sliding_window)  # (n, end)

        x = w["token_embd.weight"][torch.tensor(list(token_ids), dtype=torch.long)]
        for i in range(c.n_layer):
            p = f"blk.{i}."
            h = self._rms_norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).view(n, c.n_head, c.head_dim)
            k = (h @ w[p + "attn_k.weight"].T).view(n, c.n_head_kv, c.head_dim)
            v = (h @ w[p + "attn_v.weight"].T).view(n, c.n_head_kv, c.head_dim)
            q = self._rotary(q, positions)
            k = self._rotary(k, positions)
            cache.k[i, start:end] = k
            cache.v[i, start:end] = v

            keys = cache.k[i, :end].repeat_interleave(c.n_group, dim=1)  # (end, n_head, d)
            values = cache.v[i, :end].repeat_interleave(c.n_group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys).float() / math.sqrt(c.head_dim)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            attn = torch.einsum("hqk,khd->qhd", probs, values).reshape(n, c.n_head * c.head_dim)
            x = x + attn @ w[p + "attn_output.weight"].T

            h = self._rms_norm(x, w[p + "ffn_norm.weight"])
            gate = F.silu(h @ w[p + "ffn_gate.weight"].T)
            up = h @ w[p + "ffn_up.weight"].T
            x = x + (gate * up) @ w[p + "ffn_down.weight"].T

        cache.length = end
        x = self._rms_norm(x, w["output_norm.weight"])
        return (x @ w["output.weight"].T).float()

    def generate_greedy(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        sliding_window: int | None = None,
        eos_token_id: int | None = None,
        return_logits: bool = False,
    ) -> GreedyResult:
        """Greedy decoding: prefill the prompt, then feed back the argmax token ``max_new_tokens`` times
        (stopping early after ``eos_token_id`` when given)."""
        cache = self.new_cache(len(prompt_ids) + max_new_tokens)
        logits = self.forward(prompt_ids, cache, sliding_window=sliding_window)[-1]
        out: list[int] = []
        kept: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            if return_logits:
                kept.append(logits)
            token = int(torch.argmax(logits))
            out.append(token)
            if eos_token_id is not None and token == eos_token_id:
                break
            if len(out) == max_new_tokens:
                break
            logits = self.forward([token], cache, sliding_window=sliding_window)[-1]
        return GreedyResult(out, torch.stack(kept) if return_logits and kept else None)
