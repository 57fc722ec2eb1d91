"""Issue 23, item 1: every full block a call makes findable stays findable once the call returns (A), free of a
sequence handed slots in the current step is refused (B), a windowed BlockManager admits chunked prompts longer
than its pool (C), and the hybrid hit rule asks a sliding group for the W - 1 positions the first computed query
reads (D). Each exact case of the issue is pinned here; the stateful machines and the KV-content model check
findability after every allocate and chunk at random."""

from __future__ import annotations

import random

import numpy as np
import pytest

import pagedkv

from pagedkv import AllocStatus, BlockManager, FullAttentionSpec, SlidingWindowSpec
from pagedkv.cluster.index import MemoryIndex
from pagedkv.errors import PromptTooLongError, SequenceStateError
from pagedkv.blocks.prefix_cache import PromptKeys
from test_errors import check_raises


# ---------------------------------------------------------------------------------------------- A: hits kept
def test_hybrid_registration_is_not_lost_to_the_same_calls_eviction():
    """Issue 23 A, first case: group 0's new blocks duplicate s0's idle cached blocks, and taking group 1's blocks
    in the same call evicted those: the prompt was not findable (0 where 12 is expected), even after s4's free.
    The held block now takes the idle block's cache identity (the idle one goes to the free ring)."""
    m = BlockManager(8, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(5)],
                           enable_prefix_caching=True, grouped_results=True)
    m.allocate("s0", list(range(1, 14)))
    m.take_copy_plan()
    m.decode_step(["s0"], np.array([[7, 8]]))
    m.take_copy_plan()
    m.decode_step(["s0"], np.array([[9, 10]]))
    m.take_copy_plan()
    m.free("s0")
    p1 = list(range(1, 9)) + list(range(40, 45))
    assert m.allocate("s4", p1) == 0
    m.check_invariants()
    assert m.lookup_prefix(p1).num_cached_tokens == 12
    m.take_copy_plan()
    m.free("s4")
    assert m.lookup_prefix(p1).num_cached_tokens == 12
    assert m.allocate("s5", p1) == 12
    m.check_invariants()


def test_an_orphaned_cached_block_does_not_keep_the_new_one_out():
    """Issue 23 A, second case: s0's window released its first two blocks, which were then evicted; its third
    block stayed cached (s0 holds it) under the key the same prompt computes, chained to content that is gone.
    It kept the new prompt's block out of the cache (lookup 8 instead of 12); the orphan now gives way."""
    m = BlockManager(7, 4, sliding_window=4, enable_prefix_caching=True)
    p = list(range(1, 14))
    m.allocate("s0", p)
    m.take_copy_plan()
    m.decode_step(["s0"], [14])
    m.take_copy_plan()
    assert m.block_table("s0").tolist()[:2] == [-1, -1]
    m.allocate("s1", list(range(100, 120)))  # evicts s0's released blocks
    m.take_copy_plan()
    m.free("s1")
    assert m.allocate("s4", p) == 0
    m.check_invariants()
    assert m.lookup_prefix(p).num_cached_tokens == 12
    # s0 still reads its own block, now uncached; the new chain is whole
    assert m.block_table("s0")[2] >= 0 and m._cache.cid[m.block_table("s0")[2]] == 0


def test_a_window_the_sequence_moved_past_is_not_promised():
    """Toy-engine seeds 29 and 53 (issue 23, item 1): the chunk of 'a' moves its sliding group's window past the hit
    point 8 (its first query, at 10, reads positions 8..10), so the group releases blocks 0 and 1; 'b', in the same
    call, needs two blocks and the pool has none free: it takes exactly those. The hit at 8 needs the sliding
    group's block 1 (positions 6, 7), which nobody holds any more, so lookup_prefix finds 0: no block 'a' holds is
    lost. Findability promises the hit points whose blocks the sequence itself holds in every group
    (tests/toy_engine.py's ``_held_hit``); a window it moved past is an eviction candidate like any idle block."""
    m = BlockManager(10, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(3)],
                           enable_prefix_caching=True, watermark=0.0, grouped_results=True)
    p = list(range(1, 13))
    m.allocate("a", p, num_new_tokens=10)
    m.allocate("b", list(range(50, 58)))
    m.take_copy_plan()
    assert m.num_free_gpu_blocks == 0 and m.lookup_prefix(p).num_cached_tokens == 8
    released = set(m.block_table("a", 1)[:2].tolist())
    m.decode_step(["a", "b"], np.array([11, 12, 60]), num_new_tokens=[2, 1])
    m.take_copy_plan()
    m.check_invariants()
    assert m.block_table("a", 1)[:2].tolist() == [-1, -1]  # released by the window: the hit at 8 is not held
    assert {int(m.block_table("b", g)[2]) for g in (0, 1)} == released  # b's new blocks are those very blocks
    assert m.lookup_prefix(p).num_cached_tokens == 0
    m.free("a")
    m.free("b")
    m.check_invariants()


