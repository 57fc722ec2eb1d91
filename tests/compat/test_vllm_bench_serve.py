"""``vllm bench serve`` (vLLM 0.33's own command, in .venv-vllm) against ``pagedkv serve``: a bounded run (4
requests of 32 random tokens + 8, two at a time) completes without a failed request, and what it counted equals
what the server's /metrics counted (requests, prompt and generated tokens, first tokens). The tokenizer it needs
is the model's, written from the GGUF file's metadata by transformers in the same virtualenv."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from test_vllm_compat import ROOT, Procs, free_port, run_side, side_env, vllm_python, wait_http  # noqa: E402

MODEL = "smollm2-135m"


@contextlib.contextmanager
def pagedkv_serve(tmp_path, num_gpu_blocks: int):
    """``pagedkv serve`` (SmolLM2, one thread) on a free 127.0.0.1 port, healthy: its base URL."""
    procs = Procs(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]), OMP_NUM_THREADS="1")
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        srv = procs.start("serve", [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port),
                                    "--num-gpu-blocks", str(num_gpu_blocks)], env)
        wait_http(url + "/health", srv, 300)
        yield url
    finally:
        procs.close()


def metric_sum(url: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in ``GET /metrics``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.split()[-1])
    return total


@pytest.mark.engine
def test_vllm_bench_serve_completes_against_pagedkv_serve_and_agrees_with_its_metrics(tmp_path):
    from pagedkv.engine import find_default_model

    tok_dir = tmp_path / "tokenizer"
    info = run_side("tokenizer", str(find_default_model()), str(tok_dir))
    assert info["vocab"] > 1000
    with pagedkv_serve(tmp_path, 128) as url:
        vllm = os.path.join(os.path.dirname(vllm_python()), "vllm")
        r = subprocess.run([vllm, "bench", "serve", "--backend", "openai", "--base-url", url,
                            "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tok_dir),
                            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
                            "--num-prompts", "4", "--max-concurrency", "2", "--seed", "1", "--temperature", "0",
                            "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                            "--result-filename", "bench.json"],
                           capture_output=True, text=True, timeout=400, env=side_env(), cwd=str(tmp_path))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        res = json.loads((tmp_path / "bench.json").read_text())
        assert res["completed"] == 4 and res.get("failed", 0) == 0
        assert res["total_input_tokens"] == 4 * 32 and res["total_output_tokens"] == 4 * 8
        assert 0 < res["median_ttft_ms"] <= res["p99_ttft_ms"] and res["median_itl_ms"] > 0
        # the server counted the same requests and tokens
        assert metric_sum(url, "pagedkv:request_success_total") == res["completed"]
        assert metric_sum(url, "pagedkv:prompt_tokens_total") == res["total_input_tokens"]
        assert metric_sum(url, "pagedkv:generation_tokens_total") == res["total_output_tokens"]
        assert metric_sum(url, "pagedkv:time_to_first_token_seconds_count") == res["completed"]


@pytest.mark.engine
def test_tokenizer_routes_answer_vllms_own_request_and_response_classes(tmp_path):
    """vLLM's tokenizer-route classes build the requests and parse the answers of ``pagedkv serve``: every answer
    has exactly the response class's fields, the prompt's ids are the engine's own, and detokenizing them gives
    the prompt back."""
    from pagedkv.router.prompt import load_tokenizer

    with pagedkv_serve(tmp_path, 64) as url:
        got = run_side("tokenize", url, MODEL)
    for name in ("prompt", "strs", "chat", "detok"):
        r = got[name]
        assert r["status"] == 200 and r["keys"] == r["fields"], (name, r)
    ids = load_tokenizer().encode("The capital of France is")
    assert got["prompt"]["parsed"]["tokens"] == list(ids)
    assert got["prompt"]["parsed"]["count"] == len(ids) and got["prompt"]["parsed"]["max_model_len"] > len(ids)
    assert got["prompt"]["parsed"]["token_strs"] is None
    strs = got["strs"]["parsed"]
    assert len(strs["token_strs"]) == strs["count"] == len(strs["tokens"]) > 0
    assert got["chat"]["parsed"]["count"] > 3  # the chat template's turn markers around "Hi!"
    assert got["detok"]["parsed"]["prompt"] == "The capital of France is"
