"""External KV (docs/external-kv.md) must not slow the calls that do not use it: an in-process A/B against
another checkout (benchmarks/ab_inproc.py's method: both trees loaded side by side, alternating call for call)::

    git archive <base> src | tar -x -C /tmp/base
    PYTHONPATH=src .venv/bin/python benchmarks/extkv_ab.py /tmp/base/src

Prints, per case, the median microseconds of each tree and the ratio this / other (1.00 = unchanged). Cases:
``allocate`` (prefix caching on, half the prompt a hit), ``free`` (each sequence allocated untimed),
``decode_step`` at batch 1, 16 and 256 with prefix caching off and on, ``take_copy_plan`` (an empty step),
``block_table``, and HybridBlockManager's decode_step at batch 16 and allocate with a 4096-token hit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from ab_inproc import ab, alloc_case, hybrid_alloc_case, hybrid_case, load, step_case  # noqa: E402


def free_case(pk, rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    bm = pk.BlockManager(rounds * 24 + 64, 16, enable_prefix_caching=True)
    for i in range(rounds):
        bm.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
    it = iter(range(rounds))

    def one():
        i = next(it)
        t = time.perf_counter()
        bm.free(i)
        return time.perf_counter() - t
    return one


def plan_case(pk, rounds: int, seed: int = 0):
    bm = pk.BlockManager(1024, 16, enable_prefix_caching=True)
    for i in range(16):
        bm.allocate(i, list(range(i * 1000, i * 1000 + 200)))

    def one():
        t = time.perf_counter()
        bm.take_copy_plan()
        return time.perf_counter() - t
    return one


def table_case(pk, rounds: int, seed: int = 0):
    bm = pk.BlockManager(1024, 16, enable_prefix_caching=True)
    bm.allocate("a", list(range(300)))

    def one():
        t = time.perf_counter()
        bm.block_table("a")
        return time.perf_counter() - t
    return one


if __name__ == "__main__":
    other = load(sys.argv[1])
    rows = [("allocate", ab(lambda pk, r: alloc_case(pk, r), 600, other)),
            ("free", ab(lambda pk, r: free_case(pk, r), 600, other)),
            ("take_copy_plan", ab(plan_case, 2000, other)),
            ("block_table", ab(table_case, 2000, other))]
    for batch in (1, 16, 256):
        for caching in (False, True):
            rows.append((f"decode_step B{batch}/{'on' if caching else 'off'}",
                         ab(lambda pk, r: step_case(pk, batch, caching, r), 300, other)))
    rows.append(("hybrid step B16/on", ab(lambda pk, r: hybrid_case(pk, 16, True, r), 300, other)))
    rows.append(("hybrid allocate hit 4096", ab(lambda pk, r: hybrid_alloc_case(pk, 4096, r), 200, other)))
    for name, (t, o) in rows:
        print(f"{name:24s} this {t:8.2f} us   other {o:8.2f} us   this/other {t / o:5.2f}")
