"""The scheduler on the block manager's external-KV contract (issue 24 item 2, the tiers' path): a request whose
prefix a tier holds (``kv_ready(..., reserve=True)``) is admitted with ``allocate(num_external_tokens=)``: its
GPU blocks are reserved and counted by the manager while it waits FETCHING outside every batch (the others keep
stepping); ``kv_loaded`` reports the load, the next step calls ``finish_external`` and prefills the rest; a
failed load computes what did not arrive; an abort while FETCHING parks the blocks until the transfer is
reported ended; bad calls change nothing."""

from __future__ import annotations

import pytest

from pagedkv import BlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.scheduler import Scheduler
from sched_steps import BS, make, step

PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks, a tier can serve 7 (the last token is computed)


@pytest.mark.parametrize("chunked", [True, False])
def test_reserved_blocks_are_counted_while_the_others_step_then_the_rest_is_prefilled(chunked):
    s = make(chunked)
    bm = s.bm
    s.add_request("a", PROMPT, max_tokens=3, wait_for_kv=True)
    s.add_request("b", list(range(200, 210)), max_tokens=4)
    plan, _ = step(s)
    assert [p.request_id for p in plan.prefills] == ["b"] and not plan.kv_loads
    assert s.kv_ready("a", 0, 24, reserve=True)  # the tiers hold blocks 0-5
    free = bm.num_free_gpu_blocks
    plan, _ = step(s)
    assert not plan.prefills and plan.decode is not None  # b decodes; a is admitted FETCHING, no prefill
    (kl,) = plan.kv_loads
    assert kl.request_id == "a" and bm.external.is_loading(kl.seq_id)
    assert (kl.load.start_token, kl.load.num_tokens, len(kl.load.block_ids)) == (0, 24, 6)
    assert bm.num_free_gpu_blocks <= free - 8  # its blocks are reserved (the 6 external ones and the rest)
    assert s.num_loading == 1 and s.is_fetching("a") and s.num_running_seqs == 2
    for _ in range(2):  # the load takes a while: b goes on, a is in no batch
        plan, _ = step(s)
        assert not plan.prefills and plan.decode.seq_ids.tolist() == [1] and not plan.kv_loads  # (b: seq 1)
    assert bm.lookup_prefix(PROMPT).num_cached_tokens == 0  # arriving blocks are not findable yet
    assert s.kv_loaded("a")  # everything arrived
    assert not s.is_fetching("a")
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.request_id == "a" and pw.num_external_tokens == 24 and pw.num_cached_tokens == 24
    assert pw.positions.tolist() == list(range(24, 30)) and pw.num_samples == 1
    assert s.stats.external_tokens == 24 and s.num_loading == 0
    while s.has_unfinished():
        step(s)
    assert bm.lookup_prefix(PROMPT).num_cached_tokens == 28  # registered like computed blocks


def test_a_failed_load_computes_the_rest_in_the_step_it_is_reported():
    s = make()
    s.add_request("a", PROMPT, max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 0, 24, reserve=True)
    plan, _ = step(s)
    (kl,) = plan.kv_loads
    assert s.kv_loaded("a", 8)  # two good leading blocks, then a corrupt one
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.num_external_tokens == 8 and pw.positions.tolist() == list(range(8, 30))
    while s.has_unfinished():
        step(s)
    assert s.bm.lookup_prefix(PROMPT).num_cached_tokens == 28


def test_the_reserved_range_starts_at_the_hit_and_a_gone_hit_computes_everything():
    s = make()
    s.add_request("warm", PROMPT[:13], max_tokens=1)  # caches blocks 0-2
    while s.has_unfinished():
        step(s)
    s.add_request("a", PROMPT, max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 4, 20, reserve=True)  # the tiers hold blocks 1-5; blocks 0-2 are on the GPU
    plan, _ = step(s)
    (kl,) = plan.kv_loads
    assert (kl.load.start_token, kl.load.num_tokens) == (12, 12)  # only blocks 3-5 are reserved
    s.kv_loaded("a")
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.num_cached_tokens == 24 and pw.num_external_tokens == 12
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    s2 = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True)
    s2.add_request("b", PROMPT, max_tokens=1, wait_for_kv=True)
    s2.kv_ready("b", 8, 12, reserve=True)  # the load continued a 2-block hit that is gone
    plan = s2.schedule()
    assert not plan.kv_loads and plan.prefills[0].positions[0] == 0 and s2.stats.stale_external_loads == 1


