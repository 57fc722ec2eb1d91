"""The FastAPI application: OpenAI-compatible routes over an :class:`~pagedkv.server.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers Server-Sent Events,
one ``data: {chunk}`` per step that produced text, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text), vLLM's ``POST /tokenize`` and ``POST /detokenize``
(:mod:`.tokenization`; open without the key, as in vLLM); the pins of the prefix cache (``--pin-budget-blocks``):
``POST /v1/pins`` (pin a prefix: ``prompt`` or ``messages``, ``ttl`` seconds, ``cache_salt``; its KV is computed
first when it is not cached; 409 ``pin_budget_exceeded`` past the budget, 400 when pinning is off),
``GET /v1/pins`` and ``DELETE /v1/pins/{pin_id}`` (404 ``pin_not_found``). A completion or chat request steers
retention itself with ``session_id`` (its conversation: the eviction policy's hint, per ``cache_salt``) and
``kv_retention`` (``{"pin_tokens": N | "prompt", "ttl": s}``: its prefix pinned once computed; 400
``pinning_disabled``, 409 ``pin_budget_exceeded`` as for ``/v1/pins``; the answer's ``kv_retention`` (a
stream: a chunk with no choices before ``[DONE]``) names the pin; :mod:`pagedkv.engine.request_pins`). With an API key, every ``/v1`` route needs
``Authorization: Bearer KEY`` (401 otherwise); /health and /metrics stay open, as in vLLM.

Status codes, all in OpenAI's error shape: 400 for a client's mistake (see :mod:`.validation`: invalid JSON,
a field of the wrong type or out of range, an unknown field, a prompt longer than the context or than the KV
cache, a chat for a model without a chat template: code ``chat_template_missing``), 401 for a missing or wrong key, 404 for an unknown model or route, 413 for a body over the limit, 415 for
a body that is not JSON, 503 when the waiting queue is full or the server is shutting down, 500 when the engine
failed this request (a server fault; the engine goes on). A streamed request that fails after its first chunk
ends with an error event (``data: {"error": {...}}``) and ``data: [DONE]``. A client that disconnects (streamed
or not) aborts its request, which frees its blocks after the engine's current step.

Assembly only: each job's routes are a module of :mod:`.routes` (an ``APIRouter``), and every route reaches the
shared state (engine, names, limits, KV handoff) through one :class:`~.routes.state.ServerState` on
``app.state.server``.

The body is read up to the limit only; parsing a large body, tokenizing a prompt and rendering a chat template
run in worker threads, never on the event loop, and only after the text was bounded by the context length
(the tokenizer routes: by the body limit, as vLLM answers a count past the context).

Prefill/decode split (``kv_transfer_params`` in vLLM's shape; :mod:`.kv_transfer`, :mod:`.kv_handoff`,
docs/pd-split.md): a request with ``do_remote_decode`` is computed here and its answer carries the
``kv_transfer_params`` naming the blocks held for the decode replica (``GET`` / ``DELETE /v1/kv/holds/{id}``,
:mod:`.routes.kv`; with both replicas on one shared store, only once those blocks are in it, and naming it in
``remote_kv_store``); a request with ``do_remote_prefill`` first reads those blocks from the prefill replica (the
rest of the prompt is computed here, also when the read fails), or, when the shared store it names is this
replica's and holds every block, leaves them to the engine's tier load; then releases the hold. Bad params, a direction
the replica's ``--kv-role`` does not take, or an engine that cannot hand KV over: 400.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from .async_engine import AsyncEngine
from .kv_handoff import KVHandoff
from .metrics import ServerMetrics
from .routes import admin, openai, pins, tokenize
from .routes import kv as kv_routes
from .routes.errors import install_error_handlers
from .routes.state import ServerState
from .validation import DEFAULT_LIMITS, Limits, limits_for

__all__ = ["build_app"]


def build_app(engine: AsyncEngine, *, model_name: str, model_aliases: tuple[str, ...] = (),
              api_key: str | None = None,
              metrics: ServerMetrics | None = None, limits: Limits | None = None,
              max_body_bytes: int = DEFAULT_LIMITS.max_body_bytes, kv: KVHandoff | None = None) -> FastAPI:
    """The application serving ``engine`` under the model id ``model_name`` (a request may also name one of
    ``model_aliases``; answers always carry ``model_name``). ``limits`` default to the model's
    (:func:`~pagedkv.server.validation.limits_for`) with ``max_body_bytes``. ``kv``: the replica's side of a
    prefill/decode split (default: role ``both`` without an engine port, so ``kv_transfer_params`` get 400)."""
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)
    llm = engine.llm
    if limits is None:
        limits = limits_for(llm.tokenizer, llm.max_model_len, max_n=min(128, llm.max_num_seqs),
                            max_body_bytes=max_body_bytes)
    if kv is None:
        kv = KVHandoff()
    st = ServerState(engine, model_name, tuple(model_aliases), api_key, metrics, limits, kv, int(time.time()))
    app.state.server = st
    app.state.limits = limits
    app.state.kv = kv
    app.state.kv_auth = st.check_auth
    install_error_handlers(app)
    for module in (openai, pins, tokenize, admin):
        app.include_router(module.router)
    if kv.available:
        app.include_router(kv_routes.router)
    return app
