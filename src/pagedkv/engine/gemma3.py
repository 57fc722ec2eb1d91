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

Paged KV cache: the layout of :mod:`pagedkv.engine.model` (``(n_layer, 2, num_blocks, block_size, n_kv, d)``), so
its ``copy_blocks`` / ``swap_blocks`` and the ``LLM`` loop work unchanged. All layers share the sequence's one
block table (KV cache groups, where sliding layers free their old blocks, are later work); a local layer reads only
the blocks that hold its window (the older blocks of the table are skipped, not gathered).

Relies on these public names of :mod:`pagedkv.engine.model`: ``AttentionMetadata`` (fields ``input_ids``,
``positions``, ``slot_mapping``, ``context_lens``, ``block_tables``, ``query_lens``, ``context_lens_host``,
``query_start_loc``, ``logits_indices``), ``kv_cache_shape`` and ``NULL_BLOCK``; its attention code is not used.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_loader import TokenizerMetadata, _dequantize, _field_value, _read_tokenizer_metadata
from .model import NULL_BLOCK, AttentionMetadata, kv_cache_shape

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)

__all__ = ["ARCHITECTURE", "Gemma3Config", "PagedGemma3", "load_gemma3", "read_gemma3_config"]

ARCHITECTURE = "gemma3"


@dataclass(frozen=True)
class Gemma3Config:
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

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_head_kv * self.head_dim


