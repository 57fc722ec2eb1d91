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

Steps 2 and 3 are :func:`~pagedkv.engine.paged_attention.paged_attention`, planned once per step and shared by
all layers (:mod:`pagedkv.engine.paged_attention`, which also builds the step's :class:`AttentionMetadata`).

The products
------------
At batch 1 a decode step reads every weight once: SmolLM2-135M's float32 weights are 428 MB per token (31.7 ms of
a 45.7 ms step on one thread, measured), its file's Q4_1 blocks 0.625 bytes a weight instead of 4. So each product
is a :class:`QuantLinear` where the file's blocks have a kernel (:mod:`pagedkv.engine.quant_blocks`): steps of up
to ``max_rows`` rows read the quantized blocks through the C kernels (:mod:`pagedkv.engine.cpu`), each weight
rebuilt in float32 bit for bit as gguf rebuilds it and the activations kept float32 (llama.cpp rounds them to 8
bits), so the product is the dequantized float32 matrix's up to summation order and greedy tokens stay the
reference's; larger steps (prefill, large batches: compute-bound) use the dense float32 matrix and BLAS.

The code is device-agnostic: put the weights (``PagedLlama(..., device=...)``), the KV cache and the
metadata (``build_attention_metadata(..., device=...)``) on the same device.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_loader import (ModelConfig, TokenizerMetadata, find_default_model, llama_row_convert, load_gguf,
                          open_gguf, rope_inv_freq)
from .cpu import ENTRY_POINTS, kernels, layer_table, step_kernel
from .paged_attention import (NULL_BLOCK, AttentionMetadata, AttentionPlan, AttentionWorkspace,
                              build_attention_metadata, build_group_attention_metadata, paged_attention,
                              plan_paged_attention)
from .quant_blocks import QuantBlocks, load_blocks
from .sampling import LMHead

