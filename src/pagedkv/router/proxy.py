"""One proxied request, from the routing decision to the last byte, with every failure answered.

:meth:`Proxy.respond` returns an ASGI response whose call does the whole exchange while watching the client:

::

    choose a replica ──> send (stream) ──> headers ──> relay (SSE event by event, or the JSON body at once)
       ^                   │ failed before any answer             │ replica lost / silent too long
       └── another one ────┘ (once per replica; 503 too)          └─> SSE: an error event ends the stream
                                                                      JSON: 502 / 504 in OpenAI's error shape
    client hangs up at any point ──> the exchange is cancelled: the upstream connection is closed, which makes
                                     the replica abort the request (it watches its client, as ``pagedkv serve``)

- **Retries**: a replica that fails before answering (connection refused, reset, closed without an answer, its
  connection cap full) or answers 503 gets the request sent to another replica, at most once per replica, one
  log line each. Connection refused also takes it out of routing at once. Nothing was sent to the client yet.
- **Failures after the answer began** are never silent: a stream gets ``data: {"error": {...}}`` (OpenAI's error
  shape, ``code: "replica_failed"`` or ``"replica_timeout"``) in place of its ``data: [DONE]``; events are
  relayed whole (cut at ``\\n\\n``), so the error event never lands inside a half-sent one. A stream that ends
  cleanly without ``[DONE]`` nor an error event gets one too. A JSON answer is read whole before anything is
  sent, so its failure is a 502 (504 on a read timeout).
- **Bookkeeping** (``state.done``: in-flight count, load, pending prompt) runs in a ``finally`` for every
  attempt, before anything that can wait, whatever ends it (error, cancellation, bug).
- **Upstream limits** (:class:`UpstreamOptions`): connect, read (seconds without a byte from the replica),
  write and pool timeouts, and a cap on the connections to each replica (one ``httpx.AsyncClient`` per replica).

Cost: the relay holds at most one partial SSE event per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from starlette.responses import Response

from ..server.validation import error_body

__all__ = ["Proxy", "UpstreamOptions"]

log = logging.getLogger("pagedkv.router")


@dataclass(frozen=True)
class UpstreamOptions:
    """How the router talks to its replicas.

    ``read_timeout``: seconds a replica may stay silent (before its answer, or between two chunks of a stream);
    ``max_connections``: connections to one replica at once (requests beyond wait ``pool_timeout`` seconds for
    one, then go to another replica or get 503); ``api_key``: sent as ``Authorization: Bearer`` to the replicas
    (None: the client's own ``Authorization`` header is forwarded).
    """

    connect_timeout: float = 2.0
    read_timeout: float = 300.0
    write_timeout: float = 30.0
    pool_timeout: float = 5.0
    max_connections: int = 256
    api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "write_timeout", "pool_timeout"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds, got {v!r}")
        if not (isinstance(self.max_connections, int) and self.max_connections >= 1):
            raise ValueError(f"max_connections must be an int >= 1, got {self.max_connections!r}")


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, "server_error", code)).encode() + b"\n\n"


def _last_event(data: bytes) -> bytes:
    """The last complete SSE event of ``data`` (which ends with a blank line), stripped."""
    return data.rstrip(b"\r\n").rsplit(b"\n\n", 1)[-1].strip()


def _no_prefill_message(tried: int, roles: tuple) -> str:
    """The log line of a split request no prefill replica answered: what happened and where it goes instead."""
    where = ("a colocated replica (--kv-role both)" if roles == ("both",) else
             "a decode replica (no colocated replica is up): it computes the prompt itself")
    return (f"no prefill replica answered ({tried} tried: down, failed or refused the request): the prompt is "
            f"computed whole on {where}")


def _ends_stream(event: bytes) -> bool:
    return event == b"data: [DONE]" or event.startswith(b'data: {"error"')


class _Exchange(Response):
    """The ASGI response of one proxied request (see the module docstring)."""

    def __init__(self, proxy: "Proxy", path: str, body: bytes, headers: dict, prompt) -> None:  # noqa: D107
        # (Response's own fields are not used: this response writes its status, headers and body itself)
        self.proxy, self.path, self.body_out, self.headers_out, self.prompt = proxy, path, body, headers, prompt
        self.background = None  # FastAPI may attach its background tasks here
        self.roles = None  # the replica roles this exchange may go to (RouterState.choose; None: plain)
        self.num_tokens = len(prompt.token_ids)  # the prompt tokens the chosen replica computes
        self.extra_headers: list = []
        self.answered_by: str | None = None  # the replica whose answer was relayed (or began to be)

    async def __call__(self, scope, receive, send) -> None:
        ended = False  # the answer's last byte was handed to the server

        async def sending(message) -> None:
            nonlocal ended
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True

        work = asyncio.ensure_future(self._run(sending))
        watch = asyncio.ensure_future(self._until_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done and ended:  # (the server reports a disconnect once the answer is complete: the
                await work  # exchange finishes its bookkeeping; not a hang-up)
            elif work not in done:  # the client hung up first: stop the exchange (closes the upstream)
                self.proxy.metrics.client_disconnects += 1
                work.cancel()
                try:
                    await work
                except asyncio.CancelledError:
                    pass
            else:
                work.result()  # a bug: let the app's handler answer it
        finally:
            watch.cancel()
            if not work.done():  # we are cancelled ourselves (shutdown): the exchange's finally cleans up
                work.cancel()
        if self.background is not None:
            await self.background()

    @staticmethod
    async def _until_disconnect(receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _run(self, send) -> None:
        import httpx

        p, prompt = self.proxy, self.prompt
        state = p.state
        tried: set = set()
        while True:
            choice = await self._choose(tried)
            if choice is None:
                await self._no_replica()
                await _send_json(send, 503, error_body("no replica is available", "server_overloaded", "no_replica"))
                return
            url, predicted, load = choice
            tried.add(url)
            resp = None
            try:
                client = p.client(url)
                try:
                    resp = await client.send(client.build_request("POST", url + self.path, content=self.body_out,
                                                                  headers=self.headers_out), stream=True)
                except httpx.PoolTimeout:
                    p.metrics.pool_timeouts += 1
                    p.retry(url, f"its {p.options.max_connections} connections stayed busy "
                                 f"{p.options.pool_timeout:g} s")
                    continue
                except (httpx.ReadTimeout, httpx.WriteTimeout) as e:  # it took the request and went silent
                    p.metrics.upstream_timeouts += 1
                    log.warning("replica %s sent no answer within %g s (%s): 504", url, p.options.read_timeout,
                                type(e).__name__)
                    await _send_json(send, 504, error_body(
                        f"the replica did not answer within {p.options.read_timeout:g} s", "server_error",
                        "replica_timeout"))
                    return
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    # (in a thread: leaving routing clears its blocks from the index, which may be Redis)
                    await asyncio.to_thread(state.mark, url, False, f"connection failed: {type(e).__name__}")
                    p.retry(url, f"connection failed ({type(e).__name__})")
                    continue
                except httpx.TransportError as e:  # reset or closed before any answer: nothing was sent back
                    p.retry(url, f"no answer ({type(e).__name__}: {e})")
                    continue
                if resp.status_code == 503 and state.routable(tried, self.roles or state.plain_roles):
                    await resp.aread()
                    p.retry(url, "it answered 503")
                    continue
                self.answered_by = url
                extra = [(b"x-pagedkv-replica", url.encode()),
                         (b"x-pagedkv-predicted-cached-tokens", str(predicted).encode()), *self.extra_headers]
                ctype = resp.headers.get("content-type", "application/json")
                if ctype.startswith("text/event-stream"):
                    await self._relay_stream(resp, send, url, ctype, extra)
                else:
                    await self._relay_body(resp, send, url, ctype, extra)
                return
            finally:
                state.done(url, load, prompt.hashes)  # first, and synchronous: nothing can skip it
                if resp is not None:
                    await _close(resp)

    async def _no_replica(self) -> None:
        """Called before the 503 when no replica can take the request (a hook for the split's hold)."""

    async def _choose(self, tried: set):
        """``state.choose`` in a thread (the index may be Redis). If this request is cancelled meanwhile, the
        decision still completes in its thread and is then undone, so that it leaves no load behind."""
        state, prompt = self.proxy.state, self.prompt
        fut = asyncio.ensure_future(asyncio.to_thread(state.choose, prompt.hashes, self.num_tokens, tried,
                                                      self.roles))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def undo(f) -> None:
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    url, _, load = f.result()
                    state.done(url, load, prompt.hashes)

            fut.add_done_callback(undo)
            raise

    async def _relay_body(self, resp, send, url: str, ctype: str, extra: list) -> None:
        import httpx

        try:
            content = await resp.aread()
        except httpx.TimeoutException:
            self.proxy.metrics.upstream_timeouts += 1
            log.warning("replica %s went silent for %g s mid-answer: 504", url, self.proxy.options.read_timeout)
            await _send_json(send, 504, error_body(
                f"the replica did not finish its answer within {self.proxy.options.read_timeout:g} s",
                "server_error", "replica_timeout"))
            return
        except httpx.HTTPError as e:
            self.proxy.metrics.upstream_failures += 1
            log.warning("replica %s failed mid-answer (%s): 502", url, type(e).__name__)
            await _send_json(send, 502, error_body(
                f"the replica failed before finishing its answer ({type(e).__name__})", "server_error",
                "replica_failed"))
            return
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(content)).encode()), *extra]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})

    async def _relay_stream(self, resp, send, url: str, ctype: str, extra: list) -> None:
        import httpx

        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [(b"content-type", ctype.encode()), (b"cache-control", b"no-cache"), *extra]})
        buf, last, failure = b"", b"", None
        try:
            async for chunk in resp.aiter_raw():
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut >= 0:
                    out, buf = buf[: cut + 2], buf[cut + 2:]
                    last = _last_event(out)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except httpx.HTTPError as e:
            failure = e
        if failure is None and buf.strip():  # a last event without its blank line: pass it on as it is
            last = buf.strip()
            await send({"type": "http.response.body", "body": buf + b"\n\n", "more_body": True})
        if failure is not None or not _ends_stream(last):
            m = self.proxy.metrics
            if isinstance(failure, httpx.TimeoutException):
                m.upstream_timeouts += 1
                code = "replica_timeout"
                why = f"sent nothing for {self.proxy.options.read_timeout:g} s"
            else:
                m.upstream_failures += 1
                code = "replica_failed"
                why = (f"connection lost: {type(failure).__name__}" if failure is not None
                       else "its stream ended without [DONE]")
            log.warning("replica %s failed mid-stream (%s): the client gets an error event", url, why)
            await send({"type": "http.response.body", "more_body": True, "body": _sse_error(
                f"the replica serving this request failed before finishing it ({why}); the output is incomplete",
                code)})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _AsIs(NamedTuple):
    """An upstream answer relayed to the client as it is."""

    status: int
    ctype: str
    content: bytes


