"""Retention a user steers, on every manager (issue 23 item 4): eviction policies, request priorities and pins over
KV cache groups (HybridBlockManager) and with a sliding-window BlockManager; a fork inherits its parent's priority.
Deterministic cases, then a stateful machine over HybridBlockManager that checks, after every rule, the invariants,
that pins hold, that ``lookup_prefix`` predicts ``allocate`` exactly (hit and free blocks consumed, pinned idle
hits included) and that a refused call changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from pagedkv import (EVICTION_POLICIES, BlockManager, FullAttentionSpec as F, HybridBlockManager,
                     SlidingWindowSpec as S)
from pagedkv.blocks.evictor import LRUEvictor, RetentionEvictor
from pagedkv.errors import (InvalidArgumentError, OutOfBlocksError, PinBudgetError, PromptTooLongError,
                            SequenceStateError, UnknownPinError, UnknownSequenceError)
from pagedkv.retention import steering
from pagedkv.retention.arc import ARCEvictor
from pagedkv.retention.eviction import SessionEvictor, SLRUEvictor

BS = 4
GROUPS = [F(), S(8), S(8)]  # a window of 8 tokens: a hit needs the 2 blocks before the hit point per sliding group


def hybrid(n=60, groups=GROUPS, **kw):
    kw.setdefault("watermark", 0)
    return BlockManager(n, BS, kv_cache_groups=groups, enable_prefix_caching=True, **kw, grouped_results=True)


SYSTEM = list(range(100, 124))  # 6 blocks


# ---------------------------------------------------------------------- policies over KV cache groups
@pytest.mark.parametrize("retention", [True, False])
def test_hybrid_eviction_policy_is_the_evictor_order(retention):
    for policy, cls in (("lru", LRUEvictor), ("slru", SLRUEvictor), ("session", SessionEvictor), ("arc", ARCEvictor)):
        hm = hybrid(eviction_policy=policy, window_retention=retention)
        ev = hm._cache.evictor
        assert hm.config.eviction_policy == policy
        if retention:  # window retention's spare blocks first, then the policy's order
            assert type(ev) is RetentionEvictor and type(ev.main) is cls
        else:
            assert type(ev) is cls
    with pytest.raises(InvalidArgumentError, match="lru, slru, session, density, arc"):
        hybrid(eviction_policy="lfu")
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, BS, kv_cache_groups=GROUPS, eviction_policy="slru", grouped_results=True)  # needs prefix caching


def test_hybrid_slru_protects_a_hit_prefix_over_a_newer_one():
    """SLRU through the hybrid coordinator: a prompt hit once (its blocks protected) outlives one released later
    but never hit; plain LRU keeps the newer one. The hit counts every group's blocks."""
    def run(policy):
        hm = hybrid(n=3 * 6, eviction_policy=policy, window_retention=False)
        a, b = list(range(10, 18)), list(range(30, 38))  # 2 blocks each, 3 groups: 6 blocks a prompt
        hm.allocate("a", a + [1]); hm.free("a")
        hm.allocate("a2", a + [2]); hm.free("a2")  # a hit on a's blocks in every group
        hm.allocate("b", b + [1]); hm.free("b")
        hm.check_invariants()
        hm.allocate("z", list(range(500, 516)))  # 12 blocks: the 6 free ones, then one prompt's 6 evicted
        hm.check_invariants()
        return [hm.lookup_prefix(a + [0]).num_cached_tokens, hm.lookup_prefix(b + [0]).num_cached_tokens]

    assert run("lru") == [0, 8]
    assert run("slru") == [8, 0]


def test_hybrid_session_hint_counts_one_request_for_every_group():
    hm = hybrid(eviction_policy="session", window_retention=False)
    hm.allocate("a", SYSTEM + [1])
    hm.retention.set_retention("a", session="chat")
    hm.free("a")
    assert hm._cache.evictor.sessions == {"chat": 1}  # one hint for the three groups' blocks
    hm.check_invariants()


