"""Health checks out of the access log: a router checks every replica's ``GET /health`` every second, and those
lines would bury the requests in uvicorn's access log. :func:`quiet_health_access_log` drops exactly them (the
rest of the log is unchanged); ``pagedkv serve`` and ``pagedkv router`` call it before serving."""

from __future__ import annotations

import logging

__all__ = ["quiet_health_access_log"]


class _NoHealthLines(logging.Filter):
    """Drops uvicorn's access-log records of ``/health`` (its arguments: client, method, path, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and args[2] == "/health")


def quiet_health_access_log() -> None:
    """Install the filter on the ``uvicorn.access`` logger (idempotent; it survives uvicorn's logging set-up)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _NoHealthLines) for f in access.filters):
        access.addFilter(_NoHealthLines())
