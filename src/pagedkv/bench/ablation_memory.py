"""The memory side of the decode-step ablation (:mod:`pagedkv.bench.ablation`): bookkeeping bytes per block of
each design (tracemalloc) and what its objects cost the cyclic garbage collector."""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from typing import Callable

import numpy as np

from .ablation_pyloop import PyBlock
from .ablation_variants import VARIANTS

__all__ = ["measure_memory"]


def _traced(build: Callable[[], object]) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        obj = build()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used, obj


def _gc_ms(repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        gc.collect()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def _gc_cost(build: Callable[[], object]) -> tuple[int, float]:
    """(GC-tracked objects the built structure adds, extra ms a full gc.collect() takes while it is alive)."""
    gc.collect()
    before = len(gc.get_objects())
    obj = build()
    tracked = len(gc.get_objects()) - before
    with_obj = _gc_ms()
    del obj
    return tracked, with_obj - _gc_ms()


def measure_memory(num_blocks: int = 100_000) -> dict:
    """Bookkeeping bytes per block (tracemalloc) of each design, for a fresh pool of ``num_blocks`` blocks:

    - ``refcounts``: the refcount store alone (numpy int32 array / list of ints / dict id -> count with its
      key objects / the block objects with their id ints and the list holding them);
    - ``pool``: a whole fresh manager of the variant (refcounts + free list + block objects + empty tables);
    - ``gc_tracked_per_block`` and ``gc_ms``: GC-tracked objects the manager adds per block, and how much longer
      a full ``gc.collect()`` takes while it is alive (per-block ``__slots__`` objects are tracked containers
      the collector traverses; a list or deque of ints is one tracked object, though its items are still
      visited, a dict holding only ints is untracked, a numpy array is untracked). The time is a difference
      of two medians, only indicative on a noisy machine, and can be slightly negative when there is nothing.
    """
    n = num_blocks
    refcount_builders = {
        "pagedkv": lambda: np.zeros(n, dtype=np.int32),
        "py-list": lambda: [0] * n,
        "py-dict": lambda: {b: 0 for b in range(n)},
        "py-objects": lambda: [PyBlock(b) for b in range(n)],
    }
    rows = []
    for name, build in refcount_builders.items():
        ref_bytes, obj = _traced(build)
        del obj
        pool_bytes, mgr = _traced(lambda: VARIANTS[name](n, 16))
        del mgr
        tracked, gc_ms = _gc_cost(lambda: VARIANTS[name](n, 16))
        rows.append(
            {"design": name, "refcounts_bytes_per_block": ref_bytes / n, "pool_bytes_per_block": pool_bytes / n,
             "gc_tracked_per_block": tracked / n, "gc_ms": gc_ms}
        )
    return {"num_blocks": n, "rows": rows}

