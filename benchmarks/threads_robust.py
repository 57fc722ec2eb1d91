"""The engine at its defaults against one thread: alone, beside a busy process, as two engines (issue 26, item 1).

    PYTHONPATH=src .venv/bin/python benchmarks/threads_robust.py [--models smollm2,gemma-3-270m] [--batches 1,8,32]
        [--rounds 1] [--quick]

For each model and batch size, `pagedkv bench throughput`'s work (random prompts of 32 tokens, ``--out`` tokens
generated each, sampling, end-of-sequence ignored; output tokens/s of the generate call, model load and warm-up
excluded) in fresh engine processes, two configurations taking turns measurement by measurement:

* ``defaults``: no flag, no thread variable (the environment's ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``,
  ``GOMP_SPINCOUNT`` and ``PAGEDKV_*`` removed), as a user starts it;
* ``1 thread``: ``OMP_NUM_THREADS=1``;
* and any ``--extra VAR=VALUE[,VAR=VALUE]`` configuration (candidates of the policy, e.g. ``GOMP_SPINCOUNT=10000``
  or ``GOMP_SPINCOUNT=300000`` for libgomp's own spin), reported against ``1 thread`` beside the defaults.

in three situations: (a) ``alone``; (b) ``busy``: beside one busy process (a Python ``while True`` loop at this
script's niceness, started before the engine and stopped after it); (c) ``two``: two engines of the same
configuration started together (each loads its model, then both start generating at once; figure: the sum of
both). Prints the ratios defaults / 1 thread and the issue's "Done when" checks with pass/fail (alone >= 1.0x,
busy and two >= 0.9x), and writes ``--out-dir``/threads_robust[_TAG].json and .md.

Runs niced like its caller; on a machine where other jobs run the "alone" situation is not alone (the report
records the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITUATIONS = ("alone", "busy", "two")
CONFIGS = ("defaults", "1 thread")
THRESHOLD = {"alone": 1.0, "busy": 0.9, "two": 0.9}
_CLEAN = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "PAGEDKV_QKERNELS")


# ------------------------------------------------------------------------------------------------- the worker

def worker(model: str, batch: int, out: int, inp: int) -> int:
    """Load the engine, say ready, wait for a line on stdin, run the work, print the figures as one JSON line."""
    from pagedkv.engine.llm import LLM  # (imports pagedkv.engine first: its runtime settings precede torch)
    from pagedkv.engine.throughput import run_throughput

    llm = LLM(model)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    r = run_throughput(llm, input_len=inp, output_len=out, num_prompts=batch, use_tqdm=False)
    from pagedkv.engine.cpu import openmp_runtimes

    print(json.dumps({"output_tokens_per_s": r["output_tokens_per_s"], "elapsed_s": r["elapsed_s"],
                      "threads": r["torch_threads"], "source": r["threads_source"], "checks": r["thread_checks"],
                      "omp_runtimes": openmp_runtimes()}), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------- the driver

def _env(config: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    if config == "1 thread":
        env["OMP_NUM_THREADS"] = "1"
    elif config != "defaults":  # an --extra configuration: VAR=VALUE,VAR=VALUE
        env.update(kv.split("=", 1) for kv in config.split(","))
    return env


def _start(config: str, model: str, batch: int, out: int, inp: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", "--model", model, "--batch", str(batch),
                             "--out", str(out), "--in", str(inp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env(config), cwd=ROOT)


def _read(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"worker exited with code {p.wait()}")
    return json.loads(line)


def measure(situation: str, config: str, model: str, batch: int, out: int, inp: int, timeout: float) -> dict:
    """One measurement: the engines of ``situation`` in ``config``; output tokens/s (summed over two engines)."""
    busy = None
    if situation == "busy":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    procs = [_start(config, model, batch, out, inp) for _ in range(2 if situation == "two" else 1)]
    try:
        for p in procs:
            _read(p)  # ready
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.time() + timeout
        results = []
        for p in procs:
            results.append(_read(p))
            p.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if busy is not None:
            busy.kill()
            busy.wait()
    return {"tokens_per_s": sum(r["output_tokens_per_s"] for r in results), "engines": results}


def run(a: argparse.Namespace, save=None) -> dict:
    batches = [int(b) for b in a.batches.split(",")]
    res: dict = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                             "cpus": os.cpu_count(), "nice": os.nice(0), "loadavg_before": os.getloadavg()},
                 "command": " ".join([Path(sys.executable).name, *sys.argv]), "models": {}}
    t0 = time.time()
    for model in a.models.split(","):
        rows = res["models"].setdefault(model, {})
        for situation in SITUATIONS:
            for batch in batches:
                out = a.out_tokens[batch] if batch in a.out_tokens else 32
                key = f"{situation}/{batch}"
                configs = (*CONFIGS, *a.extra)
                rows[key] = {c: [] for c in configs} | {"out_tokens": out, "in_tokens": a.in_tokens}
                for r in range(a.rounds):
                    order = configs if r % 2 == 0 else configs[::-1]
                    for config in order:
                        m = measure(situation, config, model, batch, out, a.in_tokens, a.timeout)
                        rows[key][config].append(m)
                        print(f"{model:14s} {situation:5s} batch {batch:2d} {config:8s} {m['tokens_per_s']:7.1f} "
                              f"tok/s  threads {[e['threads'] for e in m['engines']]}", flush=True)
        if save is not None:  # after every model: a run cut short keeps what it measured
            res["machine"]["loadavg_after"] = os.getloadavg()
            res["seconds"] = time.time() - t0
            save(res)
    res["machine"]["loadavg_after"] = os.getloadavg()
    res["seconds"] = time.time() - t0
    return res


def table(res: dict) -> str:
    lines = ["| model | situation | batch | defaults tok/s | 1 thread tok/s | ratio | needs | pass |",
             "|---|---|---|---|---|---|---|---|"]
    ok_all = True
    for model, rows in res["models"].items():
        for key, row in rows.items():
            situation, batch = key.split("/")
            d = statistics.median(m["tokens_per_s"] for m in row["defaults"])
            o = statistics.median(m["tokens_per_s"] for m in row["1 thread"])
            ratio = d / o if o else float("nan")
            ok = ratio >= THRESHOLD[situation]
            ok_all &= ok
            threads = sorted({e["threads"] for m in row["defaults"] for e in m["engines"]})
            lines.append(f"| {model} | {situation} | {batch} | {d:.1f} (threads {threads}) | {o:.1f} | "
                         f"{ratio:.2f}x | >= {THRESHOLD[situation]}x | {'pass' if ok else 'FAIL'} |")
            for c in row:
                if c not in CONFIGS and isinstance(row[c], list) and row[c]:
                    x = statistics.median(m["tokens_per_s"] for m in row[c])
                    lines.append(f"| {model} | {situation} | {batch} | {c}: {x:.1f} | {o:.1f} | "
                                 f"{x / o if o else float('nan'):.2f}x | (candidate) | |")
    lines.append("")
    lines.append(f"All criteria: {'pass' if ok_all else 'FAIL'}. Load average before / after: "
                 f"{res['machine']['loadavg_before']} / {res['machine']['loadavg_after']}; "
                 f"{res['seconds']:.0f} s. Command: `{res['command']}`")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=1, help="measurements per configuration (alternating order)")
    p.add_argument("--in", dest="in_tokens", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test of the script)")
    p.add_argument("--extra", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="another configuration to measure (environment of the engine processes); repeatable")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one measurement may take")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", type=int, default=32, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.model, a.batch, a.out, a.in_tokens)
    # output tokens per request by batch size: about 2-8 s of generation each at one thread
    a.out_tokens = {1: 8, 8: 4, 32: 2} if a.quick else {1: 96, 8: 48, 32: 24}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "threads_robust" + (f"_{a.tag}" if a.tag else "")

    def save(res: dict) -> None:
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text("# benchmarks/threads_robust.py\n\n" + table(res) + "\n")

    res = run(a, save)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
