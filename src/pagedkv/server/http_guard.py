"""Read deadlines and a connection cap for the HTTP side of ``pagedkv serve`` and ``pagedkv router``.

What uvicorn (0.54, h11) does on its own: ``timeout_keep_alive`` closes a connection that stays idle *after a
response*; nothing bounds how long a client may take to send a request's headers (a new connection that sends
nothing, or headers trickled a byte at a time, stays open forever) or its body (a ``Content-Length`` that is
never completed); ``limit_concurrency`` answers 503 to a request that arrives while that many connections (or
request tasks) exist. So a slowloris client could hold any number of sockets.

:func:`uvicorn_config` builds the uvicorn config both commands use, with :class:`GuardedH11Protocol`:

* **header deadline** (``header_timeout`` seconds): a request's headers must be complete within that time of
  the connection opening, or of the previous response on a kept-alive connection. Past it the connection is
  closed; when part of a request had arrived, a ``408 Request Timeout`` is sent first.
* **body deadline** (``body_timeout`` seconds): once the headers are in, the whole body must arrive within that
  time. Past it the request ends with ``408 Request Timeout`` (JSON error body; the application sees the client
  as gone, so a request never starts on a partial body) and the connection is closed.
* **connection cap** (``max_connections``): up to that many open connections are served; a request that
  arrives on a connection beyond the cap is answered ``503 Service Unavailable`` (``connection: close``, by
  uvicorn's ``limit_concurrency``, set to the cap + 1 since it counts the connection itself) and the
  connection is closed. Connections beyond the cap are still accepted (so that they get that answer) and fall
  under the same header deadline, so the sockets open at once stay below the cap plus the connections that
  arrive within one header deadline.

Headers larger than uvicorn's h11 limit (16 KiB in all) get 400. Each timer is one ``loop.call_later`` per
connection, re-armed per request: O(1) per request. The timed-out connections are counted in
:attr:`GuardedH11Protocol.closed_by_deadline` and logged at most once a minute.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_options import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT,
                           DEFAULT_MAX_CONNECTIONS)

__all__ = ["GuardedH11Protocol", "uvicorn_config"]

log = logging.getLogger("uvicorn.error")  # (uvicorn's own lines, in its format)


def _response_408(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a body deadline (see the module docstring; the options: :mod:`.http_options`). A subclass
    sets ``header_timeout`` and ``body_timeout`` (:func:`uvicorn_config` makes one)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    #: connections closed by a deadline, by kind ("header", "body"), over every subclass (a process's total)
    closed_by_deadline: dict = {"header": 0, "body": 0}
    _last_log = [float("-inf")]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: Any = None
        self._deadline_kind: str | None = None

    # ------------------------------------------------------------------ timers
    def _arm(self, kind: str) -> None:
        self._disarm()
        seconds = self.header_timeout if kind == "header" else self.body_timeout
        self._deadline = self.loop.call_later(seconds, self._expired, kind)
        self._deadline_kind = kind

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = self._deadline_kind = None

    def _follow(self, before: Any) -> None:
        """After uvicorn handled bytes or a response: a new request whose body is still coming -> body deadline;
        a body complete (or answered) -> no deadline."""
        c = self.cycle
        if c is not None and c is not before:  # a new request's headers are complete
            if c.more_body and not c.response_complete:
                self._arm("body")
            else:
                self._disarm()
        elif self._deadline_kind == "body" and (c is None or not c.more_body or c.response_complete):
            self._disarm()

    def _expired(self, kind: str) -> None:
        self._deadline = self._deadline_kind = None
        if self.transport is None or self.transport.is_closing():
            return
        c = self.cycle
        if kind == "header":
            if c is not None and not c.response_complete:
                return  # a request is in progress: its headers came in time
            # part of a new request came (h11 buffers headers until they are complete); not the rest of the body
            # of a request already answered (e.g. a 413 sent before reading it): that connection just closes
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self.transport.write(_response_408(
                    f"the request headers were not complete within {self.header_timeout:g} s"))
        else:
            if c is None or not c.more_body or c.response_complete:
                return
            if not c.response_started:
                self.transport.write(_response_408(f"the request body was not complete within "
                                                   f"{self.body_timeout:g} s"))
            c.disconnected = True  # the application sees the client as gone
            c.message_event.set()
        self.transport.close()
        counts = GuardedH11Protocol.closed_by_deadline
        counts[kind] += 1
        now = time.monotonic()
        if now - GuardedH11Protocol._last_log[0] > 60:
            GuardedH11Protocol._last_log[0] = now
            log.warning("closed a connection whose request %s not complete within %g s (so far: %d by the "
                        "header deadline, %d by the body deadline; logged at most once a minute)",
                        "headers were" if kind == "header" else "body was",
                        self.header_timeout if kind == "header" else self.body_timeout, counts["header"],
                        counts["body"])

    # ------------------------------------------------------------------ uvicorn's protocol
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("header")

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        self._follow(before)

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.transport.is_closing():
            self._disarm()
        elif self.cycle is not before:  # a pipelined request was already waiting
            self._follow(before)
        else:
            self._arm("header")  # the next request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app: Any, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                   body_timeout: float = DEFAULT_BODY_TIMEOUT, max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
                   keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT, **kw: Any) -> Any:
    """A ``uvicorn.Config`` for ``app`` with the deadlines and the cap above (``max_connections`` None: no cap);
    other keywords go to ``uvicorn.Config``."""
    import uvicorn

    protocol = type("PagedKVH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive_timeout,
                          limit_concurrency=None if max_connections is None else max_connections + 1, **kw)
