"""A prefill/decode split of Gemma 3 270M (KV cache groups: 1 full-attention group, 5 sliding groups of window
512) through the real engine: ``pagedkv serve --kv-role prefill`` and ``--kv-role decode`` in threads on 127.0.0.1
over one loaded model (issue 25 item 4). Greedy output equal to the reference (tests/data/gemma3_greedy.json) when
the prompt's KV is computed on the prefill replica and read by the decode replica; for a prompt longer than the
window only the sliding groups' window blocks travel. Faults: the hold's lease ended before the read (the
whole prompt computed), a transfer cut short (the usable leading blocks kept, the rest computed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stub_replica import wait_for as _wait_for

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.engine

from pagedkv.tiers import codec  # noqa: E402
from pagedkv.engine.config import CacheConfig, SchedulerConfig

REFERENCE_JSON = Path(__file__).resolve().parents[1] / "data" / "gemma3_greedy.json"
BS = 16
GROUPS = 6  # group 0 full attention, 1..5 sliding window 512
BLOCK_BYTES = 3 * 2 * BS * 1 * 256 * 4  # one group's 3 layers, K and V, fp32: 96 KiB


def wait_for(cond, timeout=30.0):
    return _wait_for(cond, timeout)


@pytest.fixture(scope="module")
def cases() -> list:
    return json.loads(REFERENCE_JSON.read_text())["cases"]


@pytest.fixture(scope="module")
def split(gemma):
    from pagedkv.engine.llm import LLM
    from pagedkv.server.launch import make_server

    servers = []
    try:
        for role in ("prefill", "decode"):
            llm = LLM(gemma, block_size=BS, max_num_seqs=4,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=4096),
                      cache_config=CacheConfig(kv_cache_gib=0.1))
            assert llm.kv_cache_groups is not None and len(llm.kv_cache_groups) == GROUPS
            servers.append(make_server(llm, model_name="gemma-test", kv_role=role).start_in_thread())
        yield tuple(servers)
    finally:
        for s in servers:
            s.close()


def body(case, **kw):
    return {"prompt": case["prompt_ids"], "max_tokens": case["max_tokens"], "temperature": 0, "ignore_eos": True,
            **kw}


def served_blocks(pre, kvp) -> tuple[int, int]:
    """The values the prefill replica serves for a hold, and their bytes (its response headers)."""
    with httpx.stream("GET", f"{pre.url}/v1/kv/holds/{kvp['remote_request_id']}",
                      params={"engine": kvp["remote_engine_id"]}, timeout=60) as r:
        assert r.status_code == 200
        return int(r.headers["x-pagedkv-kv-blocks"]), int(r.headers["x-pagedkv-kv-bytes"])


def check(*servers):
    for s in servers:
        s.engine.llm.block_manager.check_invariants()


def test_a_prompt_past_the_window_prefilled_on_one_replica_decodes_on_another_as_the_reference(cases, split):
    from pagedkv.server.kv_transfer import prefill_body

    pre, dec = split
    case = cases[5]  # 783 tokens: 48 whole blocks handed over; the window at token 768 sees blocks 16..47
    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body(case)), timeout=600)
    assert r.status_code == 200, r.text
    kvp = r.json()["kv_transfer_params"]
    assert kvp["remote_num_tokens"] == 768 and len(kvp["remote_block_ids"]) == 48
    n, size = served_blocks(pre, kvp)
    assert n == 48 + 5 * 32  # every full-attention block, each sliding group's 32 window blocks: 208, not 288
    assert size == n * (BLOCK_BYTES + codec.OVERHEAD_BYTES)
    ext0 = dec.engine.llm.scheduler.stats.external_tokens
    w0 = dec.kv.port.stats["written_blocks"]
    r = httpx.post(dec.url + "/v1/completions", json=body(case, kv_transfer_params=kvp), timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == case["text"]
    assert dec.engine.llm.scheduler.stats.external_tokens - ext0 == 768  # read, not computed
    assert dec.kv.port.stats["written_blocks"] - w0 == 208
    assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)  # released by the decode replica
    check(pre, dec)


def test_faults_a_lease_that_ended_and_a_transfer_cut_short(cases, split):
    from pagedkv.server.kv_transfer import prefill_body

    pre, dec = split
    case = cases[4]  # 423 tokens, inside the window: every group hands over all 26 blocks, position by position
    sched = dec.engine.llm.scheduler

    # the lease ends before the decode replica reads: 404, the whole prompt computed, the same text
    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body(case, cache_salt="lease")), timeout=600)
    kvp = r.json()["kv_transfer_params"]
    assert len(kvp["remote_block_ids"]) == 26 and pre.engine.llm.block_manager.external.holds
    clock = pre.kv.clock
    pre.kv.clock = lambda: clock() + 1e6  # (past every lease: the registry refuses it; the sweeper releases it)
    try:
        ext0, f0 = sched.stats.external_tokens, dec.kv.stats["fetches_failed"]
        r = httpx.post(dec.url + "/v1/completions", json=body(case, kv_transfer_params=kvp, cache_salt="lease"),
                       timeout=600)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == case["text"]
        assert sched.stats.external_tokens == ext0 and dec.kv.stats["fetches_failed"] == f0 + 1
        assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)  # the sweeper released it
    finally:
        pre.kv.clock = clock

    # the prefill replica's hold goes away after 16 of its 156 values (two reads of 8): the decode replica keeps
    # the 2 positions every group sent whole, computes the rest
    r = httpx.post(pre.url + "/v1/completions", json=prefill_body(body(case, cache_salt="cut")), timeout=600)
    kvp = r.json()["kv_transfer_params"]
    port = pre.kv.port
    read, calls = port.read_blocks, []

    def cut_short(hold_id, block_ids):
        calls.append(len(block_ids))
        if len(calls) > 2:
            raise LookupError("hold released")
        return read(hold_id, block_ids)

    port.read_blocks = cut_short
    try:
        ext0, p0 = sched.stats.external_tokens, dec.kv.stats["fetches_partial"]
        r = httpx.post(dec.url + "/v1/completions", json=body(case, kv_transfer_params=kvp, cache_salt="cut"),
                       timeout=600)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == case["text"]
        assert sched.stats.external_tokens - ext0 == 2 * BS and dec.kv.stats["fetches_partial"] == p0 + 1
    finally:
        port.read_blocks = read
    assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)
    check(pre, dec)


def test_through_the_router_as_one_streamed_answer(cases, split):
    from pagedkv.router.app import RouterServer
    from pagedkv.router.prompt import PromptBuilder
    from pagedkv.router.state import Replica, RouterState

    pre, dec = split
    case = cases[4]
    state = RouterState([Replica(pre.url, role="prefill"), Replica(dec.url, role="decode")], block_size=BS)
    router = RouterServer(state, PromptBuilder(pre.engine.llm.tokenizer, BS), port=0).start_in_thread()
    try:
        ext0 = dec.engine.llm.scheduler.stats.external_tokens
        with httpx.stream("POST", router.url + "/v1/completions", json=body(case, stream=True, cache_salt="r"),
                          timeout=600) as s:
            assert s.status_code == 200 and s.headers["x-pagedkv-prefill-replica"] == pre.url
            lines = list(s.iter_lines())
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {"))
        assert text == case["text"] and "data: [DONE]" in lines
        assert dec.engine.llm.scheduler.stats.external_tokens - ext0 == 416  # 26 blocks read, not computed
        assert wait_for(lambda: not pre.engine.llm.block_manager.external.holds)
    finally:
        router.close()
    check(pre, dec)
