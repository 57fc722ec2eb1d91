"""The prefill replica's routes of a prefill/decode split: a hold's blocks read (``GET /v1/kv/holds/{id}``;
``?blocks=K`` sends only the hold's first K blocks, for a decode replica whose staging budget takes fewer than
all) and released (``DELETE``), see :mod:`pagedkv.server.kv_handoff`. Behind the API key like ``/v1``.

The routes read the handoff from ``app.state.kv`` and the key check from ``app.state.kv_auth`` (a callable
raising the 401): :func:`add_kv_routes` sets both on any FastAPI app."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ...tiers.codec import OVERHEAD_BYTES
from ..kv_wire import MEDIA_TYPE
from ..validation import APIError

__all__ = ["router", "add_kv_routes"]

router = APIRouter()


def _gone(wire_id: str) -> APIError:
    return APIError(404, f"no KV hold {wire_id[:64]!r} here (unknown, released, or past its lease)",
                    "not_found_error", "unknown_hold", None)


def _handoff(request: Request) -> Any:
    """The key checked (401), then the app's handoff."""
    request.app.state.kv_auth(request)
    return request.app.state.kv


@router.get("/v1/kv/holds/{wire_id}")
async def read_hold(wire_id: str, request: Request) -> Response:
    handoff = _handoff(request)
    if handoff.port is None:
        raise _gone(wire_id)
    first = request.query_params.get("blocks")
    if first is not None and (not first.isascii() or not first.isdigit() or len(first) > 9 or int(first) < 1):
        raise APIError(400, "'blocks' must be a whole number >= 1 (the leading blocks wanted)",
                       "invalid_request_error", None, "blocks")
    h = handoff.lookup(wire_id, request.query_params.get("engine"))
    if h is None:
        raise _gone(wire_id)
    handoff.stats["holds_served"] += 1
    n = len(h.block_ids) if first is None else min(int(first), len(h.block_ids))
    size = n * (handoff.port.payload_bytes + OVERHEAD_BYTES)
    return StreamingResponse(handoff.serve_blocks(h, n), media_type=MEDIA_TYPE,
                             headers={"x-pagedkv-kv-blocks": str(n), "x-pagedkv-kv-bytes": str(size)})


@router.delete("/v1/kv/holds/{wire_id}")
async def release_hold(wire_id: str, request: Request) -> Response:
    handoff = _handoff(request)
    if handoff.port is None or not await handoff.release(wire_id):
        raise _gone(wire_id)
    return Response(status_code=204)


def add_kv_routes(app, handoff, check_auth) -> None:
    """The routes on a FastAPI ``app`` for ``handoff`` (a :class:`~pagedkv.server.kv_handoff.KVHandoff`);
    ``check_auth(request)`` raises the 401."""
    app.state.kv = handoff
    app.state.kv_auth = check_auth
    app.include_router(router)
