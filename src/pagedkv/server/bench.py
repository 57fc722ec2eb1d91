"""``pagedkv bench serve``: load a running OpenAI-compatible server and report latency and throughput figures
(what vLLM's ``benchmark_serving.py`` reports), over streamed ``/v1/completions`` requests.

Workload: ``--num-prompts`` prompts of ``--input-len`` random token ids (sent as token ids, so lengths are
exact), of which the first ``--shared-prefix-len`` are the same in every prompt (a system prompt, say); each asks
for exactly ``--output-len`` tokens (``ignore_eos``, greedy). Requests start at ``--request-rate`` per second
(Poisson arrivals; ``inf``, the default, sends them all at once), at most ``--max-concurrency`` at a time.

With ``--long-prompt-len``, the workload is instead long prompts arriving into decoding traffic
(:mod:`pagedkv.server.longprompt`): ``--num-streams`` streams decode, then one prompt of ``--long-prompt-len``
tokens arrives; reported: the largest stall of the decoding streams while it is prefilled, its TTFT, and ITL /
TPOT percentiles (p50/p90/p99/max).

Per request: TTFT (send to first streamed text), ITL (gaps between streamed chunks), TPOT ((latency - TTFT) /
(output tokens - 1)). Printed: requests/s, output tokens/s, and the median and p99 of TTFT, TPOT and ITL (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

__all__ = ["main", "run_benchmark", "RequestResult"]


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    error: str = ""


def make_prompts(num: int, input_len: int, shared_prefix_len: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(low, high) for _ in range(min(shared_prefix_len, input_len))]
    return [shared + [rng.randrange(low, high) for _ in range(input_len - len(shared))] for _ in range(num)]


async def _one(http, url: str, model: str, prompt: list[int], output_len: int, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(False, len(prompt))
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = True
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    return res


async def run_benchmark(base_url: str, model: str | None, prompts: list[list[int]], output_len: int, *,
                        request_rate: float = float("inf"), max_concurrency: int | None = None,
                        api_key: str | None = None, seed: int = 0, progress: bool = True,
                        send_times: list[float] | None = None) -> dict:
    """Send every prompt, return the summary (and per-request results under ``"requests"``). ``send_times``
    (seconds from the start, one per prompt, non-decreasing) replaces the Poisson arrivals."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        if model is None:
            r = await http.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="bench serve", unit="req")

        async def limited(p: list[int]) -> RequestResult:
            if sem is None:
                out = await _one(http, "/v1/completions", model, p, output_len, headers)
            else:
                async with sem:
                    out = await _one(http, "/v1/completions", model, p, output_len, headers)
            if bar is not None:
                bar.update(1)
            return out

        rng = random.Random(seed)
        tasks = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if send_times is not None:
                await asyncio.sleep(max(0.0, t0 + send_times[i] - time.perf_counter()))
            tasks.append(asyncio.create_task(limited(p)))
            if send_times is None and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return summarize(results, duration, model)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * 1000


def summarize(results: list[RequestResult], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    ttft = [r.ttft for r in ok]
    return {
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "total_output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "total_prompt_tokens": sum(r.prompt_len for r in ok),
        **{f"{stat}_{name}_ms": _pct(vals, q) for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl))
           for stat, q in (("median", 50), ("p99", 99))},
        "mean_ttft_ms": sum(ttft) / len(ttft) * 1000 if ttft else float("nan"),
        "requests": [asdict(r) for r in results],
    }


