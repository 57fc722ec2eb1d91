"""Paged attention: write one layer's new keys/values into the paged KV cache and attend through block tables.

Two calls, so a model of any architecture can use them (``PagedLlama`` does; a model with a sliding window on
some layers only, such as Gemma 3, builds one plan per distinct window and passes each layer the plan of its
window)::

    plans = {w: plan_paged_attention(meta, block_size, sliding_window=w) for w in set(layer_windows)}
    ws = AttentionWorkspace()                       # one per model: reused by every layer and every step
    for i, layer in enumerate(layers):
        ...
        out = paged_attention(q, k, v, kv_cache[i], plans[layer_windows[i]], scale=..., workspace=ws)

The plan (built once per step, shared by all layers with that window) sorts the step's sequences into groups
of equal query length and picks, per group, one of two paths:

* **fresh prompts** (no token of the sequence is cached yet: ``context_len == q_len``): the keys are exactly the
  new tokens, so the group attends its own ``k``/``v`` directly with a causal (or causal band) mask; the cache is
  written but never read back, no gather at all;
* **everything else** (decodes, prefill chunks, prompts after a prefix-cache hit): the group's blocks are gathered
  from the layer's cache into a workspace buffer that is reused by every layer and step (a fresh buffer per layer
  costs a page fault per 4 KiB: measured 2-3x the copy itself), then one ``scaled_dot_product_attention`` over
  the group; the mask (additive, built once per step) is left out when every sequence of the group has the same
  context and no window cuts it: the keys are then sliced to that length.

Cost per layer: fresh prompts O(sum q_len^2) attention and no copy; other groups O(G * M * block_size) bytes
copied (``M`` blocks of the group's longest context, fewer with a window) plus the attention.

::

    kv_layer (2, num_blocks, block_size, n_kv, d)        workspace (2, G*M, block_size, n_kv, d)
    +----+----+----+----+----+----+                       +----+----+----+----+
    | b0 | b1 | b2 | b3 | b4 | .. |  -- index_select -->  | b3 | b0 | b4 | b1 |  -> SDPA (G, n_kv, M*bs, d)
    +----+----+----+----+----+----+    (table rows)       +----+----+----+----+
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:
    from pagedkv import NULL_BLOCK  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - core not importable
    NULL_BLOCK = -1

# grouped-query attention support in scaled_dot_product_attention (torch >= 2.5)
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)

__all__ = ["AttentionPlan", "AttentionWorkspace", "paged_attention", "plan_paged_attention"]


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
class AttentionPlan:
    """What :func:`paged_attention` needs for one step and one sliding-window setting (see the module doc).

    Built by :func:`plan_paged_attention` once per step; read-only; shared by every layer with that window.
    """

    groups: tuple[_Group, ...]
    slot_mapping: torch.Tensor  # (T,) int64 physical slot of each new token
    num_tokens: int
    block_size: int
    sliding_window: int | None


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


def plan_paged_attention(meta, block_size: int, *, sliding_window: int | None | str = "meta",
                         dtype: torch.dtype = torch.float32) -> AttentionPlan:
    """Plan one step's attention for a window setting (default: ``meta.sliding_window``).

    ``meta`` is an :class:`~pagedkv.engine.model.AttentionMetadata`; ``dtype`` is the dtype of the queries (the
    masks are built in it). Raises ``RuntimeError`` when a key some query needs lies in a ``NULL_BLOCK`` table
    entry. Cost: O(B) host work plus O(G * q_len * M * block_size) for the masks of the groups that need one.
    """
    window = meta.sliding_window if sliding_window == "meta" else sliding_window
    dev = meta.input_ids.device
    q_lens = meta.query_lens
    ctx = meta.context_lens_host
    by_len: dict[int, list[int]] = {}
    for b, q in enumerate(q_lens):
        by_len.setdefault(q, []).append(b)
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    groups: list[_Group] = []
    for q_len, seqs in by_len.items():
        seq_idx = np.asarray(seqs, dtype=np.int64)
        if len(by_len) == 1:
            token_idx = None  # every row of the batch, already in order
        else:
            rows = (starts[seq_idx][:, None] + np.arange(q_len)[None, :]).reshape(-1)
            token_idx = torch.from_numpy(rows).to(dev)
        g_ctx = [ctx[b] for b in seqs]
        if all(c == q_len for c in g_ctx):  # whole new prompts: keys are the new tokens themselves
            mask = None
            if window is not None and window < q_len:
                pos = torch.arange(q_len, device=dev)
                band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
                mask = _additive(band[None, None], dtype)
            groups.append(_Group(q_len, token_idx, len(seqs), True, None, q_len, mask, mask is None and q_len > 1))
            continue
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
            raise RuntimeError(
                "a key inside the attention window lies in a NULL_BLOCK table entry (the block was released "
                "too early or the block table is too short)"
            )
        if q_len == 1 and len(set(g_ctx)) == 1 and (window is None or window >= g_ctx[0]):
            # one decode token per sequence, all at the same context: every key up to it and nothing else
            num_keys, mask = g_ctx[0], None
        else:
            num_keys, mask = (last_block - first_block) * block_size, _additive(allowed[:, None], dtype)
        groups.append(_Group(q_len, token_idx, len(seqs), False, bt.clamp_min(0).reshape(-1), num_keys, mask, False))
    return AttentionPlan(tuple(groups), meta.slot_mapping, meta.num_tokens, block_size, window)


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
    n_kv = k.shape[1]
    kv_layer[0].flatten(0, 1).index_copy_(0, plan.slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].flatten(0, 1).index_copy_(0, plan.slot_mapping, v.to(kv_layer.dtype))
    ws = workspace if workspace is not None else AttentionWorkspace()
    groups = plan.groups
    if len(groups) == 1 and groups[0].token_idx is None:
        return _attend_group(groups[0], q, k, v, kv_layer, scale, ws)
    out = q.new_empty(n_tok, n_head * d)
    for g in groups:
        idx = g.token_idx
        out.index_copy_(0, idx, _attend_group(g, q.index_select(0, idx), k.index_select(0, idx),
                                              v.index_select(0, idx), kv_layer, scale, ws))
    return out


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