def _copy_of_a_cached_block(events: bool = False):
    """'a' prefills p in chunks; 'b' allocates p whole meanwhile, so b's block 1 caches p's second block first and
    a's chunk, which fills the same content, keeps its own block uncached (one block a key): a copy."""
    m = BlockManager(10, 4, num_cpu_blocks=8, enable_prefix_caching=True, watermark=0.0, enable_kv_events=events)
    p = list(range(1, 14))
    m.allocate("a", p, num_new_tokens=5)
    m.allocate("b", p)
    m.take_copy_plan()
    m.decode_step(["a"], np.array(p[5:9]), num_new_tokens=[4])
    m.take_copy_plan()
    m.check_invariants()
    a1, b1 = int(m.block_table("a")[1]), int(m.block_table("b")[1])
    assert a1 != b1 and m._cache.cid[a1] == 0 and m._cache.dupc[a1] == m._cache.cid[b1]
    return m, p, a1, b1


def test_a_held_copy_inherits_the_content_when_the_cached_block_is_evicted():
    """Toy-engine seed 23 (issue 23, item 1): r7/0 held an uncached copy (deduplicated against r13-r18's block of
    the same content); they were freed and their block evicted, and lookup_prefix found 0 of the 12 tokens r7/0
    holds. Now the held copy takes the evicted block's cache identity: same key and content id, no KV event."""
    m, p, a1, b1 = _copy_of_a_cached_block(events=True)
    m.free("b")
    m.events.take()
    m.allocate("c", list(range(100, 128)))  # 7 blocks: the 5 free ones, then b's blocks 3 and 2 (LRU) evicted
    m.take_copy_plan()
    m.check_invariants()
    assert b1 in m.block_table("c").tolist()  # the cached block went
    assert m.lookup_prefix(p).num_cached_tokens == 8  # was 4: the content stayed, in a's block
    removed = [k for e in m.events.take() if type(e).__name__ == "BlockRemoved" for k in e.block_hashes]
    assert pagedkv.block_hashes(p, 4)[1] not in removed and len(removed) == 1  # only block 2's content left
    assert m.stats.evictions == 1
    m.free("c")
    assert m.allocate("d", p) == 8 and int(m.block_table("d")[1]) == a1  # d shares a's block
    m.check_invariants()


def test_a_copy_freed_before_the_eviction_inherits_nothing():
    """A copy returned to the free ring forgets its record: the eviction then takes the content out as usual (its
    block may hold anything by then)."""
    m, p, a1, b1 = _copy_of_a_cached_block()
    m.free("a")
    assert m._cache.dupc[a1] == 0  # (back on the free ring)
    m.free("b")
    m.allocate("c", list(range(100, 140)))  # the whole pool: every free block and every cached one
    m.take_copy_plan()
    m.check_invariants()
    assert m.lookup_prefix(p).num_cached_tokens == 0 and not m._cache.dups


def test_a_copy_swapped_out_and_in_comes_back_as_the_content_it_copies():
    """Toy-engine seed 78: a sequence holding copies was swapped out (a copy's CPU block carried no identity) and
    in: its blocks came back uncached and unrecorded, so once the cached ones were freed and evicted lookup_prefix
    found 4 of its 8 tokens. A recorded copy now carries the content it copies to the CPU side: swapped in while
    the cached block is still there, the sequence shares that block (no copy made); once it is gone, the copy's
    block is cached as that content again."""
    m, p, a1, b1 = _copy_of_a_cached_block()
    pairs = m.swap_out(["a"])
    m.take_copy_plan()
    back = m.swap_in(["a"])
    m.take_copy_plan()
    m.check_invariants()
    assert int(m.block_table("a")[1]) == b1  # the cached content itself: one block fewer
    assert len(back) == len(pairs) - 2  # blocks 0 (shared already) and 1 came back without a copy
    m.free("b")
    m.allocate("c", list(range(100, 128)))
    m.take_copy_plan()
    m.check_invariants()
    assert m.lookup_prefix(p).num_cached_tokens == 8


