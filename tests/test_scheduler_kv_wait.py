"""The scheduler's waiting-for-KV state (issue 24 item 2): a request added with ``wait_for_kv=True`` is not
admitted while the steps go on for the others; ``kv_ready`` puts it back in arrival order, and its admission
skips the loaded tokens (``PrefillWork.num_external_tokens``, not charged to the budget), only where the load
continues the prefix-cache hit; a failed load (fewer tokens) computes the rest; aborts and bad calls leave the
state as it was."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.scheduler import Scheduler
from sched_steps import BS, make, step


@pytest.mark.parametrize("chunked", [True, False])
def test_a_loading_request_waits_while_others_run_then_skips_its_loaded_tokens(chunked):
    s = make(chunked)
    s.add_request("a", list(range(100, 130)), max_tokens=3, wait_for_kv=True)
    s.add_request("b", list(range(200, 210)), max_tokens=3)
    assert s.num_loading == 1 and s.num_waiting == 1
    plan, _ = step(s)
    assert [p.request_id for p in plan.prefills] == ["b"]  # b goes on; a waits for its KV
    plan, _ = step(s)
    assert not plan.prefills and plan.decode is not None and s.num_loading == 1
    assert s.kv_ready("a", 0, 24)  # blocks 0-5 loaded
    assert s.num_loading == 0 and s.num_waiting == 1
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.request_id == "a" and pw.num_external_tokens == 24 and pw.num_cached_tokens == 24
    assert pw.positions.tolist() == list(range(24, 30)) and pw.num_samples == 1
    assert s.stats.external_tokens == 24 and s.stats.computed_prefill_tokens == 10 + 6
    while s.has_unfinished():
        _, done = step(s)
    # the loaded blocks are registered like computed ones: the same prompt now hits them on the GPU
    assert s.bm.lookup_prefix(list(range(100, 130))).num_cached_tokens == 28


def test_the_load_is_used_only_from_the_hit_on():
    s = make()
    prompt = list(range(100, 130))
    s.add_request("warm", prompt[:13], max_tokens=1)  # caches blocks 0-2 (12 tokens)
    while s.has_unfinished():
        step(s)
    s.add_request("a", prompt, max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 4, 20)  # loaded blocks 1-5 while blocks 0-2 are on the GPU: only 3-5 are written
    plan, _ = step(s)
    (pw,) = plan.prefills
    assert pw.num_cached_tokens == 24 and pw.num_external_tokens == 12
    s.add_request("late", prompt[:8] + [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1, wait_for_kv=True)
    s.kv_ready("late", 8, 8)  # loaded blocks 2-3 of another prompt... whose hit (block 0-1) it continues
    plan, _ = step(s)
    (pw,) = [p for p in plan.prefills if p.request_id == "late"]
    assert pw.num_external_tokens == 8 and pw.num_cached_tokens == 16


def test_a_load_whose_hit_is_gone_is_computed():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True)
    s.add_request("a", list(range(100, 121)), max_tokens=1, wait_for_kv=True)
    s.kv_ready("a", 8, 12)  # the load continued a hit of 2 blocks that is not there
    plan, _ = s.schedule(), None
    (pw,) = plan.prefills
    assert pw.num_external_tokens == 0 and pw.num_cached_tokens == 0 and pw.positions[0] == 0
    assert s.stats.stale_external_loads == 1


def test_a_failed_load_computes_the_rest_and_a_load_of_nothing_computes_all():
    s = make()
    s.add_request("a", list(range(100, 130)), max_tokens=1, wait_for_kv=True)
    s.add_request("b", list(range(300, 330)), max_tokens=1, wait_for_kv=True)
    s.kv_ready("b", 0, 0)  # nothing held (or the load failed at once)
    s.kv_ready("a", 0, 8)  # failed after 2 good blocks
    plan, _ = step(s)
    by = {p.request_id: p for p in plan.prefills}
    assert [p.request_id for p in plan.prefills] == ["a", "b"]  # arrival order kept
    assert by["a"].num_external_tokens == 8 and by["a"].positions[0] == 8
    assert by["b"].num_external_tokens == 0 and by["b"].positions[0] == 0


def test_abort_while_loading_and_bad_calls_leave_the_state():
    s = make()
    s.add_request("a", list(range(100, 130)), max_tokens=1, wait_for_kv=True)
    for bad in [(3, 4), (0, 6), (-4, 4), (0, 32), (True, 4)]:
        with pytest.raises(InvalidArgumentError):
            s.kv_ready("a", *bad)
        assert s.num_loading == 1 and s.num_waiting == 0
    out = s.abort_request("a")
    assert out.finish_reason == "abort" and s.num_loading == 0 and not s.has_unfinished()
    assert s.kv_ready("a", 0, 8) is False  # the load's completion after the abort: a no-op
    s.add_request("b", list(range(10)), max_tokens=1)
    with pytest.raises(InvalidArgumentError):
        s.kv_ready("b", 0, 4)  # not loading
    assert s.num_waiting == 1
    plan = s.schedule()
    assert plan.prefills[0].request_id == "b"
