"""The cost of a prompt's form: ``HybridBlockManager.allocate`` of a conversation's second turn (a hybrid prefix hit,
Gemma 3's six groups, window 512) with the prompt as a list of Python ints (what an engine's tokenizer gives)
against the same prompt as a ready int64 array, two managers in one process, CPU time per thread, alternating
admission by admission (``pagedkv.bench.fair``)::

    PYTHONPATH=src .venv/bin/python benchmarks/prompt_forms.py [--lengths 1024 4096 16384] [--requests 24]

Prints per first-turn length the median us of each form and the ratio lists / arrays.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pagedkv
from pagedkv.bench.fair import alternate, clock_overhead, engine_gc
from pagedkv.bench.hybrid import TURN, gemma3_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--requests", type=int, default=24)
    a = ap.parse_args()
    clock, n = time.thread_time_ns, a.requests
    for length in a.lengths:
        rng = np.random.default_rng(length)
        firsts = [rng.integers(0, 32000, length).tolist() for _ in range(n)]
        seconds = [f + rng.integers(0, 32000, TURN).tolist() for f in firsts]
        managers = [pagedkv.BlockManager(6 * (length // 16 + 20) * (n + 2), 16, kv_cache_groups=gemma3_groups(),
                                               enable_prefix_caching=True, grouped_results=True) for _ in range(2)]

        def admit(bm, as_array: bool):
            def one(i: int) -> dict:
                bm.allocate(i, firsts[i])
                bm.free(i)
                p = np.array(seconds[i], dtype=np.int64) if as_array else seconds[i]
                t0 = clock()
                bm.allocate(n + i, p)
                t = clock() - t0
                bm.free(n + i)
                return {"x": t}
            return one

        with engine_gc():
            res = alternate([admit(managers[0], False), admit(managers[1], True)], n)
        ov = clock_overhead()
        lists, arrays = (float(np.median([d["x"] for d in r])) - ov for r in res)
        print(f"first turn {length} tokens: lists {lists / 1e3:.1f} us, int64 arrays {arrays / 1e3:.1f} us, "
              f"lists / arrays {lists / arrays:.2f}", flush=True)


if __name__ == "__main__":
    main()
