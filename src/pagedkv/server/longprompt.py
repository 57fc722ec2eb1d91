"""Long prompts arriving into decoding traffic: the ``pagedkv bench serve --long-prompt-len`` workload and its
metrics (what a user of the server feels when someone pastes a long document while others are chatting).

Workload (one *trial*)::

    streams 1..N   |--prompt--|tok tok tok tok tok .... (stall?) .... tok tok tok tok|  (cut at tail end)
    long prompt                      |send ................ first token|--tail_s--|
                                     ^ every stream has after_tokens tokens

``N`` streams (``stream_prompt_len`` random tokens, up to ``stream_output_len`` tokens, greedy, EOS ignored)
decode; once every stream has streamed ``after_tokens`` tokens, one prompt of ``long_prompt_len`` random tokens
is sent (``long_output_len`` tokens asked). The streams are watched until ``tail_s`` seconds after the long
prompt's first token, then cut (the client disconnects; the server aborts them). Prompts are fresh random token
ids per trial (``seed``), so the prefix cache never hits across trials.

Metrics (pure functions over client-side timestamps, seconds; one token per streamed chunk):

- **stall**: the largest gap between two consecutive tokens of any decoding stream that overlaps the window
  [long prompt sent, long prompt's first token]. A stream cut while waiting contributes the open gap up to the
  cut. This is the freeze a user sees while another request's prompt is prefilled.
- **ITL** (inter-token latency) percentiles p50/p90/p99/max over the gaps of every decoding stream, for the whole
  trial, before the long prompt was sent (``baseline``) and overlapping the window (``during``).
- **TPOT** per stream ((last - first token time) / (tokens - 1)), percentiles over the streams.
- **long TTFT**: the long prompt's send to its first token.

Every function here is O(total tokens); the stall and window filters are linear scans.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

__all__ = ["StreamTrace", "gaps", "percentiles", "stall", "window_gaps", "summarize_trial", "run_trial",
           "LongPromptConfig", "run_long_prompt_bench", "aggregate", "median", "print_long_prompt_summary"]

QS = (50, 90, 99)


@dataclass
class StreamTrace:
    """One streamed request as the client saw it: ``send`` time, one time per token-bearing chunk, and ``end``,
    the time it stopped being observed (its last event, or the cut); ``finished``: it ended on its own ([DONE])
    rather than being cut. ``error``: why it failed ('' when it did not)."""

    send: float
    times: list = field(default_factory=list)
    end: float = 0.0
    finished: bool = False
    error: str = ""


def gaps(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive times (``len(times) - 1`` values; none for fewer than two)."""
    return [b - a for a, b in zip(times[:-1], times[1:])]


def _intervals(s: StreamTrace) -> list[tuple[float, float]]:
    """Consecutive-token intervals of a stream, plus the open one from its last token to the cut when it was cut
    (not finished) after at least one token."""
    iv = list(zip(s.times[:-1], s.times[1:]))
    if s.times and not s.finished and s.end > s.times[-1]:
        iv.append((s.times[-1], s.end))
    return iv


def window_gaps(streams: Sequence[StreamTrace], start: float, end: float) -> list[float]:
    """Gaps of every stream (open gaps of cut streams included) whose interval overlaps [start, end]."""
    return [b - a for s in streams for a, b in _intervals(s) if a < end and b > start]


def stall(streams: Sequence[StreamTrace], start: float, end: float) -> float:
    """The largest gap overlapping [start, end] (seconds); 0.0 when no stream has a gap there."""
    return max(window_gaps(streams, start, end), default=0.0)


def percentiles(values: Sequence[float], qs: Sequence[int] = QS) -> dict:
    """``{"p50": .., "p90": .., "p99": .., "max": .., "n": ..}`` in milliseconds (linear interpolation between
    closest ranks, as numpy's default); NaN for every figure when ``values`` is empty."""
    v = sorted(values)
    out: dict = {"n": len(v)}
    for q in qs:
        if not v:
            out[f"p{q}"] = float("nan")
            continue
        k = (len(v) - 1) * q / 100
        lo = int(k)
        hi = min(lo + 1, len(v) - 1)
        out[f"p{q}"] = (v[lo] + (v[hi] - v[lo]) * (k - lo)) * 1000
    out["max"] = v[-1] * 1000 if v else float("nan")
    return out


