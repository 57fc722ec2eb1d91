"""``pagedkv router`` in front of three ``pagedkv serve`` replicas on the loopback (threads of this process over
the session's loaded weights, small KV pools, KV events on free ports): prefix routing with cached tokens in
usage, greedy outputs equal to the offline engine's (plain and streamed), bad requests, a resync after lost
events, a router restarted on a Redis index, and a replica killed mid-run. Every request is small and every
wait bounded."""

from __future__ import annotations

import json
import threading
import time

import pytest
from stub_replica import wait_for as _wait_for
from pagedkv.engine.config import CacheConfig

pytestmark = pytest.mark.engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")
pytest.importorskip("prometheus_client")

MODEL = "smollm2-test"
BLOCK = 16
SYSTEM = ("You are a helpful assistant for the pagedkv project. Answer briefly and precisely, using the documents "
          "you are given. ")


def make_replica(engine, blocks=64):
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=blocks, max_num_seqs=8, block_size=BLOCK,
              cache_config=CacheConfig(enable_kv_events=True))
    return make_server(llm, model_name=MODEL, kv_events_endpoint="tcp://127.0.0.1:*",
                       kv_events_replay_endpoint="tcp://127.0.0.1:*").start_in_thread()


def make_router(engine, replicas, index=None, route="prefix", health_interval=0.5):
    from pagedkv.engine.tokenizer import GGUFTokenizer
    from pagedkv.router.app import RouterServer
    from pagedkv.router.prompt import PromptBuilder
    from pagedkv.router.state import Replica, RouterState

    reps = [Replica(s.url, s.publisher.endpoint, s.publisher.replay_endpoint) for s in replicas]
    state = RouterState(reps, index, route=route, block_size=BLOCK)
    builder = PromptBuilder(GGUFTokenizer(engine.tokenizer_meta), BLOCK)
    router = RouterServer(state, builder, port=0, health_interval=health_interval).start_in_thread()
    time.sleep(0.3)  # SUB sockets connect
    return router


@pytest.fixture(scope="module")
def cluster(engine):
    reps = [make_replica(engine) for _ in range(3)]
    router = make_router(engine, reps)
    yield reps, router
    router.close()
    for r in reps:
        try:
            r.close()
        except Exception:
            pass


@pytest.fixture(scope="module")
def offline(engine):
    from pagedkv.engine import LLM

    return LLM(engine.paged, num_gpu_blocks=256, max_num_seqs=8, block_size=BLOCK)


def complete(url, prompt, max_tokens=4, **kw):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, **kw}, timeout=120)
    return r


def wait_for(cond, timeout=15.0):
    return _wait_for(cond, timeout)


def wait_events(router, replica_url, prompt_ids, timeout=15.0):
    """Until the router's index holds every full block of ``prompt_ids`` on ``replica_url``."""
    from pagedkv import block_hashes

    hashes = block_hashes(prompt_ids, BLOCK)
    st = router.state
    return wait_for(lambda: st.index.longest_prefix(hashes).get(replica_url, 0) == len(hashes), timeout)


def doc(i):
    return SYSTEM + f"Document {i}: " + " ".join(f"fact {i}.{k} is about topic {k * i % 7}" for k in range(14))


def test_shared_prefixes_land_where_they_are_cached_and_load_stays_balanced(cluster, engine):
    reps, router = cluster
    tok = router.builder.tokenizer
    first = {}
    for i in range(3):  # three documents, cold: spread over the three replicas
        r = complete(router.url, doc(i) + " Question: what is fact 1?")
        assert r.status_code == 200, r.text
        first[i] = r.headers["x-pagedkv-replica"]
        assert wait_events(router, first[i], tok.encode(doc(i), add_special_tokens=True)[:-2])
    assert len(set(first.values())) == 3
    for q in range(2):  # follow-ups share the document: each lands where it is cached
        for i in range(3):
            r = complete(router.url, doc(i) + f" Question: what is fact {q + 2}?")
            assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == first[i]
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(r.headers["x-pagedkv-predicted-cached-tokens"])
            assert cached > 0 and predicted > 0 and abs(cached - predicted) <= BLOCK
    text = httpx.get(router.url + "/metrics").text
    counts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("pagedkv_router_decisions_total{")]
    assert len(counts) == 3 and max(counts) == min(counts) == 3
    assert "pagedkv_router_index_blocks" in text and "pagedkv_router_event_lag_seconds" in text


