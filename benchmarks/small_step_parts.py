"""Where pagedkv's small decode step spends its time, beside nano-vllm's block-manager calls alone: CPU time per
thread, every variant alternating call by call in one process (``pagedkv.bench.fair``), token lists::

    PYTHONPATH=src .venv-anchor-nano/bin/python benchmarks/small_step_parts.py [--batch 1 2 4 8 16 32 64]

Per batch size B (caching off and on, 200-token prompts, block size 16) the median us per step of:

- ``decode_step`` with ``block_tables=False`` (pagedkv's engine mode) and with the padded tables;
- ``bookkeeping``: ``append_slots(seq, [tok])`` for each sequence, the same bookkeeping as the step (blocks taken,
  tokens recorded, full blocks hashed and registered) returning only copy-on-write pairs: no slot mapping, lengths
  or tables, i.e. what nano-vllm's ``may_append`` does;
- nano-vllm's ``may_append`` per sequence (its scheduler's calls alone) and its runner's table building.

The difference between ``decode_step`` and ``bookkeeping`` is what building the step's numpy results costs.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pagedkv
from pagedkv.bench.anchors import load_anchor
from pagedkv.bench.fair import alternate, clock_overhead, engine_gc, net
from pagedkv.bench.runner_tables import ListTables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    Nano = load_anchor("nanovllm")
    clock = time.thread_time_ns
    print("| caching | batch | decode_step delta | decode_step tables | bookkeeping (append_slots) | nano calls | "
          "nano tables | delta / nano calls | bookkeeping / nano calls |")
    print("|---" * 9 + "|")
    for caching in (False, True):
        for b in a.batch:
            rng = np.random.default_rng(b)
            prompts = [rng.integers(0, 32000, 200).tolist() for _ in range(b)]
            toks = rng.integers(0, 32000, (a.steps, b)).tolist()
            pool = b * (-(-(200 + a.steps + 1) // 16)) + 16
            pk = {k: pagedkv.BlockManager(pool, 16, enable_prefix_caching=caching) for k in ("delta", "tables", "book")}
            nano = Nano(pool, 16)
            ids = list(range(b))
            with engine_gc():
                for m in (*pk.values(), nano):
                    for i, p in enumerate(prompts):
                        m.allocate(i, p)

                def stepper(k):
                    f, tables = pk[k].decode_step, k == "tables"

                    def s(i):
                        t = toks[i]
                        t0 = clock()
                        f(ids, t, block_tables=tables)
                        return {"x": clock() - t0}
                    return s

                book = pk["book"].append_slots

                def book_s(i):
                    t = [[x] for x in toks[i]]
                    t0 = clock()
                    for s, x in zip(ids, t):
                        book(s, x)
                    return {"x": clock() - t0}

                build = ListTables(16).build

                def nano_s(i):
                    nano.prepare_step(ids, toks[i])
                    t0 = clock()
                    out = nano.decode_step(ids)
                    t1 = clock()
                    build(out.block_tables, [len(q) for q in nano._batch])
                    return {"x": t1 - t0, "tables": clock() - t1}

                res = alternate([stepper("delta"), stepper("tables"), book_s, nano_s], a.steps)
            ov = clock_overhead()
            med = [float(np.median([net(d, ov)["x"] for d in r[50:]])) / 1e3 for r in res]
            tab = float(np.median([net(d, ov)["tables"] for d in res[3][50:]])) / 1e3
            print(f"| {'on' if caching else 'off'} | {b} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:.2f} | "
                  f"{tab:.2f} | {med[0] / med[3]:.2f} | {med[2] / med[3]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
