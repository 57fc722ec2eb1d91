"""Prefill metadata: ``allocate_batch`` against ``allocate`` + ``slot_mapping`` + ``block_table`` per sequence, and
``allocate`` alone, in one process, alternating; and the decode step at several batch sizes. Run it under two
source trees, alternately, for an A/B of the same calls (e.g. ``main`` against a branch)::

    for i in 1 2 3; do PYTHONPATH=/path/to/main/src .venv/bin/python benchmarks/prefill_batch.py main
                       PYTHONPATH=src .venv/bin/python benchmarks/prefill_batch.py branch; done

Prompts: B prompts of 200-299 tokens (blocks of 16) drawn from 8 stems of 160 tokens plus a random tail, so that
about half of every prompt is a prefix hit, some inside the batch. Prints microseconds per prompt (median of the
rounds, interleaved) and the ratio batch / (allocate + metadata). With an older tree that has no ``allocate_batch`` only the
per-sequence figures and the decode step are printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from pagedkv import BlockManager

sys.path.insert(0, str(Path(__file__).parent))
from ab_step import run as run_step  # noqa: E402 (the same tight step loop)


def _prompts(b: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 32000, 160).tolist() for _ in range(8)]
    return [stems[int(rng.integers(8))] + rng.integers(0, 32000, int(rng.integers(40, 140))).tolist() for _ in range(b)]


def per_sequence(bm: BlockManager, ids, prompts, meta: bool) -> None:
    for s, p in zip(ids, prompts):
        hit = bm.allocate(s, p)
        if meta:  # what an engine gathers for the forward today
            bm.slot_mapping(s, hit, len(p))
            bm.block_table(s)


def batched(bm: BlockManager, ids, prompts) -> None:
    bm.allocate_batch(ids, prompts)


def time_prefill(b: int, hows: tuple, rounds: int) -> dict:
    """Microseconds per prompt of each way in ``hows``, interleaved round by round (the same prompts, a fresh
    manager each), median over the rounds."""
    ts: dict = {h: [] for h in hows}
    for r in range(rounds):
        prompts = _prompts(b, r)
        ids = list(range(b))
        for how in hows:
            bm = BlockManager(b * 24 + 64, 16, enable_prefix_caching=True)
            t = time.perf_counter()
            if how == "batch":
                batched(bm, ids, prompts)
            else:
                per_sequence(bm, ids, prompts, meta=how == "seq+meta")
            ts[how].append(time.perf_counter() - t)
    return {h: float(np.median(v)) / b * 1e6 for h, v in ts.items()}


def time_step(batch: int, caching: bool, steps: int = 300) -> float:
    """Mean us per decode step at ``batch`` (:func:`ab_step.run`'s loop, seed 0)."""
    return run_step(batch, caching, steps)


if __name__ == "__main__":
    tag = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    has_batch = hasattr(BlockManager, "allocate_batch")
    out = []
    for b in (1, 8, 64):
        hows = ("seq", "seq+meta", "batch") if has_batch else ("seq", "seq+meta")
        got = time_prefill(b, hows, rounds=max(15, 512 // b))
        part = f"B{b}: allocate {got['seq']:.1f} +meta {got['seq+meta']:.1f}"
        if has_batch:
            part += f" batch {got['batch']:.1f} ({got['batch'] / got['seq+meta']:.2f}x)"
        out.append(part)
    print(tag, "prefill us/prompt |", " | ".join(out))
    print(tag, "decode_step us/step |", " ".join(f"B{b}/{'on' if c else 'off'}={time_step(b, c):.1f}"
                                           for b in (1, 4, 16, 64, 1000) for c in (False, True)))