# ---------------------------------------------------------------------- priorities over KV cache groups
def test_hybrid_priority_orders_every_groups_blocks_and_spare_blocks_go_first():
    hm = hybrid(n=90)
    for s, prio in (("hi", -1), ("lo", 5), ("mid", 0)):
        base = 1000 + 100 * len(s) + 10 * prio
        hm.allocate(s, list(range(base, base + 24)) + [1])
        hm.retention.set_retention(s, priority=prio)
        for _ in range(12):  # past the windows: the sliding groups release (and demote) blocks while decoding
            hm.decode_step([s], np.array([7]))
        hm.free(s)
        hm.check_invariants()
    ev = hm._cache.evictor
    assert isinstance(ev, steering.SteeredEvictor) and len(ev.spare) > 0
    order = list(ev)
    spare = set(ev.spare)
    k = len(spare)
    assert set(order[:k]) == spare  # spare sliding blocks of any priority first
    prios = [int(ev.where[b]) for b in order[k:]]
    assert prios == sorted(prios, reverse=True) and set(prios) == {5, 0, -1}
    # every group's kept blocks of "hi" are in class -1: its full group's and its sliding groups' last windows
    assert len(ev.classes[-1]) > 9
    hm.check_invariants()


def test_hybrid_window_releases_take_the_sequence_priority_with_retention():
    hm = hybrid(n=90)
    hm.allocate("s", SYSTEM + [1])
    hm.retention.set_retention("s", priority=3)
    for _ in range(10):
        hm.decode_step(["s"], np.array([7]))
    ev = hm._cache.evictor
    kept = [b for p, c in ev.classes.items() for b in c]  # released by the windows, kept (not spare)
    assert kept and all(int(ev.where[b]) == 3 for b in kept)
    hm.check_invariants()


def test_hybrid_set_retention_checks_and_fork_inherits_the_priority():
    hm = hybrid()
    hm.allocate("p", SYSTEM + [1])
    with pytest.raises(UnknownSequenceError):
        hm.retention.set_retention("nope", priority=1)
    with pytest.raises(InvalidArgumentError):
        hm.retention.set_retention("p", priority="high")
    with pytest.raises(TypeError):
        hm.retention.set_retention("p", session=[1])
    assert not hm._hints and not isinstance(hm._cache.evictor, steering.SteeredEvictor)
    hm.retention.set_retention("p", priority=7, session="c")
    hm.fork("p", "c")
    assert hm._hints["c"] == (7, None)  # the priority, not the session hint
    hm.free("p")
    hm.decode_step(["c"], np.array([3]))
    hm.free("c")
    ev = hm._cache.evictor
    assert {int(ev.where[b]) for b in ev if b not in set(ev.spare)} == {7}
    hm.check_invariants()
    nc = BlockManager(8, BS, kv_cache_groups=GROUPS, grouped_results=True)
    nc.allocate("a", [1])
    with pytest.raises(InvalidArgumentError):
        nc.retention.set_retention("a", priority=1)


def test_block_manager_fork_inherits_the_priority():
    bm = BlockManager(8, BS, enable_prefix_caching=True, watermark=0)
    bm.allocate("p", list(range(9)))
    bm.retention.set_retention("p", priority=4, session="s")
    bm.fork("p", "c")
    assert bm._hints["c"] == (4, None)
    bm.free("p")
    bm.free("c")
    ev = bm._cache.evictor
    assert [int(ev.where[b]) for b in ev] == [4, 4]
    bm.check_invariants()


def test_a_refused_free_in_the_step_changes_no_retention_state():
    hm = hybrid()
    hm.allocate("a", SYSTEM + [1])
    hm.retention.set_retention("a", priority=2)
    hm.take_copy_plan()
    hm.decode_step(["a"], np.array([5]))
    with pytest.raises(SequenceStateError):
        hm.free("a")
    assert hm._hints["a"] == (2, None)
    hm.check_invariants()


