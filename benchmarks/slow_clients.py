"""Figures of docs/reliability.md, "Slow clients and connection floods": how long stalled connections stay open,
with uvicorn's config as pagedkv served before (``uvicorn.Config`` defaults) and with the server's guards
(``pagedkv.server.http_guard``) at their defaults, in the same run. Prints, does not assert.

    PYTHONPATH=src .venv/bin/python benchmarks/slow_clients.py [--sockets 20] [--watch 40]

Each side gets ``--sockets`` connections of each kind against a small ASGI app on 127.0.0.1: headers trickled one
byte a second, a body whose Content-Length is never completed, and a connection that sends nothing. Every
``--watch`` seconds at most, it records when each socket was closed by the server and what it answered, then a
request past a cap of ``--sockets`` connections.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _serve(guarded: bool, cap: int | None):
    import uvicorn

    from pagedkv.server.http_guard import uvicorn_config
    from test_http_guard import _app

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    kw = dict(log_level="critical", lifespan="off")
    config = uvicorn_config(_app(), max_connections=cap, **kw) if guarded else uvicorn.Config(_app(), **kw)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, sock.getsockname()[1]


def _watch(port: int, n: int, watch: float) -> dict:
    from test_http_guard import _request

    kinds = {"trickled headers": [], "body never completed": [], "nothing sent": []}
    socks = []
    for _ in range(n):
        a = socket.create_connection(("127.0.0.1", port))
        a.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
        b = socket.create_connection(("127.0.0.1", port))
        b.sendall(_request(b"0123456789")[:-4])
        c = socket.create_connection(("127.0.0.1", port))
        for kind, s in zip(kinds, (a, b, c)):
            s.setblocking(False)
            socks.append((kind, s))
    t0 = time.monotonic()
    open_ = {id(s): (kind, s) for kind, s in socks}
    answers: dict = {}
    next_byte = t0
    while open_ and time.monotonic() - t0 < watch:
        now = time.monotonic()
        for key, (kind, s) in list(open_.items()):
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                answers[key] = answers.get(key, b"") + data
                continue
            kinds[kind].append((now - t0, answers.get(key, b"")[:12].decode(errors="replace")))
            del open_[key]
            s.close()
        if now >= next_byte:
            next_byte += 1.0
            for kind, s in open_.values():
                if kind == "trickled headers":
                    try:
                        s.send(b"x")
                    except OSError:
                        pass
        time.sleep(0.02)
    for kind, s in open_.values():
        s.close()
    out = {}
    for kind, closed in kinds.items():
        still = n - len(closed)
        times = [t for t, _ in closed]
        answer = sorted({a.strip() or "(closed)" for _, a in closed})
        out[kind] = (f"{len(closed)}/{n} closed" + (f" after {min(times):.1f}-{max(times):.1f} s "
                     f"(median {statistics.median(times):.1f}), answer {', '.join(answer)}" if closed else "") +
                     (f"; {still} still open after {watch:.0f} s" if still else ""))
    return out


def _past_cap(port: int, n: int) -> str:
    from test_http_guard import _read_all, _request

    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(_request(b"0123456789")[:-4])
        held.append(s)
    time.sleep(0.3)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(_request(b"{}"))
    try:
        first = _read_all(s).split(b"\r\n", 1)[0].decode()
    except socket.timeout:
        first = "no answer in 10 s"
    for h in held + [s]:
        h.close()
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sockets", type=int, default=20)
    ap.add_argument("--watch", type=float, default=40.0)
    args = ap.parse_args()
    from pagedkv.server.http_options import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT

    print(f"{args.sockets} sockets of each kind, watched up to {args.watch:.0f} s; guards at their defaults "
          f"(--header-timeout {DEFAULT_HEADER_TIMEOUT:g}, --body-timeout {DEFAULT_BODY_TIMEOUT:g})")
    for guarded in (False, True):
        server, port = _serve(guarded, cap=None)
        name = "pagedkv guards" if guarded else "uvicorn.Config as before"
        for kind, line in _watch(port, args.sockets, args.watch).items():
            print(f"  {name:26} {kind:22} {line}")
        server.should_exit = True
        server, port = _serve(guarded, cap=args.sockets)
        print(f"  {name:26} {'request past the cap':22} {_past_cap(port, args.sockets)} "
              f"(cap {args.sockets}{'' if guarded else ': none before'})")
        server.should_exit = True


if __name__ == "__main__":
    main()
