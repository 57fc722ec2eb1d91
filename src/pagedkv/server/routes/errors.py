"""Every error ``pagedkv serve`` answers, in OpenAI's shape: :class:`~pagedkv.server.validation.APIError` as it
says, an unknown route as 404, anything else as a 500 (a server bug, never a client's mistake)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..validation import APIError, error_body

__all__ = ["ErrorResponse", "error_response", "install_error_handlers"]


class ErrorResponse(JSONResponse):
    """JSON with ASCII escapes: an error message may quote the client's text, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(status: int, message: str, type: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return ErrorResponse(error_body(message, type, code, param), status_code=status)


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return ErrorResponse(e.body(), status_code=e.status)


async def _bug(_: Request, e: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(e).__name__}", "server_error")


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), kind)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _bug)
    app.add_exception_handler(StarletteHTTPException, _http_error)
