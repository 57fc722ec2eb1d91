"""A prefill/decode split through the shared store (issue 25 item 2, docs/pd-split.md#through-the-shared-store):
two ``pagedkv serve`` replicas (SmolLM2, blocks of 4, threads on 127.0.0.1) with the same ``--kv-shared``
store, a shared directory and Redis. The prefill replica answers once its prompt's held blocks are written
through to the store and names it (``remote_kv_store``); the decode replica loads them through its own tiers (no
HTTP read). Greedy output equal to the reference on every path: through the store; a store that lost a block
(the decode replica reads the hold over HTTP); a corrupted value in the store (refused by the tier read, the
rest computed); the prefill replica's store wait timing out (HTTP); a wrong check digest on the HTTP wire
(refused, counted, the rest computed)."""

from __future__ import annotations

import pytest
from stub_replica import wait_for as _wait_for
from pagedkv.engine.config import CacheConfig, SchedulerConfig, TierConfig

pytestmark = pytest.mark.engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

BS = 4
N_NEW = 6
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575, 282, 4649, 314,
          30]  # 22 tokens: 5 whole blocks handed over, the last 2 tokens computed by the decode replica


def wait_for(cond, timeout=20.0):
    return _wait_for(cond, timeout)


@pytest.fixture(scope="module", params=["file", "redis"])
def split(request, engine, tmp_path_factory):
    from pagedkv.engine.llm import LLM
    from pagedkv.server.launch import make_server

    srv = None
    if request.param == "redis":
        from redis_server import RedisServer

        srv = RedisServer(tmp_path_factory.mktemp("redis"))
        url = srv.url
    else:
        url = tmp_path_factory.mktemp("shared").as_uri()
    servers = []
    try:
        for role in ("prefill", "decode"):
            llm = LLM(engine.paged, num_gpu_blocks=96, max_num_seqs=8, block_size=BS,
                      tier_config=TierConfig(kv_shared=url))
            servers.append(make_server(llm, model_name="smollm2-test", kv_role=role).start_in_thread())
        yield tuple(servers)
    finally:
        for s in servers:
            s.close()
        if srv is not None:
            srv.stop()


def body(salt, **kw):
    return {"prompt": PROMPT, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "cache_salt": salt, **kw}


def want_text(engine):
    ids = list(engine.reference_greedy(tuple(PROMPT), N_NEW).token_ids)
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def prefill(pre, salt):
    from pagedkv.server.kv_transfer import prefill_body

    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body(salt)), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(dec, salt, kvp):
    r = httpx.post(dec.url + "/v1/completions", json=body(salt, kv_transfer_params=kvp), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def shared(server):
    """(the engine's shared BlockStore, its connector's SHARED counters)"""
    conn = server.engine.llm.kv_tiers.connector
    i = conn.media.index("SHARED")
    return conn.stores()[i], conn.counters()[i]


def snapshot(dec):
    return dict(dec.kv.stats), dec.engine.llm.scheduler.stats.external_tokens, shared(dec)[1]


def check_clean(pre, dec):
    assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)  # released by the decode replica
    pre.engine.llm.block_manager.check_invariants()
    dec.engine.llm.block_manager.check_invariants()


def test_through_the_shared_store_gives_the_reference_without_an_http_read(engine, split):
    pre, dec = split
    assert pre.kv.shared_store is not None and pre.kv.shared_store == dec.kv.shared_store
    kvp = prefill(pre, "store-1")
    assert kvp["remote_kv_store"] == pre.kv.shared_store and kvp["remote_num_tokens"] == 20
    assert pre.kv.stats["store_answers"] >= 1
    # the answer came once every held block was in the store: the decode side's store holds all 5
    store, _ = shared(dec)
    keys = dec.kv.port.store_keys(PROMPT, "store-1", 5)
    assert store.prefix_length(keys) == 5
    st, ext, c = snapshot(dec)
    assert decode(dec, "store-1", kvp) == want_text(engine)
    assert dec.kv.stats["fetches"] == st["fetches"] and dec.kv.stats["store_loads"] == st["store_loads"] + 1
    assert pre.kv.stats["holds_served"] == 0  # no HTTP read of any hold
    assert dec.engine.llm.scheduler.stats.external_tokens - ext == 20  # loaded, not computed
    assert shared(dec)[1].hit_blocks - c.hit_blocks == 5  # from the shared tier
    check_clean(pre, dec)


