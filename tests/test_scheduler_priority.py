"""scheduling_policy="priority" (vLLM's semantics: a lower priority value is served first, ties by arrival):
admission order, the preemption victim, and the eviction class of a finished request's cached blocks."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.scheduler import Scheduler


def test_admission_by_priority_then_arrival():
    bm = BlockManager(64, 4, watermark=0)
    sched = Scheduler(bm, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        sched.add_request(rid, [1, 2, 3], max_tokens=1, priority=prio)
    order = [g.request_id for g in sched._q.waiting]
    assert order == ["b", "d", "c", "a"]
    fcfs = Scheduler(BlockManager(64, 4, watermark=0), scheduling_policy="fcfs")
    for rid, prio in (("a", 2), ("b", 0)):
        fcfs.add_request(rid, [1, 2, 3], priority=prio)
    assert [g.request_id for g in fcfs._q.waiting] == ["a", "b"]


def test_victim_is_the_largest_priority_value():
    bm = BlockManager(64, 4, watermark=0)
    sched = Scheduler(bm, scheduling_policy="priority")
    q = sched._q
    for rid, prio in (("urgent", -5), ("bulk", 3), ("normal", 0)):
        sched.add_request(rid, [1, 2, 3], priority=prio)
    for g in sorted(q.waiting, key=lambda g: g.arrival):  # as if admitted in arrival order
        q.running[g.arrival] = g
    assert sched._preemptor.victim().request_id == "bulk"
    q.by_priority = False
    assert sched._preemptor.victim().request_id == "normal"  # fcfs: the most recently admitted


def _run_two(policy):
    bm = BlockManager(6, 2, watermark=0)
    sched = Scheduler(bm, max_num_batched_tokens=64, scheduling_policy=policy)
    sched.add_request("low", [1, 2, 3, 4], max_tokens=8, priority=5, ignore_eos=True)
    sched.add_request("high", [5, 6, 7, 8], max_tokens=8, priority=0, ignore_eos=True)
    outs = {}
    for _ in range(60):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        for o in sched.update(plan, np.ones(plan.num_samples_expected, dtype=np.int64)):
            outs[o.request_id] = o
        bm.check_invariants()
    assert not sched.has_unfinished()
    return outs["low"].num_preemptions, outs["high"].num_preemptions


def test_priority_preemption_end_to_end_keeps_the_urgent_request_running():
    """A pool too small for both to finish together: by priority the low-priority request is preempted; first
    come first served preempts the later one, here the urgent request."""
    low, high = _run_two("priority")
    assert high == 0 and low >= 1
    low, high = _run_two("fcfs")
    assert low == 0 and high >= 1


def test_bad_policy_and_priority():
    with pytest.raises(ValueError):
        Scheduler(BlockManager(8, 4), scheduling_policy="lifo")
    sched = Scheduler(BlockManager(8, 4))
    with pytest.raises(ValueError):
        sched.add_request("x", [1], priority=1.5)


def test_finished_request_blocks_take_its_eviction_class():
    bm = BlockManager(32, 2, enable_prefix_caching=True, watermark=0)
    sched = Scheduler(bm)
    sched.add_request("bulk", [1, 2, 3, 4, 5], max_tokens=1, priority=7)
    plan = sched.schedule()
    assert bm._hints  # the hint waits for the free
    assert list(bm._hints.values())[0][0] == 7
