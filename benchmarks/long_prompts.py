"""A long prompt arriving into decoding traffic, chunked prefill vs not, through real ``pagedkv serve`` servers.

Starts one server per mode (SmolLM2, 127.0.0.1, free ports, the same settings except the chunked-prefill flag
and its budget), then runs the ``pagedkv bench serve --long-prompt-len`` trial (``pagedkv.server.longprompt``:
``--streams`` streams decoding, then a ``--long-prompt-len``-token prompt arrives) against each server in turn,
alternating modes for ``--rounds`` rounds so that the machine's load hits every mode alike. Writes a JSON result
(every trial's figures and raw token times, the machine's load average before and after) and a PNG chart (the
decoding streams' inter-token latency over time, one panel per mode), and prints a table with each mode's
stall and long-prompt TTFT as ratios to the unchunked mode.

Modes are ``unchunked@BUDGET`` or ``chunked@BUDGET`` (``--max-num-batched-tokens``). A server without the
chunked-prefill flags (before chunked prefill was merged) runs the unchunked modes only.

    .venv/bin/python benchmarks/long_prompts.py                       # ~3-5 minutes on 2 busy cores
    .venv/bin/python benchmarks/long_prompts.py --modes unchunked@512 chunked@512 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pagedkv.server.longprompt import LongPromptConfig, aggregate, run_trial  # noqa: E402


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supports_chunked() -> bool:
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "serve", "--help"], capture_output=True, text=True,
                         env=_env(), timeout=60).stdout
    return "--enable-chunked-prefill" in out


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def parse_mode(mode: str) -> tuple[str, int]:
    kind, _, budget = mode.partition("@")
    if kind not in ("chunked", "unchunked") or not budget.isdigit() or int(budget) < 1:
        raise SystemExit(f"long_prompts.py: bad mode {mode!r} (chunked@BUDGET or unchunked@BUDGET)")
    return kind, int(budget)


def start_server(mode: str, args: argparse.Namespace, chunked_flags: bool, log_dir: Path) -> tuple:
    kind, budget = parse_mode(mode)
    port = free_port()
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-num-seqs", "16",
           "--max-num-batched-tokens", str(budget)]
    if chunked_flags:
        cmd.append("--enable-chunked-prefill" if kind == "chunked" else "--no-enable-chunked-prefill")
    log = open(log_dir / f"serve-{mode.replace('@', '-')}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    return proc, port, cmd, log


def wait_healthy(procs: list, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for proc, port, cmd, _ in procs:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {' '.join(cmd)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server on port {port} not healthy after {timeout} s")
            time.sleep(0.5)


def stop(procs: list) -> None:
    for proc, _, _, log in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _, _, log in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


async def run_all(args: argparse.Namespace, modes: list[str], ports: dict) -> dict:
    import httpx

    cfg = LongPromptConfig(num_streams=args.streams, stream_prompt_len=args.stream_prompt_len,
                           stream_output_len=args.stream_output_len, long_prompt_len=args.long_prompt_len,
                           long_output_len=8, after_tokens=16, tail_s=args.tail, timeout_s=args.trial_timeout)
    warm = LongPromptConfig(num_streams=args.streams, stream_prompt_len=args.stream_prompt_len,
                            stream_output_len=64, long_prompt_len=256, long_output_len=2, after_tokens=4, tail_s=0.0,
                            timeout_s=60.0)
    trials: dict = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.trial_timeout),
                                 limits=httpx.Limits(max_connections=args.streams + 4)) as http:
        models = {}
        for m in modes:
            r = await http.get(f"http://127.0.0.1:{ports[m]}/v1/models")
            models[m] = r.json()["data"][0]["id"]
        for m in modes:  # warm-up (first forwards of each shape), not recorded
            http.base_url = f"http://127.0.0.1:{ports[m]}"
            await run_trial(http, models[m], warm, seed=10_000)
        seed = args.seed
        for rnd in range(args.rounds):
            order = modes if rnd % 2 == 0 else modes[::-1]  # alternate the order too
            for m in order:
                http.base_url = f"http://127.0.0.1:{ports[m]}"
                load = loadavg()
                res = await run_trial(http, models[m], cfg, seed=seed)
                seed += 1  # fresh prompts every trial: no prefix-cache hit anywhere
                res["round"] = rnd
                res["loadavg_before"] = load
                trials[m].append(res)
                print(f"round {rnd + 1}/{args.rounds} {m:>16}: stall {res['stall_ms']:8.0f} ms | long TTFT "
                      f"{res['long_ttft_ms']:8.0f} ms | ITL p50 {res['itl_ms']['p50']:6.1f} p99 "
                      f"{res['itl_ms']['p99']:8.1f} ms | load {load[0] if load else float('nan'):.2f}"
                      + (f" | errors {res['errors']}" if res["errors"] else ""), flush=True)
    return {"config": cfg, "trials": trials}


def summarize(modes: list[str], trials: dict, cfg: LongPromptConfig) -> dict:
    """Per mode, :func:`pagedkv.server.longprompt.aggregate` over its trials (medians of the stall and the long
    TTFT, ITL/TPOT percentiles over the pooled gaps), with each trial's stall and TTFT listed."""
    out = {}
    for m in modes:
        agg = aggregate(trials[m], "", cfg)
        out[m] = {k: v for k, v in agg.items() if k not in ("model", "config", "trials")}
        out[m]["stall_ms"] = [t["stall_ms"] for t in trials[m]]
        out[m]["long_ttft_ms"] = [t["long_ttft_ms"] for t in trials[m]]
    return out


