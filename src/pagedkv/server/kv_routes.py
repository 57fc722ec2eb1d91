"""The prefill replica's routes of a prefill/decode split: a hold's blocks read, and released (see
:mod:`pagedkv.server.kv_handoff`)."""

# (no `from __future__ import annotations`: FastAPI reads the handlers' annotations, imported locally)


__all__ = ["add_kv_routes"]


def add_kv_routes(app, handoff, check_auth) -> None:
    """``GET`` and ``DELETE /v1/kv/holds/{id}`` on a FastAPI ``app`` for ``handoff`` (a
    :class:`~.kv_handoff.KVHandoff`); ``check_auth(request)`` raises the 401. ``GET ...?blocks=K`` sends only the
    hold's first K blocks (a decode replica whose staging budget takes fewer than all)."""
    from fastapi import Request
    from fastapi.responses import Response, StreamingResponse

    from ..tiers.codec import OVERHEAD_BYTES
    from .kv_wire import MEDIA_TYPE
    from .validation import APIError

    def gone(wire_id: str) -> APIError:
        return APIError(404, f"no KV hold {wire_id[:64]!r} here (unknown, released, or past its lease)",
                        "not_found_error", "unknown_hold", None)

    @app.get("/v1/kv/holds/{wire_id}")
    async def read_hold(wire_id: str, request: Request) -> Response:
        check_auth(request)
        if handoff.port is None:
            raise gone(wire_id)
        first = request.query_params.get("blocks")
        if first is not None and (not first.isascii() or not first.isdigit() or len(first) > 9 or int(first) < 1):
            raise APIError(400, "'blocks' must be a whole number >= 1 (the leading blocks wanted)",
                           "invalid_request_error", None, "blocks")
        h = handoff.lookup(wire_id, request.query_params.get("engine"))
        if h is None:
            raise gone(wire_id)
        handoff.stats["holds_served"] += 1
        n = len(h.block_ids) if first is None else min(int(first), len(h.block_ids))
        size = n * (handoff.port.payload_bytes + OVERHEAD_BYTES)
        return StreamingResponse(handoff.serve_blocks(h, n), media_type=MEDIA_TYPE,
                                 headers={"x-pagedkv-kv-blocks": str(n), "x-pagedkv-kv-bytes": str(size)})

    @app.delete("/v1/kv/holds/{wire_id}")
    async def release_hold(wire_id: str, request: Request) -> Response:
        check_auth(request)
        if handoff.port is None or not await handoff.release(wire_id):
            raise gone(wire_id)
        return Response(status_code=204)