def print_summary(s: dict) -> None:
    print("=" * 16 + " Serving Benchmark Result " + "=" * 16)
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_prompt_tokens"]), ("Cached input tokens:", s["cached_prompt_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    for name in ("ttft", "tpot", "itl"):
        rows += [(f"Median {name.upper()} (ms):", f"{s[f'median_{name}_ms']:.2f}"),
                 (f"P99 {name.upper()} (ms):", f"{s[f'p99_{name}_ms']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>12}")
    for e in s["errors"]:
        print(f"error: {e}")
    print("=" * 58)


def build_parser() -> argparse.ArgumentParser:
    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv bench serve", description=plain(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests sent")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens generated per request (end of sequence ignored; default 32, and 1024 for each stream "
                        "of --long-prompt-len, which are cut once the long prompt is answered)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="leading prompt tokens shared by all prompts")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--token-range", type=int, nargs=2, default=(1000, 20000), metavar=("LOW", "HIGH"),
                   help="random prompt token ids are drawn from [LOW, HIGH)")
    p.add_argument("--result-json", default=None, help="write the summary and per-request results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = p.add_argument_group("multi-turn workload from a Mooncake trace (pagedkv.replay.workload)")
    t.add_argument("--trace", default=None, help="send whole conversations sampled from this trace, scaled down, "
                                                 "in arrival order (replaces the random prompts)")
    t.add_argument("--trace-conversations", type=int, default=24, help="conversations sampled (24)")
    t.add_argument("--trace-tokens-per-id", type=int, default=16, help="tokens per 512-token trace block (16)")
    t.add_argument("--trace-max-tokens", type=int, default=1536, help="longest scaled prompt kept (1536)")
    t.add_argument("--trace-time-scale", type=float, default=0.0,
                   help="send each request at its trace time divided by this (0: in order, as fast as the "
                        "concurrency cap allows)")
    lp = p.add_argument_group("long prompts into decoding traffic (pagedkv.server.longprompt)")
    lp.add_argument("--long-prompt-len", type=int, default=None, metavar="TOKENS",
                    help="run this workload: streams decode, then a prompt of TOKENS random tokens arrives "
                         "(replaces the random prompts; --input-len is each stream's prompt length)")
    lp.add_argument("--num-streams", type=int, default=3, help="streams decoding when the long prompt arrives (3)")
    lp.add_argument("--long-output-len", type=int, default=8, help="tokens the long prompt asks for (8)")
    lp.add_argument("--long-after-tokens", type=int, default=16,
                    help="the long prompt is sent once every stream has streamed this many tokens (16)")
    lp.add_argument("--tail", type=float, default=2.0,
                    help="seconds the streams are watched after the long prompt's first token, then cut (2)")
    lp.add_argument("--trials", type=int, default=1, help="trials one after the other, fresh prompts each (1)")
    lp.add_argument("--trial-timeout", type=float, default=120.0, help="seconds one trial may take (120)")
    return p


def _long_prompt_main(args: argparse.Namespace) -> int:
    from .longprompt import LongPromptConfig, print_long_prompt_summary, run_long_prompt_bench

    if (args.long_prompt_len < 1 or args.num_streams < 1 or args.long_output_len < 1 or args.trials < 1
            or args.long_after_tokens < 1 or not args.tail >= 0 or not args.trial_timeout > 0):
        print("pagedkv bench serve: error: --long-prompt-len, --num-streams, --long-output-len, --trials and "
              "--long-after-tokens must be >= 1, --tail >= 0 and --trial-timeout > 0", file=sys.stderr)
        return 2
    out_len = 1024 if args.output_len is None else args.output_len
    if out_len <= args.long_after_tokens:
        print("pagedkv bench serve: error: --output-len must exceed --long-after-tokens", file=sys.stderr)
        return 2
    cfg = LongPromptConfig(num_streams=args.num_streams, stream_prompt_len=args.input_len, stream_output_len=out_len,
                           long_prompt_len=args.long_prompt_len, long_output_len=args.long_output_len,
                           after_tokens=args.long_after_tokens, tail_s=args.tail, timeout_s=args.trial_timeout,
                           token_range=tuple(args.token_range))
    try:
        s = asyncio.run(run_long_prompt_bench(args.base_url, args.model, cfg, trials=args.trials, seed=args.seed,
                                              api_key=args.api_key, progress=not args.no_progress))
    except Exception as e:  # server unreachable, bad URL, ...
        print(f"pagedkv bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print_long_prompt_summary(s)
    _write_result(s, args)
    return 0 if not s["errors"] else 1


def _write_result(s: dict, args) -> None:
    """The summary and the arguments that made it, as JSON, when ``--result-json`` is given."""
    if args.result_json:
        s["args"] = {k: v for k, v in vars(args).items()}
        with open(args.result_json, "w") as f:
            json.dump(s, f, indent=1, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.long_prompt_len is not None:
        if args.trace:
            print("pagedkv bench serve: error: --long-prompt-len and --trace are different workloads",
                  file=sys.stderr)
            return 2
        return _long_prompt_main(args)
    if args.output_len is None:
        args.output_len = 32
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        print("pagedkv bench serve: error: --num-prompts, --input-len and --output-len must be >= 1", file=sys.stderr)
        return 2
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("pagedkv bench serve: error: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    send_times = None
    if args.trace:
        from ..replay.workload import trace_prompts

        try:
            prompts, times = trace_prompts(args.trace, conversations=args.trace_conversations,
                                           tokens_per_id=args.trace_tokens_per_id, max_tokens=args.trace_max_tokens,
                                           seed=args.seed, low=args.token_range[0], high=args.token_range[1],
                                           return_times=True)
        except (OSError, ValueError, KeyError) as e:
            print(f"pagedkv bench serve: error: --trace: {e}", file=sys.stderr)
            return 2
        if args.trace_time_scale < 0:
            print("pagedkv bench serve: error: --trace-time-scale must be >= 0", file=sys.stderr)
            return 2
        if args.trace_time_scale > 0:
            send_times = [t / args.trace_time_scale for t in times]
    else:
        prompts = make_prompts(args.num_prompts, args.input_len, args.shared_prefix_len, args.seed, *args.token_range)
    try:
        s = asyncio.run(run_benchmark(args.base_url, args.model, prompts, args.output_len,
                                      request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                                      api_key=args.api_key, seed=args.seed, progress=not args.no_progress,
                                      send_times=send_times))
    except Exception as e:  # server unreachable, bad URL, ...
        print(f"pagedkv bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print_summary(s)
    _write_result(s, args)
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
