"""A KV block's bytes as one payload, and back (the torch side of the storage tiers, issue 24 item 3).

The engine's KV cache is ``(n_layer, 2, num_blocks, block_size, n_head_kv, head_dim)`` (:mod:`pagedkv.engine.model`).
A block's payload is ``kv_cache[:, :, block]`` made contiguous: every layer's keys and values of its tokens, in the
layout ``"L<n_layer>,2,B<block_size>,H<n_head_kv>,D<head_dim>"`` (layer, K/V, token, KV head, dim), in the cache's
dtype. :func:`model_fingerprint` names it together with the weights (the GGUF file's digest, or the weights'
own when the model was built in memory), the dtype and the block size, so that no other model, dtype, block size
or layout ever loads it (:class:`pagedkv.tiers.ModelFingerprint`).

:func:`read_blocks` copies blocks out (one gather for the batch; the copy is the store's snapshot, taken in the
step that computed the blocks, so a block reused later can never poison a store); :func:`write_blocks` writes
loaded payloads into blocks (one scatter), before the forward of the step that admits the request.
Both O(blocks x block bytes).

**KV cache groups** (Gemma 3 on a :class:`pagedkv.HybridBlockManager`: one KV tensor whose block ids every group
draws from, so a block id's payload is one group's layers, and the functions above work on any group's blocks).
What a load of a prompt's first ``n`` blocks needs, per group, is :func:`group_block_ranges`: every block for full
attention, and for a sliding group of window W only the blocks its window still sees at position ``P = n x
block_size`` (the first token computed after the load): blocks ``(P - W + 1) // block_size`` on, the rule of the
hybrid manager's hits and of ``allocate(..., num_external_tokens=, external_window_only=True)``. The payloads of a
grouped transfer go **position by position** (:func:`group_transfer_order`: block 0 of every group that needs it,
then block 1, ...), so a transfer cut short keeps the longest usable prefix (:func:`usable_blocks`).
:func:`group_hold_block_ids` reads the blocks of that order from a holder's per-group tables;
:func:`write_external_groups` writes them into a loading request's per-group tables (positions a cut sliding
group holds as NULL_BLOCK are skipped). The storage tiers store group ``g``'s blocks under
``pagedkv.block_hashes(..., group=g)`` keys with ``model_fingerprint(...).for_group(g)`` and load only what
:func:`group_block_ranges` (defined torch-free in :mod:`pagedkv.tiers.connector`, re-exported here) says
(:mod:`pagedkv.engine.kv_tiers`).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from ..tiers.connector import group_block_ranges
from ..tiers.key import ModelFingerprint

__all__ = ["kv_layout", "model_fingerprint", "payload_bytes", "read_blocks", "weights_digest", "write_blocks",
           "write_external", "group_block_ranges", "group_transfer_order", "usable_blocks", "group_hold_block_ids",
           "write_external_groups"]

_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float64: "float64"}


def kv_layout(kv_cache: torch.Tensor) -> str:
    """The layout name of one block's payload in this cache."""
    L, two, _, bs, h, d = kv_cache.shape
    return f"L{L},{two},B{bs},H{h},D{d}"


def payload_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block's payload."""
    L, two, _, bs, h, d = kv_cache.shape
    return L * two * bs * h * d * kv_cache.element_size()


