"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize`` (fields and answers:
:mod:`pagedkv.server.tokenization`). Like vLLM's, they sit outside ``/v1`` and stay open without the API key
(``vllm bench serve`` calls them without one); they read only the tokenizer, never the engine, so they answer
while the server drains too. Errors: 400 for a bad body, 404 for an unknown model, 413 / 415 as on ``/v1``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..tokenization import detokenize, parse_detokenize, parse_tokenize, tokenize
from .state import ServerState, server_state

__all__ = ["router"]

router = APIRouter()


@router.post("/tokenize")
async def tokenize_route(request: Request, st: ServerState = Depends(server_state)) -> JSONResponse:
    req = await st.read(request, parse_tokenize)
    if req.chat is not None:
        from ..validation import APIError

        if not st.llm.tokenizer.has_chat_template:  # as the chat route: a base model has no template
            raise APIError(400, f"The model {st.model_name!r} has no chat template (its GGUF file carries none: a "
                           "base model), so messages cannot be rendered; send 'prompt'.",
                           "invalid_request_error", "chat_template_missing", "messages")
    out = await asyncio.to_thread(tokenize, req, st.llm.tokenizer, st.llm.max_model_len)
    return JSONResponse(out)


@router.post("/detokenize")
async def detokenize_route(request: Request, st: ServerState = Depends(server_state)) -> JSONResponse:
    req = await st.read(request, parse_detokenize)
    return JSONResponse(await asyncio.to_thread(detokenize, req, st.llm.tokenizer))
