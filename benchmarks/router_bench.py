"""Live figures of ``pagedkv router``: N ``pagedkv serve`` replicas (subprocesses, small KV pools, KV events)
behind the router, loaded by ``pagedkv bench serve --trace`` (whole conversations sampled from the Mooncake
conversation trace, scaled down), once per route; fresh replicas (cold caches) for each route.

    python benchmarks/router_bench.py --trace ../shared/data/mooncake/conversation_trace.jsonl \\
        --route prefix --route round-robin --out benchmarks/results/router

Writes ``bench-<route>.json`` (the bench summary plus the router's /metrics text) per route and prints a table:
hit rate (cached / prompt tokens, from the replicas' usage), TTFT median / p99, throughput, decisions per
replica. Everything binds 127.0.0.1; every process started is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, procs, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited before it was ready")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy")


def pagedkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", *args]


def run_route(route: str, args, outdir: Path, serve_args: tuple = (), tag: str | None = None) -> dict:
    """One run: fresh replicas (``serve_args`` added to each ``pagedkv serve``), the router, the trace's bench.
    Writes and returns ``bench-<tag or route>.json``: the bench summary, the router's and each replica's /metrics
    text (scraped before they stop), the setup."""
    tag = tag or route
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"))
    procs, backends = [], []
    logs = []
    try:
        for i in range(args.replicas):
            port, ev, rep = free_port(), free_port(), free_port()
            log = open(outdir / f"replica-{tag}-{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(pagedkv("serve", "--port", str(port), "--num-gpu-blocks",
                                                  str(args.num_gpu_blocks), "--max-num-seqs", "8",
                                                  "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}",
                                                  "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                                                  *serve_args),
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
            backends.append((f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rep}"))
        for url, _ in backends:
            wait_health(url, procs)
        rport = free_port()
        rlog = open(outdir / f"router-{tag}.log", "w")
        logs.append(rlog)
        cmd = ["router", "--port", str(rport), "--route", route]
        for url, ev in backends:
            cmd += ["--backend", f"{url},{ev}"]
        procs.append(subprocess.Popen(pagedkv(*cmd), env=env, stdout=rlog, stderr=subprocess.STDOUT))
        rurl = f"http://127.0.0.1:{rport}"
        wait_health(rurl, procs)
        out = outdir / f"bench-{tag}.json"
        bench = pagedkv("bench", "serve", "--base-url", rurl, "--trace", args.trace, "--trace-conversations",
                        str(args.conversations), "--output-len", str(args.output_len), "--max-concurrency",
                        str(args.concurrency), "--trace-time-scale", str(args.time_scale), "--no-progress",
                        "--result-json", str(out))
        subprocess.run(bench, env=env, check=False)
        import httpx

        doc = json.loads(out.read_text())
        doc["router_metrics"] = httpx.get(rurl + "/metrics").text
        doc["replica_metrics"] = [httpx.get(url + "/metrics").text for url, _ in backends]
        doc["setup"] = {"route": route, "replicas": args.replicas, "num_gpu_blocks": args.num_gpu_blocks,
                        "threads_per_replica": args.threads, "concurrency": args.concurrency,
                        "conversations": args.conversations, "output_len": args.output_len,
                        "time_scale": args.time_scale, "serve_args": list(serve_args)}
        out.write_text(json.dumps(doc, indent=1, default=str))
        return doc
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def simulate(args) -> None:
    """The same prompts one at a time through ``replicas`` prefix-caching managers of ``num_gpu_blocks`` blocks,
    routed by the router's own state (policies, events-fed index), no concurrency and no output tokens."""
    from pagedkv import BlockManager, block_hashes
    from pagedkv.replay.workload import trace_prompts
    from pagedkv.router.state import Replica, RouterState

    prompts = trace_prompts(args.trace, conversations=args.conversations, max_tokens=1536)
    for route in args.route or ["prefix", "round-robin"]:
        names = [f"r{i}" for i in range(args.replicas)]
        st = RouterState([Replica(f"http://{n}") for n in names], route=route)
        bms = {f"http://{n}": BlockManager(args.num_gpu_blocks, 16, enable_prefix_caching=True, watermark=0.0,
                                           enable_kv_events=True) for n in names}
        hit = total = 0
        for i, p in enumerate(prompts):
            h = block_hashes(p, 16)
            url, _, load = st.choose(h, len(p))
            hit += bms[url].allocate(i, p)
            bms[url].free(i)
            st.apply_events(url, bms[url].events.take())
            st.done(url, load, h)
            total += len(p)
        print(f"simulated {route}: hit rate {100 * hit / total:.1f}% of {total:,} prompt tokens, decisions "
              f"{[st.replicas[u].decisions for u in bms]}")


def decisions(metrics: str) -> list[int]:
    return [int(float(line.split()[-1])) for line in metrics.splitlines()
            if line.startswith("pagedkv_router_decisions_total{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--route", action="append", help="routes to compare (default: prefix, round-robin)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--num-gpu-blocks", type=int, default=256, help="KV blocks of 16 tokens per replica (256)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (1)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=40.0, help="trace time / this = send time (40)")
    ap.add_argument("--out", default="benchmarks/results/router")
    ap.add_argument("--simulate", action="store_true", help="only the one-at-a-time simulation (no processes)")
    args = ap.parse_args()
    if args.simulate:
        sys.path.insert(0, str(ROOT / "src"))
        simulate(args)
        return 0
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for route in args.route or ["prefix", "round-robin"]:
        d = run_route(route, args, outdir)
        hit = d["cached_prompt_tokens"] / d["total_prompt_tokens"] if d["total_prompt_tokens"] else 0.0
        rows.append((route, d["completed"], d["failed"], hit, d["median_ttft_ms"], d["p99_ttft_ms"],
                     d["mean_ttft_ms"], d["request_throughput"], decisions(d["router_metrics"])))
    print(f"{'route':<14}{'ok':>4}{'fail':>5}{'hit rate':>10}{'TTFT med':>10}{'p99':>9}{'mean':>9}{'req/s':>7}"
          "  decisions per replica")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:>4}{r[2]:>5}{100 * r[3]:>9.1f}%{r[4]:>9.0f}ms{r[5]:>7.0f}ms{r[6]:>7.0f}ms"
              f"{r[7]:>7.2f}  {r[8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
