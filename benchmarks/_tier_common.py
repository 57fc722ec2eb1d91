"""What the storage-tier benchmarks share (tier_serving.py, tier_crossover.py, tier_router.py): a free port on
127.0.0.1, a throwaway Redis server, an in-process server whose TTFT is measured, the machine's description,
medians.

Not a benchmark itself; the scripts import it from their own folder (``benchmarks/`` is on ``sys.path`` when a
script there runs).
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import statistics
import subprocess
import json
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` on 127.0.0.1 with no persistence, for one run (a context manager; ``url`` is None when
    ``redis-server`` is not installed or did not answer within 10 s, and then nothing runs)."""

    def __init__(self, workdir: str) -> None:
        self.proc = None
        self.url = None
        binary = shutil.which("redis-server")
        if binary is None:
            return
        port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir, "--loglevel", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        url = f"redis://127.0.0.1:{port}"
        for _ in range(200):
            try:
                redis.Redis.from_url(url).ping()
                self.url = url
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def machine() -> dict:
    """The platform, CPU count and load average now (printed beside timed figures: the machine is shared)."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def medians(rows: list[dict], keys) -> dict:
    """``{key: median of rows[i][key]}`` for each key."""
    return {k: statistics.median(r[k] for r in rows) for k in keys}


class TierServer:
    """An ``LLM`` served by ``make_server`` on 127.0.0.1 in a thread (its own GPU pool, so nothing in its prefix
    cache at the start), the storage tiers and other ``LLM`` arguments given by ``llm_kw``; :meth:`ttft` measures one
    streamed request."""

    def __init__(self, model, block_size: int, **llm_kw) -> None:
        from pagedkv.engine import LLM, engine_configs
        from pagedkv.server.launch import make_server

        self.llm = LLM(model, block_size=block_size, max_num_seqs=4, **engine_configs(**llm_kw))
        self.srv = make_server(self.llm, model_name="m", max_waiting=8).start_in_thread()

    def ttft(self, prompt: list[int]) -> tuple[float, str, int]:
        """(seconds to the first streamed chunk, the whole text, prompt tokens the tiers served)."""
        import httpx

        before = self.llm.scheduler.stats.external_tokens
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first = None
        text = []
        with httpx.stream("POST", self.srv.url + "/v1/completions", json=body, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - t0
                for ch in json.loads(line[5:]).get("choices", []):
                    text.append(ch.get("text", ""))
        deadline = time.monotonic() + 60
        while self.llm.scheduler.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        return first, "".join(text), self.llm.scheduler.stats.external_tokens - before

    @property
    def connector(self):
        """The engine's tier connector (``pagedkv.tiers.TierConnector``; the server wraps the engine's tiers in its
        KV port)."""
        t = self.llm.kv_tiers
        return getattr(t, "inner", t).connector

    def close(self) -> None:
        self.srv.close()
        self.llm.close()  # the stores in flight finish, the disk directory is released
