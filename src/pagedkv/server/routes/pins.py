"""The pins of the prefix cache (``--pin-budget-blocks``): ``POST /v1/pins`` (pin a prefix: ``prompt`` or
``messages``, ``ttl`` seconds, ``cache_salt``; its KV is computed first when it is not cached; 409
``pin_budget_exceeded`` past the budget, 400 when pinning is off), ``GET /v1/pins`` and
``DELETE /v1/pins/{pin_id}`` (404 ``pin_not_found``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ...errors import PagedKVError, PinBudgetError, UnknownPinError
from ...retention.steering import Pin
from ..async_engine import EngineDead, EngineOverloaded
from ..validation import (DEFAULT_LIMITS, MAX_PIN_TTL, APIError, Limits, _bad, _check_keys, _num, _opt_text,
                          load_json, parse_chat, parse_completion, prompt_token_ids)
from .openai import until_done
from .retention import pin_json, pins_on
from .state import ServerState, server_state

__all__ = ["router", "PinRequest", "parse_pin"]

router = APIRouter()

_PIN_KEYS = frozenset({"model", "prompt", "messages", "ttl", "cache_salt"})


@dataclass(frozen=True)
class PinRequest:
    """A validated POST /v1/pins body: the prefix as a completion or chat request (its prompt, tokenized as those
    routes tokenize it), the TTL in seconds (None: until unpinned) and the cache_salt (the namespace of the
    prefix-cache blocks: a pin holds the blocks of requests with the same salt)."""

    model: str | None
    request: Any  # CompletionRequest | ChatRequest (only its prompt is used)
    ttl: float | None
    cache_salt: str | None


def parse_pin(body: bytes | dict, limits: Limits = DEFAULT_LIMITS) -> PinRequest:
    """Validate a /v1/pins body: exactly one of ``prompt`` (a string or token ids, as /v1/completions takes it)
    and ``messages`` (as /v1/chat/completions takes them, rendered by the chat template); ``ttl`` a number of
    seconds in (0, :data:`MAX_PIN_TTL`] or null; ``cache_salt`` and ``model`` as in the other routes. Raises
    :class:`APIError` (400)."""
    d = load_json(body) if not isinstance(body, dict) else body
    _check_keys(d, _PIN_KEYS)
    has_p, has_m = d.get("prompt") is not None, d.get("messages") is not None
    if has_p == has_m:
        raise _bad("Send exactly one of 'prompt' and 'messages': the prefix to pin.", "prompt"
                   if not has_p else "messages", None if has_p else "missing_required_parameter")
    sub = {k: d[k] for k in ("prompt", "messages", "cache_salt") if d.get(k) is not None}
    req = parse_completion(sub, limits) if has_p else parse_chat(sub, limits)
    ttl = d.get("ttl")
    if ttl is not None:
        ttl = _num(d, "ttl", 0.0, 0.0, MAX_PIN_TTL, lo_open=True)
    return PinRequest(_opt_text(d, "model", 256), req, ttl, req.cache_salt)


@router.post("/v1/pins")
async def pin_prefix(request: Request, st: ServerState = Depends(server_state)) -> Response:
    """Pin a prefix: computed first (a one-token request) unless its full blocks are all cached, then pinned
    between two engine steps."""
    from ...engine.sampling import SamplingParams

    pr = await st.parsed(request, parse_pin)
    pins_on(st)
    llm, bm, engine = st.llm, st.bm, st.engine
    ids = await asyncio.to_thread(prompt_token_ids, pr.request, llm.tokenizer, st.limits)
    param = "messages" if hasattr(pr.request, "messages") else "prompt"
    st.fit(len(ids), 1, param)
    full = len(ids) // bm.block_size * bm.block_size

    def pin(require_full: bool) -> Any:
        if require_full and bm.lookup_prefix(ids + ids[:1], namespace=pr.cache_salt).num_cached_tokens < full:
            return None
        pin = bm.retention.pin_prefix(ids, ttl=pr.ttl, namespace=pr.cache_salt)
        rp = st.engine.core.request_pins
        if rp is not None:  # (requests asking to pin that prefix then need no room of the budget)
            rp.remember(ids[: pin.num_tokens], pin, pr.cache_salt)
        return pin

    try:
        got = await asyncio.to_thread(engine.between_steps, lambda: pin(True)) if full else None
        if got is None and full:  # compute its KV first: a one-token request through the scheduler
            try:
                warm = engine.prepare({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0),
                                      pr.cache_salt)
            except PagedKVError as e:
                raise APIError(400, str(e), "invalid_request_error", None, param) from None
            st.check_open()
            try:
                stream = engine.submit(warm)
            except EngineOverloaded as e:
                raise APIError(503, str(e), "server_overloaded", "server_overloaded")
            done = await until_done(st, stream, request)
            if done is None:
                return Response(status_code=499)
            got = await asyncio.to_thread(engine.between_steps, lambda: pin(False))
    except PinBudgetError as e:
        raise APIError(409, str(e), "invalid_request_error", "pin_budget_exceeded") from None
    except EngineDead as e:
        raise APIError(503, str(e), "server_error", "engine_dead") from None
    if got is None:  # shorter than a block: nothing to pin
        got = Pin(0, 0, 0, pr.ttl)
    return JSONResponse({**pin_json(got), "prompt_tokens": len(ids)})


@router.get("/v1/pins")
async def list_pins(request: Request, st: ServerState = Depends(server_state)) -> JSONResponse:
    st.check_auth(request)
    pins_on(st)
    bm = st.bm
    pins, n = await asyncio.to_thread(st.engine.between_steps, lambda: (bm.retention.pins, bm.retention.num_pinned_blocks))
    return JSONResponse({"object": "list", "data": [pin_json(p) for p in pins], "num_pinned_blocks": n,
                         "pin_budget_blocks": bm.config.pin_budget_blocks})


@router.delete("/v1/pins/{pin_id}")
async def unpin(pin_id: str, request: Request, st: ServerState = Depends(server_state)) -> JSONResponse:
    st.check_auth(request)
    pins_on(st)
    if not pin_id.isascii() or not pin_id.isdigit() or len(pin_id) > 18:
        raise APIError(404, f"no pin {pin_id[:40]!r}", "not_found_error", "pin_not_found", "pin_id")
    try:
        await asyncio.to_thread(st.engine.between_steps, lambda: st.bm.retention.unpin(int(pin_id)))
    except UnknownPinError as e:
        raise APIError(404, str(e), "not_found_error", "pin_not_found", "pin_id") from None
    return JSONResponse({"object": "pin", "pin_id": int(pin_id), "deleted": True})
