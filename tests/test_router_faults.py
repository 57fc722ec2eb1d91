"""Fault injection against ``pagedkv router``, without the model: stub replicas (tests/stub_replica.py, the real
server's wire behaviour) in threads or in processes, real KV-event publishers and block managers, a real
redis-server. Each fault ends in an answer the client can see, counters that return to zero and a router that
goes on: kill -9 of a replica mid-stream (error event, also through the official openai client), clients that
hang up (the replica aborts), replicas that go silent (read timeout), a full connection cap, request errors
inside the router (bookkeeping in ``finally``), API keys, hostile request bodies (4xx, the replica never sees
them), malformed ZMQ payloads (dropped and counted, the subscriber goes on) and Redis killed and restarted
under a router (routing goes on, /health says the index is stale, then the index is rebuilt).

Every wait is bounded; every process started is killed at the end. About 30 s on two cores.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from stub_replica import (ProcReplica, ThreadReplica, cleanup, make_router, metric, settled,  # noqa: E402,F401
                          wait_for)

BLOCK = 4


def data_lines(lines):
    return [ln for ln in lines if ln.startswith("data: ")]


# ------------------------------------------------------------------------------------------------ replica faults
def test_kill_9_of_a_replica_mid_stream_is_an_error_at_the_client_and_leaks_nothing(cleanup, caplog):
    openai = pytest.importorskip("openai")
    caplog.set_level(logging.INFO, logger="pagedkv.router")
    reps = [ProcReplica(0.05) for _ in range(3)]
    cleanup.extend(reps)
    by_url = {r.url: r for r in reps}
    router = make_router(list(by_url))
    cleanup.append(router)
    body = {"model": "stub", "prompt": "a long story", "max_tokens": 400, "stream": True}

    # raw SSE: a few events, then the replica is killed; the stream ends with an error event, not silently
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as s:
        assert s.status_code == 200
        victim = s.headers["x-pagedkv-replica"]
        lines = s.iter_lines()
        first = [next(lines) for _ in range(4)]
        by_url[victim].kill9()
        rest = data_lines(lines)
    assert any(ln.startswith("data: {") for ln in first)
    assert rest and "data: [DONE]" not in rest
    err = json.loads(rest[-1][6:])["error"]
    assert err["code"] == "replica_failed" and err["type"] == "server_error" and "incomplete" in err["message"]
    assert all("choices" in json.loads(ln[6:]) for ln in rest[:-1])  # whole events only before the error
    assert wait_for(lambda: settled(router))
    assert any("failed mid-stream" in r.getMessage() for r in caplog.records)

    # the official client raises instead of ending the loop with finish_reason None
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=30)
    stream = client.completions.create(**body)
    victim2 = stream.response.headers["x-pagedkv-replica"]
    assert victim2 != victim  # the dead one is out of routing (or retried away from)
    it = iter(stream)
    next(it)
    by_url[victim2].kill9()
    with pytest.raises(openai.APIError, match="failed before finishing"):
        for _ in it:
            pass
    assert wait_for(lambda: settled(router))

    # the survivor serves what follows; both dead replicas leave routing with one log line each
    r = httpx.post(router.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
    (survivor,) = set(by_url) - {victim, victim2}
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == survivor
    assert wait_for(lambda: router.state.routable() == [survivor])
    assert wait_for(lambda: settled(router))
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert sorted(m.split()[1] for m in downs) == sorted([victim, victim2])
    assert metric(router, "pagedkv_router_upstream_failures_total") == 2
    assert metric(router, "pagedkv_router_inflight", f'replica="{victim}"') == 0


class RawReplica:
    """A replica that answers every POST with fixed bytes and closes the connection (``/health``: 200)."""

    def __init__(self, answer: bytes) -> None:
        import socket

        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                else:
                    conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENT = b'data: {"choices": [1]}\n\n'


@pytest.mark.parametrize("answer, status", [
    # a JSON answer cut short (the replica died after its headers): 502, nothing half-sent
    (b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{"choices": [', 502),
    # a stream cut inside an event: the half event is not relayed, the error event follows the whole ones
    (_SSE_HEAD + _chunk(_EVENT + b'data: {"ch'), 200),
    # a stream that ends cleanly but without [DONE]: not a complete answer either
    (_SSE_HEAD + _chunk(_EVENT) + b"0\r\n\r\n", 200),
], ids=["json", "half-event", "no-done"])
def test_answers_cut_short_are_errors_at_the_client(cleanup, answer, status):
    rep = RawReplica(answer)
    cleanup.append(rep)
    router = make_router([rep.url])
    cleanup.append(router)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == status
    if status != 200:
        assert r.json()["error"]["code"] == "replica_failed"
    else:
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0] == 'data: {"choices": [1]}' and len(events) == 2, r.text
        assert json.loads(events[1][6:])["error"]["code"] == "replica_failed"
    assert wait_for(lambda: settled(router)) and router.metrics.upstream_failures == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_a_client_that_hangs_up_aborts_its_request_on_the_replica(cleanup, streamed):
    rep = ThreadReplica(0.05)
    cleanup.append(rep)
    router = make_router([rep.url])
    cleanup.append(router)
    body = {"model": "stub", "prompt": "x", "max_tokens": 400, "stream": streamed}  # 20 s if nobody stops it
    if streamed:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as s:
            it = s.iter_lines()
            assert len(data_lines(next(it) for _ in range(4))) >= 1
        # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    assert wait_for(lambda: rep.stats["aborted"] == 1), rep.stats
    assert rep.stats["finished"] == 0
    assert wait_for(lambda: settled(router))
    assert router.metrics.client_disconnects == 1


def test_a_silent_replica_times_out_with_504_or_an_error_event(cleanup):
    from pagedkv.router.proxy import UpstreamOptions

    rep = ThreadReplica(3.0)  # 3 s per token, read timeout 0.5 s
    cleanup.append(rep)
    router = make_router([rep.url], upstream=UpstreamOptions(read_timeout=0.5))
    cleanup.append(router)
    body = {"model": "stub", "prompt": "x", "max_tokens": 5}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "replica_timeout"
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        lines = data_lines(s.iter_lines())
    assert s.status_code == 200 and json.loads(lines[-1][6:])["error"]["code"] == "replica_timeout"
    assert wait_for(lambda: rep.stats["aborted"] == 2), rep.stats  # the router hung up on both
    assert wait_for(lambda: settled(router))
    assert router.metrics.upstream_timeouts == 2
    assert router.state.replicas[rep.url].healthy  # slow is not down


def test_the_connection_cap_queues_then_refuses(cleanup):
    from pagedkv.router.proxy import UpstreamOptions

    rep = ThreadReplica(0.1)
    cleanup.append(rep)
    router = make_router([rep.url], upstream=UpstreamOptions(max_connections=1, pool_timeout=0.3))
    cleanup.append(router)
    out = []
    t = threading.Thread(target=lambda: out.append(httpx.post(
        router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=30)))
    t.start()
    assert wait_for(lambda: rep.stats["requests"] == 1)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "y", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    t.join(30)
    assert out[0].status_code == 200 and rep.stats["requests"] == 1
    assert router.metrics.pool_timeouts == 1
    assert wait_for(lambda: settled(router))


def test_in_flight_bookkeeping_survives_any_error(cleanup, monkeypatch):
    """An error the proxy does not expect (not an httpx one) still ends the request's load."""
    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    router = make_router([rep.url])
    cleanup.append(router)

    class Broken:
        def build_request(self, *a, **k):
            return None

        async def send(self, *a, **k):
            raise RuntimeError("injected")

    real_client = router.proxy.client
    monkeypatch.setattr(router.proxy, "client", lambda url: Broken())
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello world, a prompt", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert settled(router) and router.state.replicas[rep.url].decisions == 1
    assert not router.state.pending.index.num_blocks()

    # a client that leaves while the routing decision is being made (in its thread): the decision is undone
    monkeypatch.setattr(router.proxy, "client", real_client)
    real_choose = router.state.choose
    monkeypatch.setattr(router.state, "choose", lambda *a: (time.sleep(0.6), real_choose(*a))[1])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json={"prompt": "hello world, a prompt", "max_tokens": 2},
                   timeout=httpx.Timeout(10, read=0.2))
    assert wait_for(lambda: router.state.replicas[rep.url].decisions == 2)
    assert wait_for(lambda: settled(router)) and not router.state.pending.index.num_blocks()
    assert router.metrics.client_disconnects == 1 and rep.stats["requests"] == 0


