"""Burst sharing: N requests carrying one long system prompt, admitted in one step (no forward in between).

    PYTHONPATH=src .venv/bin/python benchmarks/burst.py [--requests 1000] [--system 2048] [--own 64]

Allocates every prompt (system prompt + its own tokens) back to back, as a scheduler admits a burst in one step,
and prints the prompt tokens served from the cache (what the engine does not compute) and the GPU blocks held.
Run it under the previous tree to see the round-one behaviour (a block entered the cache only at the next call
that touched its sequence): PYTHONPATH=/tmp/old/src.
"""

import argparse

import numpy as np

from pagedkv import BlockManager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--own", type=int, default=64)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, a.system).tolist()
    bs = 16
    bm = BlockManager(a.requests * (-(-(a.system + a.own) // bs)) + 64, bs, enable_prefix_caching=True)
    hits = 0
    for i in range(a.requests):
        hits += bm.allocate(i, system + rng.integers(0, 32000, a.own).tolist())
    total = a.requests * (a.system + a.own)
    used = bm.config.num_gpu_blocks - bm.num_free_gpu_blocks
    print(f"{a.requests} requests x ({a.system} shared + {a.own} own) tokens, admitted in one step: "
          f"{hits:,} of {total:,} prompt tokens from the cache ({100 * hits / total:.1f}%), "
          f"{total - hits:,} to compute; {used:,} GPU blocks held")


if __name__ == "__main__":
    main()
