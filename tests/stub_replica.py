"""A stand-in for a ``pagedkv serve`` replica in the router's fault tests: no model, the same wire behaviour.

``POST /v1/completions`` and ``/v1/chat/completions`` answer after ``delay`` seconds per "token"
(``max_tokens`` of them): JSON, or (``"stream": true``) one SSE ``data:`` chunk per token and ``data: [DONE]``,
as the real server shapes them. Like the real server it watches its client and stops (counted as *aborted*)
when the client goes away. ``GET /health`` answers 200; ``GET /stats`` answers the counters (requests,
finished, aborted) and the last ``Authorization`` header received.

Run in a thread (:func:`start_in_thread`) or as a process (``python stub_replica.py PORT DELAY``, which prints
``ready`` once it serves), so a test can ``kill -9`` it mid-stream.

A prefill/decode split's wire behaviour (docs/pd-split.md), without KV: a body whose ``kv_transfer_params`` asks
for ``do_remote_decode`` is answered (after ``delay`` per token, as any request) with ``kv_transfer_params``
naming a made-up hold on this stub (``stats["holds"]``); a body with ``do_remote_prefill`` is recorded in
``stats["kv_params"]`` and answered as usual; ``DELETE /v1/kv/holds/{id}`` releases a hold (204, or 404 when
unknown; ``stats["releases"]``).
"""

from __future__ import annotations

import asyncio
import json
import sys


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
