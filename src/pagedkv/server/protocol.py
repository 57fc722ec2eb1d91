"""Request parsing, validation and response shapes of the OpenAI-compatible API.

Contract: :func:`parse_completion` and :func:`parse_chat` turn a raw request body into a validated request or
raise :class:`APIError` (status 400, OpenAI's error shape). They never touch the engine, so a bad request
changes no state. Fields follow OpenAI's and vLLM's names; unknown fields are ignored, as OpenAI's SDK sends
some this server does not use (``user``, ``frequency_penalty`` at its default, ...). Fields that would change
the output and are not implemented (``logprobs``, ``echo``, ``best_of`` > n, tools, ...) are refused with 400
rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "error_body",
    "parse_chat",
    "parse_completion",
    "usage",
    "new_id",
]


class APIError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    cache_salt: str | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: StrictInt = 0
    best_of: StrictInt | None = None

    @property
    def include_usage(self) -> bool:
        """Streamed responses end with a usage chunk when ``stream_options.include_usage`` is true."""
        return bool((self.stream_options or {}).get("include_usage"))

    def _refuse_unsupported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise bad_request("logprobs are not supported by this server", "logprobs")
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            raise bad_request("presence, frequency and repetition penalties are not supported", "presence_penalty")
        if self.min_tokens:
            raise bad_request("min_tokens is not supported", "min_tokens")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.cache_salt is not None and not self.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        if self.temperature < 0:
            raise bad_request(f"temperature must be >= 0, got {self.temperature}", "temperature")

    def sampling_kwargs(self, default_max_tokens: int) -> dict:
        """Keyword arguments of ``SamplingParams`` (which validates their values)."""
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
        return dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            ignore_eos=self.ignore_eos, stop=tuple(stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
        )


class CompletionRequest(_Common):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a one-element list of either."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    echo: StrictBool = False
    suffix: str | None = None

    def prompt_input(self) -> str | dict:
        """The prompt as ``LLM`` takes it: a string or ``{"prompt_token_ids": [...]}``."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", "prompt")
            return p
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        return {"prompt_token_ids": list(p)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    """POST /v1/chat/completions. ``max_completion_tokens`` is OpenAI's newer name of ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list | None = None

    def conversation(self) -> list[dict]:
        """Messages as the chat template takes them (``developer`` is rendered as ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def _load(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def _validate(cls: type[BaseModel], data: dict) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise bad_request(f"invalid field {where!r}: {err.get('msg')}", where.split(".")[0] or None) from None


def parse_completion(body: bytes) -> CompletionRequest:
    """Validate a /v1/completions body; raises :class:`APIError` (400)."""
    req = _validate(CompletionRequest, _load(body))
    req._refuse_unsupported()
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    req.prompt_input()  # shape check
    return req


def parse_chat(body: bytes) -> ChatRequest:
    """Validate a /v1/chat/completions body; raises :class:`APIError` (400)."""
    req = _validate(ChatRequest, _load(body))
    req._refuse_unsupported()
    if req.tools:
        raise bad_request("tools are not supported", "tools")
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree", "max_completion_tokens")
        req.max_tokens = req.max_completion_tokens
    return req


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