def test_api_key(cleanup):
    from pagedkv.router.proxy import UpstreamOptions

    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    router = make_router([rep.url], api_key="sekret", upstream=UpstreamOptions(api_key="replica-key"))
    cleanup.append(router)
    u = router.url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(u, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(router.url + "/v1/models").status_code == 401
    assert rep.stats["requests"] == 0
    r = httpx.post(u, json=body, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and rep.stats["authorization"] == "Bearer replica-key"
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/metrics").status_code == 200


HOSTILE = [
    ("invalid JSON", b"{not json", 400),
    ("not an object", b"[1, 2]", 400),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400),
    ("string max_tokens", json.dumps({"prompt": "x", "max_tokens": "10"}).encode(), 400),
    ("float n", json.dumps({"prompt": "x", "n": 1.5}).encode(), 400),
    ("object prompt", json.dumps({"prompt": {"a": 1}}).encode(), 400),
    ("empty prompt", json.dumps({"prompt": ""}).encode(), 400),
    ("negative temperature", json.dumps({"prompt": "x", "temperature": -1}).encode(), 400),
    ("unsupported echo", json.dumps({"prompt": "x", "echo": True}).encode(), 400),
    ("body over the limit", json.dumps({"prompt": "x" * 70_000}).encode(), 413),
]


def test_hostile_requests_are_answered_4xx_by_the_router_and_never_reach_a_replica(cleanup):
    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    router = make_router([rep.url], max_body_bytes=64 * 1024)
    cleanup.append(router)
    for name, body, status in HOSTILE:
        r = httpx.post(router.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", name
    r = httpx.post(router.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.post(router.url + "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    assert rep.stats["requests"] == 0
    assert settled(router) and httpx.get(router.url + "/health").json()["status"] == "ok"


def test_non_finite_and_huge_numbers_get_the_servers_answer(cleanup):
    """The router answers what the server's own parser answers (NaN and Infinity, which Python's JSON reads,
    and a seed beyond 64 bits): never a 5xx, and a rejected request never reaches a replica."""
    from pagedkv.server.validation import APIError, parse_completion

    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    router = make_router([rep.url])
    cleanup.append(router)
    for body in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                 b'{"prompt": "x", "seed": 1180591620717411303424}'):
        try:
            parse_completion(body)
            want = 200
        except APIError as e:
            want = e.status
        r = httpx.post(router.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == want == 400, (body, r.text)
    assert rep.stats["requests"] == 0


# ------------------------------------------------------------------------------------------------ event faults
def _batch(ts, events):
    from pagedkv.server.kv_events import KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts, events, 0))


def test_malformed_zmq_payloads_are_dropped_counted_and_the_subscriber_goes_on(cleanup):
    from pagedkv.server.kv_events import BlockStored

    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)

    class Closer:
        def close(self):
            pub.close(0)
            ctx.term()

    cleanup.append(Closer())
    router = make_router([rep.url], events={rep.url: (endpoint, None)})
    cleanup.append(router)
    time.sleep(0.3)  # the SUB socket connects
    seq = iter(range(100))
    now = time.time()

    def send(*frames):
        pub.send_multipart(frames)

    def good(hashes):
        send(b"kv-events", next(seq).to_bytes(8, "big"), _batch(now, [BlockStored(hashes, None, [], BLOCK, None,
                                                                                    None, None)]))

    first = (b"kv-events", next(seq).to_bytes(8, "big"), _batch(now, [BlockStored([1, 2], None, [], BLOCK, None,
                                                                             None, None)]))
    for _ in range(50):  # until the SUB socket has joined (a message sent before is lost; a repeat is a duplicate)
        send(*first)
        if wait_for(lambda: router.state.index.num_blocks(rep.url) == 2, 0.2):
            break
    assert router.state.index.num_blocks(rep.url) == 2
    bad = [
        (b"kv-events", b"only two frames"),
        (b"kv-events", b"\x00\x01", _batch(now, [])),  # sequence number not 8 bytes
        (b"kv-events", (1).to_bytes(8, "big"), b"\xc1 not msgpack"),
        (b"kv-events", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1})),  # wrong shape
        (b"kv-events", (1).to_bytes(8, "big"), _batch(now, [BlockStored([3], None, [], BLOCK, None, "XPU", None)])),
        (b"kv-events", (1).to_bytes(8, "big"), _batch(math.nan, [])),
        (b"kv-events", (1).to_bytes(8, "big"), _batch(now, [BlockStored([-5], None, [], BLOCK, None, None, None)])),
        (b"kv-events", (1).to_bytes(8, "big"), msgspec.msgpack.encode([now, [["Nope", 1]], None])),
    ]
    for frames in bad:
        send(*frames)
    next(seq)  # the first undecodable seq-1 message was the very next number: stepped over, the others ignored
    good([3])
    good([4])
    sub = router.subscriber
    assert wait_for(lambda: sub.feeds[rep.url].bad_payloads == len(bad)), sub.feeds[rep.url]
    assert wait_for(lambda: router.state.index.num_blocks(rep.url) == 4)
    assert sub.feeds[rep.url].seq == 3 and sub.feeds[rep.url].resyncs == 0
    assert sub.alive and sub.errors == 0
    assert metric(router, "pagedkv_router_event_bad_payloads_total", f'replica="{rep.url}"') == len(bad)
    h = httpx.get(router.url + "/health").json()
    assert h["events"] == {"subscriber": "running", "bad_payloads": len(bad)} and h["index"]["ok"]
    # an unexpected error in a callback is logged and counted, and the thread still follows the feed
    real = router.state.apply_events
    calls = []

    def flaky(replica, events):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        real(replica, events)

    sub._apply = flaky
    good([7])
    good([8])
    assert wait_for(lambda: sub.errors == 1 and router.state.index.longest_prefix([8]) == {rep.url: 1})
    assert sub.alive and metric(router, "pagedkv_router_event_subscriber_errors_total") == 1


