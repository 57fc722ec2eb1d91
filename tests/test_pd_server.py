"""``pagedkv serve``'s routes in a prefill/decode split, over a fake engine (tests/kv_fakes.py: the app, the
validation, KVHandoff and the routes are the real ones; the engine and its KV port are fakes until the engine
implements the port). Two replicas on 127.0.0.1: a prefill replica answers kv_transfer_params naming its held
blocks; a decode replica reads them, checks them against its own prompt, hands them to its engine and releases
the hold; faults leave the decode replica computing the prompt. Every wait is bounded."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")  # (the app builds the engine's SamplingParams)

from kv_fakes import FakePort, StorePort, block_payload, fake_server  # noqa: E402
from stub_replica import wait_for  # noqa: E402

from pagedkv.server.kv_transfer import parse_kv_transfer_params, prefill_body  # noqa: E402

BS = 4


@pytest.fixture
def replicas():
    pport, dport = FakePort(BS), FakePort(BS)
    p_url, p_engine, p_kv, p_close = fake_server("prefill", pport, lease_s=60.0)
    d_url, d_engine, d_kv, d_close = fake_server("decode", dport, fetch_timeout=5.0)
    yield (p_url, p_engine, p_kv, pport), (d_url, d_engine, d_kv, dport)
    p_close()
    d_close()


def post(url, body):
    return httpx.post(url + "/v1/completions", json=body, timeout=20)


def test_prefill_then_decode_hands_the_blocks_over(replicas):
    (p_url, p_engine, p_kv, pport), (d_url, d_engine, d_kv, dport) = replicas
    prompt = "the prompt of a split request"  # 29 bytes: 7 whole blocks before the last token
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0}
    r = post(p_url, prefill_body(body))
    assert r.status_code == 200, r.text
    kvp = r.json()["kv_transfer_params"]
    assert kvp["do_remote_prefill"] and kvp["remote_num_tokens"] == 28 and len(kvp["remote_block_ids"]) == 7
    assert kvp["remote_port"] == int(p_url.rsplit(":", 1)[1]) and kvp["remote_engine_id"] == p_kv.engine_id
    assert r.json()["usage"]["completion_tokens"] == 1 and p_engine.submitted[-1].params.max_tokens == 1
    assert p_kv.num_holds == 1
    r = post(d_url, {**body, "kv_transfer_params": kvp})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 28
    req = d_engine.submitted[-1]
    ids = list(prompt.encode())
    assert dport.attached[req.request_id] == [block_payload(ids[i:i + BS], 64) for i in range(0, 28, BS)]
    assert "kv_transfer_params" not in r.json()
    # the release runs in the background after the fetch (the port's part in a worker thread)
    assert wait_for(lambda: p_kv.num_holds == 0 and pport.released == [1]) and d_kv.stats["blocks_fetched"] == 7


def test_decode_computes_the_prompt_when_the_hold_is_gone(replicas):
    (p_url, _, p_kv, pport), (d_url, d_engine, d_kv, dport) = replicas
    body = {"prompt": "another prompt of some length", "max_tokens": 3}
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    assert httpx.delete(f"{p_url}/v1/kv/holds/{kvp['remote_request_id']}", timeout=5).status_code == 204
    r = post(d_url, {**body, "kv_transfer_params": kvp})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed, not read
    assert d_engine.submitted[-1].request_id not in dport.attached and d_kv.stats["fetches_failed"] == 1


def test_short_prompt_answers_null_params(replicas):
    (p_url, _, p_kv, _), (d_url, _, _, _) = replicas
    r = post(p_url, prefill_body({"prompt": "abc"}))
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None and p_kv.num_holds == 0


@pytest.mark.parametrize("who, body, code", [
    ("prefill", {"prompt": "x" * 20, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "h", "remote_block_ids": [1],
        "remote_host": "127.0.0.1", "remote_port": 9, "remote_num_tokens": 4}}, "kv_role_mismatch"),
    ("decode", prefill_body({"prompt": "x" * 20}), "kv_role_mismatch"),
    ("prefill", {**prefill_body({"prompt": "x" * 20}), "stream": True}, None),
    ("prefill", {**prefill_body({"prompt": "x" * 20}), "n": 2}, None),
    ("decode", {"prompt": "x", "kv_transfer_params": {"do_remote_decode": 1}}, "invalid_kv_transfer_params"),
])
def test_bad_requests_are_4xx(replicas, who, body, code):
    (p_url, *_), (d_url, *_) = replicas
    r = post(p_url if who == "prefill" else d_url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code or (code is None and r.json()["error"]["param"] in ("stream", "n"))


def test_a_decode_replica_that_refuses_the_request_frees_the_hold_at_once(replicas):
    (p_url, _, p_kv, pport), (d_url, d_engine, _, _) = replicas
    body = {"prompt": "a prompt that will be refused", "max_tokens": 2}
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    bad = {**body, "kv_transfer_params": {**kvp, "remote_num_tokens": kvp["remote_num_tokens"] - BS}}
    r = post(d_url, bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_num_tokens"
    assert wait_for(lambda: p_kv.num_holds == 0 and pport.released == [1]) and not d_engine.submitted


def test_a_peer_outside_the_allowed_hosts_is_refused(replicas):
    (p_url, *_), (d_url, d_engine, _, _) = replicas
    body = {"prompt": "x" * 20, "max_tokens": 2}
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    r = post(d_url, {**body, "kv_transfer_params": {**kvp, "remote_host": "10.0.0.9"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_peer_not_allowed" and not d_engine.submitted


def test_a_replica_without_a_port_refuses_kv_transfer_params_and_serves_plain_requests():
    url, engine, kv, close = fake_server("both")
    try:
        r = post(url, prefill_body({"prompt": "x" * 20}))
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_unavailable"
        r = post(url, {"prompt": "x" * 20, "max_tokens": 2})
        assert r.status_code == 200 and "kv_transfer_params" not in r.json()
        assert httpx.get(url + "/v1/kv/holds/x", timeout=5).status_code == 404  # no routes
    finally:
        close()


def test_serve_options_of_the_split_are_checked_before_the_model_loads():
    from pagedkv.server.cli import build_parser, check_options

    def check(*argv):
        check_options(build_parser().parse_args(["--port", "0", *argv]))

    check("--kv-role", "both", "--kv-peer", "10.0.0.2", "--kv-lease", "60")
    check("--kv-role", "prefill")
    for argv, words in ((["--kv-role", "prefill", "--host", "0.0.0.0"], "--kv-advertise-host"),
                        (["--kv-lease", "0"], "--kv-lease"), (["--kv-lease", "inf"], "--kv-lease"),
                        (["--kv-fetch-timeout", "-1"], "--kv-fetch-timeout")):
        with pytest.raises(ValueError, match=words):
            check(*argv)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-role", "middle"])


def samples(url):
    """``GET /metrics`` as {(sample name, ((label, value), ...) without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_the_handoff_is_in_metrics_on_both_sides(replicas):
    """Prefill side: holds taken, live, ended by a release; blocks and bytes served. Decode side: reads by
    outcome, blocks and bytes read, the fetch-time histogram, the staging gauges."""
    pytest.importorskip("prometheus_client")
    (p_url, _, p_kv, pport), (d_url, _, d_kv, _) = replicas
    body = {"prompt": "the prompt of a split request", "max_tokens": 2}  # 7 whole blocks handed over
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    m = samples(p_url)
    assert m[("pagedkv:kv_handoff_holds_active", ())] == 1 and m[("pagedkv:kv_handoff_held_blocks", ())] == 7
    assert m[("pagedkv:kv_handoff_holds_total", ())] == 1
    assert post(d_url, {**body, "kv_transfer_params": kvp}).status_code == 200
    assert wait_for(lambda: p_kv.num_holds == 0)
    m = samples(p_url)
    assert m[("pagedkv:kv_handoff_holds_active", ())] == 0 and m[("pagedkv:kv_handoff_held_blocks", ())] == 0
    assert m[("pagedkv:kv_handoff_holds_ended_total", (("how", "released"),))] == 1
    assert m[("pagedkv:kv_handoff_holds_ended_total", (("how", "expired"),))] == 0
    assert m[("pagedkv:kv_handoff_holds_served_total", ())] == 1
    assert m[("pagedkv:kv_handoff_blocks_served_total", ())] == 7
    assert m[("pagedkv:kv_handoff_bytes_served_total", ())] == 7 * (64 + 64)  # payload + header + checksum (codec.OVERHEAD_BYTES)
    d = samples(d_url)
    assert d[("pagedkv:kv_handoff_fetches_total", (("outcome", "complete"),))] == 1
    assert d[("pagedkv:kv_handoff_fetches_total", (("outcome", "failed"),))] == 0
    assert d[("pagedkv:kv_handoff_blocks_fetched_total", ())] == 7
    assert d[("pagedkv:kv_handoff_bytes_fetched_total", ())] == 7 * (64 + 64)
    assert d[("pagedkv:kv_handoff_fetch_seconds_count", ())] == 1
    assert d[("pagedkv:kv_handoff_fetch_seconds_bucket", (("le", "+Inf"),))] == 1
    assert d[("pagedkv:kv_handoff_staged_bytes_limit", ())] == d_kv.staging.limit == 1 << 30
    # the payloads the fake engine keeps are still staged (a real engine drops them once written)
    assert d[("pagedkv:kv_handoff_staged_bytes", ())] == 7 * 64

    # a hold gone before the read: a failed read, nothing fetched
    kvp = post(p_url, prefill_body({**body, "prompt": "x" * 30})).json()["kv_transfer_params"]
    assert httpx.delete(f"{p_url}/v1/kv/holds/{kvp['remote_request_id']}", timeout=5).status_code == 204
    assert post(d_url, {**body, "prompt": "x" * 30, "kv_transfer_params": kvp}).status_code == 200
    d = samples(d_url)
    assert d[("pagedkv:kv_handoff_fetches_total", (("outcome", "failed"),))] == 1
    assert d[("pagedkv:kv_handoff_blocks_fetched_total", ())] == 7
    assert d[("pagedkv:kv_handoff_fetch_seconds_count", ())] == 2
    assert samples(p_url)[("pagedkv:kv_handoff_holds_ended_total", (("how", "released"),))] == 2


def test_a_replica_without_a_port_has_no_handoff_metrics():
    from pagedkv.server.kv_handoff import KVHandoff
    from pagedkv.server.metrics import ServerMetrics

    m = ServerMetrics(dict, "m")
    m.add_kv_handoff(KVHandoff())
    assert b"kv_handoff" not in m.render()
    m.add_kv_handoff(KVHandoff(role="decode", port=FakePort(BS)))
    assert b"pagedkv:kv_handoff_fetches_total" in m.render()


def test_a_prefill_replica_killed_mid_transfer_leaves_the_blocks_that_arrived():
    """A prefill replica in its own process sends the first 8 blocks of 13, stalls, and is killed with SIGKILL:
    the decode replica keeps the 8 whole blocks it read and checked, computes the rest, answers the whole
    completion, and counts a partial read."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kv_fakes.py"))], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

    def line(timeout):
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        return proc.stdout.readline().decode().strip() if ready else ""

    dport = FakePort(BS)
    d_url, d_engine, d_kv, d_close = fake_server("decode", dport, fetch_timeout=20.0)
    try:
        first = line(60)
        assert first.startswith("url "), first
        p_url = first[4:]
        body = {"prompt": "a prompt long enough for thirteen blocks of four bytes", "max_tokens": 3}
        kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
        assert len(kvp["remote_block_ids"]) == 13
        out = {}
        t = threading.Thread(target=lambda: out.update(r=post(d_url, {**body, "kv_transfer_params": kvp})))
        t.start()
        assert line(20) == "stalled"  # the first batch of 8 blocks is on the wire
        os.kill(proc.pid, signal.SIGKILL)
        t.join(30)
        r = out["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BS  # read; the rest computed
        ids = list(body["prompt"].encode())
        assert dport.attached[d_engine.submitted[-1].request_id] == [block_payload(ids[i:i + BS], 64)
                                                                     for i in range(0, 8 * BS, BS)]
        assert d_kv.stats["fetches_partial"] == 1 and d_kv.stats["blocks_fetched"] == 8
        # the prefill replica is gone: its release (in the background) is not confirmed
        assert wait_for(lambda: d_kv.stats["releases_failed"] == 1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        d_close()


def test_a_wrong_check_digest_on_the_wire_is_refused_and_counted():
    """End to end over HTTP (the real prefill routes and decode fetch, a fake engine): a hold whose third value
    carries another check digest: the decode replica keeps the two blocks before it, counts the refusal."""
    import asyncio

    from pagedkv.server.kv_handoff import KVHandoff

    p_url, _engine, p_kv, p_close = fake_server("prefill", FakePort(BS), lease_s=60.0)
    try:
        dec = KVHandoff(role="decode", port=FakePort(BS), fetch_timeout=5.0)
        text = "a prompt for the check digest"  # 29 bytes: 7 blocks
        r = httpx.post(p_url + "/v1/completions", json=prefill_body({"prompt": text, "max_tokens": 2}), timeout=20)
        kvp = r.json()["kv_transfer_params"]
        (held,) = p_kv._holds.values()
        assert len(held.checks) == 7
        held.checks[2] ^= 1 << 63
        tokens = list(text.encode())
        res = asyncio.run(dec.fetch(parse_kv_transfer_params(kvp), tokens, None))
        assert [bytes(p) for p in res.payloads] == [block_payload(tokens[i:i + BS], 64) for i in (0, 4)]
        assert "CHECK" in res.error and dec.stats["check_refused"] == 1 and dec.stats["fetches_partial"] == 1
        held.checks[2] ^= 1 << 63  # the right digests: every block
        res = asyncio.run(dec.fetch(parse_kv_transfer_params(kvp), tokens, None))
        assert res.complete and dec.stats["check_refused"] == 1
    finally:
        p_close()


# ------------------------------------------------------------------------------------ through the shared store
@pytest.fixture
def store_replicas():
    """A prefill and a decode replica whose engines share one store (tests/kv_fakes.StorePort)."""
    from kv_fakes import StorePort

    store: set = set()
    pport, dport = StorePort(store), StorePort(store)
    p_url, p_engine, p_kv, p_close = fake_server("prefill", pport, lease_s=60.0, store_wait_s=5.0)
    d_url, d_engine, d_kv, d_close = fake_server("decode", dport, fetch_timeout=5.0)
    yield store, (p_url, p_kv, pport), (d_url, d_engine, d_kv, dport)
    p_close()
    d_close()


def _keys(text, n):
    from pagedkv import block_hashes

    return list(block_hashes(list(text.encode())[: n * BS], BS))


def test_the_answer_waits_for_the_store_and_the_decode_side_loads_from_it(store_replicas):
    """The prefill answer comes once the held blocks are in the shared store (its write-through, here a thread
    that puts them there 0.3 s after the answer started waiting), naming the store; the decode replica finds
    every block there and queues the request plain (its engine loads them through its tiers): no HTTP read,
    nothing staged; the hold is released."""
    import threading

    store, (p_url, p_kv, pport), (d_url, d_engine, d_kv, dport) = store_replicas
    text = "the prompt of a split request"  # 7 whole blocks
    body = {"prompt": text, "max_tokens": 5, "temperature": 0}
    asked = []

    def in_store(keys):
        if not asked:  # the answer's first look: the write-through lands 0.3 s later
            threading.Timer(0.3, lambda: store.update(_keys(text, 7))).start()
        asked.append(len(keys))
        return StorePort.in_shared_store(pport, keys)

    pport.in_shared_store = in_store
    r = post(p_url, prefill_body(body))
    assert r.status_code == 200 and asked[0] == 7 and len(asked) > 2  # (polled while it waited)
    kvp = r.json()["kv_transfer_params"]
    assert kvp["remote_kv_store"] == "kvs-fake" and len(kvp["remote_block_ids"]) == 7
    assert p_kv.stats["store_answers"] == 1 and p_kv.num_holds == 1  # (kept: the fallback)
    assert 0.25 <= p_kv.stats["store_wait_seconds"] < 5
    r = post(d_url, {**body, "kv_transfer_params": kvp})
    assert r.status_code == 200, r.text
    req = d_engine.submitted[-1]
    assert req.request_id not in dport.attached and d_kv.stats["fetches"] == 0 and pport.reads == 0
    assert d_kv.stats["store_loads"] == 1 and dport.probes == 1
    assert wait_for(lambda: p_kv.num_holds == 0 and pport.released == [1])


def test_a_store_missing_blocks_or_another_store_reads_the_hold(store_replicas):
    """The store lost a block after the answer (evicted): the decode replica reads the hold over HTTP instead
    (store_misses), every block; a decode replica on another store never probes it."""
    store, (p_url, p_kv, pport), (d_url, d_engine, d_kv, dport) = store_replicas
    text = "another prompt, of some length"  # 30 bytes: 7 blocks
    body = {"prompt": text, "max_tokens": 3}
    store.update(_keys(text, 7))
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    assert kvp["remote_kv_store"] == "kvs-fake"
    store.discard(_keys(text, 7)[4])
    r = post(d_url, {**body, "kv_transfer_params": kvp})
    assert r.status_code == 200
    ids = list(text.encode())
    assert dport.attached[d_engine.submitted[-1].request_id] == [block_payload(ids[i:i + BS], 64)
                                                                  for i in range(0, 28, BS)]
    assert d_kv.stats["store_misses"] == 1 and d_kv.stats["fetches"] == 1 and d_kv.stats["store_loads"] == 0
    assert wait_for(lambda: p_kv.num_holds == 0)
    dport.shared_store = "kvs-another"
    kvp = post(p_url, prefill_body({**body, "cache_salt": "s2"})).json()["kv_transfer_params"]
    probes = dport.probes
    r = post(d_url, {**body, "cache_salt": "s2", "kv_transfer_params": kvp})
    assert r.status_code == 200 and dport.probes == probes and d_kv.stats["fetches"] == 2


def test_the_store_wait_times_out_to_the_http_path(store_replicas):
    """The held blocks never reach the store (its writes fail or lag): after --kv-store-wait the answer names no
    store (counted), and the decode replica reads the hold over HTTP."""
    import time

    store, (p_url, p_kv, pport), (d_url, d_engine, d_kv, dport) = store_replicas
    p_kv.store_wait_s = 0.3
    body = {"prompt": "a prompt the store never gets", "max_tokens": 2}
    t0 = time.monotonic()
    kvp = post(p_url, prefill_body(body)).json()["kv_transfer_params"]
    assert 0.3 <= time.monotonic() - t0 < 5 and "remote_kv_store" not in kvp
    assert p_kv.stats["store_waits_timed_out"] == 1 and p_kv.stats["store_answers"] == 0
    r = post(d_url, {**body, "kv_transfer_params": kvp})
    assert r.status_code == 200 and d_kv.stats["fetches"] == 1 and dport.probes == 0
    assert len(dport.attached[d_engine.submitted[-1].request_id]) == 7
    p_kv.store_wait_s = 0.0  # 0: never through the store (no wait at all)
    kvp = post(p_url, prefill_body({**body, "cache_salt": "x"})).json()["kv_transfer_params"]
    assert "remote_kv_store" not in kvp and p_kv.stats["store_waits_timed_out"] == 1
    m = httpx.get(p_url + "/metrics", timeout=10).text
    assert "pagedkv:kv_handoff_store_waits_timed_out_total" in m and "pagedkv:kv_handoff_check_refused_total" in m


def test_blocks_the_engine_did_not_write_are_asked_of_the_store(store_replicas):
    """Held blocks the engine's write-through hook never reported (written before it started, or by another
    replica; loaded from a disk tier) are asked of the store itself: once no store is in flight, one existence
    query decides at once: all there, the answer names the store; some missing, it goes over HTTP without
    waiting out --kv-store-wait."""
    import time

    store, (p_url, p_kv, pport), (d_url, d_engine, d_kv, dport) = store_replicas
    pport.known = set()  # (the hook knows of nothing)
    pport.pending = False
    text = "blocks another replica wrote"  # 28 bytes: 6 blocks
    store.update(_keys(text, 6))
    t0 = time.monotonic()
    kvp = post(p_url, prefill_body({"prompt": text, "max_tokens": 2})).json()["kv_transfer_params"]
    assert kvp["remote_kv_store"] == "kvs-fake" and pport.probes == 1 and time.monotonic() - t0 < 4
    store.clear()
    t0 = time.monotonic()
    kvp = post(p_url, prefill_body({"prompt": text, "max_tokens": 2, "cache_salt": "b"})).json()[
        "kv_transfer_params"]
    assert "remote_kv_store" not in kvp and pport.probes == 2 and time.monotonic() - t0 < 4
    assert p_kv.stats["store_waits_timed_out"] == 1 and p_kv.stats["store_answers"] == 1
