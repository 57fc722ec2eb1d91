"""A newcomer's first hour (issue 26, item 4), the faults that need the engine: ``pagedkv serve --model NAME``
answering to that name, a base model (no chat template) defaulting to plain completion and refusing chat
(``LLM.chat``, ``pagedkv generate --chat``, ``pagedkv chat``, ``/v1/chat/completions``), and vLLM's
``max_model_len`` / ``swap_space``.

A base model is SmolLM2 with its tokenizer's chat template taken away (Gemma 3 270M, the base model that ships,
takes 90 s to load on the 2-core machine; the code path is the same: ``tokenizer.has_chat_template``).
Each test failed before its fix; every server binds 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import re

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest
from engine_helpers import free_port, wait_healthy

pytestmark = pytest.mark.engine

httpx = pytest.importorskip("httpx")


def _base_model_llm(engine):
    """An LLM on SmolLM2's weights whose GGUF metadata had no chat template (as Gemma 3 270M's has none)."""
    from pagedkv.engine import LLM

    llm = LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=4, block_size=16)
    llm.tokenizer.meta = dataclasses.replace(llm.tokenizer.meta, chat_template=None)
    assert not llm.tokenizer.has_chat_template
    return llm


# ------------------------------------------------------------------ base models
def test_llm_chat_on_a_base_model_is_refused(engine):
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.errors import NoChatTemplateError

    assert LLM(engine.paged, num_gpu_blocks=16, max_num_seqs=1).tokenizer.has_chat_template  # the instruct model
    llm = _base_model_llm(engine)
    with pytest.raises(NoChatTemplateError, match="no chat template.*plain completion"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].text


def test_generate_on_a_base_model_defaults_to_plain_completion_and_refuses_chat(engine, monkeypatch, capsys):
    import pagedkv.cli as cli
    from pagedkv.engine import SamplingParams

    llm = _base_model_llm(engine)
    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)
    prompt = "The capital of France is"
    want = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert cli.main(["generate", "--max-tokens", "6", prompt]) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n"  # the plain completion, not a chat
    note, cached = err.strip().splitlines()  # the base-model note, then the cache report every generate ends with
    assert "no chat template" in note and "plain completion" in note
    assert re.fullmatch(r"pagedkv: \d+ of \d+ prompt tokens from cache.*", cached), cached
    assert cli.main(["generate", "--chat", "--max-tokens", "6", prompt]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("pagedkv: error:") and "no chat template" in err
    assert cli.main(["chat", "--max-tokens", "6"]) == 2
    assert "no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --raw and --chat together
        cli.main(["generate", "--raw", "--chat", "hi"])


def test_generate_on_an_instruct_model_still_chats_by_default(engine, monkeypatch, capsys):
    import pagedkv.cli as cli
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(engine.paged, num_gpu_blocks=64, max_num_seqs=4, block_size=16)
    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(msg, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert cli.main(["generate", "--max-tokens", "6", msg[0]["content"]]) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n" and "no chat template" not in err


def test_the_server_refuses_chat_on_a_base_model_with_a_clear_400(engine):
    from pagedkv.server.launch import make_server

    srv = make_server(_base_model_llm(engine), model_name="base").start_in_thread()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "chat_template_missing" and "/v1/completions" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "base", "prompt": "Hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        srv.close()


# ------------------------------------------------------------------ served model ids
def test_a_file_of_a_registry_model_also_answers_to_the_registry_name(engine):
    from pagedkv.engine import LLM
    from pagedkv.engine.gguf_loader import find_default_model
    from pagedkv.server.launch import make_server, served_model_names

    name, aliases = served_model_names(str(find_default_model()))
    assert aliases == ("smollm2-135m",)
    llm = LLM(engine.paged, num_gpu_blocks=32, max_num_seqs=2, block_size=16)
    srv = make_server(llm, model_name=name, model_aliases=aliases).start_in_thread()
    try:
        ids = [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]]
        assert ids == [name, "smollm2-135m"]
        for model, status in ((name, 200), ("smollm2-135m", 200), ("gemma-3-270m", 404)):
            r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1},
                           timeout=30)
            assert r.status_code == status, (model, r.text)
            if status == 200:
                assert r.json()["model"] == name
    finally:
        srv.close()


def test_serve_with_a_model_name_serves_that_name(tmp_path):
    """``pagedkv serve --model smollm2-135m`` as users start it (it exited 2 "no such file" before), and its
    --header-timeout."""
    from pagedkv.engine.gguf_loader import ModelNotFoundError, find_default_model

    try:
        find_default_model()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", "--model", "smollm2-135m", "--port",
                             str(port), "--num-gpu-blocks", "32", "--max-num-seqs", "2", "--header-timeout", "1.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 180)
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["smollm2-135m"]
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "smollm2-135m", r.text
        # the header deadline of --header-timeout: a request whose headers never end gets 408 and is closed
        slow = socket.create_connection(("127.0.0.1", port), timeout=15)
        t0 = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        data = b""
        while chunk := slow.recv(65536):
            data += chunk
        slow.close()
        assert data.startswith(b"HTTP/1.1 408 ") and 1.4 <= time.monotonic() - t0 <= 4.5, data
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------ vLLM-named options
def test_max_model_len_and_swap_space(engine):
    from pagedkv.engine import LLM, SamplingParams, engine_configs
    from pagedkv.engine.options import add_engine_args, make_llm
    import argparse

    from pagedkv.errors import InvalidArgumentError, PromptTooLongError

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--max-model-len", "64", "--swap-space", "0.01", "--num-gpu-blocks", "32",
                         "--preemption-mode", "swap"])
    args.model = engine.paged
    llm = make_llm(args)
    per_block = engine.paged.kv_cache_bytes_per_block(16)
    assert llm.max_model_len == 64
    assert llm.block_manager.config.num_cpu_blocks == int(0.01 * 2**30) // per_block > 0
    with pytest.raises(PromptTooLongError, match="context of 64 tokens"):
        llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=8), use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [1] * 50}, SamplingParams(max_tokens=8, temperature=0),
                        use_tqdm=False)[0].outputs[0].token_ids
    for kw in ({"max_model_len": 0}, {"max_model_len": 10**9}, {"swap_space": 1, "num_cpu_blocks": 4},
               {"swap_space": -1.0}):
        with pytest.raises(InvalidArgumentError):
            LLM(engine.paged, num_gpu_blocks=8, **engine_configs(**kw))
