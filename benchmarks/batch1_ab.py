"""Batch-1 greedy decode against another tree of the project (issue 36): fresh processes, alternating.

    git archive main | tar -x -C /tmp/base   # the baseline tree (its C kernels build under their own cache key)
    PYTHONPATH=src .venv/bin/python benchmarks/batch1_ab.py --base /tmp/base [--model smollm2|gemma-3-270m]
        [--threads 1|default] [--pairs 3] [--tokens 64]

Each pair runs the baseline and this tree in fresh processes (order alternating: base/new, new/base, ...), each
with ``PYTHONPATH`` on its own ``src``. A process loads the model, warms up (one 8-token request), then times one
greedy request of ``--tokens`` new tokens (``ignore_eos``, batch 1) and prints a JSON line: wall and process CPU
time of that ``LLM.generate`` call. Prints the per-pair ratios new / base and their medians, wall and CPU (on a
shared machine read the CPU figures: a busy neighbour costs wall time, not CPU time, at one thread).
``--side`` runs one worker (what the driver starts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of the city of Paris begins"


def worker(a: argparse.Namespace) -> None:
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(None if a.model == "smollm2" else a.model, num_gpu_blocks=64, max_num_seqs=4)
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    w, c = time.perf_counter(), time.process_time()
    out = llm.generate(PROMPT, params, use_tqdm=False)
    w, c = time.perf_counter() - w, time.process_time() - c
    print(json.dumps({"wall_s": w, "cpu_s": c, "threads": llm.threads, "tokens": list(out[0].outputs[0].token_ids)}))


def run_side(a: argparse.Namespace, src: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    if a.threads == "default":
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = a.threads
    cmd = [sys.executable, __file__, "--side", "--model", a.model, "--tokens", str(a.tokens)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="the baseline tree (holding src/pagedkv)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", default="1", help="1 (OMP_NUM_THREADS=1) or default (the engine's own policy)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the runs and ratios here")
    ap.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        return worker(a)
    if a.base is None:
        ap.error("--base is required")
    trees = {"base": a.base.resolve() / "src", "new": ROOT / "src"}
    pairs = []
    for i in range(a.pairs):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        pair = {side: run_side(a, trees[side]) for side in order}
        pair["wall"] = pair["new"]["wall_s"] / pair["base"]["wall_s"]
        pair["cpu"] = pair["new"]["cpu_s"] / pair["base"]["cpu_s"]
        pair["same_tokens"] = pair["new"]["tokens"] == pair["base"]["tokens"]
        pairs.append(pair)
        print(f"pair {i} ({'/'.join(order)}): new/base wall {pair['wall']:.3f} cpu {pair['cpu']:.3f}; "
              f"new {a.tokens / pair['new']['wall_s']:.1f} tok/s wall, base {a.tokens / pair['base']['wall_s']:.1f}; "
              f"same tokens {pair['same_tokens']}", flush=True)
    med = {k: statistics.median(p[k] for p in pairs) for k in ("wall", "cpu")}
    print(f"{a.model}, threads {a.threads}, {a.pairs} pairs x {a.tokens} tokens: median new/base wall "
          f"{med['wall']:.3f}, cpu {med['cpu']:.3f}; load {os.getloadavg()[0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "threads": a.threads, "tokens": a.tokens, "pairs": pairs,
                                      "median": med, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
