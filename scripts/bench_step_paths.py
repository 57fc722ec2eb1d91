"""What each decode_step path costs: (1) with ``--paths``, the branch's step with each fast path disabled in turn,
against the same step with every path on; (2) with ``--baseline``, the branch against a baseline checkout. Both in
ONE process, alternating A, B, A, B ..., reporting the median of the per-round ratios (B / A: 1.00 = unchanged).

    git -C /path/to/repo archive BASE_COMMIT src/pagedkv | tar -x -C /tmp/base    # the baseline's package
    PYTHONPATH=src python scripts/bench_step_paths.py --baseline /tmp/base/src/pagedkv
    PYTHONPATH=src python scripts/bench_step_paths.py --paths

``--paths`` variants (each disabled on its own, on managers of the package on PYTHONPATH): ``-step_one`` (the
plain-Python step of a batch of one), ``one->small`` (a batch of one through the step of 2..SMALL_BATCH
sequences instead), ``-step_small`` (that of 2..SMALL_BATCH sequences), ``-Small`` (both: the
switch, ``_small_batch = 0``), ``-step1`` (main's one-token numpy fast path ``Stepper.step1`` and the hybrid
``fast_ok``, gone on this branch: run ``--paths`` with PYTHONPATH at a main checkout's src to measure it) and
``-all fast``. The first measurement (main, 2026-12-07): ``-Small`` 6.8-7x at a batch of one and 1.9-2.1x at eight,
5x / 1.6x on the hybrid step; ``-step1`` 1.2-2.4x at batches of 64-1000, 1.46x on the hybrid step at 64.

Cases: ``decode_step`` at batch 1, 8, 64, 256, 1000 with prefix caching off and on (one token each, full tables and
``block_tables=False``), with lookahead (2 slots) and ragged (1-3 tokens, flat with ``num_new_tokens``), and the
Gemma-3-like hybrid step (1 full + 5 sliding groups of W = 512) at 1k- and 16k-token contexts. ``--only`` keeps the
cases whose name contains one of the given words. Times are the measuring thread's CPU time, so other jobs on a
shared machine add less noise.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np

_clock = time.thread_time


from bench_groups import load_baseline  # noqa: E402 - (scripts/ is on the path of a script run)


class Decode:
    """``steps`` decode steps of ``batch`` sequences of ``ctx`` tokens: seconds per step (one measurement).

    ``kind``: "one" (one token each), "la" (one token each, 2 lookahead slots), "ragged" (1-3 tokens each, flat)."""

    def __init__(self, batch: int, prefix: bool, kind: str, delta: bool, steps: int, ctx: int = 100) -> None:
        self.batch, self.prefix, self.kind, self.delta, self.steps, self.ctx = batch, prefix, kind, delta, steps, ctx

    def __call__(self, mod, setup=None) -> float:
        bs, b, steps = 16, self.batch, self.steps
        per_tok = 3 if self.kind == "ragged" else 1
        per_seq = (self.ctx + steps * per_tok + 2) // bs + 3
        m = mod.BlockManager(b * per_seq + 16, bs, enable_prefix_caching=self.prefix, watermark=0)
        if setup is not None:
            setup(m)
        rng = np.random.default_rng(0)
        ids = list(range(b))
        for s in ids:
            m.allocate(s, rng.integers(0, 30000, self.ctx).tolist())
        kw = {} if not self.delta else {"block_tables": False}
        if self.kind == "one":
            toks = [np.ones(b, dtype=np.int64) if b > 8 else [1] * b for _ in range(steps)]
            calls = [((ids, t), kw) for t in toks]
        elif self.kind == "la":
            calls = [((ids, np.ones(b, dtype=np.int64), 2), kw) for _ in range(steps)]
        else:
            calls = []
            for _ in range(steps):
                c = rng.integers(1, 4, b)
                calls.append(((ids, np.ones(int(c.sum()), dtype=np.int64)), dict(kw, num_new_tokens=c)))
        step = m.decode_step
        gc.disable()
        t0 = _clock()
        for a, k in calls:
            step(*a, **k)
        dt = _clock() - t0
        gc.enable()
        return dt / steps


class Hybrid:
    """The Gemma-3-like hybrid manager (1 full + 5 sliding groups, W = 512): seconds per decode step (one token
    each), ``batch`` sequences of ``ctx`` tokens."""

    def __init__(self, batch: int, ctx: int, delta: bool, steps: int) -> None:
        self.batch, self.ctx, self.delta, self.steps = batch, ctx, delta, steps

    def __call__(self, mod, setup=None) -> float:
        bs, b, steps = 16, self.batch, self.steps
        per_seq = (self.ctx + steps + bs) // bs + 2
        groups = [mod.FullAttentionSpec()] + [mod.SlidingWindowSpec(512)] * 5
        m = mod.HybridBlockManager(b * (per_seq + 5 * (512 // bs + 3)) + 6 * per_seq, bs, kv_cache_groups=groups,
                                   enable_prefix_caching=True, watermark=0)
        if setup is not None:
            setup(m)
        rng = np.random.default_rng(2)
        ids = list(range(b))
        kw = {} if not self.delta else {"block_tables": False}
        for s in ids:
            m.allocate(s, rng.integers(0, 30000, self.ctx).tolist())
            m.decode_step([s], [1], **kw)
        toks = [1] * b if b <= 8 else np.ones(b, dtype=np.int64)
        step = m.decode_step
        gc.disable()
        t0 = _clock()
        for _ in range(steps):
            step(ids, toks, **kw)
        dt = _clock() - t0
        gc.enable()
        return dt / steps


def cases() -> list:
    out = []
    for delta in (False, True):
        d = " delta" if delta else " full "
        for prefix in (False, True):
            p = "on " if prefix else "off"
            for b in (1, 8, 64, 256, 1000):
                steps = 1500 if b <= 8 else 300 if b <= 64 else 100 if b <= 256 else 40
                out.append((f"decode B={b:<4} prefix={p}{d}", Decode(b, prefix, "one", delta, steps)))
        for b in (8, 64):
            out.append((f"lookahead2 B={b:<4} prefix=on {d}", Decode(b, True, "la", delta, 300)))
            out.append((f"ragged1-3 B={b:<4} prefix=on {d}", Decode(b, True, "ragged", delta, 200)))
        for b, ctx in ((1, 1024), (8, 1024), (64, 1024), (1, 16384), (8, 16384)):
            out.append((f"hybrid6 B={b:<3} ctx={ctx:<5}{d}", Hybrid(b, ctx, delta, 320 if b <= 8 else 64)))
    return out


def ab(name: str, fn, a, b, rounds: int) -> tuple:
    """Median seconds of ``a`` and ``b`` and the median of the per-round ratios b / a; ``a`` and ``b`` are
    (module, setup) pairs."""
    fn(*a), fn(*b)  # warm-up
    ta, tb, ratios = [], [], []
    for r in range(rounds):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        x = fn(*first)
        y = fn(*second)
        xa, xb = (x, y) if r % 2 == 0 else (y, x)
        ta.append(xa)
        tb.append(xb)
        ratios.append(xb / xa)
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


# ---------------------------------------------------------------------------------------------- the path switches
def _variants(mod) -> dict:
    """Setups that disable one fast path of ``mod`` (the branch's package) on a manager (monkeypatching the
    instance's parts; None: the manager as built)."""
    def off_small_one(m):  # (single-group managers only: the hybrid step has one small path)
        m._small.step_one = lambda *a, **k: None
    def off_small_batch(m):
        if hasattr(m, "_small_batch"):
            m._small_batch = 0
        else:
            m._step.small_batch = 0
    def small_one_as_many(m):  # a batch of one through step_small (decode_step only: step_small has no append_slots form)
        sm = m._small
        sm.step_one = lambda s, toks, mode: sm.step_small([s], toks, 1, mode)
    def off_small_many(m):
        m._small.step_small = lambda *a, **k: None
    def off_step1(m):
        if hasattr(m._step, "step1"):
            m._step.step1 = lambda *a, **k: None
        if hasattr(m._step, "fast_ok"):  # (a slotted class: swap in a subclass whose fast_ok declines)
            m._step.__class__ = type("NoFast", (type(m._step),), {"__slots__": (), "fast_ok": lambda self, rows: False})
    def off_all(m):
        off_small_batch(m)
        off_step1(m)
    return {"-step_one": off_small_one, "one->small": small_one_as_many, "-step_small": off_small_many, "-Small": off_small_batch,
            "-step1": off_step1, "-all fast": off_all}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="path of the baseline's src/pagedkv: A/B branch vs baseline")
    ap.add_argument("--paths", action="store_true", help="A/B of the branch with each fast path disabled in turn")
    ap.add_argument("--variants", default="", help="comma-separated subset of the --paths variants")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated words; keep the cases whose name has one")
    args = ap.parse_args(argv)
    import pagedkv
    todo = cases()
    if args.only:
        words = args.only.split(",")
        todo = [c for c in todo if any(w in c[0] for w in words)]
    if args.baseline:
        base = load_baseline(args.baseline)
        print(f"A/B decode_step: new ({pagedkv.__file__}) vs baseline ({base.__file__}), {args.rounds} alternating "
              "rounds, medians (CPU time of this thread)")
        print(f"{'case':36s} {'baseline us':>12s} {'new us':>10s} {'new/base':>9s}")
        worst = 0.0
        for name, fn in todo:
            tb, tn, r = ab(name, fn, (base, None), (pagedkv, None), args.rounds)
            worst = max(worst, r)
            print(f"{name:36s} {tb * 1e6:12.2f} {tn * 1e6:10.2f} {r:9.3f}", flush=True)
        print(f"worst ratio {worst:.3f}")
    if args.paths:
        variants = _variants(pagedkv)
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
        names = list(variants)
        print(f"fast paths disabled in turn: time with the path off / time with every path on ({args.rounds} "
              "alternating rounds, medians)")
        print(f"{'case':36s} {'all on us':>10s} " + " ".join(f"{n:>11s}" for n in names))
        for name, fn in todo:
            cells, base_t = [], []
            for n in names:
                if isinstance(fn, Hybrid) and n in ("-step_one", "one->small", "-step_small"):
                    cells.append(float("nan"))
                    continue
                ta, tb, r = ab(name, fn, (pagedkv, None), (pagedkv, variants[n]), args.rounds)
                base_t.append(ta)
                cells.append(r)
            print(f"{name:36s} {statistics.median(base_t) * 1e6:10.2f} " + " ".join(f"{c:11.3f}" for c in cells),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
