"""External KV in the BlockManager (docs/external-kv.md): loads into reserved blocks (LOADING, done, failed, abort
while loading: parked), holds with leases, store plans by write policy, and the races of the contract, each
with a test; check_invariants after every call."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager, block_hashes
from pagedkv.errors import (DuplicateSequenceError, InvalidArgumentError, OutOfBlocksError, SequenceStateError,
                            UnknownHoldError, UnknownSequenceError, UnknownStoreError)

BS = 4
SYS = list(range(1, 9))  # two full blocks shared by the prompts below


def prompt(tag: int, n: int = 20) -> list[int]:
    return SYS + [1000 * tag + i for i in range(n)]


def mgr(**kw) -> BlockManager:
    kw.setdefault("enable_prefix_caching", True)
    return BlockManager(kw.pop("num_gpu_blocks", 32), BS, **kw)


def warm(m: BlockManager) -> None:
    """SYS cached (and idle): a later prompt's hit is 8 tokens."""
    m.allocate("warm", SYS + [7])
    m.take_copy_plan()
    m.free("warm")


def snapshot(m: BlockManager) -> tuple:
    return (m.num_free_gpu_blocks, m.stats.num_cached_blocks, m.seq_ids, m.external.loading_seq_ids, m.external.parked_seq_ids,
            tuple(m.external.holds), m.external.pending_stores, {s: m.block_table(s).tolist() for s in m.seq_ids})


# ------------------------------------------------------------------ loads
def test_load_done_registers_only_at_finish():
    m = mgr(enable_kv_events=True)
    warm(m)
    m.events.take()
    p = prompt(1)  # 28 tokens: 2 hit blocks, external 3 blocks, then the rest computed
    assert m.allocate("a", p, num_external_tokens=12) == 20
    ext = m.external.external_blocks("a")
    assert (ext.start_token, ext.num_tokens, len(ext.block_ids)) == (8, 12, 3)
    assert ext.keys == tuple(block_hashes(p[:20], BS)[2:])
    assert ext.group_block_ids == (ext.block_ids,)
    assert m.external.is_loading("a") and m.external.loading_seq_ids == ("a",) and "a" in m and len(m) == 1
    m.check_invariants()
    # not findable while loading, no events
    assert m.lookup_prefix(p).num_cached_tokens == 8
    assert m.events.take() == []
    assert m.external.finish_external(done=["a"]) == {"a": 20}
    m.check_invariants()
    assert not m.external.is_loading("a") and m.external.external_blocks("a") is None
    # findable right after finish: every full block of the held prompt
    assert m.lookup_prefix(p).num_cached_tokens == 24
    stored = [k for e in m.events.take() for k in e.block_hashes]
    assert stored == block_hashes(p, BS)[2:]
    m.decode_step(["a"], [5])  # the sequence runs as usual
    m.check_invariants()


def test_finish_counts_as_a_step_handing_slots_out():
    m = mgr()
    m.take_copy_plan()  # same-step checks on
    m.allocate("a", prompt(1), num_external_tokens=12)
    m.take_copy_plan()
    m.external.finish_external(done=["a"])
    with pytest.raises(SequenceStateError):  # its prefill runs in this step's forward
        m.free("a")
    m.free("a", cache=False)  # an abort withdraws the computed blocks, keeps the loaded ones
    m.check_invariants()
    assert m.lookup_prefix(prompt(1)).num_cached_tokens == 12  # the 3 external blocks (no hit: nothing warm)


