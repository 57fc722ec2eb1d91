"""The eviction policies' base class (pagedkv.blocks.policy.EvictionPolicy): the table of policies by name, a
policy given as a name, a class or an instance, a user's policy with one hook driven against a plain reference
model, and the bookkeeping check (verify) run under every built-in policy."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import EVICTION_POLICIES, BlockManager, EvictionPolicy
from pagedkv import FullAttentionSpec, SlidingWindowSpec
from pagedkv.blocks.evictor import LRUEvictor
from pagedkv.blocks.policy import POLICIES, make_policy
from pagedkv.errors import InvalidArgumentError
from pagedkv.retention.arc import ARCEvictor
from pagedkv.retention.density import DensityEvictor
from pagedkv.retention.eviction import SessionEvictor, SLRUEvictor

import evictor_drive


def test_the_table_names_every_built_in_policy_once():
    assert EVICTION_POLICIES == ("lru", "slru", "session", "density", "arc")
    for name, cls in (("lru", LRUEvictor), ("slru", SLRUEvictor), ("session", SessionEvictor),
                      ("density", DensityEvictor), ("arc", ARCEvictor)):
        assert POLICIES[name] is cls and cls.name == name and issubclass(cls, EvictionPolicy)
    assert pagedkv.EvictionPolicy is EvictionPolicy


def test_unknown_policies_are_refused_naming_the_table():
    for bad in ("mru", 3, object(), int):
        with pytest.raises(InvalidArgumentError, match="lru, slru, session, density, arc"):
            BlockManager(8, 4, enable_prefix_caching=True, eviction_policy=bad)
    with pytest.raises(InvalidArgumentError, match="need enable_prefix_caching"):
        BlockManager(8, 4, eviction_policy=SLRUEvictor)


class Oldest(EvictionPolicy):
    """A policy with one hook: blocks hit at least once go after every block never hit (FIFO within each)."""

    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.hits = np.zeros(num_blocks, dtype=np.bool_)

    def place(self, blocks):
        h = self.hits[blocks]
        self.append(0, blocks[~h], 0)
        self.append(1, blocks[h], 1)


class RefOldest:
    def __init__(self, ev):
        self.ev, self.a, self.b = ev, OrderedDict(), OrderedDict()

    def push_many(self, blocks):
        for x in blocks:
            (self.b if self.ev.hits[x] else self.a)[x] = None

    def discard(self, x):
        (self.a if x in self.a else self.b).pop(x)

    def pop(self):
        return (self.a if self.a else self.b).popitem(last=False)[0]

    def order(self):
        return list(self.a) + list(self.b)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 24), operations=evictor_drive.ops(), marks=st.lists(st.integers(0, 23), max_size=12))
def test_a_users_policy_with_one_hook_matches_its_reference(n, operations, marks):
    ev = Oldest(n)
    ev.hits[[m for m in marks if m < n]] = True
    evictor_drive.drive(ev, RefOldest(ev), n, operations)
    ev.verify()


def _churn(policy, n_blocks=10):
    """Requests over 6 documents of 2 full blocks each (+ a partial one), hit in turn, with session hints; the
    KV events' removals, in order, are the eviction order."""
    bm = BlockManager(n_blocks, 4, enable_prefix_caching=True, eviction_policy=policy, watermark=0,
                      enable_kv_events=True)
    docs = [[100 * d + i for i in range(9)] for d in range(6)]
    for i, d in enumerate([0, 1, 2, 0, 3, 4, 0, 5, 1, 2, 3, 0, 4, 5, 2]):
        bm.allocate(i, docs[d] + [i])
        bm.retention.set_retention(i, session=d % 3)
        bm.free(i)
        bm.check_invariants()
    removed = [e for e in bm.events.take() if type(e).__name__ == "BlockRemoved"]
    return bm, removed


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_a_class_or_a_new_instance_evicts_as_the_name_does(name):
    cls = POLICIES[name]
    by_name = _churn(name)[1]
    assert by_name  # (the churn evicts)
    assert _churn(cls)[1] == by_name
    inst = make_policy(name, 10, None) if name != "arc" else None
    if inst is not None:
        bm, removed = _churn(inst)
        assert removed == by_name and bm._cache.evictor is inst
    assert BlockManager(24, 4, enable_prefix_caching=True, eviction_policy=cls).config.eviction_policy == name


def test_an_instance_must_be_new_and_sized_for_the_pool():
    with pytest.raises(InvalidArgumentError, match="num_gpu_blocks=8"):
        BlockManager(8, 4, enable_prefix_caching=True, eviction_policy=SLRUEvictor(9))
    used = SLRUEvictor(8)
    used.push(3)
    with pytest.raises(InvalidArgumentError, match="must be new"):
        BlockManager(8, 4, enable_prefix_caching=True, eviction_policy=used)


def test_an_unnamed_policy_class_reports_its_class_name_and_works_with_priorities_and_groups():
    bm = BlockManager(24, 4, enable_prefix_caching=True, eviction_policy=Oldest, pin_budget_blocks=4)
    assert bm.config.eviction_policy == "Oldest"
    bm.allocate("a", list(range(9)))
    bm.retention.set_retention("a", priority=5)  # a priority class: a new Oldest made for it
    bm.free("a")
    bm.check_invariants()
    hm = BlockManager(40, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                            enable_prefix_caching=True, eviction_policy=Oldest, grouped_results=True)
    for i in range(12):
        hm.allocate(i, [7] * 4 + list(range(10 * i, 10 * i + 9)))
        hm.free(i)
        hm.check_invariants()
    assert hm.config.eviction_policy == "Oldest"


def test_verify_catches_broken_bookkeeping():
    ev = SLRUEvictor(8)
    ev.push_many(np.array([1, 2, 3], dtype=np.int32))
    ev.verify()
    ev.stamp[2] = 0  # (a block lost without the count)
    with pytest.raises(AssertionError):
        ev.verify()
