"""Attention alone, old path against new, in one process (issue 36): one step's ``plan_paged_attention`` plus
``paged_attention`` over 30 layers with SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, blocks of 16,
float32) for batches of mixed and of equal contexts, decode steps and a mixed step with a prefill chunk, in each
mode of :data:`pagedkv.engine.paged_attention.ATTENTION_MODES` ("padded" is the former path). The modes take
turns within each repeat; prints the median wall ms per step, its spread (min-max) and each mode's ratio to
"padded" in wall and in CPU time (the process's, steadier on a shared machine); ``--json`` writes them.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/ragged_attention_ab.py --repeats 15
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pagedkv.engine.model import build_attention_metadata
from pagedkv.engine.paged_attention import ATTENTION_MODES, AttentionWorkspace, paged_attention, plan_paged_attention

BS, N_KV, N_HEAD, D, LAYERS = 16, 3, 9, 64, 30

#: name -> (query lengths, contexts after the step)
CASES = {
    "b1 ctx 3000": ([1], [3000]),
    "b1 ctx 100": ([1], [100]),
    "b8 mixed (3000 + 7 x 100)": ([1] * 8, [3000] + [100] * 7),
    "b32 mixed (3000 + 31 x 100)": ([1] * 32, [3000] + [100] * 31),
    "b32 spread (100..3000)": ([1] * 32, [100 + i * 2900 // 31 for i in range(32)]),
    "b8 equal (8 x 500)": ([1] * 8, [500] * 8),
    "b32 equal (32 x 500)": ([1] * 32, [500] * 32),
    "chunk 256 at 2048 + 4 decodes at 100": ([256] + [1] * 4, [2048] + [100] * 4),
    "2 chunks of 64 (at 1000 and 200)": ([64, 64], [1000, 200]),
}


def prepare(q_lens: list[int], contexts: list[int], kv: torch.Tensor, mode: str):
    """A callable running one step's attention (plan + LAYERS layers) in ``mode``; returns seconds (wall, CPU)."""
    tables, slots, nxt = [], [], 0
    for q, c in zip(q_lens, contexts):
        nb = -(-c // BS)
        table = list(range(nxt, nxt + nb))
        nxt += nb
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(c - q, c)]
    meta = build_attention_metadata([[1] * q for q in q_lens], [c - q for q, c in zip(q_lens, contexts)], slots,
                                    tables, block_size=BS)
    ws = AttentionWorkspace()
    g = torch.Generator().manual_seed(0)
    t = sum(q_lens)
    qkv = torch.randn(t, N_HEAD + 2 * N_KV, D, generator=g)
    q, k, v = qkv[:, :N_HEAD], qkv[:, N_HEAD:N_HEAD + N_KV], qkv[:, N_HEAD + N_KV:]

    def run() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_paged_attention(meta, BS, mode=mode)
        for _ in range(LAYERS):
            paged_attention(q, k, v, kv, plan, scale=D ** -0.5, workspace=ws)
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    need = max(sum(-(-c // BS) for c in ctx) for _, ctx in CASES.values())
    kv = torch.randn(2, need, BS, N_KV, D)
    out = {"threads": torch.get_num_threads(), "machine": platform.node(), "cpus": os.cpu_count(),
           "load_before": os.getloadavg()[0], "repeats": a.repeats, "cases": {}}
    print(f"torch threads {torch.get_num_threads()}; ms per step (plan + {LAYERS} layers), median [min-max]")
    for name, (q_lens, ctx) in CASES.items():
        runs = {m: prepare(q_lens, ctx, kv, m) for m in ATTENTION_MODES}
        for r in runs.values():
            r()  # warm-up
        times: dict[str, list[float]] = {m: [] for m in ATTENTION_MODES}
        cpu: dict[str, list[float]] = {m: [] for m in ATTENTION_MODES}
        for _ in range(a.repeats):
            for m, r in runs.items():
                w, c = r()
                times[m].append(w * 1e3)
                cpu[m].append(c * 1e3)
        med = {m: statistics.median(ts) for m, ts in times.items()}
        cmed = {m: statistics.median(ts) for m, ts in cpu.items()}
        row = "  ".join(f"{m} {med[m]:7.2f} [{min(ts):.1f}-{max(ts):.1f}] ({med[m] / med['padded']:.2f}x; CPU "
                        f"{cmed[m] / cmed['padded']:.2f}x)" for m, ts in times.items())
        print(f"{name:38s} {row}", flush=True)
        out["cases"][name] = {"q_lens": q_lens, "contexts": ctx, "wall_ms": times, "cpu_ms": cpu, "median_ms": med,
                              "median_cpu_ms": cmed, "ratio_to_padded": {m: med[m] / med["padded"] for m in med},
                              "cpu_ratio_to_padded": {m: cmed[m] / cmed["padded"] for m in cmed}}
    out["load_after"] = os.getloadavg()[0]
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
