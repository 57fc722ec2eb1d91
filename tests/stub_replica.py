"""A stand-in for a ``pagedkv serve`` replica in the router's fault tests: no model, the same wire behaviour.

``POST /v1/completions`` and ``/v1/chat/completions`` answer after ``delay`` seconds per "token"
(``max_tokens`` of them): JSON, or (``"stream": true``) one SSE ``data:`` chunk per token and ``data: [DONE]``,
as the real server shapes them. Like the real server it watches its client and stops (counted as *aborted*)
when the client goes away. ``GET /health`` answers 200; ``GET /stats`` answers the counters (requests,
finished, aborted) and the last ``Authorization`` header received.

Run in a thread (:class:`ThreadReplica`) or as a process (:class:`ProcReplica`: ``python stub_replica.py PORT
DELAY``, which prints ``ready`` once it serves), so a test can ``kill -9`` it mid-stream.

The router tests' shared start-up lives here too (tests/test_router_faults.py, tests/test_pd_router.py,
tests/test_pd_server.py, tests/engine/test_pd_engine.py): :func:`make_router` (a ``pagedkv router`` in a thread
over replicas of any role), :class:`ByteTokenizer`, :func:`wait_for`, :func:`settled`, :func:`metric` and the
:func:`cleanup` fixture (import it into the test module).

A prefill/decode split's wire behaviour (docs/pd-split.md), without KV: a body whose ``kv_transfer_params`` asks
for ``do_remote_decode`` is answered (after ``delay`` per token, as any request) with ``kv_transfer_params``
naming a made-up hold on this stub (``stats["holds"]``); a body with ``do_remote_prefill`` is recorded in
``stats["kv_params"]`` and answered as usual; ``DELETE /v1/kv/holds/{id}`` releases a hold (204, or 404 when
unknown; ``stats["releases"]``).
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def make_app(delay: float = 0.02):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    stats = {"requests": 0, "finished": 0, "aborted": 0, "authorization": None, "holds": [], "releases": [],
             "kv_params": [], "bodies": []}

    async def generate(request: Request):
        body = json.loads(await request.body())
        stats["requests"] += 1
        stats["authorization"] = request.headers.get("authorization")
        n = int(body.get("max_tokens") or 4)
        d = float(body.get("stub_delay", delay))
        stats["bodies"].append(body)
        kvp = body.get("kv_transfer_params") or {}
        if kvp.get("do_remote_prefill"):
            stats["kv_params"].append(kvp)
        gone = asyncio.Event()

        async def watch():
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    gone.set()
                    return

        async def tokens():
            for i in range(n):
                try:
                    await asyncio.wait_for(gone.wait(), d)
                except asyncio.TimeoutError:
                    yield i
                    continue
                return

        if body.get("stream"):
            async def events():
                w = asyncio.ensure_future(watch())
                done = False
                try:
                    count = 0
                    async for i in tokens():
                        count += 1
                        chunk = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                                 "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    if count == n and not gone.is_set():
                        done = True
                        stats["finished"] += 1
                        yield "data: [DONE]\n\n"
                finally:  # also when the server cancels the stream because the client left
                    w.cancel()
                    if not done:
                        stats["aborted"] += 1

            return StreamingResponse(events(), media_type="text/event-stream")
        w = asyncio.ensure_future(watch())
        try:
            out = [i async for i in tokens()]
        finally:
            w.cancel()
        if len(out) < n:
            stats["aborted"] += 1
            return Response(status_code=499)
        stats["finished"] += 1
        answer = {"id": "cmpl-stub", "object": "text_completion", "model": "stub",
                  "choices": [{"index": 0, "text": "".join(f" t{i}" for i in out), "finish_reason": "length"}]}
        if kvp.get("do_remote_decode"):
            hold = f"h{len(stats['holds'])}"
            stats["holds"].append(hold)
            port = request.url.port
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "stub",
                "remote_request_id": hold, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                "remote_port": port, "remote_num_tokens": 8, "tp_size": 1}
        return JSONResponse(answer)

    async def release(request: Request):
        hold = request.path_params["hold"]
        if hold not in stats["holds"] or hold in stats["releases"]:
            return Response(status_code=404)
        stats["releases"].append(hold)
        return Response(status_code=204)

    async def health(_: Request):
        return Response(status_code=200)

    async def get_stats(_: Request):
        return JSONResponse(stats)

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": app.state.model_id, "object": "model"}]})

    app = Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                            Route("/v1/chat/completions", generate, methods=["POST"]),
                            Route("/health", health), Route("/stats", get_stats), Route("/v1/models", models),
                            Route("/v1/kv/holds/{hold}", release, methods=["DELETE"])])
    app.state.stats = stats
    app.state.model_id = "stub"  # the id GET /v1/models lists
    return app


class ThreadReplica:
    """The stub served by uvicorn in a daemon thread of the test process."""

    def __init__(self, delay: float = 0.02) -> None:
        from pagedkv.server.launch import serve_in_thread

        self.app = make_app(delay)
        self.stats = self.app.state.stats
        self._server, self._thread, port = serve_in_thread(self.app, "127.0.0.1", 0, "stub-replica")
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


class ProcReplica:
    """The stub in its own process on a free port of 127.0.0.1, so that a test can kill it with SIGKILL
    (:meth:`kill9`, also :meth:`close`). Its start-up is bounded (30 s)."""

    def __init__(self, delay: float) -> None:
        from redis_server import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(port), str(delay)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.kill9()
            raise RuntimeError("the stub replica did not start")

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", timeout=5).json()

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    close = kill9


# ------------------------------------------------------------------------------------ the router tests' helpers
class ByteTokenizer:
    """One token per UTF-8 byte: the router only needs ids to hash (the stubs ignore them)."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def apply_chat_template(self, messages):
        return list("".join(m["content"] for m in messages).encode())


