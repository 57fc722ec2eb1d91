"""The error a server or router answers in OpenAI's shape: :class:`APIError` and :func:`error_body`.

Standard library only; :mod:`.validation` (which re-exports both) and :mod:`.kv_transfer` raise it.
"""

from __future__ import annotations

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
