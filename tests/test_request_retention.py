"""Retention a request steers (issue 23 item 4), below the model: the scheduler carries a request's ``session`` to
the block manager's hint (a golden eviction order per policy), the request pins of ``kv_retention``
(pagedkv.engine.request_pins: admission errors, the pin once computed, reuse, the budget taken meanwhile, the
blocks a hybrid pin holds) and the server's validation of ``session_id`` and ``kv_retention``. The model-level
paths (LLM.generate, pagedkv serve) are in tests/engine/test_llm.py and tests/engine/test_serve.py."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.engine.request_pins import KVRetention, RequestPins, parse_kv_retention, pin_blocks
from pagedkv.errors import InvalidArgumentError, PinBudgetError
from pagedkv.kv_groups import FullAttentionSpec, SlidingWindowSpec
from pagedkv.scheduler import Scheduler
from pagedkv.server.validation import APIError, parse_chat, parse_completion


# ---------------------------------------------------------------------- session hints through the scheduler
def _run(sched: Scheduler, rid: str, prompt: list, **kw) -> None:
    sched.add_request(rid, prompt, max_tokens=1, **kw)
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, np.zeros(plan.num_samples_expected, dtype=np.int64))


def _scheduled_golden(policy: str, hinted: bool = True) -> list:
    """tests/test_eviction_policies.py's ``test_golden_orders_where_policies_differ`` with the hints given as
    requests' ``session`` to the scheduler: x and x2 one conversation (x2 hits x's block), y a one-off, then z
    needs a block that one of them must give up."""
    bm = BlockManager(3, 2, enable_prefix_caching=True, eviction_policy=policy, watermark=0)
    sched = Scheduler(bm)
    for rid, prompt, session in (("x", [1, 2, 7], "chat"), ("x2", [1, 2, 8], "chat"), ("y", [3, 4, 9], "one-off")):
        _run(sched, rid, prompt, **({"session": session} if hinted else {}))
    _run(sched, "z", [5, 6, 0])
    bm.check_invariants()
    return [bm.lookup_prefix([1, 2, 0]).num_cached_tokens, bm.lookup_prefix([3, 4, 0]).num_cached_tokens]


def test_session_reaches_the_policy_through_the_scheduler():
    assert _scheduled_golden("lru") == [0, 2]  # LRU: the conversation's block is the older release
    assert _scheduled_golden("session") == [2, 0]  # the conversation (2 requests) outlives the one-off
    assert _scheduled_golden("session", hinted=False) == [0, 2]  # no hint: the session policy is LRU


def test_session_hint_once_per_request_and_with_priority():
    bm = BlockManager(32, 2, enable_prefix_caching=True, watermark=0)
    sched = Scheduler(bm)
    sched.add_request("r", [1, 2, 3, 4, 5], n=2, max_tokens=2, priority=3, session=("tenant", "chat-1"))
    sched.schedule()
    assert list(bm._hints.values()) == [(3, ("tenant", "chat-1"))]  # sample 0 only; the fork inherits priority
    with pytest.raises(ValueError, match="hashable"):
        sched.add_request("bad", [1, 2], session=["not", "hashable"])
    assert "bad" not in sched._q.requests


# ---------------------------------------------------------------------- request pins
def test_parse_kv_retention():
    assert parse_kv_retention(None) is None
    assert parse_kv_retention({"pin_tokens": "prompt"}) == KVRetention("prompt", None)
    assert parse_kv_retention({"pin_tokens": 8, "ttl": 60}) == KVRetention(8, 60.0)
    assert parse_kv_retention(KVRetention(4)) == KVRetention(4, None)
    for bad in ({"ttl": 5}, {"pin_tokens": 0}, {"pin_tokens": True}, {"pin_tokens": "all"}, {"pin_tokens": 2.0},
                {"pin_tokens": 4, "ttl": 0}, {"pin_tokens": 4, "ttl": -1}, {"pin_tokens": 4, "ttl": float("nan")},
                {"pin_tokens": 4, "ttl": float("inf")}, {"pin_tokens": 4, "ttl": "1h"}, {"pin_tokens": 4, "x": 1},
                [("pin_tokens", 4)], 7):
        with pytest.raises(InvalidArgumentError):
            parse_kv_retention(bad)


def _compute(bm: BlockManager, sid: str, prompt: list) -> None:
    bm.allocate(sid, prompt)
    bm.take_copy_plan()
    bm.free(sid)


def test_request_pins_admit_settle_reuse_and_errors():
    bm = BlockManager(16, 4, enable_prefix_caching=True, watermark=0, pin_budget_blocks=4)
    rp = RequestPins(bm)
    system = list(range(100, 110))  # 10 tokens: 2 full blocks
    with pytest.raises(InvalidArgumentError, match="longer than the prompt"):
        rp.admit(system, KVRetention(11))
    assert rp.admit(system, KVRetention(3)) == (0, None)  # shorter than a block: nothing to pin, no error
    assert rp.admit(system, KVRetention("prompt", 30.0)) == (8, 30.0)
    with pytest.raises(PinBudgetError, match="never|budget is 4"):
        rp.admit(list(range(30)), KVRetention("prompt"))  # 7 blocks > the budget of 4
    _compute(bm, "a", system + [1])
    pin, err = rp.settle(system, 8, 30.0)
    assert err is None and (pin.num_tokens, pin.num_blocks, pin.ttl) == (8, 2, 30.0) and bm.retention.pins == (pin,)
    # the same prefix again: the live pin is reused, no budget needed even when the rest is taken
    assert rp.settle(system, 8, 30.0) == (pin, None) and len(bm.retention.pins) == 1
    other = list(range(200, 208))
    _compute(bm, "b", other + [1])
    admin = bm.retention.pin_prefix(other)  # the budget is now full (4 of 4)
    assert rp.admit(system + [5, 6], KVRetention(8, 30.0)) == (8, 30.0)  # reuse: admitted
    with pytest.raises(PinBudgetError, match="other pins hold 4"):
        rp.admit(list(range(300, 310)), KVRetention(8))
    with pytest.raises(PinBudgetError):  # pinned, but not made known: counted as new blocks (conservative)
        rp.admit(other, KVRetention(8))
    rp.remember(other, admin)  # (LLM.pin_prefix and POST /v1/pins do this)
    assert rp.admit(other, KVRetention(8)) == (8, None)  # its blocks are pinned already: no room needed
    got, err = rp.settle(other, 8, None)  # a pin of its own over the same blocks: nothing more of the budget
    assert err is None and got.pin_id not in (0, admin.pin_id) and bm.retention.num_pinned_blocks == 4
    assert rp.settle(other, 8, None) == (got, None)  # and the next request reuses it
    assert rp.admit(system, KVRetention(8, 99.0)) == (8, 99.0)  # another TTL: another pin, the same blocks
    bm.retention.unpin(got.pin_id)
    # taken between admission and the pin: nothing pinned, the reason returned
    third = list(range(400, 408))
    _compute(bm, "c", third + [1])
    got, err = rp.settle(third, 8, None)
    assert got.pin_id == 0 and "pin budget" in err and bm.retention.num_pinned_blocks == 4
    bm.retention.unpin(pin.pin_id)  # the reused pin gone: the next request pins anew
    pin2, err = rp.settle(system, 8, 30.0)
    assert err is None and pin2.pin_id not in (0, pin.pin_id)
    bm.check_invariants()
    off = RequestPins(BlockManager(16, 4, enable_prefix_caching=True))
    with pytest.raises(InvalidArgumentError, match="pin budget"):
        off.admit(system, KVRetention(8))


@pytest.mark.parametrize("bs", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 3, 5, 8, 33])
def test_pin_blocks_is_what_a_hybrid_pin_holds(bs, window):
    groups = [FullAttentionSpec(), SlidingWindowSpec(window), SlidingWindowSpec(window + 2)]
    for nb in (1, 3, 10):
        bm = BlockManager(400, bs, kv_cache_groups=groups, enable_prefix_caching=True, pin_budget_blocks=400, grouped_results=True)
        prompt = list(range(1, nb * bs + 2))
        bm.allocate("a", prompt)
        bm.take_copy_plan()
        bm.free("a")
        pin = bm.retention.pin_prefix(prompt[: nb * bs])
        assert pin.num_tokens == nb * bs and pin.num_blocks == pin_blocks(groups, nb * bs, bs)
    assert pin_blocks(None, 40, 4) == 10 and pin_blocks(groups, 0, bs) == 0


# ---------------------------------------------------------------------- the server's fields
def test_server_validation_of_session_id_and_kv_retention():
    base = {"prompt": "hi", "max_tokens": 1}
    r = parse_completion({**base, "session_id": "chat-7", "kv_retention": {"pin_tokens": "prompt", "ttl": 60}})
    assert r.session_id == "chat-7" and r.kv_retention == {"pin_tokens": "prompt", "ttl": 60.0}
    r = parse_chat({"messages": [{"role": "user", "content": "x"}], "kv_retention": {"pin_tokens": 32}})
    assert r.kv_retention == {"pin_tokens": 32, "ttl": None} and r.session_id is None
    bad = [({"session_id": 7}, "session_id"), ({"session_id": ""}, "session_id"),
           ({"session_id": "x" * 300}, "session_id"), ({"kv_retention": 5}, "kv_retention"),
           ({"kv_retention": {}}, "kv_retention.pin_tokens"), ({"kv_retention": {"pin_tokens": 0}}, "kv_retention.pin_tokens"),
           ({"kv_retention": {"pin_tokens": "all"}}, "kv_retention.pin_tokens"),
           ({"kv_retention": {"pin_tokens": 4, "ttl": 0}}, "kv_retention.ttl"),
           ({"kv_retention": {"pin_tokens": 4, "ttl": 1e9}}, "kv_retention.ttl"),
           ({"kv_retention": {"pin_tokens": 4, "priority": 1}}, "kv_retention.priority")]
    for extra, param in bad:
        with pytest.raises(APIError) as e:
            parse_completion({**base, **extra})
        assert e.value.status == 400 and e.value.body()["error"]["param"] == param, extra
