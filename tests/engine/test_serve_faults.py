"""Fault injection against ``pagedkv serve`` (bounded: one small server, ~50 hostile requests, three short-lived
processes). Every hostile request of tests/hostile_inputs.py is answered with its 4xx (or, for the documented
denormal rows, served), the server stays healthy, and no KV block stays held; SIGTERM mid-stream drains and
exits 0; a bad option ends start-up with one line and exit status 2 before the model loads."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from engine_helpers import fail_sampling_of_seed, free_port, wait_healthy
from hostile_inputs import HOSTILE

pytestmark = pytest.mark.engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "smollm2-test"


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=8, block_size=16)
    srv = make_server(llm, model_name=MODEL).start_in_thread()
    yield srv
    srv.close()


def wait_idle(srv, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.engine.num_unfinished or srv.engine.llm.scheduler.has_unfinished():
        assert time.monotonic() < deadline, "requests are stuck in the engine"
        time.sleep(0.02)


def test_hostile_requests_get_4xx_and_leave_the_server_healthy(server):
    bm = server.engine.llm.block_manager
    answers = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, route, body, ctype, status, param in HOSTILE:
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            r = http.post(path, content=body, headers={"Content-Type": ctype})
            answers.append((name, r.status_code))
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            if status >= 400:
                err = r.json()["error"]
                assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error", \
                    (name, err)
            assert http.get("/health").status_code == 200, name
        # a body without Content-Length (chunked): cut off at the limit while it is read
        chunks = (b'{"prompt": "' + b"a" * 2**20 if i == 0 else b"a" * 2**20 for i in range(3))
        r = http.post("/v1/completions", content=chunks, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert http.get("/health").status_code == 200
        wait_idle(server)
        assert bm.stats.gpu_usage == 0.0 and server.engine.faults == 0 and server.engine.alive
        bm.check_invariants()
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert not [a for a in answers if a[1] >= 500]


def _serve(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)


def test_bad_options_exit_2_with_one_line_before_the_model_loads():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = str(busy.getsockname()[1])
    cases = {
        "port out of range": (["--port", "99999"], "--port"),
        "port in use": (["--port", taken], "cannot listen"),
        "malformed endpoint": (["--port", "0", "--kv-events-endpoint", "tcp//nowhere"], "--kv-events-endpoint"),
        "endpoint in use": (["--port", "0", "--kv-events-endpoint", f"tcp://127.0.0.1:{taken}",
                             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"], "KV-event"),
        "missing model file": (["--port", "0", "--model", "/nonexistent/model.gguf"], "no such file"),
        "bad block size": (["--port", "0", "--block-size", "0"], "--block-size"),
        "a split role on 0.0.0.0 without an address": (["--port", "0", "--kv-role", "decode", "--host", "0.0.0.0"],
                                                        "--kv-advertise-host"),
        "bad hold lease": (["--port", "0", "--kv-lease", "0"], "--kv-lease"),
    }
    try:
        procs = {name: _serve(*argv) for name, (argv, _) in cases.items()}
        for name, p in procs.items():
            out, err = p.communicate(timeout=120)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert p.returncode == 2, (name, p.returncode, err[-500:])
            assert len(lines) == 1 and lines[0].startswith("pagedkv serve: error:"), (name, err[-500:])
            assert cases[name][1] in lines[0] and "Traceback" not in err, (name, lines)
    finally:
        busy.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_sigterm_mid_stream_drains_and_exits_0():
    """A stream still generating when SIGTERM arrives: /health and new requests answer 503 at once, the stream
    ends with an error event and [DONE] once the drain timeout passes, and the process exits 0."""
    port = free_port()
    proc = _serve("--port", str(port), "--num-gpu-blocks", "64", "--max-num-seqs", "4", "--drain-timeout", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
        body = {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line:
                    events.append(line)
                    break
            t_signal = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health", timeout=5).status_code != 503:  # (the signal lands within a tick)
                assert time.monotonic() < deadline, "/health did not turn 503 after SIGTERM"
                time.sleep(0.05)
            late = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
            assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
            events += [ln for ln in lines if ln]
        assert events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
        assert proc.wait(30) == 0
        took = time.monotonic() - t_signal
        _, stderr = proc.communicate(timeout=5)
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-2000:]
        assert took < 20, took  # bounded: the 2 s drain plus the shutdown (generous for a loaded machine)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_drain_lets_requests_in_flight_finish_and_refuses_new_ones(engine):
    """``AsyncEngine.drain`` (what SIGTERM runs): a request in flight that can finish within the timeout ends
    normally with its full output; requests arriving meanwhile get 503 (server_shutting_down)."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=32, max_num_seqs=4, block_size=16)
    srv = make_server(llm, model_name=MODEL, drain_timeout=60).start_in_thread()
    try:
        result = {}

        def run():
            result["r"] = httpx.post(srv.url + "/v1/completions", timeout=120,
                                     json={"prompt": "Hello", "max_tokens": 24, "ignore_eos": True})

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while not srv.engine.num_unfinished:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        clean = {}
        d = threading.Thread(target=lambda: clean.setdefault("ok", srv.engine.drain(60)))
        d.start()
        while not srv.engine.draining:
            time.sleep(0.01)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        t.join(120)
        d.join(60)
        assert clean == {"ok": True}
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 24
        assert llm.block_manager.stats.gpu_usage == 0.0
    finally:
        srv.close()