def test_a_copy_swapped_out_while_its_content_is_evicted_is_cached_as_it_again():
    m, p, a1, b1 = _copy_of_a_cached_block()
    m.swap_out(["a"])
    m.take_copy_plan()
    m.free("b")
    m.allocate("c", list(range(100, 140)))  # the whole pool: b's cached blocks are evicted
    m.take_copy_plan()
    m.free("c")
    assert m.lookup_prefix(p).num_cached_tokens == 0
    m.swap_in(["a"])
    m.take_copy_plan()
    m.check_invariants()
    a1 = int(m.block_table("a")[1])
    assert m._cache.cid[a1] != 0 and m._cache.dupc[a1] == 0
    assert m.lookup_prefix(p).num_cached_tokens == 8


def test_a_windowed_row_swapped_in_keeps_its_window_findable():
    """Toy-engine seed 65 (issue 23, item 1): r11/0's sliding group (W = 3) had released block 0 when it was
    swapped out; its block 1 was an uncached copy (s0 cached the same content first), came back uncached, and a
    row with released blocks is not registered again from the root: once s0's blocks were evicted lookup_prefix
    found 4 (here) or 0 (there) of the 8 tokens the sequence holds. The copy now carries its content through the
    CPU side: the sequence shares s0's block, which stays cached while it holds it."""
    m = BlockManager(20, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(3)], num_cpu_blocks=16,
                           enable_prefix_caching=True, watermark=0.0, grouped_results=True)
    p = list(range(1, 9))
    m.allocate("s0", p)
    m.take_copy_plan()
    m.allocate("s1", p)  # hit 4: s1 fills block 1 itself, in both groups a copy of s0's
    m.take_copy_plan()
    m.decode_step(["s1"], np.array([9]))  # the sliding group's window moves past block 0: released
    m.take_copy_plan()
    assert m.block_table("s1", 1)[0] == -1
    m.swap_out(["s1"])
    m.take_copy_plan()
    m.swap_in(["s1"])
    m.take_copy_plan()
    m.check_invariants()
    assert m.block_table("s1", 1)[1] == m.block_table("s0", 1)[1]
    m.free("s0")
    m.allocate("big", list(range(100, 128)))  # evicts every idle cached block
    m.take_copy_plan()
    m.free("big")
    m.check_invariants()
    assert m.lookup_prefix(p + [9]).num_cached_tokens == 8  # was 4


def test_a_windowed_row_swapped_in_copies_a_content_cached_again():
    """The other way a windowed row's block comes back uncached: its content was evicted while it was out and
    cached again by another sequence (new content ids, the same keys): a sliding group's block is recorded as a
    copy of it (its hits check a window by chained key and tokens: the parent's new content id is no obstacle),
    so it takes that content's identity when the other block is evicted first."""
    m = BlockManager(24, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(3)], num_cpu_blocks=16,
                           enable_prefix_caching=True, watermark=0.0, grouped_results=True)
    p = list(range(1, 9))
    m.allocate("a", p)
    m.take_copy_plan()
    m.decode_step(["a"], np.array([9]))  # the sliding group releases block 0
    m.take_copy_plan()
    m.swap_out(["a"])
    m.take_copy_plan()
    m.allocate("big", list(range(100, 144)))  # the whole pool: a's idle cached blocks are evicted
    m.take_copy_plan()
    m.free("big")
    m.allocate("b", p)  # p cached again: new content ids
    m.take_copy_plan()
    m.swap_in(["a"])
    m.take_copy_plan()
    m.check_invariants()
    a1, b1 = int(m.block_table("a", 1)[1]), int(m.block_table("b", 1)[1])
    assert a1 != b1 and m._cache.cid[a1] == 0 and m._cache.dupc[a1] == m._cache.cid[b1]
    m.free("b")
    m.allocate("c", list(range(200, 236)))  # evicts b's blocks: a's copies inherit their contents
    m.take_copy_plan()
    m.check_invariants()
    assert m._cache.cid[a1] != 0
    assert m.lookup_prefix(p + [9]).num_cached_tokens == 8


