"""Reference inference engine for pagedkv (needs the ``engine`` extra: torch, gguf, tokenizers, jinja2).

Submodules:

* :mod:`pagedkv.engine.gguf_loader`: read a Llama GGUF file (config, float weights, tokenizer metadata).
* :mod:`pagedkv.engine.tokenizer`: byte-level BPE tokenizer and chat template from GGUF metadata.
* :mod:`pagedkv.engine.model`: Llama forward over a paged KV cache (slot mapping + block tables), and the
  products it computes with (dense, or reading the file's quantized weights: ``QuantLinear``).
* :mod:`pagedkv.engine.paged_attention`: one step's attention metadata, its plan, and the attention over the
  paged cache (the ragged C kernel, or gathered groups).
* :mod:`pagedkv.engine.cpu`: the CPU runtime (torch-free): the C kernels' build and the OpenMP thread policy.
* :mod:`pagedkv.engine.quant_blocks`: the file's quantized weights split into the kernels' layout (at load).
* :mod:`pagedkv.engine.gemma3`: Gemma 3 forward over the same paged KV cache (per-layer sliding windows).
* :mod:`pagedkv.engine.spm_tokenizer`: SentencePiece tokenizer from GGUF metadata (Gemma's).
* :mod:`pagedkv.engine.registry`: model names (``"gemma-3-270m"``), architecture -> model class, tokenizer choice.
* :mod:`pagedkv.engine.reference`: a simple contiguous-cache reference forward and greedy generation.
* :mod:`pagedkv.engine.config`: the engine's options, declared once (``CacheConfig``, ``SchedulerConfig``,
  ``ModelRunConfig``, ``TierConfig``).
* :mod:`pagedkv.engine.core`: ``EngineCore``, the one engine API (``make_request`` / ``add_request`` / ``abort`` /
  ``step``) that ``LLM`` and the server drive; :mod:`pagedkv.engine.outputs`: what it hands back.
* :mod:`pagedkv.engine.sampling` (the LM head and the sampler) and :mod:`pagedkv.engine.llm`: ``SamplingParams``,
  ``LLM`` (generate / chat / stream over the engine core).
* :mod:`pagedkv.engine.request_pins`: a request's ``kv_retention`` (pin its prompt's prefix once computed).
* :mod:`pagedkv.engine.options`: the command-line options of every command that builds an engine (torch-free at
  import time).

Names are exported lazily so that ``import pagedkv.engine`` does not import torch by itself. Importing it sets
``GOMP_SPINCOUNT`` to libgomp's own default (OpenMP threads spin at a barrier no longer than that) when torch is
not loaded yet and the user set neither it nor ``OMP_WAIT_POLICY`` (:func:`pagedkv.engine.cpu.prepare_runtime`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .cpu import prepare_runtime as _prepare_runtime

_prepare_runtime()  # before anything loads torch's OpenMP runtime, which reads its settings once

_EXPORTS = {
    "ModelConfig": "gguf_loader",
    "ModelNotFoundError": "gguf_loader",
    "TokenizerMetadata": "gguf_loader",
    "find_default_model": "gguf_loader",
    "load_gguf": "gguf_loader",
    "GGUFTokenizer": "tokenizer",
    "AttentionMetadata": "model",
    "PagedLlama": "model",
    "build_attention_metadata": "model",
    "copy_blocks": "model",
    "kv_cache_shape": "model",
    "swap_blocks": "model",
    "ReferenceLlama": "reference",
    "PagedGemma3": "gemma3",
    "SentencePieceTokenizer": "spm_tokenizer",
    "load_model": "registry",
    "resolve_model_path": "registry",
    "LLM": "llm",
    "CompletionOutput": "outputs",
    "RequestOutput": "outputs",
    "EngineCore": "core",
    "CacheConfig": "config",
    "SchedulerConfig": "config",
    "ModelRunConfig": "config",
    "TierConfig": "config",
    "engine_configs": "config",
    "SamplingParams": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
