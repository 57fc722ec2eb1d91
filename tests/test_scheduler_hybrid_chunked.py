"""The scheduler drives a HybridBlockManager (KV cache groups: full attention and sliding windows) with chunked
prefill. A content model stands for the engine: every computed position writes, in each group g, the value
``identity(context) * G + g`` at its slot of that group, after the step's copies; then every position each query
attends to (all earlier ones for a full group, the window ``(q - W, q]`` for a sliding one) must read back its own
identity through that group's block table. Prefix hits, chunks split mid-block and on block edges, sliding
windows releasing blocks between chunks, forks (n = 2) and preemption in the middle of prefills are all covered;
the outputs must equal those of the same deterministic "model" without paging."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
from pagedkv.scheduler import Scheduler
from toy_engine import run_copies

BS = 4
GROUPS = [FullAttentionSpec(), SlidingWindowSpec(5), SlidingWindowSpec(8)]
G = len(GROUPS)


def _next(ctx) -> int:
    """The deterministic "model": the next token of a context."""
    return (7 * sum(ctx) + 3 * len(ctx) + ctx[-1]) % 16


class _Store:
    """One value per slot (the shape copy_blocks expects: (1, slots, 1, 1)); NaN where nothing was written."""

    def __init__(self, num_blocks: int) -> None:
        self.block_size = BS
        self.k = np.full((1, max(num_blocks, 1) * BS, 1, 1), np.nan)
        self.v = self.k.copy()

    def blocks(self, which):
        return which.reshape(which.shape[0], -1, BS, *which.shape[2:])


def _requests(seed: int) -> list:
    rng = random.Random(seed)
    stem = [rng.randrange(16) for _ in range(23)]
    return [
        (stem, 1, 6),
        ([rng.randrange(16) for _ in range(5)], 1, 9),
        (stem, 1, 5),  # identical: hits the blocks the first one's chunks fill
        (stem[:13] + [rng.randrange(16) for _ in range(9)], 2, 4),  # a shared prefix, two samples
        ([rng.randrange(16) for _ in range(31)], 1, 3),
        (stem[:8], 1, 4),  # ends on a block boundary
    ]


def _reference(reqs: list) -> dict:
    out = {}
    for i, (p, n, m) in enumerate(reqs):
        samples = []
        for j in range(n):
            toks = list(p) + [(_next(p) + j) % 16]
            while len(toks) - len(p) < m:
                toks.append(_next(toks))
            samples.append(tuple(toks[len(p):]))
        out[i] = tuple(samples)
    return out


def _run(sched, bm, reqs, gpu, cpu, seen, ids, base=0) -> dict:
    """Run ``reqs`` to the end; ``ids``: context -> identity, kept across runs on the same stores."""

    def ident(ctx) -> float:
        return float(ids.setdefault(tuple(ctx), len(ids)) * G)

    for i, (p, n, m) in enumerate(reqs):
        sched.add_request(base + i, p, n=n, max_tokens=m, ignore_eos=True)
    out, steps = {}, 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000, "no progress"
        plan = sched.schedule()
        run_copies(gpu, cpu, plan.copies)
        segs = [(pw.seq_id, pw.positions, pw.slot_mapping, pw.block_table) for pw in plan.prefills]
        d = plan.decode
        if d is not None:
            ends = np.concatenate(([0], np.cumsum(d.query_lens)))
            for i, sid in enumerate(d.seq_ids.tolist()):
                a, z = ends[i], ends[i + 1]
                segs.append((sid, d.positions[a:z], d.result.slot_mapping[:, a:z],
                             tuple(t[i] for t in d.result.block_tables)))
        ctxs = []
        for sid, pos, slots, tables in segs:  # the forward's writes, every group
            view = sched.sequence(sid)
            ctx = (list(reqs[view.request_id - base][0]) + list(view.output))[: int(pos[-1]) + 1]
            ctxs.append(ctx)
            assert np.asarray(slots).shape == (G, len(pos)) and len(tables) == G
            for g in range(G):
                gpu.k[0, np.asarray(slots[g]), 0, 0] = [ident(ctx[: q + 1]) + g for q in pos.tolist()]
        for (sid, pos, slots, tables), ctx in zip(segs, ctxs):  # the forward's reads, every group
            for g, spec in enumerate(GROUPS):
                t = np.asarray(tables[g])
                for q in pos.tolist():
                    lo = 0 if spec.window is None else max(0, q - spec.window + 1)
                    for p in range(lo, q + 1):
                        b = int(t[p // BS])
                        assert b >= 0, f"seq {sid} group {g}: position {p} (query {q}) has no block"
                        assert gpu.k[0, b * BS + p % BS, 0, 0] == ident(ctx[: p + 1]) + g, (sid, g, p, q)
        sampled = []
        for pw, ctx in zip(plan.prefills, ctxs):
            seen["chunks"] += 1
            seen["mid_block"] += pw.num_samples == 0 and pw.seq_len % BS != 0
            seen["hits"] += pw.num_cached_tokens > 0 and pw.num_cached_tokens == pw.positions[0]
            if pw.num_samples == 0:
                sampled.append(None)
            elif pw.num_samples == 1:
                sampled.append(_next(ctx))
            else:
                sampled.append([(_next(ctx) + j) % 16 for j in range(pw.num_samples)])
        sampled += [_next(ctx) for ctx in ctxs[len(plan.prefills):]]
        seen["preempted"] += len(plan.preempted)
        for r in sched.update(plan, sampled):
            out[r.request_id - base] = r.outputs
        bm.check_invariants()
    return out


REQS = _requests(0)
REF = _reference(REQS)


@pytest.mark.parametrize("budget,blocks,mode", [
    (5, 300, "recompute"),  # chunks end mid-block
    (8, 300, "recompute"),  # and on block edges
    (9, 40, "recompute"),  # a small pool: preemption in the middle of prefills
    (9, 40, "swap"),
])
def test_scheduler_drives_a_hybrid_manager_with_chunked_prefill(budget, blocks, mode):
    bm = BlockManager(blocks, BS, kv_cache_groups=GROUPS, num_cpu_blocks=120, enable_prefix_caching=True,
                            watermark=0.0, grouped_results=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget, preemption_mode=mode,
                      enable_chunked_prefill=True)
    gpu, cpu = _Store(blocks), _Store(120)
    seen = {"chunks": 0, "mid_block": 0, "hits": 0, "preempted": 0}
    ids: dict = {}
    assert _run(sched, bm, REQS, gpu, cpu, seen, ids) == REF
    assert _run(sched, bm, REQS, gpu, cpu, seen, ids, base=100) == REF  # again: hits on what the chunks cached
    assert sched.stats.prefill_chunks > sched.stats.prefills and seen["hits"] > 0
    if blocks < 100:
        assert seen["preempted"] > 0, seen
    elif budget % BS:
        assert seen["mid_block"] > 0
    assert len(bm) == 0