def weights_digest(model: Any) -> str:
    """The weights' identity: ``"gguf:<xxh3_128 of the file>"`` when the model knows its GGUF file
    (``model.source_path``, set by :func:`pagedkv.engine.registry.load_model`), else ``"weights:<xxh3_128 of every
    weight tensor the model holds in its public attributes: name, shape, dtype and bytes>"``. Computed once per
    model (cached on it). O(file or weights)."""
    cached = getattr(model, "_pagedkv_weights_digest", None)
    if cached is not None:
        return cached
    path = getattr(model, "source_path", None)
    h = xxhash.xxh3_128()
    if path is not None and os.path.isfile(path):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        out = "gguf:" + h.hexdigest()
    else:
        n = 0
        for name in sorted(vars(model)):  # the tensors the model computes with (public attributes, in order)
            if name.startswith("_"):
                continue
            v = getattr(model, name)
            items = v if isinstance(v, (list, tuple)) else (v,)
            for i, x in enumerate(items):
                for j, t in enumerate(x if isinstance(x, (list, tuple)) else (x,)):
                    if isinstance(t, torch.Tensor):
                        h.update(f"{name}[{i}][{j}]:{tuple(t.shape)}:{t.dtype};".encode())
                        flat = t.detach().cpu().contiguous().reshape(-1)  # (0-d tensors too)
                        h.update(flat.view(torch.uint8).numpy().data)
                        n += 1
        if not n:
            raise TypeError(f"{type(model).__name__}: no GGUF path and no weights to name the KV it computes")
        out = "weights:" + h.hexdigest()
    try:
        model._pagedkv_weights_digest = out
    except AttributeError:
        pass
    return out


def model_fingerprint(model: Any, kv_cache: torch.Tensor, group: int = 0) -> ModelFingerprint:
    """The fingerprint of the KV blocks ``model`` computes into ``kv_cache``."""
    dtype = _TORCH_DTYPES.get(kv_cache.dtype)
    if dtype is None:
        raise TypeError(f"no storage-tier name for KV dtype {kv_cache.dtype}")
    return ModelFingerprint(weights_digest(model), dtype, int(kv_cache.shape[3]), kv_layout(kv_cache), group)


def read_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[np.ndarray]:
    """A contiguous copy of each block's payload (one numpy array per block, views of one buffer), in order."""
    if not len(block_ids):
        return []
    idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=kv_cache.device)
    # (L, 2, n, B, H, D) -> (n, L, 2, B, H, D): each block's bytes contiguous
    out = kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    arr = out.view(torch.uint8).numpy() if out.dtype == torch.bfloat16 else out.numpy()
    return [arr[i] for i in range(arr.shape[0])]


def write_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
    """Write ``payloads[i]`` (bytes-like, one block's payload) into block ``block_ids[i]`` of ``kv_cache``."""
    n = len(block_ids)
    if n != len(payloads):
        raise ValueError(f"{n} blocks but {len(payloads)} payloads")
    if not n:
        return
    L, two, _, bs, h, d = kv_cache.shape
    want = payload_bytes(kv_cache)
    buf = np.empty((n, want), dtype=np.uint8)
    for i, p in enumerate(payloads):
        mv = memoryview(p).cast("B")
        if mv.nbytes != want:
            raise ValueError(f"a payload of {mv.nbytes} bytes for blocks of {want}")
        buf[i] = np.frombuffer(mv, dtype=np.uint8)
    src = torch.from_numpy(buf).view(kv_cache.dtype).view(n, L, two, bs, h, d).permute(1, 2, 0, 3, 4, 5)
    idx = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=kv_cache.device)
    kv_cache.index_copy_(2, idx, src.to(kv_cache.device))


def write_external(plan: Any, kv_cache: torch.Tensor, pending: dict, block_size: int) -> int:
    """Write the KV that arrived from outside into the blocks of the plan's prefills that use it (before the
    forward): ``pending`` maps a request id to ``(start_block, payloads)``, ``payloads[i]`` the KV of prompt block
    ``start_block + i``. Each prefill's entry is popped, used or not (a prefill without external tokens drops it).
    Returns the blocks written. O(written blocks x block bytes)."""
    written = 0
    for pw in plan.prefills:
        entry = pending.pop(pw.request_id, None)
        if entry is None or not pw.num_external_tokens:
            continue
        start, payloads = entry
        j0 = (pw.num_cached_tokens - pw.num_external_tokens) // block_size
        j1 = pw.num_cached_tokens // block_size
        write_blocks(kv_cache, pw.block_table[j0:j1].tolist(), payloads[j0 - start:j1 - start])
        written += j1 - j0
    return written


