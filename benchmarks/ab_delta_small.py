"""In-process A/B of ``BlockManager.decode_step`` at batch 1, 2 and 4 (``block_tables=False`` and the padded
tables, caching off and on, the sampled tokens as a list of ints) between this tree's pagedkv and another
checkout's, CPU time per thread (``time.thread_time_ns``, one clock read subtracted), alternating call by call::

    PYTHONPATH=src .venv/bin/python benchmarks/ab_delta_small.py /path/to/other/src

Prints the median microseconds per step of each tree and the ratio this / other.
"""
import sys, time, numpy as np
sys.path.insert(0, "benchmarks")
from ab_inproc import load
import pagedkv as this
from pagedkv.bench.fair import alternate, clock_overhead
other = load(sys.argv[1])
c = time.thread_time_ns
N = 3000
for b in (1, 2, 4):
    for caching in (False, True):
        for tables in (False, True):
            rng = np.random.default_rng(b)
            prompts = [rng.integers(0, 32000, 200).tolist() for _ in range(b)]
            toks = rng.integers(0, 32000, (N, b)).tolist()
            def mk(pk):
                bm = pk.BlockManager(b * 260 + 64, 16, enable_prefix_caching=caching)
                for i, p in enumerate(prompts): bm.allocate(i, p)
                ids = list(range(b)); f = bm.decode_step
                def s(i):
                    t = toks[i]; t0 = c(); f(ids, t, block_tables=tables); return {"x": c() - t0}
                return s
            ra, rb = alternate([mk(this), mk(other)], N)
            ov = clock_overhead()
            a = np.median([d["x"] for d in ra[50:]]) - ov; o = np.median([d["x"] for d in rb[50:]]) - ov
            print(f"B{b} caching {'on ' if caching else 'off'} {'tables' if tables else 'delta '}  this {a/1e3:6.2f} us  other {o/1e3:6.2f} us  this/other {a/o:.2f}")
