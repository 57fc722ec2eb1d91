"""HybridBlockManager (KV cache groups over one pool): golden block ids per group, the hybrid hit rule, eviction
order across groups, KV events with group fields, all-or-nothing calls, errors."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import (NULL_BLOCK, BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec,
                     block_hashes)
from pagedkv.errors import (DuplicateSequenceError, InvalidArgumentError, OutOfBlocksError, PromptTooLongError,
                            SequenceStateError, UnknownSequenceError)
from pagedkv.events import BlockRemoved, BlockStored

F, S = FullAttentionSpec, SlidingWindowSpec


def tables(m, seq):
    return [m.block_table(seq, g).tolist() for g in range(m.config.num_groups)]


def test_specs():
    assert F().kind == "full_attention" and F().window is None
    assert S(512).kind == "sliding_window" and S(512).window == 512
    assert S(8) == S(8) and hash(S(8)) == hash(S(8)) and S(8) != S(9)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(InvalidArgumentError):
            S(bad)
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, 4, kv_cache_groups=[], grouped_results=True)
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, 4, kv_cache_groups=[F(), "sliding"], grouped_results=True)
    assert pagedkv.HybridBlockManager is HybridBlockManager


def test_golden_tables_and_slots_per_group():
    """Exact block ids: the groups draw from one FIFO ring in group order; the sliding group releases the blocks
    its window no longer sees (to the ring's tail) and its table holds NULL_BLOCK there."""
    m = BlockManager(16, 4, kv_cache_groups=[F(), S(8)], watermark=0, grouped_results=True)
    assert m.allocate("a", list(range(10))) == 0
    assert tables(m, "a") == [[0, 1, 2], [3, 4, 5]]
    got = []
    for _ in range(6):
        r = m.decode_step(["a"], np.array([7]))
        assert r.slot_mapping.shape == (2, 1) and r.seq_lens.tolist() == [m.num_tokens("a")]
        got.append((r.slot_mapping[:, 0].tolist(), [t[0].tolist() for t in r.block_tables], m.num_free_gpu_blocks))
        m.check_invariants()
    assert got == [
        ([10, 22], [[0, 1, 2], [3, 4, 5]], 10),
        ([11, 23], [[0, 1, 2], [-1, 4, 5]], 11),  # position 11 sees (3, 11]: block 0 of the window group goes
        ([24, 28], [[0, 1, 2, 6], [-1, 4, 5, 7]], 9),
        ([25, 29], [[0, 1, 2, 6], [-1, 4, 5, 7]], 9),
        ([26, 30], [[0, 1, 2, 6], [-1, 4, 5, 7]], 9),
        ([27, 31], [[0, 1, 2, 6], [-1, -1, 5, 7]], 10),
    ]
    assert m.slot_mapping("a", 12, 16, 1).tolist() == [28, 29, 30, 31]
    with pytest.raises(SequenceStateError):
        m.slot_mapping("a", 0, 4, 1)  # released by the window
    assert m.slot_mapping("a", 0, 2, 0).tolist() == [0, 1]
    with pytest.raises(InvalidArgumentError):
        m.block_table("a", 2)
    with pytest.raises(InvalidArgumentError):
        m.block_table("a", -1)


def test_eviction_order_across_groups_and_events_carry_the_group():
    """One LRU for every group: a freed sequence's blocks are released group by group, tail first; a later
    allocation evicts the least recently used first whatever its group, and the events name each block's group."""
    m = BlockManager(12, 4, kv_cache_groups=[F(), S(4)], watermark=0, enable_prefix_caching=True,
                           enable_kv_events=True, grouped_results=True)
    m.allocate("a", list(range(9)))
    assert tables(m, "a") == [[0, 1, 2], [3, 4, 5]]
    ev = m.events.take()
    assert [(type(e).__name__, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in ev] == [
        ("BlockStored", 0, "full_attention", None), ("BlockStored", 1, "sliding_window", 4)]
    # group 0's keys are those of a single-group manager (block_hashes); group 1's differ
    assert ev[0].block_hashes == block_hashes(list(range(9)), 4)
    assert not set(ev[1].block_hashes) & set(ev[0].block_hashes)
    m.free("a")
    assert list(m._cache.evictor) == [1, 0, 4, 3]  # group 0 tail first, then group 1 tail first
    m.allocate("b", [50 + i for i in range(17)])
    assert tables(m, "b") == [[6, 7, 8, 9, 10], [11, 2, 5, 1, 0]]
    ev = m.events.take()
    assert [(type(e).__name__, e.group_idx) for e in ev] == [("BlockStored", 0), ("BlockRemoved", 0),
                                                            ("BlockStored", 1)]
    assert ev[1].block_hashes == block_hashes(list(range(9)), 4)[::-1]  # blocks 1 then 0
    m.check_invariants()


def test_single_group_events_keep_their_defaults():
    m = BlockManager(8, 4, enable_prefix_caching=True, enable_kv_events=True)
    m.allocate("a", list(range(9)))
    m.reset_prefix_cache()
    m.allocate("b", list(range(9)))
    (st,) = [e for e in m.events.take() if isinstance(e, BlockStored)]
    assert (st.group_idx, st.kv_cache_spec_kind, st.kv_cache_spec_sliding_window) == (None, None, None)
    assert BlockRemoved([1]).group_idx is None


def _window_scenario():
    """Sequence a holds P (17 tokens) and decodes 3 tokens: the window group (W = 4) releases its blocks 0..3 to
    the LRU; pressure then evicts two of them (blocks 1 and 2 of P in that group)."""
    # (plain LRU: window retention, on by default, would evict the window group's blocks 0 and 1 first)
    m = BlockManager(20, 4, kv_cache_groups=[F(), S(4)], watermark=0, enable_prefix_caching=True,
                           window_retention=False, grouped_results=True)
    P = list(range(1, 18))
    m.allocate("a", P)
    for t in (1, 2, 3):
        m.decode_step(["a"], np.array([t]))
    assert tables(m, "a") == [[0, 1, 2, 3, 4], [-1, -1, -1, -1, 9]]
    assert list(m._cache.evictor) == [7, 6, 5, 8]
    m.allocate("f", list(range(100, 117)))  # takes the free ring
    m.allocate("g", [600])  # evicts 7 and 6
    assert list(m._cache.evictor) == [5, 8]
    m.free("f")
    return m, P


def test_hybrid_hit_needs_the_window_only():
    m, P = _window_scenario()
    # the full group has P's blocks 0..3 (held by a); the window group has blocks 0 (5) and 3 (8) cached
    hit = m.lookup_prefix(P[:16] + [99])
    assert (hit.num_cached_tokens, hit.num_new_blocks) == (16, 3)  # window [12, 16): block 3 of group 1 only
    # hit point 12 would need group 1's block 2 (evicted), 8 its block 1 (evicted): the hit falls to 4
    assert m.lookup_prefix(P[:12] + [99]).num_cached_tokens == 4
    assert m.allocate("c", P[:12] + [99]) == 4
    assert tables(m, "c") == [[0, 14, 19, 8], [5, 13, 12, 11]]  # (8 was evicted to make room)
    # c re-cached P's blocks 1 and 2 in group 1: P[:16] now hits 12, its window group NULL before [8, 12)
    assert m.lookup_prefix(P[:16] + [99]).num_cached_tokens == 12
    assert m.allocate("d", P[:16] + [99]) == 12
    assert tables(m, "d") == [[0, 1, 2, 10, 18], [-1, -1, 12, 17, 16]]
    m.check_invariants()


def test_decode_is_all_or_nothing_across_groups():
    """Group 0 alone would fit; both groups together do not: nothing changes."""
    m = BlockManager(8, 4, kv_cache_groups=[F(), F()], watermark=0, grouped_results=True)
    m.allocate("a", [1, 2, 3, 4])
    m.allocate("b", [1, 2, 3, 4])
    m.allocate("c", [1, 2, 3, 4])
    assert m.num_free_gpu_blocks == 2
    before = [tables(m, s) for s in "abc"]
    with pytest.raises(OutOfBlocksError):
        m.decode_step(["a", "b"], np.array([5, 5]))  # 2 new blocks per group
    assert [tables(m, s) for s in "abc"] == before and m.num_free_gpu_blocks == 2
    assert [m.num_tokens(s) for s in "abc"] == [4, 4, 4]
    assert not m.can_append_slots(["a", "b"])
    assert m.can_append_slots(["a"])
    r = m.decode_step(["a"], np.array([5]))
    assert [t.tolist() for t in r.block_tables] == [[[0, 6]], [[1, 7]]]
    m.check_invariants()


def test_allocate_is_all_or_nothing_and_admission_counts_every_group():
    m = BlockManager(10, 4, kv_cache_groups=[F(), S(4), S(4)], watermark=0, grouped_results=True)
    with pytest.raises(PromptTooLongError):
        m.allocate("x", list(range(13)))  # 4 blocks x 3 groups > 10
    assert m.can_allocate(list(range(13))) == pagedkv.AllocStatus.NEVER
    assert m.can_allocate(list(range(12))) == pagedkv.AllocStatus.OK
    m.allocate("a", list(range(8)))  # 6 blocks
    assert m.can_allocate(list(range(8))) == pagedkv.AllocStatus.LATER
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", list(range(8)))
    with pytest.raises(OutOfBlocksError):
        m.allocate_batch(["b", "c"], [[1], [2, 3]])  # 6 blocks > 4
    assert len(m) == 1 and m.num_free_gpu_blocks == 4
    with pytest.raises(DuplicateSequenceError):
        m.allocate("a", [1])
    with pytest.raises(DuplicateSequenceError):
        m.allocate_batch(["b", "b"], [[1], [1]])
    with pytest.raises(InvalidArgumentError):
        m.allocate("b", [1], namespace=1.5)
    with pytest.raises(UnknownSequenceError):
        m.free("zz")
    m.check_invariants()


def test_allocate_batch_matches_allocate_calls():
    """allocate_batch gives the same hits, tables and slots as consecutive allocate calls (burst sharing inside
    the batch included), per group."""
    prompts = [list(range(1, 14)), list(range(1, 14)), list(range(1, 9)) + [40, 41], [7] * 5]
    kw = dict(kv_cache_groups=[F(), S(6), F()], enable_prefix_caching=True, watermark=0)
    a = BlockManager(64, 4, **kw, grouped_results=True)
    b = BlockManager(64, 4, **kw, grouped_results=True)
    pb = a.allocate_batch(list("wxyz"), prompts, namespaces=[None, None, None, "t"])
    hits = [b.allocate(s, p, namespace=ns) for s, p, ns in zip("wxyz", prompts, [None, None, None, "t"])]
    assert pb.num_cached_tokens.tolist() == hits == [0, 12, 8, 0]
    assert pb.slot_mapping.shape == (3, int(pb.query_start_loc[-1]))
    for g in range(3):
        for i, s in enumerate("wxyz"):
            assert a.block_table(s, g).tolist() == b.block_table(s, g).tolist()
            q0, q1 = pb.query_start_loc[i], pb.query_start_loc[i + 1]
            assert pb.slot_mapping[g, q0:q1].tolist() == b.slot_mapping(s, hits[i], len(prompts[i]), g).tolist()
            assert pb.block_tables[g][i, : len(a.block_table(s, g))].tolist() == a.block_table(s, g).tolist()
    a.check_invariants()


def test_fork_cow_and_swap_per_group():
    m = BlockManager(32, 4, kv_cache_groups=[F(), S(4)], num_cpu_blocks=32, watermark=0, grouped_results=True)
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    m.take_copy_plan()
    m.fork("a", "b")
    r = m.decode_step(["a", "b"], np.array([7, 8]))
    # the shared last block is copied in each group for a (b, the last writer, keeps it)
    assert r.cow.tolist() == [[1, 4], [3, 5]]
    plan = m.take_copy_plan()
    assert plan.src.tolist() == [1, 3] and plan.dst.tolist() == [4, 5]
    pairs = m.swap_out(["a"])
    assert [s for s, _ in pairs] == [0, 4, 2, 5]  # group 0's blocks, then group 1's
    assert m.is_swapped("a")
    with pytest.raises(SequenceStateError):
        m.decode_step(["a"], np.array([1]))
    back = m.swap_in(["a"])
    assert len(back) == 4 and not m.is_swapped("a")
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert m.num_free_gpu_blocks == 32 and m.stats.num_free_cpu_blocks == 32
    m.check_invariants()


def test_swap_out_is_all_or_nothing():
    m = BlockManager(32, 4, kv_cache_groups=[F(), F()], num_cpu_blocks=3, watermark=0, grouped_results=True)
    m.allocate("a", [1, 2, 3, 4, 5])  # 2 blocks per group: 4 CPU blocks needed
    m.take_copy_plan()
    assert not m.can_swap_out(["a"])
    with pytest.raises(OutOfBlocksError):
        m.swap_out(["a"])
    assert not m.is_swapped("a") and m.stats.num_free_cpu_blocks == 3 and len(m.take_copy_plan()) == 0
    m.check_invariants()


def test_free_cache_false_withdraws_every_group_or_refuses():
    m = BlockManager(32, 4, kv_cache_groups=[F(), S(4)], enable_prefix_caching=True, watermark=0, grouped_results=True)
    m.allocate("a", list(range(9)))
    assert m.stats.num_cached_blocks == 4
    m.allocate("b", list(range(9)))  # hits a's blocks in the same step
    with pytest.raises(SequenceStateError):
        m.free("a", cache=False)
    assert m.stats.num_cached_blocks == 4 and "a" in m
    m.free("b", cache=False)  # b cached nothing of its own
    m.free("a", cache=False)
    assert m.stats.num_cached_blocks == 0 and m.num_free_gpu_blocks == 32
    m.check_invariants()


def test_reset_prefix_cache_and_lookahead_and_stats():
    m = BlockManager(64, 4, kv_cache_groups=[F(), S(8)], enable_prefix_caching=True, watermark=0, grouped_results=True)
    m.allocate("a", list(range(9)), 3)
    assert [len(t) for t in tables(m, "a")] == [3, 3]
    r = m.decode_step(["a"], [[1, 2]], 3)  # two tokens plus 3 lookahead slots: 14 slots -> 4 blocks
    assert r.slot_mapping.shape == (2, 2) and [t.shape[1] for t in r.block_tables] == [4, 4]
    assert m.reset_prefix_cache() == 0 and m.stats.num_cached_blocks == 0
    m.decode_step(["a"], [[1, 2, 3]])  # a's chains are broken: nothing more is cached
    assert m.stats.num_cached_blocks == 0
    m.allocate("b", list(range(9)))
    assert m.stats.prefix_query_tokens == 18 and m.stats.prefix_hit_tokens == 0
    m.check_invariants()


def test_cpu_tier_hits_in_every_group():
    m = BlockManager(12, 4, kv_cache_groups=[F(), S(4)], num_cpu_blocks=16, enable_prefix_caching=True,
                           cpu_prefix_cache=True, watermark=0, grouped_results=True)
    P = list(range(1, 14))  # 3 full blocks
    m.allocate("a", P)
    m.free("a")
    m.take_copy_plan()
    m.allocate("f", list(range(100, 121)))  # 6 blocks per group: every cached block is demoted
    plan = m.take_copy_plan()
    assert int((plan.kind == pagedkv.CopyKind.GPU_TO_CPU).sum()) == 6
    m.free("f", cache=False)  # (not needed: nothing left to hit)
    hit = m.lookup_prefix(P)
    assert hit.num_cached_tokens == 12 and hit.num_cpu_blocks == 3 + 1  # group 1 needs block 2 only (W = 4)
    assert m.allocate("c", P) == 12
    assert m.block_table("c", 1)[:2].tolist() == [NULL_BLOCK, NULL_BLOCK]
    plan = m.take_copy_plan()
    assert int((plan.kind == pagedkv.CopyKind.CPU_TO_GPU).sum()) == 4
    m.check_invariants()


def test_block_hashes_of_each_group_are_the_events_keys():
    m = BlockManager(64, 4, kv_cache_groups=[F(), S(4), F()], enable_prefix_caching=True,
                           enable_kv_events=True, grouped_results=True)
    toks = list(range(1, 18))
    m.allocate("a", toks, namespace="t")
    ev = m.events.take()
    assert [e.group_idx for e in ev] == [0, 1, 2]
    for e in ev:
        assert e.namespace == "t"
        assert e.block_hashes == block_hashes(toks, 4, "t", group=e.group_idx)
    assert block_hashes(toks, 4, "t", group=0) == block_hashes(toks, 4, "t")
    with pytest.raises(InvalidArgumentError):
        block_hashes(toks, 4, group=-1)


def test_fixed_table_width_per_group():
    from pagedkv.errors import TableWidthError
    m = BlockManager(64, 4, kv_cache_groups=[F(), S(4)], block_table_width=3, watermark=0, grouped_results=True)
    pb = m.allocate_batch(["a"], [[1, 2, 3, 4, 5]])
    assert [t.shape for t in pb.block_tables] == [(1, 3), (1, 3)]
    with pytest.raises(TableWidthError):
        m.allocate("b", list(range(13)))
    r = m.decode_step(["a"], np.array([1]))
    assert [t.tolist() for t in r.block_tables] == [[[0, 1, -1]], [[2, 3, -1]]]
    for _ in range(6):
        m.decode_step(["a"], np.array([1]))
    before = tables(m, "a"), m.num_free_gpu_blocks
    with pytest.raises(TableWidthError):
        m.decode_step(["a"], np.array([1]))  # a fourth block in each group
    assert (tables(m, "a"), m.num_free_gpu_blocks) == before
    m.check_invariants()
