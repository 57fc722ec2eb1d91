"""``pagedkv serve`` with real clients on the loopback: the official ``openai`` package and raw HTTP (httpx).

One server per module (127.0.0.1, a free port, a background thread, an API key) over the session's already
loaded weights, and an offline ``LLM`` on the same weights for the expected outputs. Every request is small
(max_tokens <= 8) and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from engine_helpers import fail_sampling_of_seed, free_port, wait_healthy
from pagedkv.engine.config import CacheConfig, SchedulerConfig

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

KEY = "test-key"
MODEL = "smollm2-test"
BLOCK = 16


@pytest.fixture(scope="module")
def offline(engine):
    from pagedkv.engine import LLM

    return LLM(engine.paged, num_gpu_blocks=256, max_num_seqs=8, block_size=BLOCK)


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=96, max_num_seqs=16, block_size=BLOCK)
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=64).start_in_thread()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(max_tokens=8, **kw):
    from pagedkv.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def wait_idle(server, timeout=30.0) -> None:
    """Until the engine holds no request (aborts are applied between steps)."""
    deadline = time.monotonic() + timeout
    while server.engine.num_unfinished or server.engine.llm.scheduler.has_unfinished():
        assert time.monotonic() < deadline, "requests are stuck in the engine"
        time.sleep(0.02)
    time.sleep(0.05)  # the snapshot is taken right after the step that finished them


def metric(server, name: str, label: str = "") -> float:
    """The value of ``name`` (its first sample whose labels contain ``label``; 0 if there is none with a label)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(label)}[^}}]*}} (\S+)$", text, re.M)
    if m is None and label:
        return 0.0
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_openai_client_completions_and_chat_match_llm_generate(server, client, offline):
    prompt = "The capital of France is"
    want = offline.generate(prompt, greedy(), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == want.outputs[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # streamed: the pieces concatenate to the same text, then usage, then [DONE] (the SDK checks it)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and len([c for c in chunks if c.choices]) >= 2
    # token ids as the prompt
    ids = list(want.prompt_token_ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == want.outputs[0].text

    conv = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline.chat(conv, greedy(), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=conv, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_parallel_sampling_with_a_seed_and_default_max_tokens(server, client, offline):
    from pagedkv.engine import SamplingParams

    sp = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    want = [o.text for o in offline.generate("Once upon a time", sp, use_tqdm=False)[0].outputs]
    kw = dict(model=MODEL, prompt="Once upon a time", n=2, temperature=0.8, seed=7, max_tokens=6,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want and r.usage.completion_tokens == 12
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    # a chat without max_tokens may use the rest of the KV cache (small here), not fail for the context's sake
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 200


def test_stop_strings_and_sse_framing(server, offline):
    prompt = "1, 2, 3, 4,"
    want = offline.generate(prompt, greedy(max_tokens=8, stop=(" 6",)), use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": " 6", "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_models_health_and_api_key(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                       headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)


BAD_REQUESTS = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    (json.dumps({"model": MODEL}).encode(), 400),  # no prompt
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "8"}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 999}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 5}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": [1, -5]}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400),
    (json.dumps({"model": MODEL, "prompt": [1] * 9000}).encode(), 400),  # longer than the context
    (json.dumps({"model": MODEL, "prompt": [1] * 2000}).encode(), 400),  # longer than the KV cache
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4000}).encode(), 400),  # never fits the cache
    (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404),
]