def read_gemma3_config(reader: Any) -> Gemma3Config:
    """:class:`Gemma3Config` from an open ``gguf.GGUFReader``; ``ValueError`` for another architecture or a
    missing required key."""
    arch = _field_value(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"not a Gemma 3 GGUF file (general.architecture is {arch!r})")

    def req(key: str) -> Any:
        value = _field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata key {arch}.{key}")
        return value

    def opt(key: str, default: Any) -> Any:
        value = _field_value(reader, f"{arch}.{key}")
        return default if value is None else value

    n_embd = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_head_kv = int(opt("attention.head_count_kv", n_head))
    head_dim = int(opt("attention.key_length", n_embd // n_head))
    if int(opt("attention.value_length", head_dim)) != head_dim:
        raise ValueError("key length != value length is not supported")
    if n_head % n_head_kv:
        raise ValueError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if int(opt("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    scaling_type = opt("rope.scaling.type", None) or None
    if scaling_type == "none":
        scaling_type = None
    if scaling_type not in (None, "linear"):
        raise ValueError(f"rope scaling type {scaling_type!r} is not supported")
    softcap = float(opt("final_logit_softcapping", 0.0) or 0.0)
    attn_softcap = float(opt("attn_logit_softcapping", 0.0) or 0.0)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = opt("vocab_size", len(tokens.data) if tokens is not None else None)
    names = {t.name: t for t in reader.tensors}
    if vocab is None:
        vocab = int(names["token_embd.weight"].shape[1])
    file_type = _field_value(reader, "general.file_type")
    return Gemma3Config(
        arch=arch,
        name=str(_field_value(reader, "general.name", "") or ""),
        n_layer=int(req("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(req("feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(opt("context_length", 32768)),
        rope_freq_base=float(opt("rope.freq_base", 1_000_000.0)),
        rope_freq_base_swa=float(opt("rope.freq_base_swa", 10_000.0)),
        rms_eps=float(opt("attention.layer_norm_rms_epsilon", 1e-6)),
        sliding_window=int(opt("attention.sliding_window", 4096)),
        sliding_window_pattern=int(opt("attention.sliding_window_pattern", 6)),
        query_pre_attn_scalar=float(opt("attention.query_pre_attn_scalar", head_dim)),
        rope_scaling_type=scaling_type,
        rope_scaling_factor=float(opt("rope.scaling.factor", 1.0) or 1.0),
        final_logit_softcapping=softcap or None,
        attn_logit_softcapping=attn_softcap or None,
        tied_embeddings="output.weight" not in names,
        file_type=int(file_type) if file_type is not None else None,
    )


_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                  "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")


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
        from gguf import GGUFReader

        if path is None:
            raise ValueError("load_gemma3 needs a path or a reader")
        if not Path(path).is_file():
            raise FileNotFoundError(f"GGUF model file not found: {path}")
        reader = GGUFReader(str(path), "r")
    config = read_gemma3_config(reader)
    tok_meta = _read_tokenizer_metadata(reader)
    tensors = list(reader.tensors)
    reader.fields.clear()  # the vocabulary's per-string views are no longer needed
    threads = num_threads or min(8, os.cpu_count() or 1)

    def convert(tensor: Any) -> tuple[str, torch.Tensor]:
        arr = _dequantize(tensor)
        if tensor.name.endswith("norm.weight"):
            # HF's GGUF loader stores stored - 1 and Gemma's norm multiplies by 1 + w: the same float32 steps
            arr = np.float32(1.0) + (arr - np.float32(1.0))
        return tensor.name, torch.from_numpy(np.ascontiguousarray(arr))

    if threads > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            weights = dict(pool.map(convert, tensors))
    else:
        weights = dict(map(convert, tensors))
    if "output.weight" not in weights:
        weights["output.weight"] = weights["token_embd.weight"]
    _check_shapes(config, weights)
    return config, weights, tok_meta


def _check_shapes(c: Gemma3Config, weights: dict[str, torch.Tensor]) -> None:
    expected = {
        "token_embd.weight": (c.vocab_size, c.n_embd),
        "output_norm.weight": (c.n_embd,),
        "output.weight": (c.vocab_size, c.n_embd),
    }
    shapes = {
        "attn_norm": (c.n_embd,), "attn_q": (c.q_size, c.n_embd), "attn_k": (c.kv_size, c.n_embd),
        "attn_v": (c.kv_size, c.n_embd), "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,),
        "attn_output": (c.n_embd, c.q_size), "post_attention_norm": (c.n_embd,), "ffn_norm": (c.n_embd,),
        "ffn_gate": (c.n_ff, c.n_embd), "ffn_up": (c.n_ff, c.n_embd), "ffn_down": (c.n_embd, c.n_ff),
        "post_ffw_norm": (c.n_embd,),
    }
    for i in range(c.n_layer):
        for n, shape in shapes.items():
            expected[f"blk.{i}.{n}.weight"] = shape
    for name, shape in expected.items():
        t = weights.get(name)
        if t is None:
            raise ValueError(f"GGUF file lacks the tensor {name}")
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")


def rope_inv_freq(base: float, dim: int, linear_factor: float = 1.0) -> torch.Tensor:
    """``1 / base ** (2i / dim)`` in float32 as Hugging Face computes it, divided by a linear scaling factor."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv / linear_factor if linear_factor != 1.0 else inv


def _rms_norm(x: torch.Tensor, mult: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in float32; ``mult`` is the ``(1 + w)`` multiplier."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * mult.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _Group:
    """Sequences of one step with the same query length, attended as one dense batch for one window kind."""

    token_idx: torch.Tensor | None  # (G * q_len,) rows of the flat batch; None = all rows, in order
    q_len: int
    block_ids: torch.Tensor  # (G, M) int64 block ids (NULL entries clamped to 0, always masked)
    mask: torch.Tensor  # (G, 1, q_len, M * block_size) bool, True = attend


def plan_attention(meta: AttentionMetadata, block_size: int, window: int | None,
                   device: torch.device) -> list[_Group]:
    """The attention plan of one step for one window kind (``None``: full causal attention).

    A query at position ``p`` attends key positions ``k <= p`` and, with a window ``W``, ``k > p - W``. Blocks
    wholly before every query's window are not gathered. Raises ``RuntimeError`` if a key some query needs lies
    in a ``NULL_BLOCK`` table entry. O(keys x queries) for the masks, built once per step and window kind.
    """
    q_lens = meta.query_lens
    ctx = meta.context_lens_host
    by_len: dict[int, list[int]] = {}
    for b, q in enumerate(q_lens):
        by_len.setdefault(q, []).append(b)
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    groups = []
    for q_len, seqs in by_len.items():
        seq_idx = np.asarray(seqs, dtype=np.int64)
        token_idx = None
        if len(by_len) > 1:
            rows = (starts[seq_idx][:, None] + np.arange(q_len)[None, :]).reshape(-1)
            token_idx = torch.from_numpy(rows).to(device)
        g_ctx = [ctx[b] for b in seqs]
        last_block = -(-max(g_ctx) // block_size)
        first_block = 0
        if window is not None:
            first_block = max(0, min(c - q_len for c in g_ctx) - window + 1) // block_size
        sel = torch.from_numpy(seq_idx).to(device)
        bt = meta.block_tables.index_select(0, sel)[:, first_block:last_block].long()
        key_pos = torch.arange(first_block * block_size, last_block * block_size, device=device)
        q_pos = meta.context_lens.index_select(0, sel)[:, None] - q_len + torch.arange(q_len, device=device)[None, :]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        released = (bt == NULL_BLOCK).repeat_interleave(block_size, dim=1)
        if bool((mask & released[:, None, :]).any()):
            raise RuntimeError("a key inside the attention window lies in a NULL_BLOCK table entry")
        groups.append(_Group(token_idx, q_len, bt.clamp_min(0), mask[:, None]))
    return groups


class PagedGemma3:
    """A Gemma 3 decoder whose attention reads and writes a paged KV cache (one block table for all layers).

    ``forward(meta, kv_cache)`` has the contract of :meth:`pagedkv.engine.model.PagedLlama.forward`:
    ``meta.sliding_window`` is ignored (each layer has its own window, ``config.layer_windows``).
    """

    def __init__(
        self,
        config: Gemma3Config,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tokenizer_metadata: TokenizerMetadata | None = None,
    ) -> None:
        self.config = config
        self.tokenizer_metadata = tokenizer_metadata
        self.dtype = dtype or weights["token_embd.weight"].dtype
        dev = torch.device(device) if device is not None else weights["token_embd.weight"].device
        moved: dict[int, torch.Tensor] = {}

        def w(name: str) -> torch.Tensor:
            t = weights[name]
            if id(t) not in moved:  # keep tied tensors tied
                moved[id(t)] = t.to(dev, self.dtype)
            return moved[id(t)]

        self.tok_embd = w("token_embd.weight")
        self.device = self.tok_embd.device
        self.lm_head = w("output.weight")
        self.out_norm = w("output_norm.weight")
        self.layers = [tuple(w(f"blk.{i}.{n}.weight") for n in _LAYER_TENSORS) for i in range(config.n_layer)]
        self.layer_windows = config.layer_windows
        # sqrt(hidden) as a float32 tensor cast to the model dtype (as Gemma's scaled embedding does)
        self.embed_scale = torch.tensor(config.n_embd ** 0.5, dtype=torch.float32).to(self.dtype)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self._inv_freq = {
            None: rope_inv_freq(config.rope_freq_base, config.head_dim,
                                config.rope_scaling_factor if config.rope_scaling_type == "linear" else 1.0),
            "local": rope_inv_freq(config.rope_freq_base_swa, config.head_dim),
        }
        self._rope_tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_gguf(cls, path: Any = None, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32, reader: Any = None) -> PagedGemma3:
        config, weights, tok_meta = load_gemma3(path, reader=reader)
        return cls(config, weights, device=device, dtype=dtype, tokenizer_metadata=tok_meta)

    # ------------------------------------------------------------------ KV cache (PagedLlama's layout)
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return kv_cache_shape(self.config, num_blocks, block_size)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        elem = torch.empty(0, dtype=dtype or self.dtype).element_size()
        c = self.config
        return c.n_layer * 2 * block_size * c.n_head_kv * c.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int, *, device: torch.device | str | None = None,
                          dtype: torch.dtype | None = None, pin_memory: bool = False) -> torch.Tensor:
        dev = torch.device(device) if device is not None else self.device
        return torch.zeros(self.kv_cache_shape(num_blocks, block_size), dtype=dtype or self.dtype, device=dev,
                           pin_memory=pin_memory and dev.type == "cpu" and torch.cuda.is_available())

    # ------------------------------------------------------------------ rotary tables
    def _rope(self, kind: Any, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rope_tables.get(kind, (None, None))
        if cos is None or max_pos > cos.shape[0]:
            n = max(max_pos, 2 * (cos.shape[0] if cos is not None else 0), 256)
            freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self._inv_freq[kind][None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)
            self._rope_tables[kind] = (cos, sin)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    # ------------------------------------------------------------------ attention
    def _attend(self, group: _Group, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        c = self.config
        n_seq, n_blocks = group.block_ids.shape
        kv = kv_layer.index_select(1, group.block_ids.reshape(-1))  # (2, G * M, bs, n_kv, d)
        n_keys = n_blocks * kv.shape[2]
        k = kv[0].view(n_seq, n_keys, c.n_head_kv, c.head_dim).transpose(1, 2)
        v = kv[1].view(n_seq, n_keys, c.n_head_kv, c.head_dim).transpose(1, 2)
        qh = q.view(n_seq, group.q_len, c.n_head, c.head_dim).transpose(1, 2)
        if c.attn_logit_softcapping is not None:  # explicit scores (SDPA has no soft-capping)
            k = k.repeat_interleave(c.n_group, dim=1)
            v = v.repeat_interleave(c.n_group, dim=1)
            scores = (qh @ k.transpose(-1, -2)).float() * self.scale
            cap = c.attn_logit_softcapping
            scores = torch.tanh(scores / cap) * cap
            scores = scores.masked_fill(~group.mask, float("-inf"))
            out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
        elif _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=group.mask, scale=self.scale, enable_gqa=True)
        else:
            k = k.repeat_interleave(c.n_group, dim=1)
            v = v.repeat_interleave(c.n_group, dim=1)
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=group.mask, scale=self.scale)
        return out.transpose(1, 2).reshape(n_seq * group.q_len, c.n_head * c.head_dim)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step; float32 logits ``(R, vocab)`` for ``meta.logits_indices`` (default: the last new token
        of each sequence)."""
        c = self.config
        if kv_cache.dim() != 6 or kv_cache.shape[0] != c.n_layer or kv_cache.shape[1] != 2:
            raise ValueError(f"KV cache must have shape {kv_cache_shape(c, -1, -1)}, got {tuple(kv_cache.shape)}")
        block_size = kv_cache.shape[3]
        n_tok = meta.num_tokens
        max_pos = max(meta.context_lens_host, default=0)
        plans = {w: plan_attention(meta, block_size, w, self.device) for w in set(self.layer_windows)}
        ropes = {w: self._rope(None if w is None else "local", meta.positions, max_pos) for w in plans}
        slots = meta.slot_mapping
        eps = c.rms_eps

        x = self.tok_embd.index_select(0, meta.input_ids) * self.embed_scale
        for layer, (attn_norm, wq, wk, wv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, w_gate, w_up, w_down,
                    post_ffw_norm) in enumerate(self.layers):
            window = self.layer_windows[layer]
            h = _rms_norm(x, attn_norm, eps)
            q = _rms_norm(F.linear(h, wq).view(n_tok, c.n_head, c.head_dim), q_norm, eps)
            k = _rms_norm(F.linear(h, wk).view(n_tok, c.n_head_kv, c.head_dim), k_norm, eps)
            v = F.linear(h, wv).view(n_tok, c.n_head_kv, c.head_dim)
            cos, sin = ropes[window]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin

            kv_layer = kv_cache[layer]
            kv_layer[0].flatten(0, 1).index_copy_(0, slots, k.to(kv_cache.dtype))
            kv_layer[1].flatten(0, 1).index_copy_(0, slots, v.to(kv_cache.dtype))
            groups = plans[window]
            if len(groups) == 1 and groups[0].token_idx is None:
                attn = self._attend(groups[0], q, kv_layer)
            else:
                attn = q.new_empty(n_tok, c.n_head * c.head_dim)
                for g in groups:
                    attn.index_copy_(0, g.token_idx, self._attend(g, q.index_select(0, g.token_idx), kv_layer))
            x = x + _rms_norm(F.linear(attn.to(x.dtype), wo), post_attn_norm, eps)

            h = _rms_norm(x, ffn_norm, eps)
            mlp = F.linear(F.gelu(F.linear(h, w_gate), approximate="tanh") * F.linear(h, w_up), w_down)
            x = x + _rms_norm(mlp, post_ffw_norm, eps)

        idx = meta.logits_indices
        if idx is None:
            idx = meta.query_start_loc[1:] - 1
        logits = F.linear(_rms_norm(x.index_select(0, idx), self.out_norm, eps), self.lm_head).float()
        if c.final_logit_softcapping is not None:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    __call__ = forward
