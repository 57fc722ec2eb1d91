"""The one append algorithm (``manager/_step.py``): ``Stepper.plan`` changes nothing, ``Stepper.commit`` carries it out;
the one-token step reads each row's written column directly, including a row whose table fills every column."""

import numpy as np
import pytest

from pagedkv import BlockManager, FullAttentionSpec, SlidingWindowSpec
from pagedkv.types import NULL_BLOCK


@pytest.mark.parametrize("delta", [False, True])
def test_one_token_step_of_a_row_whose_table_fills_every_column(delta):
    """A table matrix starts 4 columns wide: "a" (8 tokens, blocks of 2) fills them, so its next token's column is
    past the matrix; "b" writes into its half-full last block. The vectorised step grows "a" and writes "b" in place."""
    bm = BlockManager(32, 2, watermark=0)
    bm._small_batch = 0  # (the vectorised plan and commit)
    bm.allocate("a", list(range(8)))
    bm.allocate("b", [1, 2, 3])
    assert bm._t.table.shape[1] == 4  # (the premise: "a"'s next column is past the matrix)
    res = bm.decode_step(["a", "b"], np.array([9, 9]), block_tables=not delta)
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert ta.size == 5 and tb.size == 2
    assert res.slot_mapping.tolist() == [int(ta[4]) * 2, int(tb[1]) * 2 + 1]
    assert res.seq_lens.tolist() == [9, 4]
    if delta:
        upd = res.table_updates
        assert list(zip(upd.rows.tolist(), upd.cols.tolist(), upd.blocks.tolist())) == [
            (int(res.table_rows[0]), 4, int(ta[4]))]
    else:
        assert res.block_tables.tolist() == [ta.tolist(), tb.tolist() + [NULL_BLOCK] * 3]
    bm.check_invariants()


@pytest.mark.parametrize("counts, la", [(None, 0), (np.array([1, 2, 3]), 0), (None, 2), (np.array([3, 1, 1]), 1)])
def test_plan_changes_nothing_and_commit_matches_it(counts, la):
    """With forks sharing written blocks (copy-on-write) and a sliding window releasing blocks: a plan leaves the
    tables, refcounts and free blocks as they were; committing it takes exactly its ``needed`` blocks."""
    bm = BlockManager(64, 2, sliding_window=4, enable_prefix_caching=True, watermark=0)
    bm._small_batch = 0
    bm.allocate("p", list(range(1, 8)))
    bm.fork("p", "c")
    bm.allocate("q", list(range(20, 31)))
    step, t = bm._step, bm._t
    rows = t.rows(["p", "c", "q"])
    before = (t.table.copy(), t.ntok.copy(), t.nblk.copy(), bm._gpu.ref.copy(), bm.num_free_gpu_blocks)
    plan = step.plan(rows, counts, la, exact=True)
    after = (t.table, t.ntok, t.nblk, bm._gpu.ref, bm.num_free_gpu_blocks)
    assert all(np.array_equal(x, y) for x, y in zip(before[:4], after[:4])) and before[4] == after[4]
    assert plan.cow is not None and plan.release is not None  # (the premise: both parts are exercised)
    assert plan.needed <= plan.available
    n = 3 if counts is None else int(counts.sum())
    free = bm.num_free_gpu_blocks
    freed = plan.available - free  # blocks the window returns before the step takes any
    res = step.commit(rows, counts, np.arange(100, 100 + n), plan, 1)
    assert bm.num_free_gpu_blocks == free + freed - plan.needed
    assert len(res.cow) == plan.cow[0].size
    bm.check_invariants()


def test_hybrid_step_short_in_sum_only_counts_window_releases():
    """Every group alone fits in the free blocks but not all together: the coordinator re-plans counting what the
    windows free (each group's plan counts it only when that group alone is short), and the step fits."""
    hm = BlockManager(20, 2, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(2)], watermark=0, grouped_results=True)
    hm._step.small_batch = 0
    hm.allocate("a", list(range(1, 10)))
    hm.allocate("b", list(range(20, 29)))
    for _ in range(4):
        hm.decode_step(["a", "b"], np.array([1, 1]))
    rows, counts = hm._t0.rows(["a", "b"]), np.array([2, 2])
    free = hm.num_free_gpu_blocks
    plans = [s.plan(rows, counts, 0) for s in hm._step.steps]
    assert [p.available for p in plans] == [free, free]  # (the premise: neither group alone is short ...)
    assert sum(p.needed for p in plans) > free  # (... but together they are, before the window's releases)
    assert hm.can_append_slots(["a", "b"], num_new_tokens=counts)
    res = hm.decode_step(["a", "b"], np.array([5, 6, 7, 8]), num_new_tokens=counts)
    assert res.seq_lens.tolist() == [15, 15]
    hm.check_invariants()
