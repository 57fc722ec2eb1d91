"""Figures of docs/reliability.md: what hardening costs and what it bounds. Prints, does not assert.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_faults.py [--tenants 100000] [--skip-serve]

1. Validation cost per request: ``pagedkv.server.validation.parse_completion`` / ``parse_chat`` on typical
   bodies, microseconds per call (median of 7 alternating rounds), and the hostile table's bodies.
2. Namespaces: the prefix-cache namespace registry and live Python objects after N distinct ``cache_salt``s
   (allocate + free of a 3-block prompt each, a 64-block pool with a CPU tier and KV events), with the release
   sweep on and off (off: the sweep threshold set past N, i.e. the behaviour before), in the same process.
3. ``pagedkv serve`` in a subprocess: seconds to a one-line exit 2 for a port in use (before the model loads),
   seconds to /health 200 (model load), and seconds from SIGTERM to exit 0 with one stream in flight
   (``--drain-timeout 2``) and idle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def validation_cost() -> None:
    from hostile_inputs import HOSTILE
    from pagedkv.server.validation import APIError, Limits, parse_chat, parse_completion

    limits = Limits(max_model_len=8192, vocab_size=49152, max_prompt_chars=8192 * 48, max_n=32)
    comp = json.dumps({"model": "m", "prompt": "The capital of France is " * 20, "max_tokens": 64,
                       "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "stream": True,
                       "stream_options": {"include_usage": True}, "cache_salt": "tenant-42"}).encode()
    chat = json.dumps({"model": "m", "messages": [{"role": "system", "content": "You are helpful."},
                                                  {"role": "user", "content": "What is a paged KV cache? " * 20}],
                       "max_completion_tokens": 64, "temperature": 0}).encode()
    ids = json.dumps({"prompt": list(range(4000)), "max_tokens": 8}).encode()

    def per_call(fn, body, reps=2000) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            fn(body, limits)
        return (time.perf_counter() - t) / reps * 1e6

    rows = {"completion (text)": (parse_completion, comp), "chat (2 messages)": (parse_chat, chat),
            "completion (4000 token ids)": (parse_completion, ids)}
    print("1. validation cost per request (median of 7 rounds)")
    for name, (fn, body) in rows.items():
        us = statistics.median(per_call(fn, body, 200 if "ids" in name else 2000) for _ in range(7))
        print(f"   {name:30s} {len(body):7d} B  {us:8.1f} us")
    worst = []
    for name, route, body, _, _, _ in HOSTILE:
        fn = parse_chat if route == "chat" else parse_completion
        t = time.perf_counter()
        try:
            fn(body, limits)
        except APIError:
            pass
        worst.append((time.perf_counter() - t, name, len(body)))
    worst.sort(reverse=True)
    print("   hostile table, slowest refusals (the 413 rows are refused before parsing by the server):")
    for dt, name, n in worst[:3]:
        print(f"   {name:30s} {n:7d} B  {dt * 1e3:8.1f} ms")


def namespaces(tenants: int) -> None:
    import pagedkv.blocks.prefix_cache as pc
    from pagedkv import BlockManager

    def run(n: int, sweep: int) -> tuple[float, float, int]:
        saved = pc._SWEEP_MIN
        pc._SWEEP_MIN = sweep
        try:
            bm = BlockManager(64, 4, num_cpu_blocks=16, enable_prefix_caching=True, cpu_prefix_cache=True,
                              enable_kv_events=True)
            prompt = list(range(7, 16))
            t = time.perf_counter()
            for i in range(n):
                bm.allocate(i, prompt, namespace=f"tenant-{i}")
                bm.free(i)
                if i % 5000 == 0:
                    bm.events.take()
            dt = time.perf_counter() - t
            bm.events.take()
            c = bm._cache
            size = sum(sys.getsizeof(r) for r in (c.roots, c._ns_ids, c.ns_list))
            size += sum(sys.getsizeof(k) for k in c.roots) + sum(sys.getsizeof(k) for k in c._ns_ids)
            return dt / n * 1e6, size / 2**20, len(c.roots)
        finally:
            pc._SWEEP_MIN = saved

    on, off = pc._SWEEP_MIN, 10**12  # off: the threshold past N, i.e. the behaviour before the release
    print(f"2. {tenants} distinct cache_salt namespaces through a 64-block pool (+16 CPU blocks, KV events on)")
    for label, sweep in (("release on (this change)", on), ("release off (before)", off)):
        us, mib, roots = run(tenants, sweep)
        print(f"   {label:26s} namespaces kept {roots:7d}  registry {mib:6.2f} MiB")
    a, b = [], []
    for _ in range(5):  # speed: alternating A/B rounds of 10k tenants, median ratio
        a.append(run(10_000, on)[0])
        b.append(run(10_000, off)[0])
    ratio = statistics.median(x / y for x, y in zip(a, b))
    print(f"   allocate+free per tenant: {statistics.median(a):.1f} us with release, {statistics.median(b):.1f} us "
          f"without (median ratio {ratio:.2f}x over 5 alternating rounds)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve() -> None:
    import httpx

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve"]
    print("3. pagedkv serve start-up and shutdown")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    t = time.perf_counter()
    p = subprocess.run(cmd + ["--port", str(busy.getsockname()[1])], env=env, capture_output=True, text=True)
    print(f"   port in use: exit {p.returncode} after {time.perf_counter() - t:.1f} s: {p.stderr.strip()}")
    busy.close()
    for label, stream in (("one stream in flight", True), ("idle", False)):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        t = time.perf_counter()
        proc = subprocess.Popen(cmd + ["--port", str(port), "--num-gpu-blocks", "64", "--drain-timeout", "2"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        up = time.perf_counter() - t
        last = ""
        if stream:
            body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                it = r.iter_lines()
                next(ln for ln in it if ln)
                t = time.perf_counter()
                proc.send_signal(signal.SIGTERM)
                last = [ln for ln in it if ln][-2][:90]
        else:
            t = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        print(f"   {label:22s} up in {up:5.1f} s; SIGTERM -> exit {rc} in {time.perf_counter() - t:4.1f} s "
              f"{'(stream ended with ' + last + ')' if last else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=100_000)
    ap.add_argument("--skip-serve", action="store_true")
    args = ap.parse_args()
    validation_cost()
    namespaces(args.tenants)
    if not args.skip_serve:
        serve()


if __name__ == "__main__":
    main()
