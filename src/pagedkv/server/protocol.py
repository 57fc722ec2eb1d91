"""Response shapes of the OpenAI-compatible API (ids, usage), and the request parsing of
:mod:`pagedkv.server.validation` under its former names (``parse_completion``, ``parse_chat``, ``APIError``,
``error_body``), which the router imports from here.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from .validation import APIError, ChatRequest, CompletionRequest, error_body, parse_chat, parse_completion

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "ResponseHead",
    "error_body",
    "parse_chat",
    "parse_completion",
    "usage",
    "new_id",
]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object, with the prefix-cache hit under ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ResponseHead:
    """The fields every response and chunk of one request share."""

    id: str
    model: str
    created: int

    @classmethod
    def make(cls, prefix: str, model: str) -> "ResponseHead":
        return cls(new_id(prefix), model, int(time.time()))
