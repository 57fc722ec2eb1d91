"""The FastAPI application: OpenAI-compatible routes over an :class:`~pagedkv.server.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers Server-Sent Events,
one ``data: {chunk}`` per step that produced text, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text). With an API key, every ``/v1`` route needs
``Authorization: Bearer KEY`` (401 otherwise); /health and /metrics stay open, as in vLLM.

Status codes: 400 for a client's mistake (invalid JSON, bad or unsupported parameters, a prompt longer than the
context or than the KV cache), 401 for a missing or wrong key, 404 for an unknown model or route, 503 when the
waiting queue is full; all in OpenAI's error shape. A client that disconnects (streamed or not) aborts its
request, which frees its blocks after the engine's current step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import PagedKVError, PromptTooLongError
from .async_engine import AsyncEngine, Delta, EngineDead, EngineOverloaded, Finished, RequestStream
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import APIError, ResponseHead, error_body, parse_chat, parse_completion, usage

__all__ = ["build_app"]


def _error(status: int, message: str, type: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, code, param), status_code=status)


def build_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The application serving ``engine`` under the model id ``model_name``."""
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)
    llm = engine.llm
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

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
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model_not_found", "model")

    async def start(prompt: Any, req: Any, default_max: int) -> RequestStream:
        """Validate against the engine (400 on a prompt that can never run) and queue (503 when full)."""
        from ..engine.sampling import SamplingParams

        try:
            params = SamplingParams(**req.sampling_kwargs(default_max))
            request = await asyncio.to_thread(engine.prepare, prompt, params, req.cache_salt)
        except PagedKVError as e:
            code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
            m = re.match(r"SamplingParams: (\w+)", str(e))
            param = m.group(1) if m else ("prompt" if code else None)
            raise APIError(400, str(e), "invalid_request_error", code, param) from None
        try:
            return engine.submit(request)
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_overloaded", "server_overloaded")
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", "engine_dead")

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
        except EngineDead as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            watcher.cancel()
            stream.abort()

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream_events(request: Request, stream: RequestStream, make_chunk, kind: str, head: ResponseHead,
                            include_usage: bool, first: list | None) -> AsyncIterator[str]:
        """SSE body: ``first`` chunks (chat's role deltas), then text deltas, finish reasons, usage, [DONE].
        A client that disconnects aborts the request, which ends this iteration."""
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
            if not stream.aborted:
                yield "data: [DONE]\n\n"
        except EngineDead as e:
            yield sse(error_body(str(e), "server_error"))
        finally:
            watcher.cancel()
            stream.abort()

    def result_usage(res: Any) -> dict:
        return usage(len(res.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs), res.num_cached_tokens)

    async def body_of(request: Request) -> bytes:
        check_auth(request)
        return await request.body()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_completion(await body_of(request))
        check_model(req.model)
        stream = await start(req.prompt_input(), req, 16)
        head = ResponseHead.make("cmpl", model_name)

        def chunk(index: int, text: str, reason: str | None) -> dict:
            return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            events = stream_events(request, stream, chunk, "text_completion", head, req.include_usage, None)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await until_done(stream, request)
        if done is None:
            return Response(status_code=499)  # nobody is listening
        res = done.result
        return JSONResponse({
            "id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
            "choices": [{"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                        for o in res.outputs],
            "usage": result_usage(res),
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await body_of(request))
        check_model(req.model)
        try:
            ids = llm.tokenizer.apply_chat_template(req.conversation())
        except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", "invalid_request_error",
                           None, "messages")
        bm = llm.block_manager  # default max_tokens: the rest of the context, or of the KV cache if smaller
        room = min(llm.max_model_len, (bm.num_gpu_blocks - bm.watermark_blocks) * bm.block_size)
        stream = await start({"prompt_token_ids": ids}, req, max(1, room - len(ids)))
        head = ResponseHead.make("chatcmpl", model_name)

        def chunk(index: int, text: str, reason: str | None, role: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                    "model": head.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            first = [chunk(i, "", None, role=True) for i in range(stream.n)]
            events = stream_events(request, stream, chunk, "chat.completion.chunk", head, req.include_usage, first)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await until_done(stream, request)
        if done is None:
            return Response(status_code=499)
        res = done.result
        return JSONResponse({
            "id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
            "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                         "logprobs": None, "finish_reason": o.finish_reason} for o in res.outputs],
            "usage": result_usage(res),
        })

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "pagedkv",
            "max_model_len": llm.max_model_len,
        }]})

    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return Response(status_code=200)
        return _error(503, "the engine is not running", "server_error")

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app
