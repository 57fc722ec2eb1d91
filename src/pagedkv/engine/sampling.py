"""Sampling parameters (in the style of vLLM's ``SamplingParams``) and the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgumentError

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate from one prompt.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k, ``top_p == 1`` disables nucleus
    sampling. ``seed`` makes a request's samples reproducible whatever else runs in the batch. Generation stops
    at ``max_tokens`` new tokens, at end-of-sequence (unless ``ignore_eos``), at a token of ``stop_token_ids``, or
    when the text contains one of ``stop`` (the stop string is not included in the text).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidArgumentError(f"SamplingParams: {msg}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            bad(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            bad(f"seed must be an int or None, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, num: int, generator: torch.Generator | None) -> list[int]:
    """Draw ``num`` tokens from one row of float32 logits ``(vocab,)`` (independently, with replacement)."""
    if params.temperature == 0:
        return [int(torch.argmax(logits))] * num
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True  # always keep the most likely token (a denormal top_p rounds to 0 in float32)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return torch.multinomial(probs, num, replacement=True, generator=generator).tolist()
