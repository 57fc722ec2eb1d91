"""vLLM's tokenizer routes and the chat field vLLM prefers, over HTTP on the loopback: one ``pagedkv serve``
(SmolLM2, an API key) and a ``pagedkv router`` in front of it, both on 127.0.0.1 in threads. ``/tokenize`` must
answer the token ids the completion and chat routes compute (their usage and the offline engine say so),
``/detokenize`` their text, with the calls ``vllm bench serve`` makes; bad bodies get a 4xx and change nothing.
Every request is small and every wait bounded."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

KEY = "test-key"
MODEL = "smollm2-test"
BLOCK = 16
AUTH = {"Authorization": f"Bearer {KEY}"}
CONV = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(engine):
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    llm = LLM(engine.paged, num_gpu_blocks=48, max_num_seqs=4, block_size=BLOCK)
    srv = make_server(llm, model_name=MODEL, api_key=KEY, max_waiting=16).start_in_thread()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def router(server, engine):
    from stub_replica import make_router

    from pagedkv.engine.tokenizer import GGUFTokenizer
    from pagedkv.router.proxy import UpstreamOptions

    r = make_router([server.url], tokenizer=GGUFTokenizer(engine.tokenizer_meta), block_size=BLOCK, api_key=KEY,
                    upstream=UpstreamOptions(api_key=KEY))
    yield r
    r.close()


@pytest.fixture(scope="module")
def offline(engine):
    from pagedkv.engine import LLM

    return LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=2, block_size=BLOCK)


def post(url, path, body, headers=None):
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def test_tokenize_answers_the_ids_the_generation_routes_compute(server, offline):
    from pagedkv.engine import SamplingParams

    llm = server.engine.llm
    prompt = "The capital of France is"
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    r = post(server.url, "/tokenize", {"model": MODEL, "prompt": prompt})  # (no key: open, as in vLLM)
    assert r.status_code == 200
    got = r.json()
    assert got == {"count": len(want.prompt_token_ids), "max_model_len": llm.max_model_len,
                   "tokens": list(want.prompt_token_ids), "token_strs": None}
    c = post(server.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}, AUTH)
    assert c.json()["usage"]["prompt_tokens"] == got["count"]
    r = post(server.url, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert r["token_strs"] == [llm.tokenizer.id_to_token(t) for t in r["tokens"]] and len(r["token_strs"]) == 5

    # a chat: the chat route's prompt, rendered by the template (no extra special tokens by default)
    want = offline.chat(CONV, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    chat = post(server.url, "/tokenize", {"model": MODEL, "messages": CONV}).json()
    assert chat["tokens"] == list(want.prompt_token_ids)
    c = post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": CONV, "max_tokens": 1}, AUTH)
    assert c.json()["usage"]["prompt_tokens"] == chat["count"]
    bare = post(server.url, "/tokenize", {"messages": CONV, "add_generation_prompt": False}).json()
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    # continue_final_message: the assistant's own text is where the rendering stops
    cont = post(server.url, "/tokenize", {"messages": CONV + [{"role": "assistant", "content": "It is"}],
                                          "continue_final_message": True, "add_generation_prompt": False}).json()
    text = post(server.url, "/detokenize", {"tokens": cont["tokens"]}).json()["prompt"]
    assert text.endswith("assistant\nIt is") and text.startswith(
        post(server.url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"])


def test_the_calls_vllm_bench_serve_makes(server):
    """vllm bench serve's prompt alignment: tokenize without special tokens, cut, detokenize, no key."""
    prompt = "Paged attention stores the KV cache in fixed-size blocks."
    r = post(server.url, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": False})
    tokens = r.json()["tokens"]
    assert r.status_code == 200 and len(tokens) > 8
    assert post(server.url, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {"prompt": prompt}
    cut = post(server.url, "/detokenize", {"model": MODEL, "tokens": tokens[:6]}).json()["prompt"]
    assert prompt.startswith(cut) and post(server.url, "/tokenize", {"prompt": cut, "add_special_tokens": False}
                                           ).json()["tokens"] == tokens[:6]


BAD = [
    ("/tokenize", {"prompt": "x", "messages": CONV}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "nonsense": 1}, 400, "nonsense"),
    ("/tokenize", {"messages": CONV, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CONV, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),  # past the vocabulary (49152)
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
]


def _state(server):
    bm = server.engine.llm.block_manager
    return server.engine.num_unfinished, bm.num_free_gpu_blocks, bm.stats.num_cached_blocks


def test_bad_bodies_get_a_4xx_and_change_nothing(server):
    before = _state(server)
    good = post(server.url, "/tokenize", {"prompt": "hello"}).json()
    for path, body, status, param in BAD:
        r = post(server.url, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, body, r.text)
    r = httpx.post(server.url + "/tokenize", content=b"prompt=x", headers={"content-type": "text/plain"}, timeout=30)
    assert r.status_code == 415
    r = httpx.post(server.url + "/tokenize", content=b"{" * 10, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400
    big = json.dumps({"prompt": "x" * (3 * 2**20)})
    r = httpx.post(server.url + "/tokenize", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert _state(server) == before and post(server.url, "/tokenize", {"prompt": "hello"}).json() == good
    # the key guards /v1 only: the tokenizer routes stay open, as vLLM's
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


def test_the_router_relays_the_tokenizer_routes(server, router):
    for path, body in [("/tokenize", {"model": MODEL, "prompt": "The capital of France is"}),
                       ("/tokenize", {"messages": CONV, "return_token_strs": True}),
                       ("/detokenize", {"tokens": [504, 3575, 282, 4649, 314]})]:
        direct, via = post(server.url, path, body), post(router.url, path, body)
        assert via.status_code == direct.status_code == 200 and via.json() == direct.json()
    before = _state(server)
    for path, body, status, param in BAD:
        direct, via = post(server.url, path, body), post(router.url, path, body)
        assert via.status_code == direct.status_code == status and via.json() == direct.json(), (path, body)
    assert _state(server) == before
    assert all(r.inflight == 0 and r.inflight_tokens == 0 for r in router.state.replicas.values())


def test_chat_takes_max_completion_tokens_over_max_tokens(server):
    """vLLM (and OpenAI) read max_completion_tokens when a chat sends both; pagedkv used to refuse the pair."""
    body = {"model": MODEL, "messages": CONV, "max_tokens": 2, "max_completion_tokens": 5, "ignore_eos": True,
            "temperature": 0}
    r = post(server.url, "/v1/chat/completions", body, AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    r = post(server.url, "/v1/chat/completions", {**body, "max_completion_tokens": None}, AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