def test_redis_killed_and_restarted_under_a_router(cleanup, tmp_path, caplog):
    from redis_server import RedisServer

    from pagedkv import BlockManager, block_hashes
    from pagedkv.cluster import RedisIndex
    from pagedkv.server.kv_events import KVEventPublisher

    caplog.set_level(logging.INFO, logger="pagedkv.router")
    srv = RedisServer(tmp_path)
    cleanup.append(type("S", (), {"close": lambda self: srv.kill()})())
    rep = ThreadReplica(0.01)
    cleanup.append(rep)
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    cleanup.append(pub)
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True, watermark=0.0, enable_kv_events=True)

    def run(seq_id, prompt):
        bm.allocate(seq_id, prompt)
        bm.free(seq_id)
        pub.publish(bm.events.take())
        pub.flush()

    p1, p2 = list(range(100, 113)), list(range(200, 213))
    run(0, p1)  # before the router starts: it learns it from the replay socket
    router = make_router([rep.url], events={rep.url: (pub.endpoint, pub.replay_endpoint)},
                         index=RedisIndex(srv.url, prefix="rk", timeout=0.5))
    cleanup.append(router)
    ix = router.state.index
    assert wait_for(lambda: ix.longest_prefix(block_hashes(p1, BLOCK)) == {rep.url: 3})

    srv.kill()  # Redis crashes: the router notices within a health round, routes on load alone, says so
    assert wait_for(lambda: not router.state.index_ok)
    h = httpx.get(router.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "degraded" and not h.json()["index"]["ok"]
    assert metric(router, "pagedkv_router_index_up") == 0
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "still served", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    run(1, p2)  # events during the outage: not lost for good (the replay holds them)

    srv2 = RedisServer(tmp_path, port=srv.port)  # back, empty (no persistence)
    cleanup.append(type("S", (), {"close": lambda self: srv2.kill()})())
    assert wait_for(lambda: router.state.index_ok, timeout=15)
    assert ix.longest_prefix(block_hashes(p1, BLOCK)) == {rep.url: 3}
    assert ix.longest_prefix(block_hashes(p2, BLOCK)) == {rep.url: 3}
    assert httpx.get(router.url + "/health").json()["status"] == "ok"
    assert metric(router, "pagedkv_router_index_outages_total") == 1
    assert metric(router, "pagedkv_router_index_resyncs_total") == 1
    assert metric(router, "pagedkv_router_index_errors_total") >= 1
    assert router.subscriber.alive and settled(router)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("prefix index unavailable" in m for m in msgs) == 1
    assert sum("prefix index back" in m for m in msgs) == 1


# ------------------------------------------------------------------------------------------------ logs
def test_health_checks_stay_out_of_the_access_log_and_the_rest_stays_in():
    """uvicorn as ``pagedkv serve`` runs it (its own logging set-up at start), in a subprocess: the access log
    shows the other requests and none of the health checks."""
    from redis_server import free_port

    port = free_port()
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import uvicorn; "
            "from stub_replica import make_app; from pagedkv.server.access_log import quiet_health_access_log; "
            "quiet_health_access_log(); quiet_health_access_log(); "
            f"uvicorn.run(make_app(), host='127.0.0.1', port={port}, log_level='info', lifespan='off')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _answers(url + "/stats"), timeout=30)
        for _ in range(5):
            assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/stats?after=health").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=15)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0].decode()
    assert '"GET /stats?after=health HTTP/1.1" 200' in out, out
    assert "/health" not in out, out


def _answers(url):
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("flags, message", [
    (["--upstream-read-timeout", "0"], "read_timeout must be > 0"),
    (["--upstream-max-connections", "0"], "max_connections must be an int >= 1"),
    (["--upstream-connect-timeout", "nan"], "connect_timeout must be > 0"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
    (["--api-key", " "], "--api-key must not be empty"),
])
def test_bad_router_options_are_one_line_and_exit_2(flags, message, capsys):
    from pagedkv.router.cli import main

    assert main(["--backend", "http://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedkv router: error: ") and message in err and "\n" not in err
