"""Prefill/decode split against colocated replicas, side by side (issue 25 item 4; docs/pd-split.md).

Two ways to serve the same long-prompt mix with two SmolLM2 replicas behind ``pagedkv router``, on the same cores:

- **colocated**: two ``pagedkv serve`` replicas (``--kv-role both``), ``pagedkv router --backend A --backend B``:
  each replica prefills and decodes its own requests;
- **split**: ``pagedkv serve --kv-role prefill`` (A) and ``--kv-role decode`` (B), ``pagedkv router --prefill A
  --decode B``: every prompt is computed on A, its KV blocks read by B, which decodes.

Replica A of each pair is pinned to core 0, replica B to core 1 (``taskset``), each with ``--threads 1``; the
routers and the load generator are not pinned (the same for both). All four replicas and both routers run at
once, and the trials alternate between the two setups (colocated, split, colocated, ...), each trial one run of
``pagedkv bench serve --long-prompt-len L`` against the setup's router (a fresh seed per trial, the same seed
for both setups: the same prompts): ``--num-streams`` streams decode, then a prompt of L tokens arrives.

Reported per setup, over its trials: the decode streams' inter-token latency p50/p99 (every gap of every
stream, pooled) and their largest stall while the long prompt is served (median and worst trial), TTFT p50/p90
over every request (streams and the long prompt) and the long prompt's own TTFT (median), and the streams'
output tokens/s (their tokens over the trial's wall time, median). Written to ``--out`` (.md, .json, .png).

Bounded: every replica and router is killed at the end; each trial has ``--trial-timeout``; start-up waits
at most 300 s. Run it through the quiet-machine lock::

    bash /work/notes/bench.sh env PYTHONPATH=$PWD/src .venv/bin/python benchmarks/pd_side_by_side.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUPS = ("colocated", "split")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pinned(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def wait_healthy(url: str, proc: subprocess.Popen, what: str, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not become healthy in time")


class Cluster:
    """The processes of both setups; :meth:`close` kills them all."""

    def __init__(self, serve_args: list[str], threads: int, cores: tuple, logdir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir
        self.serve_args = serve_args
        self.threads = threads
        self.cores = cores
        self.urls: dict[str, str] = {}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def serve(self, name: str, role: str, core: int | None) -> tuple[str, subprocess.Popen]:
        port = free_port()
        argv = [*pinned(core), sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--kv-role", role,
                "--threads", str(self.threads), *self.serve_args]
        return f"http://127.0.0.1:{port}", self._spawn(name, argv)

    def router(self, name: str, flags: list[str]) -> tuple[str, subprocess.Popen]:
        port = free_port()
        argv = [sys.executable, "-m", "pagedkv.cli", "router", "--port", str(port), *flags]
        return f"http://127.0.0.1:{port}", self._spawn(name, argv)

    def start(self) -> None:
        c0, c1 = self.cores
        reps = {"colo-A": self.serve("colo-A", "both", c0), "colo-B": self.serve("colo-B", "both", c1),
                "split-P": self.serve("split-P", "prefill", c0), "split-D": self.serve("split-D", "decode", c1)}
        deadline = time.monotonic() + 300
        for name, (url, p) in reps.items():
            wait_healthy(url, p, name, deadline)
        routers = {
            "colocated": self.router("router-colocated", ["--backend", reps["colo-A"][0], "--backend",
                                                          reps["colo-B"][0]]),
            "split": self.router("router-split", ["--prefill", reps["split-P"][0], "--decode", reps["split-D"][0]]),
        }
        for name, (url, p) in routers.items():
            wait_healthy(url, p, f"the {name} router", deadline)
        self.urls = {name: url for name, (url, _) in routers.items()}

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def warm_up(url: str) -> None:
    """One short streamed request, so that the first trial does not pay the first step's costs."""
    import httpx

    body = {"prompt": list(range(1000, 1100)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


def run_trial(url: str, a: argparse.Namespace, seed: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "pagedkv.cli", "bench", "serve", "--base-url", url, "--long-prompt-len",
            str(a.long_prompt_len), "--num-streams", str(a.num_streams), "--input-len", str(a.input_len),
            "--long-output-len", str(a.long_output_len), "--long-after-tokens", str(a.after_tokens),
            "--tail", str(a.tail), "--trials", "1", "--trial-timeout", str(a.trial_timeout), "--seed", str(seed),
            "--result-json", str(out), "--no-progress"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=a.trial_timeout + 60)
    if not out.exists():
        raise RuntimeError(f"pagedkv bench serve failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(out.read_text())["trials"][0]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def trial_figures(t: dict) -> dict:
    """Per-trial figures from the trace (seconds since the trial's first send)."""
    tr = t["trace"]
    streams, long = tr["streams"], tr["long"]
    gaps = [b - a for s in streams for a, b in zip(s["times"][:-1], s["times"][1:])]
    ttfts = [s["times"][0] - s["send"] for s in streams if s["times"]]
    if long["times"]:
        ttfts.append(long["times"][0] - long["send"])
    tokens = sum(len(s["times"]) for s in streams)
    end = max([s["end"] for s in streams] + [long["end"] or 0.0])
    start = min(s["send"] for s in streams)
    return {"gaps_s": gaps, "ttfts_s": ttfts, "stall_ms": t["stall_ms"], "long_ttft_ms": t["long_ttft_ms"],
            "stream_tokens": tokens, "wall_s": end - start, "tokens_per_s": tokens / (end - start),
            "errors": t["errors"]}


def summarize(trials: list[dict]) -> dict:
    figs = [trial_figures(t) for t in trials]
    gaps = [g for f in figs for g in f["gaps_s"]]
    ttfts = [x for f in figs for x in f["ttfts_s"]]
    return {
        "trials": len(figs),
        "itl_p50_ms": pct(gaps, 50) * 1000, "itl_p99_ms": pct(gaps, 99) * 1000,
        "stall_median_ms": statistics.median(f["stall_ms"] for f in figs),
        "stall_max_ms": max(f["stall_ms"] for f in figs),
        "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p90_ms": pct(ttfts, 90) * 1000,
        "long_ttft_median_ms": statistics.median(f["long_ttft_ms"] for f in figs),
        "tokens_per_s_median": statistics.median(f["tokens_per_s"] for f in figs),
        "per_trial": [{k: v for k, v in f.items() if k not in ("gaps_s", "ttfts_s")} for f in figs],
        "errors": [e for f in figs for e in f["errors"]],
    }


ROWS = (("decode ITL p50 (ms)", "itl_p50_ms"), ("decode ITL p99 (ms)", "itl_p99_ms"),
        ("largest stall, median of trials (ms)", "stall_median_ms"), ("largest stall, worst trial (ms)",
                                                                      "stall_max_ms"),
        ("TTFT p50, every request (ms)", "ttft_p50_ms"), ("TTFT p90, every request (ms)", "ttft_p90_ms"),
        ("long prompt's TTFT, median (ms)", "long_ttft_median_ms"),
        ("streams' output tokens/s, median", "tokens_per_s_median"))


def table(res: dict) -> str:
    lines = ["| figure | colocated | split | split / colocated |", "|---|---|---|---|"]
    for label, key in ROWS:
        c, s = res["colocated"][key], res["split"][key]
        lines.append(f"| {label} | {c:,.1f} | {s:,.1f} | {s / c:.2f}x |")
    return "\n".join(lines)


def chart(res: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = (("decode ITL p99", "itl_p99_ms"), ("largest stall\n(median)", "stall_median_ms"),
              ("TTFT p50", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"), ("long prompt\nTTFT", "long_ttft_median_ms"))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [5, 1.3]})
    x = range(len(groups))
    w = 0.38
    for i, setup in enumerate(SETUPS):
        vals = [res[setup][k] / 1000 for _, k in groups]
        bars = ax.bar([p + (i - 0.5) * w for p in x], vals, w, label=setup)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(x), [g for g, _ in groups], fontsize=8)
    ax.set_ylabel("seconds (lower is better)")
    ax.legend()
    tps = [res[s]["tokens_per_s_median"] for s in SETUPS]
    bars = ax2.bar(SETUPS, tps, color=["C0", "C1"])
    ax2.bar_label(bars, fmt="%.1f", fontsize=7)
    ax2.set_ylabel("streams' output tokens/s (higher is better)")
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--num-streams", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64, help="each stream's prompt tokens")
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--after-tokens", type=int, default=16)
    p.add_argument("--tail", type=float, default=2.0)
    p.add_argument("--trials", type=int, default=3, help="trials per setup (alternating)")
    p.add_argument("--trial-timeout", type=float, default=240.0)
    p.add_argument("--threads", type=int, default=1, help="--threads of each replica")
    p.add_argument("--cores", type=int, nargs=2, default=(0, 1), metavar=("A", "B"),
                   help="cores replica A (colocated A, prefill) and B (colocated B, decode) are pinned to")
    p.add_argument("--no-pin", action="store_true", help="do not pin the replicas (same --threads only)")
    p.add_argument("--serve-args", default="--num-gpu-blocks 1024", help="extra pagedkv serve options (all four)")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--name", default="pd_side_by_side",
                   help="files written: benchmarks/results/NAME.md, .json and .png")
    p.add_argument("--out", default=None, help="path stem of the .md, .json and .png written (instead of --name)")
    p.add_argument("--no-chart", action="store_true")
    a = p.parse_args(argv)
    cores = (None, None) if a.no_pin else tuple(a.cores)
    out = Path(a.out) if a.out else HERE / "results" / a.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pd-side-") as tmp:
        tmp = Path(tmp)
        cl = Cluster(a.serve_args.split(), a.threads, cores, tmp)
        raw: dict[str, list] = {s: [] for s in SETUPS}
        try:
            t0 = time.monotonic()
            cl.start()
            print(f"4 replicas and 2 routers up in {time.monotonic() - t0:.0f} s", flush=True)
            for s in SETUPS:
                warm_up(cl.urls[s])
            for k in range(a.trials):
                order = SETUPS if k % 2 == 0 else SETUPS[::-1]
                for s in order:
                    t = run_trial(cl.urls[s], a, a.seed + k, tmp / f"{s}-{k}.json")
                    raw[s].append(t)
                    f = trial_figures(t)
                    print(f"trial {k + 1}/{a.trials} {s:9s}: stall {f['stall_ms']:8.0f} ms, long TTFT "
                          f"{f['long_ttft_ms']:8.0f} ms, tokens/s {f['tokens_per_s']:6.1f}"
                          + (f", errors {f['errors']}" if f["errors"] else ""), flush=True)
        except BaseException:
            for f in sorted(tmp.glob("*.log")):
                print(f"--- {f.name} (tail)\n{f.read_text(errors='replace')[-1500:]}", file=sys.stderr)
            raise
        finally:
            cl.close()
    res = {s: summarize(raw[s]) for s in SETUPS}
    cfg = {k: v for k, v in vars(a).items()}
    cfg["pinning"] = ("none (same --threads only)" if a.no_pin else
                      f"replica A (colocated A, prefill) on core {a.cores[0]}, replica B (colocated B, decode) on "
                      f"core {a.cores[1]}; routers and load generator unpinned")
    cmd = "PYTHONPATH=src .venv/bin/python benchmarks/pd_side_by_side.py " + " ".join(argv or sys.argv[1:])
    title = (f"SmolLM2-135M, 2 replicas, {a.num_streams} streams + one {a.long_prompt_len}-token prompt, "
             f"{a.trials} trials per setup; {cfg['pinning']}, --threads {a.threads}")
    md = "\n".join([f"# Prefill/decode split against colocated replicas", "", f"`{cmd.strip()}`", "", title, "",
                    table(res), ""])
    print(md)
    errors = res["colocated"]["errors"] + res["split"]["errors"]
    for e in errors:
        print(f"error: {e}")
    Path(str(out) + ".md").write_text(md)
    Path(str(out) + ".json").write_text(json.dumps({"config": cfg, "command": cmd.strip(), "results": res,
                                                    "raw": raw}, indent=1, default=str))
    if not a.no_chart:
        chart(res, Path(str(out) + ".png"), title)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
