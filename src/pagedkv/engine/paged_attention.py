"""Paged attention: write one layer's new keys/values into the paged KV cache and attend through block tables.

Two calls (``PagedLlama`` makes them; Gemma 3, a sliding window on some layers only, builds one plan per window)::

    plans = {w: plan_paged_attention(meta, block_size, sliding_window=w) for w in set(layer_windows)}
    ws = AttentionWorkspace()                       # one per model: reused by every layer and every step
    for i, layer in enumerate(layers):
        out = paged_attention(q, k, v, kv_cache[i], plans[layer_windows[i]], scale=..., workspace=ws)

The step's :class:`AttentionMetadata` (:func:`build_attention_metadata`, once per step, from the block manager's
slots and tables) says what each sequence adds. The plan (once per step, shared by all layers with that window)
sorts the sequences by query length and, in the default mode ``"ragged"`` (:data:`ATTENTION_MODES`;
``PAGEDKV_ATTENTION`` or :func:`set_attention_mode` pick another), sends each to one of three paths:

* **fresh prompts** (no token of the sequence is cached yet: ``context_len == q_len``): the keys are exactly the
  new tokens, so sequences of one query length attend their own ``k``/``v`` directly with a causal (or causal
  band) mask; the cache is written but never read back, no gather at all;
* **decodes and short queries** (up to :data:`KERNEL_MAX_QUERY_LEN` new tokens after cached ones): the C kernel
  ``pkv_paged_attn`` (``_qkernels.c``, :mod:`pagedkv.engine.cpu`) reads each sequence's own keys and values
  through its block table, exactly its context (its window on sliding layers): no gather, no padding to the
  batch's longest, no mask; one call per layer for all of them, OpenMP over (sequence, KV head);
* **longer chunks** (and everything not fresh when the kernel is off): split into groups of similar context
  (:func:`_buckets`: a sequence is padded by at most :data:`BUCKET_SLACK_KEYS` keys or a quarter of its group's
  span), each group's blocks gathered (``index_select`` of its table rows) into a workspace buffer reused by every
  layer and step (a fresh buffer per layer costs a page fault per 4 KiB: measured 2-3x the copy itself), then one
  ``scaled_dot_product_attention``; the mask (additive, built once per step) is left out when every sequence of a
  decode group has the same context and no window cuts it: the keys are then sliced to that length.

``"bucketed"`` is the last path for everything not fresh (without the kernels, or a cache the kernel cannot read:
not float32, not contiguous); ``"padded"`` is the former plan, one group per query length gathered up to its
longest context, kept for A/B runs (``benchmarks/ragged_attention_ab.py``, ``benchmarks/mixed_lengths.py``).

Cost per layer: fresh prompts O(sum q_len^2) attention and no copy; the kernel O(sum over query rows of keys x
n_head x d), reading each needed key once per query row; gathered groups O(G * M * block_size) bytes copied (``M``
blocks of the group's longest context, fewer with a window) plus the attention.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

try:
    from pagedkv import NULL_BLOCK  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - core not importable
    NULL_BLOCK = -1

# grouped-query attention support in scaled_dot_product_attention (torch >= 2.5)
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)

__all__ = ["ATTENTION_MODES", "AttentionMetadata", "AttentionPlan", "AttentionWorkspace", "attention_mode",
           "build_attention_metadata", "build_group_attention_metadata", "paged_attention",
           "plan_paged_attention", "set_attention_mode"]

#: ``"ragged"``: non-fresh sequences with a query of up to :data:`KERNEL_MAX_QUERY_LEN` tokens go through the C
#: kernel, each over its own keys; the rest as ``"bucketed"`` (the same when the kernels are not built).
#: ``"bucketed"``: groups of equal query length split further by context (:func:`_buckets`), each gathered and
#: attended by SDPA. ``"padded"``: the former path, one group per query length gathered up to its longest context.
ATTENTION_MODES = ("ragged", "bucketed", "padded")
#: query tokens per sequence up to which the kernel attends it (decodes, short chunks); longer ones go to SDPA
KERNEL_MAX_QUERY_LEN = 4
#: padding (keys) a sequence may take to share a gathered group (about the cost of one more group per layer)
BUCKET_SLACK_KEYS = 128
_NULL_MSG = ("a key inside the attention window lies in a NULL_BLOCK table entry (the block was released too "
             "early or the block table is too short)")


def _check_mode(mode: str) -> str:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {', '.join(ATTENTION_MODES)}, not {mode!r}")
    return mode


_MODE = _check_mode(os.environ.get("PAGEDKV_ATTENTION", "ragged"))


def attention_mode() -> str:
    """The mode plans take by default: ``PAGEDKV_ATTENTION`` at import (default ``"ragged"``), or
    :func:`set_attention_mode`'s."""
    return _MODE