def summarize_trial(streams: Sequence[StreamTrace], long: StreamTrace) -> dict:
    """The metrics of one trial (times in ms; see the module docstring). ``long.times[0]`` is the long prompt's
    first token; when it never came (failure, timeout) the window runs to ``long.end`` and ``long_ttft_ms`` is
    NaN."""
    first = long.times[0] if long.times else long.end
    start = long.send
    all_gaps = [g for s in streams for g in gaps(s.times)]
    before = [b - a for s in streams for a, b in zip(s.times[:-1], s.times[1:]) if b <= start]
    tpot = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in streams if len(s.times) > 1]
    during = window_gaps(streams, start, first)
    return {
        "stall_ms": max(during, default=0.0) * 1000,
        "long_ttft_ms": (first - long.send) * 1000 if long.times else float("nan"),
        "long_latency_ms": (long.end - long.send) * 1000,
        "itl_ms": percentiles(all_gaps),
        "itl_baseline_ms": percentiles(before),
        "itl_during_ms": percentiles(during),
        "tpot_ms": percentiles(tpot),
        "streams_outlived_prefill": sum(1 for s in streams if s.times and s.end >= first),
        "stream_tokens": [len(s.times) for s in streams],
        "errors": [e for e in [s.error for s in streams] + [long.error] if e],
    }


@dataclass(frozen=True)
class LongPromptConfig:
    """The knobs of one trial (see the module docstring)."""

    num_streams: int = 3
    stream_prompt_len: int = 32
    stream_output_len: int = 1024
    long_prompt_len: int = 3500
    long_output_len: int = 8
    after_tokens: int = 16
    tail_s: float = 2.0
    timeout_s: float = 120.0
    token_range: tuple = (1000, 20000)


async def _stream(http, model: str, prompt: list[int], max_tokens: int, headers: dict, trace: StreamTrace,
                  on_token=None) -> None:
    """Send one streamed completion and record its chunk times into ``trace`` (cancellable: a cancel closes the
    connection and the trace keeps what it saw)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    trace.send = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    trace.finished = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    trace.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    continue
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    trace.times.append(now)
                    if on_token is not None:
                        on_token(len(trace.times))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a failed request is reported, not fatal
        trace.error = f"{type(e).__name__}: {e}"
    finally:
        trace.end = time.perf_counter()


async def run_trial(http, model: str, cfg: LongPromptConfig, seed: int, headers: dict | None = None) -> dict:
    """One trial against the server behind ``http`` (an ``httpx.AsyncClient`` with its ``base_url``). Returns
    the metrics of :func:`summarize_trial` plus the raw times (seconds from the first send) under ``"trace"``.
    Bounded by ``cfg.timeout_s``: what is still running then is cut and the trial reports an error."""
    headers = headers or {}
    rng = random.Random(seed)
    lo, hi = cfg.token_range
    stream_prompts = [[rng.randrange(lo, hi) for _ in range(cfg.stream_prompt_len)] for _ in range(cfg.num_streams)]
    long_prompt = [rng.randrange(lo, hi) for _ in range(cfg.long_prompt_len)]
    traces = [StreamTrace(0.0) for _ in range(cfg.num_streams)]
    long = StreamTrace(0.0)
    ready = [asyncio.Event() for _ in range(cfg.num_streams)]
    long_first = asyncio.Event()

    def reached(i: int):
        def cb(n: int) -> None:
            if n >= cfg.after_tokens:
                ready[i].set()
        return cb

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_stream(http, model, p, cfg.stream_output_len, headers, tr, reached(i)))
             for i, (p, tr) in enumerate(zip(stream_prompts, traces))]
    long_task = None
    timed_out = False

    async def until_ready(i: int) -> None:  # a stream that ends early (error) must not hold the trial
        waiter = asyncio.create_task(ready[i].wait())
        await asyncio.wait([waiter, tasks[i]], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    try:
        async with asyncio.timeout(cfg.timeout_s):
            await asyncio.gather(*(until_ready(i) for i in range(cfg.num_streams)))
            long_task = asyncio.create_task(_stream(http, model, long_prompt, cfg.long_output_len, headers, long,
                                                    lambda n: long_first.set()))
            waiter = asyncio.create_task(long_first.wait())
            await asyncio.wait([waiter, long_task], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            await asyncio.sleep(cfg.tail_s)
            if long_task is not None:
                await long_task
    except TimeoutError:
        timed_out = True
    finally:
        for t in tasks + ([long_task] if long_task is not None else []):
            t.cancel()
        await asyncio.gather(*tasks, *([long_task] if long_task is not None else []), return_exceptions=True)
    out = summarize_trial(traces, long)
    if timed_out:
        out["errors"].append(f"trial timed out after {cfg.timeout_s} s")
    rel = lambda xs: [round(x - t0, 6) for x in xs]  # noqa: E731
    out["trace"] = {
        "streams": [{"send": round(s.send - t0, 6), "times": rel(s.times), "end": round(s.end - t0, 6),
                     "finished": s.finished} for s in traces],
        "long": {"send": round(long.send - t0, 6) if long_task else None, "times": rel(long.times),
                 "end": round(long.end - t0, 6) if long_task else None},
    }
    return out


async def run_long_prompt_bench(base_url: str, model: str | None, cfg: LongPromptConfig, *, trials: int = 1,
                                seed: int = 0, api_key: str | None = None, progress: bool = True) -> dict:
    """``trials`` trials one after the other (seeds ``seed``, ``seed + 1``, ...), against ``base_url``. Returns
    ``{"model", "config", "trials": [...], "median_stall_ms", "median_long_ttft_ms", "itl_ms", "tpot_ms",
    "errors"}``; ``itl_ms`` / ``tpot_ms`` pool the gaps of every trial."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=cfg.num_streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as http:
        if model is None:
            r = await http.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        results = []
        for k in range(trials):
            res = await run_trial(http, model, cfg, seed + k, headers)
            results.append(res)
            if progress:
                print(f"trial {k + 1}/{trials}: stall {res['stall_ms']:.0f} ms, long-prompt TTFT "
                      f"{res['long_ttft_ms']:.0f} ms, ITL p50 {res['itl_ms']['p50']:.1f} ms", flush=True)
    return aggregate(results, model, cfg)