# ---------------------------------------------------------------------- pins over KV cache groups
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("retention", [True, False])
def test_hybrid_pin_holds_what_a_hit_needs_through_any_pressure(policy, retention):
    hm = hybrid(n=50, eviction_policy=policy, pin_budget_blocks=10, window_retention=retention)
    hm.allocate("sys", SYSTEM + [1])
    hm.free("sys")
    pin = hm.retention.pin_prefix(SYSTEM, ttl=60)
    # the full group's 6 blocks and each sliding group's last window before 24 tokens (positions 17-23: 2 blocks)
    assert (pin.num_tokens, pin.num_blocks, pin.ttl) == (24, 10, 60) and hm.retention.pins == (pin,)
    assert hm.retention.num_pinned_blocks == 10 and hm.num_free_gpu_blocks == 40
    hm.check_invariants()
    rng = np.random.default_rng(0)
    for i in range(12):  # every other block churns
        hm.allocate(i, rng.integers(0, 1000, 30))
        hm.retention.set_retention(i, priority=int(rng.integers(-3, 3)))
        for _ in range(4):
            hm.decode_step([i], np.array([9]))
        hm.free(i)
        hm.check_invariants()
    assert hm.stats.evictions > 0
    hit = hm.lookup_prefix(SYSTEM + [5])
    assert hit.num_cached_tokens == 24
    free = hm.num_free_gpu_blocks
    assert hm.allocate("user", SYSTEM + [5]) == 24
    assert free - hm.num_free_gpu_blocks == hit.num_new_blocks == 3  # the pinned hits take no free block
    hm.free("user")
    hm.retention.unpin(pin.pin_id)
    assert hm.retention.num_pinned_blocks == 0 and hm.retention.pins == ()
    with pytest.raises(UnknownPinError):
        hm.retention.unpin(pin.pin_id)
    hm.check_invariants()


def test_hybrid_pin_budget_errors_and_reset():
    hm = hybrid(pin_budget_blocks=14)
    hm.allocate("sys", SYSTEM + [1]); hm.free("sys")
    doc = list(range(300, 316))  # 4 full blocks: a pin holds them and 2 x 2 window blocks
    hm.allocate("doc", doc + [1]); hm.free("doc")
    p1 = hm.retention.pin_prefix(SYSTEM)
    before = (hm.retention.num_pinned_blocks, hm.retention.pins, hm.num_free_gpu_blocks, list(hm._cache.evictor))
    with pytest.raises(PinBudgetError, match="budget is 14"):  # 10 + 8 blocks
        hm.retention.pin_prefix(doc)
    assert (hm.retention.num_pinned_blocks, hm.retention.pins, hm.num_free_gpu_blocks, list(hm._cache.evictor)) == before
    # nested: its full group's blocks are pinned already, not the sliding groups' windows before 16 tokens
    p2 = hm.retention.pin_prefix(SYSTEM[:16])
    assert (p2.num_tokens, p2.num_blocks) == (16, 8) and hm.retention.num_pinned_blocks == 14
    hm.retention.unpin(p1.pin_id)
    assert hm.retention.num_pinned_blocks == 8
    assert hm.retention.pin_prefix([7, 7, 7, 7, 7]) == pagedkv.Pin(0, 0, 0, None)  # nothing cached
    with pytest.raises(InvalidArgumentError):
        hm.retention.pin_prefix(SYSTEM, ttl=-1)
    with pytest.raises(InvalidArgumentError):
        hybrid().retention.pin_prefix(SYSTEM)  # no budget
    assert hm.reset_prefix_cache() > 0
    assert hm.retention.pins == () and hm.retention.num_pinned_blocks == 0
    hm.check_invariants()