def test_abort_while_fetching_parks_the_blocks_until_the_transfer_ends():
    s = make()
    bm = s.bm
    free0 = bm.num_free_gpu_blocks
    s.add_request("a", PROMPT, max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 0, 24, reserve=True)
    plan, _ = step(s)
    (kl,) = plan.kv_loads
    out = s.abort_request("a")
    assert out.finish_reason == "abort" and s.num_loading == 0 and s.num_parked == 1
    assert bm.external.parked_seq_ids == (kl.seq_id,) and bm.num_free_gpu_blocks == free0 - 6  # a transfer may write them
    assert not s.is_fetching("a") and s.num_running_seqs == 0
    step(s)
    assert bm.external.parked_seq_ids == (kl.seq_id,)  # still: the transfer has not been reported ended
    assert s.kv_loaded("a") is False  # the transfer ended: the parked blocks are freed at the next step
    step(s)
    assert bm.external.parked_seq_ids == () and bm.num_free_gpu_blocks == free0 and s.num_parked == 0
    assert s.kv_loaded("a") is False  # unknown now: a no-op
    # a load reported, then the request aborted before the next step: the blocks are freed at that step
    s.add_request("b", PROMPT, max_tokens=1, wait_for_kv=True)
    s.kv_ready("b", 0, 24, reserve=True)
    step(s)
    s.kv_loaded("b")
    s.abort_request("b")
    assert s.num_parked == 0
    step(s)
    assert bm.external.parked_seq_ids == () and bm.num_free_gpu_blocks == free0 and not s.has_unfinished()


def test_bad_kv_loaded_calls_change_nothing():
    s = make()
    s.add_request("a", PROMPT, max_tokens=1, wait_for_kv=True)
    with pytest.raises(InvalidArgumentError):
        s.kv_loaded("a")  # not admitted with reserved blocks yet
    s.kv_ready("a", 0, 24, reserve=True)
    step(s)
    for bad in (3, 28, -4, True, 2.0):
        with pytest.raises(InvalidArgumentError):
            s.kv_loaded("a", bad)
        assert s.is_fetching("a")
    assert s.kv_loaded("a", 24)  # all of it: the same as None
    with pytest.raises(InvalidArgumentError):
        s.kv_loaded("a")  # reported twice
    plan, _ = step(s)
    assert plan.prefills[0].num_external_tokens == 24
    assert s.kv_loaded("nope") is False


def test_the_progress_guard_waits_for_a_fetching_request_that_holds_the_pool():
    s = make(blocks=10)
    s.add_request("a", PROMPT, max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 0, 24, reserve=True)
    step(s)  # a holds 8 of the 10 blocks while it loads
    s.add_request("b", list(range(300, 320)), max_tokens=1)  # needs 5: not now, but not never either
    plan, _ = step(s)
    assert not plan.prefills and not plan.ignored and s.num_waiting == 1
    s.kv_loaded("a")
    while s.has_unfinished():
        plan, _ = step(s)
        assert not plan.ignored


def hybrid_sched(chunked: bool = True) -> Scheduler:
    from pagedkv import FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

    bm = BlockManager(96, BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                            enable_prefix_caching=True, watermark=0, grouped_results=True)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=chunked,
                     incremental_tables=True)


@pytest.mark.parametrize("ok", [None, 0, 8])
def test_a_window_only_load_ends_whole_or_is_computed_whole(ok):
    """``kv_ready(..., reserve=True, window_only=True)`` (the P/D split's decode side with KV cache groups): the
    sliding group reserves only its window's blocks at the load's end (NULL_BLOCK before them). A load that
    arrives whole is used; one that ends short (the transfer cut, the hold gone) cannot be used in part (the
    window's earlier KV exists nowhere): its blocks are freed and the request is computed whole, in the same
    step, state checked after every step."""
    from pagedkv.types import NULL_BLOCK

    s = hybrid_sched()
    bm = s.bm
    free0 = bm.num_free_gpu_blocks
    s.add_request("a", PROMPT, max_tokens=2, wait_for_kv=True)
    assert s.kv_ready("a", 0, 7 * BS, reserve=True, window_only=True)
    plan, _ = step(s)
    (kl,) = plan.kv_loads
    full, sliding = kl.load.group_block_ids
    assert len(full) == 7 and min(full) >= 0
    assert NULL_BLOCK in sliding and min(b for b in sliding if b >= 0) >= 0  # cut to the window at 28
    assert s.is_fetching("a") and bm.external.is_loading(kl.seq_id)
    s.kv_loaded("a", ok)
    plan, _ = step(s)
    (pw,) = plan.prefills
    if ok is None:  # whole: the last token only is computed
        assert pw.num_external_tokens == 7 * BS and pw.positions.tolist() == [28, 29]
        assert s.stats.stale_external_loads == 0
    else:  # cut short: computed whole (the scheduler freed the reserved blocks and admitted it again)
        assert pw.num_external_tokens == 0 and pw.positions[0] == 0
        assert s.stats.requeued_window_loads == 1 and not bm.external.parked_seq_ids
    while s.has_unfinished():
        step(s)
    assert bm.num_free_gpu_blocks == free0 and s.num_parked == 0


