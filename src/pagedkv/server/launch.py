"""Assemble a server (engine thread, metrics, KV-event publisher, app) and run it, in the foreground
(``pagedkv serve``) or in a background thread (tests, ``pagedkv bench serve --launch``).

In the foreground, the first SIGTERM or SIGINT *drains* (see :meth:`Server.run`): /health and new requests answer
503 at once, the requests in flight run to their end for up to ``drain_timeout`` seconds and are then ended with
a clean error (an error event for a stream), and the process exits 0. A second signal stops at once. A fault
that leaves the engine unusable stops the server too, and :meth:`Server.run` returns 1 (the process exits
non-zero, for a supervisor to restart it).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Server", "make_server", "default_model_name", "served_model_names", "engine_kv_port"]


def served_model_names(model: str | None) -> tuple[str, tuple[str, ...]]:
    """``(model id, aliases)`` for ``--model``: a registry name (``gemma-3-270m``) is the id itself, with no alias;
    a GGUF path (or none: the default model's file) is known by the file's stem, and also by the registry name
    when the file has that model's file name (``.../gemma-3-270m-q4_k_m.gguf`` -> alias ``gemma-3-270m``).
    Torch-free; finds the default model's file when ``model`` is None (FileNotFoundError if absent)."""
    from ..engine.registry import MODEL_FILES, MODEL_NAMES

    if model in MODEL_NAMES:
        return model, ()
    if model is None:
        from ..engine.gguf_loader import find_default_model

        model = str(find_default_model())
    name = Path(model).name
    return Path(model).stem, tuple(k for k, f in MODEL_FILES.items() if f == name)


def default_model_name(llm: Any, path: str | None) -> str:
    """The model id clients send (see :func:`served_model_names`): the registry name given, else the GGUF file's
    stem (SmolLM2-135M-Instruct's for the default model)."""
    return served_model_names(path)[0]


log = logging.getLogger("pagedkv.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), so that a bad address or a port in use is found
    before anything slow starts. OSError / ValueError (with a one-line message) when it cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve_in_thread(app, host: str, port: int, name: str, timeout: float = 30.0, http: dict | None = None):
    """Run ASGI ``app`` with uvicorn on ``host:port`` (port 0: a free one) in a daemon thread; wait until it
    accepts connections. ``http``: the read deadlines and connection cap (keywords of
    :func:`~pagedkv.server.http_guard.uvicorn_config`; its defaults when None). Returns ``(uvicorn server,
    thread, port)``; RuntimeError if it does not start in ``timeout`` seconds."""
    import uvicorn

    from .http_guard import uvicorn_config

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                           **(http or {})))
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
    drain_timeout: float = 30.0
    sock: socket.socket | None = None  # bound in advance (pagedkv serve binds before loading the model)
    fatal: str | None = None  # why the engine stopped, if it did
    http: dict | None = None  # read deadlines and connection cap (pagedkv.server.http_guard.uvicorn_config)
    kv: Any = None  # the replica's side of a prefill/decode split (pagedkv.server.kv_handoff.KVHandoff)
    _uvicorn: Any = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_in_thread(self, timeout: float = 30.0) -> "Server":
        """Serve on ``host:port`` (port 0: a free port, written back to ``self.port``) in a daemon thread."""
        self._uvicorn, self._thread, self.port = serve_in_thread(self.app, self.host, self.port, "pagedkv-uvicorn",
                                                                 timeout, self.http)
        if self.kv is not None:
            self.kv.port_number = self.port  # (port 0: the one found)
        return self

    def run(self) -> int:
        """Serve in the foreground until a signal (drain, then exit status 0) or an engine fault (status 1).
        Returns the exit status."""
        import uvicorn

        from .access_log import quiet_health_access_log
        from .http_guard import uvicorn_config

        quiet_health_access_log()

        outer = self

        class _Uvicorn(uvicorn.Server):
            draining = False

            def handle_exit(self, sig: int, frame: Any) -> None:  # (signal handler: main thread)
                if self.draining or sig not in (signal.SIGTERM, signal.SIGINT):
                    self.should_exit = self.force_exit = True  # a second signal: stop now
                    return
                self.draining = True
                log.info("signal %d: draining (up to %.0f s); a second signal stops at once", sig,
                         outer.drain_timeout)
                threading.Thread(target=outer._drain_then_exit, name="pagedkv-drain", daemon=True).start()

        sock = self.sock if self.sock is not None else bind_socket(self.host, self.port)
        if self.kv is not None:
            self.kv.port_number = sock.getsockname()[1]
        self._uvicorn = server = _Uvicorn(uvicorn_config(self.app, log_level="info", lifespan="off",
                                                         timeout_graceful_shutdown=2, **(self.http or {})))
        try:
            server.run(sockets=[sock])
        finally:
            self.close()
        return 1 if self.fatal is not None else 0

    def _drain_then_exit(self) -> None:
        clean = self.engine.drain(self.drain_timeout)
        log.info("drained: %s", "every request finished" if clean else "the requests left were ended with an error")
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def on_fatal(self, message: str) -> None:
        """The engine stopped for good (called from its thread): stop serving; :meth:`run` returns 1."""
        self.fatal = message
        log.critical("the engine stopped: %s; the server exits", message)
        if self._uvicorn is not None and self._thread is None:  # (in a thread, tests look at the 503s)
            self._uvicorn.should_exit = True

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(10)
        self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()


