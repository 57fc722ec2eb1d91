"""Assemble a server (engine thread, metrics, KV-event publisher, app) and run it, in the foreground
(``pagedkv serve``) or in a background thread (tests, ``pagedkv bench serve --launch``)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Server", "make_server", "default_model_name"]


def default_model_name(llm: Any, path: str | None) -> str:
    """The model id clients send: the GGUF file's stem (SmolLM2-135M-Instruct's for the default model)."""
    if path is None:
        from ..engine.gguf_loader import find_default_model

        path = str(find_default_model())
    return Path(path).stem


def serve_in_thread(app, host: str, port: int, name: str, timeout: float = 30.0):
    """Run ASGI ``app`` with uvicorn on ``host:port`` (port 0: a free one) in a daemon thread; wait until it
    accepts connections. Returns ``(uvicorn server, thread, port)``; RuntimeError if it does not start in
    ``timeout`` seconds."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{name}: the server did not start")
        time.sleep(0.02)
    return server, thread, port


@dataclass
class Server:
    """A running or runnable server: ``app`` (ASGI), ``engine``, ``metrics``, ``publisher`` (or None)."""

    app: Any
    engine: Any
    metrics: Any
    publisher: Any
    model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    _uvicorn: Any = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_in_thread(self, timeout: float = 30.0) -> "Server":
        """Serve on ``host:port`` (port 0: a free port, written back to ``self.port``) in a daemon thread."""
        self._uvicorn, self._thread, self.port = serve_in_thread(self.app, self.host, self.port, "pagedkv-uvicorn",
                                                                 timeout)
        return self

    def run(self) -> None:
        """Serve in the foreground until interrupted."""
        import uvicorn

        from .access_log import quiet_health_access_log

        quiet_health_access_log()
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
        self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()


def make_server(llm: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                max_waiting: int = 256, kv_events_endpoint: str | None = None,
                kv_events_replay_endpoint: str | None = None, kv_events_topic: str = "kv-events") -> Server:
    """Wire ``llm`` into a :class:`Server`. With ``kv_events_endpoint`` the block manager's events (it needs
    ``take_events``, i.e. an ``LLM(..., enable_kv_events=True)``) are published there over ZMQ."""
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics

    publisher = None
    if kv_events_endpoint is not None:
        from .kv_events import KVEventPublisher

        if not hasattr(llm.block_manager, "take_events"):
            raise RuntimeError("--kv-events-endpoint needs a block manager with take_events (enable_kv_events)")
        publisher = KVEventPublisher(kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint,
                                     topic=kv_events_topic)
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["engine"].snapshot, model_name)
    engine = AsyncEngine(llm, max_waiting=max_waiting, observer=metrics.observe,
                         event_sink=publisher.publish if publisher is not None else None)
    holder["engine"] = engine
    app = build_app(engine, model_name=model_name, api_key=api_key, metrics=metrics)
    return Server(app, engine, metrics, publisher, model_name, host, port)