def test_loading_refuses_the_step_calls_and_changes_nothing():
    m = mgr(num_cpu_blocks=16)
    warm(m)
    m.allocate("a", prompt(1), num_external_tokens=12)
    before = snapshot(m)
    calls = [lambda: m.decode_step(["a"], [1]), lambda: m.decode_step(["a"], np.array([1])),
             lambda: m.append_slots("a", [1]), lambda: m.fork("a", "c"), lambda: m.swap_out(["a"]),
             lambda: m.swap_in(["a"]), lambda: m.external.hold("a", 10.0), lambda: m.free("a", hold_for=10.0),
             lambda: m.can_append_slots(["a"])]
    for call in calls:
        with pytest.raises(SequenceStateError):
            call()
        assert snapshot(m) == before
        m.check_invariants()
    # the read-only queries answer
    assert m.num_tokens("a") == 28 and m.block_table("a").size == 7 and m.slot_mapping("a", 8, 12).size == 4
    assert m.table_rows(["a"]).size == 1 and not m.is_swapped("a")
    with pytest.raises(DuplicateSequenceError):
        m.allocate("a", prompt(2))
    m.allocate("p", [1, 2, 3])
    with pytest.raises(DuplicateSequenceError):  # a fork's child id is checked against the LOADING ids too
        m.fork("p", "a")
    m.free("p", cache=False)


def test_failed_load_keeps_the_intact_part_and_computes_the_rest():
    m = mgr()
    warm(m)
    p = prompt(1)
    m.allocate("a", p, num_external_tokens=12)
    assert m.external.finish_external(failed={"a": 4}) == {"a": 12}
    m.check_invariants()
    assert m.num_tokens("a") == len(p)  # never a silent truncation: the rest is computed by the prefill
    m.take_copy_plan()
    m.free("a")
    assert m.lookup_prefix(p).num_cached_tokens == 24


def test_abort_while_loading_parks_the_blocks_until_reported():
    m = mgr(num_gpu_blocks=12, watermark=0)
    warm(m)
    m.allocate("a", prompt(1), num_external_tokens=12)
    ext = set(m.external.external_blocks("a").block_ids)
    m.free("a")
    assert m.external.parked_seq_ids == ("a",) and "a" not in m
    m.check_invariants()
    assert m.num_free_gpu_blocks == 12 - 3
    with pytest.raises(DuplicateSequenceError):
        m.allocate("a", prompt(2))
    # the whole rest of the pool is handed out; never a parked block
    m.allocate("x", list(range(5000, 5000 + 9 * BS - 1)))
    assert not ext & set(m.block_table("x").tolist())
    with pytest.raises(OutOfBlocksError):
        m.allocate("y", [1, 2, 3])
    m.check_invariants()
    assert m.external.finish_external(done=["a"]) == {}  # after abort: frees the parked blocks, not in the result
    assert m.external.parked_seq_ids == () and m.num_free_gpu_blocks == 3
    m.check_invariants()
    with pytest.raises(UnknownSequenceError):  # reported again
        m.external.finish_external(done=["a"])
    m.allocate("a", prompt(2)[:5])


def test_finish_validates_everything_first():
    m = mgr()
    m.allocate("a", prompt(1), num_external_tokens=12)
    m.allocate("b", prompt(2), num_external_tokens=8)
    m.allocate("c", [1, 2, 3])
    before = snapshot(m)
    bad = [dict(done=["a", "zz"]), dict(done=["a", "c"]), dict(done=["a"], failed={"a": 0}),
           dict(done=["a", "a"]), dict(failed={"a": 12}), dict(failed={"a": 3}), dict(failed={"a": -4}),
           dict(failed={"a": True}), dict(done="a"), dict(failed=[("a", 0)]), dict(done=[["a"]])]
    errs = (UnknownSequenceError, SequenceStateError, InvalidArgumentError)
    for kw in bad:
        with pytest.raises(errs):
            m.external.finish_external(**kw)
        assert snapshot(m) == before
        m.check_invariants()
    assert m.external.finish_external(done=["a"], failed={"b": 0}) == {"a": 12, "b": 0}
    with pytest.raises(SequenceStateError):  # reported twice
        m.external.finish_external(done=["a"])
    m.check_invariants()


