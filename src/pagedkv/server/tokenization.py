"""vLLM's tokenizer routes, ``POST /tokenize`` and ``POST /detokenize``: their bodies validated and answered with
the model's own tokenizer, exactly as the completion and chat routes tokenize.

A plain module (standard library only at import; the tokenizer is passed in). Fields (vLLM 0.33's
``TokenizeCompletionRequest``, ``TokenizeChatRequest`` and ``DetokenizeRequest``):

* a completion: ``prompt`` (a string), ``add_special_tokens`` (default true: BOS where the model adds it),
  ``return_token_strs`` (default false), ``model``;
* a chat: ``messages`` (as ``/v1/chat/completions`` takes them), ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false; only with ``add_generation_prompt`` false, as in vLLM: the rendering
  stops right after the final message's text, for the model to go on with it), ``add_special_tokens`` (default
  false: the template has them), ``return_token_strs``, ``model``; ``chat_template``, ``chat_template_kwargs``, ``tools``,
  ``media_io_kwargs`` and ``mm_processor_kwargs`` only empty or null (400 ``unsupported_parameter`` otherwise:
  the model's own template renders text messages, as on the chat route);
* ``/detokenize``: ``tokens`` (ids in the vocabulary) and ``model``; special tokens are kept in the text.

Answers: ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked for; the
tokenizer's own pieces) and ``{"prompt"}``. As in vLLM, a prompt longer than the context is tokenized all the
same (``count`` > ``max_model_len`` tells the client); the body limit bounds the work. Where pagedkv differs:
an unknown field is refused (400 ``unknown_parameter``), as on every route of this server (vLLM ignores it), a
body with both ``prompt`` and ``messages`` is refused, and a token id outside the vocabulary is a 400.
O(body size) to parse, O(prompt) to answer (in a worker thread).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .api_error import _bad, _show, _type_error, _unsupported
from .validation import DEFAULT_LIMITS, Limits, _bool, _check_keys, _is_int, _opt_text, _text, load_json, parse_chat

__all__ = ["TokenizeRequest", "DetokenizeRequest", "parse_tokenize", "parse_detokenize", "tokenize",
           "detokenize"]

_COMPLETION_KEYS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_KEYS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "return_token_strs", "chat_template", "chat_template_kwargs",
                        "tools", "media_io_kwargs", "mm_processor_kwargs"})
_DETOKENIZE_KEYS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: ``prompt`` (a completion) or ``messages`` (a chat, as ``(role, text)``
    pairs in a :class:`~pagedkv.server.validation.ChatRequest`), and the flags with vLLM's defaults."""

    model: str | None
    prompt: str | None
    chat: Any  # a ChatRequest (its messages only), or None for a completion
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    """A validated ``/detokenize`` body."""

    model: str | None
    tokens: tuple[int, ...]


def _empty_or_null(d: dict, name: str, kind: type) -> None:
    v = d.get(name)
    if v is None:
        return
    if not isinstance(v, kind):
        raise _type_error(name, "an array" if kind is list else "an object", v)
    if v:
        raise _unsupported(name, "the model's own chat template renders text messages here")


def parse_tokenize(body: bytes | dict, limits: Limits = DEFAULT_LIMITS) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (bytes or a parsed object); raises :class:`~.validation.APIError` (400)."""
    d = load_json(body) if not isinstance(body, dict) else body
    has_p, has_m = d.get("prompt") is not None, d.get("messages") is not None
    if has_p == has_m:
        raise _bad("Send exactly one of 'prompt' (a completion) and 'messages' (a chat).",
                   "messages" if has_m else "prompt", None if has_p else "missing_required_parameter")
    model = _opt_text(d, "model", 256)
    strs = _bool(d, "return_token_strs")
    if has_p:
        _check_keys(d, _COMPLETION_KEYS)
        return TokenizeRequest(model, _text(d["prompt"], "prompt"), None, _bool(d, "add_special_tokens", True),
                               False, False, strs)
    _check_keys(d, _CHAT_KEYS)
    cont, gen = _bool(d, "continue_final_message"), _bool(d, "add_generation_prompt", True)
    if cont and gen:  # (as in vLLM, whose template call refuses the pair: the default true counts)
        raise _bad("Cannot set both 'continue_final_message' and 'add_generation_prompt' to true (send "
                   "'add_generation_prompt': false with 'continue_final_message').", "continue_final_message")
    if d.get("chat_template") is not None:
        _text(d["chat_template"], "chat_template")
        raise _unsupported("chat_template", "the model's own chat template is used")
    _empty_or_null(d, "chat_template_kwargs", dict)
    _empty_or_null(d, "tools", list)
    _empty_or_null(d, "media_io_kwargs", dict)
    _empty_or_null(d, "mm_processor_kwargs", dict)
    # the messages as the chat route checks them, without its bound on their length (as in vLLM, /tokenize
    # answers a count past the context)
    chat = parse_chat({"messages": d["messages"]}, replace(limits, max_prompt_chars=None))
    return TokenizeRequest(model, None, chat, _bool(d, "add_special_tokens", False), gen, cont, strs)


def parse_detokenize(body: bytes | dict, limits: Limits = DEFAULT_LIMITS) -> DetokenizeRequest:
    """Validate a ``/detokenize`` body: ``tokens`` an array of ids in ``[0, vocab_size)`` (any non-negative id
    when the limits do not know the vocabulary). Raises :class:`~.validation.APIError` (400)."""
    d = load_json(body) if not isinstance(body, dict) else body
    _check_keys(d, _DETOKENIZE_KEYS)
    model = _opt_text(d, "model", 256)
    v = d.get("tokens")
    if v is None:
        raise _bad("Missing required parameter: 'tokens'.", "tokens", "missing_required_parameter")
    if not isinstance(v, list):
        raise _type_error("tokens", "an array of integers", v)
    hi = limits.vocab_size - 1 if limits.vocab_size is not None else 2**63 - 1
    for i, t in enumerate(v):
        if not _is_int(t):
            raise _type_error(f"tokens.[{i}]", "an integer", t)
        if t < 0 or t > hi:
            raise _bad(f"Invalid 'tokens.[{i}]': token id {_show(t)} is out of range [0, {hi}].", "tokens")
    return DetokenizeRequest(model, tuple(v))


def _continue_final(text: str, final: str) -> str:
    """``text`` (a chat rendered without a generation prompt) cut right after the final message's text."""
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise _bad("continue_final_message: the chat template does not render the final message's text as "
                   "sent, so it cannot be continued.", "messages")
    end = at + len(core)
    tail = final[len(final.rstrip()):]  # the message's own trailing whitespace, where the template kept it
    if tail and text.startswith(tail, end):
        end += len(tail)
    return text[:end]


def tokenize(req: TokenizeRequest, tokenizer: Any, max_model_len: int) -> dict:
    """The ``/tokenize`` answer. A chat renders the model's template (400 when it rejects the messages); the
    text is encoded with BOS/EOS only where ``add_special_tokens`` asks. Blocking: O(prompt)."""
    if req.chat is None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        conv = req.chat.conversation()
        try:
            text = tokenizer.render_chat(conv, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # the template refused the conversation (e.g. roles out of order)
            raise _bad(f"The chat template rejected the messages: {str(e)[:300]}", "messages") from None
        if req.continue_final_message:
            text = _continue_final(text, conv[-1]["content"])
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    ids = [int(t) for t in ids]
    strs = [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Any) -> dict:
    """The ``/detokenize`` answer: the ids' text, special tokens kept (as vLLM decodes). Blocking: O(ids)."""
    return {"prompt": tokenizer.decode(list(req.tokens))}
