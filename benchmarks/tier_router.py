"""The conversation trace through ``pagedkv router`` over two replicas, with and without the shared tier (issue 24,
item 6): prompt tokens served from cache, per tier, and TTFT p50 / p90.

Per configuration, fresh processes (cold caches): two ``pagedkv serve`` replicas (SmolLM2-135M, small KV pools,
KV events) behind ``pagedkv router --route prefix``, loaded by ``pagedkv bench serve --trace`` (whole conversations
sampled from the Mooncake conversation trace, scaled down in tokens and time); the configurations:

- **no shared tier**: each replica holds only its own GPU pool;
- **shared tier (Redis)**: both replicas also write every computed prompt block through to one Redis on
  127.0.0.1 (``--kv-shared redis://...``) and load from it the blocks of a prompt past their own pool's hit (a
  conversation whose earlier turns the other replica served, or whose blocks the replica's small pool evicted);
  the router counts blocks in the shared store as reachable from both replicas (KV events with medium SHARED).

Prompt tokens served from cache come from the replicas' usage (``cached_tokens``, which counts the tier's loads
too); the shared tier's part from the replicas' ``pagedkv:kv_tier_hit_blocks_total{medium="SHARED"}`` x the block
size; the replicas' own pools serve the rest. TTFT percentiles over every completed request (client-measured).
Everything binds 127.0.0.1, every process started is stopped, every run is bounded (``--timeout`` s).

    python benchmarks/tier_router.py --trace ../shared/data/mooncake/conversation_trace.jsonl \\
        [--conversations 24] [--repeats 1] [--out benchmarks/results/router_tiers]
    python benchmarks/tier_router.py --show benchmarks/results/router_tiers/summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tier_common import RedisServer, machine  # noqa: E402
import router_bench  # noqa: E402

BLOCK = 16  # pagedkv serve's default block size


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus family's samples whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _pct(vals: list[float], q: float) -> float:
    if not vals:
        return float("nan")
    v = sorted(vals)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(doc: dict, config: str) -> dict:
    """One run's row: tokens, cache hits by tier, TTFT percentiles (ms), failures."""
    reqs = [r for r in doc["requests"] if r.get("ok")]
    ttft = [1000 * r["ttft"] for r in reqs]
    shared_blocks = sum(_metric(m, "pagedkv:kv_tier_hit_blocks_total", medium="SHARED")
                        for m in doc.get("replica_metrics", []))
    failed_blocks = sum(_metric(m, "pagedkv:kv_tier_failed_blocks_total") for m in doc.get("replica_metrics", []))
    prompt, cached = doc["total_prompt_tokens"], doc["cached_prompt_tokens"]
    shared = int(shared_blocks) * BLOCK
    return {"config": config, "completed": doc["completed"], "failed": doc["failed"], "prompt_tokens": prompt,
            "cached_tokens": cached, "own_pool_tokens": cached - shared, "shared_tier_tokens": shared,
            "tier_failed_blocks": int(failed_blocks), "hit_rate": cached / prompt if prompt else 0.0,
            "shared_rate": shared / prompt if prompt else 0.0,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "ttft_p99_ms": _pct(ttft, 99),
            "duration_s": doc["duration_s"],
            "decisions": router_bench.decisions(doc.get("router_metrics", ""))}


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-tier-router-") as tmp, RedisServer(tmp) as redis_srv:
        if redis_srv.url is None:
            raise SystemExit("redis-server is needed for the shared tier (scripts/setup.sh installs it)")
        for rep in range(args.repeats):
            for config in args.configs.split(","):
                if config == "shared":
                    import redis

                    redis.Redis.from_url(redis_srv.url).flushall()  # a cold shared store for every run
                    serve = ("--kv-shared", redis_srv.url)
                else:
                    serve = ()
                doc = router_bench.run_route(args.route, args, out, serve_args=serve, tag=f"{config}-{rep}")
                row = summarize(doc, config)
                row["repeat"] = rep
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    res = {"setup": {"replicas": args.replicas, "route": args.route, "num_gpu_blocks": args.num_gpu_blocks,
                     "conversations": args.conversations, "output_len": args.output_len,
                     "concurrency": args.concurrency, "time_scale": args.time_scale, "threads": args.threads,
                     "model": "smollm2-135m (pagedkv serve's default)", "trace": Path(args.trace).name},
           "machine": machine(), "runs": rows}
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    return res


def show(res: dict) -> None:
    s = res["setup"]
    print(f"{s['replicas']} replicas x {s['num_gpu_blocks']} blocks of {BLOCK} tokens, route {s['route']}, "
          f"{s['conversations']} conversations of the {s['trace']} trace, concurrency {s['concurrency']}, "
          f"output {s['output_len']} tokens; load average {res['machine']['loadavg'][0]:.1f}")
    print("| configuration | run | requests ok / failed | prompt tokens | from cache | own pool (GPU) | shared tier "
          "| TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    label = {"none": "no shared tier", "shared": "shared tier (Redis)"}
    for r in res["runs"]:
        p = r["prompt_tokens"]
        print(f"| {label.get(r['config'], r['config'])} | {r['repeat']} | {r['completed']} / {r['failed']} | {p:,} | "
              f"{100 * r['hit_rate']:.1f}% | {100 * r['own_pool_tokens'] / p:.1f}% | "
              f"{100 * r['shared_rate']:.1f}% | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |")
    by = {}
    for r in res["runs"]:
        by.setdefault(r["config"], []).append(r)
    if len(res["runs"]) > len(by):
        for c, rs in by.items():
            print(f"median over {len(rs)} runs, {label.get(c, c)}: from cache "
                  f"{100 * statistics.median(r['hit_rate'] for r in rs):.1f}%, TTFT p50 "
                  f"{statistics.median(r['ttft_p50_ms'] for r in rs):.0f} ms, p90 "
                  f"{statistics.median(r['ttft_p90_ms'] for r in rs):.0f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--configs", default="none,shared", help="comma-separated: none, shared (run in this order)")
    ap.add_argument("--route", default="prefix")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-gpu-blocks", type=int, default=128, help="KV blocks of 16 tokens per replica (128)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (1)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=40.0, help="trace time / this = send time (40)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/router_tiers")
    ap.add_argument("--show", default=None, metavar="JSON", help="reprint a summary.json")
    args = ap.parse_args(argv)
    if args.show:
        show(json.loads(Path(args.show).read_text()))
        return 0
    if args.trace is None:
        ap.error("--trace is required")
    if any(c not in ("none", "shared") for c in args.configs.split(",")):
        ap.error("--configs takes none and shared")
    show(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