def test_hybrid_pin_ttl_expires(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(steering, "_now", lambda: now[0])
    hm = hybrid(pin_budget_blocks=10)
    hm.allocate("sys", SYSTEM + [1]); hm.free("sys")
    hm.retention.pin_prefix(SYSTEM, ttl=5)
    now[0] = 14
    assert hm.allocate("hit", SYSTEM + [2]) == 24  # a hit on the pin's last block refreshes it
    hm.free("hit")
    now[0] = 18
    assert hm.retention.num_pinned_blocks == 10
    now[0] = 19.5
    assert hm.num_free_gpu_blocks == 60 and hm.retention.pins == ()
    hm.check_invariants()


def test_hybrid_pin_stops_before_cpu_tier_blocks():
    """With a CPU tier a pin holds GPU blocks only: it stops at the first hit point whose blocks are not all on the
    GPU."""
    hm = BlockManager(30, BS, kv_cache_groups=[F(), S(4)], enable_prefix_caching=True, watermark=0,
                            num_cpu_blocks=40, cpu_prefix_cache=True, pin_budget_blocks=20, window_retention=False, grouped_results=True)
    hm.allocate("sys", SYSTEM + [1])
    hm.take_copy_plan()  # (its KV written: its blocks may be demoted from now on)
    hm.free("sys")
    hm.allocate("x", list(range(2000, 2030)))  # 16 blocks: 2 left free
    hm.allocate("y", list(range(3000, 3012)))  # 6 blocks: 4 of the system prompt's evicted (group 0's tail first)
    hm.take_copy_plan()  # (the demotions to the CPU tier)
    hit = hm.lookup_prefix(SYSTEM + [1])
    pin = hm.retention.pin_prefix(SYSTEM)
    assert hit.num_cpu_blocks > 0 and pin.num_tokens < hit.num_cached_tokens
    hm.check_invariants()


# ---------------------------------------------------------------------- pins with a sliding-window BlockManager
def test_sliding_window_pin_survives_and_a_step_does_not_count_a_pinned_release_as_free():
    """Regression: the step counted a pinned block its window releases as free; here the one step that needs a
    block releases only pinned ones, so it must be refused (it took a block that did not exist and left the
    sequence with released blocks its window still sees)."""
    bm = BlockManager(4, BS, enable_prefix_caching=True, sliding_window=5, pin_budget_blocks=2, watermark=0)
    system = list(range(100, 108))
    bm.allocate("s", system + [1, 2, 3, 4])  # 3 full blocks
    assert bm.retention.pin_prefix(system).num_blocks == 2
    bm.allocate("x", [7, 7, 7])  # the last free block
    assert not bm.can_append_slots(["s"])
    with pytest.raises(OutOfBlocksError):
        bm.decode_step(["s"], np.array([5]))
    bm.check_invariants()
    bm.free("x")
    bm.decode_step(["s"], np.array([5]))  # releases blocks 0 and 1 (parked: pinned), takes the freed one
    assert list(bm.block_table("s")[:2]) == [-1, -1] and bm.num_free_gpu_blocks == 0
    bm.check_invariants()
    bm.free("s")
    for i in range(4):
        bm.allocate(i, list(range(500 + 10 * i, 508 + 10 * i)))
        bm.free(i)
    assert bm.lookup_prefix(system + [9]).num_cached_tokens == 8  # a hit at the pin's length: every full block
    bm.check_invariants()


# ---------------------------------------------------------------------- stateful: HybridBlockManager with retention
DOCS = [list(range(1000 * d, 1000 * d + 40)) for d in range(1, 4)]


class HybridRetentionMachine(RuleBasedStateMachine):
    """Random calls on a HybridBlockManager with a drawn policy, window retention on or off, priorities, session
    hints, pins (TTL off) and a small pool, one step per rule. No aborts (free(cache=False)), so every pin holds
    its prefix."""

    @initialize(policy=st.sampled_from(EVICTION_POLICIES), retention=st.booleans(),
                groups=st.sampled_from([(None, 8), (None, 5, 8), (4, None), (None, 3, None, 12)]),
                n=st.integers(24, 60), budget=st.sampled_from([0, 6, 14, 30]))
    def setup(self, policy, retention, groups, n, budget):
        specs = [F() if w is None else S(w) for w in groups]
        self.hm = BlockManager(n, BS, kv_cache_groups=specs, enable_prefix_caching=True, watermark=0,
                                     eviction_policy=policy, pin_budget_blocks=budget, window_retention=retention, grouped_results=True)
        self.live: list = []
        self.nid = 0
        self.pins: dict = {}  # pin id -> (tokens, tokens pinned)

    def state(self):
        hm = self.hm
        return (hm.num_free_gpu_blocks, hm.retention.num_pinned_blocks, hm.retention.pins, len(hm), hm.stats.num_cached_blocks)

    @rule(doc=st.integers(0, 2), cut=st.integers(0, 40), extra=st.integers(0, 9), prio=st.integers(-2, 2),
          session=st.sampled_from([None, "a", "b"]))
    def allocate(self, doc, cut, extra, prio, session):
        toks = DOCS[doc][:cut] + [7000 + self.nid * 10 + j for j in range(extra)] or [1]
        hit = self.hm.lookup_prefix(toks)
        before = self.state()
        sid = self.nid
        try:
            got = self.hm.allocate(sid, toks)
        except PromptTooLongError:  # never fits (every group's blocks): nothing changed
            assert self.state() == before
            return
        except OutOfBlocksError:
            assert hit.num_new_blocks > before[0]  # refused: it did not fit, and nothing changed
            assert self.state() == before
            return
        assert hit.num_new_blocks <= before[0]
        assert got == hit.num_cached_tokens  # lookup_prefix predicts the hit ...
        assert before[0] - self.hm.num_free_gpu_blocks == hit.num_new_blocks  # ... and the blocks it takes
        self.nid += 1
        self.live.append(sid)
        if prio or session:
            self.hm.retention.set_retention(sid, priority=prio, session=session)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        batch = data.draw(st.lists(st.sampled_from(self.live), min_size=1, max_size=3, unique=True))
        fits = self.hm.can_append_slots(batch)
        before = self.state()
        try:
            self.hm.decode_step(batch, np.array([5] * len(batch)))
        except OutOfBlocksError:
            assert not fits and self.state() == before
            return
        assert fits

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.live))
        self.live.remove(sid)
        self.hm.free(sid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        self.hm.fork(parent, self.nid)
        self.live.append(self.nid)
        self.nid += 1

    @rule(doc=st.integers(0, 2), cut=st.integers(1, 40))
    def pin(self, doc, cut):
        toks = DOCS[doc][:cut]
        if not self.hm.config.pin_budget_blocks:
            with pytest.raises(InvalidArgumentError):
                self.hm.retention.pin_prefix(toks)
            return
        before = self.state()
        try:
            p = self.hm.retention.pin_prefix(toks)
        except PinBudgetError:
            assert self.state() == before
            return
        if p.pin_id:
            assert 0 < p.num_tokens <= len(toks) // BS * BS and p.num_tokens % BS == 0
            self.pins[p.pin_id] = (toks, p.num_tokens)
        assert self.hm.retention.num_pinned_blocks <= self.hm.config.pin_budget_blocks

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pid = data.draw(st.sampled_from(sorted(self.pins)))
        self.hm.retention.unpin(pid)
        del self.pins[pid]

    @invariant()
    def invariants_and_pins_hold(self):
        if not hasattr(self, "hm"):
            return
        self.hm.take_copy_plan()  # every rule is a step (its forward writes what it handed out)
        self.hm.check_invariants()
        for toks, n in self.pins.values():  # a pinned prefix stays hittable at the pin's length
            assert self.hm.lookup_prefix(toks[:n] + [0]).num_cached_tokens == n


HybridRetentionMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHybridRetention = HybridRetentionMachine.TestCase


def test_lookup_counts_a_pinned_orphan_the_allocation_meets():
    """Issue 23 (the hybrid retention machine's block-count mismatch, reduced): the pin holds the sliding group's
    blocks 1 and 2 of DOCS[1], whose block 0 there was evicted, so they are orphans a full chain walk cannot reach.
    Allocating DOCS[1][:8] (no hit) registered its sliding group's block 1 under the pinned block's key: the orphan
    was uncached and went to the free ring, and lookup_prefix's num_new_blocks (4) exceeded what the free count
    lost (3). A pinned orphan now stays cached, chained under the live parent (same key: same prefix), and the new
    block is its copy: the prediction is exact and the pinned block reachable again."""
    hm = BlockManager(24, BS, kv_cache_groups=[F(), S(8)], enable_prefix_caching=True, watermark=0,
                            eviction_policy="lru", pin_budget_blocks=6, window_retention=True, grouped_results=True)

    def step():
        hm.take_copy_plan()
        hm.check_invariants()

    hm.allocate(0, DOCS[1][:18] + [7000 + j for j in range(9)])
    step()
    hm.fork(0, 1)
    hm.fork(0, 2)
    hm.decode_step([0], np.array([5]))
    step()
    for s in (0, 1, 2):
        hm.free(s)
    hm.allocate(3, DOCS[0][:7] + [7030 + j for j in range(9)])
    step()
    hm.free(3)
    assert hm.retention.pin_prefix(DOCS[1][:12]).num_blocks == 5
    hm.allocate(4, [1])
    step()
    for _ in range(4):
        hm.decode_step([4], np.array([5]))
        step()
    hit = hm.lookup_prefix(DOCS[1][:8])
    free = hm.num_free_gpu_blocks
    assert hm.allocate(5, DOCS[1][:8]) == hit.num_cached_tokens == 0
    hm.check_invariants()
    assert free - hm.num_free_gpu_blocks == hit.num_new_blocks == 4  # was 3 taken, 4 predicted
    b1 = int(hm.block_table(5, 1)[1])
    assert hm._cache.cid[b1] == 0 and hm._cache.dupc[b1] != 0  # a copy of the pinned block, which stays pinned
    assert hm.retention.num_pinned_blocks == 5
    hm.take_copy_plan()
    hm.free(5)
    hm.check_invariants()
    assert hm.lookup_prefix(DOCS[1][:12] + [0]).num_cached_tokens == 12  # the pinned prefix stays a hit


def test_kv_events_and_stats_keep_their_meaning_with_pins_and_priorities():
    """A pin or a priority changes which blocks are evicted, never what the events say: every evicted block is one
    BlockRemoved (the pinned ones never), the eviction counter counts them, and the index rebuilt from the events
    is the cache's key set."""
    hm = hybrid(n=40, pin_budget_blocks=10, eviction_policy="slru", enable_kv_events=True)
    hm.allocate("sys", SYSTEM + [1]); hm.free("sys")
    pin = hm.retention.pin_prefix(SYSTEM)
    pinned_keys = {int(hm._cache.key[b]) for b in hm._cache.evictor.pins[pin.pin_id][0]}
    index: set = set()
    for e in hm.events.take():
        if isinstance(e, pagedkv.events.BlockStored):
            index |= set(e.block_hashes)
    ev0, removed = hm.stats.evictions, 0
    rng = np.random.default_rng(1)
    for i in range(10):
        hm.allocate(i, rng.integers(0, 1000, 28))
        hm.retention.set_retention(i, priority=i % 3)
        hm.free(i)
        for e in hm.events.take():
            if isinstance(e, pagedkv.events.BlockStored):
                index |= set(e.block_hashes)
            elif isinstance(e, pagedkv.events.BlockRemoved):
                assert not pinned_keys & set(e.block_hashes)
                index -= set(e.block_hashes)
                removed += len(e.block_hashes)
    assert removed == hm.stats.evictions - ev0 > 0
    assert index == {int(k) for k in hm._cache.mapping()}
    hm.check_invariants()