def test_allocate_decides_the_external_range_not_the_lookup():
    """Race: another request takes the looked-up prefix's blocks between lookup and allocation."""
    m = mgr(num_gpu_blocks=10, watermark=0)
    warm(m)
    p = prompt(1)
    assert m.lookup_prefix(p).num_cached_tokens == 8
    m.allocate("hog", list(range(3000, 3000 + 10 * BS - 1)))  # evicts SYS
    m.take_copy_plan()
    m.free("hog")
    assert m.allocate("a", p, num_external_tokens=12) == 12  # hit 0: the range starts at 0
    ext = m.external.external_blocks("a")
    assert ext.start_token == 0 and ext.keys == tuple(block_hashes(p[:12], BS))
    m.check_invariants()


def test_external_range_is_cut_before_the_last_token():
    m = mgr()
    p = list(range(1, 13))  # 12 tokens: at most 8 loaded (the last block holds the token to compute)
    assert m.allocate("a", p, num_external_tokens=40) == 8
    assert m.external.external_blocks("a").num_tokens == 8
    assert m.allocate("b", [1, 2, 3], num_external_tokens=4) == 0  # nothing to load: RUNNING
    assert m.external.external_blocks("b") is None and not m.external.is_loading("b")
    m.check_invariants()


def test_bad_arguments():
    m = mgr()
    for e in (3, -4, 4.0, True, "8"):
        with pytest.raises(InvalidArgumentError):
            m.allocate("a", prompt(1), num_external_tokens=e)
    assert len(m) == 0
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, BS, sliding_window=8).allocate("a", prompt(1), num_external_tokens=4)
    with pytest.raises(UnknownSequenceError):
        m.external.external_blocks("nope")
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, BS, store_policy="write_through")
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, BS, enable_prefix_caching=True, store_policy="write_sideways")
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, BS, enable_prefix_caching=True, store_policy="selective", store_min_hits=0)
    m.check_invariants()


def test_without_prefix_caching():
    m = BlockManager(16, BS)
    assert m.allocate("a", prompt(1), num_external_tokens=12) == 12
    assert m.external.external_blocks("a").start_token == 0
    assert m.external.finish_external(done=["a"]) == {"a": 12}
    m.decode_step(["a"], [1])
    m.check_invariants()


def test_chunked_prefill_with_external_tokens():
    m = mgr()
    warm(m)
    p = prompt(1, 40)  # 48 tokens
    assert m.allocate("a", p, num_external_tokens=8, num_new_tokens=8) == 16
    assert m.num_tokens("a") == 24  # hit 8 + external 8 + one chunk of 8
    m.check_invariants()
    m.external.finish_external(done=["a"])
    m.take_copy_plan()
    m.decode_step(["a"], p[24:32], num_new_tokens=[8])
    m.check_invariants()
    with pytest.raises(SequenceStateError):
        m.fork("a", "b")  # the prompt is not all appended yet


def test_allocate_batch_with_external_tokens():
    m = mgr()
    warm(m)
    ps = [prompt(1), prompt(2), prompt(1)]
    b = m.allocate_batch(["a", "b", "c"], ps, num_external_tokens=[12, 0, 8])
    assert b.num_cached_tokens.tolist() == [20, 8, 16]
    assert m.external.loading_seq_ids == ("a", "c")
    assert b.seq_lens.tolist() == [28, 28, 28]
    assert b.query_start_loc.tolist() == [0, 8, 28, 40]
    m.check_invariants()
    before = snapshot(m)
    with pytest.raises(DuplicateSequenceError):
        m.allocate_batch(["d", "d"], ps[:2], num_external_tokens=[4, 4])
    with pytest.raises(InvalidArgumentError):
        m.allocate_batch(["d", "e"], ps[:2], num_external_tokens=[4])
    with pytest.raises(OutOfBlocksError):
        m.allocate_batch(["d", "e"], [prompt(7, 60), prompt(8, 60)], num_external_tokens=[4, 4])
    assert snapshot(m) == before
    m.external.finish_external(done=["a", "c"])
    m.check_invariants()


