"""Golden tests: they pin policy (exact block ids handed out, exact eviction order), not only correctness.

A change that alters which block goes where must change these expectations on purpose.
"""

import numpy as np

from pagedkv import NULL_BLOCK, BlockManager


def table(bm, s):
    return bm.block_table(s).tolist()


def test_fresh_pool_hands_out_ids_in_order_and_reuses_freed_ones_last():
    bm = BlockManager(8, 4, watermark=0)
    bm.allocate("a", range(10))  # 3 blocks
    bm.allocate("b", range(5))  # 2 blocks
    assert table(bm, "a") == [0, 1, 2]
    assert table(bm, "b") == [3, 4]
    bm.free("a")  # released tail first: 2, 1, 0 join the ring behind 5, 6, 7
    bm.allocate("c", range(12))
    assert table(bm, "c") == [5, 6, 7]
    bm.allocate("d", range(9))
    assert table(bm, "d") == [2, 1, 0]
    bm.check_invariants()


def test_decode_step_takes_new_blocks_in_batch_order():
    bm = BlockManager(16, 4, watermark=0)
    for s, n in (("x", 4), ("y", 3), ("z", 8)):
        bm.allocate(s, range(n))  # x: [0], y: [1], z: [2, 3]
    res = bm.decode_step(["x", "y", "z"], np.array([7, 7, 7]))
    # x and z start a new block (4 and 5 in batch order), y fills slot 3 of block 1
    assert res.slot_mapping.tolist() == [4 * 4 + 0, 1 * 4 + 3, 5 * 4 + 0]
    assert res.block_tables.tolist() == [[0, 4, -1], [1, -1, -1], [2, 3, 5]]
    assert res.seq_lens.tolist() == [5, 4, 9]
    assert res.cow.shape == (0, 2)


