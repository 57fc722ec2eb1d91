"""Issue 34: ``pagedkv_router_client_disconnects_total`` counts only clients that left before the answer ended.
Before, the disconnect watcher won once the response was sent, so every normal request counted one. Stub
replicas (tests/stub_replica.py), a real router over HTTP; bounded waits."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("prometheus_client")

from stub_replica import ThreadReplica, cleanup, make_router, metric, settled, wait_for  # noqa: E402,F401


def test_normal_requests_through_two_replicas_count_no_disconnect(cleanup):
    reps = [ThreadReplica(0.0) for _ in range(2)]
    cleanup.extend(reps)
    router = make_router([r.url for r in reps])
    cleanup.append(router)
    for i in range(8):
        body = {"model": "stub", "prompt": f"p{i}", "max_tokens": 3, "stream": bool(i % 2)}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
    assert wait_for(lambda: settled(router))
    assert sum(r.stats["finished"] for r in reps) == 8 and sum(r.stats["aborted"] for r in reps) == 0
    assert router.metrics.client_disconnects == 0
    m = httpx.get(router.url + "/metrics", timeout=10).text
    assert "pagedkv_router_client_disconnects_total 0.0" in m


def test_a_client_that_hangs_up_mid_stream_counts_one(cleanup):
    reps = [ThreadReplica(0.05) for _ in range(2)]
    cleanup.extend(reps)
    router = make_router([r.url for r in reps])
    cleanup.append(router)
    body = {"model": "stub", "prompt": "x", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as s:
        it = s.iter_lines()
        for _ in range(4):
            next(it)
    assert wait_for(lambda: sum(r.stats["aborted"] for r in reps) == 1)
    r = httpx.post(router.url + "/v1/completions", json={"model": "stub", "prompt": "y", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200
    assert wait_for(lambda: settled(router))
    assert router.metrics.client_disconnects == 1


def test_the_no_prefill_log_says_where_the_prompt_goes():
    # issue 34: a split with its prefill replica killed logged "computed whole on a colocated replica" although
    # the split has none: the decode replica computed it
    from pagedkv.router.proxy import _no_prefill_message

    split_only = _no_prefill_message(1, ("both", "decode"))
    assert "decode replica" in split_only and "colocated replica (" not in split_only and "1 tried" in split_only
    assert "colocated replica (--kv-role both)" in _no_prefill_message(2, ("both",))