def test_reset_prefix_cache_while_loading():
    m = mgr()
    warm(m)
    m.allocate("a", prompt(1), num_external_tokens=12)
    m.reset_prefix_cache()
    m.check_invariants()
    assert m.external.finish_external(done=["a"]) == {"a": 20}
    m.check_invariants()
    assert m.lookup_prefix(prompt(1)).num_cached_tokens == 0  # the broken chain caches nothing


# ------------------------------------------------------------------ holds
def test_hold_keeps_blocks_findable_and_unreusable():
    m = mgr(num_gpu_blocks=12, watermark=0)
    p = prompt(1)
    m.allocate("a", p)
    m.take_copy_plan()
    h = m.free("a", hold_for=480.0, now=100.0)
    assert h.expires_at == 580.0 and h.num_tokens == 28 and len(h.block_ids) == 7 and h.seq_id == "a"
    assert m.external.holds == (h,)
    m.check_invariants()
    assert m.lookup_prefix(p).num_cached_tokens == 24  # still findable
    assert m.num_free_gpu_blocks == 5
    with pytest.raises(OutOfBlocksError):  # never evicted for another prompt
        m.allocate("x", list(range(5000, 5000 + 6 * BS)))
    m.allocate("x", list(range(5000, 5000 + 5 * BS)))
    assert not set(h.block_ids) & set(m.block_table("x").tolist())
    m.check_invariants()
    m.external.release_hold(h.hold_id)
    with pytest.raises(UnknownHoldError):
        m.external.release_hold(h.hold_id)
    m.check_invariants()
    assert m.num_free_gpu_blocks == 7


def test_hold_leases_renew_and_expire_on_an_injected_clock():
    m = mgr()
    m.allocate("a", prompt(1))
    m.allocate("b", prompt(2))
    h1 = m.external.hold("a", 10.0, now=0.0)
    h2 = m.external.hold("b", 20.0, now=0.0)
    h3 = m.external.hold("a", 5.0, now=0.0)  # held twice
    m.check_invariants()
    assert m.external.renew_hold(h3.hold_id, 30.0, now=1.0).expires_at == 31.0
    assert m.external.expire_holds(now=9.9) == []
    assert m.external.expire_holds(now=20.0) == [h1.hold_id, h2.hold_id]
    m.check_invariants()
    for bad in (h1.hold_id, 999, "x", None):
        with pytest.raises(UnknownHoldError):
            m.external.renew_hold(bad, 1.0)
    for bad in (0, -1, float("inf"), True, "1"):
        with pytest.raises(InvalidArgumentError):
            m.external.renew_hold(h3.hold_id, bad)
        with pytest.raises(InvalidArgumentError):
            m.external.hold("a", bad)
    m.take_copy_plan()
    m.free("a")
    m.free("b")
    assert [h.hold_id for h in m.external.holds] == [h3.hold_id]
    assert m.external.expire_holds(now=31.0) == [h3.hold_id]
    m.check_invariants()
    assert m.num_free_gpu_blocks == 32


def test_a_write_into_a_held_block_copies_on_write():
    m = mgr()
    m.allocate("a", list(range(1, 7)))  # a partial second block
    h = m.external.hold("a", 10.0, now=0.0)
    res = m.decode_step(["a"], [99])
    assert res.cow.tolist() == [[h.block_ids[1], m.block_table("a")[1]]]
    m.check_invariants()


def test_free_with_hold_for_is_all_or_nothing():
    m = mgr()
    m.take_copy_plan()
    m.allocate("a", prompt(1))
    before = snapshot(m)
    with pytest.raises(SequenceStateError):  # handed slots in this step
        m.free("a", hold_for=10.0)
    assert snapshot(m) == before
    m.check_invariants()
    m.take_copy_plan()
    assert m.free("a", hold_for=10.0, now=0.0).hold_id == 1  # (the failed one took no id)


def test_hold_refused_for_a_swapped_sequence():
    m = mgr(num_cpu_blocks=16)
    m.allocate("a", prompt(1))
    m.take_copy_plan()
    m.swap_out(["a"])
    with pytest.raises(SequenceStateError):
        m.external.hold("a", 10.0)
    m.check_invariants()


