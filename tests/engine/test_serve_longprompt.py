"""``pagedkv bench serve --long-prompt-len``: the long-prompt-into-decoding-traffic workload against a real
server on the loopback (127.0.0.1, a free port, the session's loaded SmolLM2 weights), without chunked prefill and
with it (a 64-token budget, so the "long" prompt takes five steps). Small and bounded: two streams, a 300-token
long prompt, one trial under a 60 s timeout per mode; the cut streams must leave the engine idle."""

from __future__ import annotations

import json
import math
import time

import pytest
from pagedkv.engine.config import SchedulerConfig

pytestmark = pytest.mark.engine

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module", params=[False, True], ids=["unchunked", "chunked64"])
def server(engine, request):
    from pagedkv.engine import LLM
    from pagedkv.server.launch import make_server

    chunked = request.param
    llm = LLM(engine.paged, num_gpu_blocks=96, max_num_seqs=8, block_size=16,
              scheduler_config=SchedulerConfig(enable_chunked_prefill=chunked,
              max_num_batched_tokens=64 if chunked else 2048))
    srv = make_server(llm, model_name="smollm2-test", max_waiting=16).start_in_thread()
    srv.chunked = chunked
    yield srv
    srv.close()


def test_long_prompt_workload_end_to_end(server, tmp_path, capsys):
    from pagedkv.server.bench import main

    out = tmp_path / "lp.json"
    rc = main(["--base-url", server.url, "--long-prompt-len", "300", "--num-streams", "2", "--input-len", "8",
               "--output-len", "400", "--long-after-tokens", "6", "--long-output-len", "3", "--tail", "0.3",
               "--trial-timeout", "60", "--result-json", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "Largest stall of the streams" in printed and "Long prompt TTFT" in printed
    s = json.loads(out.read_text())
    assert s["model"] == "smollm2-test" and s["errors"] == []
    (trial,) = s["trials"]
    tr = trial["trace"]
    long = tr["long"]
    assert len(long["times"]) >= 1 and long["send"] <= long["times"][0] <= long["end"]
    for st in tr["streams"]:
        # the long prompt went out only once every stream had streamed its 6 tokens
        assert len(st["times"]) >= 6 and st["times"][5] <= long["send"]
        # streams were cut after the tail (400 tokens cannot all come in that time), not finished
        assert not st["finished"] and st["end"] >= long["times"][0]
    assert trial["streams_outlived_prefill"] == 2
    # tokens each stream streamed while the long prompt waited for its first token: without chunking, at most the
    # step in flight when it arrived and the prefill step itself; with a 64-token budget its 300 tokens take five
    # steps (62 prompt tokens beside the two decodes), and every one of them gives each stream a token
    inside = [sum(1 for t in st["times"] if long["send"] < t < long["times"][0]) for st in tr["streams"]]
    if server.chunked:
        assert min(inside) >= 3, inside
    else:
        assert max(inside) <= 2, inside
    assert trial["long_ttft_ms"] == pytest.approx((long["times"][0] - long["send"]) * 1000, abs=1e-3)
    assert 0 < trial["stall_ms"] == pytest.approx(trial["itl_during_ms"]["max"])
    for key in ("itl_ms", "itl_baseline_ms", "tpot_ms"):
        assert {"p50", "p90", "p99", "max"} <= set(s[key]) and not math.isnan(s[key]["p50"])
    # the cut streams were aborted by the server: it holds no request shortly after
    deadline = time.monotonic() + 20
    while server.engine.num_unfinished or server.engine.llm.scheduler.has_unfinished():
        assert time.monotonic() < deadline, "the cut streams are still in the engine"
        time.sleep(0.05)


def test_long_prompt_options_are_checked(capsys):
    from pagedkv.server.bench import main

    assert main(["--long-prompt-len", "0"]) == 2
    assert main(["--long-prompt-len", "10", "--output-len", "4", "--long-after-tokens", "4"]) == 2
    assert main(["--long-prompt-len", "10", "--trace", "x.jsonl"]) == 2
    assert capsys.readouterr().err.count("pagedkv bench serve: error") == 3
