"""Eviction policies (pagedkv.retention.eviction) and steered retention (pagedkv.retention.steering): each policy against a plain
reference model through random operation sequences, golden eviction orders, request priorities, pinned prefixes
(budget, TTL, unpin, reset) and the manager's contracts around them."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import BlockManager, EVICTION_POLICIES
from pagedkv.errors import InvalidArgumentError, PinBudgetError, UnknownPinError, UnknownSequenceError
from pagedkv.retention.eviction import SessionEvictor, SLRUEvictor, make_evictor
from pagedkv.blocks.evictor import LRUEvictor
from pagedkv.retention import steering

import evictor_drive


# ---------------------------------------------------------------------- reference models
class RefSLRU:
    def __init__(self, n, frac=0.8):
        self.p, self.q, self.hit, self.cap = OrderedDict(), OrderedDict(), set(), max(1, int(frac * n))

    def push_many(self, blocks):
        for b in blocks:
            if b in self.hit:
                self.q[b] = None
                while len(self.q) > self.cap:
                    self.p[self.q.popitem(last=False)[0]] = None
            else:
                self.p[b] = None

    def discard(self, b):
        (self.p if b in self.p else self.q).pop(b)
        self.hit.add(b)

    def pop(self):
        b = (self.p if self.p else self.q).popitem(last=False)[0]
        self.hit.discard(b)
        return b

    def order(self):
        return list(self.p) + list(self.q)


class RefSession:
    def __init__(self, n, lifetimes=4.0):
        self.span, self.clock, self.key, self.bonus, self.turns = max(1, int(lifetimes * n)), 0, {}, {}, {}

    def hint(self, blocks, s):
        self.turns[s] = self.turns.get(s, 0) + 1
        for b in blocks:
            self.bonus[b] = (self.turns[s] - 1) * self.span

    def push_many(self, blocks):  # the blocks of one push share the key of its first serial
        first = self.clock + 1
        for b in blocks:
            self.clock += 1
            self.key[b] = (first + self.bonus.pop(b, 0), self.clock)

    def discard(self, b):
        del self.key[b]

    def pop(self):
        b = min(self.key, key=self.key.get)
        del self.key[b]
        return b

    def order(self):
        return sorted(self.key, key=self.key.get)


def _session_hint(x, absent, inside):
    """A hint for up to 3 blocks not in the evictor, one of 3 sessions."""
    return (absent[: 1 + x % 3], x % 3) if absent else None


@pytest.mark.parametrize("policy", ["slru", "session"])
@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 30), operations=evictor_drive.ops())
def test_policy_matches_its_reference(policy, n, operations):
    if policy == "slru":
        evictor_drive.drive(make_evictor(policy, n), RefSLRU(n), n, operations)
    else:
        evictor_drive.drive(make_evictor(policy, n), RefSession(n), n, operations, _session_hint)


# ---------------------------------------------------------------------- golden eviction orders, through the manager
def _run_golden(policy):
    """Four prompts of one full block (and a partial one) released in order a, b, c, d; a and c are hit again (c
    twice; with session hints a and c are one conversation); then one prompt needs every block: the KV events
    name the evicted blocks in eviction order."""
    bm = BlockManager(6, 4, enable_prefix_caching=True, eviction_policy=policy, watermark=0, enable_kv_events=True)
    prompts = {s: [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4] for i, s in enumerate("abcd")}
    for s, p in prompts.items():
        bm.allocate(s, p + [99])
        bm.retention.set_retention(s, session="chat" if s in "ac" else s)
        bm.free(s)
    for k, s in enumerate(("a", "c", "c")):  # hits: a block back from the evictor, then released again
        assert bm.allocate(f"{s}{k}", prompts[s] + [98]) == 4
        bm.retention.set_retention(f"{s}{k}", session="chat")
        bm.free(f"{s}{k}")
    bm.check_invariants()
    bm.events.take()
    bm.allocate("big", list(range(500, 524)))
    removed = [k for e in bm.events.take() if isinstance(e, pagedkv.events.BlockRemoved) for k in e.block_hashes]
    name = {pagedkv.block_hashes(p, 4)[0]: s for s, p in prompts.items()}
    bm.check_invariants()
    return "".join(name[k] for k in removed)


@pytest.mark.parametrize("policy, order", [
    ("lru", "bdac"),       # least recently released first
    ("slru", "bdac"),      # never-hit b, d first, then the protected a, c in LRU order
    ("session", "bdac"),   # the conversation's blocks (turns 2-5 of "chat") outlive the one-offs b, d
    ("density", "bdac"),   # nothing learnt yet (no return seen before a refresh): every density 0, LRU's order
    ("arc", "bdac"),       # T1 (b, d: never hit) while it holds more than p = 0 blocks, then T2 (a, c) in LRU order
])
def test_golden_eviction_order(policy, order):
    assert _run_golden(policy) == order


def test_golden_orders_where_policies_differ():
    """SLRU protects a block hit once over one released later; session keeps a conversation's blocks over a newer
    one-off; LRU evicts by release order alone."""
    def run(policy):
        bm = BlockManager(3, 2, enable_prefix_caching=True, eviction_policy=policy, watermark=0)
        bm.allocate("x", [1, 2, 7]); bm.retention.set_retention("x", session="chat"); bm.free("x")
        bm.allocate("x2", [1, 2, 8]); bm.retention.set_retention("x2", session="chat"); bm.free("x2")  # a hit on [1, 2]
        bm.allocate("y", [3, 4, 9]); bm.retention.set_retention("y", session="one-off"); bm.free("y")
        bm.allocate("z", [5, 6, 0])  # needs 2 blocks: one free, one evicted
        return [bm.lookup_prefix([1, 2, 0]).num_cached_tokens, bm.lookup_prefix([3, 4, 0]).num_cached_tokens]

    assert run("lru") == [0, 2]
    assert run("slru") == [2, 0]
    assert run("session") == [2, 0]


# ---------------------------------------------------------------------- priorities
def test_priority_orders_eviction_and_ties_by_recency():
    """vLLM's convention: a lower value is a higher priority; the largest value's blocks go first."""
    bm = BlockManager(6, 2, enable_prefix_caching=True, watermark=0)
    for s, prio in (("hi", -1), ("lo", 5), ("mid", 0), ("mid2", 0)):
        base = 10 * len(s) + prio * 100 + 1000
        bm.allocate(s, [base, base + 1, 0])
        bm.retention.set_retention(s, priority=prio)
        bm.free(s)
    bm.check_invariants()
    ev = bm._cache.evictor
    assert isinstance(ev, steering.SteeredEvictor)
    # eviction order: lo (5), then mid, mid2 (0, LRU), then hi (-1)
    order = list(ev)
    assert len(order) == 4 and ev.classes[5] and ev.classes[-1]
    assert [int(ev.where[b]) for b in order] == [5, 0, 0, -1]
    bm.allocate("new", list(range(2000, 2010)))  # 5 blocks: the 2 free ones, then the lo, mid, mid2 blocks
    assert list(ev) == order[3:]
    bm.check_invariants()


def test_priority_of_a_shared_block_is_its_last_releaser():
    bm = BlockManager(4, 2, enable_prefix_caching=True, watermark=0)
    bm.allocate("a", [1, 2, 3])
    bm.fork("a", "b")
    bm.retention.set_retention("a", priority=9)
    bm.free("a")  # still held by b
    bm.free("b")  # untagged: priority 0
    ev = bm._cache.evictor
    assert isinstance(ev, steering.SteeredEvictor)
    assert [int(ev.where[b]) for b in ev] == [0]
    bm.check_invariants()


def test_set_retention_errors_change_nothing():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(UnknownSequenceError):
        bm.retention.set_retention("nope", priority=1)
    with pytest.raises(InvalidArgumentError):
        bm.retention.set_retention("a", priority=1.5)
    with pytest.raises(TypeError):
        bm.retention.set_retention("a", session=["unhashable"])
    assert not bm._hints and not bm._steered
    nc = BlockManager(4, 2)  # no prefix caching: the call refuses
    nc.allocate("a", [1])
    with pytest.raises(InvalidArgumentError):
        nc.retention.set_retention("a", priority=1)


def test_constructor_checks():
    with pytest.raises(InvalidArgumentError, match="lru, slru, session, density, arc"):
        BlockManager(4, 2, enable_prefix_caching=True, eviction_policy="lfu")
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, 2, eviction_policy="slru")  # needs prefix caching
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, 2, enable_prefix_caching=True, pin_budget_blocks=-1)
    assert BlockManager(4, 2, enable_prefix_caching=True, pin_budget_blocks=2, sliding_window=4).config.pin_budget_blocks == 2
    assert EVICTION_POLICIES == ("lru", "slru", "session", "density", "arc")
    assert type(BlockManager(4, 2, enable_prefix_caching=True)._cache.evictor) is LRUEvictor  # the hot path as is
    assert type(BlockManager(4, 2, enable_prefix_caching=True, eviction_policy="slru")._cache.evictor) is SLRUEvictor
    assert BlockManager(4, 2, enable_prefix_caching=True, eviction_policy="session").config.eviction_policy == "session"
    assert isinstance(make_evictor("session", 3), SessionEvictor)


# ---------------------------------------------------------------------- pins
SYSTEM = list(range(100, 108))  # two blocks of 4


def _pinned_manager(policy="lru", budget=2, n=6):
    bm = BlockManager(n, 4, enable_prefix_caching=True, eviction_policy=policy, pin_budget_blocks=budget, watermark=0)
    bm.allocate("sys", SYSTEM + [1])
    bm.free("sys")
    return bm


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_pinned_prefix_survives_any_pressure(policy):
    bm = _pinned_manager(policy)
    pin = bm.retention.pin_prefix(SYSTEM)
    assert (pin.num_tokens, pin.num_blocks, pin.ttl) == (8, 2, None) and bm.retention.pins == (pin,)
    assert bm.retention.num_pinned_blocks == 2 and bm.num_free_gpu_blocks == 4  # parked: neither free nor evictable
    bm.check_invariants()
    for i in range(20):  # every other block churns
        bm.allocate(i, [1000 + 10 * i + j for j in range(16)])
        bm.check_invariants()
        bm.free(i)
    assert bm.lookup_prefix(SYSTEM + [5]).num_cached_tokens == 8
    assert bm.lookup_prefix(SYSTEM + [5]).num_new_blocks == 1  # the pinned hit takes no free block
    assert bm.allocate("user", SYSTEM + [5]) == 8  # a hit takes the blocks out of the parking...
    assert bm.num_free_gpu_blocks == 3
    bm.free("user")  # ... and a release parks them again
    assert bm.num_free_gpu_blocks == 4
    bm.retention.unpin(pin.pin_id)
    assert bm.num_free_gpu_blocks == 6 and bm.retention.num_pinned_blocks == 0 and bm.retention.pins == ()
    bm.check_invariants()
    with pytest.raises(UnknownPinError):
        bm.retention.unpin(pin.pin_id)
    for i in range(3):
        bm.allocate(f"u{i}", [2000 + 10 * i + j for j in range(8)])
    assert bm.lookup_prefix(SYSTEM + [5]).num_cached_tokens == 0  # unpinned, it is evicted as usual


def test_pin_budget_refusal_changes_nothing():
    bm = _pinned_manager(budget=3)
    bm.allocate("doc", [200 + j for j in range(8)] + [1])
    bm.free("doc")
    p1 = bm.retention.pin_prefix(SYSTEM)
    before = (bm.retention.num_pinned_blocks, bm.retention.pins, bm.num_free_gpu_blocks, list(bm._cache.evictor))
    with pytest.raises(PinBudgetError, match="budget is 3"):
        bm.retention.pin_prefix([200 + j for j in range(8)])
    assert (bm.retention.num_pinned_blocks, bm.retention.pins, bm.num_free_gpu_blocks, list(bm._cache.evictor)) == before
    p2 = bm.retention.pin_prefix(SYSTEM[:4])  # nested: its block is pinned already, no budget spent
    assert bm.retention.num_pinned_blocks == 2 and p2.num_blocks == 1
    bm.retention.unpin(p1.pin_id)
    assert bm.retention.num_pinned_blocks == 1  # the first block is still held by p2
    bm.check_invariants()


def test_pin_errors():
    with pytest.raises(InvalidArgumentError):
        BlockManager(4, 2, enable_prefix_caching=True).retention.pin_prefix([1, 2])  # no budget
    bm = _pinned_manager()
    with pytest.raises(InvalidArgumentError):
        bm.retention.pin_prefix(SYSTEM, ttl=0)
    with pytest.raises(pagedkv.InvalidTokensError):
        bm.retention.pin_prefix([])
    assert bm.retention.pin_prefix([7, 7, 7, 7]) == pagedkv.Pin(0, 0, 0, None)  # nothing cached: nothing pinned
    assert bm.retention.num_pinned_blocks == 0
    with pytest.raises(UnknownPinError):
        bm.retention.unpin(3)


def test_pin_ttl_expires_and_is_refreshed_on_hit(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(steering, "_now", lambda: now[0])
    bm = _pinned_manager()
    pin = bm.retention.pin_prefix(SYSTEM, ttl=10)
    now[0] = 108
    bm.allocate("hit", SYSTEM + [3])  # a hit on the whole pin refreshes it
    bm.free("hit")
    now[0] = 115
    assert bm.num_free_gpu_blocks == 4 and bm.retention.pins == (pin,)  # 7 s since the refresh: still pinned
    now[0] = 118.5
    assert bm.num_free_gpu_blocks == 6  # expired at 118: dropped by the next count
    assert bm.retention.pins == () and bm.retention.num_pinned_blocks == 0
    bm.check_invariants()


def test_reset_drops_pins_and_frees_parked_blocks():
    bm = _pinned_manager()
    bm.retention.pin_prefix(SYSTEM)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_free_gpu_blocks == 6 and bm.retention.pins == () and bm.retention.num_pinned_blocks == 0
    bm.check_invariants()


def test_withdrawn_content_is_not_held_by_its_pin():
    """A pin made on blocks whose KV was never written (aborted: free(cache=False)) holds nothing."""
    bm = BlockManager(6, 4, enable_prefix_caching=True, pin_budget_blocks=2, watermark=0)
    bm.allocate("s", SYSTEM + [1])
    bm.retention.pin_prefix(SYSTEM)
    bm.free("s", cache=False)  # the blocks are withdrawn from the cache, and go back to the free ring
    assert bm.num_free_gpu_blocks == 6 and bm.retention.num_pinned_blocks == 2  # the budget still counts the pin
    bm.check_invariants()
    bm.allocate("t", SYSTEM + [1])  # the same blocks may come back with new content: not parked on release
    bm.free("t")
    assert bm.num_free_gpu_blocks == 6
    bm.check_invariants()
