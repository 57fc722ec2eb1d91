"""The router's HTTP side: the OpenAI-compatible routes of ``pagedkv serve``, proxied to the chosen replica.

``POST /v1/completions`` and ``POST /v1/chat/completions``: the body (at most ``max_body_bytes``: 413 beyond)
is parsed and validated by the server's own request parser and tokenized as a replica would (:mod:`.prompt`; a
bad body gets the replica's 4xx without reaching one), routed (:meth:`RouterState.choose`) and forwarded
unchanged (:mod:`.proxy`: retries, timeouts, error events, aborts when the client leaves); the answer comes
back unchanged with two extra headers, ``x-pagedkv-replica`` and ``x-pagedkv-predicted-cached-tokens``.

With an API key every ``/v1`` route needs ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and
``/metrics`` stay open, as on the replicas.

``GET /v1/models``, and vLLM's ``POST /tokenize`` and ``POST /detokenize`` (validated here first; open without
the key, as on the replicas), are answered by a healthy replica; ``GET /metrics`` is the router's own
(:mod:`.metrics`); ``GET /health`` is 200 while a replica is routable (503 otherwise) with a JSON body::

    {"status": "ok" | "degraded" | "unavailable",
     "replicas": {"healthy": 2, "total": 3},
     "index": {"ok": false, "stale_seconds": 4.2, "error": "..."},      # stale: Redis unreachable
     "events": {"subscriber": "running" | "stopped" | "off", "bad_payloads": 0}}

``degraded``: still routing, but the index is stale, the event subscriber stopped, or a replica is down.

:class:`RouterServer` assembles everything (state, event subscriber, health checker, app) and runs it.
"""

# (no `from __future__ import annotations`: FastAPI reads the handlers' annotations, imported locally)

import asyncio
import hmac
import logging
from typing import Any

from .._cli_config import ServiceConfig

__all__ = ["build_app", "RouterServer", "DEFAULT_MAX_BODY_BYTES"]

DEFAULT_MAX_BODY_BYTES = ServiceConfig.max_body_bytes  # --max-body-bytes' default, pagedkv serve's too
log = logging.getLogger("pagedkv.router")


def _error(status: int, message: str, type: str, code: str | None = None, param: str | None = None):
    from fastapi.responses import JSONResponse

    from ..server.validation import error_body

    return JSONResponse(error_body(message, type, code, param), status_code=status)


def health_report(state) -> dict:
    """The body of ``GET /health`` (see the module docstring)."""
    healthy = len(state.routable())
    sub = state.subscriber
    events = {"subscriber": "off" if sub is None else ("running" if sub.alive else "stopped"),
              "bad_payloads": 0 if sub is None else sub.bad_payloads}
    index = {"ok": state.index_ok, "stale_seconds": round(state.index_stale_seconds, 3),
             "error": None if state.index_ok else state.index_error}
    status = "unavailable" if not healthy else (
        "ok" if state.index_ok and events["subscriber"] != "stopped" and healthy == len(state.replicas)
        else "degraded")
    return {"status": status, "replicas": {"healthy": healthy, "total": len(state.replicas)}, "index": index,
            "events": events}


