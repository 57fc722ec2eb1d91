"""Replay speed against its yardstick: ``pagedkv replay`` (sequence mode) vs a minimal OrderedDict LRU replay.

    PYTHONPATH=src .venv/bin/python benchmarks/replay_speed.py [--trace FILE] [--capacity 1M ...] [--repeats 3]
        [--limit N] [--json OUT]

For each capacity and repeat, in the same process and alternating (baseline, pagedkv, baseline, pagedkv, ...):

- baseline: :func:`pagedkv.replay.baseline.lru_replay`, the same LRU replay on the trace's prefix-tree nodes with
  an ``OrderedDict`` (no hashing, no tokens, no manager; its nodes are computed untimed);
- pagedkv: :func:`pagedkv.replay.replay_sequence` with a :class:`pagedkv.BlockManager`, the replay of
  ``pagedkv replay --mode sequence`` (its own timer: the allocate / free loop, token synthesis included, trace
  parsing excluded).

Both must report the same hit tokens, evictions and skipped requests (asserted: a faster replay that changes a
single hit fails here). Prints the seconds of each run and the ratio pagedkv / baseline per repeat, then the
median [min-max] per capacity. The ratio is taken on the process's CPU time of each loop (``time.process_time``):
on a shared machine wall time mostly measures how often the process was descheduled; the wall-time ratio is
printed beside it. The full trace is ``../shared/data/mooncake/conversation_trace.jsonl`` (12,031
requests, 144.8M prompt tokens); the default looks for it next to the repository and its parents.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.replay import load_trace, replay_sequence
from pagedkv.replay.__main__ import parse_tokens
from pagedkv.replay.baseline import lru_replay

TRACE = Path("shared/data/mooncake/conversation_trace.jsonl")


def _default_trace() -> Path | None:
    here = Path(__file__).resolve().parent
    for d in [Path.cwd(), *Path.cwd().parents, here, *here.parents]:
        if (d / ".." / TRACE).is_file():
            return (d / ".." / TRACE).resolve()
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake trace (default: ../shared/data/mooncake/...)")
    ap.add_argument("--capacity", type=parse_tokens, action="append", metavar="TOKENS", help="default 1M")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="the first N requests only")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    a = ap.parse_args(argv)
    path = a.trace or _default_trace()
    if path is None or not Path(path).is_file():
        ap.error("no trace: pass --trace FILE (../shared/data/mooncake/conversation_trace.jsonl)")
    caps = a.capacity or [1_000_000]
    tr = load_trace(path, a.limit)
    print(f"{Path(path).name}: {len(tr):,} requests, {tr.prompt_tokens:,} prompt tokens; blocks of {a.block_size}; "
          f"pagedkv {pagedkv.__version__}, python {platform.python_version()}, numpy {np.__version__}")
    out = {"trace": Path(path).name, "requests": len(tr), "block_size": a.block_size, "repeats": a.repeats,
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.platform(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "points": []}
    lru_replay(tr.limit(50), caps[0], block_size=a.block_size)  # warm-up (imports, first calls)
    replay_sequence(tr.limit(50), caps[0], block_size=a.block_size)
    for cap in caps:
        runs = []
        for rep in range(a.repeats):
            gc.collect()
            b = lru_replay(tr, cap, block_size=a.block_size)
            gc.collect()
            p = replay_sequence(tr, cap, block_size=a.block_size)
            same = (p.hit_tokens, p.evictions, p.skipped) == (b.hit_tokens, b.evictions, b.skipped)
            assert same, f"hits differ at {cap}: pagedkv {(p.hit_tokens, p.evictions, p.skipped)} " \
                         f"vs LRU baseline {(b.hit_tokens, b.evictions, b.skipped)}"
            pc = p.cpu_seconds
            r, rw = pc / b.cpu_seconds, p.seconds / b.seconds
            runs.append({"baseline_cpu_s": b.cpu_seconds, "pagedkv_cpu_s": pc, "ratio": r,
                         "baseline_wall_s": b.seconds, "pagedkv_wall_s": p.seconds, "ratio_wall": rw})
            print(f"  {cap:>12,} tokens, repeat {rep + 1}: CPU s baseline {b.cpu_seconds:6.2f}, pagedkv {pc:6.2f}, "
                  f"ratio {r:.2f} (wall {b.seconds:.2f} / {p.seconds:.2f} s, {rw:.2f}); hit rate "
                  f"{100 * p.hit_rate:.2f}%, {p.evictions:,} evictions (equal)", flush=True)
        rs, rws = [x["ratio"] for x in runs], [x["ratio_wall"] for x in runs]
        point = {"capacity_tokens": cap, "hit_tokens": p.hit_tokens, "prompt_tokens": p.prompt_tokens,
                 "hit_rate": p.hit_rate, "evictions": p.evictions, "skipped": p.skipped,
                 "baseline_cpu_s_median": statistics.median(x["baseline_cpu_s"] for x in runs),
                 "pagedkv_cpu_s_median": statistics.median(x["pagedkv_cpu_s"] for x in runs),
                 "ratio": {"median": statistics.median(rs), "min": min(rs), "max": max(rs)},
                 "ratio_wall": {"median": statistics.median(rws), "min": min(rws), "max": max(rws)}, "runs": runs}
        out["points"].append(point)
        print(f"{cap:>12,} tokens: pagedkv / baseline = {point['ratio']['median']:.2f} "
              f"[{point['ratio']['min']:.2f}-{point['ratio']['max']:.2f}] in CPU time (median [min-max] of "
              f"{a.repeats}; wall time {point['ratio_wall']['median']:.2f}); CPU s baseline "
              f"{point['baseline_cpu_s_median']:.2f}, pagedkv {point['pagedkv_cpu_s_median']:.2f}; "
              f"hits identical ({p.hit_tokens:,} tokens)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
