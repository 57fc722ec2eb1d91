"""vLLM's own toy prefill/decode proxy (tests/compat/vendor/toy_proxy_server.py, unchanged) in front of
``pagedkv serve --kv-role prefill`` and ``--kv-role decode``: the proxy sends the prompt to the prefill replica
with vLLM's ``kv_transfer_params`` (``do_remote_decode``), passes the answer's ``kv_transfer_params`` to the
decode replica, and relays its answer. Greedy text through the proxy equals the decode replica's own, and the
decode replica really read the prompt's blocks from the prefill replica (its fetch counter). The proxy needs
only FastAPI, httpx and uvicorn (it imports nothing of vLLM), so it runs in the main virtualenv."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from test_vllm_compat import ROOT, Procs, free_port, wait_http  # noqa: E402

PROXY = Path(__file__).with_name("vendor") / "toy_proxy_server.py"
MODEL = "smollm2-135m"


def fetched_blocks(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedkv:kv_handoff_blocks_fetched_total"):
            return float(line.split()[-1])
    raise AssertionError("no pagedkv:kv_handoff_blocks_fetched_total in /metrics")


@pytest.mark.engine
def test_vllms_toy_proxy_drives_pagedkv_prefill_and_decode_replicas(tmp_path):
    procs = Procs(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]), OMP_NUM_THREADS="1")
    try:
        ports = {"prefill": free_port(), "decode": free_port()}
        urls = {role: f"http://127.0.0.1:{p}" for role, p in ports.items()}
        serve = {role: procs.start(role, [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(p),
                                          "--kv-role", role, "--num-gpu-blocks", "128"], env)
                 for role, p in ports.items()}
        xport = free_port()
        proxy = procs.start("proxy", [sys.executable, str(PROXY), "--port", str(xport),
                                      "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(ports["prefill"]),
                                      "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(ports["decode"])], env)
        for role in ports:
            wait_http(urls[role] + "/health", serve[role], 300)
        xurl = f"http://127.0.0.1:{xport}"
        wait_http(xurl + "/healthcheck", proxy, 60)
        prompt = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks, so that "
                  "sequences sharing a prefix can share its blocks and memory is not reserved ahead. ") * 2
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        before = fetched_blocks(urls["decode"])
        r = httpx.post(xurl + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        via = r.json()
        assert fetched_blocks(urls["decode"]) > before  # the decode replica read the prompt's blocks
        direct = httpx.post(urls["decode"] + "/v1/completions", json=body, timeout=300).json()
        assert via["choices"][0]["text"] == direct["choices"][0]["text"] and via["choices"][0]["text"]
        assert via["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 12
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0}
        before = fetched_blocks(urls["decode"])
        r = httpx.post(xurl + "/v1/chat/completions", json=chat, timeout=300)
        assert r.status_code == 200, r.text
        assert fetched_blocks(urls["decode"]) > before
        direct = httpx.post(urls["decode"] + "/v1/chat/completions", json=chat, timeout=300).json()
        assert r.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    finally:
        procs.close()