def test_a_swapped_in_sequence_chains_on_from_its_prefix_cached_again():
    """Issue 23, item 1.2, re-cached chains: 'a' was swapped out, its blocks evicted, and 'b' cached the same prefix
    again under new content ids. Swapped in, a's blocks could not adopt their old identity (the keys are taken)
    and its chain ended in the gone content, so the block its next chunk filled was cached under it, unreachable:
    lookup_prefix found 8 of the 12 tokens it holds. Swap-in now walks such a row's prefix: its blocks become copies
    of the contents cached again and its chain continues from them."""
    m = BlockManager(8, 4, num_cpu_blocks=8, enable_prefix_caching=True, watermark=0.0)
    p = list(range(1, 10))
    m.allocate("a", p)
    m.take_copy_plan()
    m.swap_out(["a"])
    m.take_copy_plan()
    m.allocate("big", list(range(100, 132)))  # the whole pool: a's idle cached blocks are evicted
    m.take_copy_plan()
    m.free("big")
    assert m.lookup_prefix(p).num_cached_tokens == 0
    m.allocate("b", p)  # the same prefix, cached again: new content ids
    m.take_copy_plan()
    m.swap_in(["a"])
    m.take_copy_plan()
    m.check_invariants()
    m.decode_step(["a"], [10, 11, 12], num_new_tokens=[3])  # fills a's block 2
    m.take_copy_plan()
    m.check_invariants()
    q = list(range(1, 13)) + [99]
    assert m.lookup_prefix(q).num_cached_tokens == 12  # was 8
    m.free("b")
    m.allocate("c", list(range(200, 220)))  # evicts b's blocks: a's copies inherit their contents
    m.take_copy_plan()
    m.check_invariants()
    assert m.lookup_prefix(q).num_cached_tokens == 12


def _findability_walk(seed: int, hybrid: bool) -> int:
    """Random allocate / decode (chunks of 1-3 tokens) / free over small pools, windows and block sizes; after
    every allocate the prompt's full blocks (up to one token before its end) must be found. Returns the checks."""
    rng = random.Random(seed)
    bs, nb, w = rng.choice([1, 2, 4]), rng.randint(4, 12), rng.randint(1, 9)
    if hybrid:
        m = BlockManager(nb, bs, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(w)],
                               enable_prefix_caching=True, grouped_results=True)
    else:
        m = BlockManager(nb, bs, sliding_window=rng.choice([None, w]), enable_prefix_caching=True)
    live, checks = {}, 0
    base = [rng.randint(1, 3) for _ in range(40)]
    for step in range(60):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 20)
            k = rng.randint(0, n)
            p = base[:k] + [rng.randint(1, 3) for _ in range(n - k)]
            if m.can_allocate(p) != AllocStatus.OK:
                continue
            m.allocate(step, p)
            live[step] = p
            assert m.lookup_prefix(p).num_cached_tokens == (len(p) - 1) // bs * bs, (seed, step)
            checks += 1
        elif op < 0.7 and live:
            s = rng.choice(list(live))
            t = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
            if m.can_append_slots([s], num_new_tokens=len(t)):
                m.decode_step([s], np.array([t]))
        elif live:
            s = rng.choice(list(live))
            del live[s]
            m.free(s)
        m.take_copy_plan()
        m.check_invariants()
    return checks


@pytest.mark.parametrize("hybrid", [False, True])
def test_every_allocated_prompt_is_findable(hybrid):
    # (before the fixes: 14 of these 300 walks failed single-group, 48 hybrid)
    assert sum(_findability_walk(seed, hybrid) for seed in range(300)) > 1000


# ---------------------------------------------------------------------------------------------- B: free in step
def _stepping(m):
    m.allocate("warm", [1, 2, 3])
    m.take_copy_plan()  # (the first plan switches the same-step checks on)
    m.free("warm")


