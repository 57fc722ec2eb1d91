"""The CPU tier of the prefix cache: demotion, promotion, the copies of a step, sharing the CPU pool with swap."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import BlockRemoved, BlockStored


def tier(gpu=4, cpu=8, **kw):
    return BlockManager(gpu, 4, num_cpu_blocks=cpu, enable_prefix_caching=True, cpu_prefix_cache=True,
                        watermark=0, **kw)


def test_demote_on_eviction_then_promote_on_a_hit_exact_copies():
    bm = tier()
    bm.allocate("a", list(range(13)))  # GPU 0 1 2 full, 3 partial
    bm.free("a")
    assert bm.take_copies().demotions.shape == (0, 2)
    bm.allocate("b", list(range(100, 116)))  # 4 new blocks: free block 3, then evicts 2, 1, 0 (LRU, tail first)
    dem, pro = bm.take_copies()
    assert dem.tolist() == [[2, 0], [1, 1], [0, 2]] and pro.size == 0  # a's tail first, into CPU 0, 1, 2
    assert bm.stats.num_cpu_cached_blocks == 3
    bm.free("b")
    bm.take_copies()
    assert bm.allocate("c", list(range(13))) == 12  # all three from the CPU tier
    dem, pro = bm.take_copies()
    # b's four blocks are evicted (demoted to CPU 3..6) before a's content comes back into the same GPU blocks
    assert dem.tolist() == [[0, 3], [1, 4], [2, 5], [3, 6]]
    assert pro.tolist() == [[2, 0], [1, 1], [0, 2]]
    st = bm.stats
    assert (st.cpu_hit_tokens, st.cpu_hit_blocks, st.demotions, st.promotions) == (12, 3, 7, 3)
    assert st.prefix_hit_tokens == 12
    assert bm.block_table("c").tolist()[:3] == [0, 1, 2]
    bm.check_invariants()


def test_a_prefix_continues_from_the_gpu_into_the_cpu_tier():
    bm = tier(gpu=6, cpu=8)
    bm.allocate("a", list(range(13)))
    bm.free("a")  # cached: 0 1 2; the evictor releases the tail first
    bm.allocate("x", list(range(50, 62)))  # 3 blocks: free 3 4 5 first
    bm.free("x")
    bm.take_copies()
    bm.allocate("y", [7] * 4)  # 1 block: evicts LRU = a's tail (block 2) -> CPU
    assert bm.take_copies().demotions.tolist() == [[2, 0]]
    assert bm.allocate("c", list(range(13))) == 12  # blocks 0, 1 on the GPU, block 2 from the CPU tier
    assert bm.take_copies().promotions.shape == (1, 2)
    assert bm.stats.cpu_hit_blocks == 1
    bm.check_invariants()


def test_a_block_cached_in_the_current_step_is_not_demoted():
    bm = tier(gpu=4, cpu=8)
    bm.allocate("a", list(range(9)))  # blocks 0 1 cached now, KV written by this step's forward
    bm.free("a")  # aborted but the step runs; blocks stay cached (their KV will be written)
    bm.allocate("b", list(range(100, 116)))  # evicts them in the same step: their KV is not there yet
    dem, pro = bm.take_copies()
    assert dem.size == 0 and bm.stats.num_cpu_cached_blocks == 0
    bm.check_invariants()


def test_swap_comes_first_and_evicts_the_tier_lru():
    bm = tier(gpu=4, cpu=4)
    bm.allocate("a", list(range(16)))
    bm.free("a")
    bm.take_copies()
    bm.allocate("b", list(range(100, 116)))  # demotes a's 4 blocks: the CPU pool is all tier
    bm.take_copies()
    assert bm.stats.num_cpu_cached_blocks == 4 and bm.stats.num_free_cpu_blocks == 4  # evictable counts as free
    assert bm.can_swap_out(["b"])
    ev0 = bm.stats.cpu_evictions
    pairs = bm.swap_out(["b"])  # needs 4 CPU blocks: evicts every tier block, LRU first
    assert len(pairs) == 4 and bm.stats.cpu_evictions - ev0 == 4 and bm.stats.num_cpu_cached_blocks == 0
    bm.check_invariants()
    bm.swap_in(["b"])
    bm.check_invariants()


def test_pinned_blocks_survive_until_the_copies_are_taken():
    bm = tier(gpu=4, cpu=3)
    bm.allocate("a", list(range(13)))
    bm.free("a")
    bm.take_copies()
    bm.allocate("b", list(range(100, 116)))
    bm.take_copies()  # a's 3 blocks in the CPU tier: the CPU pool is full of tier blocks
    bm.free("b")
    bm.take_copies()
    assert bm.allocate("c", list(range(13))) == 12  # promotes the 3 tier blocks while evicting b's 4 GPU blocks
    dem, pro = bm.take_copies()
    # the demotions could not evict the tier blocks being promoted (pinned): they were dropped
    assert pro.shape == (3, 2) and dem.size == 0 and bm.stats.dropped_demotions == 4
    bm.check_invariants()


def test_namespaces_stay_apart_in_the_cpu_tier_and_reset_clears_it():
    bm = tier(enable_kv_events=True)
    bm.allocate("a", list(range(9)), namespace="t1")
    bm.free("a")
    bm.take_copies()
    bm.allocate("b", list(range(100, 116)))
    bm.take_copies()
    assert bm.stats.num_cpu_cached_blocks == 2
    bm.free("b")
    assert bm.allocate("c", list(range(9))) == 0  # another namespace: no hit in either tier
    bm.take_copies()
    bm.free("c")
    assert bm.allocate("d", list(range(9)), namespace="t1") == 8
    bm.take_copies()
    ev = bm.events.take()
    cpu_stored = [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {e.namespace for e in cpu_stored} >= {"t1"}
    bm.free("d")
    bm.reset_prefix_cache()
    assert bm.stats.num_cpu_cached_blocks == 0 and bm.stats.num_cached_blocks == 0
    assert bm.stats.num_free_cpu_blocks == 8
    bm.check_invariants()


def test_cpu_tier_needs_caching_and_a_cpu_pool():
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, 4, num_cpu_blocks=4, cpu_prefix_cache=True)
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, 4, enable_prefix_caching=True, cpu_prefix_cache=True)
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    copies = bm.take_copies()
    assert copies.demotions.shape == (0, 2) and copies.promotions.shape == (0, 2) and not bm.config.cpu_prefix_cache