# ------------------------------------------------------------------ stores
def test_write_through_plans_each_registered_block_once_and_pins_it():
    m = mgr(num_gpu_blocks=10, watermark=0, store_policy="write_through")
    assert m.external.take_store_plan() is None
    p = prompt(1, 12)  # 20 tokens: 5 full blocks registered by allocate
    m.allocate("a", p)
    assert m.external.take_store_plan() is None  # their KV is written by this step's forward: planned after it
    m.take_copy_plan()
    plan = m.external.take_store_plan()
    assert plan.keys == tuple(block_hashes(p, BS)) and len(plan.block_ids) == 5
    assert m.external.pending_stores == (plan.store_id,)
    assert m.external.take_store_plan() is None
    m.check_invariants()
    m.take_copy_plan()
    m.free("a")
    # pinned: a store never reads a reused block
    with pytest.raises(OutOfBlocksError):
        m.allocate("x", list(range(5000, 5000 + 6 * BS)))
    m.allocate("x", list(range(5000, 5000 + 5 * BS - 1)))
    assert not set(plan.block_ids) & set(m.block_table("x").tolist())
    m.check_invariants()
    m.external.complete_store(plan.store_id, success=True)
    with pytest.raises(UnknownStoreError):
        m.external.complete_store(plan.store_id)
    m.check_invariants()
    m.take_copy_plan()
    plan2 = m.external.take_store_plan()  # x's blocks, none of a's
    assert not set(plan2.block_ids) & set(plan.block_ids)
    m.external.complete_store(plan2.store_id, success=False)
    m.check_invariants()


def test_write_through_plans_a_load_only_once_it_is_done():
    m = mgr(store_policy="write_through")
    m.allocate("a", prompt(1), num_external_tokens=12)
    m.take_copy_plan()
    assert m.external.take_store_plan() is None  # nothing registered while loading
    m.external.finish_external(done=["a"])
    m.take_copy_plan()
    assert len(m.external.take_store_plan().block_ids) == 7


def test_selective_plans_a_block_hit_often_enough():
    m = mgr(store_policy="selective", store_min_hits=2)
    p = prompt(1)
    for i in range(3):
        m.allocate(i, p)
        m.take_copy_plan()
        plan = m.external.take_store_plan()
        if i < 2:
            assert plan is None
        else:
            assert len(plan.block_ids) == 6  # every full block but the last (the last block is computed)
    m.check_invariants()
    m.external.complete_store(plan.store_id, True)
    for i in range(3, 6):
        m.allocate(i, p)
        assert m.external.take_store_plan() is None  # stored already
    m.check_invariants()


def test_write_back_plans_the_next_victims_and_pins_them_until_stored():
    m = mgr(num_gpu_blocks=32, watermark=0, store_policy="write_back")  # at most 16 pinned at once
    assert m.external.take_store_plan() is None  # nothing cached and idle
    a = prompt(1, 12)  # 20 tokens: 5 full blocks
    m.allocate("a", a)
    m.take_copy_plan()
    assert m.external.take_store_plan() is None  # referenced: nothing is about to be evicted
    m.free("a")
    plan = m.external.take_store_plan()  # a's 5 idle cached blocks are the next victims
    assert set(plan.keys) == set(block_hashes(a, BS)) and len(plan.block_ids) == 5
    assert m.num_free_gpu_blocks == 27 and m.external.take_store_plan() is None  # pinned: not evictable, not replanned
    m.check_invariants()
    with pytest.raises(OutOfBlocksError):  # the pinned blocks cannot be evicted for another prompt ...
        m.allocate("x", list(range(5000, 5000 + 28 * BS)))
    m.allocate("x", list(range(5000, 5000 + 27 * BS)))  # ... the rest can
    assert not set(plan.block_ids) & set(m.block_table("x").tolist())
    m.check_invariants()
    m.external.complete_store(plan.store_id, success=True)  # stored: evictable again, never planned again
    m.take_copy_plan()
    m.free("x")
    plan2 = m.external.take_store_plan()  # the next victims: x's blocks (27 full), at most 16, none of a's
    assert len(plan2.block_ids) == 16 and not set(plan2.block_ids) & set(plan.block_ids)
    assert set(plan2.keys) <= set(block_hashes(list(range(5000, 5000 + 27 * BS)), BS))
    assert m.external.take_store_plan() is None  # 16 pinned: the lookahead is full
    m.external.complete_store(plan2.store_id, success=False)  # not stored: planned again
    plan3 = m.external.take_store_plan()
    assert len(plan3.block_ids) == 16 and not set(plan3.keys) & set(block_hashes(a, BS))
    m.external.complete_store(plan3.store_id, success=True)
    plan4 = m.external.take_store_plan()
    assert len(plan4.block_ids) == 27 - 16 and not set(plan4.keys) & (set(plan3.keys) | set(block_hashes(a, BS)))
    m.external.complete_store(plan4.store_id, success=True)
    assert m.external.take_store_plan() is None  # every idle cached block is stored
    m.check_invariants()


