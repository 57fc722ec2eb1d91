"""Validation of OpenAI-compatible request bodies at the edge, shared by ``pagedkv serve`` and ``pagedkv router``.

A plain module (standard library only; no torch, no pydantic, no web framework at import time). Its API:

* :class:`Limits`: the bounds a server enforces (body size, context, vocabulary, stop strings, cache_salt ...).
* :func:`check_content_type`, :func:`read_body`, :func:`load_json`: the HTTP side (415, 413, 400) before any field
  is read; then the field checks behind the parsers (each reads one field, returns it typed and in range, or
  raises a 400 built by :mod:`pagedkv.server.api_error` whose ``param`` names the field as OpenAI does).
* :func:`parse_completion`, :func:`parse_chat`: a raw body -> a validated :class:`CompletionRequest` /
  :class:`ChatRequest`, or :class:`APIError` (400, OpenAI's error shape, ``param`` naming the field at fault).
* ``session_id`` and ``kv_retention`` (pagedkv's retention fields, docs/guide/serving.md#retention-per-request) are
  checked here for type and range; the engine checks ``kv_retention`` against the prompt and the pin budget.
* :func:`prompt_token_ids`: the request's prompt as token ids (tokenizing, or rendering the chat template), bounded
  by the context length *before* the work; blocking, so call it with ``asyncio.to_thread``.

Contract: a body is accepted only if every field has the type the OpenAI API gives it and a value in range;
numbers are finite (JSON's ``NaN``/``Infinity`` and overflowing literals such as ``1e400`` are refused), integers
are bounded (``seed`` fits 64 bits, ``n`` <= :attr:`Limits.max_n`, token ids < the vocabulary). A temperature
below :data:`GREEDY_TEMPERATURE` (including denormals such as ``1e-45``) means greedy sampling, as in vLLM: such a
temperature would overflow the logits; so does a ``top_p`` below it (it keeps only the most likely token).
Unknown fields are refused as OpenAI refuses them ("Unrecognized request
argument supplied"), in the body and in each message. OpenAI fields this server does not implement are refused
when set to anything that would change the output (``logprobs``, ``echo``, penalties, tools, ...) and accepted
and ignored when they only label the request (``user``, ``metadata``, ``store``, ``service_tier``, ...).
Messages name the request's fields in OpenAI's style (``messages.[0].content``), never this library's classes.
Parsing costs O(body size) and never more: lengths are checked before elements, strings before tokenizing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .api_error import APIError, _bad, _show, _type_error, _unsupported, error_body  # noqa: F401 (re-exported)

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "GREEDY_TEMPERATURE", "Limits", "MAX_PIN_TTL",
           "check_content_type", "error_body", "limits_for", "load_json", "parse_chat", "parse_completion",
           "prompt_token_ids", "read_body"]


# --------------------------------------------------------------------------------- the HTTP side of a body
def check_content_type(value: str | None) -> None:
    """415 unless the body is declared JSON (``application/json``, ``application/*+json``) or not declared."""
    if not value:
        return
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    raise APIError(415, f"Unsupported Content-Type {mime[:80]!r}: send the request body as application/json",
                   "invalid_request_error", "unsupported_media_type")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes", "invalid_request_error",
                    "request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, reading at most ``limit`` bytes: 413 as soon as the declared
    ``Content-Length`` or the bytes received exceed it (the rest is never read)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _bad("Invalid Content-Length header", code="invalid_request")
        if int(declared) > limit:
            raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _nonfinite(token: str) -> float:
    return float("nan") if token == "NaN" else float(token.replace("Infinity", "inf"))


def load_json(body: bytes | str) -> dict:
    """The body as a JSON object; 400 for invalid UTF-8, invalid JSON, nesting deeper than the parser's recursion
    limit, or a top level that is not an object. ``NaN``/``Infinity`` parse (as non-finite floats) so that the
    field checks can name the field."""
    try:
        data = json.loads(body, parse_constant=_nonfinite)
    except UnicodeDecodeError:
        raise _bad("The request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise _bad("The request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:
        why = "a number has too many digits" if "integer string conversion" in str(e) else str(e)[:200]
        raise _bad(f"We could not parse the JSON body of your request: {why}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object", code="invalid_json")
    return data


# -------------------------------------------------------------- field checks (O(the value's size) each)
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, name: str, default: Any, lo: int, hi: int, *, nullable: bool = True,
         path: str | None = None) -> Any:
    v = d.get(name, default)
    if v is None and nullable:
        return default
    p = path or name
    if not _is_int(v):
        raise _type_error(p, "an integer", v)
    if v < lo:
        raise _bad(f"Invalid '{p}': integer below minimum value. Expected a value >= {lo}, but got {_show(v)} "
                   "instead.", p)
    if v > hi:
        raise _bad(f"Invalid '{p}': integer above maximum value. Expected a value <= {hi}, but got {_show(v)} "
                   "instead.", p)
    return v


def _num(d: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False,
         path: str | None = None) -> float:
    v = d.get(name, default)
    if v is None:
        return default
    name = path or name  # (the field as messages name it)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise _type_error(name, "a decimal", v)
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(f"Invalid '{name}': expected a finite number, but got {_show(v)} instead.", name)
    if v < lo or (lo_open and v == lo):
        rel = ">" if lo_open else ">="
        raise _bad(f"Invalid '{name}': decimal below minimum value. Expected a value {rel} {lo}, but got "
                   f"{_show(v)} instead.", name)
    if v > hi:
        raise _bad(f"Invalid '{name}': decimal above maximum value. Expected a value <= {hi}, but got {_show(v)} "
                   "instead.", name)
    return float(v)


def _bool(d: dict, name: str, default: bool = False) -> bool:
    v = d.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _text(v: Any, path: str, max_chars: int | None = None) -> str:
    """``v`` as a string of valid Unicode (no lone surrogates: they cannot be encoded as UTF-8)."""
    if not isinstance(v, str):
        raise _type_error(path, "a string", v)
    if max_chars is not None and len(v) > max_chars:
        raise _bad(f"Invalid '{path}': string too long. Expected a string with maximum length {max_chars}, but got "
                   f"a string with length {len(v)} instead.", path, "string_above_max_length")
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(f"Invalid '{path}': the string is not valid Unicode (it contains a lone surrogate).",
                       path) from None
    return v


def _opt_text(d: dict, name: str, max_chars: int | None = 4096) -> str | None:
    v = d.get(name)
    return None if v is None else _text(v, name, max_chars)


def _check_keys(d: dict, known: frozenset, prefix: str = "") -> None:
    for k in d:
        if k not in known:
            name = f"{prefix}{k}"[:200]
            raise _bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


#: the longest TTL a pin may ask for (seconds: 30 days); longer: pin without a TTL and unpin it
MAX_PIN_TTL = 30 * 24 * 3600.0
#: A temperature below this samples greedily (vLLM's epsilon): dividing logits by less overflows float32.
GREEDY_TEMPERATURE = 1e-5

_INT64_MIN, _UINT64_MAX, _INT32_MAX = -(2**63), 2**64 - 1, 2**31 - 1


@dataclass(frozen=True)
class Limits:
    """Bounds of a request. ``None`` for the model-dependent ones means "not checked here" (a router without the
    model's sizes); the server fills them from its engine.

    max_body_bytes: largest request body (413 beyond). max_model_len: the context (prompt tokens, max_tokens).
    vocab_size: token ids lie in ``[0, vocab_size)``. max_prompt_chars: longest prompt text (a string prompt, or
    the messages' text together) tokenized at all; longer text cannot fit ``max_model_len`` tokens and is refused
    before tokenizing (the server sets it to ``max_model_len`` x the longest token's length). max_n: most samples.
    max_stop / max_stop_chars: stop strings (OpenAI allows 4). max_stop_token_ids, max_cache_salt_chars,
    max_messages: as named.
    """

    max_body_bytes: int = 2 * 2**20
    max_model_len: int | None = None
    vocab_size: int | None = None
    max_prompt_chars: int | None = None
    max_n: int = 128
    max_stop: int = 4
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_cache_salt_chars: int = 256
    max_messages: int = 4096


DEFAULT_LIMITS = Limits()


def _token_ids(v: Any, path: str, limits: Limits, max_len: int | None, what: str) -> list[int]:
    """A list of token ids: its length first (``max_len``), then each id's type and range."""
    if not isinstance(v, list):
        raise _type_error(path, "an array of integers", v)
    if max_len is not None and len(v) > max_len:
        code = "context_length_exceeded" if what == "prompt" else None
        raise _bad(f"Invalid '{path}': {len(v)} token ids; at most {max_len} are allowed.", path, code)
    hi = (limits.vocab_size - 1) if limits.vocab_size is not None else _INT32_MAX
    if v and all(type(t) is int for t in v) and min(v) >= 0 and max(v) <= hi:  # (the common case, at C speed)
        return v
    for i, t in enumerate(v):
        if not _is_int(t):
            raise _type_error(f"{path}.[{i}]", "an integer", t)
        if t < 0 or t > hi:
            raise _bad(f"Invalid '{path}.[{i}]': token id {_show(t)} is out of range [0, {hi}].", path)
    return v


# ---------------------------------------------------------------------------------------------- requests
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "user", "best_of",
    # vLLM's extensions implemented here (or accepted at their neutral value)
    "top_k", "ignore_eos", "cache_salt", "stop_token_ids", "repetition_penalty", "min_tokens", "priority",
    "kv_transfer_params",  # a prefill/decode split (pagedkv.server.kv_transfer)
    # pagedkv's retention fields (docs/guide/serving.md#retention-per-request)
    "session_id", "kv_retention",
})
_COMPLETION_KEYS = _COMMON | {"prompt", "echo", "suffix"}
_CHAT_KEYS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "functions",
    "function_call", "response_format", "metadata", "store", "service_tier", "modalities", "audio", "prediction",
    "reasoning_effort", "verbosity", "web_search_options", "prompt_cache_key", "safety_identifier",
}
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_ROLES = ("system", "user", "assistant", "developer")


@dataclass(frozen=True)
class _Common:
    """Fields shared by completions and chat completions, validated (see the module docstring)."""

    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    cache_salt: str | None
    stream: bool
    include_usage: bool
    priority: int  # vLLM's request priority (lower is more urgent; --scheduling-policy priority)
    kv_transfer: Any = None  # a pagedkv.server.kv_transfer.KVTransferParams, or None (no transfer)
    session_id: str | None = None  # the conversation: the eviction policy's hint ("session", "density")
    kv_retention: dict | None = None  # {"pin_tokens": int >= 1 | "prompt", "ttl": float | None}: pin the prefix

    def sampling_kwargs(self, default_max_tokens: int) -> dict:
        """Keyword arguments of ``pagedkv.engine.SamplingParams`` (a tiny temperature or top_p: greedy)."""
        greedy = self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TEMPERATURE
        return dict(
            n=self.n, temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
        )


def _common(d: dict, limits: Limits, *, chat: bool) -> dict:
    max_len = limits.max_model_len if limits.max_model_len is not None else _INT32_MAX
    out: dict[str, Any] = {}
    out["model"] = _opt_text(d, "model", 256)
    out["max_tokens"] = _int(d, "max_tokens", None, 1, max_len)
    if chat and d.get("max_completion_tokens") is not None:  # it wins over max_tokens, as in vLLM and OpenAI
        out["max_tokens"] = _int(d, "max_completion_tokens", None, 1, max_len)
    out["temperature"] = _num(d, "temperature", 1.0, 0.0, 2.0)
    out["top_p"] = _num(d, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    out["top_k"] = _int(d, "top_k", -1, -1, _INT32_MAX)
    out["seed"] = _int(d, "seed", None, _INT64_MIN, _UINT64_MAX)
    out["n"] = n = _int(d, "n", 1, 1, limits.max_n)
    out["ignore_eos"] = _bool(d, "ignore_eos")
    out["stream"] = stream = _bool(d, "stream")
    so = d.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        _check_keys(so, frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"}),
                    "stream_options.")
        include_usage = _bool(so, "include_usage")
        if _bool(so, "continuous_usage_stats"):
            raise _unsupported("stream_options.continuous_usage_stats")
        _bool(so, "include_obfuscation")
    out["include_usage"] = include_usage
    stop = d.get("stop")
    if stop is None:
        stops: tuple = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop", limits.max_stop_chars),)
    elif isinstance(stop, list):
        if len(stop) > limits.max_stop:
            raise _bad(f"Invalid 'stop': array too long. Expected an array with maximum length {limits.max_stop}, "
                       f"but got an array with length {len(stop)} instead.", "stop", "array_above_max_length")
        stops = tuple(_text(s, f"stop.[{i}]", limits.max_stop_chars) for i, s in enumerate(stop))
    else:
        raise _type_error("stop", "a string or an array of strings", stop)
    if any(not s for s in stops):
        raise _bad("Invalid 'stop': stop strings must not be empty.", "stop")
    out["stop"] = stops
    sti = d.get("stop_token_ids")
    out["stop_token_ids"] = () if sti is None else \
        tuple(_token_ids(sti, "stop_token_ids", limits, limits.max_stop_token_ids, "stop_token_ids"))
    salt = d.get("cache_salt")
    if salt is not None:
        _text(salt, "cache_salt", limits.max_cache_salt_chars)
        if not salt:
            raise _bad("Invalid 'cache_salt': expected a non-empty string.", "cache_salt")
    out["cache_salt"] = salt
    out["priority"] = _int(d, "priority", 0, -(2**31), 2**31 - 1, nullable=False)
    if d.get("kv_transfer_params") is not None:
        from .kv_transfer import parse_kv_transfer_params

        out["kv_transfer"] = parse_kv_transfer_params(d["kv_transfer_params"])
    sid = d.get("session_id")
    if sid is not None:
        _text(sid, "session_id", limits.max_cache_salt_chars)
        if not sid:
            raise _bad("Invalid 'session_id': expected a non-empty string.", "session_id")
    out["session_id"] = sid
    out["kv_retention"] = _kv_retention(d.get("kv_retention"), max_len)
    # known, not implemented: refused unless neutral
    if _num(d, "presence_penalty", 0.0, -2.0, 2.0):
        raise _unsupported("presence_penalty", "only 0 is")
    if _num(d, "frequency_penalty", 0.0, -2.0, 2.0):
        raise _unsupported("frequency_penalty", "only 0 is")
    if _num(d, "repetition_penalty", 1.0, 0.0, 2.0**31, lo_open=True) != 1.0:
        raise _unsupported("repetition_penalty", "only 1 is")
    if _int(d, "min_tokens", 0, 0, max_len):
        raise _unsupported("min_tokens", "only 0 is")
    best_of = _int(d, "best_of", None, 1, limits.max_n)
    if best_of is not None and best_of != n:
        raise _unsupported("best_of", "only best_of equal to n is")
    lb = d.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise _type_error("logit_bias", "an object", lb)
        if lb:
            raise _unsupported("logit_bias")
    _opt_text(d, "user")
    return out


def _kv_retention(v: Any, max_len: int) -> dict | None:
    """``kv_retention``: null, or ``{"pin_tokens": int in [1, context] | "prompt", "ttl": seconds in
    (0, MAX_PIN_TTL] | null}`` (the engine checks it against the prompt and the pin budget)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _type_error("kv_retention", "an object", v)
    _check_keys(v, frozenset({"pin_tokens", "ttl"}), "kv_retention.")
    n = v.get("pin_tokens")
    if n is None:
        raise _bad("Missing required parameter: 'kv_retention.pin_tokens' (an integer, or \"prompt\").",
                   "kv_retention.pin_tokens", "missing_required_parameter")
    if n != "prompt":
        if not _is_int(n):
            raise _type_error("kv_retention.pin_tokens", "an integer or \"prompt\"", n)
        n = _int(v, "pin_tokens", None, 1, max_len, path="kv_retention.pin_tokens")
    ttl = _num(v, "ttl", None, 0.0, MAX_PIN_TTL, lo_open=True, path="kv_retention.ttl")
    return {"pin_tokens": n, "ttl": ttl}


@dataclass(frozen=True)
class CompletionRequest(_Common):
    """A validated POST /v1/completions body. ``prompt``: a string or a list of token ids."""

    prompt: str | list[int] = ""

    def prompt_input(self) -> str | dict:
        """The prompt as ``LLM`` takes it: a string or ``{"prompt_token_ids": [...]}``."""
        return self.prompt if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}


@dataclass(frozen=True)
class ChatRequest(_Common):
    """A validated POST /v1/chat/completions body: ``messages`` as ``(role, text)`` pairs."""

    messages: tuple[tuple[str, str], ...] = field(default=())

    def conversation(self) -> list[dict]:
        """Messages as the chat template takes them (``developer`` is rendered as ``system``)."""
        return [{"role": "system" if r == "developer" else r, "content": t} for r, t in self.messages]

    @property
    def num_chars(self) -> int:
        return sum(len(t) for _, t in self.messages)


def _prompt(d: dict, limits: Limits) -> str | list[int]:
    if "prompt" not in d or d["prompt"] is None:
        raise _bad("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    p = d["prompt"]
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of prompts: only one is served
        if len(p) != 1:
            raise _unsupported("prompt", "batched prompts are not; send one prompt per request")
        p = p[0]
    if isinstance(p, str):
        _text(p, "prompt", limits.max_prompt_chars)
        if not p:
            raise _bad("Invalid 'prompt': the prompt must not be empty.", "prompt")
        return p
    if not isinstance(p, list):
        raise _type_error("prompt", "a string or an array of token ids", p)
    if not p:
        raise _bad("Invalid 'prompt': the prompt must not be empty.", "prompt")
    return list(_token_ids(p, "prompt", limits, limits.max_model_len, "prompt"))


def parse_completion(body: bytes | dict, limits: Limits = DEFAULT_LIMITS) -> CompletionRequest:
    """Validate a /v1/completions body (bytes, or an already parsed object); raises :class:`APIError`."""
    d = load_json(body) if not isinstance(body, dict) else body
    _check_keys(d, _COMPLETION_KEYS)
    prompt = _prompt(d, limits)
    common = _common(d, limits, chat=False)
    if _int(d, "logprobs", None, 0, 5):
        raise _unsupported("logprobs")
    if _bool(d, "echo"):
        raise _unsupported("echo")
    if _opt_text(d, "suffix"):
        raise _unsupported("suffix")
    return CompletionRequest(prompt=prompt, **common)


def _message_text(m: dict, i: int, limits: Limits) -> str:
    path = f"messages.[{i}].content"
    c = m.get("content")
    if c is None:
        raise _bad(f"Invalid value for '{path}': expected a string or an array of text parts, got null.", path)
    if isinstance(c, str):
        return _text(c, path)
    if not isinstance(c, list):
        raise _type_error(path, "a string or an array of text parts", c)
    parts = []
    for j, part in enumerate(c):
        pp = f"{path}.[{j}]"
        if not isinstance(part, dict):
            raise _type_error(pp, "an object", part)
        if part.get("type") != "text":
            raise _unsupported(pp, "only content parts of type 'text' are")
        _check_keys(part, frozenset({"type", "text"}), pp + ".")
        parts.append(_text(part.get("text"), pp + ".text"))
    return "".join(parts)


def parse_chat(body: bytes | dict, limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a /v1/chat/completions body (bytes, or an already parsed object); raises :class:`APIError`."""
    d = load_json(body) if not isinstance(body, dict) else body
    _check_keys(d, _CHAT_KEYS)
    msgs = d.get("messages")
    if msgs is None:
        raise _bad("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages")
    max_messages = min(limits.max_messages, limits.max_model_len or limits.max_messages)
    if len(msgs) > max_messages:
        raise _bad(f"Invalid 'messages': array too long. Expected an array with maximum length {max_messages}, but "
                   f"got an array with length {len(msgs)} instead.", "messages", "array_above_max_length")
    out, chars = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages.[{i}]", "an object", m)
        role = m.get("role")
        if role in ("tool", "function"):  # (before the keys: a tool message's tool_call_id would hide this)
            raise _unsupported(f"messages.[{i}].role", f"messages of role '{role}' are not (no tools)")
        _check_keys(m, _MESSAGE_KEYS, f"messages.[{i}].")
        if role not in _ROLES:
            raise _bad(f"Invalid value for 'messages.[{i}].role': expected one of {', '.join(_ROLES)}, but got "
                       f"{_show(role)[:60]} instead.", f"messages.[{i}].role")
        _opt_text(m, "name", 256)
        text = _message_text(m, i, limits)
        chars += len(text)
        if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
            raise _bad(f"The messages hold more than {limits.max_prompt_chars} characters, more than the model's "
                       f"context of {limits.max_model_len} tokens can take.", "messages", "context_length_exceeded")
        out.append((role, text))
    common = _common(d, limits, chat=True)
    lp = d.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _type_error("logprobs", "a boolean", lp)
    if lp:
        raise _unsupported("logprobs")
    if _int(d, "top_logprobs", None, 0, 20):
        raise _unsupported("top_logprobs")
    tools = d.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "an array", tools)
        if tools:
            raise _unsupported("tools")
    tc = d.get("tool_choice")
    if tc not in (None, "none", "auto"):
        raise _unsupported("tool_choice")
    _bool(d, "parallel_tool_calls")
    for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "reasoning_effort",
                 "verbosity"):
        if d.get(name) is not None:
            raise _unsupported(name)
    rf = d.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _type_error("response_format", "an object", rf)
        if rf.get("type") != "text":
            raise _unsupported("response_format", "only {'type': 'text'} is")
    mod = d.get("modalities")
    if mod is not None and mod != ["text"]:
        raise _unsupported("modalities", "only ['text'] is")
    md = d.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise _type_error("metadata", "an object", md)
    _bool(d, "store")
    for name in ("service_tier", "prompt_cache_key", "safety_identifier"):
        _opt_text(d, name)
    return ChatRequest(messages=tuple(out), **common)


# ---------------------------------------------------------------------------------------------- tokens
def _context_error(n: int, limits: Limits, param: str) -> APIError:
    return _bad(f"This model's maximum context length is {limits.max_model_len} tokens; the "
                f"{'messages hold' if param == 'messages' else 'prompt holds'} {n} tokens.", param,
                "context_length_exceeded")


def prompt_token_ids(req: CompletionRequest | ChatRequest, tokenizer: Any,
                     limits: Limits = DEFAULT_LIMITS) -> list[int]:
    """The prompt's token ids as the engine takes them: a completion's string encoded with the special tokens, its
    token ids as given, a chat's messages rendered by the model's chat template and encoded. ``tokenizer`` is a
    ``pagedkv.engine.tokenizer.GGUFTokenizer`` (``encode``, ``render_chat``). 400 (``context_length_exceeded``)
    when the prompt has more than ``limits.max_model_len`` tokens; the text was bounded by
    ``limits.max_prompt_chars`` at parsing, so the work is bounded too. Blocking: O(prompt text)."""
    if isinstance(req, ChatRequest):
        try:
            text = tokenizer.render_chat(req.conversation())
        except Exception as e:  # the template refused the conversation (e.g. roles out of order)
            raise _bad(f"The chat template rejected the messages: {str(e)[:300]}", "messages") from None
        if limits.max_prompt_chars is not None and len(text) > limits.max_prompt_chars:
            raise _bad(f"The rendered messages hold more than {limits.max_prompt_chars} characters, more than the "
                       f"model's context of {limits.max_model_len} tokens can take.", "messages",
                       "context_length_exceeded")
        ids, param = tokenizer.encode(text), "messages"
    else:
        p, param = req.prompt, "prompt"
        ids = tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
    if not ids:
        raise _bad(f"Invalid '{param}': the prompt is empty.", param)
    if limits.max_model_len is not None and len(ids) > limits.max_model_len:
        raise _context_error(len(ids), limits, param)
    return ids


def limits_for(tokenizer: Any, max_model_len: int, *, max_n: int = 128,
               max_body_bytes: int = DEFAULT_LIMITS.max_body_bytes, **over: Any) -> Limits:
    """:class:`Limits` for a model: its context, vocabulary and the longest prompt text worth tokenizing
    (``max_model_len`` tokens of the vocabulary's longest token; every token covers at most that many
    characters). O(vocabulary) once."""
    tokens = getattr(getattr(tokenizer, "meta", None), "tokens", None) or []
    longest = max((len(t) for t in tokens), default=64)
    return Limits(max_body_bytes=max_body_bytes, max_model_len=max_model_len, vocab_size=tokenizer.vocab_size,
                  max_prompt_chars=max_model_len * max(1, longest), max_n=max_n, **over)

