"""The router's HTTP side: the OpenAI-compatible routes of ``pagedkv serve``, proxied to the chosen replica.

``POST /v1/completions`` and ``POST /v1/chat/completions``: the body is parsed and tokenized as a replica would
(:mod:`.prompt`; a bad body gets the replica's 400 without reaching one), routed (:meth:`RouterState.choose`),
and forwarded unchanged with its ``Authorization`` header; the answer (JSON, or Server-Sent Events streamed
chunk by chunk) comes back unchanged with two extra headers, ``x-pagedkv-replica`` and
``x-pagedkv-predicted-cached-tokens``. A request that a replica could not take before it started (connection
refused or reset before an answer, or a 503) is sent to another replica (at most once per replica); a replica
that refuses connections leaves routing until its health checks pass. When no replica is left: 503.

``GET /v1/models`` is answered by a healthy replica; ``GET /health`` is 200 while a replica is routable (503
otherwise); ``GET /metrics`` is the router's own (:mod:`.metrics`).

:class:`RouterServer` assembles everything (state, event subscriber, health checker, app) and runs it.
"""

# (no `from __future__ import annotations`: FastAPI reads the handlers' annotations, imported locally)

import asyncio
import threading
from typing import Any

__all__ = ["build_app", "RouterServer"]


def _error(status: int, message: str, type: str, code: str | None = None):
    from fastapi.responses import JSONResponse

    from ..server.protocol import error_body

    return JSONResponse(error_body(message, type, code), status_code=status)


def build_app(state, builder, metrics):
    """The FastAPI application over ``state`` (:class:`~.state.RouterState`), ``builder``
    (:class:`~.prompt.PromptBuilder`) and ``metrics`` (:class:`~.metrics.RouterMetrics`)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from ..server.protocol import APIError

    app = FastAPI(title="pagedkv router", docs_url=None, redoc_url=None, openapi_url=None)
    holder: dict[str, Any] = {}

    def client() -> httpx.AsyncClient:
        c = holder.get("client")
        if c is None:
            c = holder["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0),
                                                     limits=httpx.Limits(max_connections=None,
                                                                         max_keepalive_connections=64))
        return c

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        return _error(500, f"internal error in the router: {type(e).__name__}", "server_error")

    def forward_headers(request: Request) -> dict:
        h = {"content-type": "application/json"}
        if "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        return h

    async def proxy(kind: str, path: str, request: Request) -> Response:
        body = await request.body()
        try:
            prompt = await asyncio.to_thread(builder.build, kind, body)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        tried: set = set()
        headers = forward_headers(request)
        while True:
            choice = await asyncio.to_thread(state.choose, prompt.hashes, len(prompt.token_ids), tried)
            if choice is None:
                return _error(503, "no replica is available", "server_overloaded", "no_replica")
            url, predicted, load = choice
            tried.add(url)
            try:
                resp = await client().send(client().build_request("POST", url + path, content=body,
                                                                  headers=headers), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
                # nothing reached the engine: the request has not started; the replica is down
                del e
                state.done(url, load, prompt.hashes)
                state.mark(url, False)
                metrics.retries += 1
                continue
            if resp.status_code == 503:  # full or dead: not started there; another replica may take it
                await resp.aread()
                await resp.aclose()
                state.done(url, load, prompt.hashes)
                if state.routable(tried):
                    metrics.retries += 1
                    continue
                return Response(resp.content, status_code=503, media_type=resp.headers.get("content-type"))

            finished = []

            async def finish(resp=resp, url=url, load=load) -> None:
                """Close the upstream answer and end the request's load, once (after the relay, or as the
                response's background task when a client left before the relay started)."""
                if not finished:
                    finished.append(True)
                    await resp.aclose()
                    state.done(url, load, prompt.hashes)

            async def relay(resp=resp):
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                except httpx.HTTPError:
                    pass  # the replica died mid-answer: the client sees the stream end
                finally:
                    await finish()

            out = {"x-pagedkv-replica": url, "x-pagedkv-predicted-cached-tokens": str(predicted)}
            return StreamingResponse(relay(), status_code=resp.status_code, headers=out,
                                     media_type=resp.headers.get("content-type"), background=BackgroundTask(finish))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy("completions", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy("chat", "/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in forward_headers(request).items() if k == "authorization"}
        for url in state.routable():
            try:
                r = await client().get(url + "/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return _error(503, "no replica is available", "server_overloaded", "no_replica")

    @app.get("/health")
    async def health() -> Response:
        if state.routable():
            return Response(status_code=200)
        return _error(503, "no replica is available", "server_error", "no_replica")

    @app.get("/metrics")
    async def prometheus() -> Response:
        from .metrics import CONTENT_TYPE

        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    return app


class HealthChecker:
    """Polls ``GET /health`` of every replica every ``interval`` seconds on its own thread; a replica that
    fails ``fails`` checks in a row (no answer within ``timeout`` seconds, or not 200) leaves routing (and the
    index), one that answers 200 comes back. A busy replica on a saturated CPU can take a second to answer:
    the defaults (3 checks of 3 s) keep it in."""

    def __init__(self, state, interval: float = 1.0, timeout: float = 3.0, fails: int = 3) -> None:
        self.state, self.interval, self.timeout, self.fails = state, interval, timeout, fails
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-router-health", daemon=True)

    def start(self) -> "HealthChecker":
        self._thread.start()
        return self

    def check_once(self) -> None:
        import httpx

        for url, r in list(self.state.replicas.items()):
            try:
                ok = httpx.get(url + "/health", timeout=self.timeout).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                self.state.mark(url, True)
            elif r.failures + 1 >= self.fails or not r.healthy:
                self.state.mark(url, False)
            else:
                r.failures += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check_once()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class RouterServer:
    """State + event subscriber + health checker + app; :meth:`run` in the foreground or
    :meth:`start_in_thread` (tests)."""

    def __init__(self, state, builder, *, host: str = "127.0.0.1", port: int = 8080, topic: str = "kv-events",
                 health_interval: float = 1.0, health_timeout: float = 3.0, health_fails: int = 3) -> None:
        from .metrics import RouterMetrics

        self.state, self.builder = state, builder
        self.host, self.port = host, port
        self.metrics = RouterMetrics(state)
        self.app = build_app(state, builder, self.metrics)
        feeds = {u: (r.events, r.replay) for u, r in state.replicas.items() if r.events}
        self.subscriber = None
        if feeds:
            from .events import EventSubscriber

            idx = state.index
            self.subscriber = EventSubscriber(
                feeds, state.apply_events, state.clear_replica, topic=topic,
                start_seq=(lambda r: (idx.get_seq(r) + 1) if idx.get_seq(r) is not None else 0)
                if hasattr(idx, "get_seq") else None,
                applied=idx.set_seq if hasattr(idx, "set_seq") else None)
            state.subscriber = self.subscriber
        self.health = HealthChecker(state, health_interval, health_timeout, health_fails)
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
                                                                 "pagedkv-router-uvicorn", timeout)
        return self

    def run(self) -> None:
        import uvicorn

        self._start_background()
        try:
            uvicorn.run(self.app, host=self.host, port=self.port, log_level="info", lifespan="off",
                        timeout_graceful_shutdown=5)
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