def test_a_window_only_load_the_window_sees_whole_keeps_its_good_leading_blocks():
    """A window-only load short enough that the window sees it whole is not cut: a partial load keeps its good
    leading blocks (the rest computed), as a plain load."""
    s = hybrid_sched()
    p = PROMPT[:10]  # 10 tokens: 2 whole blocks (8 tokens <= the window: nothing cut)
    s.add_request("a", p, max_tokens=2, wait_for_kv=True)
    assert s.kv_ready("a", 0, 2 * BS, reserve=True, window_only=True)
    plan, _ = step(s)
    (kl,) = plan.kv_loads
    assert all(b >= 0 for ids in kl.load.group_block_ids for b in ids)
    s.kv_loaded("a", BS)
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.num_external_tokens == BS and pw.positions.tolist()[0] == BS
    assert s.stats.stale_external_loads == 0
    while s.has_unfinished():
        step(s)
def _hybrid_step(s: Scheduler):
    plan = s.schedule()
    n = len(plan.prefills) + (len(plan.decode.seq_ids) if plan.decode is not None else 0)
    done = s.update(plan, [7] * n)
    s.bm.check_invariants()
    return plan, done


@pytest.mark.parametrize("loaded", [None, 0])
def test_kv_cache_groups_reserve_window_only_and_a_short_cut_load_is_queued_again(loaded):
    """KV cache groups (a HybridBlockManager, docs/tiers.md#kv-cache-groups): a reserved load is cut to the sliding
    windows (``external_window_only``: the sliding group reserves only the blocks its window sees at the load's
    end, NULL_BLOCK before). Whole, it is used; short (``kv_loaded(rid, 0)``: no shorter end of a cut load is
    usable), the reservation is freed and the request queued again and computed from its hit
    (``requeued_window_loads``), the invariants holding at every step."""
    from pagedkv import FullAttentionSpec, HybridBlockManager, SlidingWindowSpec

    bm = BlockManager(64, BS, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(window=2 * BS)],
                            enable_prefix_caching=True, grouped_results=True)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  incremental_tables=True)
    s.add_request("a", PROMPT, max_tokens=2, wait_for_kv=True)
    assert s.kv_ready("a", 0, 28, reserve=True)  # the tiers hold blocks 0-6
    plan, _ = _hybrid_step(s)
    (kl,) = plan.kv_loads
    full, sliding = kl.load.group_block_ids
    assert len(full) == 7 and min(full) >= 0
    # the window of 8 tokens at position 28 sees tokens 21-27: blocks 5 and 6; blocks 0-4 are not reserved
    assert [b >= 0 for b in sliding] == [False] * 5 + [True] * 2
    assert s.kv_loaded("a", loaded)
    plan, _ = _hybrid_step(s)
    if loaded is None:
        (pw,) = plan.prefills
        assert pw.num_external_tokens == 28 and pw.positions.tolist() == [28, 29]
        assert s.stats.requeued_window_loads == 0 and s.stats.external_tokens == 28
    else:
        assert s.stats.requeued_window_loads == 1 and not s.is_fetching("a") and not plan.kv_loads
        (pw,) = plan.prefills  # queued again at the front and computed from position 0, in this very step
        assert pw.request_id == "a" and pw.num_external_tokens == 0 and pw.positions.tolist()[0] == 0
        assert s.stats.external_tokens == 0 and s.num_running_seqs == 1
    while s.has_unfinished():
        _hybrid_step(s)
    assert bm.num_free_gpu_blocks == 64
