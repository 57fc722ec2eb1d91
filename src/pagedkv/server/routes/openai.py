"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers
Server-Sent Events, one ``data: {chunk}`` per step that produced text, ending with ``data: [DONE]``) and
``GET /v1/models``; and one request's way through the engine, as they run it: :func:`start` (tokenize, check,
the prefill/decode split's KV, queue), then :func:`finish` (the whole answer) or :func:`stream_events`
(Server-Sent Events). A client that disconnects aborts its request, which frees its blocks after the engine's
current step."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...errors import PagedKVError
from ..async_engine import (Delta, EngineDead, EngineDraining, EngineOverloaded, Finished, RequestFailed,
                            RequestStream)
from ..kv_transfer import check_request
from ..validation import APIError, error_body, parse_chat, parse_completion, prompt_token_ids
from .retention import admit_pin, pin_answer
from .state import ServerState, server_state

__all__ = ["router", "start", "finish", "until_done", "stream_events", "result_usage"]

router = APIRouter()


# ------------------------------------------------------------------- response shapes (ids, usage)
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


# ---------------------------------------------------------------------------------------------- routes
@router.post("/v1/completions")
async def completions(request: Request, st: ServerState = Depends(server_state)) -> Response:
    req = await st.parsed(request, parse_completion)
    stream = await start(st, req, chat=False)
    head = ResponseHead.make("cmpl", st.model_name)

    def chunk(index: int, text: str, reason: str | None) -> dict:
        return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}

    if req.stream:
        events = stream_events(st, request, stream, chunk, "text_completion", head, req.include_usage, None,
                               req.kv_retention)
        return StreamingResponse(events, media_type="text/event-stream")
    done, extra = await finish(st, stream, request, req)
    if done is None:
        return Response(status_code=499)  # nobody is listening
    res = done.result
    return JSONResponse({
        "id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
        "choices": [{"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                    for o in res.outputs],
        "usage": result_usage(res), **extra,
    })


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, st: ServerState = Depends(server_state)) -> Response:
    req = await st.parsed(request, parse_chat)
    if not st.llm.tokenizer.has_chat_template:  # a base model: refused, as vLLM refuses chat without a template
        raise APIError(400, f"The model {st.model_name!r} has no chat template (its GGUF file carries none: a base "
                       "model), so chat completions are refused; use /v1/completions.",
                       "invalid_request_error", "chat_template_missing", "messages")
    stream = await start(st, req, chat=True)
    head = ResponseHead.make("chatcmpl", st.model_name)

    def chunk(index: int, text: str, reason: str | None, role: bool = False) -> dict:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                "model": head.model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    if req.stream:
        first = [chunk(i, "", None, role=True) for i in range(stream.n)]
        events = stream_events(st, request, stream, chunk, "chat.completion.chunk", head, req.include_usage,
                               first, req.kv_retention)
        return StreamingResponse(events, media_type="text/event-stream")
    done, extra = await finish(st, stream, request, req)
    if done is None:
        return Response(status_code=499)
    res = done.result
    return JSONResponse({
        "id": head.id, "object": "chat.completion", "created": head.created, "model": head.model,
        "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                     "logprobs": None, "finish_reason": o.finish_reason} for o in res.outputs],
        "usage": result_usage(res), **extra,
    })


@router.get("/v1/models")
async def models(request: Request, st: ServerState = Depends(server_state)) -> JSONResponse:
    st.check_auth(request)
    return JSONResponse({"object": "list", "data": [{
        "id": name, "object": "model", "created": st.created, "owned_by": "pagedkv", "root": st.model_name,
        "max_model_len": st.llm.max_model_len,
    } for name in (st.model_name, *st.model_aliases)]})


# ------------------------------------------------------------------------------------------ a request's way
def _max_tokens(st: ServerState, req: Any, n_prompt: int, chat: bool) -> int:
    if req.max_tokens is not None:
        return req.max_tokens
    if chat:  # the rest of the context, or of the KV cache if smaller
        return max(1, min(st.llm.max_model_len, st.kv_room) - n_prompt)
    return 16  # OpenAI's default for completions


async def _prepare(st: ServerState, req: Any, ids: list, chat: bool) -> Any:
    """The checks (400), the engine's request and its pin (409); a refused decode request frees the prefill
    replica's hold now."""
    from ...engine.sampling import SamplingParams

    kv, kvt = st.kv, req.kv_transfer
    max_tokens = _max_tokens(st, req, len(ids), chat)
    try:
        st.fit(len(ids), max_tokens, "messages" if chat else "prompt")
        if kvt is not None:  # (a plain request runs no KV-handoff code)
            check_request(kvt, role=kv.role, available=kv.available, block_size=st.bm.block_size,
                          num_prompt_tokens=len(ids), n=req.n, stream=req.stream)
        if kvt is not None and kvt.do_remote_prefill:
            kv.check_peer(kvt)
        try:
            params = SamplingParams(**req.sampling_kwargs(max_tokens))
            request = st.engine.prepare({"prompt_token_ids": ids}, params, req.cache_salt)
            request.priority = req.priority
            # the conversation hint, per tenant: one salt's session ids are not another's
            if req.session_id is not None:
                request.session = req.session_id if req.cache_salt is None else (req.cache_salt, req.session_id)
        except PagedKVError as e:  # (validation caught what a client can get wrong; this is a last line)
            raise APIError(400, str(e).removeprefix("SamplingParams: "), "invalid_request_error", None,
                           None) from None
        if req.kv_retention is not None:
            request.retain = await admit_pin(st, ids, req.kv_retention, req.cache_salt)
    except APIError:
        if kvt is not None and kvt.do_remote_prefill and kvt.remote_host in kv.allow_hosts:
            st.in_background(kv.release_remote(kvt))  # refused here: the prefill replica frees its hold now
        raise
    return request


async def start(st: ServerState, req: Any, chat: bool) -> RequestStream:
    """Tokenize (in a thread, bounded), check the fit (400), build the request and queue it (503 when full)."""
    ids = await asyncio.to_thread(prompt_token_ids, req, st.llm.tokenizer, st.limits)
    request = await _prepare(st, req, ids, chat)
    kv, kvt = st.kv, req.kv_transfer
    remote_prefill = kvt is not None and kvt.do_remote_prefill
    into = None  # the decode side's transfer into reserved blocks (ports that offer it)
    via_store = remote_prefill and await kv.through_store(kvt, ids, req.cache_salt)
    if via_store:
        st.in_background(kv.release_remote(kvt))  # every block is in the shared store: the engine loads them
    elif remote_prefill:
        if getattr(kv.port, "expect_external", None) is None:  # read the KV before queueing, staged
            got = await kv.fetch(kvt, ids, req.cache_salt)
            st.in_background(kv.release_remote(kvt))
            if got.payloads:
                kv.port.attach_external(request, got.payloads, len(kvt.remote_block_ids))
    reserved = remote_prefill and not via_store and getattr(kv.port, "expect_external", None) is not None
    try:
        st.check_open()
    except APIError:
        if reserved:
            st.in_background(kv.release_remote(kvt))
        raise
    if reserved:
        # queued at once, waiting for its KV: its blocks are reserved at admission, the read starts then and
        # writes into them as it arrives (docs/pd-split.md#the-decode-side)
        into = kv.port.expect_external(request, len(kvt.remote_block_ids))
    if kvt is not None and kvt.do_remote_decode:
        kv.ensure_sweeper()  # (holds are taken: the sweeper releases those past their lease)
        kv.expect_hold(request, ids, req.cache_salt)
    try:
        stream = st.engine.submit(request)
    except (EngineOverloaded, EngineDead) as e:
        if kvt is not None and kvt.do_remote_decode:
            kv.forget(request.request_id)
        elif remote_prefill:
            kv.port.drop_staged(request.request_id)
            if into is not None:
                st.in_background(kv.release_remote(kvt))
        if isinstance(e, EngineOverloaded):
            raise APIError(503, str(e), "server_overloaded", "server_overloaded") from None
        if isinstance(e, EngineDraining):
            raise APIError(503, str(e), "server_error", "server_shutting_down") from None
        raise APIError(503, str(e), "server_error", "engine_dead") from None
    if into is not None:
        st.in_background(kv.fetch_into(kvt, ids, req.cache_salt, into, gone=lambda: stream.finished))
    return stream


async def finish(st: ServerState, stream: RequestStream, request: Request,
                 req: Any) -> tuple[Finished | None, dict]:
    """:func:`until_done`, and the extra fields of the answer: ``kv_transfer_params`` for a prefill for a
    remote decode (a hold left unanswered, the request aborted or failed, is released); ``kv_retention``, the
    request's pin, when it asked for one."""
    try:
        done = await until_done(st, stream, request)
        extra: dict = {}
        if done is not None and req.kv_retention is not None:
            extra["kv_retention"] = pin_answer(done.result, req.kv_retention)
        if done is None or req.kv_transfer is None or not req.kv_transfer.do_remote_decode:
            return done, extra
        return done, {"kv_transfer_params": await st.kv.answer_async(stream.request_id), **extra}
    finally:
        if req.kv_transfer is not None:
            st.kv.forget(stream.request_id)


def _abort_on_disconnect(request: Request, stream: RequestStream) -> asyncio.Task:
    """A task that aborts ``stream`` when the client disconnects (cancel it once the response is done).
    uvicorn drops writes to a closed connection silently, so the disconnect must be watched for."""
    async def watch() -> None:
        while not stream.finished:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.abort()
                return

    return asyncio.ensure_future(watch())


async def until_done(st: ServerState, stream: RequestStream, request: Request) -> Finished | None:
    """The final result, or None (the request aborted) if the client goes away first."""
    watcher = _abort_on_disconnect(request, stream)
    try:
        async for item in stream:
            if isinstance(item, Finished):
                return item
        return None
    except RequestFailed as e:
        raise APIError(500, str(e), "server_error", "internal_error") from None
    except EngineDead as e:
        draining = st.engine.draining
        raise APIError(503 if draining else 500, str(e), "server_error",
                       "server_shutting_down" if draining else "engine_dead") from None
    finally:
        watcher.cancel()
        stream.abort()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_error(st: ServerState, e: Exception) -> str:
    if isinstance(e, RequestFailed):
        body = error_body(str(e), "server_error", "internal_error")
    elif st.engine.draining:
        body = error_body(str(e), "server_error", "server_shutting_down")
    else:
        body = error_body(str(e), "server_error", "engine_dead")
    return _sse(body)


def result_usage(res: Any) -> dict:
    """OpenAI's usage of a finished request (prompt, completion and cached tokens)."""
    return usage(len(res.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs), res.num_cached_tokens)


async def stream_events(st: ServerState, request: Request, stream: RequestStream, make_chunk, kind: str,
                        head: ResponseHead, include_usage: bool, first: list | None,
                        retention: dict | None = None) -> AsyncIterator[str]:
    """SSE body: ``first`` chunks (chat's role deltas), then text deltas, finish reasons, usage, the request's
    pin (``retention``: its ``kv_retention``; a chunk with no choices, as usage's), [DONE]. A client that
    disconnects aborts the request, which ends this iteration; a failure after the first chunk ends the stream
    with an error event and [DONE]."""
    watcher = _abort_on_disconnect(request, stream)
    try:
        for chunk in first or ():
            yield _sse(chunk)
        async for item in stream:
            if isinstance(item, Delta):
                if item.text:
                    yield _sse(make_chunk(item.index, item.text, None))
                continue
            res = item.result
            for d, out in zip(item.deltas, res.outputs):
                yield _sse(make_chunk(d.index, d.text, out.finish_reason))
            if include_usage:
                yield _sse({"id": head.id, "object": kind, "created": head.created,
                            "model": head.model, "choices": [], "usage": result_usage(res)})
            if retention is not None:
                yield _sse({"id": head.id, "object": kind, "created": head.created, "model": head.model,
                            "choices": [], "kv_retention": pin_answer(res, retention)})
        if not stream.aborted:
            yield "data: [DONE]\n\n"
    except (RequestFailed, EngineDead) as e:  # an error event, then the end of the stream
        yield _sse_error(st, e)
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        stream.abort()
