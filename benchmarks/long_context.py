"""Long contexts cost the decode step nothing extra (issue 17, item 5): the step's cost against context length.

    PYTHONPATH=src python benchmarks/long_context.py                 # the step curve and the replay, ~10 min
    PYTHONPATH=src python benchmarks/long_context.py --skip-replay   # the step curve only, ~3 min
    PYTHONPATH=src python benchmarks/long_context.py --quick         # a smoke run of both parts

1. **The step at batch 64 against context length.** 64 sequences hold prompts of C tokens each (C = 1k, 8k, 32k,
   100k; distinct random tokens, blocks of 16), then decode one token each per step. Two managers built alike
   decode the same tokens, one with the padded tables (``decode_step(ids, toks)``, the default: the gather of
   64 x C/16 table entries) and one incrementally (``decode_step(ids, toks, block_tables=False)``: the step's
   table changes only), alternating by rounds of steps in one process so that a slow spell of the shared machine
   hits both alike. Prints the mean microseconds per step of each (the slowest 2% of steps left out: OS
   preemption; the JSON has the medians too), and each one's cost at C against its cost at
   1k (target for the incremental form: 100k within 1.5x of 1k). Prefix caching off and on.
2. **The timed replay of the conversation trace at 1M tokens** (``pagedkv replay --mode timed``, whose decode
   steps use the incremental form) against the sequence replay of the same trace and capacity (target: within
   2x), alternating, in one process; and the timed replay with the padded tables (the step as before) for
   comparison. Needs the Mooncake trace (``--trace``, default ``../shared/data/mooncake/conversation_trace.jsonl``).

``--groups gemma3`` runs part 1 on a :class:`~pagedkv.HybridBlockManager` with Gemma 3's KV cache groups (one
full-attention group, five sliding-window groups of 512 tokens): the padded tables are then six per step
(:class:`~pagedkv.HybridStepResult`), the incremental form :class:`~pagedkv.HybridStepDelta`.

Figures go to stdout and, as JSON, to ``benchmarks/results/long_context.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

BLOCK = 16
BATCH = 64


def _mean_us(times: list[float]) -> float:
    """Mean of the fastest 98% (the slowest 2% are OS preemptions on a shared machine), in microseconds; the
    steps that take new blocks (every 16th of each sequence) are in it."""
    kept = sorted(times)[: len(times) - len(times) // 50]
    return float(np.mean(kept)) * 1e6


GEMMA3_GROUPS = (FullAttentionSpec(),) + (SlidingWindowSpec(512),) * 5


def _managers(context: int, steps: int, caching: bool, seed: int = 0, groups: tuple | None = None):
    """Two managers (padded tables, incremental) holding BATCH prompts of ``context`` tokens."""
    rng = np.random.default_rng(seed)
    blocks = BATCH * (-(-(context + steps) // BLOCK) + 1) + 64
    if groups:  # every sliding group holds its window (plus a block either side) per sequence, and a whole
        # prompt while it is admitted (its first step releases what the window no longer sees)
        blocks += sum(BATCH * (-(-g.window // BLOCK) + 2) + -(-context // BLOCK) for g in groups[1:])
    prompts = [rng.integers(0, 1 << 30, context).tolist() for _ in range(BATCH)]
    out = []
    for _ in range(2):
        if groups:
            bm = BlockManager(blocks, BLOCK, kv_cache_groups=groups, enable_prefix_caching=caching, grouped_results=True)
        else:
            bm = BlockManager(blocks, BLOCK, enable_prefix_caching=caching)
        if groups:  # one at a time, each followed by one step of its own (the window's releases)
            for i, p in enumerate(prompts):
                bm.allocate(i, p[:-1])
                bm.decode_step([i], p[-1:])
        else:
            bm.allocate_batch(list(range(BATCH)), prompts)
        out.append(bm)
    return out


def step_curve(contexts: list[int], steps: int, rounds: int, caching: bool, groups: tuple | None = None) -> list[dict]:
    """Median us per step, padded tables vs incremental, at each context (alternating rounds of steps)."""
    rows = []
    ids = list(range(BATCH))
    for c in contexts:
        full, inc = _managers(c, steps * rounds, caching, groups=groups)
        toks = np.random.default_rng(1).integers(0, 1 << 30, (steps * rounds, BATCH))
        t_full, t_inc = [], []
        for r in range(rounds):
            for bm, tables, acc in ((full, True, t_full), (inc, False, t_inc)) if r % 2 == 0 else \
                    ((inc, False, t_inc), (full, True, t_full)):
                step = bm.decode_step
                for s in range(r * steps, (r + 1) * steps):
                    t = time.perf_counter()
                    step(ids, toks[s], block_tables=tables)
                    acc.append(time.perf_counter() - t)
        rows.append({"context": c, "caching": caching, "full_us": _mean_us(t_full), "incremental_us": _mean_us(t_inc),
                     "full_median_us": statistics.median(t_full) * 1e6,
                     "incremental_median_us": statistics.median(t_inc) * 1e6})
        print(f"  context {c:>7,}: padded tables {rows[-1]['full_us']:7.1f} us/step   "
              f"incremental {rows[-1]['incremental_us']:6.1f} us/step   (medians {rows[-1]['full_median_us']:7.1f} "
              f"and {rows[-1]['incremental_median_us']:6.1f})", flush=True)
        del full, inc
    base = rows[0]
    for row in rows:
        row["full_vs_first"] = row["full_us"] / base["full_us"]
        row["incremental_vs_first"] = row["incremental_us"] / base["incremental_us"]
        row["incremental_median_vs_first"] = row["incremental_median_us"] / base["incremental_median_us"]
    return rows


class _PaddedTables(BlockManager):
    """BlockManager as the timed replay drove it before the incremental form (it looks for ``table_rows``)."""

    table_rows = None


def replay(trace_path: str, capacity: int, rounds: int, limit: int | None) -> dict:
    from pagedkv.replay.sequence import replay_sequence
    from pagedkv.replay.timed import replay_timed
    from pagedkv.replay.trace import load_trace

    trace = load_trace(trace_path, limit)
    runs = {"sequence": [], "timed": [], "timed_padded": []}
    hits = {}
    for r in range(rounds):
        order = ["sequence", "timed", "timed_padded"]
        if r % 2:
            order.reverse()
        for name in order:
            if name == "sequence":
                res = replay_sequence(trace, capacity)
            else:
                res = replay_timed(trace, capacity, manager_cls=_PaddedTables if name == "timed_padded" else None)
            runs[name].append(res.seconds)
            hits.setdefault(name, res.hit_tokens)
            print(f"  round {r + 1}: {name:<13} {res.seconds:6.2f} s  (hit tokens {res.hit_tokens:,})", flush=True)
    assert hits["timed"] == hits["timed_padded"], "the two timed replays must make the same calls"
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [t / s for t, s in zip(runs["timed"], runs["sequence"])]
    ratios_padded = [t / s for t, s in zip(runs["timed_padded"], runs["sequence"])]
    return {"trace": Path(trace_path).name, "capacity_tokens": capacity, "requests": len(trace), "seconds": runs,
            "median_s": med, "timed_vs_sequence": statistics.median(ratios),
            "timed_padded_vs_sequence": statistics.median(ratios_padded),
            "timed_vs_sequence_all": ratios, "timed_padded_vs_sequence_all": ratios_padded}


def _default_trace() -> str:
    root = Path(__file__).resolve().parents[1]
    for up in (root.parent, root.parent.parent):
        p = up / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
        if p.exists():
            return str(p)
    return "../shared/data/mooncake/conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small contexts, few steps, 500 requests")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-curve", action="store_true", help="the replay only")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the replay (default 3)")
    ap.add_argument("--trace", default=_default_trace(), help="the Mooncake conversation trace (default: "
                    "shared/data/mooncake/conversation_trace.jsonl beside the checkout or one level up)")
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--groups", choices=["gemma3"], help="part 1 on KV cache groups: Gemma 3's (1 full + 5 sliding "
                    "of 512 tokens); the replay is skipped")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results") / "long_context.json"))
    args = ap.parse_args()
    contexts = [1024, 4096] if args.quick else [1024, 8192, 32768, 102400]
    steps, rounds = (20, 2) if args.quick else (200, 6)
    groups = GEMMA3_GROUPS if args.groups == "gemma3" else None
    if groups:
        args.skip_replay = True
        if args.out == ap.get_default("out"):
            args.out = str(Path(args.out).with_name("long_context_gemma3.json"))
    result = {"machine": platform.machine(), "python": platform.python_version(), "batch": BATCH,
              "block_size": BLOCK, "steps_per_round": steps, "rounds": rounds, "groups": args.groups, "curve": []}
    for caching in () if args.skip_curve else (False, True):
        print(f"decode step, batch {BATCH}, prefix caching {'on' if caching else 'off'}"
              f"{', KV cache groups ' + args.groups if groups else ''}:", flush=True)
        rows = step_curve(contexts, steps, rounds, caching, groups)
        result["curve"] += rows
        last = rows[-1]
        print(f"  {last['context']:,} vs {rows[0]['context']:,} tokens: padded tables "
              f"{last['full_vs_first']:.2f}x, incremental {last['incremental_vs_first']:.2f}x (target <= 1.5x; "
              f"medians {last['incremental_median_vs_first']:.2f}x)")
    if not args.skip_replay:
        if Path(args.trace).exists():
            print(f"replay of {Path(args.trace).name} at {args.capacity:,} tokens, timed vs sequence mode:",
                  flush=True)
            rep = replay(args.trace, args.capacity, 1 if args.quick else args.rounds, 500 if args.quick else None)
            result["replay"] = rep
            print(f"  timed / sequence: {rep['timed_vs_sequence']:.2f}x (target <= 2x); with padded tables "
                  f"{rep['timed_padded_vs_sequence']:.2f}x")
        else:
            print(f"(no trace at {args.trace}: replay skipped)")
    if not args.quick:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