def test_bad_requests_get_openai_errors_and_change_nothing(server):
    bm = server.engine.llm.block_manager
    before = (bm.num_free_gpu_blocks, bm.stats.num_cached_blocks, server.engine.llm.scheduler.stats.finished)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body, status in BAD_REQUESTS:
        r = httpx.post(server.url + "/v1/completions", content=body, headers=h, timeout=10)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"], err
    chat_bad = [{"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                {"model": MODEL, "messages": "hello"}]
    for body in chat_bad:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(server.url + "/v1/nowhere", headers=h, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    assert (bm.num_free_gpu_blocks, bm.stats.num_cached_blocks, server.engine.llm.scheduler.stats.finished) == before
    assert not server.engine.num_unfinished
    bm.check_invariants()


def test_full_waiting_queue_answers_503(server, client):
    engine = server.engine
    saved = engine.max_waiting
    engine.max_waiting = 0  # every new request finds the queue full
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        assert not engine.num_unfinished
    finally:
        engine.max_waiting = saved
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_non_streaming_client_that_hangs_up_aborts_its_request(server):
    wait_idle(server)
    aborted = metric(server, "pagedkv:request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10, read=0.5))
    wait_idle(server, timeout=10)  # 500 tokens would take far longer than this
    assert metric(server, "pagedkv:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert server.engine.llm.block_manager.stats.gpu_usage == 0.0


def test_cache_salt_isolates_prefix_cache_tenants(server):
    h = {"Authorization": f"Bearer {KEY}"}
    prompt = "Tell me a story about a paged KV cache that was shared by many tenants, " * 2  # > 2 blocks

    def cached(salt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(server.url + "/v1/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    hit = cached("tenant-a")
    assert hit >= 2 * BLOCK and hit % BLOCK == 0  # the same tenant shares its prefix
    assert cached("tenant-b") == 0  # another tenant does not, although the prompt is the same
    assert cached(None) == 0  # nor does the default namespace
    assert cached("tenant-b") == hit and cached(None) == hit


def test_metrics_after_traffic(server, client):
    client.completions.create(model=MODEL, prompt="Metrics are", max_tokens=4, temperature=0)
    wait_idle(server)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("pagedkv:num_requests_running", "pagedkv:num_requests_waiting", "pagedkv:kv_cache_usage_perc",
                 "pagedkv:prefix_cache_queries_total", "pagedkv:prefix_cache_hits_total",
                 "pagedkv:num_preemptions_total", "pagedkv:prompt_tokens_total", "pagedkv:generation_tokens_total",
                 "pagedkv:time_to_first_token_seconds_bucket", "pagedkv:inter_token_latency_seconds_bucket",
                 "pagedkv:e2e_request_latency_seconds_count"):
        assert name in text, name
    assert metric(server, "pagedkv:kv_cache_usage_perc") == 0.0
    assert metric(server, "pagedkv:num_requests_running") == 0.0
    assert metric(server, "pagedkv:generation_tokens_total") >= 4
    assert metric(server, "pagedkv:prompt_tokens_total") >= 3
    q, h = metric(server, "pagedkv:prefix_cache_queries_total"), metric(server, "pagedkv:prefix_cache_hits_total")
    assert q > h > 0  # the cache_salt test hit the cache
    assert metric(server, "pagedkv:e2e_request_latency_seconds_count") >= 1


def test_load_with_disconnects_and_bad_requests(server, offline):
    """32 concurrent streaming clients: 8 hang up after their first chunk, 4 send bad requests. Afterwards no
    request is stuck, no block is held, the manager's invariants hold, and every completed output equals the
    offline engine's."""
    n_clients, max_tokens = 32, 8
    prompts = [f"Request number {i} asks: what is {i} plus {i}?" for i in range(n_clients)]
    role = ["ok"] * n_clients
    for i in range(0, n_clients, 4):
        role[i] = "disconnect"
    for i in range(1, n_clients, 8):
        role[i] = "bad"
    h = {"Authorization": f"Bearer {KEY}"}

    async def one(http: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        if role[i] == "disconnect":
            body["max_tokens"] = 100  # still generating when the client hangs up
        if role[i] == "bad":
            body["top_k"] = -7
        async with http.stream("POST", "/v1/completions", json=body, headers=h) as r:
            if role[i] == "bad":
                await r.aread()
                return r.status_code, r.json()
            assert r.status_code == 200
            text, done = "", False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                if role[i] == "disconnect":
                    return "gone", None  # leaving the block closes the connection mid-stream
            return ("done" if done else "cut"), text

    async def run():
        limits = httpx.Limits(max_connections=n_clients + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(n_clients))), 240)

    aborted = metric(server, "pagedkv:request_success_total", 'finished_reason="abort"')
    results = asyncio.run(run())
    wait_idle(server)
    bm = server.engine.llm.block_manager
    bm.check_invariants()
    assert bm.stats.gpu_usage == 0.0 and metric(server, "pagedkv:kv_cache_usage_perc") == 0.0
    assert metric(server, "pagedkv:num_requests_running") == 0 and metric(server, "pagedkv:num_requests_waiting") == 0
    ok = [i for i in range(n_clients) if role[i] == "ok"]
    want = offline.generate([prompts[i] for i in ok], greedy(max_tokens, ignore_eos=True), use_tqdm=False)
    for i, w in zip(ok, want):
        assert results[i] == ("done", w.outputs[0].text), i
    for i in range(n_clients):
        if role[i] == "bad":
            status, err = results[i]
            assert status == 400 and err["error"]["param"] == "top_k"
        elif role[i] == "disconnect":
            assert results[i][0] == "gone"
    # every hung-up client's request was aborted (not run to its 100 tokens)
    n_gone = role.count("disconnect")
    assert metric(server, "pagedkv:request_success_total", 'finished_reason="abort"') == aborted + n_gone


def test_bench_serve_reports_vllm_style_figures(server):
    from pagedkv.server.bench import make_prompts, run_benchmark

    prompts = make_prompts(4, 40, 32, seed=3, low=1000, high=20000)
    s = asyncio.run(asyncio.wait_for(run_benchmark(server.url, None, prompts, 4, max_concurrency=1, api_key=KEY,
                                                   progress=False), 120))
    assert s["model"] == MODEL and s["completed"] == 4 and s["failed"] == 0
    assert s["total_output_tokens"] == 16 and s["total_prompt_tokens"] == 160
    assert s["cached_prompt_tokens"] == 3 * 32  # one at a time: requests 2..4 reuse the 32-token shared prefix
    for k in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
              "p99_tpot_ms", "median_itl_ms", "p99_itl_ms"):
        assert s[k] > 0, k
    assert s["p99_ttft_ms"] >= s["median_ttft_ms"]


def test_serve_command_in_a_subprocess(tmp_path):
    """``pagedkv serve`` as users start it: loopback, a free port, the default model; stopped by SIGINT."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    port, ev_port, replay_port = free_port(), free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--num-gpu-blocks",
                             "32", "--api-key", "k", "--served-model-name", "smol",
                             "--kv-events-endpoint", f"tcp://127.0.0.1:{ev_port}",
                             "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120)
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens <= 3 and r.choices[0].message.content
        # the prompt's full blocks were announced: ask the replay socket
        import zmq

        from pagedkv.server.kv_events import END_SEQ, decode_payload

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10000)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        names = []
        while True:
            *_, seq, payload = dealer.recv_multipart()  # ([b"", topic, seq, payload]: vLLM 0.33's framing)
            if seq == END_SEQ:
                break
            names += [type(e).__name__ for e in decode_payload(payload).events]
        dealer.close(0)
        assert "BlockStored" in names
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_kv_events_rebuild_the_cached_key_set(engine):
    """A subscriber of the server's KV events rebuilds exactly the block manager's set of cached block keys,
    through evictions (a small pool), from the live stream plus the replay socket."""
    import zmq

    from pagedkv.engine import LLM
    from pagedkv.server.kv_events import END_SEQ, decode_payload
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=12, max_num_seqs=4, block_size=BLOCK,
              cache_config=CacheConfig(enable_kv_events=True))
    srv = make_server(llm, model_name=MODEL, kv_events_endpoint="tcp://127.0.0.1:*",
                      kv_events_replay_endpoint="tcp://127.0.0.1:*").start_in_thread()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(srv.publisher.endpoint)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompts = [f"Story {i}: " + "once upon a time there was a block of sixteen tokens " * 5 for i in range(6)]
        prompts += prompts[:2]  # hits
        for p in prompts:
            c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        wait_idle(srv)
        srv.publisher.flush()
        live = {}
        while True:
            try:
                _, seq, payload = sub.recv_multipart()
            except zmq.Again:
                break
            live[int.from_bytes(seq, "big")] = payload
        # fill the gaps (a PUB socket drops what it sends before the subscription arrives) from the replay socket
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(srv.publisher.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()  # vLLM 0.33's framing
            assert empty == b"" and topic == (b"" if seq == END_SEQ else b"kv-events")
            if seq == END_SEQ:
                break
            live.setdefault(int.from_bytes(seq, "big"), payload)
        dealer.close(0)
        assert sorted(live) == list(range(srv.publisher.next_seq)) and live
        keys: set = set()
        removed = 0
        for num in sorted(live):
            for e in decode_payload(live[num]).events:
                name = type(e).__name__
                if name == "BlockStored":
                    assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
                    keys.update(e.block_hashes)
                elif name == "BlockRemoved":
                    removed += len(e.block_hashes)
                    keys.difference_update(e.block_hashes)
                else:
                    keys.clear()
        assert removed > 0  # the pool is small: blocks were evicted
        assert keys == set(llm.block_manager._cache.mapping())
        import pagedkv

        # the last prompt's full blocks are cached under these keys
        ids = llm.tokenizer.encode(prompts[-1], add_special_tokens=True)
        full = ids[: len(ids) // BLOCK * BLOCK]
        assert full and set(pagedkv.block_hashes(full, BLOCK, None)) <= keys
    finally:
        sub.close(0)
        srv.close()


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(engine):
    """A forward pass that raises fails the requests of its step (500, OpenAI's shape); the engine goes on:
    /health stays 200, no block is held, the invariants hold, the next request is served."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=16, max_num_seqs=2, block_size=BLOCK)
    real = llm.core._execute

    def broken(*_a, **_k):
        raise RuntimeError("injected")

    llm.core._execute = broken
    srv = make_server(llm, model_name=MODEL).start_in_thread()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200 and json.loads(lines[-2][6:])["error"]["code"] == "internal_error"
        assert lines[-1] == "data: [DONE]"
        llm.core._execute = real
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        wait_idle(srv)
        assert llm.block_manager.stats.gpu_usage == 0.0 and srv.engine.faults == 2 and srv.engine.alive
        llm.block_manager.check_invariants()
    finally:
        srv.close()


def test_a_sampler_fault_fails_only_its_request(engine, offline, monkeypatch):
    """Sampling that raises for one request (its logits, its parameters) fails that request alone: the request
    next to it in the same steps gets exactly the offline engine's output."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    fail_sampling_of_seed(monkeypatch, "injected: probabilities are not finite")  # every sampler raises for seed 666
    llm = LLM(engine.paged, num_gpu_blocks=32, max_num_seqs=4, block_size=BLOCK)
    srv = make_server(llm, model_name=MODEL).start_in_thread()
    prompt = "The capital of France is"
    want = offline.generate(prompt, greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text

    async def both():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            good = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True})
            bad = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "seed": 666})
            return await asyncio.wait_for(asyncio.gather(good, bad), 120)

    try:
        good, bad = asyncio.run(both())
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "internal_error"
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == want
        wait_idle(srv)
        assert llm.block_manager.stats.gpu_usage == 0.0 and srv.engine.faults == 1 and srv.engine.alive
        llm.block_manager.check_invariants()
    finally:
        srv.close()


def test_a_broken_scheduler_stops_the_engine_and_says_so(engine):
    """A fault that leaves the engine unusable (here the scheduler itself raises) fails the requests in flight,
    turns /health and new requests to 503, and calls on_fatal (``pagedkv serve`` then exits non-zero)."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=16, max_num_seqs=2, block_size=BLOCK)

    def broken(*_a, **_k):
        raise RuntimeError("injected")

    llm.scheduler.schedule = broken
    srv = make_server(llm, model_name=MODEL).start_in_thread()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "error" in r.json()
        assert srv.fatal is not None and "injected" in srv.fatal
    finally:
        srv.close()


def test_priority_field_reaches_the_block_manager(engine):
    """A server with --scheduling-policy priority: the request's ``priority`` is the class its cached blocks are
    evicted in (lower-priority blocks first), and a bad value is a 400."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=4, block_size=BLOCK,
              scheduler_config=SchedulerConfig(scheduling_policy="priority"),
              cache_config=CacheConfig(eviction_policy="slru", kv_cache_groups=False))
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=8).start_in_thread()
    try:
        h = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "Priorities order the eviction of cached blocks " * 2, "max_tokens": 1,
                "temperature": 0, "priority": 9}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        wait_idle(srv)
        ev = llm.block_manager._cache.evictor
        assert 9 in ev.classes and len(ev.classes[9]) > 0  # its full blocks wait in the class of priority 9
        r = httpx.post(srv.url + "/v1/completions", json={**body, "priority": "high"}, headers=h, timeout=60)
        assert r.status_code == 400 and "priority" in r.text
    finally:
        srv.close()


def test_pins_through_the_server(engine, server):
    """POST /v1/pins computes a prefix that is not cached and pins it (a later request hits it after pressure that
    evicts everything else), GET lists the pins, DELETE drops one; bad input is a 400, past the budget a 409, an
    unknown pin a 404, and a server without a pin budget answers 400 (pinning_disabled)."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=20, max_num_seqs=4, block_size=BLOCK,
              cache_config=CacheConfig(pin_budget_blocks=4, kv_cache_groups=False))
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=8).start_in_thread()
    h = {"Authorization": f"Bearer {KEY}"}
    system = list(range(300, 350))  # 50 tokens: 3 full blocks of 16
    try:
        r = httpx.post(srv.url + "/v1/pins", json={"model": MODEL, "prompt": system, "ttl": 600}, headers=h,
                       timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["num_tokens"], got["num_blocks"], got["ttl"], got["prompt_tokens"]) == (48, 3, 600, 50)
        pid = got["pin_id"]
        assert pid and llm.block_manager.retention.num_pinned_blocks == 3
        listed = httpx.get(srv.url + "/v1/pins", headers=h, timeout=30).json()
        assert [p["pin_id"] for p in listed["data"]] == [pid] and listed["num_pinned_blocks"] == 3
        assert listed["pin_budget_blocks"] == 4
        # pressure: prompts that need every other block, twice over
        for i in range(4):
            body = {"model": MODEL, "prompt": list(range(1000 + 100 * i, 1090 + 100 * i)), "max_tokens": 4,
                    "temperature": 0}
            assert httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60).status_code == 200
        assert llm.block_manager.stats.evictions > 0
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": system + [7, 8],
                                                           "max_tokens": 2, "temperature": 0}, headers=h, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        # past the budget: 409, nothing pinned
        r = httpx.post(srv.url + "/v1/pins", json={"prompt": list(range(500, 540))}, headers=h, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "pin_budget_exceeded"
        assert llm.block_manager.retention.num_pinned_blocks == 3
        for bad in ({"prompt": system, "ttl": 0}, {"prompt": system, "ttl": "long"}, {},
                    {"prompt": system, "messages": [{"role": "user", "content": "x"}]}, {"prompt": system, "x": 1},
                    {"prompt": [-1, 2]}):
            r = httpx.post(srv.url + "/v1/pins", json=bad, headers=h, timeout=30)
            assert r.status_code == 400, (bad, r.text)
        assert httpx.post(srv.url + "/v1/pins", json={"prompt": system}, timeout=30).status_code == 401
        assert httpx.delete(srv.url + f"/v1/pins/{pid}", headers=h, timeout=30).json()["deleted"] is True
        assert llm.block_manager.retention.num_pinned_blocks == 0
        for gone in (str(pid), "abc", "-1"):
            r = httpx.delete(srv.url + f"/v1/pins/{gone}", headers=h, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "pin_not_found"
        llm.block_manager.check_invariants()
    finally:
        srv.close()
    r = httpx.post(server.url + "/v1/pins", json={"prompt": system}, headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "pinning_disabled"


def test_session_id_reaches_the_eviction_policy(engine):
    """``session_id`` on completions and chat: the scheduler hands it to the session policy (per tenant with a
    cache_salt), which keeps the conversation (two requests, the second a hit) over a newer one-off: the golden
    order of tests/test_eviction_policies.py through HTTP (LRU, or no hints, keeps the one-off instead); a bad
    value is a 400."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=3, max_num_seqs=2, block_size=2,
              cache_config=CacheConfig(eviction_policy="session", kv_cache_groups=False))
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=8).start_in_thread()
    h = {"Authorization": f"Bearer {KEY}"}
    try:
        for prompt, session in (([1, 2, 7], "chat"), ([1, 2, 8], "chat"), ([3, 4, 9], "one-off")):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "session_id": session}
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 11], "max_tokens": 1}, headers=h,
                       timeout=60)
        assert r.status_code == 200
        wait_idle(srv)
        bm = llm.block_manager

        def kept():
            return srv.engine.between_steps(lambda: [bm.lookup_prefix([1, 2, 0]).num_cached_tokens,
                                                     bm.lookup_prefix([3, 4, 0]).num_cached_tokens])

        assert kept() == [2, 0]
        sessions = bm._cache.evictor.sessions
        assert dict(sessions) == {"chat": 2, "one-off": 1}
        body = {"prompt": [20, 21, 22], "max_tokens": 1, "session_id": "chat", "cache_salt": "tenant-b"}
        assert httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60).status_code == 200
        wait_idle(srv)
        assert sessions[("tenant-b", "chat")] == 1 and sessions["chat"] == 2  # another tenant's "chat"
        for bad in (7, "", "x" * 300, ["a"]):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "session_id": bad}, headers=h,
                           timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", (bad, r.text)
        bm.check_invariants()
    finally:
        srv.close()


def test_kv_retention_pins_a_request_prefix_through_the_server(engine, server):
    """``kv_retention`` on a completion: the prompt's full blocks pinned once computed (the answer's
    ``kv_retention`` names the pin, GET /v1/pins lists it); the same request again reuses the pin; a chat request
    pins its rendered messages; past the budget a 409 and nothing runs; a pin longer than the prompt or a bad
    field a 400; a server without a pin budget a 400 (pinning_disabled)."""
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=24, max_num_seqs=4, block_size=BLOCK,
              cache_config=CacheConfig(pin_budget_blocks=4, kv_cache_groups=False))
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=8).start_in_thread()
    h = {"Authorization": f"Bearer {KEY}"}
    system = list(range(300, 350))  # 50 tokens: 3 full blocks of 16
    body = {"model": MODEL, "prompt": system, "max_tokens": 2, "temperature": 0,
            "kv_retention": {"pin_tokens": "prompt", "ttl": 600}}
    try:
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["kv_retention"]
        assert (got["num_tokens"], got["num_blocks"], got["ttl"], got["error"]) == (48, 3, 600, None)
        pid = got["pin_id"]
        listed = httpx.get(srv.url + "/v1/pins", headers=h, timeout=30).json()
        assert [p["pin_id"] for p in listed["data"]] == [pid] and listed["num_pinned_blocks"] == 3
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60).json()
        assert r["kv_retention"]["pin_id"] == pid and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert len(httpx.get(srv.url + "/v1/pins", headers=h, timeout=30).json()["data"]) == 1
        prefills = llm.scheduler.stats.prefills
        r = httpx.post(srv.url + "/v1/completions", headers=h, timeout=60, json={
            **body, "prompt": list(range(500, 540))})  # 2 more blocks: 5 > the budget of 4
        assert r.status_code == 409 and r.json()["error"]["code"] == "pin_budget_exceeded"
        assert llm.scheduler.stats.prefills == prefills and llm.block_manager.retention.num_pinned_blocks == 3
        # a chat request pinning its first 16 tokens (one block) fits beside the 3 pinned
        chat = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 1, "temperature": 0, "kv_retention": {"pin_tokens": 16}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["kv_retention"]["num_tokens"] == 16 and llm.block_manager.retention.num_pinned_blocks == 4
        # the budget is full, but a pin of the same prefix with another TTL holds no new block: admitted
        r = httpx.post(srv.url + "/v1/completions", headers=h, timeout=60, json={
            **body, "kv_retention": {"pin_tokens": 48, "ttl": 60}})
        assert r.status_code == 200 and r.json()["kv_retention"]["ttl"] == 60
        assert llm.block_manager.retention.num_pinned_blocks == 4 and len(llm.pins) == 3
        # streamed: the pin in a chunk with no choices before [DONE] (here the reused request pin)
        with httpx.stream("POST", srv.url + "/v1/completions", headers=h, timeout=60,
                          json={**body, "stream": True}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"] == [] and last["kv_retention"]["pin_id"] == pid
        assert all("kv_retention" not in json.loads(e) for e in events[:-2])
        for bad, param in (({"pin_tokens": 51}, "kv_retention.pin_tokens"), ({"pin_tokens": 0},
                           "kv_retention.pin_tokens"), ({"pin_tokens": 8, "ttl": -1}, "kv_retention.ttl"),
                           ("prompt", "kv_retention"), ({"ttl": 5}, "kv_retention.pin_tokens")):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "kv_retention": bad}, headers=h, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        llm.block_manager.check_invariants()
    finally:
        srv.close()
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "pinning_disabled"
