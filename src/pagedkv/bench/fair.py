"""How the side-by-side benchmarks time one implementation against another (``hybrid``, ``sweep``).

Three rules, each against a way a comparison on a shared machine goes wrong:

* **CPU time of the calling thread** (:data:`CLOCK`, ``time.thread_time_ns``): a call that waits for a core
  while another process runs is not charged the wait. Reading this clock is a system call (a few hundred ns
  here, measured by :func:`clock_overhead` in every run and subtracted from each timed part), so figures of a
  microsecond or two carry the subtraction's error; ratios compare two figures that both carry it.
* **Call by call alternation** (:func:`alternate`): call i of every implementation runs before call i + 1 of
  any, the first of each round rotating, so a burst of load on the machine falls on both sides alike instead of
  on one side's whole series.
* **The garbage collector in the state an engine runs it** (:func:`engine_gc`): vLLM's ``EngineCore`` calls
  ``gc.freeze()`` once start-up is over (``vllm/v1/engine/core.py``, ``freeze_gc_heap``), so the objects made at
  start-up (V1's ``KVCacheBlock`` per block) are never scanned again. The benchmarks build every manager, then
  freeze, then admit and time; requests made afterwards stay collectable, as in the engine. The freeze is
  process wide, so it applies to every implementation of the run.

What each implementation is charged with (the engine's own CPU work per step, nothing else) is stated where
its step is built (:mod:`pagedkv.bench.hybrid`, :mod:`pagedkv.bench.sweep`).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

__all__ = ["CLOCK", "alternate", "clock_overhead", "engine_gc", "net"]

CLOCK: Callable[[], int] = time.thread_time_ns


def clock_overhead(clock: Callable[[], int] = CLOCK, n: int = 2001) -> int:
    """Median ns between two back-to-back reads of ``clock`` (what one timed part carries on top of its work)."""
    d = np.empty(n, dtype=np.int64)
    for i in range(n):
        t0 = clock()
        d[i] = clock() - t0
    return int(np.median(d))


def net(parts: Mapping[str, int], overhead: int) -> dict[str, int]:
    """Each part less one clock read (never below 0)."""
    return {k: max(0, v - overhead) for k, v in parts.items()}


def alternate(contenders: Sequence[Callable[[int], Mapping[str, int]]], n: int) -> list[list[Mapping[str, int]]]:
    """Call ``contenders[c](i)`` for i in 0..n-1, call i of every contender before call i + 1 of any, the first
    of round i being contender ``i % len(contenders)``. Each call returns its timed parts (ns by name); the
    result holds them per contender, in call order. O(n x contenders) calls."""
    k = len(contenders)
    out: list[list[Mapping[str, int]]] = [[] for _ in range(k)]
    for i in range(n):
        for j in range(k):
            c = (i + j) % k
            out[c].append(contenders[c](i))
    return out


@contextmanager
def engine_gc() -> Iterator[None]:
    """``gc.collect()`` then ``gc.freeze()`` (the start-up heap frozen, as vLLM's engine core does); on exit
    ``gc.unfreeze()`` and a collection, so the next run starts from the same state."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def pagedkv_step(decode: Callable, seq_ids: list, toks: Sequence, tables: bool,
                 clock: Callable[[], int] = CLOCK) -> Callable[[int], dict]:
    """The timed step of pagedkv: one ``decode_step(seq_ids, toks[i], block_tables=tables)`` call, part
    ``calls``."""

    def step(i: int) -> dict:
        tokens = toks[i]
        t0 = clock()
        decode(seq_ids, tokens, block_tables=tables)
        return {"calls": clock() - t0}

    return step


def v1_step(bm, rows, seq_ids: list, toks: Sequence, clock: Callable[[], int] = CLOCK) -> Callable[[int], dict]:
    """The timed step of vLLM V1 (adapter ``bm``, runner rows ``rows``: a V1BlockRows): the request update with
    its hashing (``request``), the KV-manager calls (``calls``) and the new block ids appended to the CPU rows
    (``runner``); the adapter's staging of the step's tokens is not timed. ``step.rows`` is ``rows`` (tests)."""
    stage, update, decode, append = bm.stage, bm.update_requests, bm.decode_step, rows.append

    def step(i: int) -> dict:
        stage(seq_ids, toks[i])
        t0 = clock()
        update()
        t1 = clock()
        out = decode(seq_ids)
        t2 = clock()
        append(out.block_tables)
        t3 = clock()
        return {"request": t1 - t0, "calls": t2 - t1, "runner": t3 - t2}

    step.rows = rows  # type: ignore[attr-defined]
    return step
