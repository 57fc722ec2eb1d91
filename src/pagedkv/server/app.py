"""The FastAPI application: OpenAI-compatible routes over an :class:`~pagedkv.server.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers Server-Sent Events,
one ``data: {chunk}`` per step that produced text, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text); the pins of the prefix cache (``--pin-budget-blocks``):
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

The body is read up to the limit only; parsing a large body, tokenizing a prompt and rendering a chat template
run in worker threads, never on the event loop, and only after the text was bounded by the context length.

Prefill/decode split (``kv_transfer_params`` in vLLM's shape; :mod:`.kv_transfer`, :mod:`.kv_handoff`,
docs/pd-split.md): a request with ``do_remote_decode`` is computed here and its answer carries the
``kv_transfer_params`` naming the blocks held for the decode replica (``GET`` / ``DELETE /v1/kv/holds/{id}``,
:mod:`.kv_routes`; with both replicas on one shared store, only once those blocks are in it, and naming it in
``remote_kv_store``); a request with ``do_remote_prefill`` first reads those blocks from the prefill replica (the
rest of the prompt is computed here, also when the read fails), or, when the shared store it names is this
replica's and holds every block, leaves them to the engine's tier load; then releases the hold. Bad params, a direction
the replica's ``--kv-role`` does not take, or an engine that cannot hand KV over: 400.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import PagedKVError, PinBudgetError, UnknownPinError
from ..retention.steering import Pin
from .async_engine import (AsyncEngine, Delta, EngineDead, EngineDraining, EngineOverloaded, Finished,
                           RequestFailed, RequestStream)
from .kv_handoff import KVHandoff
from .kv_transfer import check_request
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ResponseHead, usage
from .validation import (DEFAULT_LIMITS, APIError, Limits, check_content_type, error_body, limits_for,
                         parse_chat, parse_completion, parse_pin, prompt_token_ids, read_body)

__all__ = ["build_app"]

_PARSE_IN_THREAD = 16 * 1024  # bodies larger than this are parsed in a worker thread


class _ErrorResponse(JSONResponse):
    """JSON with ASCII escapes: an error message may quote the client's text, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(status: int, message: str, type: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return _ErrorResponse(error_body(message, type, code, param), status_code=status)


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
    created = int(time.time())
    if limits is None:
        limits = limits_for(llm.tokenizer, llm.max_model_len, max_n=min(128, llm.max_num_seqs),
                            max_body_bytes=max_body_bytes)
    app.state.limits = limits
    if kv is None:
        kv = KVHandoff()
    app.state.kv = kv
    background: set = set()  # hold releases in flight (a reference keeps each task alive)

    def in_background(coro) -> None:
        task = asyncio.ensure_future(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _ErrorResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:  # a server bug, never a client's mistake
        return _error(500, f"internal error: {type(e).__name__}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name and name not in model_aliases:
            raise APIError(404, f"The model {name[:100]!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model_not_found", "model")

    def check_open() -> None:
        if engine.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "server_error",
                           "server_shutting_down")

    bm = llm.block_manager
    kv_room = (bm.num_gpu_blocks - bm.watermark_blocks) * bm.block_size  # tokens one request can ever hold

    def fit(n_prompt: int, max_tokens: int, param: str) -> None:
        """400 (context_length_exceeded) unless the prompt plus max_tokens fit the context and the KV cache."""
        total = n_prompt + max_tokens
        if total > llm.max_model_len:
            raise APIError(400, f"This model's maximum context length is {llm.max_model_len} tokens. However, you "
                           f"requested {total} tokens ({n_prompt} in the {param}, {max_tokens} in the completion). "
                           f"Please reduce the length of the {param} or completion.", "invalid_request_error",
                           "context_length_exceeded", param)
        need = -(-total // bm.block_size) * bm.block_size
        if need > kv_room:
            raise APIError(400, f"This server's KV cache holds at most {kv_room} tokens per request. However, you "
                           f"requested {total} tokens ({n_prompt} in the {param}, {max_tokens} in the completion). "
                           f"Please reduce the length of the {param} or completion.", "invalid_request_error",
                           "context_length_exceeded", param)

    async def start(req: Any, chat: bool) -> RequestStream:
        """Tokenize (in a thread, bounded), check the fit (400), build the request and queue it (503 when full)."""
        from ..engine.sampling import SamplingParams

        ids = await asyncio.to_thread(prompt_token_ids, req, llm.tokenizer, limits)
        param = "messages" if chat else "prompt"
        if req.max_tokens is not None:
            max_tokens = req.max_tokens
        elif chat:  # the rest of the context, or of the KV cache if smaller
            max_tokens = max(1, min(llm.max_model_len, kv_room) - len(ids))
        else:
            max_tokens = 16  # OpenAI's default for completions
        kvt = req.kv_transfer
        try:
            fit(len(ids), max_tokens, param)
            check_request(kvt, role=kv.role, available=kv.available, block_size=bm.block_size,
                          num_prompt_tokens=len(ids), n=req.n, stream=req.stream)
            if kvt is not None and kvt.do_remote_prefill:
                kv.check_peer(kvt)
            try:
                params = SamplingParams(**req.sampling_kwargs(max_tokens))
                request = engine.prepare({"prompt_token_ids": ids}, params, req.cache_salt)
                request.priority = req.priority
                # the conversation hint, per tenant: one salt's session ids are not another's
                if req.session_id is not None:
                    request.session = req.session_id if req.cache_salt is None else (req.cache_salt, req.session_id)
            except PagedKVError as e:  # (validation caught what a client can get wrong; this is a last line)
                raise APIError(400, str(e).removeprefix("SamplingParams: "), "invalid_request_error", None,
                               None) from None
            if req.kv_retention is not None:
                request.retain = await admit_pin(ids, req.kv_retention, req.cache_salt)
        except APIError:
            if kvt is not None and kvt.do_remote_prefill and kvt.remote_host in kv.allow_hosts:
                in_background(kv.release_remote(kvt))  # refused here: the prefill replica frees its hold now
            raise
        into = None  # the decode side's transfer into reserved blocks (ports that offer it)
        via_store = kvt is not None and kvt.do_remote_prefill and await kv.through_store(kvt, ids, req.cache_salt)
        if via_store:
            in_background(kv.release_remote(kvt))  # every block is in the shared store: the engine loads them
        elif kvt is not None and kvt.do_remote_prefill:
            if getattr(kv.port, "expect_external", None) is None:  # read the KV before queueing, staged
                got = await kv.fetch(kvt, ids, req.cache_salt)
                in_background(kv.release_remote(kvt))
                if got.payloads:
                    kv.port.attach_external(request, got.payloads, len(kvt.remote_block_ids))
        reserved = (kvt is not None and kvt.do_remote_prefill and not via_store
                    and getattr(kv.port, "expect_external", None) is not None)
        try:
            check_open()
        except APIError:
            if reserved:
                in_background(kv.release_remote(kvt))
            raise
        if reserved:
            # queued at once, waiting for its KV: its blocks are reserved at admission, the read starts then and
            # writes into them as it arrives (docs/pd-split.md#the-decode-side)
            into = kv.port.expect_external(request, len(kvt.remote_block_ids))
        if kvt is not None and kvt.do_remote_decode:
            kv.expect_hold(request, ids, req.cache_salt)
        try:
            stream = engine.submit(request)
        except (EngineOverloaded, EngineDead) as e:
            if kvt is not None and kvt.do_remote_decode:
                kv.forget(request.request_id)
            elif kvt is not None and kvt.do_remote_prefill:
                kv.port.drop_staged(request.request_id)
                if into is not None:
                    in_background(kv.release_remote(kvt))
            if isinstance(e, EngineOverloaded):
                raise APIError(503, str(e), "server_overloaded", "server_overloaded") from None
            if isinstance(e, EngineDraining):
                raise APIError(503, str(e), "server_error", "server_shutting_down") from None
            raise APIError(503, str(e), "server_error", "engine_dead") from None
        if into is not None:
            in_background(kv.fetch_into(kvt, ids, req.cache_salt, into, gone=lambda: stream.finished))
        return stream

    async def admit_pin(ids: list, spec: dict, salt: str | None) -> tuple:
        """A request's ``kv_retention`` checked between two steps (:mod:`pagedkv.engine.request_pins`): 400
        ``pinning_disabled`` or for a ``pin_tokens`` longer than the prompt, 409 ``pin_budget_exceeded`` when the
        pin does not fit the budget now. Returns what the request pins once computed."""
        from ..engine.request_pins import KVRetention

        pins_on()
        try:
            return await asyncio.to_thread(engine.between_steps, lambda: engine.core.request_pins.admit(
                ids, KVRetention(spec["pin_tokens"], spec["ttl"]), salt))
        except PinBudgetError as e:
            raise APIError(409, str(e), "invalid_request_error", "pin_budget_exceeded", "kv_retention") from None
        except PagedKVError as e:
            raise APIError(400, str(e), "invalid_request_error", None, "kv_retention.pin_tokens") from None
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", "engine_dead") from None

    def pin_answer(res: Any, spec: dict) -> dict:
        """The answer's ``kv_retention``: the request's pin (``pin_id`` null when nothing was pinned) and ``error``."""
        pin = res.pin if res.pin is not None else Pin(0, 0, 0, spec["ttl"])
        return {**pin_json(pin), "error": res.pin_error}

    async def finish(stream: RequestStream, request: Request, req: Any) -> tuple[Finished | None, dict]:
        """:func:`until_done`, and the extra fields of the answer: ``kv_transfer_params`` for a prefill for a
        remote decode (a hold left unanswered, the request aborted or failed, is released); ``kv_retention``, the
        request's pin, when it asked for one."""
        try:
            done = await until_done(stream, request)
            extra: dict = {}
            if done is not None and req.kv_retention is not None:
                extra["kv_retention"] = pin_answer(done.result, req.kv_retention)
            if done is None or req.kv_transfer is None or not req.kv_transfer.do_remote_decode:
                return done, extra
            return done, {"kv_transfer_params": await kv.answer_async(stream.request_id), **extra}
        finally:
            kv.forget(stream.request_id)

    def abort_on_disconnect(request: Request, stream: RequestStream) -> asyncio.Task:
        """A task that aborts ``stream`` when the client disconnects (cancel it once the response is done).
        uvicorn drops writes to a closed connection silently, so the disconnect must be watched for."""
        async def watch() -> None:
            while not stream.finished:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    stream.abort()
                    return

        return asyncio.ensure_future(watch())

    async def until_done(stream: RequestStream, request: Request) -> Finished | None:
        """The final result, or None (the request aborted) if the client goes away first."""
        watcher = abort_on_disconnect(request, stream)
        try:
            async for item in stream:
                if isinstance(item, Finished):
                    return item
            return None
        except RequestFailed as e:
            raise APIError(500, str(e), "server_error", "internal_error") from None
        except EngineDead as e:
            raise APIError(503 if engine.draining else 500, str(e), "server_error",
                           "server_shutting_down" if engine.draining else "engine_dead") from None
        finally:
            watcher.cancel()
            stream.abort()

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def sse_error(e: Exception) -> str:
        if isinstance(e, RequestFailed):
            body = error_body(str(e), "server_error", "internal_error")
        elif engine.draining:
            body = error_body(str(e), "server_error", "server_shutting_down")
        else:
            body = error_body(str(e), "server_error", "engine_dead")
        return sse(body)

    async def stream_events(request: Request, stream: RequestStream, make_chunk, kind: str, head: ResponseHead,
                            include_usage: bool, first: list | None, retention: dict | None = None
                            ) -> AsyncIterator[str]:
        """SSE body: ``first`` chunks (chat's role deltas), then text deltas, finish reasons, usage, the request's
        pin (``retention``: its ``kv_retention``; a chunk with no choices, as usage's), [DONE]. A client that
        disconnects aborts the request, which ends this iteration."""
        watcher = abort_on_disconnect(request, stream)
        try:
            for chunk in first or ():
                yield sse(chunk)
            async for item in stream:
                if isinstance(item, Delta):
                    if item.text:
                        yield sse(make_chunk(item.index, item.text, None))
                    continue
                res = item.result
                for d, out in zip(item.deltas, res.outputs):
                    yield sse(make_chunk(d.index, d.text, out.finish_reason))
                if include_usage:
                    yield sse({"id": head.id, "object": kind, "created": head.created,
                               "model": head.model, "choices": [], "usage": result_usage(res)})
                if retention is not None:
                    yield sse({"id": head.id, "object": kind, "created": head.created, "model": head.model,
                               "choices": [], "kv_retention": pin_answer(res, retention)})
            if not stream.aborted:
                yield "data: [DONE]\n\n"
        except (RequestFailed, EngineDead) as e:  # an error event, then the end of the stream
            yield sse_error(e)
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            stream.abort()

    def result_usage(res: Any) -> dict:
        return usage(len(res.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs), res.num_cached_tokens)

    async def parsed(request: Request, parse) -> Any:
        """Auth, then the body checked (415, 413) and parsed (400); a large body is parsed in a thread."""
        check_auth(request)
        check_open()
        kv.ensure_sweeper()
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, limits.max_body_bytes)
        if len(body) > _PARSE_IN_THREAD:
            req = await asyncio.to_thread(parse, body, limits)
        else:
            req = parse(body, limits)
        check_model(req.model)
        return req

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parsed(request, parse_completion)
        stream = await start(req, chat=False)
        head = ResponseHead.make("cmpl", model_name)

        def chunk(index: int, text: str, reason: str | None) -> dict:
            return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            events = stream_events(request, stream, chunk, "text_completion", head, req.include_usage, None,
                                   req.kv_retention)
            return StreamingResponse(events, media_type="text/event-stream")
        done, extra = await finish(stream, request, req)
        if done is None:
            return Response(status_code=499)  # nobody is listening
        res = done.result
        return JSONResponse({
            "id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
            "choices": [{"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                        for o in res.outputs],
            "usage": result_usage(res), **extra,
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parsed(request, parse_chat)
        if not llm.tokenizer.has_chat_template:  # a base model: refused, as vLLM refuses chat without a template
            raise APIError(400, f"The model {model_name!r} has no chat template (its GGUF file carries none: a base "
                           "model), so chat completions are refused; use /v1/completions.",
                           "invalid_request_error", "chat_template_missing", "messages")
        stream = await start(req, chat=True)
        head = ResponseHead.make("chatcmpl", model_name)

        def chunk(index: int, text: str, reason: str | None, role: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                    "model": head.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            first = [chunk(i, "", None, role=True) for i in range(stream.n)]
            events = stream_events(request, stream, chunk, "chat.completion.chunk", head, req.include_usage, first,
                                   req.kv_retention)
            return StreamingResponse(events, media_type="text/event-stream")
        done, extra = await finish(stream, request, req)
        if done is None:
            return Response(status_code=499)
        res = done.result
        return JSONResponse({
            "id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
            "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                         "logprobs": None, "finish_reason": o.finish_reason} for o in res.outputs],
            "usage": result_usage(res), **extra,
        })

    if kv.available:
        from .kv_routes import add_kv_routes

        add_kv_routes(app, kv, check_auth)
    def pin_json(pin: Any) -> dict:
        return {"object": "pin", "pin_id": pin.pin_id or None, "num_tokens": pin.num_tokens,
                "num_blocks": pin.num_blocks, "ttl": pin.ttl}

    def pins_on() -> None:
        if not bm.enable_prefix_caching or not bm.pin_budget_blocks:
            raise APIError(400, "pinning is off on this server: start it with --pin-budget-blocks N (and prefix "
                           "caching on)", "invalid_request_error", "pinning_disabled")

    @app.post("/v1/pins")
    async def pin_prefix(request: Request) -> JSONResponse:
        """Pin a prefix (see the module docstring): computed first (a one-token request) unless its full blocks are
        all cached, then pinned between two engine steps."""
        from ..engine.sampling import SamplingParams

        pr = await parsed(request, parse_pin)
        pins_on()
        ids = await asyncio.to_thread(prompt_token_ids, pr.request, llm.tokenizer, limits)
        param = "messages" if hasattr(pr.request, "messages") else "prompt"
        fit(len(ids), 1, param)
        full = len(ids) // bm.block_size * bm.block_size

        def pin(require_full: bool) -> Any:
            if require_full and bm.lookup_prefix(ids + ids[:1], namespace=pr.cache_salt).num_cached_tokens < full:
                return None
            pin = bm.pin_prefix(ids, ttl=pr.ttl, namespace=pr.cache_salt)
            rp = engine.core.request_pins
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
                check_open()
                try:
                    stream = engine.submit(warm)
                except EngineOverloaded as e:
                    raise APIError(503, str(e), "server_overloaded", "server_overloaded")
                done = await until_done(stream, request)
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

    @app.get("/v1/pins")
    async def list_pins(request: Request) -> JSONResponse:
        check_auth(request)
        pins_on()
        pins, n = await asyncio.to_thread(engine.between_steps, lambda: (bm.pins, bm.num_pinned_blocks))
        return JSONResponse({"object": "list", "data": [pin_json(p) for p in pins], "num_pinned_blocks": n,
                             "pin_budget_blocks": bm.pin_budget_blocks})

    @app.delete("/v1/pins/{pin_id}")
    async def unpin(pin_id: str, request: Request) -> JSONResponse:
        check_auth(request)
        pins_on()
        if not pin_id.isascii() or not pin_id.isdigit() or len(pin_id) > 18:
            raise APIError(404, f"no pin {pin_id[:40]!r}", "not_found_error", "pin_not_found", "pin_id")
        try:
            await asyncio.to_thread(engine.between_steps, lambda: bm.unpin(int(pin_id)))
        except UnknownPinError as e:
            raise APIError(404, str(e), "not_found_error", "pin_not_found", "pin_id") from None
        return JSONResponse({"object": "pin", "pin_id": int(pin_id), "deleted": True})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "pagedkv", "root": model_name,
            "max_model_len": llm.max_model_len,
        } for name in (model_name, *model_aliases)]})

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return _error(503, "the server is shutting down", "server_error", "server_shutting_down")
        if engine.alive:
            return Response(status_code=200)
        return _error(503, "the engine is not running", "server_error", "engine_dead")

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app