@pytest.mark.parametrize("hybrid", [False, True])
def test_free_of_a_sequence_handed_slots_this_step_is_refused(hybrid):
    m = BlockManager(16, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(6)],
                           enable_prefix_caching=True, grouped_results=True) if hybrid else BlockManager(16, 4, enable_prefix_caching=True)
    _stepping(m)
    p = list(range(1, 10))
    m.allocate("a", p)
    if not hybrid:  # (the hybrid's refusal comes from its group 0 manager, unchanged state checked below)
        check_raises(m, SequenceStateError, m.free, "a", must_mention=("'a'", "cache=False"))
    else:
        with pytest.raises(SequenceStateError):
            m.free("a")
        m.check_invariants()
    assert "a" in m and m.lookup_prefix(p).num_cached_tokens == 8  # still cached, pending
    m.free("a", cache=False)  # the abort path stays open and withdraws what nobody wrote
    assert "a" not in m and m.lookup_prefix(p).num_cached_tokens == 0
    m.allocate("b", p)
    m.take_copy_plan()
    m.free("b")  # after the step: written, cached
    assert m.lookup_prefix(p).num_cached_tokens == 8
    m.allocate("c", p)
    m.take_copy_plan()
    m.decode_step(["c"], [5])
    with pytest.raises(SequenceStateError):
        m.free("c")
    m.take_copy_plan()
    m.free("c")
    m.check_invariants()


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("rechain", [False, True])
def test_a_sequence_swapped_in_this_step_is_always_aborted_with_cache_false(hybrid, rechain):
    """Issue 23, item 1.3: 'a' is swapped in in the step that 'b' cached a's prefix again, through the CPU tier
    (a's swap-in then reuses b's blocks, whose KV this step's forward writes: 'a' counts as handed slots) or
    anew (a's blocks come back as copies of b's, re-registered from the root by Swapper.rechain). free(a) is
    refused in the first case (issue 23 B) and free(a, cache=False) always succeeds, withdrawing nothing of the
    swap-in (its KV is the plan's copies); b's own abort is then free too. Issue 32, departure 1: without the
    tier a's swap-in shares b's blocks too (found from the root by key, tokens and parent), so it counts as handed
    slots in both cases."""
    kw = dict(num_cpu_blocks=16, enable_prefix_caching=True, cpu_prefix_cache=not rechain, watermark=0.0)
    if hybrid:
        m = BlockManager(16, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(5)], **kw, grouped_results=True)
    else:
        m = BlockManager(8, 4, **kw)
    _stepping(m)
    p = list(range(1, 10))
    m.allocate("a", p)
    m.take_copy_plan()
    m.swap_out(["a"])
    m.take_copy_plan()
    m.allocate("big", list(range(100, 132)))  # evicts a's idle cached blocks (into the CPU tier if on)
    m.take_copy_plan()
    m.free("big")
    m.allocate("b", p)  # this step: p cached again (the tier's content ids, or new ones)
    m.swap_in(["a"])
    m.check_invariants()
    shared = int(m.block_table("a")[0]) == int(m.block_table("b")[0])
    assert shared  # reused (pending): through the tier, or found cached again from the root without it
    with pytest.raises(SequenceStateError):
        m.free("a")
    m.check_invariants()
    cached = m.lookup_prefix(p).num_cached_tokens
    m.free("a", cache=False)
    m.check_invariants()
    assert "a" not in m and m.lookup_prefix(p).num_cached_tokens == cached == 8  # b's blocks: b's to withdraw
    m.free("b", cache=False)
    m.take_copy_plan()
    m.check_invariants()
    # b's own blocks are withdrawn; through the tier they were promotions (the plan's copies write their KV)
    assert m.lookup_prefix(p).num_cached_tokens == (0 if rechain else 8)


def test_free_in_step_is_allowed_without_prefix_caching_and_before_the_first_plan():
    m = BlockManager(8, 4)
    _stepping(m)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.free("a")  # nothing is cached: nothing can be found as computed
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.free("a")  # no step known yet (the same-step checks start with the first take_copy_plan)
    m.check_invariants()