def test_offline_generate_raises_a_sampler_fault_and_stays_usable(engine, monkeypatch):
    """``LLM.generate`` with a request whose sampling raises: a RuntimeError naming it, every request of the call
    aborted (no block held, nothing left in the scheduler), and the next call works."""
    from pagedkv.engine import LLM, SamplingParams

    fail_sampling_of_seed(monkeypatch, "injected")  # every sampler raises for seed 666
    llm = LLM(engine.paged, num_gpu_blocks=32, max_num_seqs=4, block_size=16)
    with pytest.raises(RuntimeError, match="sampling failed"):
        llm.generate(["Hello", "World"], [SamplingParams(max_tokens=4, temperature=0),
                                          SamplingParams(max_tokens=4, seed=666)], use_tqdm=False)
    assert not llm.scheduler.has_unfinished() and llm.block_manager.stats.gpu_usage == 0.0 and not llm.core._sample_faults
    llm.block_manager.check_invariants()
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


_FATAL_SCRIPT = """
import sys, threading, time
import httpx
from pagedkv.engine import LLM
from pagedkv.server.launch import bind_socket, make_server

llm = LLM(num_gpu_blocks=16, max_num_seqs=2)

def broken(*_a, **_k):
    raise RuntimeError("injected")

llm.scheduler.schedule = broken
sock = bind_socket("127.0.0.1", 0)
srv = make_server(llm, model_name="m", sock=sock, port=sock.getsockname()[1])

def poke():
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    print("ANSWER", r.status_code, r.json()["error"]["code"], flush=True)

t = threading.Thread(target=poke, daemon=True)
t.start()
rc = srv.run()
t.join(30)  # (the answer was sent before the server stopped; let the client print it)
sys.exit(rc)
"""


def test_an_unusable_engine_makes_the_foreground_server_exit_non_zero():
    """In the foreground (as ``pagedkv serve`` runs it), a fault that leaves the engine unusable answers the
    request in flight with an error and ends the process with status 1 (for a supervisor), not 503 forever."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", _FATAL_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "ANSWER 500 engine_dead" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert "the engine stopped" in p.stderr


def test_a_text_decoding_fault_fails_only_its_request(engine, monkeypatch):
    """Decoding one request's streamed text raises: that stream ends with an error event, the stream next to it
    completes normally, no block stays held."""
    from pagedkv.engine import LLM
    from pagedkv.server.async_engine import AsyncEngine
    from pagedkv.server.launch import make_server

    real = AsyncEngine._visible_text

    def picky(req, tokens):
        if req.params.seed == 666:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, tokens)

    monkeypatch.setattr(AsyncEngine, "_visible_text", staticmethod(picky))
    llm = LLM(engine.paged, num_gpu_blocks=32, max_num_seqs=4, block_size=16)
    srv = make_server(llm, model_name=MODEL).start_in_thread()

    async def one(http, seed):
        body = {"prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "stream": True, "seed": seed}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            return [ln async for ln in r.aiter_lines() if ln]

    async def both():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(one(http, 1), one(http, 666)), 120)

    try:
        good, bad = asyncio.run(both())
        assert good[-1] == "data: [DONE]" and "error" not in good[-2]
        assert json.loads(bad[-2][6:])["error"]["code"] == "internal_error" and bad[-1] == "data: [DONE]"
        wait_idle(srv)
        assert llm.block_manager.stats.gpu_usage == 0.0 and srv.engine.faults == 1
        llm.block_manager.check_invariants()
    finally:
        srv.close()
