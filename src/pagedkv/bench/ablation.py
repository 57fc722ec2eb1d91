"""Ablation of the decode hot path: what do flat refcount arrays, int block ids and internal access buy?

The question (from a discussion of vLLM's block allocator): is a flat list of reference counts indexed by block
id better than a dict, are int block ids better than per-block objects, and does reading state through public
read-only accessors on the hot path cost anything measurable? This module answers it with data: the same decode
workload run through small block managers that differ in exactly one of those choices.

Every variant implements the same per-step semantics as :meth:`pagedkv.BlockManager.decode_step` with one new
token per sequence and no prefix caching, sliding window or lookahead:

- the token goes to position ``num_tokens`` of each sequence; its slot is ``block * block_size + offset``;
- a sequence whose blocks are all full takes a new block from a FIFO free list (oldest free block first);
- a sequence writing into a block it shares (refcount > 1) first copies it (copy-on-write): the destination
  comes from the free list, the source loses one reference; when every holder of a shared block writes it in
  the same step the last writer in batch order keeps the original (pagedkv's batch semantics, which a
  sequential loop gets for free);
- copy-on-write destinations are taken before new blocks, each group in batch order (so block ids match pagedkv
  exactly);
- all or nothing: a step that needs more blocks than are free raises OutOfBlocksError and changes nothing;
- ``free`` drops one reference per block, tail first; blocks reaching zero join the tail of the free list.

The variants (each a small class with ``allocate``, ``fork``, ``free`` and ``step``):

``pagedkv``
    The real :class:`~pagedkv.BlockManager` (vectorised numpy over the whole batch). The baseline.
``pagedkv-accessors``
    pagedkv's step, but the engine-facing output is built through the public read-only API, per sequence:
    ``block_table(seq_id)`` (a read-only copy) and ``num_tokens(seq_id)``, padded into the batch matrix, where
    the real step does one fancy index into its internal table matrix. The bookkeeping itself (refcounts, free
    ring, copy-on-write) cannot be done through read-only accessors at all in a vectorised design: there is no
    per-block public read it could use that would not turn the batch operation back into a Python loop, which
    is what the ``py-*`` variants measure. So this is the closest honest equivalent for the vectorised side:
    "a clean public API on the hot path" means per-sequence public reads, and this variant pays for them.
``py-list``
    A straightforward pure-Python loop over the batch: refcounts in a flat Python list indexed by block id, int
    block ids, a deque as the free list, per-sequence state in a ``__slots__`` object read by attribute. This
    isolates "vectorised batch vs Python loop".
``py-dict``
    ``py-list`` with the refcounts in a dict keyed by block id (pre-filled for every block, like vLLM's
    ``RefCounter``). Same statements, only the container differs.
``py-objects``
    ``py-list`` with one ``__slots__`` object per block (``id``, ``refcount``): the free list and the tables hold
    the objects, the refcount is an attribute, slots are computed from ``block.id``. The engine needs int ids,
    so the step's block tables are built as ``[b.id for b in table]``.
``py-accessors``
    ``py-list`` whose hot loop reads state through public read-only accessors, as a clean public API would
    expose them: ``pool.refcount(block)``, ``pool.num_free``, properties ``seq.num_tokens`` and
    ``seq.last_block``, and ``seq.block_table`` returning an immutable tuple (the read-only view a caller may
    keep). Writes are the same statements as ``py-list``, so the difference is the cost of the reads alone.

Each step is timed in two modes:

``step``
    the full engine-facing result: slot mapping, batch block tables, sequence lengths, copy-on-write pairs
    (``decode_step``'s :class:`~pagedkv.StepResult`; the ``py-*`` variants return Python lists, the int-id ones
    handing out their live table lists without a copy, the cheapest a Python manager can do);
``append``
    the bookkeeping only: slot mapping and copy-on-write pairs, no tables (pagedkv's internal
    ``_append(..., tables=False)``, the path behind ``append_slots``). ``pagedkv-accessors`` is identical to
    ``pagedkv`` here and is not run.

Method notes. The workload is the seed decode workload: ``batch`` sequences with ``prompt_len``-token prompts,
then ``steps`` decode steps over the whole batch, pool sized so nothing runs out. Each timed call is wrapped in
``time.perf_counter_ns``; a repeat's figure is the median over its steps. One step in ``block_size`` is a "fill
step" where every sequence takes a new block (the free-list pop and refcount write); the median over those is
kept too. The mean over steps is in the JSON only: on a shared machine it is dominated by a few preempted steps
(scheduler ticks of several milliseconds), which the medians ignore. Repeats interleave the variants (ABCABC, with the starting
variant rotated), so slow drift of this shared machine hits all of them alike; the first ``warmup`` rounds are
dropped. The cyclic GC is collected before and disabled during each timed run, as ``timeit`` does (the GC cost
of per-block objects is measured separately with the memory figures). Every ``py-*`` variant has its own copy of
the hot loop on purpose: CPython 3.11 specialises bytecode per code object (``BINARY_SUBSCR_LIST_INT`` vs
``BINARY_SUBSCR_DICT``), and one loop shared by the list and dict variants would be respecialised back and
forth as the runs interleave. All ``py-*`` variants memoise the last batch's sequence lookup as pagedkv does,
so the loop itself is what differs.

Run ``python -m pagedkv.bench.ablation [--quick] [--repeats N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np

from pagedkv import NULL_BLOCK

from .ablation_memory import measure_memory
from .ablation_pyloop import PyAccessors, PyDict, PyList, PyObjects
from .ablation_report import format_table
from .ablation_variants import APPEND_SKIP, MODES, VARIANTS, PagedKV, PagedKVAccessors

__all__ = [
    "VARIANTS",
    "MODES",
    "PagedKV",
    "PagedKVAccessors",
    "PyList",
    "PyDict",
    "PyObjects",
    "PyAccessors",
    "normalize",
    "run_ablation",
    "measure_memory",
    "format_table",
    "main",
]

APPEND_SKIP = {"pagedkv-accessors"}  # identical to pagedkv in append mode

# (label, variant, reference, modes): the questions the ablation answers
QUESTIONS = (
    ("vectorised batch vs Python loop", "py-list", "pagedkv", MODES),
    ("dict vs list refcounts", "py-dict", "py-list", MODES),
    ("per-block objects vs int ids", "py-objects", "py-list", MODES),
    ("public accessors vs internal access (Python loop)", "py-accessors", "py-list", MODES),
    ("public accessors vs internal access (vectorised)", "pagedkv-accessors", "pagedkv", ("step",)),
)


def normalize(result) -> tuple:
    """A step result as plain tuples (slots, tables or None, seq_lens or None, cow pairs), for comparing variants:
    padded numpy tables lose their NULL_BLOCK padding, block objects were already turned into ids."""
    slots, tables, lens, cow = result
    slots = tuple(int(x) for x in slots)
    cow = tuple((int(s), int(d)) for s, d in cow)
    if tables is None:
        return slots, None, None, cow
    if isinstance(tables, np.ndarray):
        rows = tuple(tuple(int(b) for b in row if b != NULL_BLOCK) for row in tables)
    else:
        rows = tuple(tuple(int(b) for b in t) for t in tables)
    return slots, rows, tuple(int(x) for x in lens), cow



# ---------------------------------------------------------------------------------------------- timing
def _timed_run(cls: type, tables: bool, batch: int, steps: int, prompt_len: int, block_size: int) -> list[int]:
    """One run of the seed workload; nanoseconds of each decode step."""
    num_blocks = batch * -(-(prompt_len + steps) // block_size) + 64
    mgr = cls(num_blocks, block_size)
    prompt = np.ones(prompt_len, dtype=np.int32)
    for i in range(batch):
        mgr.allocate(i, prompt)
    ids = list(range(batch))
    toks = np.full(batch, 7, dtype=np.int32)
    step = mgr.step
    clock = time.perf_counter_ns
    times = []
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            t0 = clock()
            step(ids, toks, tables)
            times.append(clock() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return times


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ratio(a: list[float], b: list[float]) -> dict:
    """Ratio of medians of a to b, with bounds min(a)/max(b) .. max(a)/min(b) (the ranges overlap iff the
    bounds contain 1), and the paired per-repeat ratios (the rounds are interleaved)."""
    paired = [x / y for x, y in zip(a, b)]
    lo, hi = min(a) / max(b), max(a) / min(b)
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "lo": lo,
        "hi": hi,
        "paired": _spread(paired),
        "outside_noise": lo > 1.0 or hi < 1.0,
    }


def _pct(r: float) -> str:
    return f"{(r - 1) * 100:+.1f}%"


def _verdict_text(label: str, a: str, b: str, cmp: dict) -> str:
    r, lo, hi = cmp["ratio"], cmp["lo"], cmp["hi"]
    if r >= 2:
        size = f"{r:.2f}x slower [{lo:.2f}x .. {hi:.2f}x]"
    elif r <= 0.5:
        size = f"{1 / r:.2f}x faster [{1 / hi:.2f}x .. {1 / lo:.2f}x]"
    else:
        size = f"{_pct(r)} time [{_pct(lo)} .. {_pct(hi)}]"
    noise = "outside noise" if cmp["outside_noise"] else "inside noise"
    return f"{label}: {a} vs {b} {size}, {noise}"


def run_ablation(
    repeats: int = 5,
    warmup: int = 1,
    batch: int = 1000,
    steps: int = 256,
    prompt_len: int = 256,
    block_size: int = 16,
    quick: bool = False,
    memory_blocks: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Time every variant in both modes on the seed decode workload and answer the questions.

    ``quick`` shrinks the workload (64 sequences, 64-token prompts, 48 steps, 3 repeats, 10k-block memory
    probe) for a smoke run of a few seconds. Returns a JSON-serialisable dict: ``config``, ``results[mode]
    [variant]`` (per-repeat medians and means in microseconds, their min/median/max, ratios to pagedkv and
    py-list), ``verdicts[mode]`` and ``memory`` (see :func:`measure_memory`).
    """
    if quick:
        repeats, warmup, batch, steps, prompt_len = min(repeats, 3), min(warmup, 1), 64, 48, 64
    if memory_blocks is None:
        memory_blocks = 10_000 if quick else 100_000
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    units = [(m, v) for m in MODES for v in VARIANTS if not (m == "append" and v in APPEND_SKIP)]
    med: dict = {u: [] for u in units}
    mean: dict = {u: [] for u in units}
    fill: dict = {u: [] for u in units}
    fill_steps = [i for i in range(steps) if (prompt_len + i) % block_size == 0]  # every sequence takes a block
    t_start = time.perf_counter()
    for r in range(warmup + repeats):
        k = r % len(units)
        for mode, name in units[k:] + units[:k]:  # interleaved, start rotated each round
            ns = _timed_run(VARIANTS[name], mode == "step", batch, steps, prompt_len, block_size)
            if r >= warmup:
                med[(mode, name)].append(statistics.median(ns) / 1e3)
                mean[(mode, name)].append(statistics.fmean(ns) / 1e3)
                if fill_steps:
                    fill[(mode, name)].append(statistics.median(ns[i] for i in fill_steps) / 1e3)
        if progress:
            kind = "warmup" if r < warmup else "repeat"
            progress(f"{kind} {r + 1 - (warmup if r >= warmup else 0)} done ({time.perf_counter() - t_start:.0f} s)")
    results: dict = {m: {} for m in MODES}
    for mode, name in units:
        results[mode][name] = {
            "median_us": med[(mode, name)],
            "mean_us": mean[(mode, name)],
            **_spread(med[(mode, name)]),
            "mean": _spread(mean[(mode, name)]),
            "fill_median_us": fill[(mode, name)],
            "fill": _spread(fill[(mode, name)]) if fill_steps else None,
        }
    for mode in MODES:
        for name, row in results[mode].items():
            for ref in ("pagedkv", "py-list"):
                row[f"vs_{ref}"] = _ratio(row["median_us"], results[mode][ref]["median_us"])
    verdicts: dict = {m: [] for m in MODES}
    for label, a, b, modes in QUESTIONS:
        for mode in modes:
            cmp = _ratio(results[mode][a]["median_us"], results[mode][b]["median_us"])
            delta = statistics.median(results[mode][a]["median_us"]) - statistics.median(results[mode][b]["median_us"])
            verdicts[mode].append(
                {"question": label, "variant": a, "reference": b, **cmp, "delta_us": delta,
                 "text": _verdict_text(label, a, b, cmp)}
            )
    return {
        "config": {
            "repeats": repeats, "warmup": warmup, "batch": batch, "steps": steps, "prompt_len": prompt_len,
            "block_size": block_size, "quick": quick,
            "num_blocks": batch * -(-(prompt_len + steps) // block_size) + 64,
        },
        "environment": {
            "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "results": results,
        "verdicts": verdicts,
        "memory": measure_memory(memory_blocks),
        "elapsed_s": time.perf_counter() - t_start,
    }



def main(argv: Sequence[str] | None = None) -> int:
    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv bench ablation", description=plain(__doc__.split("\n\n")[0]),
                                formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="small workload, a few seconds (smoke test)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved measured repeats")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--batch", type=int, default=1000, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=256, help="decode steps per run")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--json", metavar="PATH", help="also write the full result as JSON")
    a = p.parse_args(argv)
    result = run_ablation(
        repeats=a.repeats, warmup=a.warmup, batch=a.batch, steps=a.steps, prompt_len=a.prompt_len,
        block_size=a.block_size, quick=a.quick, progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