def test_greedy_outputs_equal_the_offline_engine_plain_and_streamed(cluster, offline):
    from pagedkv.engine import SamplingParams

    _, router = cluster
    prompts = [doc(0) + " Summarise.", "The capital of France is"]
    want = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                                                        use_tqdm=False)]
    for p, w in zip(prompts, want):
        r = complete(router.url, p, max_tokens=6)
        assert r.json()["choices"][0]["text"] == w
        with httpx.stream("POST", router.url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0,
                                "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == w
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    r = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want


def test_bad_requests_get_clear_4xx(cluster):
    _, router = cluster
    u = router.url
    r = httpx.post(u + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(u + "/v1/completions", json={"model": MODEL, "prompt": ""}).status_code == 400
    assert httpx.post(u + "/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    r = httpx.post(u + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # the replica's answer
    assert httpx.get(u + "/v1/nothing").status_code == 404
    assert httpx.get(u + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(u + "/health").status_code == 200


def test_lost_events_force_a_resync_that_restores_the_index(cluster):
    reps, router = cluster
    sub = router.subscriber
    tok = router.builder.tokenizer
    prompt = doc(7) + " Question?"
    r = complete(router.url, prompt)
    url = r.headers["x-pagedkv-replica"]
    assert wait_events(router, url, tok.encode(doc(7), add_special_tokens=True)[:-2])
    before = sub.feeds[url].resyncs
    sub.drop_next(url, 10**6)  # lose every message of that replica from now on ...
    p2 = doc(8) + " Question?"
    # send the request straight to the replica (the router would pick any), so its events go missing
    rep = next(s for s in reps if s.url == url)
    assert complete(rep.url, p2).status_code == 200
    ids2 = tok.encode(doc(8), add_special_tokens=True)[:-2]
    time.sleep(0.5)
    assert not wait_events(router, url, ids2, timeout=0.5)  # the index missed it
    sub.feeds[url].dropping = 0  # ... then messages flow again: the next one reveals the gap
    assert complete(rep.url, doc(9) + " Another question?").status_code == 200
    assert wait_events(router, url, ids2)
    assert sub.feeds[url].resyncs == before + 1
    assert "pagedkv_router_resyncs_total" in httpx.get(router.url + "/metrics").text


def test_a_router_restarted_on_the_redis_index_routes_by_prefix_at_once(cluster, engine, tmp_path):
    from redis_server import RedisServer

    from pagedkv.cluster import RedisIndex

    reps, _ = cluster
    srv = RedisServer(tmp_path)
    try:
        r1 = make_router(engine, reps, RedisIndex(srv.url, prefix="rt"))
        try:
            r = complete(r1.url, doc(11) + " First question?")
            url = r.headers["x-pagedkv-replica"]
            assert wait_events(r1, url, r1.builder.tokenizer.encode(doc(11), add_special_tokens=True)[:-2])
        finally:
            r1.close()
        r2 = make_router(engine, reps, RedisIndex(srv.url, prefix="rt"))
        try:
            r = complete(r2.url, doc(11) + " Second question?")
            assert r.headers["x-pagedkv-replica"] == url
            assert int(r.headers["x-pagedkv-predicted-cached-tokens"]) > 0
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        finally:
            r2.close()
    finally:
        srv.stop()


def test_the_router_tokenizer_reads_only_metadata_and_matches_the_engine(engine):
    from pagedkv.router.prompt import PromptBuilder, load_tokenizer

    tok = load_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld! 12345 <|im_end|>"}]
    assert tok.apply_chat_template(msgs) == engine.tokenizer.apply_chat_template(msgs)
    for text in ("The capital of France is", "  spaces\n\ttabs 3.14159 ünïcödé 🙂"):
        assert tok.encode(text, add_special_tokens=True) == engine.tokenizer.encode(text, add_special_tokens=True)
    b = PromptBuilder(tok, BLOCK)
    rp = b.build("chat", json.dumps({"model": MODEL, "messages": msgs, "cache_salt": "t1"}).encode())
    from pagedkv import block_hashes

    ids = engine.tokenizer.apply_chat_template(msgs)
    assert rp.token_ids == ids and rp.namespace == "t1" and rp.hashes == block_hashes(ids, BLOCK, "t1")


def test_the_router_command_in_a_subprocess(cluster):
    import os
    import socket
    import subprocess
    import sys

    reps, router = cluster
    first = complete(router.url, doc(3) + " First question?").headers["x-pagedkv-replica"]
    n_doc = len(router.builder.tokenizer.encode(doc(3), add_special_tokens=True)) - 2
    assert wait_events(router, first, router.builder.tokenizer.encode(doc(3), add_special_tokens=True)[:-2])
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedkv.cli", "router", "--port", str(port), "--health-interval", "0.5"]
    for r in reps:
        cmd += ["--backend", f"{r.url},{r.publisher.endpoint},{r.publisher.replay_endpoint}"]
    env = dict(os.environ)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ok(url + "/health"), timeout=60), proc.stdout.read1() if proc.poll() else ""
        r = complete(url, doc(3) + " One more question?")
        # the new router learnt doc(3)'s blocks from the replicas' replay sockets: it goes where they are
        assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == first
        predicted = int(r.headers["x-pagedkv-predicted-cached-tokens"])
        assert predicted >= n_doc // BLOCK * BLOCK
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= predicted
        assert "pagedkv_router_decisions_total" in httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_replica_loses_no_request_that_had_not_started(cluster, engine):
    """Mid-run: streamed requests are in flight on every replica when the one holding a document's prefix is
    killed. Requests in flight elsewhere finish; those sent afterwards (which the index would send to the dead
    replica) are retried on the others and all succeed; the dead replica leaves routing and the index. Only a
    request that had already started on the killed replica may end early."""
    reps, router = cluster
    tok = router.builder.tokenizer
    r = complete(router.url, doc(20) + " Question?")
    victim = r.headers["x-pagedkv-replica"]
    assert wait_events(router, victim, tok.encode(doc(20), add_special_tokens=True)[:-2])
    router.health.interval = 60  # the router must find out from the requests themselves
    time.sleep(0.8)
    retries = router.metrics.retries
    before, after = [], []

    def streamed(i, out):
        body = {"model": MODEL, "prompt": doc(30 + i) + " Go on.", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as s:
                lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
                out.append((s.headers.get("x-pagedkv-replica"), s.status_code, lines[-1:] == ["data: [DONE]"]))
        except httpx.HTTPError as e:
            out.append((None, 0, str(e)))

    running = [threading.Thread(target=streamed, args=(i, before)) for i in range(6)]
    for t in running:
        t.start()
    time.sleep(1.0)  # all six routed (two per replica) and generating
    next(s for s in reps if s.url == victim).close()

    def one(i):
        after.append(complete(router.url, doc(20) + f" Question {i}?"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads + running:
        t.join(120)
    assert len(after) == 6 and all(x.status_code == 200 for x in after), [x.text for x in after]
    assert all(x.headers["x-pagedkv-replica"] != victim for x in after)
    assert 1 <= router.metrics.retries - retries <= 6  # those sent to the victim before it left routing
    assert len(before) == 6 and all(ok for rep, code, ok in before if rep != victim), before
    assert sum(rep != victim for rep, _, _ in before) >= 3
    assert not router.state.replicas[victim].healthy
    assert router.state.index.num_blocks(victim) == 0
    text = httpx.get(router.url + "/metrics").text
    assert f'pagedkv_router_replica_healthy{{replica="{victim}"}} 0.0' in text
    assert httpx.get(router.url + "/health").status_code == 200


def test_kill_9_of_a_real_replica_mid_stream(cluster, engine, tmp_path):
    """A ``pagedkv serve`` process killed with SIGKILL while it streams: the client's stream ends with an error
    event in OpenAI's shape (never a silent end: no [DONE] either), the router's in-flight counts return to 0,
    the dead replica leaves routing and the next request is served by a live one."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from pagedkv.router.app import RouterServer
    from pagedkv.router.prompt import PromptBuilder
    from pagedkv.router.state import Replica, RouterState

    reps, _ = cluster
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = open(tmp_path / "replica.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--num-gpu-blocks",
                             "64", "--max-num-seqs", "4", "--served-model-name", MODEL], stdout=log, stderr=log)
    victim = f"http://127.0.0.1:{port}"
    router = None
    try:
        assert wait_for(lambda: _ok(victim + "/health"), timeout=120), (tmp_path / "replica.log").read_text()
        state = RouterState([Replica(victim), Replica(reps[0].url)], route="least-loaded", block_size=BLOCK)
        router = RouterServer(state, PromptBuilder(router_tokenizer(engine), BLOCK), port=0,
                              health_interval=0.3, health_fails=2).start_in_thread()
        body = {"model": MODEL, "prompt": doc(40) + " Go on.", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        lines = None
        for _ in range(4):  # least-loaded alternates: one of the first two streams lands on the victim
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as s:
                if s.headers["x-pagedkv-replica"] != victim:
                    continue
                it = s.iter_lines()
                first = data_of([next(it) for _ in range(6)])
                os.kill(proc.pid, signal.SIGKILL)
                lines = first + data_of(it)
                break
        assert lines is not None
        assert len(first) == 3 and all("choices" in json.loads(ln[6:]) for ln in first)
        assert "data: [DONE]" not in lines
        err = json.loads(lines[-1][6:])["error"]
        assert err["type"] == "server_error" and err["code"] == "replica_failed"
        assert wait_for(lambda: all(r.inflight == 0 and r.inflight_tokens == 0 for r in state.replicas.values()))
        r = complete(router.url, "The capital of France is")
        assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == reps[0].url
        assert wait_for(lambda: state.routable() == [reps[0].url])
    finally:
        if router is not None:
            router.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()


def router_tokenizer(engine):
    from pagedkv.engine.tokenizer import GGUFTokenizer

    return GGUFTokenizer(engine.tokenizer_meta)


def data_of(lines):
    return [ln for ln in lines if ln.startswith("data: ")]