def ratios(modes: list[str], summary: dict, trials: dict) -> dict:
    """Per chunked mode, stall and TTFT over the unchunked mode of the same budget (else the first unchunked
    mode): the ratio of medians, and per round the ratio of the two trials run back to back."""
    base_modes = [m for m in modes if m.startswith("unchunked")]
    out = {}
    for m in modes:
        if not m.startswith("chunked") or not base_modes:
            continue
        same = f"unchunked@{m.split('@')[1]}"
        b = same if same in base_modes else base_modes[0]
        per_round = [t["stall_ms"] / u["stall_ms"] for t, u in zip(trials[m], trials[b]) if u["stall_ms"] > 0]
        out[m] = {"vs": b,
                  "stall_ratio": summary[m]["median_stall_ms"] / summary[b]["median_stall_ms"],
                  "stall_ratio_per_round": per_round,
                  "long_ttft_ratio": summary[m]["median_long_ttft_ms"] / summary[b]["median_long_ttft_ms"]}
    return out


def plot(modes: list[str], trials: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 2.4 * len(modes) + 0.6), sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], modes):
        ts = trials[m]
        # the trial with the median stall (the figure's story is the typical trial, not the luckiest)
        t = sorted(ts, key=lambda x: x["stall_ms"])[(len(ts) - 1) // 2]
        send = t["trace"]["long"]["send"]
        first = t["trace"]["long"]["times"][0] if t["trace"]["long"]["times"] else t["trace"]["long"]["end"]
        for i, s in enumerate(t["trace"]["streams"]):
            # each gap as a segment from the token before to the token after, at the gap's height: a stall reads
            # as a long high bar over the time it froze the stream
            a = [x - send for x in s["times"][:-1]]
            b = [x - send for x in s["times"][1:]]
            y = [max((hi - lo) * 1000, 1.0) for lo, hi in zip(a, b)]
            color = f"C{i}"
            ax.hlines(y, a, b, colors=color, lw=1.2)
            ax.plot(b, y, ".", ms=3, color=color, label=f"stream {i + 1}")
        ax.axvspan(0, first - send, color="tab:red", alpha=0.12, label="long prompt waiting for its 1st token")
        ax.set_yscale("log")
        ax.set_ylim(5, None)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{m}: largest stall {t['stall_ms'] / 1000:.2f} s, long-prompt TTFT "
                     f"{t['long_ttft_ms'] / 1000:.2f} s (median of {len(ts)} trials: stall "
                     f"{summary[m]['median_stall_ms'] / 1000:.2f} s)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds since the long prompt was sent (each segment: one gap between two tokens of a "
                           "stream, at its length)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["unchunked@512", "chunked@512", "chunked@1024"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--stream-prompt-len", type=int, default=128)
    p.add_argument("--stream-output-len", type=int, default=1200)
    p.add_argument("--long-prompt-len", type=int, default=3500)
    p.add_argument("--tail", type=float, default=2.0)
    p.add_argument("--trial-timeout", type=float, default=120.0)
    p.add_argument("--num-gpu-blocks", type=int, default=512, help="per server (16 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_prompts.json"))
    p.add_argument("--plot", default=str(ROOT / "benchmarks" / "results" / "long_prompts.png"))
    args = p.parse_args()
    chunked_flags = supports_chunked()
    modes = args.modes if chunked_flags else [m for m in args.modes if m.startswith("unchunked")]
    if not modes:
        print("long_prompts.py: this pagedkv has no --enable-chunked-prefill; give an unchunked mode", file=sys.stderr)
        return 2
    if modes != args.modes:
        print(f"long_prompts.py: no chunked prefill in this pagedkv; running {modes} only", file=sys.stderr)
    for m in modes:
        parse_mode(m)
    import tempfile

    log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-long-prompts-"))  # the servers' logs (kept, path printed)
    t_start = time.time()
    load_start = loadavg()
    procs = []
    try:
        for m in modes:
            procs.append(start_server(m, args, chunked_flags, log_dir))
        wait_healthy(procs, timeout=180)
        ports = {m: port for m, (_, port, _, _) in zip(modes, procs)}
        res = asyncio.run(run_all(args, modes, ports))
    except BaseException:
        print(f"long_prompts.py: failed; the servers' logs are in {log_dir}", file=sys.stderr)
        raise
    finally:
        stop(procs)
    summary = summarize(modes, res["trials"], res["config"])
    rat = ratios(modes, summary, res["trials"])
    import subprocess as sp

    commit = sp.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                    text=True).stdout.strip()
    result = {
        "what": "largest stall of decoding streams while a long prompt is prefilled, chunked prefill vs not",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": loadavg()},
        "duration_s": time.time() - t_start,
        "server_commands": {m: cmd[2:] for m, (_, _, cmd, _) in zip(modes, procs)},
        "modes": modes, "rounds": args.rounds, "config": asdict(res["config"]),
        "summary": summary, "ratios": rat, "trials": res["trials"],
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    plot(modes, res["trials"], summary, Path(args.plot))
    print()
    print(f"{'mode':>16} | {'stall (ms, median)':>18} | {'long TTFT (ms)':>14} | {'ITL p50/p90/p99/max (ms)':>28} | "
          f"{'TPOT p50 (ms)':>13} | stall x | TTFT x")
    for m in modes:
        s = summary[m]
        r = rat.get(m)
        i = s["itl_ms"]
        print(f"{m:>16} | {s['median_stall_ms']:18.0f} | {s['median_long_ttft_ms']:14.0f} | "
              f"{i['p50']:6.1f} /{i['p90']:6.1f} /{i['p99']:7.0f} /{i['max']:7.0f} | {s['tpot_ms']['p50']:13.1f} | "
              + (f"{r['stall_ratio']:7.3f} | {r['long_ttft_ratio']:6.2f}" if r else "  1.000 |   1.00"))
    print(f"\nload average: {load_start} at the start, {result['machine']['loadavg_end']} at the end "
          f"({os.cpu_count()} CPUs); {result['duration_s']:.0f} s; wrote {args.out} and {args.plot}")
    return 0 if not any(s["errors"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
