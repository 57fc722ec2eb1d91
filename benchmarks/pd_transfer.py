"""A prefill/decode split's KV transfer against a recompute, on two ``pagedkv serve`` processes (docs/pd-split.md).

Starts a prefill replica (``--kv-role prefill``) and a decode replica (``--kv-role decode``) on 127.0.0.1, then
for each repeat and prompt length, with a fresh ``cache_salt`` each time (no prefix hit anywhere):

- recompute: the decode replica gets the plain request (it computes the whole prompt): TTFT of its stream;
- split: the prefill replica computes the prompt (max_tokens 1, its wall time reported), then the decode replica
  gets the request with the returned kv_transfer_params: TTFT of its stream (the blocks' read included).

With ``--shared URL`` (a ``redis://`` or ``file:///`` store given to both replicas as ``--kv-shared``; ``redis``:
a throwaway redis-server on a free port, no persistence) a third way is measured:

- store: the prefill replica answers once its prompt's blocks are written through to the shared store
  (``remote_kv_store``; its wall time reported: the compute and the wait), and the decode replica loads them
  through its own tiers (no HTTP read): TTFT of its stream.

and the split over HTTP drops ``remote_kv_store`` from the params it forwards (a decode replica without the store);
both prefill answers then include the wait for the store.

Prints per length the medians and the ratio split-TTFT / recompute-TTFT, and checks that every way gives the same
greedy text. The two measure the decode replica's time to first token only: the prefill replica's compute is
reported beside it, not added (in a split it runs on other cores). Bounded: every request has a timeout and
the servers are killed at the end.

    PYTHONPATH=src .venv/bin/python benchmarks/pd_transfer.py --lengths 512 2048 --repeats 3
    PYTHONPATH=src .venv/bin/python benchmarks/pd_transfer.py --lengths 1024 2048 --repeats 1 \
        --serve-args "--model gemma-3-270m --num-gpu-blocks 2048"     (Gemma 3: KV cache groups)
    PYTHONPATH=src .venv/bin/python benchmarks/pd_transfer.py --lengths 512 2048 --repeats 2 --shared redis

Each length's line also says what the prefill replica serves for the hold (its response headers: values and
bytes; with KV cache groups one value per group block, a sliding group's only inside its window).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(role: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--kv-role", role,
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {role} replica exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the {role} replica did not start")


def ttft(url: str, body: dict) -> tuple[float, str]:
    import httpx

    t = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as s:
        s.raise_for_status()
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if first is None:
                    first = time.perf_counter() - t
                text.append(chunk["choices"][0]["text"])
    return first, "".join(text)


def start_redis() -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on a free port of 127.0.0.1 (no persistence): (process, URL)."""
    import shutil
    import tempfile

    import redis

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.1)


def prefill(p_url: str, body: dict) -> tuple[dict, float]:
    import httpx

    from pagedkv.server.kv_transfer import prefill_body

    t = time.perf_counter()
    ans = httpx.post(p_url + "/v1/completions", json=prefill_body(body), timeout=600).json()
    return ans["kv_transfer_params"], time.perf_counter() - t