def set_attention_mode(mode: str) -> str:
    """Make ``mode`` (one of :data:`ATTENTION_MODES`) the default of later plans, process-wide (for A/B runs);
    returns the previous one. ``ValueError`` for another name."""
    global _MODE
    prev, _MODE = _MODE, _check_mode(mode)
    return prev


_KERNEL: list = []


def _kernel() -> Any:
    """The C entry point ``pkv_paged_attn`` (``_qkernels.c``, built by :func:`pagedkv.engine.cpu.kernels`), or
    ``None`` when the kernels are not built or disabled (``PAGEDKV_QKERNELS=0``)."""
    if not _KERNEL:
        from .cpu import kernels

        dll = kernels()
        _KERNEL.append(None if dll is None else bind_kernel(dll))
    return _KERNEL[0]


def bind_kernel(dll: ctypes.CDLL) -> Any:
    """``dll.pkv_paged_attn`` with its signature set (``dll``: a :func:`pagedkv.engine.cpu.build_kernels`
    build; tests bind the AVX2 and plain-C variants this way)."""
    fn = dll.pkv_paged_attn
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [vp, i64, vp, i64, i64, i64, i64, i64, vp, i64, vp, i64, i64, ctypes.c_float, vp, i64, ctypes.c_int]
    fn.restype = i64
    return fn


@dataclass(frozen=True)
class _Group:
    """Sequences of one step that share the same query length, attended as one dense batch."""

    q_len: int
    token_idx: torch.Tensor | None  # (G * q_len,) rows of the flat batch; None = every row, in order
    num_seqs: int
    fresh: bool  # every sequence is a whole new prompt: attend the new k/v directly
    block_ids: torch.Tensor | None  # (G * M,) int64 block ids to gather (NULL clamped to 0); None when fresh
    num_keys: int  # keys per sequence after the gather (M * block_size, or the common context length)
    mask: torch.Tensor | None  # additive (G or 1, 1, q_len, num_keys) in the model dtype; None = no mask
    causal: bool  # fresh group without a window: SDPA's is_causal


@dataclass(frozen=True)
class _Ragged:
    """Sequences of one step attended by the C kernel, each over exactly its own keys (no gather, no mask)."""

    seqs: torch.Tensor  # (S, 4) int64: table row, first row in the flat batch, q_len, context
    tables: torch.Tensor  # (B, M) int32, contiguous: the step's block tables
    window: int  # 0: none
    seq_list: tuple[int, ...]  # the same sequences (batch indices), for the torch fallback
    meta: Any  # the step's metadata, for the torch fallback
    fallback: dict = field(default_factory=dict, compare=False)  # built on demand: dtype -> groups


@dataclass(frozen=True)
class AttentionPlan:
    """What :func:`paged_attention` needs for one step and one sliding-window setting (see the module doc).

    Built by :func:`plan_paged_attention` once per step; read-only; shared by every layer with that window.
    """

    groups: tuple[_Group, ...]
    slot_mapping: torch.Tensor  # (T,) int64 physical slot of each new token
    num_tokens: int
    block_size: int
    sliding_window: int | None
    ragged: _Ragged | None = None  # the kernel's sequences (mode "ragged"), None when there are none
    mode: str = "padded"


