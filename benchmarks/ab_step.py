"""A/B of the decode step between two checkouts: the same tight loop, run alternately under each source tree.

    git worktree add /tmp/old e84f594
    for i in 1 2 3; do PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/ab_step.py old
                       PYTHONPATH=src .venv/bin/python benchmarks/ab_step.py new; done

B sequences with prompts of 200-299 random tokens (blocks of 16, so blocks fill at staggered steps) decode 300
steps of one token each; prints the mean us per step (the slowest 2% left out: OS preemption) at batch 1000 and
64, prefix caching off and on. Used to check that round two (the manager split, burst sharing, KV events, the
small-batch path, the LRU log, the CPU tier) costs the batched step nothing.
"""

import sys
import time

import numpy as np

from pagedkv import BlockManager


def run(batch: int, caching: bool, steps: int = 300, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    bm = BlockManager(batch * 40 + 64, 16, enable_prefix_caching=caching)
    ids = list(range(batch))
    for i in ids:
        bm.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
    toks = rng.integers(0, 32000, (steps, batch))
    ts = []
    for s in range(steps):
        t = time.perf_counter()
        bm.decode_step(ids, toks[s])
        ts.append(time.perf_counter() - t)
    kept = sorted(ts[10:])[: -len(ts) // 50]
    return float(np.mean(kept)) * 1e6


if __name__ == "__main__":
    tag = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    print(tag, " ".join(f"B{b}/{'on' if c else 'off'}={run(b, c):.1f}" for b in (1000, 64) for c in (False, True)))
