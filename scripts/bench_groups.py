"""KV cache groups: (1) A/B of the single-group BlockManager against a baseline checkout in ONE process, and (2)
the cost of a Gemma-3-like HybridBlockManager (1 full + 5 sliding groups of W = 512) per decode step.

    git -C /path/to/repo archive BASE_COMMIT src/pagedkv | tar -x -C /tmp/base   # the baseline's package
    PYTHONPATH=src python scripts/bench_groups.py --baseline /tmp/base/src/pagedkv

The baseline package is imported under another name (``pagedkv_base``: the core uses relative imports only), so
both run in the same process; measurements alternate A, B, A, B ... and the report gives the median of the
per-round ratios (new / baseline: 1.00 = unchanged). Without ``--baseline`` only part (2) runs. Times are the
measuring thread's CPU time (``--clock wall`` for wall time), so other jobs on a shared machine add less noise.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np


_clock = time.thread_time  # CPU time of this thread: a shared machine's descheduling does not count (--clock wall)


def load_baseline(path: str):
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location("pagedkv_base", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pagedkv_base"] = mod
    spec.loader.exec_module(mod)
    return mod


def decode_case(mod, batch: int, prefix: bool, steps: int, ctx: int = 100, reps: int = 3):
    """Seconds per decode_step of ``batch`` sequences of ``ctx`` tokens (one token each): the best of ``reps``
    runs of ``steps`` steps."""
    bs = 16
    per_seq = (ctx + steps * reps) // bs + 2
    m = mod.BlockManager(batch * per_seq + 16, bs, enable_prefix_caching=prefix, watermark=0)
    rng = np.random.default_rng(0)
    ids = list(range(batch))
    for s in ids:
        m.allocate(s, rng.integers(0, 30000, ctx).tolist())
    toks = np.ones(batch, dtype=np.int64)
    best = float("inf")
    for _ in range(reps):
        t0 = _clock()
        for _ in range(steps):
            m.decode_step(ids, toks)
        best = min(best, (_clock() - t0) / steps)
    return best


def allocate_case(mod, prefix: bool, n: int = 64, plen: int = 512, reps: int = 3):
    """Seconds per allocate of a ``plen``-token prompt sharing its first half with the previous ones (best of
    ``reps`` managers)."""
    return min(_allocate_once(mod, prefix, n, plen) for _ in range(reps))


def _allocate_once(mod, prefix: bool, n: int, plen: int) -> float:
    bs = 16
    m = mod.BlockManager(n * (plen // bs + 2) + 16, bs, enable_prefix_caching=prefix, watermark=0)
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 30000, plen // 2).tolist()
    prompts = [shared + rng.integers(0, 30000, plen - plen // 2).tolist() for _ in range(n)]
    t0 = _clock()
    for i, p in enumerate(prompts):
        m.allocate(i, p)
    return (_clock() - t0) / n


def ab(new, base, rounds: int) -> list:
    cases = []
    for prefix in (False, True):
        for b in (1, 8, 64, 256, 1000):
            steps = 2000 if b <= 8 else 400 if b <= 256 else 100
            cases.append((f"decode_step B={b:<4} prefix={'on ' if prefix else 'off'}",
                          lambda mod, b=b, p=prefix, s=steps: decode_case(mod, b, p, s)))
        cases.append((f"allocate 512 tok     prefix={'on ' if prefix else 'off'}",
                      lambda mod, p=prefix: allocate_case(mod, p)))
    rows = []
    for name, fn in cases:
        fn(new), fn(base)  # warm-up
        tn, tb, ratios = [], [], []
        for r in range(rounds):
            pair = (new, base) if r % 2 == 0 else (base, new)
            got = {id(mod): fn(mod) for mod in pair}
            tn.append(got[id(new)])
            tb.append(got[id(base)])
            ratios.append(got[id(new)] / got[id(base)])
        rows.append((name, statistics.median(tb) * 1e6, statistics.median(tn) * 1e6, statistics.median(ratios)))
    return rows


def gemma_case(mod, batch: int, ctx: int, steps: int, hybrid: bool):
    """(median, mean) seconds per decode step: the Gemma-3-like hybrid manager (6 groups), or one table."""
    bs = 16
    per_seq = (ctx + steps + bs) // bs + 2
    if hybrid:  # the pool a real deployment sizes: a sliding group keeps about W / block_size + 2 blocks a sequence
        groups = [mod.FullAttentionSpec()] + [mod.SlidingWindowSpec(512)] * 5
        m = mod.HybridBlockManager(batch * (per_seq + 5 * (512 // bs + 3)) + 6 * per_seq, bs, kv_cache_groups=groups,
                                   enable_prefix_caching=True, watermark=0)
    else:
        m = mod.BlockManager(batch * per_seq + 16, bs, enable_prefix_caching=True, watermark=0)
    rng = np.random.default_rng(2)
    ids = list(range(batch))
    for s in ids:  # prefill, then the first decode step (which releases what the windows no longer see)
        m.allocate(s, rng.integers(0, 30000, ctx).tolist())
        m.decode_step([s], np.ones(1, dtype=np.int64))
    toks = np.ones(batch, dtype=np.int64)
    for _ in range(bs):  # (the first step releases the windows' prompt blocks)
        m.decode_step(ids, toks)
    gc.collect()
    gc.freeze()  # (as an engine does after start-up: full collections would scan the set-up's objects)
    times = []
    for _ in range(steps):
        t0 = _clock()
        m.decode_step(ids, toks)
        times.append(_clock() - t0)
    # (median and mean: a step that fills and registers a block in every sequence and group costs several plain
    # ones, and on a shared machine a step is sometimes descheduled for milliseconds)
    gc.unfreeze()
    return statistics.median(times), sum(times) / len(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="path of the baseline's src/pagedkv (A/B of the single-group manager)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ctx", type=int, default=2048, help="context length of the Gemma-like sequences")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: CPU time of the measuring thread (default; robust on a shared machine)")
    ap.add_argument("--skip-gemma", action="store_true", help="only the A/B")
    args = ap.parse_args(argv)
    global _clock
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    import pagedkv
    if args.baseline:
        base = load_baseline(args.baseline)
        print(f"A/B single-group BlockManager: new ({pagedkv.__file__}) vs baseline ({base.__file__}), "
              f"{args.rounds} alternating rounds, medians")
        print(f"{'case':40s} {'baseline us':>12s} {'new us':>10s} {'new/base':>9s}")
        for name, b, n, r in ab(pagedkv, base, args.rounds):
            print(f"{name:40s} {b:12.1f} {n:10.1f} {r:9.3f}")
    if args.skip_gemma:
        return 0
    print(f"\nGemma-3-like HybridBlockManager (1 full + 5 sliding W=512, block 16, prefix caching, {args.ctx}-token "
          "contexts) vs one BlockManager table, per decode step (one token each)")
    print(f"{'batch':>6s} {'one table: median':>18s} {'mean':>8s}   {'6 groups: median':>17s} {'mean':>8s}   "
          f"{'ratio of medians':>16s}  (us per step)")
    for b in (1, 64, 1000):
        steps = 320 if b == 1 else 64 if b == 64 else 32  # (multiples of the block size: the sequences advance
        # in lockstep, so one step in 16 fills a block in every sequence and group and registers them all)
        one, hyb = [], []
        for r in range(max(3, args.rounds // 2)):
            one.append(gemma_case(pagedkv, b, args.ctx, steps, False))
            hyb.append(gemma_case(pagedkv, b, args.ctx, steps, True))
        om, oa = (statistics.median(x[i] for x in one) * 1e6 for i in (0, 1))
        hm, ha = (statistics.median(x[i] for x in hyb) * 1e6 for i in (0, 1))
        print(f"{b:6d} {om:18.1f} {oa:8.1f}   {hm:17.1f} {ha:8.1f}   {hm / om:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
