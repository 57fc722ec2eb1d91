"""Where pagedkv's time goes at batch 1 and in the single-sequence calls: per-line and per-function profiles.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_small.py [--calls 3000] [--top 12]

For each of ``decode_step`` at batch 1 (prefix caching off and on), ``append_slots(seq, [tok])``, ``allocate``
of a 20-token prompt, ``fork`` and ``free``, it prints:

- the untraced cost per call (median of ``time.perf_counter_ns`` around each call);
- a line profile of pagedkv's own modules (``sys.settrace`` line events in ``pagedkv/*.py``): per line, the
  median time from its event to the next one, less the tracer's own cost per event (the median on lines that
  do nothing), times the line's events per call; medians, because a shared machine preempts the process now
  and then. The figures sum to roughly the untraced cost; a line's time includes the C calls it makes (numpy),
  not the Python functions it calls (those have their own lines);
- the top functions by own time under cProfile (slower than untraced, but the call counts are exact).

A diagnostic for the developer making the small-batch path faster, not part of the suite.
"""

from __future__ import annotations

import argparse
import cProfile
import linecache
import os
import pstats
import sys
import time
from collections import defaultdict

import numpy as np

from pagedkv import BlockManager

_PKG = os.path.dirname(os.path.abspath(sys.modules["pagedkv"].__file__))


class LineTimer:
    """Time between consecutive line events in pagedkv's modules, attributed to the earlier line."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots
        self.ns: dict[tuple[str, int], list[int]] = defaultdict(list)  # every event's duration
        self.hits: dict[tuple[str, int], int] = defaultdict(int)
        self._last: tuple[str, int] | None = None
        self._t = 0

    def _local(self, frame, event, arg):
        now = time.perf_counter_ns()
        if self._last is not None:
            self.ns[self._last].append(now - self._t)
        if event == "line":
            key = (frame.f_code.co_filename, frame.f_lineno)
            self.hits[key] += 1
            self._last = key
        else:  # return / exception: time after this belongs to the caller's line, resumed below
            self._last = None
        self._t = time.perf_counter_ns()
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(self.roots):
            now = time.perf_counter_ns()
            if self._last is not None:  # the caller's line, up to the call
                self.ns[self._last].append(now - self._t)
            self._last = None
            self._t = time.perf_counter_ns()
            return self._local
        return None

    def run(self, fn, n: int) -> None:
        sys.settrace(self._global)
        try:
            for _ in range(n):
                fn()
                self._last = None
        finally:
            sys.settrace(None)


def _overhead_per_event(n: int = 20000) -> float:
    src = "def f():\n" + "".join("    x = 1\n" for _ in range(20))
    ns: dict = {}
    fname = os.path.join(_PKG, "_calibration_.py")
    exec(compile(src, fname, "exec"), ns)
    lt = LineTimer((fname,))
    lt.run(ns["f"], n)
    return float(np.median([d for v in lt.ns.values() for d in v]))


def _untraced(fn, n: int) -> float:
    clock = time.perf_counter_ns
    ns = []
    for _ in range(n):
        t0 = clock()
        fn()
        ns.append(clock() - t0)
    return float(np.median(ns)) / 1e3


def _cases(n: int):
    """name -> (setup() returning a zero-argument call that does one more call each time)."""

    def decode1(caching):
        def setup():
            bm = BlockManager(4096, 16, enable_prefix_caching=caching)
            bm.allocate(0, np.arange(100) % 997)
            ids, tok = [0], np.array([5], dtype=np.int64)
            return lambda: bm.decode_step(ids, tok)
        return setup

    def append():
        bm = BlockManager(8192, 16)
        bm.allocate(0, list(range(100)))
        tok = [5]
        return lambda: bm.append_slots(0, tok)

    def append_cow():  # each call: a child's first token into the partial block it shares with its parent
        bm = BlockManager(8 * n + 64, 16)
        bm.allocate(0, list(range(20)))
        for c in range(1, 4 * n + 1000):
            bm.fork(0, c)
        it = iter(range(1, 10**9))
        tok = [5]
        return lambda: bm.append_slots(next(it), tok)

    def allocate():
        bm = BlockManager(4 * n * 2 + 64, 16)
        prompt = list(range(20))
        it = iter(range(10**9))
        return lambda: bm.allocate(next(it), prompt)

    def fork():
        bm = BlockManager(64, 16)
        bm.allocate(0, list(range(100)))
        it = iter(range(1, 10**9))
        return lambda: bm.fork(0, next(it))

    def free():
        bm = BlockManager(4 * n * 2 + 64, 16)
        prompt = list(range(20))
        for i in range(2 * n + 2000):
            bm.allocate(i, prompt)
        it = iter(range(10**9))
        return lambda: bm.free(next(it))

    return {"decode_step B=1, caching off": decode1(False), "decode_step B=1, caching on": decode1(True),
            "append_slots(seq, [tok])": append,
            "append_slots with copy-on-write": append_cow, "allocate(20 tokens)": allocate, "fork": fork, "free": free}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    n = a.calls
    over = _overhead_per_event()
    print(f"tracer overhead per line event: {over / 1e3:.3f} us (subtracted)\n")
    for name, setup in _cases(n).items():
        fn = setup()
        for _ in range(200):
            fn()
        us = _untraced(setup(), n)
        lt = LineTimer((_PKG,))
        lt.run(setup(), n)
        rows = []
        for key, ns in lt.ns.items():
            per_call = len(ns) / n  # events per benchmarked call
            rows.append((max(float(np.median(ns)) - over, 0.0) * per_call / 1e3, lt.hits[key] / n, key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"== {name}: {us:.2f} us per call untraced; line profile sums to {total:.2f} us")
        for t, h, (f, ln) in rows[: a.top]:
            line = linecache.getline(f, ln).strip()
            print(f"  {t:7.2f} us  {h:5.2f}x  {os.path.basename(f)}:{ln:<5} {line[:96]}")
        pr = cProfile.Profile()
        fn = setup()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        st = pstats.Stats(pr)
        items = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: a.top]
        print("  cProfile, own time per call of the benchmarked call:")
        for (f, ln, func), (cc, nc, tt, ct, _) in items:
            print(f"    {tt / n * 1e6:7.2f} us  {nc / n:5.2f} calls  {os.path.basename(f)}:{ln} {func}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
