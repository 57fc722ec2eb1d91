"""The HTTP side of a request body, before any field is read (shared by ``pagedkv serve`` and ``pagedkv
router``, re-exported by :mod:`pagedkv.server.validation`): its declared type (415), its size (413: never read past
the limit) and its JSON (400 for invalid UTF-8, invalid JSON, too deep a nesting, a top level that is not an
object). Standard library only."""

from __future__ import annotations

import json
from typing import Any

from .api_error import APIError
from .fields import _bad


# ---------------------------------------------------------------------------------------------- HTTP side
def check_content_type(value: str | None) -> None:
    """415 unless the body is declared JSON (``application/json``, ``application/*+json``) or not declared."""
    if not value:
        return
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return
    raise APIError(415, f"Unsupported Content-Type {mime[:80]!r}: send the request body as application/json",
                   "invalid_request_error", "unsupported_media_type")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes", "invalid_request_error",
                    "request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, reading at most ``limit`` bytes: 413 as soon as the declared
    ``Content-Length`` or the bytes received exceed it (the rest is never read)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _bad("Invalid Content-Length header", code="invalid_request")
        if int(declared) > limit:
            raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------- JSON
def _nonfinite(token: str) -> float:
    return float("nan") if token == "NaN" else float(token.replace("Infinity", "inf"))


def load_json(body: bytes | str) -> dict:
    """The body as a JSON object; 400 for invalid UTF-8, invalid JSON, nesting deeper than the parser's recursion
    limit, or a top level that is not an object. ``NaN``/``Infinity`` parse (as non-finite floats) so that the
    field checks can name the field."""
    try:
        data = json.loads(body, parse_constant=_nonfinite)
    except UnicodeDecodeError:
        raise _bad("The request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise _bad("The request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:
        why = "a number has too many digits" if "integer string conversion" in str(e) else str(e)[:200]
        raise _bad(f"We could not parse the JSON body of your request: {why}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object", code="invalid_json")
    return data