# ---------------------------------------------------------------------------------------------- C: windowed chunks
@pytest.mark.parametrize("caching", [False, True])
def test_windowed_manager_admits_a_chunked_prompt_longer_than_its_pool(caching):
    p = list(range(1, 81))
    hyb = BlockManager(10, 4, kv_cache_groups=[SlidingWindowSpec(4)], enable_prefix_caching=caching, grouped_results=True)
    m = BlockManager(10, 4, sliding_window=4, enable_prefix_caching=caching)
    assert hyb.can_allocate(p, num_new_tokens=8) == m.can_allocate(p, num_new_tokens=8) == AllocStatus.OK
    assert m.can_allocate(p) == AllocStatus.NEVER  # whole, it never fits
    check_raises(m, PromptTooLongError, m.allocate, "x", p)
    assert m.can_allocate(p, num_new_tokens=40) == AllocStatus.NEVER  # 3 + 40 tokens at once: 12 blocks
    check_raises(m, PromptTooLongError, m.allocate, "x", p, num_new_tokens=40)
    m.allocate("a", p, num_new_tokens=8)
    m.take_copy_plan()
    while m.num_tokens("a") < len(p):
        n = m.num_tokens("a")
        assert m.can_append_slots(["a"], num_new_tokens=8)
        m.decode_step(["a"], np.array(p[n : n + 8]), num_new_tokens=[8])
        m.take_copy_plan()
        m.check_invariants()
        assert (m.block_table("a") >= 0).sum() <= 4
    assert (m.block_table("a") >= 0).sum() == 3
    m.free("a")
    m.check_invariants()


def test_windowed_chunked_hit_is_cut_to_fit_the_pool():
    """A cached prefix as large as the pool: the hit plus the first chunk must fit, so the hit is cut (lookup_prefix
    and can_allocate predict the same), else the prompt would wait for blocks forever."""
    m = BlockManager(6, 4, sliding_window=4, enable_prefix_caching=True, watermark=0)
    p = list(range(1, 31))  # 7 full blocks + 2
    m.allocate("a", p[:24])  # 6 full blocks, all cached
    m.take_copy_plan()
    m.free("a")
    assert m.lookup_prefix(p).num_cached_tokens == 24
    hit = m.lookup_prefix(p, num_new_tokens=8)
    assert (hit.num_cached_tokens, hit.num_new_blocks) == (16, 6)  # 4 hit blocks + 2 chunk blocks: the pool
    assert m.can_allocate(p, num_new_tokens=8) == AllocStatus.OK
    assert m.allocate("b", p, num_new_tokens=8) == 16
    assert m.num_tokens("b") == 24
    m.check_invariants()
    m.take_copy_plan()
    m.decode_step(["b"], np.array(p[24:]), num_new_tokens=[6])
    m.check_invariants()


def _pool_sized_prefix():
    m = BlockManager(8, 4, sliding_window=4, enable_prefix_caching=True, watermark=0.25, enable_kv_events=True)
    p = list(range(1, 31))
    m.allocate("a", p[:24])  # 6 full blocks, all cached: the pool less its watermark of 2
    m.take_copy_plan()
    m.free("a")
    return m, p


def test_windowed_chunked_hit_is_cut_in_allocate_batch_as_in_allocate():
    """Issue 23, item 1.3: allocate_batch cuts a windowed chunked prompt's hit to fit the pool less the watermark
    as allocate does. Its walk over the batch did not: 'b' wanted its 6 hit blocks plus 2 and the batch with 'x'
    was refused (9 blocks of 8), though the consecutive calls admit both (b: 4 hits + 2 new, x: 1)."""
    a, p = _pool_sized_prefix()
    b, _ = _pool_sized_prefix()
    q = [90, 91]
    res = a.allocate_batch(["b", "x"], [p, q], num_new_tokens=[8, 8])
    hits = [b.allocate("b", p, num_new_tokens=8), b.allocate("x", q, num_new_tokens=8)]
    assert res.num_cached_tokens.tolist() == hits == [16, 0]
    for s in ("b", "x"):
        assert a.block_table(s).tolist() == b.block_table(s).tolist() and a.num_tokens(s) == b.num_tokens(s)
    assert a.num_tokens("b") == 24 and a.events.take() == b.events.take()
    a.check_invariants()
    a.take_copy_plan()
    a.decode_step(["b"], np.array(p[24:]), num_new_tokens=[6])
    a.check_invariants()