def median(xs: Sequence[float]) -> float:
    """The median of the values that are not NaN (NaN when none is). O(n log n)."""
    v = sorted(x for x in xs if x == x)
    if not v:
        return float("nan")
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def aggregate(trials: Sequence[dict], model: str, cfg: LongPromptConfig) -> dict:
    """Medians over trials of the stall and the long TTFT; ITL and TPOT percentiles over the pooled gaps."""
    itl, before, tpot = [], [], []
    for t in trials:
        tr = t["trace"]
        start = tr["long"]["send"]
        for s in tr["streams"]:
            g = gaps(s["times"])
            itl += g
            before += [b - a for a, b in zip(s["times"][:-1], s["times"][1:]) if start is None or b <= start]
            if len(s["times"]) > 1:
                tpot.append((s["times"][-1] - s["times"][0]) / (len(s["times"]) - 1))
    return {
        "model": model,
        "config": asdict(cfg),
        "median_stall_ms": median([t["stall_ms"] for t in trials]),
        "max_stall_ms": max((t["stall_ms"] for t in trials), default=float("nan")),
        "median_long_ttft_ms": median([t["long_ttft_ms"] for t in trials]),
        "itl_ms": percentiles(itl),
        "itl_baseline_ms": percentiles(before),
        "tpot_ms": percentiles(tpot),
        "errors": [e for t in trials for e in t["errors"]],
        "trials": list(trials),
    }


def print_long_prompt_summary(s: dict) -> None:
    c = s["config"]
    print("=" * 20 + " Long prompt into decoding traffic " + "=" * 19)
    print(f"{c['num_streams']} streams decoding, then a {c['long_prompt_len']}-token prompt; "
          f"{len(s['trials'])} trial(s)")
    rows = [("Largest stall of the streams (ms, median):", f"{s['median_stall_ms']:.1f}"),
            ("Largest stall (ms, worst trial):", f"{s['max_stall_ms']:.1f}"),
            ("Long prompt TTFT (ms, median):", f"{s['median_long_ttft_ms']:.1f}")]
    for name, key in (("ITL", "itl_ms"), ("ITL before the long prompt", "itl_baseline_ms"), ("TPOT", "tpot_ms")):
        p = s[key]
        rows.append((f"{name} p50/p90/p99/max (ms):",
                     f"{p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f} / {p['max']:.1f}"))
    for k, v in rows:
        print(f"{k:<48}{v:>26}")
    for e in sorted(set(s["errors"]))[:5]:
        print(f"error: {e}")
    print("=" * 74)