def test_lru_eviction_order_tail_first_and_plain_free_blocks_first():
    bm = BlockManager(6, 4, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", range(13))  # blocks 0 1 2 full, 3 partial
    assert table(bm, "a") == [0, 1, 2, 3]
    bm.free("a")  # full blocks 0..2 enter the cache; released 3, 2, 1, 0
    assert list(bm._cache.evictor) == [2, 1, 0]  # LRU first: the tail goes first
    assert bm.num_free_gpu_blocks == 6 and bm.stats.num_cached_blocks == 3
    bm.allocate("b", range(100, 116))  # 4 new blocks: free ring 4, 5, 3 first, then evicts 2
    assert table(bm, "b") == [4, 5, 3, 2]
    assert bm.stats.evictions == 1
    assert list(bm._cache.evictor) == [1, 0]
    bm.free("b")  # b's four full blocks are cached, released tail first
    assert list(bm._cache.evictor) == [1, 0, 2, 3, 5, 4]
    hit = bm.allocate("c", range(13))  # blocks 0 and 1 still cached; block 2 was evicted
    assert hit == 8
    assert table(bm, "c") == [0, 1, 2, 3]  # two new blocks: evict b's tail (2) then 3
    assert bm.stats.evictions == 3
    assert list(bm._cache.evictor) == [5, 4]
    bm.check_invariants()


def test_eviction_order_follows_release_order_across_sequences():
    bm = BlockManager(8, 2, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", [1, 1, 2, 2, 3])  # blocks 0 1 (full) 2
    bm.allocate("b", [5, 5, 6, 6, 7])  # blocks 3 4 (full) 5
    bm.free("b")
    bm.free("a")
    # b released first (LRU), each sequence tail first
    assert list(bm._cache.evictor) == [4, 3, 1, 0]
    bm.allocate("c", list(range(20, 32)))  # 6 blocks: ring 6, 7, 5, 2, then evict 4, 3
    assert table(bm, "c") == [6, 7, 5, 2, 4, 3]
    assert list(bm._cache.evictor) == [1, 0]


def test_hit_moves_block_out_of_evictor_and_refreeing_makes_it_most_recent():
    bm = BlockManager(8, 2, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", [1, 1, 2, 2, 9])
    bm.free("a")
    bm.allocate("b", [3, 3, 4, 4, 9])
    bm.free("b")
    assert list(bm._cache.evictor) == [1, 0, 4, 3]
    assert bm.allocate("c", [1, 1, 7]) == 2  # hits block 0
    assert list(bm._cache.evictor) == [1, 4, 3]
    bm.free("c")  # c's partial block goes to the ring, block 0 becomes most recent
    assert list(bm._cache.evictor) == [1, 4, 3, 0]


def test_copy_on_write_pair_after_fork():
    bm = BlockManager(10, 4, watermark=0)
    bm.allocate("p", range(6))  # [0, 1], block 1 half full
    bm.fork("p", "c")
    assert table(bm, "c") == [0, 1]
    assert bm.append_slots("c", [9]) == [(1, 2)]  # child writes into shared block 1: copy to 2
    assert table(bm, "c") == [0, 2] and table(bm, "p") == [0, 1]
    assert bm.append_slots("p", [9]) == []  # parent now owns block 1 alone
    assert bm.stats.cow_copies == 1
    bm.check_invariants()


def test_batched_copy_on_write_takes_destinations_before_new_blocks():
    bm = BlockManager(10, 2, watermark=0)
    bm.allocate("p", [1, 2, 3])  # [0, 1]
    bm.fork("p", "c")
    bm.allocate("q", [4, 5])  # [2]
    res = bm.decode_step(["p", "c", "q"], np.array([6, 7, 8]))
    # p writes shared block 1 -> copy to 3; q needs a new block -> 4; c then owns block 1 alone
    assert res.cow.tolist() == [[1, 3]]
    assert res.block_tables.tolist() == [[0, 3], [0, 1], [2, 4]]
    assert res.slot_mapping.tolist() == [3 * 2 + 1, 1 * 2 + 1, 4 * 2 + 0]


def test_swap_out_and_in_pairs_and_sharing():
    bm = BlockManager(8, 2, num_cpu_blocks=8, watermark=0)
    bm.allocate("p", [1, 2, 3])  # [0, 1]
    bm.fork("p", "c")
    bm.append_slots("c", [4])  # cow: c -> [0, 2]
    bm.allocate("o", [7])  # [3]
    assert bm.swap_out(["p", "c"]) == [(0, 0), (1, 1), (2, 2)]  # shared block 0 moves once
    assert table(bm, "p") == [0, 1] and table(bm, "c") == [0, 2]  # CPU ids now
    assert bm.num_free_gpu_blocks == 7 and bm.stats.num_free_cpu_blocks == 5
    bm.check_invariants()
    # GPU ring now: 4 5 6 7 2 1 0 (released tail first per sequence order of first appearance reversed)
    assert bm.swap_in(["c", "p"]) == [(0, 4), (2, 5), (1, 6)]
    assert table(bm, "p") == [4, 6] and table(bm, "c") == [4, 5]
    bm.check_invariants()


def test_sliding_window_releases_blocks_and_marks_them_null():
    bm = BlockManager(32, 4, sliding_window=8, watermark=0)
    bm.allocate("s", range(12))  # [0, 1, 2]: the prompt is kept whole for its prefill
    assert table(bm, "s") == [0, 1, 2]
    bm.append_slots("s", [0])  # query at 12 sees 5..12: block 0 (0..3) is out
    assert table(bm, "s") == [NULL_BLOCK, 1, 2, 3]
    held = []
    for t in range(40):
        bm.append_slots("s", [t])
        held.append(int((bm.block_table("s") >= 0).sum()))
        bm.check_invariants()
    assert max(held) <= 8 // 4 + 2
    assert bm.num_free_gpu_blocks == 32 - held[-1]
    # released blocks were reused in ring order
    assert table(bm, "s")[-1] < 32


def test_copy_on_write_follows_batch_order_when_sequences_write_different_columns():
    # b runs one token ahead of a; both hold block 4 (a's column 4, b's column 4) and both write it in one
    # ragged step: a comes first in the batch, so a copies and b, the last writer, keeps block 4. Block 5 is
    # written by b alone while a still holds it: b copies it. (Found by the stateful test: the copies used to be
    # ordered by column offset, not by batch position, and a kept block 4.)
    bm = BlockManager(16, 1, watermark=0)
    bm.allocate("a", [1, 2])
    bm.decode_step(["a"], np.array([3]), num_lookahead_slots=3)
    bm.fork("a", "b")
    assert bm.append_slots("b", [9]) == [(3, 6)]
    r = bm.decode_step(["a", "b"], [[7, 8], [7, 8]])
    assert r.cow.tolist() == [[4, 7], [5, 8]]
    assert bm.block_table("a").tolist() == [0, 1, 2, 3, 7, 5]
    assert bm.block_table("b").tolist() == [0, 1, 2, 6, 4, 8]
    bm.check_invariants()


def test_burst_sharing_block_ids_and_eviction_order():
    bm = BlockManager(8, 4, enable_prefix_caching=True, watermark=0)
    p = list(range(14))  # 3 full blocks + 2 tokens
    assert bm.allocate("a", p) == 0
    assert table(bm, "a") == [0, 1, 2, 3]
    assert bm.allocate("b", p) == 12  # same step: a's 3 full blocks, cached as allocate returned
    assert table(bm, "b") == [0, 1, 2, 4]
    res = bm.decode_step(["a", "b"], np.array([5, 6]))  # both fill their own partial block 3 / 4
    assert res.cow.shape == (0, 2) and res.slot_mapping.tolist() == [3 * 4 + 2, 4 * 4 + 2]
    res = bm.decode_step(["a", "b"], np.array([7, 7]))  # blocks 3 and 4 are full now: 3 cached, 4 differs
    assert bm.stats.num_cached_blocks == 5
    bm.free("b")  # released tail first: 4, then 2 1 0 stay held by a
    bm.free("a")  # 3, 2, 1, 0
    assert list(bm._cache.evictor) == [4, 3, 2, 1, 0]
    assert bm.allocate("c", list(range(100, 120))) == 0  # 5 blocks: free ring 5 6 7, then evicts 4 and 3
    assert table(bm, "c") == [5, 6, 7, 4, 3]
    assert list(bm._cache.evictor) == [2, 1, 0]
    bm.check_invariants()
