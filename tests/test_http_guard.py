"""Header and body read deadlines and the connection cap of the HTTP side (``pagedkv.server.http_guard``), on
127.0.0.1 with deadlines of about a second: a trickled header, a connection that sends nothing, a body never
completed, requests in time (kept alive too), connections past the cap; and ``pagedkv router`` as a process
with the flags. Every socket has a timeout; every wait is bounded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

DEADLINE = 1.0
SLACK = 2.0  # a busy 2-core machine: the close may come a little late, never early


def _app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen = {"bodies": 0}

    async def echo(request):
        body = await request.body()
        seen["bodies"] += 1
        return JSONResponse({"n": len(body)})

    app = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])
    app.state.seen = seen
    return app


@pytest.fixture
def served():
    from pagedkv.server.launch import serve_in_thread

    app = _app()
    server, thread, port = serve_in_thread(app, "127.0.0.1", 0, "guard-test",
                                           http={"header_timeout": DEADLINE, "body_timeout": DEADLINE,
                                                 "max_connections": 3, "keep_alive_timeout": 5.0})
    yield app, port
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _request(body: bytes = b"", keep_alive: bool = False, path: bytes = b"/") -> bytes:
    conn = b"keep-alive" if keep_alive else b"close"
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: " + conn +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _closed_after(s: socket.socket, t0: float) -> tuple[bytes, float]:
    data = _read_all(s)
    return data, time.monotonic() - t0


def test_trickled_headers_are_answered_408_and_closed_at_the_deadline(served):
    _, port = served
    s = _connect(port)
    t0 = time.monotonic()
    s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
    s.settimeout(0.2)
    got = b""
    try:  # one header byte every 0.2 s, for longer than the deadline
        for b in b"x-slow: " + b"a" * 40:
            s.sendall(bytes([b]))
            try:
                got = s.recv(65536)
                if got:
                    break
            except socket.timeout:
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    s.settimeout(10)
    try:
        rest = _read_all(s)
    except ConnectionResetError:
        rest = b""
    took = time.monotonic() - t0
    s.close()
    assert (got + rest).startswith(b"HTTP/1.1 408 "), got + rest
    assert DEADLINE - 0.05 <= took <= DEADLINE + SLACK, took


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(served):
    _, port = served
    s = _connect(port)
    data, took = _closed_after(s, time.monotonic())
    s.close()
    assert data == b"" and DEADLINE - 0.05 <= took <= DEADLINE + SLACK, (data, took)


def test_a_body_never_completed_gets_408_and_the_app_never_sees_it(served):
    app, port = served
    s = _connect(port)
    t0 = time.monotonic()
    s.sendall(_request(b'{"prompt": "x"}')[:-5])  # content-length says 5 bytes more
    data, took = _closed_after(s, t0)
    s.close()
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data, data
    assert DEADLINE - 0.05 <= took <= DEADLINE + SLACK, took
    assert app.state.seen["bodies"] == 0


def test_requests_in_time_are_served_and_a_kept_alive_connection_gets_a_fresh_deadline(served):
    app, port = served
    s = _connect(port)
    raw = _request(b'{"a": 1}', keep_alive=True)
    for _ in range(3):  # each request trickled over 0.6 s; 1.8 s in all on one connection
        for i in range(0, len(raw), len(raw) // 6 + 1):
            s.sendall(raw[i:i + len(raw) // 6 + 1])
            time.sleep(0.1)
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b'{"n":8}'), head
    s.close()
    assert app.state.seen["bodies"] == 3


def test_requests_past_the_connection_cap_get_503(served):
    app, port = served
    held = [_connect(port) for _ in range(3)]  # the cap: 3 open connections
    try:
        for h in held:  # each mid-request (headers in, body still coming), so each is an open connection
            h.sendall(_request(b"0123456789")[:-4])
        time.sleep(0.2)
        s = _connect(port)
        s.sendall(_request(b"{}"))
        data = _read_all(s)
        s.close()
        assert data.startswith(b"HTTP/1.1 503 "), data
    finally:
        for h in held:
            h.close()
    time.sleep(0.3)
    s = _connect(port)
    s.sendall(_request(b"{}"))
    assert _read_all(s).startswith(b"HTTP/1.1 200 ")
    s.close()


def test_the_options_and_their_checks():
    from pagedkv.router.cli import build_parser as router_parser
    from pagedkv.server.cli import build_parser as serve_parser
    from pagedkv.server.http_options import check_http_args, http_options

    for parser, base in ((serve_parser(), []), (router_parser(), ["--backend", "http://127.0.0.1:1"])):
        a = parser.parse_args(base)
        assert http_options(a) == {"header_timeout": 10.0, "body_timeout": 30.0, "max_connections": 1000,
                                   "keep_alive_timeout": 5.0}
        a = parser.parse_args(base + ["--header-timeout", "2", "--body-timeout", "3", "--max-connections", "7",
                                      "--keep-alive-timeout", "1"])
        assert http_options(a) == {"header_timeout": 2.0, "body_timeout": 3.0, "max_connections": 7,
                                   "keep_alive_timeout": 1.0}
        for bad in (["--header-timeout", "0"], ["--body-timeout", "inf"], ["--max-connections", "0"],
                    ["--keep-alive-timeout", "-1"]):
            with pytest.raises(ValueError, match=bad[0]):
                check_http_args(parser.parse_args(base + bad))


def test_the_router_command_closes_slow_clients_and_caps_connections():
    """``pagedkv router`` as a process (no replica needs to be up), the deadlines and the cap from its flags."""
    pytest.importorskip("gguf")
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model

    try:
        find_default_model()  # (the router reads the default model's tokenizer metadata)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "router", "--backend", "http://127.0.0.1:9",
                             "--port", str(port), "--header-timeout", "2", "--body-timeout", "2",
                             "--max-connections", "2", "--health-interval", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the router did not come up"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        warm = _connect(port)  # (the first request warms the app up; the probe connection closes meanwhile)
        warm.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_all(warm).startswith(b"HTTP/1.1 ")
        warm.close()
        time.sleep(0.3)
        slow = _connect(port)
        t0 = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # then nothing more
        held = _connect(port)
        held.sendall(_request(b"0123456789", path=b"/v1/completions")[:-4])  # a body never completed
        time.sleep(0.3)  # (the cap counts the connections open when a request's headers are complete)
        extra = _connect(port)  # past the cap of 2
        extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _read_all(extra).startswith(b"HTTP/1.1 503 ")
        extra.close()
        assert _read_all(slow).startswith(b"HTTP/1.1 408 ")
        assert _read_all(held).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - t0 <= 2.0 + SLACK
        slow.close()
        held.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
