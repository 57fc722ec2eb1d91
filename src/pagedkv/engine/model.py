"""Llama forward pass over a paged KV cache.

KV cache layout
---------------
One tensor for the whole model::

    kv_cache.shape == (n_layer, 2, num_blocks, block_size, n_head_kv, head_dim)
                                 ^ 0 = keys, 1 = values

Physical slot ``s = block_id * block_size + offset`` is row ``s`` of ``kv_cache[layer, i].flatten(0, 1)``.
A sequence's *block table* lists its block ids in logical order: token ``j`` of the sequence lives in
block ``table[j // block_size]`` at offset ``j % block_size``. ``NULL_BLOCK`` (-1) pads the batch
block-table matrix and marks table entries whose block was released because it fell out of the
sliding window; such entries are never read (they are masked out).

One step
--------
A step runs any mix of sequences, each contributing ``q_len >= 1`` *new* tokens (a whole prompt, a
prefill chunk, or one decode token). The new tokens of a sequence are always the last ``q_len``
tokens of its context: with ``context_len`` tokens after the step, their positions are
``context_len - q_len, ..., context_len - 1``. For every layer the forward

1. projects the flat batch of new tokens to Q, K, V and applies rotary embeddings,
2. writes K and V of every new token into its physical slot (``slot_mapping``),
3. reads each sequence's keys and values back *through its block table* and attends causally
   (optionally within a sliding window: a query at position ``p`` sees keys in ``(p - W, p]``).

Steps 2 and 3 are :func:`~pagedkv.engine.paged_attention.paged_attention` (module
:mod:`pagedkv.engine.paged_attention`): sequences with the same ``q_len`` are attended together as one dense
group (all decode sequences form one group, no Python loop over sequences); whole new prompts attend their own
keys directly (no read of the cache); other groups gather their blocks into a workspace reused by every layer
and step. The per-step plan (groups, block ids, masks) is built once and shared by all layers.

The code is device-agnostic: put the weights (``PagedLlama(..., device=...)``), the KV cache and the
metadata (``build_attention_metadata(..., device=...)``) on the same device.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_loader import (ModelConfig, TokenizerMetadata, find_default_model, llama_row_convert, load_gguf,
                          open_gguf, rope_inv_freq)
from .lm_head import LMHead
from .qmatmul import QuantBlocks, head_linear, load_blocks, make_linear
from .paged_attention import (NULL_BLOCK, AttentionPlan, AttentionWorkspace, paged_attention,
                              plan_paged_attention)

__all__ = [
    "NULL_BLOCK",
    "AttentionMetadata",
    "AttentionPlan",
    "AttentionWorkspace",
    "PagedDecoder",
    "PagedLlama",
    "paged_attention",
    "plan_paged_attention",
    "build_attention_metadata",
    "build_group_attention_metadata",
    "copy_blocks",
    "execute_copy_plan",
    "kv_cache_shape",
    "swap_blocks",
]


# --------------------------------------------------------------------------------------------------
# metadata


@dataclass
class AttentionMetadata:
    """Everything the paged forward needs for one step of ``B`` sequences and ``T`` new tokens.

    Device tensors (all on the model's device):

    ``input_ids``        int64 ``(T,)``: new tokens of all sequences, sequence 0's first.
    ``positions``        int64 ``(T,)``: their positions (``context_len - q_len + i`` within a sequence).
    ``slot_mapping``     int64 ``(T,)``: physical slot (``block * block_size + offset``) of each new token;
                         must be ``>= 0`` (every new token is written).
    ``query_start_loc``  int64 ``(B + 1,)``: cumulative query lengths (``cu_seqlens``); sequence ``b`` owns
                         tokens ``query_start_loc[b]:query_start_loc[b + 1]``.
    ``context_lens``     int64 ``(B,)``: tokens of each sequence after this step (cached + new).
    ``block_tables``     int32 ``(B, max_blocks)``: block tables padded with ``NULL_BLOCK``; ``NULL_BLOCK``
                         inside a table marks a block released by the sliding window.
    ``logits_indices``   int64 ``(R,)``: rows of the flat token batch whose logits are returned
                         (default: the last new token of every sequence, so ``R == B``).

    Host copies used for planning (no device synchronisation): ``query_lens`` and ``context_lens_host``
    (tuples of ``B`` ints).

    ``sliding_window``: ``None`` for full attention, else ``W``: a query at position ``p`` attends the
    keys at positions ``p - W + 1 .. p``.

    ``groups``: with KV cache groups (:class:`pagedkv.HybridBlockManager`), one metadata per group (index order),
    each with that group's ``slot_mapping`` and ``block_tables`` and the same tokens (see
    :func:`build_group_attention_metadata`); ``None`` with one block table for all layers.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    sliding_window: int | None = None
    logits_indices: torch.Tensor | None = None
    groups: tuple[AttentionMetadata, ...] | None = None


    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """A copy with every tensor moved to ``device``."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return AttentionMetadata(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            query_start_loc=move(self.query_start_loc),
            context_lens=move(self.context_lens),
            block_tables=move(self.block_tables),
            query_lens=self.query_lens,
            context_lens_host=self.context_lens_host,
            sliding_window=self.sliding_window,
            logits_indices=move(self.logits_indices),
            groups=None if self.groups is None else tuple(g.to(device) for g in self.groups),
        )


def _as_int_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


def build_attention_metadata(
    new_token_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    slot_mapping: Any,
    block_tables: Any,
    *,
    block_size: int,
    sliding_window: int | None = None,
    logits: str | Sequence[int] = "last",
    device: torch.device | str | None = None,
    validate: bool = True,
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from host data (lists / numpy arrays) and validate it.

    ``new_token_ids[b]``: the new tokens of sequence ``b`` this step (prompt, prefill chunk or one
    decode token). ``num_computed[b]``: tokens of sequence ``b`` already in the KV cache, i.e. the
    position of its first new token. ``slot_mapping``: the ``T`` physical slots of the new tokens,
    concatenated in batch order (e.g. ``StepResult.slot_mapping`` of ``BlockManager.decode_step``,
    or ``BlockManager.slot_mapping(seq, start, end)`` per sequence, concatenated).
    ``block_tables``: a ``(B, M)`` array padded with ``NULL_BLOCK`` (e.g. ``StepResult.block_tables``)
    or a list of ``B`` 1-D tables (padded here). ``logits``: ``"last"`` (the last new token of each
    sequence), ``"all"`` (every new token) or explicit flat token indices. ``validate`` checks that
    every slot lies in the block its position maps to (cheap, vectorized numpy).
    """
    q_lens = [len(t) for t in new_token_ids]
    n_comp = _as_int_list(num_computed)
    if len(n_comp) != len(q_lens):
        raise ValueError("new_token_ids and num_computed differ in length")
    if any(q < 1 for q in q_lens):
        raise ValueError("every sequence of a step needs at least one new token")
    ctx = [c + q for c, q in zip(n_comp, q_lens)]
    n_tok = sum(q_lens)
    flat_ids = (np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in new_token_ids])
                if q_lens else np.zeros(0, dtype=np.int64))
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    # position of flat token i of sequence b: num_computed[b] + (i - starts[b])
    positions = np.arange(n_tok, dtype=np.int64) + np.repeat(np.asarray(n_comp, dtype=np.int64) - starts[:-1], q_lens)
    slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
    if slots.shape[0] != flat_ids.shape[0]:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {flat_ids.shape[0]} new tokens")
    if validate and slots.size and slots.min() < 0:
        raise ValueError("slot_mapping contains negative slots")

    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.cpu().numpy()
    if isinstance(block_tables, np.ndarray) and block_tables.ndim == 2:
        bt = block_tables.astype(np.int32, copy=False)
    else:
        rows = [np.asarray(t, dtype=np.int32).reshape(-1) for t in block_tables]
        width = max((len(r) for r in rows), default=0)
        bt = np.full((len(rows), max(width, 1)), NULL_BLOCK, dtype=np.int32)
        for i, r in enumerate(rows):
            bt[i, : len(r)] = r
    if bt.shape[0] != len(q_lens):
        raise ValueError(f"block_tables has {bt.shape[0]} rows for {len(q_lens)} sequences")
    need = max((-(-c // block_size) for c in ctx), default=0)
    if bt.shape[1] < need:
        raise ValueError(f"block_tables has {bt.shape[1]} columns, the longest context needs {need}")
    if validate and n_tok:
        # the slot of every new token must lie in the block its position maps to
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        expected_blocks = bt[seq_of_token, positions // block_size]
        if np.any(expected_blocks != slots // block_size) or np.any(slots % block_size != positions % block_size):
            raise ValueError("slot_mapping disagrees with the block tables")

    if isinstance(logits, str):
        if logits == "last":
            logits_idx = starts[1:] - 1
        elif logits == "all":
            logits_idx = np.arange(flat_ids.shape[0], dtype=np.int64)
        else:
            raise ValueError(f"logits must be 'last', 'all' or indices, not {logits!r}")
    else:
        logits_idx = np.asarray(logits, dtype=np.int64).reshape(-1)

    dev = torch.device(device) if device is not None else torch.device("cpu")
    as_t = lambda a, dt: torch.as_tensor(a, dtype=dt).to(dev)  # noqa: E731
    return AttentionMetadata(
        input_ids=as_t(flat_ids, torch.int64),
        positions=as_t(positions, torch.int64),
        slot_mapping=as_t(slots, torch.int64),
        query_start_loc=as_t(starts, torch.int64),
        context_lens=as_t(np.asarray(ctx, dtype=np.int64), torch.int64),
        block_tables=as_t(bt, torch.int32),
        query_lens=tuple(q_lens),
        context_lens_host=tuple(ctx),
        sliding_window=sliding_window,
        logits_indices=as_t(logits_idx, torch.int64),
    )


def build_group_attention_metadata(
    new_token_ids: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    slot_mappings: Any,
    block_tables: Sequence[Any],
    *,
    block_size: int,
    logits: str | Sequence[int] = "last",
    device: torch.device | str | None = None,
    validate: bool = True,
) -> AttentionMetadata:
    """:class:`AttentionMetadata` for KV cache groups: ``slot_mappings`` is ``(G, T)`` (each group's slot of each
    new token, e.g. ``HybridStepResult.slot_mapping``), ``block_tables[g]`` group ``g``'s tables (as
    :func:`build_attention_metadata` takes them). Returns group 0's metadata with ``groups`` set to every group's
    (validated as :func:`build_attention_metadata` validates one). O(G x the cost of one)."""
    slots = np.asarray(slot_mappings, dtype=np.int64)
    if slots.ndim != 2 or slots.shape[0] != len(block_tables):
        raise ValueError(f"slot_mappings must be (G, T) with G = {len(block_tables)} groups, got {slots.shape}")
    metas = tuple(build_attention_metadata(new_token_ids, num_computed, slots[g], block_tables[g],
                                           block_size=block_size, logits=logits, device=device, validate=validate)
                  for g in range(slots.shape[0]))
    return dataclasses.replace(metas[0], groups=metas)


# --------------------------------------------------------------------------------------------------
# KV cache helpers


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the KV cache tensor: ``(n_layer, 2, num_blocks, block_size, n_head_kv, head_dim)``."""
    return (config.n_layer, 2, num_blocks, block_size, config.n_head_kv, config.head_dim)


def _pairs_to_index(pairs: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(pairs, torch.Tensor):
        arr = pairs.detach().to("cpu", torch.int64)
    else:
        arr = torch.as_tensor(np.asarray(pairs, dtype=np.int64).reshape(-1, 2) if len(pairs) else
                              np.zeros((0, 2), dtype=np.int64))
    arr = arr.reshape(-1, 2)
    if arr.shape[0] == 0:
        return None
    return arr[:, 0].to(device), arr[:, 1].to(device)


@torch.inference_mode()
def copy_blocks(kv_cache: torch.Tensor, pairs: Any) -> None:
    """Copy-on-write: copy block ``src`` to block ``dst`` in every layer, for each ``(src, dst)`` pair.

    ``pairs`` is an ``(m, 2)`` int array/tensor or a list of tuples (e.g. ``StepResult.cow``). All
    sources are read before any destination is written.
    """
    idx = _pairs_to_index(pairs, kv_cache.device)
    if idx is None:
        return
    src, dst = idx
    kv_cache[:, :, dst] = kv_cache[:, :, src]


@torch.inference_mode()
def execute_copy_plan(plan: Any, kv_cache: torch.Tensor, cpu_kv_cache: torch.Tensor | None) -> None:
    """Execute a step's :class:`pagedkv.CopyPlan` (``BlockManager.take_copy_plan()``, ``StepPlan.copies``) on the
    KV caches, in order: each of its batches (consecutive copies of one kind that may run together) as one
    gather-then-scatter between the device cache and the CPU cache (or within the device cache)."""
    for kind, src, dst in plan.batches():
        if kind == 2:  # CopyKind.GPU_TO_GPU
            copy_blocks(kv_cache, np.stack((src, dst), axis=1))
        elif cpu_kv_cache is None:
            raise ValueError("the copy plan moves blocks to or from the CPU but there is no CPU KV cache")
        elif kind == 0:  # CopyKind.GPU_TO_CPU
            swap_blocks(kv_cache, cpu_kv_cache, np.stack((src, dst), axis=1))
        else:  # CopyKind.CPU_TO_GPU
            swap_blocks(cpu_kv_cache, kv_cache, np.stack((src, dst), axis=1))


@torch.inference_mode()
def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: Any) -> None:
    """Copy block ``s`` of ``src_cache`` to block ``d`` of ``dst_cache`` in every layer, for each ``(s, d)``.

    Used for swapping between the device cache and a CPU cache of the same layout (the block counts
    may differ): ``swap_blocks(gpu_cache, cpu_cache, bm.swap_out(...))`` and
    ``swap_blocks(cpu_cache, gpu_cache, bm.swap_in(...))``.
    """
    if src_cache.shape[:2] != dst_cache.shape[:2] or src_cache.shape[3:] != dst_cache.shape[3:]:
        raise ValueError(f"incompatible KV cache shapes {tuple(src_cache.shape)} and {tuple(dst_cache.shape)}")
    idx = _pairs_to_index(pairs, torch.device("cpu"))
    if idx is None:
        return
    src, dst = idx
    moved = src_cache[:, :, src.to(src_cache.device)]
    dst_cache[:, :, dst.to(dst_cache.device)] = moved.to(dst_cache.device, dtype=dst_cache.dtype)


# --------------------------------------------------------------------------------------------------
# model



_HAS_RMS_NORM = hasattr(F, "rms_norm")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _HAS_RMS_NORM and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedDecoder:
    """What the paged decoders here share: weights moved to a device/dtype (tied tensors kept tied, fused
    projections), the KV cache (:func:`kv_cache_shape`'s layout with one slot per layer, or per layer slot of a
    KV cache group, :meth:`kv_layer_slots`), cached rotary tables and one attention workspace per thread.

    A subclass sets ``config`` (``n_layer``, ``n_head_kv``, ``head_dim``), ``tokenizer_metadata``, ``device``,
    ``dtype`` and implements ``forward(meta, kv_cache)``.
    """

    config: Any
    device: torch.device
    dtype: torch.dtype
    tokenizer_metadata: TokenizerMetadata | None

    def _init_common(self, weights: dict[str, torch.Tensor], device: Any, dtype: torch.dtype | None) -> None:
        self.device = torch.device(device) if device is not None else weights["token_embd.weight"].device
        self.dtype = dtype or weights["token_embd.weight"].dtype
        self._weights = weights
        self._moved: dict[int, torch.Tensor] = {}
        self._rope_tables: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        self._local = threading.local()  # one attention workspace per thread (replicas may share a model)

    def _w(self, name: str) -> torch.Tensor:
        """The weight ``name`` on the model's device and dtype; tied tensors stay one tensor."""
        t = self._weights[name]
        key = id(t)
        if key not in self._moved:
            self._moved[key] = t.to(self.device, self.dtype)
        return self._moved[key]

    def _fused(self, *names: str) -> torch.Tensor:
        """The weights ``names`` stacked along the output dimension: one matmul for several projections."""
        return torch.cat([self._weights[n].to(self.device, self.dtype) for n in names], dim=0).contiguous()

    # ------------------------------------------------------------------ KV cache
    #: KV cache groups of the model's layers (``pagedkv.FullAttentionSpec`` / ``SlidingWindowSpec``, group index
    #: order) for a :class:`pagedkv.HybridBlockManager`; ``None``: every layer attends the same way (one table)
    kv_cache_groups: tuple | None = None

    def kv_layer_slots(self, grouped: bool = False) -> int:
        """Layer slots of the KV cache tensor (its first dimension): ``n_layer`` with one block table for all
        layers, the layers per group with KV cache groups (``grouped``)."""
        if not grouped:
            return self.config.n_layer
        if not self.kv_cache_groups:
            raise ValueError(f"{type(self).__name__} has no KV cache groups")
        return self.config.n_layer // len(self.kv_cache_groups)

    def kv_cache_shape(self, num_blocks: int, block_size: int, *, grouped: bool = False) -> tuple[int, ...]:
        c = self.config
        return (self.kv_layer_slots(grouped), 2, num_blocks, block_size, c.n_head_kv, c.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None, *,
                                 grouped: bool = False) -> int:
        """Bytes one block id occupies in the KV cache tensor (keys and values of every layer slot)."""
        elem = torch.empty(0, dtype=dtype or self.dtype).element_size()
        c = self.config
        return self.kv_layer_slots(grouped) * 2 * block_size * c.n_head_kv * c.head_dim * elem

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
        grouped: bool = False,
    ) -> torch.Tensor:
        """A zero-filled KV cache (zeros keep masked-out stale slots finite); ``grouped``: one slot per layer of a
        KV cache group (block ids of a :class:`pagedkv.HybridBlockManager`)."""
        dev = torch.device(device) if device is not None else self.device
        return torch.zeros(
            self.kv_cache_shape(num_blocks, block_size, grouped=grouped),
            dtype=dtype or self.dtype,
            device=dev,
            pin_memory=pin_memory and dev.type == "cpu" and torch.cuda.is_available(),
        )

    def _check_kv_cache(self, kv_cache: torch.Tensor, grouped: bool = False) -> None:
        if (kv_cache.dim() != 6 or kv_cache.shape[0] != self.kv_layer_slots(grouped) or kv_cache.shape[1] != 2):
            raise ValueError(f"KV cache must have shape {self.kv_cache_shape(-1, -1, grouped=grouped)}, got "
                             f"{tuple(kv_cache.shape)}")

    # ------------------------------------------------------------------ rotary tables and workspace
    def _rope(self, key: Any, inv_freq: torch.Tensor, positions: torch.Tensor,
              max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``positions`` as ``(T, 1, head_dim)`` for the frequencies ``inv_freq`` (cached under
        ``key``, grown by doubling)."""
        cos, sin = self._rope_tables.get(key, (None, None))
        if cos is None or max_pos > cos.shape[0] or cos.device != self.device:
            n = max(max_pos, 2 * (cos.shape[0] if cos is not None else 0), 256)
            freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)
            self._rope_tables[key] = (cos, sin)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    # ------------------------------------------------------------------ the layers' products
    #: the four products of a layer, each the GGUF matrices stacked along its output rows
    LINEAR_NAMES = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))

    def _make_linears(self, positions: tuple[int, ...], quantized: dict[str, QuantBlocks] | None) -> list[tuple]:
        """Per layer, its four products ``(qkv, attn_output, gate_up, down)`` (:data:`LINEAR_NAMES`; ``positions``:
        where each weight sits in ``self.layers[i]``): a :class:`~pagedkv.engine.qmatmul.QuantLinear` where the
        file's blocks have a kernel (few-row steps read the quantized weights), else the dense float32 product."""
        return [tuple(make_linear(self.layers[i][j], [f"blk.{i}.{n}.weight" for n in names], quantized)
                      for names, j in zip(self.LINEAR_NAMES, positions)) for i in range(self.config.n_layer)]

    @property
    def quant_kernels(self) -> bool:
        """Whether few-row steps read some of the file's quantized weights (:mod:`pagedkv.engine.qmatmul`)."""
        return any(lin.uses_kernel for layer in self.linears for lin in layer)

    def _workspace(self) -> AttentionWorkspace:
        ws = getattr(self._local, "workspace", None)
        if ws is None:
            ws = self._local.workspace = AttentionWorkspace()
        return ws


class PagedLlama(PagedDecoder):
    """A Llama decoder whose attention reads and writes a paged KV cache.

    ``weights`` uses the names of :mod:`pagedkv.engine.gguf_loader`. The tensors are moved to
    ``device``/``dtype``; the Q/K/V projections of a layer are fused into one matrix (one matmul), and so are
    the gate and up projections of its MLP. ``layers[i]`` is ``(attn_norm, w_qkv, attn_output, ffn_norm,
    w_gate_up, ffn_down)``.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tokenizer_metadata: TokenizerMetadata | None = None,
        quantized: dict[str, QuantBlocks] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer_metadata = tokenizer_metadata
        self._init_common(weights, device, dtype)
        w, fused = self._w, self._fused
        self.tok_embd = w("token_embd.weight")
        self.device = self.tok_embd.device  # normalized, e.g. "cuda" -> "cuda:0"
        self.out_norm = w("output_norm.weight")
        self.lm_head = w("output.weight")
        # exact float32 logits, and the bounded fast path (lm_head.py)
        self.head = LMHead(self.lm_head, quantized=head_linear(self.lm_head, quantized, max_rows=LMHead.QUANT_ROWS))
        self.layers = [
            (
                w(f"blk.{i}.attn_norm.weight"),
                fused(f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"),
                w(f"blk.{i}.attn_output.weight"),
                w(f"blk.{i}.ffn_norm.weight"),
                fused(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
                w(f"blk.{i}.ffn_down.weight"),
            )
            for i in range(config.n_layer)
        ]
        del self._weights, self._moved  # the model holds only what it uses
        self._inv_freq = rope_inv_freq(config, weights.get("rope_freqs.weight"))
        self.scale = 1.0 / math.sqrt(config.head_dim)
        #: per layer, its four products (:meth:`PagedDecoder._make_linears`)
        self.linears = self._make_linears((1, 2, 4, 5), quantized)

    @classmethod
    def from_gguf(
        cls, path: Any = None, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
        quant_kernels: bool = True,
    ) -> PagedLlama:
        """Load a GGUF file (default: :func:`find_default_model`) into a model; the tokenizer metadata
        is kept as ``model.tokenizer_metadata``. ``quant_kernels``: few-row steps read the file's quantized blocks
        (:mod:`pagedkv.engine.qmatmul`; float32 CPU weights only); False: every product is the dense float32 one."""
        reader = open_gguf(path if path is not None else find_default_model())  # read once, for both
        config, weights, tok_meta = load_gguf(reader=reader, dtype=dtype)
        quantized = load_blocks(reader, llama_row_convert(config)) if quant_kernels else None
        return cls(config, weights, device=device, dtype=dtype, tokenizer_metadata=tok_meta, quantized=quantized)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step; returns float32 logits ``(R, vocab)`` for ``meta.logits_indices``
        (by default the last new token of each sequence, in batch order)."""
        return self.head.logits(self.hidden(meta, kv_cache))

    @torch.inference_mode()
    def hidden(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step up to the LM head: the final-normed hidden states ``(R, n_embd)`` of
        ``meta.logits_indices`` (``forward`` is ``self.head.logits(self.hidden(...))``)."""
        c = self.config
        if meta.groups is not None:
            raise ValueError("PagedLlama has no KV cache groups (metadata with groups given)")
        self._check_kv_cache(kv_cache)
        block_size = kv_cache.shape[3]
        n_tok = meta.num_tokens
        plan = plan_paged_attention(meta, block_size, dtype=self.dtype)
        cos, sin = self._rope(None, self._inv_freq, meta.positions, max(meta.context_lens_host, default=0))
        n_head, n_kv, d = c.n_head, c.n_head_kv, c.head_dim
        n_ff = self.layers[0][4].shape[0] // 2 if self.layers else 0
        ws = self._workspace()

        x = self.tok_embd.index_select(0, meta.input_ids)  # (T, n_embd)
        for layer, (attn_norm, _, _, ffn_norm, _, _) in enumerate(self.layers):
            lin_qkv, lin_o, lin_gu, lin_down = self.linears[layer]
            h = _rms_norm(x, attn_norm, c.rms_eps)
            qkv = lin_qkv(h).view(n_tok, n_head + 2 * n_kv, d)
            qk = qkv[:, : n_head + n_kv]
            qk = qk * cos + _rotate_half(qk) * sin  # rotary embeddings of queries and keys in one go
            attn = paged_attention(qk[:, :n_head], qk[:, n_head:], qkv[:, n_head + n_kv:], kv_cache[layer], plan,
                                   scale=self.scale, workspace=ws)
            x = x + lin_o(attn.to(x.dtype))

            h = _rms_norm(x, ffn_norm, c.rms_eps)
            gu = lin_gu(h)
            x = x + lin_down(F.silu(gu[:, :n_ff]) * gu[:, n_ff:])

        idx = meta.logits_indices
        if idx is None:
            idx = meta.query_start_loc[1:] - 1
        return _rms_norm(x.index_select(0, idx), self.out_norm, c.rms_eps)

    __call__ = forward