def test_write_back_with_the_cpu_tier_stores_what_leaves_the_cpu_pool_first():
    """write_back over the CPU tier (golden): a GPU eviction is a demotion, so nothing is planned from the GPU;
    the plans take the CPU tier's next victims (tail first, as demoted), with their parents and tokens, keep them
    in the tier until stored (a demotion meanwhile is dropped rather than evict them), then give them a second
    chance; a failed store plans them again; reset_prefix_cache while pending returns them to the free ring."""
    m = mgr(num_gpu_blocks=8, num_cpu_blocks=8, cpu_prefix_cache=True, watermark=0, store_policy="write_back",
            enable_kv_events=True)
    a, b, c = list(range(100, 120)), list(range(200, 232)), list(range(300, 332))  # 5, 8 and 8 full blocks
    ka, kb = block_hashes(a, BS), block_hashes(b, BS)
    m.allocate("a", a)
    m.take_copy_plan()
    m.free("a")
    assert m.external.take_store_plan() is None  # a's idle GPU blocks: an eviction would demote them, not lose them
    m.allocate("b", b)  # evicts a's 5 blocks: demoted, tail first
    m.take_copy_plan()
    p = m.external.take_store_plan()
    assert p.medium == "CPU" and p.keys == tuple(reversed(ka)) and p.block_ids == (0, 1, 2, 3, 4)
    assert p.parent_keys == (ka[3], ka[2], ka[1], ka[0], None)
    assert p.token_ids.tolist() == [a[i * BS:(i + 1) * BS] for i in reversed(range(5))]
    assert m.external.take_store_plan() is None and m.external.pending_stores == (p.store_id,)
    m.check_invariants()
    m.free("b")
    m.allocate("c", c)  # evicts b's 8 blocks: 3 CPU blocks are free, a's 5 are kept until stored
    plan = m.take_copy_plan()
    assert len(plan) == 3
    assert m.lookup_prefix(a + [1]).num_cpu_blocks == 5  # still in the tier
    m.check_invariants()
    m.external.complete_store(p.store_id, True)
    m.check_invariants()
    p2 = m.external.take_store_plan()  # b's 3 demoted blocks; a's are stored: never planned again
    assert p2.medium == "CPU" and p2.keys == (kb[7], kb[6], kb[5])
    assert p2.parent_keys == (kb[6], kb[5], kb[4])
    m.external.complete_store(p2.store_id, False)  # failed: planned again
    p3 = m.external.take_store_plan()
    assert p3.keys == p2.keys
    m.reset_prefix_cache()  # (c still runs) every tier block forgotten; the pending ones wait for their store
    m.check_invariants()
    m.external.complete_store(p3.store_id, True)
    m.check_invariants()
    m.free("c")
    assert m.stats.num_free_cpu_blocks == 8 and m.external.take_store_plan() is None