class AttentionWorkspace:
    """A scratch buffer for the gathered keys/values, grown on demand and reused by every call.

    Not thread-safe: one forward at a time per workspace.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` backed by the workspace (valid until the next ``take``)."""
        n = int(np.prod(shape))
        b = self._buf
        if b is None or b.numel() < n or b.dtype != dtype or b.device != device:
            self._buf = b = torch.empty(max(n, int(1.25 * n)), dtype=dtype, device=device)
        return b[:n].view(shape)


# --------------------------------------------------------------------------------------------------
# metadata: one step's sequences, slots and tables


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
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        if self.groups is not None:
            moved["groups"] = tuple(g.to(device) for g in self.groups)
        return AttentionMetadata(**moved)


def _as_int_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


def build_attention_metadata(new_token_ids: Sequence[Sequence[int]], num_computed: Sequence[int], slot_mapping: Any,
                             block_tables: Any, *, block_size: int, sliding_window: int | None = None,
                             logits: str | Sequence[int] = "last", device: torch.device | str | None = None,
                             validate: bool = True) -> AttentionMetadata:
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


def build_group_attention_metadata(new_token_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                                   slot_mappings: Any, block_tables: Sequence[Any], *, block_size: int,
                                   logits: str | Sequence[int] = "last", device: torch.device | str | None = None,
                                   validate: bool = True) -> AttentionMetadata:
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


def plan_paged_attention(meta, block_size: int, *, sliding_window: int | None | str = "meta",
                         dtype: torch.dtype = torch.float32, mode: str | None = None) -> AttentionPlan:
    """Plan one step's attention for a window setting (default: ``meta.sliding_window``).

    ``meta`` is an :class:`~pagedkv.engine.model.AttentionMetadata`; ``dtype`` is the dtype of the queries (the
    masks are built in it); ``mode``: ``"ragged"``, ``"bucketed"`` or ``"padded"`` (default: :func:`attention_mode`;
    the module doc). Raises ``RuntimeError`` when a key some query needs lies in a ``NULL_BLOCK`` table entry.
    Cost: O(B log B) host work, plus O(S * M) for the NULL check of the kernel's ``S`` sequences (``M`` table
    columns) and O(G * q_len * keys) for the masks of the gathered groups that need one.
    """
    window = meta.sliding_window if sliding_window == "meta" else sliding_window
    mode = _MODE if mode is None else _check_mode(mode)
    q_lens = meta.query_lens
    ctx = meta.context_lens_host
    by_len: dict[int, list[int]] = {}
    for b, q in enumerate(q_lens):
        by_len.setdefault(q, []).append(b)
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    use_kernel = (mode == "ragged" and dtype == torch.float32 and meta.input_ids.device.type == "cpu"
                  and _kernel() is not None)
    parts: list[tuple[int, list[int], bool]] = []  # (q_len, sequences, fresh)
    ragged: list[int] = []
    for q_len, seqs in by_len.items():
        if mode == "padded":  # one group per query length, gathered up to its longest context
            parts.append((q_len, seqs, all(ctx[b] == q_len for b in seqs)))
            continue
        fresh = [b for b in seqs if ctx[b] == q_len]
        rest = [b for b in seqs if ctx[b] != q_len]
        if fresh:
            parts.append((q_len, fresh, True))
        if use_kernel and q_len <= KERNEL_MAX_QUERY_LEN:
            ragged += rest
        else:
            parts += [(q_len, bucket, False) for bucket in _buckets(rest, q_len, ctx, block_size, window)]
    in_order = len(parts) == 1 and not ragged and parts[0][1] == list(range(len(q_lens)))
    groups = tuple(_plan_group(meta, q_len, seqs, fresh, None if in_order else starts, block_size, window, dtype)
                   for q_len, seqs, fresh in parts)
    rag = _plan_ragged(meta, ragged, starts, block_size, window) if ragged else None
    return AttentionPlan(groups, meta.slot_mapping, meta.num_tokens, block_size, window, rag, mode)


