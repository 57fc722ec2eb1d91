"""The scheduler driving a HybridBlockManager (KV cache groups): what the Gemma 3 engine runs on.

Each step's plan is checked against the manager group by group (a prefill's ``(G, T)`` slot mapping and its ``G``
tables, a decode's per-group step result), and every constrained run (small pools, recompute or swap preemption,
prefix caching, parallel samples) must reproduce the outputs of an unconstrained run on a one-table BlockManager
(the fake model of test_scheduler: the next token depends on sequence id, position and last token only).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import NULL_BLOCK, FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
from pagedkv.scheduler import Scheduler
from test_scheduler import EngineTables, FakeModel, make_requests, outputs, run

BS = 4
SPECS = (FullAttentionSpec(), SlidingWindowSpec(8), SlidingWindowSpec(8))


class GroupTables:
    """An engine's own block tables with KV cache groups (``incremental_tables=True``): one matrix per group,
    the same rows; whole rows loaded from the plan's tuples of one table per group, each group's updates applied
    to its own matrix."""

    def __init__(self, G: int) -> None:
        self.g = [EngineTables() for _ in range(G)]

    def apply(self, plan) -> None:
        for pw in plan.prefills:
            for g, t in enumerate(self.g):
                t.load(pw.table_row, pw.block_table[g])
        d = plan.decode
        if d is not None:
            for _, row, table in d.table_loads:
                for g, t in enumerate(self.g):
                    t.load(row, table[g])
            for t, upd in zip(self.g, d.result.table_updates):
                if upd.rows.size:
                    t._fit(int(upd.rows.max()) + 1, int(upd.cols.max()) + 1)
                upd.apply(t.t)


def check_hybrid_plan(bm: HybridBlockManager, plan, tables: GroupTables | None = None) -> None:
    G = bm.config.num_groups
    if tables is not None:
        tables.apply(plan)
    for pw in plan.prefills:
        L, start = pw.seq_len, pw.num_cached_tokens
        assert pw.slot_mapping.shape == (G, L - start) and len(pw.block_table) == G
        for g in range(G):
            np.testing.assert_array_equal(pw.slot_mapping[g], bm.slot_mapping(pw.seq_id, start, L, g))
            np.testing.assert_array_equal(pw.block_table[g], bm.block_table(pw.seq_id, g))
            table = pw.block_table[g]
            np.testing.assert_array_equal(pw.slot_mapping[g] // BS, table[pw.positions // BS])
    d = plan.decode
    if d is not None:
        res = d.result
        assert res.slot_mapping.shape == (G, len(d.positions))
        assert len(res.table_updates if tables is not None else res.block_tables) == G
        ends = np.cumsum(d.query_lens)
        for j, sid in enumerate(d.seq_ids.tolist()):
            n = bm.num_tokens(sid)
            q = int(d.query_lens[j])
            for g in range(G):
                table = bm.block_table(sid, g)
                row = tables.g[g].t[res.table_rows[j]] if tables is not None else res.block_tables[g][j]
                np.testing.assert_array_equal(row[: len(table)], table)
                assert (row[len(table):] == NULL_BLOCK).all()
                np.testing.assert_array_equal(res.slot_mapping[g][ends[j] - q: ends[j]],
                                              bm.slot_mapping(sid, n - q, n, g))


def run_hybrid(reqs, *, num_gpu_blocks, num_cpu_blocks=0, mode="recompute", prefix_caching=False,
               max_num_batched_tokens=64, incremental=False):
    bm = BlockManager(num_gpu_blocks, BS, kv_cache_groups=SPECS, num_cpu_blocks=num_cpu_blocks,
                            enable_prefix_caching=prefix_caching, grouped_results=True)
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens, preemption_mode=mode,
                      incremental_tables=incremental)
    tables = GroupTables(len(SPECS)) if incremental else None
    for r in reqs:
        sched.add_request(r["request_id"], r["prompt"], n=r["n"], max_tokens=r["max_tokens"], ignore_eos=True)
    model = FakeModel()
    outs = {}
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        check_hybrid_plan(bm, plan, tables)
        for o in sched.update(plan, model.sample(plan)):
            outs[o.request_id] = o
        bm.check_invariants()
        steps += 1
        assert steps < 20_000
    assert len(bm) == 0
    return outs, sched


@pytest.mark.parametrize("mode,cpu", [("recompute", 0), ("swap", 400)])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_hybrid_runs_reproduce_the_unconstrained_one_table_run(mode, cpu, prefix, n):
    # the small pool: room for a long prompt (39 tokens, 10 blocks in each of 3 groups) and its samples growing
    reqs = make_requests(7, 12, min_prompt=3, max_prompt=30, max_out=24, n=n, shared_prefix=[5] * 9)
    want = outputs(run(reqs, prefix_caching=prefix)[0])
    roomy, _ = run_hybrid(reqs, num_gpu_blocks=2_000, prefix_caching=prefix)
    assert outputs(roomy) == want
    small, sched = run_hybrid(reqs, num_gpu_blocks=36 if n == 1 else 60, num_cpu_blocks=cpu, mode=mode, prefix_caching=prefix)
    assert outputs(small) == want
    # the engine's own tables (incremental_tables, what LLM runs): the same run, every decode's tables exact
    small_inc, sched_inc = run_hybrid(reqs, num_gpu_blocks=36 if n == 1 else 60, num_cpu_blocks=cpu, mode=mode,
                                      prefix_caching=prefix, incremental=True)
    assert outputs(small_inc) == want and sched_inc.stats.preemptions == sched.stats.preemptions
    if prefix:  # hybrid hits (the full group's blocks and each sliding group's last window) were taken
        assert sched.stats.cached_tokens > 0
    else:  # the small pool preempted (with prefix caching, admission waits for evictable blocks instead)
        assert sched.stats.preemptions > 0
        if mode == "swap":
            assert sched.stats.swap_outs > 0
