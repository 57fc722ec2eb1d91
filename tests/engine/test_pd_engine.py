"""A prefill/decode split through the real engine (issue 25, SmolLM2, blocks of 4): ``pagedkv serve --kv-role
prefill`` and ``--kv-role decode`` in threads on 127.0.0.1 over the session's weights, directly and behind
``pagedkv router --prefill --decode``. Greedy output equal to the reference when the prompt's KV is computed on
the prefill replica and read by the decode replica (the decode replica computes only the last block); the hold
is released; a decode replica whose hold is gone computes the whole prompt, still equal."""

from __future__ import annotations

import pytest
from stub_replica import make_router
from stub_replica import wait_for as _wait_for

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


@pytest.fixture(scope="module")
def split(engine):
    from pagedkv.engine.llm import LLM
    from pagedkv.server.launch import make_server

    servers = []
    try:
        for role in ("prefill", "decode"):
            llm = LLM(engine.paged, num_gpu_blocks=96, max_num_seqs=8, block_size=BS)
            servers.append(make_server(llm, model_name="smollm2-test", kv_role=role).start_in_thread())
        yield tuple(servers)
    finally:
        for s in servers:
            s.close()


def body(**kw):
    return {"prompt": PROMPT, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True, **kw}


def want_text(engine):
    ids = list(engine.reference_greedy(tuple(PROMPT), N_NEW).token_ids)
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_prefill_on_one_replica_decode_on_another_gives_the_reference(engine, split):
    from pagedkv.server.kv_transfer import prefill_body

    pre, dec = split
    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body()), timeout=120)
    assert r.status_code == 200, r.text
    kvp = r.json()["kv_transfer_params"]
    assert kvp["remote_num_tokens"] == 20 and len(kvp["remote_block_ids"]) == 5
    assert len(pre.engine.llm.block_manager.external.holds) == 1
    ext_before = dec.engine.llm.scheduler.stats.external_tokens
    r = httpx.post(dec.url + "/v1/completions", json=body(kv_transfer_params=kvp), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want_text(engine)
    assert dec.engine.llm.scheduler.stats.external_tokens - ext_before == 20  # read, not computed
    assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)  # released by the decode replica
    pre.engine.llm.block_manager.check_invariants()
    dec.engine.llm.block_manager.check_invariants()

    # the hold gone before the decode replica reads it: 404, the whole prompt computed, the same text
    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body(cache_salt="t2")), timeout=120)
    kvp = r.json()["kv_transfer_params"]
    assert httpx.delete(f"{pre.url}/v1/kv/holds/{kvp['remote_request_id']}", timeout=10).status_code == 204
    ext_before = dec.engine.llm.scheduler.stats.external_tokens
    r = httpx.post(dec.url + "/v1/completions", json=body(kv_transfer_params=kvp, cache_salt="t2"), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want_text(engine)
    assert dec.engine.llm.scheduler.stats.external_tokens == ext_before


def test_through_the_router_as_one_streamed_answer(engine, split):
    import json

    pre, dec = split
    router = make_router(prefill=[pre.url], decode=[dec.url], block_size=BS, tokenizer=engine.tokenizer)
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json=body(stream=True, cache_salt="r"),
                          timeout=120) as s:
            assert s.status_code == 200 and s.headers["x-pagedkv-prefill-replica"] == pre.url
            lines = list(s.iter_lines())
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {"))
        assert text == want_text(engine) and "data: [DONE]" in lines
        assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)
    finally:
        router.close()
