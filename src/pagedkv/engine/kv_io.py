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
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

from ..tiers.key import ModelFingerprint

__all__ = ["kv_layout", "model_fingerprint", "payload_bytes", "read_blocks", "weights_digest", "write_blocks"]

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
