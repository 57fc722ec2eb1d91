"""Adapters that put the block managers people would otherwise use ("anchors") behind the subset of
``pagedkv.BlockManager`` that the benchmark scheduler calls, so one request stream can be replayed
through pagedkv and through each anchor.

Anchors are optional and live in their own virtualenvs (two vLLM versions cannot share one); create
them with ``scripts/install_anchors.sh``:

=============  ==========================================================  ==========================
name           block manager                                               interpreter
=============  ==========================================================  ==========================
``vllm_v2``    vLLM 0.6.3.post1 ``vllm.core.block_manager.SelfAttnBlockSpaceManager``  ``.venv-anchor-v2``
``vllm_v1``    vLLM 0.33.x ``vllm.v1.core.kv_cache_manager.KVCacheManager``            ``.venv-anchor-v1``
``nanovllm``   nano-vllm-fork ``nanovllm.engine.block_manager.BlockManager``            ``.venv-anchor-nano``
=============  ==========================================================  ==========================

>>> from pagedkv.bench.anchors import load_anchor
>>> Anchor = load_anchor("vllm_v2")      # raises AnchorUnavailable (with an install hint) if absent
>>> bm = Anchor(40_000, 16, enable_prefix_caching=True)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ._base import (
    FEATURES,
    AllocStatus,
    AnchorAdapter,
    AnchorOutOfBlocks,
    AnchorStep,
    AnchorUnavailable,
)

__all__ = [
    "ANCHORS",
    "FEATURES",
    "AllocStatus",
    "AnchorAdapter",
    "AnchorInfo",
    "AnchorOutOfBlocks",
    "AnchorStep",
    "AnchorUnavailable",
    "available_anchors",
    "load_anchor",
]


@dataclass(frozen=True)
class AnchorInfo:
    name: str
    module: str
    cls: str
    venv: str  # virtualenv (relative to the repository root) made by scripts/install_anchors.sh
    target: str  # argument of scripts/install_anchors.sh that creates it
    packages: str  # what it installs, for the error message


ANCHORS: dict[str, AnchorInfo] = {
    "vllm_v2": AnchorInfo(
        "vllm_v2",
        "pagedkv.bench.anchors.vllm_v2",
        "VllmV2Anchor",
        ".venv-anchor-v2",
        "v2",
        "vllm==0.6.3.post1 (--no-deps) with CPU torch, msgspec, pydantic, psutil, pyyaml",
    ),
    "vllm_v1": AnchorInfo(
        "vllm_v1",
        "pagedkv.bench.anchors.vllm_v1",
        "VllmV1Anchor",
        ".venv-anchor-v1",
        "v1",
        "vllm==0.33.0 (--no-deps) with CPU torch, msgspec, pydantic, pyzmq, cbor2 and a few small pure-Python packages",
    ),
    "nanovllm": AnchorInfo(
        "nanovllm",
        "pagedkv.bench.anchors.nanovllm",
        "NanoVllmAnchor",
        ".venv-anchor-nano",
        "nano",
        "nano-vllm-fork (--no-deps) with numpy and xxhash; no torch",
    ),
}

_ALIASES = {"v2": "vllm_v2", "vllm-v2": "vllm_v2", "v1": "vllm_v1", "vllm-v1": "vllm_v1", "nano": "nanovllm",
            "nano-vllm": "nanovllm", "nano_vllm": "nanovllm"}


def _info(name: str) -> AnchorInfo:
    key = _ALIASES.get(name, name)
    try:
        return ANCHORS[key]
    except KeyError:
        raise KeyError(f"unknown anchor {name!r}; known: {', '.join(ANCHORS)}") from None


def load_anchor(name: str) -> type[AnchorAdapter]:
    """The adapter class of anchor ``name`` (see ``ANCHORS``); AnchorUnavailable if it cannot load here."""
    info = _info(name)
    try:
        module = importlib.import_module(info.module)
    except ImportError as exc:
        raise AnchorUnavailable(
            f"anchor {info.name!r} cannot be loaded in this interpreter: {exc}. It needs {info.packages}; "
            f"create its virtualenv with `bash scripts/install_anchors.sh {info.target}` and run under "
            f"`{info.venv}/bin/python`."
        ) from exc
    return getattr(module, info.cls)


def available_anchors() -> dict[str, str]:
    """``{name: "ok" or why not}`` for every anchor, as seen from this interpreter."""
    out: dict[str, str] = {}
    for name in ANCHORS:
        try:
            load_anchor(name)
        except AnchorUnavailable as exc:
            out[name] = str(exc)
        else:
            out[name] = "ok"
    return out