def make_router(backends=(), *, prefill=(), decode=(), events=None, index=None, block_size: int = 4,
                tokenizer=None, **kw):
    """A ``pagedkv router`` started in a thread on 127.0.0.1 (``.url``; ``close()`` it): colocated ``backends``
    (``events``: url -> (events endpoint, replay endpoint)), ``prefill`` and ``decode`` replicas of a split,
    routing over ``tokenizer`` (default :class:`ByteTokenizer`). Health checks every 0.2 s, two failures mark a
    replica down, unless ``kw`` says otherwise (the rest of ``kw`` goes to ``RouterServer``)."""
    from pagedkv.router.app import RouterServer
    from pagedkv.router.prompt import PromptBuilder
    from pagedkv.router.state import Replica, RouterState

    reps = [Replica(u, role="prefill") for u in prefill] + [Replica(u, role="decode") for u in decode] + \
        [Replica(u, *((events or {}).get(u, (None, None)))) for u in backends]
    state = RouterState(reps, index, block_size=block_size)
    kw = {"health_interval": 0.2, "health_timeout": 3.0, "health_fails": 2, **kw}
    return RouterServer(state, PromptBuilder(tokenizer or ByteTokenizer(), block_size), port=0,
                        **kw).start_in_thread()


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` every 20 ms until it is true (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def settled(router) -> bool:
    """Every replica's in-flight count and load back to zero."""
    return all(r.inflight == 0 and r.inflight_tokens == 0 for r in router.state.replicas.values())


def metric(url_or_server, name: str, labels: str = "") -> float | None:
    """The value of one sample of ``GET /metrics`` (``labels``: the text inside the braces, exactly as
    exposed), None when absent."""
    import httpx

    url = getattr(url_or_server, "url", url_or_server)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{labels} ") or line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return None


@pytest.fixture
def cleanup():
    """A list to append replicas, routers and callables to: each is closed (or called) at the end, last first."""
    things: list = []
    yield things
    for t in reversed(things):
        try:
            t() if callable(t) else t.close()
        except Exception:
            pass


if __name__ == "__main__":
    import uvicorn

    port, delay = int(sys.argv[1]), float(sys.argv[2])
    config = uvicorn.Config(make_app(delay), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def main():
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await task

    asyncio.run(main())
