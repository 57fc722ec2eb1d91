"""What every route of ``pagedkv serve`` reaches: one :class:`ServerState` on ``app.state.server``, read through
the :func:`server_state` dependency, with the checks the routes share (key, model, open, fit, body)."""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..validation import APIError, Limits, check_content_type, read_body

__all__ = ["ServerState", "server_state", "PARSE_IN_THREAD"]

PARSE_IN_THREAD = 16 * 1024  # bodies larger than this are parsed in a worker thread


@dataclass
class ServerState:
    """The engine, the served names, the limits and the replica's KV handoff, shared by every route.

    ``engine``: an :class:`~pagedkv.server.async_engine.AsyncEngine` (or a stand-in with ``llm``, ``prepare``,
    ``submit``, ``between_steps``, ``alive``, ``draining``); ``kv``: a :class:`~pagedkv.server.kv_handoff.KVHandoff`.
    ``kv_room``: the tokens one request can ever hold in the KV cache (computed once)."""

    engine: Any
    model_name: str
    model_aliases: tuple[str, ...]
    api_key: str | None
    metrics: Any
    limits: Limits
    kv: Any
    created: int
    kv_room: int = 0
    background: set = field(default_factory=set)  # hold releases in flight (a reference keeps each task alive)

    def __post_init__(self) -> None:
        bm = self.llm.block_manager
        self.kv_room = (bm.config.num_gpu_blocks - bm.config.watermark_blocks) * bm.block_size

    @property
    def llm(self) -> Any:
        return self.engine.llm

    @property
    def bm(self) -> Any:
        return self.engine.llm.block_manager

    def in_background(self, coro) -> None:
        """Run ``coro`` as a task the state keeps alive until it ends."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def check_auth(self, request: Request) -> None:
        """401 unless the request carries ``Authorization: Bearer KEY`` (no key set: every request passes)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is None, the served name or one of its aliases."""
        if name is not None and name != self.model_name and name not in self.model_aliases:
            raise APIError(404, f"The model {name[:100]!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model_not_found", "model")

    def check_open(self) -> None:
        """503 ``server_shutting_down`` while the engine drains."""
        if self.engine.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", "server_error",
                           "server_shutting_down")

    def fit(self, n_prompt: int, max_tokens: int, param: str) -> None:
        """400 (context_length_exceeded) unless the prompt plus max_tokens fit the context and the KV cache."""
        total, max_len = n_prompt + max_tokens, self.llm.max_model_len
        if total > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                           f"requested {total} tokens ({n_prompt} in the {param}, {max_tokens} in the completion). "
                           f"Please reduce the length of the {param} or completion.", "invalid_request_error",
                           "context_length_exceeded", param)
        bs = self.bm.block_size
        if -(-total // bs) * bs > self.kv_room:
            raise APIError(400, f"This server's KV cache holds at most {self.kv_room} tokens per request. However, "
                           f"you requested {total} tokens ({n_prompt} in the {param}, {max_tokens} in the "
                           f"completion). Please reduce the length of the {param} or completion.",
                           "invalid_request_error", "context_length_exceeded", param)

    async def read(self, request: Request, parse) -> Any:
        """The body checked (415, 413) and parsed by ``parse(body, limits)`` (400); a large body is parsed in a
        thread. Then the model it names is checked (404)."""
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, self.limits.max_body_bytes)
        if len(body) > PARSE_IN_THREAD:
            req = await asyncio.to_thread(parse, body, self.limits)
        else:
            req = parse(body, self.limits)
        self.check_model(req.model)
        return req

    async def parsed(self, request: Request, parse) -> Any:
        """A ``/v1`` body: the key (401), the server open (503), then :meth:`read`."""
        self.check_auth(request)
        self.check_open()
        return await self.read(request, parse)


def server_state(request: Request) -> ServerState:
    """The dependency every route takes its :class:`ServerState` from."""
    return request.app.state.server
