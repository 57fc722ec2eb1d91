"""The error a server or router answers in OpenAI's shape: :class:`APIError` and :func:`error_body`, and the
builders of the 400s that :mod:`.validation`'s field checks raise (a request that is valid never calls them).

Standard library only; :mod:`.validation` (which re-exports both) and :mod:`.kv_transfer` raise it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["APIError", "error_body"]


class APIError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "code", "param"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        message, param = _printable(message), (None if param is None else _printable(param))
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def _printable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (a client's lone surrogates) as backslash escapes."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming the field at fault (``param``, as OpenAI names it)."""
    return APIError(400, message, "invalid_request_error", code, param)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a decimal"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _show(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _type_error(name: str, expected: str, v: Any) -> APIError:
    return _bad(f"Invalid type for '{name}': expected {expected}, but got {_kind(v)} instead.", name)


def _unsupported(name: str, what: str | None = None) -> APIError:
    return _bad(f"'{name}' is not supported by this server{': ' + what if what else ''}.", name,
                "unsupported_parameter")