def build_app(state, builder, metrics, proxy=None, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI application over ``state`` (:class:`~.state.RouterState`), ``builder``
    (:class:`~.prompt.PromptBuilder`), ``metrics`` (:class:`~.metrics.RouterMetrics`) and ``proxy``
    (:class:`~.proxy.Proxy`; default options when None)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from ..server.validation import APIError
    from ..server.tokenization import parse_detokenize, parse_tokenize
    from ..server.validation import Limits, check_content_type, read_body
    from .proxy import Proxy

    if proxy is None:
        proxy = Proxy(state, metrics)
    app = FastAPI(title="pagedkv router", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("router bug: %s", type(e).__name__)
        return _error(500, f"internal error in the router: {type(e).__name__}", "server_error")

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    async def route(kind: str, path: str, request: Request) -> Response:
        check_auth(request)
        check_content_type(request.headers.get("content-type"))  # 415, as a replica answers
        body = await read_body(request, max_body_bytes)  # 413
        prompt = await asyncio.to_thread(builder.build, kind, body)  # APIError: the server's 4xx
        return proxy.respond(path, body, request.headers, prompt)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("completions", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route("chat", "/v1/chat/completions", request)

    async def any_replica(method: str, path: str, headers: dict, body: bytes | None = None) -> Response:
        """The answer of the first healthy replica that answers at all, relayed as it is (503 when none)."""
        import httpx

        for url in state.routable():
            try:
                r = await proxy.client(url).request(method, url + path, content=body, headers=headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return _error(503, "no replica is available", "server_overloaded", "no_replica")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        headers = {k: v for k, v in proxy.upstream_headers(request.headers).items() if k == "authorization"}
        return await any_replica("GET", "/v1/models", headers)

    # (the replicas' vocabulary is the router's tokenizer's: a bad token id gets the replica's own 400 here)
    tok_limits = Limits(max_body_bytes=max_body_bytes, vocab_size=getattr(builder.tokenizer, "vocab_size", None))

    async def tokenizer_route(path: str, parse, request: Request) -> Response:
        # (open without the key, as on the replicas and in vLLM; a bad body is refused here, as a replica would)
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, max_body_bytes)
        await asyncio.to_thread(parse, body, tok_limits)
        return await any_replica("POST", path, proxy.upstream_headers(request.headers), body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await tokenizer_route("/tokenize", parse_tokenize, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await tokenizer_route("/detokenize", parse_detokenize, request)

    @app.get("/health")
    async def health() -> Response:
        report = health_report(state)
        if report["status"] != "unavailable":
            return JSONResponse(report)
        from ..server.validation import error_body

        return JSONResponse({**error_body("no replica is available", "server_error", "no_replica"), **report},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        from .metrics import CONTENT_TYPE

        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return app


class RouterServer:
    """State + event subscriber + health checker + app; :meth:`run` in the foreground or
    :meth:`start_in_thread` (tests). ``upstream``: :class:`~.proxy.UpstreamOptions`."""

    def __init__(self, state, builder, *, host: str = "127.0.0.1", port: int = 8080, topic: str = "kv-events",
                 health_interval: float = 1.0, health_timeout: float = 3.0, health_fails: int = 3,
                 api_key: str | None = None, upstream=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 model_names: tuple[str, ...] = (), http: dict | None = None) -> None:
        from .health import HealthChecker
        from .metrics import RouterMetrics
        from .proxy import Proxy

        self.state, self.builder = state, builder
        self.host, self.port = host, port
        self.http = http  # read deadlines and connection cap (pagedkv.server.http_guard.uvicorn_config)
        self.metrics = RouterMetrics(state)
        self.proxy = Proxy(state, self.metrics, upstream)
        self.app = build_app(state, builder, self.metrics, self.proxy, api_key=api_key,
                             max_body_bytes=max_body_bytes)
        feeds = {u: (r.events, r.replay) for u, r in state.replicas.items() if r.events}
        self.subscriber = None
        if feeds:
            from .events import EventSubscriber

            idx = state.index
            self.subscriber = EventSubscriber(
                feeds, state.apply_events, state.clear_replica, topic=topic,
                start_seq=(lambda r: (idx.get_seq(r) + 1) if idx.get_seq(r) is not None else 0)
                if hasattr(idx, "get_seq") else None,
                applied=idx.set_seq if hasattr(idx, "set_seq") else None, health=state)
            state.subscriber = self.subscriber
        self.health = HealthChecker(state, health_interval, health_timeout, health_fails, model_names=model_names,
                                    api_key=getattr(upstream, "api_key", None))
        self._uvicorn = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _start_background(self) -> None:
        self.health.check_once()
        if self.subscriber is not None:
            self.subscriber.start()
        self.health.start()

    def start_in_thread(self, timeout: float = 30.0) -> "RouterServer":
        from ..server.launch import serve_in_thread

        self._start_background()
        self._uvicorn, self._thread, self.port = serve_in_thread(self.app, self.host, self.port,
                                                                 "pagedkv-router-uvicorn", timeout, self.http)
        return self

    def run(self) -> None:
        import uvicorn

        from ..server.access_log import quiet_health_access_log
        from ..server.http_guard import uvicorn_config

        self._start_background()
        quiet_health_access_log()
        try:
            uvicorn.Server(uvicorn_config(self.app, host=self.host, port=self.port, log_level="info",
                                          lifespan="off", timeout_graceful_shutdown=5, **(self.http or {}))).run()
        finally:
            self.close()

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(10)
        self.health.close()
        if self.subscriber is not None:
            self.subscriber.close()