def test_a_store_missing_a_block_falls_back_to_the_hold(engine, split):
    pre, dec = split
    kvp = prefill(pre, "store-2")
    assert "remote_kv_store" in kvp
    store, _ = shared(dec)
    keys = dec.kv.port.store_keys(PROMPT, "store-2", 5)
    store.backend.discard_many(store.names(keys[3:4]))  # (evicted between the answer and the decode request)
    st, ext, c = snapshot(dec)
    assert decode(dec, "store-2", kvp) == want_text(engine)
    assert dec.kv.stats["store_misses"] == st["store_misses"] + 1 and dec.kv.stats["fetches"] == st["fetches"] + 1
    assert dec.kv.stats["fetches_partial"] == st["fetches_partial"] and dec.kv.stats["blocks_fetched"] == \
        st["blocks_fetched"] + 5  # every block over HTTP
    assert dec.engine.llm.scheduler.stats.external_tokens - ext == 20
    check_clean(pre, dec)


def test_a_corrupted_value_in_the_store_is_refused_and_computed(engine, split):
    from pagedkv.tiers import codec

    pre, dec = split
    kvp = prefill(pre, "store-3")
    store, _ = shared(dec)
    keys = dec.kv.port.store_keys(PROMPT, "store-3", 5)
    (name,) = store.names(keys[2:3])
    (value,) = store.backend.read_many([name])
    bad = bytearray(value)
    bad[codec.HEADER_BYTES + 100] ^= 0x40  # a flipped bit in block 2's payload
    store.backend.discard_many([name])
    store.backend.write_many([name], [bytes(bad)])
    st, ext, c = snapshot(dec)
    assert decode(dec, "store-3", kvp) == want_text(engine)  # blocks 0-1 loaded, the rest computed
    assert dec.kv.stats["store_loads"] == st["store_loads"] + 1 and dec.kv.stats["fetches"] == st["fetches"]
    assert dec.engine.llm.scheduler.stats.external_tokens - ext == 8
    after = shared(dec)[1]
    assert after.hit_blocks - c.hit_blocks == 2 and after.failed_blocks - c.failed_blocks == 3
    check_clean(pre, dec)


def test_the_store_wait_timing_out_hands_over_by_http(engine, split, monkeypatch):
    pre, dec = split
    port = pre.kv.port
    # the write-through lags: still in flight (as the hook sees it) when --kv-store-wait ends
    monkeypatch.setattr(port, "in_shared_store", lambda keys: False)
    monkeypatch.setattr(port, "stores_pending", lambda: True)
    monkeypatch.setattr(pre.kv, "store_wait_s", 0.2)  # (shorter than the half second between store queries)
    timed_out = pre.kv.stats["store_waits_timed_out"]
    kvp = prefill(pre, "store-4")
    assert "remote_kv_store" not in kvp and pre.kv.stats["store_waits_timed_out"] == timed_out + 1
    st, ext, _ = snapshot(dec)
    assert decode(dec, "store-4", kvp) == want_text(engine)
    assert dec.kv.stats["fetches"] == st["fetches"] + 1 and dec.kv.stats["store_loads"] == st["store_loads"]
    assert dec.engine.llm.scheduler.stats.external_tokens - ext == 20
    check_clean(pre, dec)


def test_a_wrong_check_digest_on_the_http_wire_is_refused(engine, split, monkeypatch):
    pre, dec = split
    monkeypatch.setattr(pre.kv, "store_wait_s", 0.0)  # (HTTP only)
    kvp = prefill(pre, "store-5")
    assert "remote_kv_store" not in kvp
    held = pre.kv._holds[kvp["remote_request_id"]]
    held.checks[3] ^= 1  # block 3 sent with another prefix's check digest
    st, ext, _ = snapshot(dec)
    assert decode(dec, "store-5", kvp) == want_text(engine)
    assert dec.kv.stats["check_refused"] == st["check_refused"] + 1
    assert dec.kv.stats["fetches_partial"] == st["fetches_partial"] + 1
    assert dec.engine.llm.scheduler.stats.external_tokens - ext == 12  # blocks 0-2 read, the rest computed
    check_clean(pre, dec)


