"""``pagedkv router`` with prefill and decode replicas (docs/pd-split.md), on 127.0.0.1 with bounded waits.

End to end over ``pagedkv serve``'s real app, validation and KV handoff on fake engines (tests/kv_fakes.py): the
prompt goes to a prefill replica, the decode request to a decode replica with the returned kv_transfer_params, the
blocks are read and the hold released, the answer streamed to the client as one. Faults with stub replicas in
processes (tests/stub_replica.py) killed with SIGKILL: a prefill replica lost before answering (the next one, then
a recompute on a decode replica), a decode replica lost mid-stream (an error event, never a silent truncation), no
decode replica left (503, the router releases the hold), the client's mistakes (the prefill replica's 4xx).
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from stub_replica import ProcReplica, cleanup, make_router, metric, settled, wait_for  # noqa: E402,F401

BLOCK = 4


def sse_texts(lines):
    out = []
    for ln in lines:
        if ln.startswith("data: {"):
            out.append(json.loads(ln[6:]))
    return out


# ------------------------------------------------------------------------------------------------ end to end
def test_split_end_to_end_over_the_real_server_app(cleanup):
    pytest.importorskip("torch")  # (the server app builds the engine's SamplingParams)
    from kv_fakes import FakePort, block_payload, fake_server

    pport, dport = FakePort(BLOCK), FakePort(BLOCK)
    p_url, p_engine, p_kv, p_close = fake_server("prefill", pport)
    d_url, d_engine, d_kv, d_close = fake_server("decode", dport)
    cleanup += [p_close, d_close]
    router = make_router(prefill=[p_url], decode=[d_url])
    cleanup.append(router)
    prompt = "a prompt long enough for some blocks"  # 36 bytes: 8 whole blocks before the last token
    ids = list(prompt.encode())
    want = [block_payload(ids[i:i + BLOCK], 64) for i in range(0, 32, BLOCK)]

    with httpx.stream("POST", router.url + "/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        assert s.headers["x-pagedkv-replica"] == d_url and s.headers["x-pagedkv-prefill-replica"] == p_url
        lines = list(s.iter_lines())
    chunks = sse_texts(lines)
    assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).count(" t") == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # read, not computed
    # the prefill replica computed 1 token, not streamed; the decode replica read its 8 blocks and released them
    pre, dec = p_engine.submitted[-1], d_engine.submitted[-1]
    assert pre.params.max_tokens == 1 and dec.params.max_tokens == 4
    assert dport.attached[dec.request_id] == want
    assert wait_for(lambda: p_kv.num_holds == 0 and pport.released == [1])
    assert wait_for(lambda: settled(router))

    # not streamed, a chat-less completion: the same flow, JSON answer
    r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt + "!", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "kv_transfer_params" not in r.json()
    assert wait_for(lambda: p_kv.num_holds == 0 and len(pport.released) == 2)

    # the client's own kv_transfer_params are validated (400 at the router) and never reach a replica
    n = len(p_engine.submitted)
    r = httpx.post(router.url + "/v1/completions", timeout=30,
                   json={"prompt": prompt, "kv_transfer_params": {"do_remote_prefill": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.do_remote_prefill"
    # n > 1 skips the split (a hold hands one sequence's blocks to one decode request): computed whole on the
    # decode replica, never sent to a prefill replica (which refuses n > 1 with kv_transfer_params)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == d_url
    assert "x-pagedkv-prefill-replica" not in r.headers and "kv_transfer_params" not in r.json()
    dec = d_engine.submitted[-1]
    assert dec.params.n == 2 and dec.params.max_tokens == 2 and dec.request_id not in dport.attached
    assert len(p_engine.submitted) == n and not metric(router, "pagedkv_router_pd_client_errors_total")
    assert wait_for(lambda: settled(router))


# ------------------------------------------------------------------------------------------------ faults
def test_prefill_replicas_lost_before_answering(cleanup):
    """The first prefill replica is killed while it computes: the next one takes the prompt; when none is left
    the decode replica computes the whole prompt (a recompute), never an error for the client."""
    p1, p2, d = ProcReplica(5.0), ProcReplica(0.01), ProcReplica(0.01)
    cleanup += [p1, p2, d]
    router = make_router(prefill=[p1.url, p2.url], decode=[d.url])
    cleanup.append(router)
    body = {"prompt": "some prompt of twenty", "max_tokens": 3}

    import threading

    out = {}

    def go():
        out["r"] = httpx.post(router.url + "/v1/completions", json=body, timeout=30)

    # p1 is chosen first (the tie goes to the first replica); it sleeps 5 s per token: killed meanwhile (a
    # shorter delay lets a loaded machine answer before the kill)
    t = threading.Thread(target=go)
    t.start()
    assert wait_for(lambda: p1.stats()["requests"] == 1, 10)
    p1.close()
    t.join(30)
    r = out["r"]
    assert r.status_code == 200 and r.headers["x-pagedkv-prefill-replica"] == p2.url
    assert r.headers["x-pagedkv-replica"] == d.url and r.json()["choices"][0]["text"] == " t0 t1 t2"
    assert d.stats()["kv_params"][-1]["remote_request_id"] == "h0"  # p2's hold went to the decode replica
    assert d.stats()["kv_params"][-1]["remote_port"] == int(p2.url.rsplit(":", 1)[1])
    assert wait_for(lambda: settled(router))

    # no prefill replica left: the decode replica computes the prompt itself (no kv_transfer_params)
    p2.close()
    r = httpx.post(router.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == d.url and "data: [DONE]" in r.text
    last = d.stats()["bodies"][-1]
    assert "kv_transfer_params" not in last and last["max_tokens"] == 3 and last["stream"] is True
    assert metric(router, "pagedkv_router_pd_recomputes_total") >= 1
    assert wait_for(lambda: settled(router))


def test_decode_replica_lost_mid_stream_is_an_error_event(cleanup):
    p, d = ProcReplica(0.01), ProcReplica(0.05)
    cleanup += [p, d]
    router = make_router(prefill=[p.url], decode=[d.url])
    cleanup.append(router)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                      json={"prompt": "a prompt of twenty b", "max_tokens": 400, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["x-pagedkv-replica"] == d.url
        lines = s.iter_lines()
        first = [next(lines) for _ in range(4)]
        d.close()
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert any(ln.startswith("data: {") for ln in first)
    assert rest and "data: [DONE]" not in rest
    err = json.loads(rest[-1][6:])["error"]
    assert err["code"] == "replica_failed" and "incomplete" in err["message"]
    assert wait_for(lambda: settled(router))


def test_no_decode_replica_is_a_503_and_the_router_releases_the_hold(cleanup):
    p, d = ProcReplica(0.01), ProcReplica(0.01)
    cleanup += [p, d]
    router = make_router(prefill=[p.url], decode=[d.url])
    cleanup.append(router)
    d.close()
    assert wait_for(lambda: router.state.routable(roles=("decode",)) == [])
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "twenty bytes prompt!", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert p.stats()["releases"] == ["h0"] and metric(router, "pagedkv_router_pd_holds_released_total") == 1
    assert wait_for(lambda: settled(router))


def test_router_cli_takes_prefill_and_decode_replicas():
    from pagedkv.router.cli import build_parser
    from pagedkv.router.state import parse_backend

    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert args.prefill == ["http://127.0.0.1:1"] and args.decode == ["http://127.0.0.1:2"] and args.backend == []
    assert parse_backend("http://h:1,tcp://h:5", "prefill").role == "prefill"
    from pagedkv.router.cli import main

    assert main(["--prefill", "http://127.0.0.1:1"]) == 2  # a split needs both roles
    assert main([]) == 2


def test_decode_replica_lost_before_answering_is_retried_with_the_same_params(cleanup):
    """The decode replica is killed after it got the request and before it answered: the next decode replica
    gets the same kv_transfer_params (the hold is still on the prefill replica), the client the whole answer."""
    p, d1, d2 = ProcReplica(0.01), ProcReplica(5.0), ProcReplica(0.01)
    cleanup += [p, d1, d2]
    router = make_router(prefill=[p.url], decode=[d1.url, d2.url])
    cleanup.append(router)

    import threading

    out = {}

    def go():
        out["r"] = httpx.post(router.url + "/v1/completions", json={"prompt": "a prompt of twenty b",
                                                                    "max_tokens": 2}, timeout=30)

    t = threading.Thread(target=go)
    t.start()
    assert wait_for(lambda: d1.stats()["requests"] == 1, 10)  # d1 first (the tie goes to the first replica)
    sent = d1.stats()["kv_params"][-1]
    d1.close()
    t.join(30)
    r = out["r"]
    assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == d2.url, r.text
    assert r.json()["choices"][0]["text"] == " t0 t1"
    assert d2.stats()["kv_params"] == [sent] and sent["remote_request_id"] == "h0"
    assert p.stats()["requests"] == 1  # one prefill: the retry reuses its hold
    assert metric(router, "pagedkv_router_retries_total") >= 1
    assert wait_for(lambda: settled(router))
