"""The one-API change (docs/design.md, "One API for one group or many") against another checkout, in one process,
alternating call for call (benchmarks/ab_inproc.py's method and cases)::

    git archive <base> src | tar -x -C /tmp/base
    PYTHONPATH=src .venv/bin/python benchmarks/oneapi_ab.py /tmp/base/src

Part 1, this tree / the other (ratio 1.00 = unchanged): BlockManager's decode_step at batch 1 to 1000, prefix
caching off and on (the small-batch path, the one-token fast path), ``block_tables=False`` at batch 64,
``allocate``, ``can_append_slots`` and ``block_table`` (they gained an argument each), and the hybrid step at
batch 1 and 64.

Part 2, this tree only: the batch form of the lookahead slots against the per-sequence calls it replaces
(``lookahead_slots(ids, k)`` vs B x G ``slot_mapping(seq, n, n + k, g)``), and reading a result's grouped names
(``res.group_slot_mapping``) against its plain ones.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from ab_inproc import ab, alloc_case, hybrid_case, load, step_case  # noqa: E402

import pagedkv as this  # noqa: E402


def delta_case(pk, batch: int, rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    bm = pk.BlockManager(batch * 40 + 64, 16, enable_prefix_caching=True)
    ids = list(range(batch))
    for i in ids:
        bm.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
    toks = rng.integers(0, 32000, (rounds, batch))
    it = iter(range(rounds))

    def one():
        s = next(it)
        t = time.perf_counter()
        bm.decode_step(ids, toks[s], block_tables=False)
        return time.perf_counter() - t
    return one


def _filled(pk, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    bm = pk.BlockManager(batch * 40 + 64, 16, enable_prefix_caching=True)
    ids = list(range(batch))
    for i in ids:
        bm.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist(), 4)
    return bm, ids


def can_append_case(pk, batch: int, rounds: int):
    bm, ids = _filled(pk, batch)

    def one():
        t = time.perf_counter()
        bm.can_append_slots(ids, 2, num_new_tokens=3)
        return time.perf_counter() - t
    return one


def block_table_case(pk, rounds: int):
    bm, ids = _filled(pk, 8)

    def one():
        t = time.perf_counter()
        bm.block_table(3)
        return time.perf_counter() - t
    return one


def timeit(fn, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def part2() -> None:
    k = 4
    for groups in (None, [this.FullAttentionSpec()] + [this.SlidingWindowSpec(64)] * 5):
        for batch in (1, 16, 64, 256):
            rng = np.random.default_rng(0)
            if groups is None:
                m = this.BlockManager(batch * 40 + 64, 16)
            else:
                m = this.HybridBlockManager(batch * 6 * 24 + 256, 16, kv_cache_groups=groups)
            ids = list(range(batch))
            for i in ids:
                m.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
            m.decode_step(ids, np.zeros(batch, np.int64), k)
            G = m.config.num_groups
            batch_form = lambda: m.lookahead_slots(ids, k)  # noqa: E731
            per_seq = lambda: [m.slot_mapping(s, n, n + k, g) for g in range(G)  # noqa: E731
                               for s, n in zip(ids, [m.num_tokens(s) for s in ids])]
            assert (batch_form() == np.concatenate(per_seq()).reshape(G, -1)).all()
            a, b = timeit(batch_form, 300), timeit(per_seq, 100)
            print(f"lookahead slots G{G} B{batch:<4d} lookahead_slots {a:8.2f} us   B x G slot_mapping {b:9.2f} us"
                  f"   {b / a:6.1f}x")
    bm, ids = _filled(this, 64)
    res = bm.decode_step(ids, np.zeros(64, np.int64))
    print(f"reading res.slot_mapping {timeit(lambda: res.slot_mapping, 2000) * 1000:6.0f} ns   "
          f"res.group_slot_mapping {timeit(lambda: res.group_slot_mapping, 2000) * 1000:6.0f} ns   "
          f"res.group_block_tables {timeit(lambda: res.group_block_tables, 2000) * 1000:6.0f} ns")


if __name__ == "__main__":
    other = load(sys.argv[1])
    rows = [("allocate", ab(lambda pk, r: alloc_case(pk, r), 400, other))]
    for batch in (1, 4, 16, 64, 1000):
        for caching in (False, True):
            n = 300 if batch < 1000 else 150
            rows.append((f"decode_step B{batch}/{'on' if caching else 'off'}",
                         ab(lambda pk, r: step_case(pk, batch, caching, r), n, other)))
    rows.append(("decode_step delta B64", ab(lambda pk, r: delta_case(pk, 64, r), 300, other)))
    rows.append(("can_append_slots B64", ab(lambda pk, r: can_append_case(pk, 64, r), 400, other)))
    rows.append(("block_table", ab(lambda pk, r: block_table_case(pk, r), 2000, other)))
    for batch in (1, 64):
        rows.append((f"hybrid step B{batch}/on", ab(lambda pk, r: hybrid_case(pk, batch, True, r), 300, other)))
    for name, (t, o) in rows:
        print(f"{name:24s} this {t:8.2f} us   other {o:8.2f} us   this/other {t / o:5.2f}")
    part2()