def engine_kv_port(llm: Any, lock: Any = None, *, required: bool = False) -> Any:
    """The engine's :class:`~pagedkv.server.kv_handoff.KVPort` (:class:`pagedkv.engine.kv_port.EngineKVPort`,
    over the engine's step ``lock``; KV cache groups too), or None when the engine cannot hand KV over (a block
    manager without holds);
    ValueError then when ``required``."""
    try:
        from ..engine.kv_port import EngineKVPort

        return EngineKVPort(llm, lock)
    except (ValueError, AttributeError, TypeError, ImportError):
        if required:
            raise
        return None


def make_server(llm: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                max_waiting: int = 256, kv_events_endpoint: str | None = None,
                kv_events_replay_endpoint: str | None = None, kv_events_topic: str = "kv-events",
                publisher: Any = None, max_body_bytes: int | None = None, drain_timeout: float = 30.0,
                sock: socket.socket | None = None, model_aliases: tuple[str, ...] = (),
                http: dict | None = None, kv_role: str = "both", kv_port: Any = None, kv_lease: float = 480.0,
                kv_peers: tuple[str, ...] = (), kv_advertise_host: str | None = None, kv_fetch_timeout: float = 30.0,
                kv_peer_api_key: str | None = None, kv_fetch_buffer_bytes: int | None = None,
                kv_store_wait: float | None = None) -> Server:
    """Wire ``llm`` into a :class:`Server`. With ``kv_events_endpoint`` the block manager's events (it needs
    ``take_events``, i.e. an ``CacheConfig(enable_kv_events=True)``) are published there over ZMQ (or give an
    already bound ``publisher``). ``max_body_bytes``: the request body limit (413 beyond; default 2 MiB).
    ``model_aliases``: other model ids a request may name (answered as ``model_name``). ``http``: the header and
    body read deadlines and the connection cap (keywords of :func:`~pagedkv.server.http_guard.uvicorn_config`:
    ``header_timeout``, ``body_timeout``, ``max_connections``, ``keep_alive_timeout``; its defaults when None).
    ``kv_*``: the prefill/decode split (:class:`~pagedkv.server.kv_handoff.KVHandoff`): the role, the engine's
    port (default :func:`engine_kv_port`; ValueError for a role other than ``both`` without one), the hold lease,
    the hosts a decode replica reads KV from besides loopback, the address decode replicas reach this one at
    (default ``host``), the fetch bound in seconds, the key sent to prefill replicas (default ``api_key``) and the
    decode side's staging budget in bytes (the blocks read and not yet written into their reserved cache
    blocks; default 1 GiB), and the most seconds a prefill answer waits for its blocks
    in the shared store (default 5; docs/pd-split.md#through-the-shared-store). The handoff's counters join the
    metrics."""
    from .app import build_app
    from .async_engine import AsyncEngine
    from .metrics import ServerMetrics
    from .validation import DEFAULT_LIMITS

    if publisher is not None and not hasattr(getattr(llm.block_manager, "events", None), "take"):
        raise RuntimeError("--kv-events-endpoint needs a block manager with take_events (enable_kv_events)")
    if publisher is None and kv_events_endpoint is not None:
        from .kv_events import KVEventPublisher

        if not hasattr(getattr(llm.block_manager, "events", None), "take"):
            raise RuntimeError("--kv-events-endpoint needs a block manager with take_events (enable_kv_events)")
        publisher = KVEventPublisher(kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint,
                                     topic=kv_events_topic)
    from .kv_handoff import LOOPBACK_HOSTS, KVHandoff

    advertise = kv_advertise_host or host
    if kv_role != "both" and advertise in ("0.0.0.0", "::", ""):
        raise ValueError("--kv-role with --host 0.0.0.0 needs --kv-advertise-host (the address decode replicas "
                         "reach this one at)")
    holder: dict = {}
    metrics = ServerMetrics(lambda: holder["engine"].snapshot, model_name)
    engine = AsyncEngine(llm, max_waiting=max_waiting, observer=metrics.observe,
                         event_sink=publisher.publish if publisher is not None else None,
                         on_fatal=lambda message: holder["server"].on_fatal(message))
    holder["engine"] = engine
    try:
        if kv_port is None:
            kv_port = engine_kv_port(llm, engine._lock, required=kv_role != "both")
        kv = KVHandoff(role=kv_role, port=kv_port, host=advertise, port_number=port, lease_s=kv_lease,
                       allow_hosts=LOOPBACK_HOSTS | frozenset(kv_peers), fetch_timeout=kv_fetch_timeout,
                       peer_api_key=kv_peer_api_key if kv_peer_api_key is not None else api_key,
                       **({} if kv_fetch_buffer_bytes is None else {"fetch_buffer_bytes": kv_fetch_buffer_bytes}),
                       **({} if kv_store_wait is None else {"store_wait_s": kv_store_wait}))
    except ValueError:
        engine.shutdown()
        raise
    metrics.add_kv_handoff(kv)
    app = build_app(engine, model_name=model_name, model_aliases=model_aliases, api_key=api_key, metrics=metrics,
                    max_body_bytes=max_body_bytes or DEFAULT_LIMITS.max_body_bytes, kv=kv)
    server = holder["server"] = Server(app, engine, metrics, publisher, model_name, host, port, drain_timeout, sock,
                                       http=http, kv=kv)
    return server
