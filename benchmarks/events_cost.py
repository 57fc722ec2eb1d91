"""What KV events cost: the batched decode step with prefix caching, events off against on (drained every step).

    PYTHONPATH=src .venv/bin/python benchmarks/events_cost.py [--batch 1000] [--steps 256] [--repeats 5]

B sequences with distinct prompts of 200-299 tokens (blocks of 16, so blocks fill at staggered steps) decode one
token per step; about B/16 blocks fill, and so are cached and reported, per step. Off and on run interleaved in
one process (one fresh manager per run); prints the mean us per step of each (the slowest 2% left out: OS
preemption) and the per-repeat ratio on / off (median [min-max]).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedkv import BlockManager


def run(batch: int, steps: int, events: bool, seed: int) -> float:
    rng = np.random.default_rng(seed)
    bm = BlockManager(batch * (256 + steps) // 16 + batch + 64, 16, enable_prefix_caching=True,
                      enable_kv_events=events)
    ids = list(range(batch))
    for i in ids:
        bm.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
    bm.events.take()
    toks = rng.integers(0, 32000, (steps, batch))
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        bm.decode_step(ids, toks[s])
        if events:
            bm.events.take()
        times.append(time.perf_counter() - t0)
    kept = sorted(times[8:])[: -len(times) // 50]
    return float(np.mean(kept)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    off, on = [], []
    for r in range(a.repeats):
        off.append(run(a.batch, a.steps, False, r))
        on.append(run(a.batch, a.steps, True, r))
    ratio = np.array(on) / np.array(off)
    print(f"batch {a.batch}, prefix caching on, mean us per step, median over {a.repeats} interleaved repeats")
    print(f"events off: {np.median(off):.1f} us   events on (drained each step): {np.median(on):.1f} us   "
          f"on/off {np.median(ratio):.2f} [{ratio.min():.2f}-{ratio.max():.2f}]")


if __name__ == "__main__":
    main()