def test_complete_store_bad_input():
    m = mgr(store_policy="write_through")
    m.allocate("a", prompt(1))
    m.take_copy_plan()
    plan = m.external.take_store_plan()
    for bad in (999, None, "x"):
        with pytest.raises(UnknownStoreError):
            m.external.complete_store(bad)
    with pytest.raises(InvalidArgumentError):
        m.external.complete_store(plan.store_id, success="yes")
    assert m.external.pending_stores == (plan.store_id,)
    m.check_invariants()


# ------------------------------------------------------------------ KV cache groups (HybridBlockManager)
def hybrid(**kw):
    from pagedkv import FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

    kw.setdefault("enable_prefix_caching", True)
    return BlockManager(kw.pop("num_gpu_blocks", 64), BS, kv_cache_groups=[
        FullAttentionSpec(), SlidingWindowSpec(8)], **kw, grouped_results=True)


def test_hybrid_holds_cover_every_group_and_only_the_window():
    m = hybrid()
    p = prompt(1)  # 28 tokens: 7 blocks per group, the sliding group keeps its window after a step
    m.allocate("a", p)
    m.take_copy_plan()
    m.decode_step(["a"], [3])
    m.take_copy_plan()
    h = m.free("a", hold_for=10.0, now=0.0)
    full, sliding = h.group_block_ids
    assert h.block_ids == full and len(full) == 8
    assert 0 < len(sliding) < len(full)  # the window released the others (NULL_BLOCK, not held)
    m.check_invariants()
    free = m.num_free_gpu_blocks
    m.external.release_hold(h.hold_id)
    assert m.num_free_gpu_blocks == free + len(full) + len(sliding)
    m.check_invariants()
    with pytest.raises(UnknownHoldError):
        m.external.release_hold(h.hold_id)


def test_hybrid_store_plan():
    m = hybrid(store_policy="write_through")
    m.allocate("a", prompt(1))
    m.take_copy_plan()
    plan = m.external.take_store_plan()
    assert len(plan.block_ids) == 14  # 7 full blocks in each group
    assert set(block_hashes(prompt(1), BS)) <= set(plan.keys)
    assert set(block_hashes(prompt(1), BS, group=1)) <= set(plan.keys)
    m.check_invariants()
    m.external.complete_store(plan.store_id)
    m.check_invariants()


def test_hybrid_loads_in_every_group():
    m = hybrid(enable_kv_events=True)
    m.allocate("w", SYS + [7])
    m.take_copy_plan()
    m.free("w")
    m.events.take()
    p = prompt(1)
    assert m.allocate("a", p, num_external_tokens=12) == 20
    ext = m.external.external_blocks("a")
    assert len(ext.group_block_ids) == 2 and all(len(g) == 3 for g in ext.group_block_ids)
    assert ext.group_keys[1] == tuple(block_hashes(p[:20], BS, group=1)[2:])
    assert m.external.loading_seq_ids == ("a",)
    m.check_invariants()
    with pytest.raises(SequenceStateError):
        m.decode_step(["a"], [1])
    assert m.lookup_prefix(p).num_cached_tokens == 8 and m.events.take() == []
    assert m.external.finish_external(done=["a"]) == {"a": 20}
    m.check_invariants()
    assert m.lookup_prefix(p).num_cached_tokens == 24
    m.take_copy_plan()
    m.decode_step(["a"], [1])
    m.check_invariants()
    # an abort while loading parks every group's arriving blocks
    m.allocate("b", prompt(2), num_external_tokens=8)
    m.free("b")
    assert m.external.parked_seq_ids == ("b",)
    m.check_invariants()
    assert m.external.finish_external(failed={"b": 4}) == {}
    m.check_invariants()
    b = m.allocate_batch(["c", "d"], [prompt(3), prompt(4)], num_external_tokens=[8, 0])
    assert b.num_cached_tokens.tolist() == [16, 8] and m.external.loading_seq_ids == ("c",)
    m.check_invariants()
    m.external.finish_external(failed={"c": 0})
    m.check_invariants()