def test_through_the_router_the_store_path_carries_the_field(engine, split):
    """``pagedkv router --prefill --decode`` validates the prefill answer's params and passes them on: the
    decode replica loads through the store (no HTTP read), one streamed answer equal to the reference."""
    import json

    from stub_replica import make_router

    pre, dec = split
    st, ext, _ = snapshot(dec)
    router = make_router(prefill=[pre.url], decode=[dec.url], block_size=BS, tokenizer=engine.tokenizer)
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json=body("store-r", stream=True),
                          timeout=120) as s:
            assert s.status_code == 200
            lines = list(s.iter_lines())
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {"))
        assert text == want_text(engine) and "data: [DONE]" in lines
        assert dec.kv.stats["store_loads"] == st["store_loads"] + 1 and dec.kv.stats["fetches"] == st["fetches"]
        assert dec.engine.llm.scheduler.stats.external_tokens - ext == 20
        check_clean(pre, dec)
    finally:
        router.close()


def test_gemma3_with_kv_cache_groups_through_the_shared_store(gemma, tmp_path):
    """Gemma 3 (KV cache groups: 1 full-attention group, 5 sliding groups of window 512) split over two replicas
    with the same shared directory: the prefill replica answers once every group's held blocks a load needs are
    in the store (a sliding group only its window's), the decode replica's existence query finds each group's
    keys in its group's store, and its engine loads them per group from SHARED through its tier lookup: no HTTP
    read, the reference text."""
    import json
    from pathlib import Path

    from pagedkv.engine.llm import LLM
    from pagedkv.server.kv_transfer import prefill_body
    from pagedkv.server.launch import make_server

    gbs = 16
    case = json.loads((Path(__file__).resolve().parents[1] / "data" / "gemma3_greedy.json").read_text())["cases"][5]
    url = (tmp_path / "shared").as_uri()
    servers = []
    try:
        for role in ("prefill", "decode"):
            llm = LLM(gemma, block_size=gbs, max_num_seqs=4,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=4096),
                      cache_config=CacheConfig(kv_cache_gib=0.1), tier_config=TierConfig(kv_shared=url))
            assert llm.kv_cache_groups is not None and len(llm.kv_cache_groups) == 6
            servers.append(make_server(llm, model_name="gemma-test", kv_role=role).start_in_thread())
        pre, dec = servers
        assert pre.kv.shared_store is not None and pre.kv.shared_store == dec.kv.shared_store
        b = {"prompt": case["prompt_ids"], "max_tokens": case["max_tokens"], "temperature": 0, "ignore_eos": True,
             "cache_salt": "gemma"}
        r = httpx.post(pre.url + "/v1/completions", json=prefill_body(b), timeout=600)
        assert r.status_code == 200, r.text
        kvp = r.json()["kv_transfer_params"]
        # 783 tokens: 48 whole blocks; the window at token 768 sees blocks 16..47 of each sliding group
        assert kvp["remote_kv_store"] == pre.kv.shared_store and kvp["remote_num_tokens"] == 768
        assert pre.kv.stats["store_answers"] == 1 and pre.kv.stats["store_waits_timed_out"] == 0
        port = dec.kv.port
        keys = port.store_keys(case["prompt_ids"], "gemma", 48)
        assert len(keys) == 48 + 5 * 32 and {g for g, _ in keys} == set(range(6))
        assert port.probe_shared(keys) == len(keys)  # every group's keys, each in its group's store
        assert port.probe_shared([(1, k) if g == 0 else (g, k) for g, k in keys]) == 0  # (group 1 has none)
        inner = port.inner
        ext0, loaded0 = dec.engine.llm.scheduler.stats.external_tokens, list(inner.group_loaded_blocks)
        r = httpx.post(dec.url + "/v1/completions", json={**b, "kv_transfer_params": kvp}, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == case["text"]
        assert dec.kv.stats["store_loads"] == 1 and dec.kv.stats["fetches"] == 0 and dec.kv.stats["store_misses"] == 0
        assert pre.kv.stats["holds_served"] == 0  # no HTTP read of the hold
        assert dec.engine.llm.scheduler.stats.external_tokens - ext0 == 768  # loaded, not computed
        # per group from the shared tier: the full-attention group its 48 blocks, each sliding group its 32
        assert [a - b0 for a, b0 in zip(inner.group_loaded_blocks, loaded0)] == [48] + [32] * 5
        assert [c.medium for c in inner.connector.counters()] == ["SHARED"]
        assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds, 30)  # released by the decode replica
        for s in servers:
            s.engine.llm.block_manager.check_invariants()
    finally:
        for s in servers:
            s.close()
