"""What :class:`~pagedkv.engine.core.EngineCore` is built from: the model and its tokenizer
(:func:`load_model_parts`), the block manager and the KV caches (:func:`build_cache`), from the configs of
:mod:`pagedkv.engine.config`. Run once, when an engine is made (never on a step). ``InvalidArgumentError`` for
what the configs cannot check alone (``max_model_len`` past the model's context, ``sliding_window`` on a model with
per-layer windows, ``quant_kernels=False`` with a model loaded with them)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ..errors import InvalidArgumentError
from ..hybrid import HybridBlockManager
from ..manager import BlockManager
from .config import CacheConfig, ModelRunConfig, SchedulerConfig, TierConfig, parse_store_policy
from .registry import load_model, make_tokenizer

__all__ = ["ModelParts", "CacheParts", "load_model_parts", "build_cache"]


class ModelParts(NamedTuple):
    model: Any
    device: torch.device
    tokenizer: Any
    max_model_len: int  #: the longest sequence a request may have (the model's context, or less)
    quant_kernels: bool  #: whether decode steps read the file's quantized weights (asked for, and they built)
    fast_lm_head: bool  #: whether the exact fast LM head is in use (asked for, and the model supports it)


class CacheParts(NamedTuple):
    kv_cache_groups: tuple | None  #: the KV cache groups in use (a HybridBlockManager), or None: one table
    block_manager: Any
    kv_cache: Any
    cpu_kv_cache: Any  #: None without CPU blocks


def load_model_parts(model: Any, cache: CacheConfig, run: ModelRunConfig) -> ModelParts:
    """The model (loaded from a name or a path, or an already loaded one shared), its tokenizer, its LM head
    prepared and its context."""
    device = torch.device(run.device)
    if model is not None and not isinstance(model, (str, os.PathLike)):  # share already loaded weights
        if not run.quant_kernels and getattr(model, "quant_kernels", False):
            raise InvalidArgumentError(
                "quant_kernels=False, but this model was loaded with the quantized kernels: load it with "
                "from_gguf(..., quant_kernels=False), or pass its name or path")
        device = model.device
    else:
        model = load_model(model, device=device, dtype=run.dtype or torch.float32, quant_kernels=run.quant_kernels)
    if cache.sliding_window is not None and getattr(model, "layer_windows", None) is not None:
        raise InvalidArgumentError(
            "this model has per-layer sliding windows (its full-attention layers need every block): "
            "sliding_window must be None"
        )
    head = getattr(model, "head", None)
    fast = bool(run.fast_lm_head and head is not None and head.supports_approx and hasattr(model, "hidden"))
    if fast:
        head.prepare()  # the low-precision copies, once per model (shared by engines sharing the model)
    max_model_len = int(model.config.context_length)
    if run.max_model_len is not None:
        if not 1 <= run.max_model_len <= max_model_len:
            raise InvalidArgumentError(f"max_model_len must be an int in [1, {max_model_len}] (the "
                                       f"model's context), got {run.max_model_len!r}")
        max_model_len = run.max_model_len
    return ModelParts(model, device, make_tokenizer(model.tokenizer_metadata), max_model_len,
                      bool(getattr(model, "quant_kernels", False)), fast)


def build_cache(model: Any, max_model_len: int, cache: CacheConfig, sched: SchedulerConfig,
                tiers: TierConfig) -> CacheParts:
    """The block manager (one table, or one per KV cache group of the model) and the GPU and CPU KV caches."""
    groups = getattr(model, "kv_cache_groups", None) if cache.kv_cache_groups else None
    groups = tuple(groups) if groups else None
    kv_kw = {"grouped": True} if groups is not None else {}
    bs = cache.block_size
    num_gpu_blocks, num_cpu_blocks = cache.num_gpu_blocks, cache.num_cpu_blocks
    if num_gpu_blocks is None:
        per_block = model.kv_cache_bytes_per_block(bs, **kv_kw)
        cap = (len(groups) if groups is not None else 1) * sched.max_num_seqs * -(-max_model_len // bs)
        num_gpu_blocks = max(1, min(cap, int(cache.kv_cache_gib * 2**30) // per_block))
    if cache.swap_space is not None:
        num_cpu_blocks = int(cache.swap_space * 2**30) // model.kv_cache_bytes_per_block(bs, **kv_kw)
    common = dict(num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=cache.enable_prefix_caching,
                  enable_kv_events=cache.enable_kv_events, cpu_prefix_cache=cache.cpu_prefix_cache,
                  eviction_policy=cache.eviction_policy, pin_budget_blocks=cache.pin_budget_blocks)
    store_policy, store_min_hits = parse_store_policy(tiers.kv_store)
    if tiers.enabled and cache.enable_prefix_caching and store_policy != "none" \
            and (groups is not None or cache.sliding_window is None):
        common.update(store_policy=store_policy, store_min_hits=store_min_hits)
    if groups is not None:
        bm = BlockManager(num_gpu_blocks, bs, kv_cache_groups=groups, **common, grouped_results=True)
    else:
        bm = BlockManager(num_gpu_blocks, bs, sliding_window=cache.sliding_window, **common)
    kv_cache = model.allocate_kv_cache(num_gpu_blocks, bs, **kv_kw)
    cpu_kv_cache = model.allocate_kv_cache(num_cpu_blocks, bs, device="cpu", **kv_kw) if num_cpu_blocks else None
    return CacheParts(groups, bm, kv_cache, cpu_kv_cache)