def test_hybrid_selective_counts_hits_in_every_group():
    m = hybrid(store_policy="selective", store_min_hits=1)
    p = prompt(1)
    m.allocate(0, p)
    m.take_copy_plan()
    assert m.external.take_store_plan() is None
    m.allocate(1, p)
    plan = m.external.take_store_plan()
    assert plan is not None and len(plan.block_ids) >= 6
    m.check_invariants()


def test_hybrid_load_of_window_blocks_only():
    """external_window_only: a sliding group reserves only the external blocks its window sees at the load's end
    (the P/D split's Gemma 3 transfer); its earlier positions are NULL_BLOCK, its hit blocks go back to the cache,
    it registers nothing more of the prompt; the load ends whole or aborted."""
    from pagedkv.types import NULL_BLOCK

    def warmed():
        m = hybrid()
        m.allocate("w", SYS + [7])
        m.take_copy_plan()
        m.free("w")
        return m

    m, twin = warmed(), warmed()
    p = prompt(1)  # 28 tokens: hit 8 (blocks 0, 1 in both groups), external 16 -> P = 24; window 8 sees 17..23
    assert m.allocate("a", p, num_external_tokens=16, external_window_only=True) == 24
    assert twin.allocate("a", p, num_external_tokens=16) == 24
    ext = m.external.external_blocks("a")
    full, sliding = ext.group_block_ids
    assert len(full) == 4 and min(full) >= 0
    assert sliding[:2] == (NULL_BLOCK, NULL_BLOCK) and min(sliding[2:]) >= 0  # blocks 4, 5 only
    assert m.block_table("a", 1).tolist()[:4] == [NULL_BLOCK] * 4
    assert ext.group_keys == twin.external.external_blocks("a").group_keys
    assert ext.cut and not twin.external.external_blocks("a").cut  # said, not found by scanning for NULL_BLOCK
    # the sliding group took 2 new blocks fewer and gave its 2 hit blocks back (idle, still cached)
    assert m.num_free_gpu_blocks == twin.num_free_gpu_blocks + 4
    m.check_invariants()
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        m.external.finish_external(failed={"a": 4})  # a part of it cannot be used: the window's earlier KV is nowhere
    assert snapshot(m) == before
    assert m.external.finish_external(done=["a"]) == {"a": 24}
    m.check_invariants()
    # the full group registered its blocks, the cut sliding group nothing past its (released) hit
    assert m.lookup_prefix(p).num_cached_tokens == 8
    m.take_copy_plan()
    m.decode_step(["a"], [5])
    m.check_invariants()
    h = m.external.hold("a", 5.0, now=0.0)
    assert len(h.group_block_ids[0]) == 8 and NULL_BLOCK not in h.group_block_ids[1]
    assert len(h.group_block_ids[1]) <= 3
    m.external.release_hold(h.hold_id)
    m.take_copy_plan()
    m.free("a")
    m.check_invariants()
    # aborted while loading: its reserved blocks (the NULL positions hold none) parked, then released
    free = m.num_free_gpu_blocks
    assert m.allocate("b", prompt(2), num_external_tokens=16, external_window_only=True) == 24
    m.free("b")
    assert m.external.parked_seq_ids == ("b",)
    m.check_invariants()
    assert m.external.finish_external(failed={"b": 0}) == {}
    assert m.num_free_gpu_blocks == free and m.external.parked_seq_ids == ()
    m.check_invariants()
    # a load the window still sees whole is not cut: as without the flag (a part of it may fail)
    assert m.allocate("c", prompt(3), num_external_tokens=4, external_window_only=True) == 12
    assert NULL_BLOCK not in m.external.external_blocks("c").group_block_ids[1] and not m.external.external_blocks("c").cut
    assert m.external.finish_external(failed={"c": 0}) == {"c": 8}
    m.check_invariants()
    with pytest.raises(InvalidArgumentError):
        m.allocate("d", prompt(4), num_external_tokens=4, external_window_only=1)
    m.check_invariants()