# ------------------------------------------------------------------------------------------ KV cache groups
def group_transfer_order(num_blocks: int, block_size: int, windows: Sequence[int | None]) -> list[tuple[int, int]]:
    """The ``(group, block)`` pairs of a grouped transfer of ``num_blocks`` prompt blocks, in wire order:
    position by position, groups in index order at each position (see the module docstring).
    O(transferred blocks)."""
    ranges = group_block_ranges(num_blocks, block_size, windows)
    return [(g, j) for j in range(num_blocks) for g, (a, _) in enumerate(ranges) if j >= a]


def usable_blocks(num_blocks: int, block_size: int, windows: Sequence[int | None], received: int) -> int:
    """The most leading prompt blocks ``m <= num_blocks`` a load can use when only the first ``received`` payloads
    of :func:`group_transfer_order` ``(num_blocks, ...)`` arrived: every group's blocks that a load of ``m``
    blocks needs (:func:`group_block_ranges` of ``m``) arrived. A sliding group's earlier blocks were never sent,
    so a long prompt cut short is usually 0 (computed). O(num_blocks x groups)."""
    if received <= 0:
        return 0
    order = group_transfer_order(num_blocks, block_size, windows)
    got = order[: min(received, len(order))]
    lo = [num_blocks] * len(windows)
    hi = [0] * len(windows)
    for g, j in got:  # (each group's received blocks are one contiguous run)
        lo[g] = min(lo[g], j)
        hi[g] = max(hi[g], j + 1)
    for m in range(num_blocks, 0, -1):
        ok = True
        for g, (a, z) in enumerate(group_block_ranges(m, block_size, windows)):
            if a < z and not (lo[g] <= a and z <= hi[g]):
                ok = False
                break
        if ok:
            return m
    return 0


def group_hold_block_ids(tables: Sequence[Any], num_blocks: int, block_size: int,
                         windows: Sequence[int | None]) -> list[int] | None:
    """The block ids (one flat list, in :func:`group_transfer_order`) that hold a grouped transfer of the first
    ``num_blocks`` prompt blocks, read from a holder's per-group block tables (``tables[g][j]``: NULL_BLOCK, < 0,
    where a group holds none); None when a needed block is not held (a sliding window released it).
    O(transferred blocks)."""
    out = []
    for g, j in group_transfer_order(num_blocks, block_size, windows):
        t = tables[g]
        b = int(t[j]) if j < len(t) else -1
        if b < 0:
            return None
        out.append(b)
    return out


def write_external_groups(plan: Any, kv_cache: torch.Tensor, pending: dict, block_size: int) -> int:
    """:func:`write_external` for a model with KV cache groups (``pw.block_table``: one table per group):
    ``pending`` maps a request id to ``{(group, block): payload}`` (a transfer's payloads by
    :func:`group_transfer_order`). For each prefill with external tokens, every group's blocks of the external
    range are written from its entry; a position the group's table holds as NULL_BLOCK (a sliding group's block
    its window no longer sees, ``external_window_only``) is skipped. Each prefill's entry is popped. Raises
    KeyError when a block to write has no payload (the allocation and the payloads disagree: a bug, nothing
    written for that prefill). Returns the blocks written. O(written blocks x block bytes)."""
    ids, payloads = [], []
    for pw in plan.prefills:
        entry = pending.pop(pw.request_id, None)
        if entry is None or not pw.num_external_tokens:
            continue
        j0 = (pw.num_cached_tokens - pw.num_external_tokens) // block_size
        j1 = pw.num_cached_tokens // block_size
        mine_ids, mine = [], []
        for g, table in enumerate(pw.block_table):
            for j in range(j0, j1):
                b = int(table[j])
                if b < 0:
                    continue
                mine_ids.append(b)
                mine.append(entry[(g, j)])
        ids += mine_ids
        payloads += mine
    write_blocks(kv_cache, ids, payloads)
    return len(ids)
