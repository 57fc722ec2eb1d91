"""Issue 34: an idle server's metrics are settled when its tier writes finish, without another request. Before,
finished tier writes were accounted only at the next engine step: after the last answer ``kv_cache_usage_perc``
stayed above 0 (the blocks pinned for the store) and ``kv_tier_stored_blocks_total`` below what the tier held,
until another request came. The disk tier's writes are slowed so that they end after the answer."""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.engine

BS = 4


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, name
    return float(m.group(2))


def test_idle_metrics_settle_when_the_tier_writes_finish(engine, tmp_path, monkeypatch):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from pagedkv.engine.llm import LLM
    from pagedkv.server.launch import make_server
    from pagedkv.tiers import _files

    real = _files.write_atomic

    def slow(*a, **kw):
        time.sleep(0.15)
        return real(*a, **kw)

    monkeypatch.setattr(_files, "write_atomic", slow)
    from pagedkv.engine.config import engine_configs

    llm = LLM(engine.paged, block_size=BS, max_num_seqs=4, num_gpu_blocks=96,
              **engine_configs(kv_disk_dir=tmp_path, kv_disk_gib=0.05))
    srv = make_server(llm, model_name="m", max_waiting=8).start_in_thread()
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": list(range(300, 330)),
                                                          "max_tokens": 2, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        tiers = getattr(llm.kv_tiers, "inner", None) or llm.kv_tiers
        assert tiers.connector.flush(60)  # every write ended (on the I/O threads); no request comes after
        deadline = time.monotonic() + 10
        while True:
            m = httpx.get(srv.url + "/metrics", timeout=10).text
            stored = sample(m, "pagedkv:kv_tier_stored_blocks_total")
            usage = sample(m, "pagedkv:kv_cache_usage_perc")
            if (stored > 0 and usage == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        disk = tiers.connector.stores()[0].backend
        assert stored == disk.num_values > 0
        assert usage == 0.0
        assert sample(m, "pagedkv:num_requests_running") == 0
    finally:
        srv.close()
        llm.close()
