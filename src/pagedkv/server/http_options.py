"""The options of the client-facing HTTP side of ``pagedkv serve`` and ``pagedkv router``: read deadlines, a
connection cap, the keep-alive timeout (what they do: :mod:`pagedkv.server.http_guard`). Imports nothing heavy, so
building a parser stays cheap."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_HEADER_TIMEOUT", "DEFAULT_BODY_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_KEEP_ALIVE_TIMEOUT",
           "add_http_args", "check_http_args", "http_options"]

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's default


def add_http_args(p: Any) -> None:
    """The options of the client-facing HTTP side (``pagedkv serve``, ``pagedkv router``)."""
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                   help="a request's headers must be complete within this time of the connection opening (or of "
                        "the previous response); past it the connection is closed, with 408 if a request had "
                        f"begun (default {DEFAULT_HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help="a request's whole body must arrive within this time of its headers; past it: 408 and "
                        f"the connection closed (default {DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open client connections served at once; a request on a connection beyond gets 503 and "
                        f"the connection is closed (default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT, metavar="SECONDS",
                   help="an idle kept-alive connection is closed after this time (default "
                        f"{DEFAULT_KEEP_ALIVE_TIMEOUT:g}, uvicorn's)")


def check_http_args(args: Any) -> None:
    """ValueError (one line) unless the options of :func:`add_http_args` are in range."""
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        v = getattr(args, name)
        if not 0 < v < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {v}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")


def http_options(args: Any) -> dict:
    """The keywords of :func:`uvicorn_config` from parsed :func:`add_http_args` options."""
    return {"header_timeout": args.header_timeout, "body_timeout": args.body_timeout,
            "max_connections": args.max_connections, "keep_alive_timeout": args.keep_alive_timeout}