def _buckets(seqs: list[int], q_len: int, ctx, block_size: int, window: int | None) -> list[list[int]]:
    """``seqs`` (same ``q_len``, none fresh) split into groups whose gathered block spans pad no sequence by more
    than :data:`BUCKET_SLACK_KEYS` keys or a quarter of the span, whichever is more (longest contexts first;
    each group then costs one gather and one SDPA per layer). O(n log n)."""
    if len(seqs) <= 1:
        return [seqs] if seqs else []
    spans = []
    for b in seqs:
        hi = -(-ctx[b] // block_size)
        lo = 0 if window is None else max(0, ctx[b] - q_len - window + 1) // block_size
        spans.append((hi, lo, b))
    spans.sort(key=lambda s: (-s[0], s[2]))  # longest first; batch order among equals
    out: list[list[int]] = []
    cur: list[int] = []
    cur_hi = cur_lo = narrow = 0
    for hi, lo, b in spans:
        if cur:
            u_lo, n = min(cur_lo, lo), min(narrow, hi - lo)
            width = cur_hi - u_lo
            if (width - n) * block_size <= max(BUCKET_SLACK_KEYS, width * block_size // 4):
                cur.append(b)
                cur_lo, narrow = u_lo, n
                continue
            out.append(cur)
        cur, cur_hi, cur_lo, narrow = [b], hi, lo, hi - lo
    out.append(cur)
    return out


def _plan_group(meta, q_len: int, seqs: list[int], fresh: bool, starts: np.ndarray | None, block_size: int,
                window: int | None, dtype: torch.dtype) -> _Group:
    """One dense group: ``seqs`` (same ``q_len``) attended by one SDPA; ``starts`` ``None``: every row, in order."""
    dev = meta.input_ids.device
    ctx = meta.context_lens_host
    seq_idx = np.asarray(seqs, dtype=np.int64)
    token_idx = None
    if starts is not None:
        rows = (starts[seq_idx][:, None] + np.arange(q_len)[None, :]).reshape(-1)
        token_idx = torch.from_numpy(rows).to(dev)
    g_ctx = [ctx[b] for b in seqs]
    if fresh:  # whole new prompts: keys are the new tokens themselves
        mask = None
        if window is not None and window < q_len:
            pos = torch.arange(q_len, device=dev)
            band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            mask = _additive(band[None, None], dtype)
        return _Group(q_len, token_idx, len(seqs), True, None, q_len, mask, mask is None and q_len > 1)
    last_block = -(-max(g_ctx) // block_size)  # blocks needed by the longest context
    first_block = 0
    if window is not None:
        # keys older than every query's window are never read: skip their blocks entirely
        lowest_key = min(c - q_len for c in g_ctx) - window + 1
        first_block = max(0, lowest_key) // block_size
    sel = torch.from_numpy(seq_idx).to(dev)
    bt = meta.block_tables.index_select(0, sel)[:, first_block:last_block].long()
    key_pos = torch.arange(first_block * block_size, last_block * block_size, device=dev)
    g_ctx_t = meta.context_lens.index_select(0, sel)
    q_pos = g_ctx_t[:, None] - q_len + torch.arange(q_len, device=dev)[None, :]  # (G, q_len)
    allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # causal
    if window is not None:
        allowed &= key_pos[None, None, :] > (q_pos[:, :, None] - window)
    # every key a query needs must be in a real block; NULL_BLOCK entries are only legal where
    # no query looks (padding, blocks released by the sliding window)
    released = (bt == NULL_BLOCK).repeat_interleave(block_size, dim=1)  # (G, keys)
    if bool((allowed & released[:, None, :]).any()):
        raise RuntimeError(_NULL_MSG)
    if q_len == 1 and len(set(g_ctx)) == 1 and (window is None or window >= g_ctx[0]):
        # one decode token per sequence, all at the same context: every key up to it and nothing else
        num_keys, mask = g_ctx[0], None
    else:
        num_keys, mask = (last_block - first_block) * block_size, _additive(allowed[:, None], dtype)
    return _Group(q_len, token_idx, len(seqs), False, bt.clamp_min(0).reshape(-1), num_keys, mask, False)


def _plan_ragged(meta, seqs: list[int], starts: np.ndarray, block_size: int, window: int | None) -> _Ragged:
    """The kernel's part of the step: ``seqs`` as ``(table row, first row, q_len, context)``, after checking that
    no key a query needs lies in a ``NULL_BLOCK`` entry (O(S * M) numpy on the host's table)."""
    sel = np.asarray(seqs, dtype=np.int64)
    ctx = np.asarray(meta.context_lens_host, dtype=np.int64)[sel]
    q_len = np.asarray(meta.query_lens, dtype=np.int64)[sel]
    tables = meta.block_tables
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    first_key = np.zeros_like(ctx) if window is None else np.maximum(ctx - q_len - window + 1, 0)
    cols = np.arange(tables.shape[1])
    need = (cols[None, :] >= (first_key // block_size)[:, None]) & (cols[None, :] <= ((ctx - 1) // block_size)[:, None])
    if bool((need & (tables.numpy()[sel] == NULL_BLOCK)).any()):
        raise RuntimeError(_NULL_MSG)
    desc = torch.from_numpy(np.stack([sel, starts[sel], q_len, ctx], axis=1).astype(np.int64, copy=False))
    return _Ragged(desc.contiguous(), tables, 0 if window is None else int(window), tuple(seqs), meta)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean "may attend" mask as an additive one (0 / -inf) in ``dtype``: SDPA then adds it as it is."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan,
                    *, scale: float, workspace: AttentionWorkspace | None = None) -> torch.Tensor:
    """Write ``k``/``v`` of the step's new tokens into ``kv_layer`` and return the attention output.

    ``q``: ``(T, n_head, d)``; ``k``, ``v``: ``(T, n_kv, d)`` (views of a fused projection are fine);
    ``kv_layer``: one layer of the cache, ``(2, num_blocks, block_size, n_kv, d)``. Returns ``(T, n_head * d)``
    in the query dtype, rows in the order of the flat batch. ``n_head`` must be a multiple of ``n_kv`` (grouped
    queries). ``workspace``: reuse one across layers and steps (a new one is made when ``None``).
    """
    n_tok, n_head, d = q.shape
    kv_layer[0].flatten(0, 1).index_copy_(0, plan.slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].flatten(0, 1).index_copy_(0, plan.slot_mapping, v.to(kv_layer.dtype))
    ws = workspace if workspace is not None else AttentionWorkspace()
    groups, rag = plan.groups, plan.ragged
    if rag is not None and not _kernel_fits(q, kv_layer):
        groups = groups + _fallback_groups(rag, plan, q.dtype)
        rag = None
    if rag is None and len(groups) == 1 and groups[0].token_idx is None:
        return _attend_group(groups[0], q, k, v, kv_layer, scale, ws)
    out = q.new_empty(n_tok, n_head * d)
    if rag is not None:
        _attend_ragged(rag, q, kv_layer, scale, out)
    for g in groups:
        idx = g.token_idx
        out.index_copy_(0, idx, _attend_group(g, q.index_select(0, idx), k.index_select(0, idx),
                                              v.index_select(0, idx), kv_layer, scale, ws))
    return out


def _kernel_fits(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether the kernel reads these tensors as they are: float32 on the CPU, a contiguous cache layer, and
    queries whose heads lie one after another (a view of a fused projection is fine)."""
    return (q.dtype == torch.float32 and kv_layer.dtype == torch.float32 and q.device.type == "cpu"
            and kv_layer.device.type == "cpu" and kv_layer.is_contiguous() and q.stride(2) == 1
            and q.stride(1) == q.shape[2])


def _fallback_groups(rag: _Ragged, plan: AttentionPlan, dtype: torch.dtype) -> tuple[_Group, ...]:
    """The kernel's sequences as bucketed SDPA groups (a cache or queries the kernel cannot read); built once per
    plan and dtype."""
    got = rag.fallback.get(dtype)
    if got is None:
        meta, bs, w = rag.meta, plan.block_size, plan.sliding_window
        starts = np.zeros(len(meta.query_lens) + 1, dtype=np.int64)
        np.cumsum(meta.query_lens, out=starts[1:])
        by_len: dict[int, list[int]] = {}
        for b in rag.seq_list:
            by_len.setdefault(meta.query_lens[b], []).append(b)
        got = rag.fallback[dtype] = tuple(_plan_group(meta, q_len, bucket, False, starts, bs, w, dtype)
                                          for q_len, seqs in by_len.items()
                                          for bucket in _buckets(seqs, q_len, meta.context_lens_host, bs, w))
    return got


def _attend_ragged(rag: _Ragged, q: torch.Tensor, kv_layer: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """The C kernel over the plan's ragged sequences: writes their rows of ``out`` (contiguous ``(T, H * d)``)."""
    _, n_head, d = q.shape
    _, num_blocks, bs, n_kv, _ = kv_layer.shape
    bad = _kernel()(q.data_ptr(), q.stride(0), kv_layer.data_ptr(), num_blocks, bs, n_kv, d, n_head,
                    rag.tables.data_ptr(), rag.tables.shape[1], rag.seqs.data_ptr(), rag.seqs.shape[0], rag.window,
                    scale, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if bad < 0:
        raise ValueError(f"the attention kernel takes n_head a multiple of n_kv, at most 256 (got {n_head}, {n_kv})")
    if bad:
        raise RuntimeError(f"paged attention read {bad} keys through a NULL_BLOCK or out-of-range block id (or ran "
                           "out of memory for its scratch)")


def _sdpa(qh, kh, vh, mask, causal, scale, n_group):
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=n_group > 1)
    if n_group > 1:  # older torch: repeat each KV head for its query heads (head h uses KV head h // n_group)
        kh = kh.repeat_interleave(n_group, dim=1)
        vh = vh.repeat_interleave(n_group, dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale)


def _attend_group(g: _Group, q, k, v, kv_layer, scale, ws) -> torch.Tensor:
    n_seq, lq = g.num_seqs, g.q_len
    _, n_head, d = q.shape
    n_kv = k.shape[1]
    qh = q.reshape(n_seq, lq, n_head, d).transpose(1, 2)  # (G, n_head, lq, d)
    if g.fresh:
        kh = k.to(q.dtype).reshape(n_seq, lq, n_kv, d).transpose(1, 2)
        vh = v.to(q.dtype).reshape(n_seq, lq, n_kv, d).transpose(1, 2)
    else:
        bs = kv_layer.shape[2]
        n_blocks = g.block_ids.shape[0] // n_seq
        gathered = ws.take((2, g.block_ids.shape[0], bs, n_kv, d), kv_layer.dtype, kv_layer.device)
        torch.index_select(kv_layer, 1, g.block_ids, out=gathered)
        kv = gathered.view(2, n_seq, n_blocks * bs, n_kv, d)[:, :, : g.num_keys]
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        kh = kv[0].transpose(1, 2)  # (G, n_kv, keys, d)
        vh = kv[1].transpose(1, 2)
    out = _sdpa(qh, kh, vh, g.mask, g.causal, scale, n_head // n_kv)
    return out.transpose(1, 2).reshape(n_seq * lq, n_head * d)
