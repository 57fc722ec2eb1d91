"""What the engine hands back: a request's :class:`RequestOutput` (its samples, :class:`CompletionOutput`), one
step's :class:`StepOutput` (:meth:`pagedkv.engine.core.EngineCore.step`) and :class:`EngineTimes`. Plain
dataclasses, torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..retention.steering import Pin

__all__ = ["CompletionOutput", "RequestOutput", "StepOutput", "EngineTimes"]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sample."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length" (max_tokens) or "abort"


@dataclass(frozen=True)
class RequestOutput:
    """Result of one prompt: its samples, and how many prompt tokens came from the prefix cache. With
    ``kv_retention``: ``pin``, the request's pin (``pin_id`` 0 when nothing was pinned), and ``pin_error``, why
    not when the pin budget was taken between admission and the pin (see :mod:`pagedkv.engine.request_pins`)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    pin: Pin | None = None
    pin_error: str | None = None


@dataclass(frozen=True)
class StepOutput:
    """One engine step (:meth:`~pagedkv.engine.core.EngineCore.step`).

    ``plan``: the scheduler's plan that ran (its ``prefills`` and ``decode`` name the sequences it computed for;
    their new tokens are read from ``scheduler.sequence(seq_id)``). ``finished``: the scheduler outputs of the
    requests that finished in it (EOS, a stop token or string, ``max_tokens``), each request dropped from the core;
    ``Request.finish(output)`` makes its :class:`RequestOutput`. ``faults``: request id -> the exception that
    failed it in this step; each was aborted (its blocks freed) and is in no other field. ``forward_error``: the
    exception of a forward pass (or its KV copies) that raised, which fails every request of the step (the prefix
    cache was then reset: blocks cached in the step may hold KV nobody wrote); None otherwise. ``sampling_failed``:
    the ids among ``faults`` whose sampling raised."""

    plan: Any
    finished: tuple
    faults: dict
    forward_error: BaseException | None = None
    sampling_failed: frozenset = frozenset()


@dataclass
class EngineTimes:
    """Wall time of the last ``generate`` call, split by component (seconds)."""

    total: float = 0.0
    scheduler: float = 0.0  # schedule() + update(), block-manager calls included
    block_manager: float = 0.0  # inside BlockManager methods only
    model: float = 0.0  # KV copies + metadata + forward (sampling excluded)
    sampling: float = 0.0  # drawing the next tokens from the logits
