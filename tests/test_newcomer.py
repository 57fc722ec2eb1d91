"""A newcomer's first hour (issue 26, item 4), the faults that need no model weights: model names accepted by
``pagedkv serve``, the served ids and aliases, vLLM-named options, clear errors (a tool message, a missing extra,
grammar), and a router in front of a replica of another model warning at start-up.

Each test failed before its fix; every server binds 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _serve_args(*argv: str):
    from pagedkv.server.cli import build_parser

    return build_parser().parse_args(list(argv))


# ------------------------------------------------------------------ pagedkv serve --model NAME
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_serve_accepts_the_registry_model_names(name):
    from pagedkv.server.cli import check_options

    check_options(_serve_args("--model", name))  # (raised FileNotFoundError "no such file" before)


def test_serve_still_refuses_a_missing_file_and_names_the_known_models(tmp_path):
    from pagedkv.server.cli import check_options

    with pytest.raises(FileNotFoundError, match="no such file.*gemma-3-270m, smollm2-135m"):
        check_options(_serve_args("--model", str(tmp_path / "nope.gguf")))


def test_the_served_id_is_the_name_given_and_a_registry_file_also_answers_to_its_name(tmp_path):
    from pagedkv.server.launch import served_model_names

    assert served_model_names("gemma-3-270m") == ("gemma-3-270m", ())
    assert served_model_names("smollm2-135m") == ("smollm2-135m", ())
    assert served_model_names(str(tmp_path / "gemma-3-270m-q4_k_m.gguf")) == ("gemma-3-270m-q4_k_m",
                                                                              ("gemma-3-270m",))
    assert served_model_names(str(tmp_path / "my-model.gguf")) == ("my-model", ())


# ------------------------------------------------------------------ vLLM-named options
def test_vllm_named_options_are_accepted():
    a = _serve_args("--no-enable-prefix-caching", "--max-model-len", "512", "--swap-space", "0.5")
    assert a.no_prefix_caching is True and a.max_model_len == 512 and a.swap_space == 0.5
    assert _serve_args("--no-prefix-caching").no_prefix_caching is True
    assert _serve_args("--enable-prefix-caching").no_prefix_caching is False
    assert _serve_args().no_prefix_caching is False and _serve_args().swap_space is None


def test_swap_space_checks():
    from pagedkv.server.cli import check_options

    check_options(_serve_args("--preemption-mode", "swap", "--swap-space", "1"))
    check_options(_serve_args("--cpu-prefix-cache", "--swap-space", "1"))
    for argv, msg in [(["--swap-space", "1", "--num-cpu-blocks", "8"], "not both"),
                      (["--swap-space", "-1"], "--swap-space"),
                      (["--swap-space", "inf"], "--swap-space"),
                      (["--max-model-len", "0"], "--max-model-len"),
                      (["--preemption-mode", "swap"], "--swap-space")]:
        with pytest.raises(ValueError, match=msg):
            check_options(_serve_args(*argv))


# ------------------------------------------------------------------ request errors
def test_a_tool_message_with_tool_call_id_gets_the_clear_message():
    from pagedkv.server.validation import APIError, parse_chat

    for extra in ({}, {"tool_call_id": "call_1"}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                           {"role": "tool", "content": "42", **extra}]}
        with pytest.raises(APIError) as e:
            parse_chat(body)
        assert e.value.status == 400 and e.value.code == "unsupported_parameter", extra
        assert "role 'tool'" in e.value.message and "Unrecognized" not in e.value.message, extra


def test_the_context_error_is_grammatical():
    from pagedkv.server.validation import APIError, Limits, parse_chat, parse_completion, prompt_token_ids

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [1] * 9001

        def render_chat(self, conversation):
            return "x"

    limits = Limits(max_model_len=8192)
    for req, want in [(parse_completion({"model": "m", "prompt": "hi"}, limits), "the prompt holds 9001 tokens"),
                      (parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, limits),
                       "the messages hold 9001 tokens")]:
        with pytest.raises(APIError) as e:
            prompt_token_ids(req, Tok(), limits)
        assert want in e.value.message, e.value.message


# ------------------------------------------------------------------ a missing extra
def test_gemma_without_the_gemma_extra_names_the_extra(monkeypatch, capsys):
    pytest.importorskip("gguf")
    from pagedkv.errors import MissingExtraError
    from pagedkv.router.prompt import load_tokenizer

    try:
        from pagedkv.engine.registry import find_gemma3_model

        find_gemma3_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'pagedkv\[gemma\]'") as e:
        load_tokenizer("gemma-3-270m")
    assert isinstance(e.value, ImportError)
    from pagedkv.router.cli import main

    assert main(["--backend", "http://127.0.0.1:9", "--model", "gemma-3-270m", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pagedkv[gemma]" in err and "Traceback" not in err


# ------------------------------------------------------------------ router --model vs the replicas' model
def test_the_router_warns_about_a_replica_serving_another_model(caplog):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from stub_replica import ThreadReplica, make_router

    from pagedkv.server.launch import served_model_names

    smol = ThreadReplica()
    smol.app.state.model_id = "smollm2-135m"
    gemma = ThreadReplica()
    gemma.app.state.model_id = "gemma-3-270m"
    router = None
    try:
        name, aliases = served_model_names("gemma-3-270m")
        with caplog.at_level(logging.WARNING, logger="pagedkv.router"):
            router = make_router([smol.url, gemma.url], block_size=16, model_names=(name, *aliases))
        # at start-up (the first health round runs before the router serves)
        assert router.health.model_mismatch == {smol.url: ("smollm2-135m",)}
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(smol.url in m and "gemma-3-270m" in m and "smollm2-135m" in m for m in warned), warned
        assert not any(gemma.url in m for m in warned), warned
    finally:
        if router is not None:
            router.close()
        smol.close()
        gemma.close()