class _SplitExchange(_Exchange):
    """One request through a prefill/decode split (docs/pd-split.md)::

        prefill replica (by prefix) ──> JSON answer with kv_transfer_params ──> decode replica (least busy)
           │ fails before answering: the next prefill replica                     │ relayed as in _Exchange:
           │ none left / a 5xx / silent: recompute on a colocated or decode       │ streamed, retried before
           │   replica (the request without kv_transfer_params)                   │ its answer, an error event
           └ a 4xx: the client's own mistake, answered as it is                   └ if lost mid-stream

    The prefill step's body is the client's with ``max_tokens`` 1, not streamed, and ``do_remote_decode``
    (:func:`pagedkv.server.kv_transfer.prefill_body`); its answer's ``kv_transfer_params`` (validated; null or
    malformed: the decode replica computes the whole prompt) go into the decode step's body. When no decode replica
    takes the request, the router releases the hold itself (``DELETE`` on the prefill replica)."""

    def __init__(self, proxy: "Proxy", path: str, body: bytes, headers: dict, prompt, doc: dict) -> None:
        super().__init__(proxy, path, body, headers, prompt)
        self.doc = doc  # the client's body, parsed (the app validated it)

    async def _run(self, send) -> None:
        from ..server.kv_transfer import prefill_body

        p, state = self.proxy, self.proxy.state
        outcome = await self._prefill(json.dumps(prefill_body(self.doc)).encode())
        if isinstance(outcome, _AsIs):  # the client's mistake: the prefill replica's 4xx as it is
            status, ctype, content = outcome
            p.metrics.pd_client_errors += 1
            head = [(b"content-type", ctype.encode()), (b"content-length", str(len(content)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": content, "more_body": False})
            return
        doc = dict(self.doc)
        doc.pop("kv_transfer_params", None)
        if outcome is None:  # no prefill replica answered: computed whole on a colocated (or decode) replica
            p.metrics.pd_recomputes += 1
            self.roles = state.plain_roles
        else:
            prefill_url, kvt = outcome
            self.extra_headers = [(b"x-pagedkv-prefill-replica", prefill_url.encode())]
            self.roles = ("decode",)
            if kvt is not None:
                doc["kv_transfer_params"] = kvt.to_json()
                self.num_tokens = max(1, len(self.prompt.token_ids) - kvt.remote_num_tokens)
        self.body_out = json.dumps(doc).encode()
        self._hold = outcome[1] if outcome is not None else None
        try:
            await super()._run(send)
        finally:
            if self._hold is not None and self.answered_by is None:  # (a decode replica that took the request
                await self._no_replica()  # releases the hold itself once it has read the blocks)

    async def _no_replica(self) -> None:
        if getattr(self, "_hold", None) is not None:
            hold, self._hold = self._hold, None
            await self._release(hold)

    async def _prefill(self, body: bytes):
        """``(prefill url, KVTransferParams or None)``; an :class:`_AsIs` answer for the client (a 4xx); None when
        no prefill replica answered (the caller recomputes)."""
        import httpx

        from ..server.kv_transfer import parse_kv_transfer_params
        from ..server.validation import APIError

        p, state, prompt = self.proxy, self.proxy.state, self.prompt
        tried: set = set()
        while True:
            self.roles = ("prefill",)
            choice = await self._choose(tried)
            if choice is None:
                if tried:
                    log.warning("%s", _no_prefill_message(len(tried), state.plain_roles))
                return None
            url, _, load = choice
            tried.add(url)
            try:
                client = p.client(url)
                try:
                    resp = await client.post(url + self.path, content=body, headers=self.headers_out)
                except httpx.PoolTimeout:
                    p.metrics.pool_timeouts += 1
                    p.retry(url, "its connections stayed busy (prefill)")
                    continue
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    await asyncio.to_thread(state.mark, url, False, f"connection failed: {type(e).__name__}")
                    p.retry(url, f"connection failed ({type(e).__name__}) (prefill)")
                    continue
                except httpx.TimeoutException:
                    p.metrics.upstream_timeouts += 1
                    log.warning("prefill replica %s silent for %g s: the request is computed whole elsewhere", url,
                                p.options.read_timeout)
                    return None
                except httpx.TransportError as e:
                    p.metrics.pd_prefill_failures += 1
                    p.retry(url, f"no answer ({type(e).__name__}) (prefill)")
                    continue
            finally:
                state.done(url, load, prompt.hashes)
            ctype = resp.headers.get("content-type", "application/json")
            if 400 <= resp.status_code < 500 and resp.status_code != 408 and not _replica_refusal(resp):
                return _AsIs(resp.status_code, ctype, resp.content)
            if resp.status_code != 200:
                p.metrics.pd_prefill_failures += 1
                p.retry(url, f"it answered {resp.status_code} (prefill)")
                continue
            try:
                raw = resp.json().get("kv_transfer_params")
                kvt = parse_kv_transfer_params(raw)
                if kvt is not None and not kvt.do_remote_prefill:
                    raise APIError(400, "not a prefill's answer")
            except (ValueError, AttributeError, APIError) as e:
                log.warning("prefill replica %s answered unusable kv_transfer_params (%s): the decode replica "
                            "computes the whole prompt", url, e)
                kvt = None
            return url, kvt

    async def _release(self, kvt) -> None:
        """Free a hold no decode replica took (bounded; its lease ends it otherwise)."""
        import httpx

        p = self.proxy
        url = f"{kvt.base_url}/v1/kv/holds/{kvt.remote_request_id}"
        try:
            await asyncio.shield(p.client(kvt.base_url).delete(url, headers=self.headers_out))
            p.metrics.pd_holds_released += 1
        except (httpx.HTTPError, asyncio.CancelledError, OSError) as e:
            log.warning("releasing hold %s on %s failed (%s): its lease will end it", kvt.remote_request_id,
                        kvt.base_url, type(e).__name__)


def _replica_refusal(resp) -> bool:
    """A prefill replica's 400 that says it cannot take the split (misconfigured), not that the request is bad."""
    if resp.status_code != 400:
        return False
    try:
        code = resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return code in ("kv_role_mismatch", "kv_transfer_unavailable")


async def _close(resp) -> None:
    """Close an upstream answer even while being cancelled (closing an unfinished one closes its connection,
    which the replica sees as its client leaving)."""
    try:
        await asyncio.shield(resp.aclose())
    except Exception:  # noqa: BLE001 - the connection is gone either way
        pass


async def _send_json(send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Proxy:
    """The upstream side of the router: one ``httpx.AsyncClient`` per replica (made on first use, in the
    serving event loop) and :meth:`respond`."""

    def __init__(self, state, metrics, options: UpstreamOptions | None = None) -> None:
        self.state, self.metrics = state, metrics
        self.options = options or UpstreamOptions()
        self._clients: dict[str, Any] = {}

    def client(self, url: str):
        c = self._clients.get(url)
        if c is None:
            import httpx

            o = self.options
            c = self._clients[url] = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=o.connect_timeout, read=o.read_timeout, write=o.write_timeout,
                                      pool=o.pool_timeout),
                limits=httpx.Limits(max_connections=o.max_connections,
                                    max_keepalive_connections=min(o.max_connections, 64)))
        return c

    def retry(self, url: str, why: str) -> None:
        self.metrics.retries += 1
        log.warning("retrying a request on another replica: %s %s", url, why)

    def upstream_headers(self, request_headers) -> dict:
        h = {"content-type": "application/json"}
        if self.options.api_key is not None:
            h["authorization"] = f"Bearer {self.options.api_key}"
        elif "authorization" in request_headers:
            h["authorization"] = request_headers["authorization"]
        return h

    def respond(self, path: str, body: bytes, request_headers, prompt) -> _Exchange:
        """The response of a validated request (``prompt``: its :class:`~.prompt.RoutedPrompt`): through the
        prefill/decode split when the router has both roles (:class:`_SplitExchange`), else to one replica. A
        request with ``n`` > 1 skips the split (a hold hands one sequence's blocks to one decode request): it is
        computed whole on a colocated replica, or a decode replica when there is none (docs/pd-split.md)."""
        headers = self.upstream_headers(request_headers)
        if self.state.split:
            from ..server.validation import load_json

            doc = load_json(body)
            if doc.get("n") in (None, 1):
                return _SplitExchange(self, path, body, headers, prompt, doc)
        return _Exchange(self, path, body, headers, prompt)