def main() -> None:
    import httpx

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--serve-args", default="--num-gpu-blocks 1024", help="extra pagedkv serve options (both)")
    p.add_argument("--shared", default=None, metavar="URL",
                   help="measure the handover through this shared store too (--kv-shared of both replicas; "
                        "'redis': a throwaway redis-server)")
    a = p.parse_args()
    extra = a.serve_args.split()
    procs = []
    try:
        if a.shared == "redis":
            rp, a.shared = start_redis()
            procs.append(rp)
        if a.shared:
            extra += ["--kv-shared", a.shared]
        (pp, p_url), (dp, d_url) = start("prefill", extra), start("decode", extra)
        procs += [pp, dp]
        for n in a.lengths:
            rec, spl, pre, sto, pre_sto = [], [], [], [], []
            for r in range(a.repeats + 1):  # the first round warms up
                ids = [1] + [(7 * i + 13 * r + n) % 20000 + 100 for i in range(n - 1)]
                base = {"prompt": ids, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
                t_rec, text_rec = ttft(d_url, {**base, "cache_salt": f"rec-{n}-{r}"})
                salt = f"split-{n}-{r}"
                kvp, t_pre = prefill(p_url, {**base, "cache_salt": salt})
                kvp.pop("remote_kv_store", None)  # (over HTTP)
                with httpx.stream("GET", f"{p_url}/v1/kv/holds/{kvp['remote_request_id']}",
                                  params={"engine": kvp["remote_engine_id"]}, timeout=60) as h:
                    sent = (int(h.headers["x-pagedkv-kv-blocks"]), int(h.headers["x-pagedkv-kv-bytes"]))
                t_spl, text_spl = ttft(d_url, {**base, "cache_salt": salt, "kv_transfer_params": kvp})
                if text_rec != text_spl:
                    raise SystemExit(f"texts differ at {n} tokens: {text_rec!r} vs {text_spl!r}")
                if a.shared:
                    salt = f"store-{n}-{r}"
                    kvs, t_pre_sto = prefill(p_url, {**base, "cache_salt": salt})
                    if "remote_kv_store" not in kvs:
                        raise SystemExit(f"the prefill answer at {n} tokens names no shared store (its "
                                         "write-through did not finish within --kv-store-wait)")
                    t_sto, text_sto = ttft(d_url, {**base, "cache_salt": salt, "kv_transfer_params": kvs})
                    if text_sto != text_rec:
                        raise SystemExit(f"texts differ at {n} tokens (store): {text_rec!r} vs {text_sto!r}")
                if r:
                    rec.append(t_rec)
                    spl.append(t_spl)
                    pre.append(t_pre)
                    if a.shared:
                        sto.append(t_sto)
                        pre_sto.append(t_pre_sto)
            mr, ms, mp = statistics.median(rec), statistics.median(spl), statistics.median(pre)
            line = (f"prompt {n:6d} tokens ({kvp['remote_num_tokens']} handed over in {sent[0]} values, "
                    f"{sent[1] / 1e6:.1f} MB): decode TTFT recompute "
                    f"{mr * 1000:8.1f} ms, after the transfer {ms * 1000:8.1f} ms, ratio {ms / mr:5.2f}x; ")
            if a.shared:
                mt, mpt = statistics.median(sto), statistics.median(pre_sto)
                line += (f"through the store {mt * 1000:8.1f} ms, ratio {mt / mr:5.2f}x ({mt / ms:5.2f}x HTTP); "
                         f"prefill replica's answers (compute and store wait, both ways) {mp * 1000:8.1f} / "
                         f"{mpt * 1000:8.1f} ms; texts equal")
                print(line, flush=True)
            else:
                print(line + f"prefill replica's compute {mp * 1000:8.1f} ms; texts equal", flush=True)
        if a.shared:
            stats = httpx.get(p_url + "/metrics", timeout=30).text
            got = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in stats.splitlines()
                   if ln.startswith("pagedkv:kv_handoff_store_")}
            n_ans = got.get("pagedkv:kv_handoff_store_answers_total", 0.0)
            wait = got.get("pagedkv:kv_handoff_store_wait_seconds_total", 0.0)
            print(f"prefill replica: {n_ans:.0f} answers through the store, "
                  f"{got.get('pagedkv:kv_handoff_store_waits_timed_out_total', 0.0):.0f} timed out; their wait for "
                  f"the write-through {1000 * wait / max(n_ans, 1):.1f} ms on average (every round, warm-up "
                  "included)", flush=True)
            stats = httpx.get(d_url + "/metrics", timeout=30).text
            got = [ln for ln in stats.splitlines() if ln.startswith(("pagedkv:kv_handoff_store_",
                                                                       "pagedkv:kv_handoff_fetches_total"))]
            print("decode replica:", "; ".join(got), flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    main()
