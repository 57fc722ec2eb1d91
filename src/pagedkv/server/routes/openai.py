"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` answers
Server-Sent Events, one ``data: {chunk}`` per step that produced text, ending with ``data: [DONE]``) and
``GET /v1/models``. The request's way through the engine: :mod:`.generation`."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..protocol import ResponseHead
from ..validation import APIError, parse_chat, parse_completion
from .generation import finish, result_usage, start, stream_events
from .state import ServerState, server_state

__all__ = ["router"]

router = APIRouter()


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