__all__ = [
    "NULL_BLOCK",
    "AttentionMetadata",
    "AttentionPlan",
    "AttentionWorkspace",
    "DenseLinear",
    "PagedDecoder",
    "PagedLlama",
    "QuantLinear",
    "head_linear",
    "make_linear",
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
# the products: dense, or with the file's quantized weights


class QuantLinear:
    """``y = x @ W.T`` for a weight held both dense (float32 ``(N, K)``) and quantized: one :class:`QuantBlocks`, or
    several stacked along the output rows (a fused projection whose parts have different kinds, e.g. Gemma 3's
    Q5_0 Q/K with a Q8_0 V; adjacent parts of one kind are merged).

    ``x`` of up to ``max_rows`` rows (float32, on the CPU) goes through the quantized kernels (one call per part,
    each writing its columns of ``y``) on ``torch.get_num_threads()`` threads; anything else through ``F.linear``
    on the dense weight. Both give the product with the same float32 matrix (summation order aside).
    O(rows x N x K). ``ValueError`` when the shapes differ or ``x`` has another number of features."""

    __slots__ = ("weight", "kinds", "max_rows", "_parts", "_n", "_k", "_on")

    #: rows up to which the kernels are used (measured, benchmarks/qmatmul_ab.py: at 32 rows they still beat MKL on
    #: SmolLM2's products, one thread, by 0.75x; at 48 the dense product is ahead)
    DEFAULT_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, blocks: QuantBlocks | list[QuantBlocks], *,
                 max_rows: int | None = None) -> None:
        parts = [blocks] if isinstance(blocks, QuantBlocks) else list(blocks)
        merged: list[QuantBlocks] = []
        for b in parts:  # adjacent parts of one kind: one call
            if merged and merged[-1].kind == b.kind:
                merged[-1] = QuantBlocks.concat([merged[-1], b])
            else:
                merged.append(b)
        ks = {b.shape[1] for b in merged}
        n = sum(b.shape[0] for b in merged)
        if len(ks) != 1 or (n, ks.pop()) != tuple(weight.shape):
            raise ValueError(f"weight {tuple(weight.shape)} and blocks {[b.shape for b in parts]} differ in shape")
        self.weight = weight
        self.kinds = tuple(b.kind for b in merged)
        self.max_rows = self.DEFAULT_MAX_ROWS if max_rows is None else max_rows
        self._n, self._k = tuple(weight.shape)
        dll = kernels() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        self._on = dll is not None
        t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        row = 0
        self._parts = []
        for b in merged:  # (kernel, qs, d, aux, first output row, rows)
            self._parts.append((None if dll is None else getattr(dll, ENTRY_POINTS[b.kind]), t(b.qs), t(b.d), t(b.aux),
                                row, b.shape[0]))
            row += b.shape[0]

    @property
    def kind(self) -> str:
        """The quantization type of the blocks (``"Q4_1+Q8_0"`` for parts of several)."""
        return "+".join(self.kinds)

    @property
    def uses_kernel(self) -> bool:
        """Whether few-row products go through the quantized kernels (built, CPU, float32)."""
        return self._on

    def part_pointers(self) -> list[tuple]:
        """Per part: ``(kind, qs, d, aux, first output row, rows)``, the arrays as pointers (``aux`` ``None`` where
        the layout has none), for :func:`pagedkv.engine.cpu.layer_table`."""
        return [(k, qs.data_ptr(), d.data_ptr(), None if aux is None else aux.data_ptr(), row, n)
                for k, (_, qs, d, aux, row, n) in zip(self.kinds, self._parts)]

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized copy."""
        return sum(a.numel() * a.element_size() for p in self._parts for a in p[1:4] if a is not None)

    def set_kernels(self, dll: ctypes.CDLL) -> None:
        """Use the kernels of ``dll`` (a :func:`build_kernels` variant; for tests)."""
        self._parts = [(getattr(dll, ENTRY_POINTS[k]), *p[1:]) for k, p in zip(self.kinds, self._parts)]
        self._on = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if x.shape[-1] != self._k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight {self._k}")
        if not self._on or not 0 < rows <= self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight)
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty((rows, self._n), dtype=torch.float32)
        xp, ldx, yp, nt = x.data_ptr(), x.stride(0), y.data_ptr(), torch.get_num_threads()
        for fn, qs, d, aux, row, n in self._parts:
            fn(xp, rows, ldx, self._k, qs.data_ptr(), d.data_ptr(), None if aux is None else aux.data_ptr(),
               0, n, yp + 4 * row, self._n, nt)
        return y


class DenseLinear:
    """``F.linear`` with a fixed weight: the product of a weight without quantized blocks."""

    __slots__ = ("weight",)
    uses_kernel = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def make_linear(weight: torch.Tensor, names: list[str], quantized: dict[str, QuantBlocks] | None) -> Any:
    """The product with ``weight`` (the matrices ``names`` of a GGUF file stacked along the rows): a
    :class:`QuantLinear` when every part has blocks a kernel reads and the weight is float32 on the CPU, else a
    :class:`DenseLinear`."""
    parts = [quantized.get(n) for n in names] if quantized else [None]
    if any(p is None for p in parts) or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return DenseLinear(weight)
    return QuantLinear(weight, parts)


def head_linear(weight: torch.Tensor, quantized: dict[str, QuantBlocks] | None, *, max_rows: int) -> Any:
    """The LM head's quantized product (``output.weight``'s blocks, or ``token_embd.weight``'s when the file ties
    the output to the embedding), or ``None`` (no blocks a kernel reads, no kernels)."""
    if not quantized:
        return None
    name = "output.weight" if "output.weight" in quantized else "token_embd.weight"
    lin = make_linear(weight, [name], quantized)
    if not lin.uses_kernel:
        return None
    lin.max_rows = max_rows
    return lin


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
        cos, sin = self._rope_table(key, inv_freq, max_pos)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def _rope_table(self, key: Any, inv_freq: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``(cos, sin)`` tables, ``(P, head_dim)`` contiguous with ``P >= max_pos``."""
        cos, sin = self._rope_tables.get(key, (None, None))
        if cos is None or max_pos > cos.shape[0] or cos.device != self.device:
            n = max(max_pos, 2 * (cos.shape[0] if cos is not None else 0), 256)
            freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)
            self._rope_tables[key] = (cos, sin)
        return cos, sin

    # ------------------------------------------------------------------ the layers' products
    #: the four products of a layer, each the GGUF matrices stacked along its output rows
    LINEAR_NAMES = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))

    def _make_linears(self, positions: tuple[int, ...], quantized: dict[str, QuantBlocks] | None) -> list[tuple]:
        """Per layer, its four products ``(qkv, attn_output, gate_up, down)`` (:data:`LINEAR_NAMES`; ``positions``:
        where each weight sits in ``self.layers[i]``): a :class:`QuantLinear` where the
        file's blocks have a kernel (few-row steps read the quantized weights), else the dense float32 product."""
        return [tuple(make_linear(self.layers[i][j], [f"blk.{i}.{n}.weight" for n in names], quantized)
                      for names, j in zip(self.LINEAR_NAMES, positions)) for i in range(self.config.n_layer)]

    @property
    def quant_kernels(self) -> bool:
        """Whether few-row steps read some of the file's quantized weights (:class:`QuantLinear`)."""
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
        # exact float32 logits, and the bounded fast path (sampling.py)
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
        # the fused few-row step (one C call for every layer) where every product reads quantized blocks
        fusable = self.linears and all(lin.uses_kernel for layer in self.linears for lin in layer)
        self._fused_table = layer_table(
            [(layer[0].data_ptr(), layer[3].data_ptr(), *(lin.part_pointers() for lin in lins))
             for layer, lins in zip(self.layers, self.linears)]) if fusable and self.dtype == torch.float32 else None
        self._fused_linears = self.linears  # (a model whose products are replaced afterwards takes the torch path)
        self._fused_rows = min((lin.max_rows for layer in self.linears for lin in layer), default=0) if fusable else 0

    @classmethod
    def from_gguf(
        cls, path: Any = None, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
        quant_kernels: bool = True,
    ) -> PagedLlama:
        """Load a GGUF file (default: :func:`find_default_model`) into a model; the tokenizer metadata
        is kept as ``model.tokenizer_metadata``. ``quant_kernels``: few-row steps read the file's quantized blocks
        (:class:`QuantLinear`; float32 CPU weights only); False: every product is the dense float32 one."""
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
        if plan.ragged is not None and not plan.groups and n_tok <= self._fused_rows:
            fused = self._hidden_fused(meta, kv_cache, plan)
            if fused is not None:
                return fused
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

    def _hidden_fused(self, meta: AttentionMetadata, kv_cache: torch.Tensor, plan: AttentionPlan) -> Any:
        """:meth:`hidden` of a step whose attention is all ragged and whose products all read quantized blocks, as
        one C call over every layer (``pkv_llama_step``, :mod:`pagedkv.engine.cpu`); ``None`` where it does not
        apply (then the torch path runs). Buffers reused per thread and row count."""
        fn, table = step_kernel("pkv_llama_step"), self._fused_table
        if (fn is None or table is None or self.linears is not self._fused_linears or kv_cache.dtype != torch.float32
                or not kv_cache.is_contiguous()):
            return None
        c, n_tok, rag = self.config, meta.num_tokens, plan.ragged
        bufs = getattr(self._local, "fused", None)
        if bufs is None:
            bufs = self._local.fused = {}
        b = bufs.get(n_tok)
        if b is None:  # x, h, qkv, attn, tmp, gu, act, out
            n_ff = self.layers[0][4].shape[0] // 2
            widths = (c.n_embd, c.n_embd, (c.n_head + 2 * c.n_head_kv) * c.head_dim, c.n_head * c.head_dim,
                      c.n_embd, 2 * n_ff, n_ff, c.n_embd)
            b = bufs[n_tok] = [torch.empty(n_tok, w) for w in widths]
        x, out = b[0], b[7]
        torch.index_select(self.tok_embd, 0, meta.input_ids, out=x)
        cos, sin = self._rope_table(None, self._inv_freq, max(meta.context_lens_host, default=0))
        pos, slots = meta.positions, plan.slot_mapping
        _, _, num_blocks, bs, _, _ = kv_cache.shape
        bad = fn(table, c.n_layer, n_tok, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, b[6].shape[1], c.rms_eps,
                 self.scale, *(t.data_ptr() for t in b[:7]), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                 slots.data_ptr(), kv_cache.data_ptr(), num_blocks, bs, rag.tables.data_ptr(), rag.tables.shape[1],
                 rag.seqs.data_ptr(), rag.seqs.shape[0], rag.window, self.out_norm.data_ptr(), out.data_ptr(),
                 torch.get_num_threads())
        if bad:
            raise RuntimeError(f"the fused step read {bad} keys through a NULL_BLOCK or out-of-range block id")
        idx = meta.logits_indices
        return out.index_select(0, meta.query_start_loc[1:] - 1 if idx is None else idx)

    __call__ = forward
