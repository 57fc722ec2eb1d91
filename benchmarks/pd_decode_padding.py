"""What a long sequence in a decode batch costs the reference engine's paged attention (docs/pd-split.md).

``plan_paged_attention`` attends a step's decode tokens as one group whose keys are gathered up to the group's
longest context (``M`` blocks for every sequence of the group, masked past each one's own context), so one long
sequence makes every sequence of its batch pay for its context. This times one decode step's attention (plan
plus 30 layers, SmolLM2-135M's shapes: 9 query heads, 3 KV heads of 64, blocks of 16 tokens, float32) for the
batches of the P/D side by side (``benchmarks/pd_side_by_side.py``): colocated replica A holds 2 streams beside
the long prompt's sequence, the split's decode replica 4; each with and without that sequence. Attention only:
the projections and MLP of the step are not included. Median of ``--repeats``, the cases interleaved, after one warm-up; one thread.

    bash /work/notes/bench.sh env PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 taskset -c 1 \\
        .venv/bin/python benchmarks/pd_decode_padding.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.engine.model import build_attention_metadata
from pagedkv.engine.paged_attention import (ATTENTION_MODES, AttentionWorkspace, paged_attention, plan_paged_attention,
                                            set_attention_mode)

BS, N_KV, N_HEAD, D, LAYERS = 16, 3, 9, 64, 30


def prepare(contexts: list[int], kv: torch.Tensor):
    """A callable running one decode step's attention over ``contexts`` (tokens after the step); returns seconds."""
    tables, slots, nxt = [], [], 0
    for c in contexts:
        nb = -(-c // BS)
        table = list(range(nxt, nxt + nb))
        nxt += nb
        tables.append(table)
        slots.append(table[(c - 1) // BS] * BS + (c - 1) % BS)
    meta = build_attention_metadata([[1]] * len(contexts), [c - 1 for c in contexts], slots, tables, block_size=BS)
    ws = AttentionWorkspace()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(contexts), N_HEAD, D, generator=g)
    k = torch.randn(len(contexts), N_KV, D, generator=g)
    v = torch.randn(len(contexts), N_KV, D, generator=g)

    def run() -> float:
        t0 = time.perf_counter()
        plan = plan_paged_attention(meta, BS)
        for _ in range(LAYERS):
            paged_attention(q, k, v, kv, plan, scale=D ** -0.5, workspace=ws)
        return time.perf_counter() - t0

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", type=int, default=2049, help="the long sequence's context (a 2,048-token prompt + 1)")
    p.add_argument("--stream", type=int, default=480, help="each stream's context")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--mode", default="padded", choices=ATTENTION_MODES,
                   help="attention mode (padded: the path measured in docs/pd-split.md; ragged: issue 36's default)")
    a = p.parse_args(argv)
    set_attention_mode(a.mode)
    torch.set_num_threads(1)
    blocks = 6 * -(-max(a.long, a.stream) // BS) + 8
    kv = torch.randn(2, blocks, BS, N_KV, D, generator=torch.Generator().manual_seed(1))
    cases = (("colocated replica A: 2 streams + the long sequence", [a.stream] * 2 + [a.long]),
             ("split decode replica: 4 streams + the long sequence", [a.stream] * 4 + [a.long]),
             ("colocated replica A: 2 streams alone", [a.stream] * 2),
             ("split decode replica: 4 streams alone", [a.stream] * 4))
    runs = {name: prepare(ctx, kv) for name, ctx in cases}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(a.repeats):  # interleaved, so that load changes hit every case alike
        for name, run in runs.items():
            times[name].append(run())
    res = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, ms in res.items():
        print(f"{name:55s} {ms:7.1f} ms")
    names = [n for n, _ in cases]
    print(f"with the long sequence, decode replica / replica A: {res[names[1]] / res[names[0]]:.2f}x; "
          f"without it: {res[names[3]] / res[names[2]]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
