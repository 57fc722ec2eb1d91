"""The ``arc`` eviction policy (pagedkv.retention.arc): the evictor against a plain reference model of ARC through
random operation sequences (content registered, released, hit, evicted, re-cached), golden adaptation runs through
BlockManager and HybridBlockManager, and the hook (make_evictor hands the prefix cache's key and cid arrays)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.retention.arc import ARCEvictor, _Ghost
from pagedkv.retention.eviction import make_evictor


class RefARC:
    """ARC as the paper states it, on blocks whose content key and id the test sets: T1/T2 (OrderedDicts of
    blocks), ghosts B1/B2 (OrderedDicts of keys), p. A push files a block hit while cached, or whose key is in a
    ghost list (adapting p, key removed), in T2, else in T1; an eviction takes T1 while it holds more than p
    blocks (or T2 is empty); the ghosts are trimmed to |T1| + |B1| <= c and the directory to 2c."""

    def __init__(self, c, key, cid):
        self.c, self.key, self.cid = c, key, cid
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
        self.p, self.hit = 0.0, {}

    def push_many(self, blocks):
        to2 = []
        for b in blocks:
            c, k = int(self.cid[b]), int(self.key[b])
            if c and self.hit.get(b) == c:
                to2.append(True)
                continue
            n1, n2 = len(self.b1), len(self.b2)
            if k in self.b1:
                self.p = min(self.c, self.p + max(1.0, n2 / n1))
                del self.b1[k]
            elif k in self.b2:
                self.p = max(0.0, self.p - max(1.0, n1 / n2))
                del self.b2[k]
            else:
                to2.append(False)
                continue
            self.hit[b] = c
            to2.append(True)
        for b, two in zip(blocks, to2):
            (self.t2 if two else self.t1)[b] = None
        self.trim()

    def trim(self):
        while len(self.b1) and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while len(self.b2) and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def discard(self, b):
        (self.t1 if b in self.t1 else self.t2).pop(b)
        self.hit[b] = int(self.cid[b])

    def pop_many(self, n):
        k = min(n, max(0, len(self.t1) - int(self.p)))
        if n - k > len(self.t2):
            k = n - len(self.t2)
        a = [self.t1.popitem(last=False)[0] for _ in range(k)]
        b = [self.t2.popitem(last=False)[0] for _ in range(n - k)]
        for x in a:
            self.b1[int(self.key[x])] = None
        for x in b:
            self.b2[int(self.key[x])] = None
        self.trim()
        return a + b

    def order(self):
        o1 = list(self.t1)
        k = min(len(o1), max(0, len(o1) - int(self.p)))
        return o1[:k] + list(self.t2) + o1[k:]


OPS = st.lists(st.tuples(st.sampled_from(["cache", "push_many", "discard", "discard_many", "pop_many"]),
                         st.integers(0, 1000)), min_size=1, max_size=300)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 24), contents=st.integers(1, 40), ops=OPS)
def test_arc_matches_its_reference(n, contents, ops):
    """Blocks get contents (key = content number, fresh content id each time), are released, hit and evicted;
    an evicted block's content comes back on another block (the ghost hits). Orders, membership, p and the
    ghost lists match the reference after every operation."""
    key = np.zeros(n, dtype=np.uint64)
    cid = np.zeros(n, dtype=np.int64)
    ev, ref = ARCEvictor(n, key, cid), RefARC(n, key, cid)
    serial = 0
    inside: list = []  # in the evictor
    held: list = []  # cached, referenced (not in the evictor)
    for op, x in ops:
        free = [b for b in range(n) if cid[b] == 0]
        cached_keys = {int(key[b]) for b in range(n) if cid[b]}
        if op == "cache" and free:  # register a content on a free block (a miss; maybe a ghost's content)
            b = free[x % len(free)]
            k = 1 + x % contents
            if k in cached_keys:
                continue
            serial += 1
            key[b], cid[b] = k, serial
            held.append(b)
        elif op == "push_many" and held:
            blocks = list(dict.fromkeys(held[(x + 5 * i) % len(held)] for i in range(1 + x % len(held))))
            ev.push_many(np.array(blocks, dtype=np.int32))
            ref.push_many(blocks)
            for b in blocks:
                held.remove(b)
            inside += blocks
        elif op == "discard" and inside:  # a hit takes it back
            b = inside.pop(x % len(inside))
            ev.discard(b), ref.discard(b)
            held.append(b)
        elif op == "discard_many" and inside:
            blocks = list(dict.fromkeys(inside[(x + 3 * i) % len(inside)] for i in range(x % 4)))
            ev.discard_many(np.array(blocks, dtype=np.int64))
            for b in blocks:
                ref.discard(b)
                inside.remove(b)
                held.append(b)
        elif op == "pop_many" and inside:
            k = x % (len(inside) + 1)
            got = (ev.pop_many(k) if k != 1 or x % 2 else np.array([ev.pop()])).tolist()
            assert got == ref.pop_many(k)
            for b in got:
                inside.remove(b)
                cid[b] = 0  # the prefix cache forgets the content (its key stays until reused)
        assert len(ev) == len(inside)
        assert list(ev) == ref.order()
        assert all((b in ev) == (b in inside) for b in range(n))
        assert ev.p == ref.p
        assert ev.b1.keys() == list(ref.b1) and ev.b2.keys() == list(ref.b2)
        ev.check_ghosts()


def test_ghost_list_keeps_insertion_order_through_compactions():
    g = _Ghost()
    for i in range(50):
        g.add_many(np.arange(10 * i, 10 * i + 10, dtype=np.uint64))
        assert g.take(10 * i + 3)
        g.trim(37)
        assert len(g) <= 37
    keys = g.keys()
    assert len(keys) == 37 and keys == sorted(keys) and 493 not in keys and keys[-1] == 499
    g.add_many(np.array([keys[0]], dtype=np.uint64))  # re-added: now the most recent
    assert g.keys()[-1] == keys[0] and len(g) == 37
    g.trim(0)
    assert len(g) == 0 and g.keys() == []


def test_make_evictor_arc_needs_the_cache():
    with pytest.raises(InvalidArgumentError, match="arc"):
        make_evictor("arc", 4)
    bm = BlockManager(4, 2, enable_prefix_caching=True, eviction_policy="arc")
    ev = bm._cache.evictor
    assert type(ev) is ARCEvictor and ev.key is bm._cache.key and ev.cid is bm._cache.cid
    assert bm.config.eviction_policy == "arc"


def _adapt(policy):
    """Block size 2, pool 4. X is hit (frequent, T2); Y is evicted by a one-off Z (Y's key to B1) and then comes
    back (a ghost hit: p rises to 1, Y to T2); a prompt needing 2 evictions then finds T1 at p: ARC evicts the
    frequent X and Y and keeps Z's first block; SLRU evicts the never-hit blocks first; LRU by release."""
    bm = BlockManager(4, 2, enable_prefix_caching=True, eviction_policy=policy, watermark=0)
    X, Y, Z = [1, 2], [3, 4], [5, 6, 7, 8]
    for s, p in (("x", X + [0]), ("x2", X + [9]), ("y", Y + [0]), ("z", Z + [0]), ("y2", Y + [1])):
        bm.allocate(s, p)
        bm.free(s)
        bm.check_invariants()
    ev = bm._cache.evictor
    if policy == "arc":
        assert ev.p == 1.0 and len(ev.t1) == 1 and len(ev.t2) == 2
    bm.allocate("w", [11, 12, 13, 14, 0])
    bm.check_invariants()
    return [bm.lookup_prefix(p + [0]).num_cached_tokens for p in (X, Y, Z)]


def test_golden_arc_adapts_to_a_ghost_hit():
    assert _adapt("arc") == [0, 0, 2]
    assert _adapt("slru") == [2, 0, 0]
    assert _adapt("lru") == [0, 2, 0]


def test_arc_over_kv_cache_groups():
    """ARC behind HybridBlockManager (every group's blocks in one prefix cache): the run of _adapt with two and
    three groups. Y's G blocks are G ghost hits (p = G); the last prompt's evictions then take T2 (X and Y in
    every group), where SLRU keeps the hit X and LRU the recent Y. Z's first block is gone in group 0 either
    way (a release files its blocks group by group, tail first, and y2's eviction took group 0's), so Z hits
    nothing."""
    def run(policy, groups, retention):
        G = len(groups)
        hm = BlockManager(G * 4, 2, kv_cache_groups=groups, enable_prefix_caching=True,
                                eviction_policy=policy, watermark=0, window_retention=retention, grouped_results=True)
        X, Y, Z = [1, 2], [3, 4], [5, 6, 7, 8]
        for s, p in (("x", X + [0]), ("x2", X + [9]), ("y", Y + [0]), ("z", Z + [0]), ("y2", Y + [1])):
            hm.allocate(s, p)
            hm.free(s)
            hm.check_invariants()
        if policy == "arc":
            ev = hm._cache.evictor
            ev = getattr(ev, "main", ev)  # (under window retention's spare class)
            assert ev.p == G and len(ev.t2) == 2 * G
            ev.check_ghosts()
        hm.allocate("w", [11, 12, 13, 14, 0])
        hm.check_invariants()
        return [hm.lookup_prefix(p + [0]).num_cached_tokens for p in (X, Y, Z)]

    for groups in ([FullAttentionSpec(), FullAttentionSpec()],
                   [FullAttentionSpec(), SlidingWindowSpec(4), SlidingWindowSpec(4)]):
        for retention in (False, True):
            assert run("arc", groups, retention) == [0, 0, 0]
            assert run("slru", groups, retention) == [2, 0, 0]
            assert run("lru", groups, retention) == [0, 2, 0]
