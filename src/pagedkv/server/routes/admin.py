"""The operator's routes, open without the API key (as in vLLM): ``GET /health`` (200 while the engine runs;
503 ``server_shutting_down`` while it drains, ``engine_dead`` once it stopped) and ``GET /metrics``
(Prometheus text, :mod:`pagedkv.server.metrics`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from ..metrics import CONTENT_TYPE
from .errors import error_response
from .state import ServerState, server_state

__all__ = ["router"]

router = APIRouter()


@router.get("/health")
async def health(st: ServerState = Depends(server_state)) -> Response:
    if st.engine.draining:
        return error_response(503, "the server is shutting down", "server_error", "server_shutting_down")
    if st.engine.alive:
        return Response(status_code=200)
    return error_response(503, "the engine is not running", "server_error", "engine_dead")


@router.get("/metrics")
async def prometheus(st: ServerState = Depends(server_state)) -> Response:
    body = st.metrics.render() if st.metrics is not None else b""
    return Response(body, media_type=CONTENT_TYPE)