# ---------------------------------------------------------------------------------------------- D: hybrid hit rule
def test_hybrid_hit_needs_the_w_minus_1_positions_the_first_query_reads():
    """W % block_size == 1 (W = 5, block_size 4): the first query at L = 12 reads positions 8..11, block 2 only;
    the old rule asked for [7, 12), blocks 1 and 2, and lost the hit when block 1 was gone."""
    m = BlockManager(12, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(5)],
                           enable_prefix_caching=True, grouped_results=True)
    p = list(range(1, 14))
    m.allocate("a", p)
    m.take_copy_plan()
    m.decode_step(["a"], [20])
    m.take_copy_plan()
    t1 = m.block_table("a", 1)
    assert t1[:2].tolist() == [-1, -1]  # released by the window (positions < 14 - 5 + 1 = 10)
    m.allocate("b", list(range(200, 212)))  # takes the free blocks, then evicts group 1's released ones
    m.take_copy_plan()
    m.free("b")
    cached = set(m._cache.mapping().values())
    assert t1[2] in cached and t1[1] not in cached
    hit = m.lookup_prefix(p)
    assert hit.num_cached_tokens == 12  # the old rule: 8 (block 1 of group 1 missing)
    assert m.allocate("c", p) == 12
    assert m.block_table("c", 1).tolist()[:3] == [-1, -1, int(t1[2])]
    m.check_invariants()


def test_hybrid_window_of_one_token_needs_no_cached_block():
    m = BlockManager(16, 2, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(1)],
                           enable_prefix_caching=True, grouped_results=True)
    p = list(range(1, 10))
    m.allocate("a", p)
    m.take_copy_plan()
    m.free("a")
    assert m.lookup_prefix(p).num_cached_tokens == 8
    assert m.allocate("b", p) == 8
    t1 = m.block_table("b", 1).tolist()
    assert t1[:4] == [-1, -1, -1, -1] and t1[4] >= 0  # nothing held before the hit point
    m.take_copy_plan()
    m.decode_step(["b"], [3])
    m.check_invariants()


def test_router_index_scores_the_same_window_rule():
    """The router's hybrid match (cluster.index) needs ceil((W - 1) / block_size) blocks before L, as the engine."""
    m = BlockManager(12, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(5)],
                           enable_prefix_caching=True, enable_kv_events=True, grouped_results=True)
    p = list(range(1, 14))
    m.allocate("a", p)
    m.take_copy_plan()
    m.decode_step(["a"], [20])
    m.take_copy_plan()
    m.allocate("b", list(range(200, 212)))
    m.take_copy_plan()
    m.free("b")
    idx = MemoryIndex()
    idx.apply_all("r0", m.events.take())
    keys = PromptKeys(p, 4)
    assert m.lookup_prefix(p).num_cached_tokens == 12
    assert idx.longest_prefix(keys) == {"r0": 3}


def test_a_pinned_idle_block_is_never_handed_over():
    """A new block of the same content as a pinned idle (parked) block keeps its own, uncached: the pinned block
    cannot be evicted, and the pin holds that very block. Handing it over (as an unpinned idle block is) freed the
    pinned block: the allocation took no block of the free count, and once the sequence was freed the pin held
    nothing (found by the stateful machine after merging pins with issue 23 A's fix)."""
    bm = BlockManager(8, 2, enable_prefix_caching=True, pin_budget_blocks=2, watermark=0.0)
    bm.allocate("a", [1, 0, 5])
    bm.take_copies()
    bm.free("a")
    pin = bm.retention.pin_prefix([1, 0])
    assert pin.num_blocks == 1
    free = bm.num_free_gpu_blocks
    assert bm.lookup_prefix([1, 0]).num_new_blocks == 1
    bm.allocate("b", [1, 0])
    bm.take_copies()
    assert bm.num_free_gpu_blocks == free - 1
    bm.check_invariants()
    bm.free("b")
    bm.check_invariants()
    assert bm.retention.num_pinned_blocks == 1 and bm.num_free_gpu_blocks == free  # the pinned block is not free
    assert bm.lookup_prefix([1, 0, 3]).num_cached_tokens == 2
