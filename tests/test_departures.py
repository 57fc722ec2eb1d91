"""The five departures from the documented contract that an engine written from the docs alone found (issue 32,
"The contract, exactly as documented"): each scenario exactly as the issue gives it, asserting what the docs say."""

from __future__ import annotations

from collections import Counter

import pytest

from pagedkv import BlockManager, FullAttentionSpec, SlidingWindowSpec, block_hashes


def _step(m):
    m.take_copy_plan()  # (the engine executes the plan, then the step's forward)


@pytest.mark.parametrize("window", [None, 8, 64])
def test_a_swap_in_shares_content_another_sequence_cached_while_it_was_out(window):
    """docs/design.md: a swapped-out sequence's cached blocks may be evicted while it is out; at swap-in it shares
    the block still caching that content. B caches P's first three blocks again (new content ids) while A is out:
    A's swap-in shares them, and A's later blocks chain after them, so all of A's 20 cached tokens stay findable,
    while A lives and after both are freed (also with KV cache groups: a full and a sliding one)."""
    if window is None:
        bm = BlockManager(12, 4, num_cpu_blocks=12, enable_prefix_caching=True)
    else:
        bm = BlockManager(24, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(window)],
                                num_cpu_blocks=24, enable_prefix_caching=True, watermark=0, grouped_results=True)
    P = list(range(1, 22))
    bm.allocate("A", P)
    _step(bm)
    bm.swap_out(["A"])
    _step(bm)
    bm.allocate("X", list(range(100, 145)))  # evicts A's cached GPU blocks
    _step(bm)
    bm.free("X")
    _step(bm)
    bm.allocate("B", P[:12] + [99])
    _step(bm)
    pairs = bm.swap_in(["A"])
    _step(bm)
    bm.check_invariants()
    b_blocks = bm.block_table("B")[:3].tolist()
    assert bm.block_table("A")[:3].tolist() == b_blocks  # shared, not copied
    # only A's own blocks come back (three a group)
    assert len(pairs) == 3 * bm.config.num_groups and not {d for _, d in pairs} & set(b_blocks)
    assert bm.lookup_prefix(P).num_cached_tokens == 20
    bm.free("B")
    bm.free("A")
    bm.check_invariants()
    assert bm.lookup_prefix(P).num_cached_tokens == 20


@pytest.mark.parametrize("policy", ["write_through", "selective", "write_back"])
def test_stored_content_is_never_planned_again_after_eviction_and_recompute(policy):
    """docs/external-kv.md: a content already stored (planned, and the store succeeded) is not planned again; P
    computed three times with eviction between (new content ids each time) is planned once per block."""
    m = BlockManager(16, 4, enable_prefix_caching=True, watermark=0, store_policy=policy, store_min_hits=1)
    P = list(range(1, 18))  # 4 full blocks before the last token
    planned = Counter()

    def drain():
        while (plan := m.external.take_store_plan()) is not None:
            planned.update(plan.keys)
            m.external.complete_store(plan.store_id, True)

    for rnd in range(3):
        m.allocate("p", P)
        _step(m)
        drain()
        if policy == "selective":  # a hit makes it a candidate
            m.allocate("q", P)
            _step(m)
            drain()
            m.free("q")
        m.free("p")
        _step(m)
        drain()
        x = list(range(1000 * (rnd + 1), 1000 * (rnd + 1) + 63))  # takes every block: P is evicted
        m.allocate("x", x)
        _step(m)
        assert m.lookup_prefix(P).num_cached_tokens == 0
        m.free("x")
        _step(m)
        m.check_invariants()
    assert [planned[k] for k in block_hashes(P, 4)] == [1, 1, 1, 1]


def test_free_right_after_swap_in_sharing_a_live_sequences_blocks_is_allowed():
    """docs/engine-contract.md: a sequence swapped in in the current step counts as handed slots only when it got
    back a GPU block cached in the same step. B (allocated a step earlier) shares A's blocks: free, fork and
    swap_out of A right after its swap-in are accepted."""
    for call in ("free", "fork", "swap_out"):
        bm = BlockManager(16, 4, num_cpu_blocks=16, enable_prefix_caching=True)
        _step(bm)  # the same-step checks are on
        A = list(range(1, 11))
        bm.allocate("A", A)
        _step(bm)
        bm.swap_out(["A"])
        _step(bm)
        bm.allocate("B", A + [99])
        _step(bm)
        bm.swap_in(["A"])
        assert bm.block_table("A")[:2].tolist() == bm.block_table("B")[:2].tolist()
        if call == "free":
            bm.free("A")
        elif call == "fork":
            bm.fork("A", "A2")
        else:
            bm.swap_out(["A"])
        bm.check_invariants()


def test_free_right_after_swap_in_of_a_block_cached_this_step_is_still_refused():
    """The documented exception stays: B caches A's prefix again in the step A comes back in (no CPU tier)."""
    from pagedkv.errors import SequenceStateError

    bm = BlockManager(8, 4, num_cpu_blocks=16, enable_prefix_caching=True, watermark=0.0)
    _step(bm)
    p = list(range(1, 10))
    bm.allocate("a", p)
    _step(bm)
    bm.swap_out(["a"])
    _step(bm)
    bm.allocate("big", list(range(100, 132)))
    _step(bm)
    bm.free("big")
    bm.allocate("b", p)  # this step
    bm.swap_in(["a"])
    with pytest.raises(SequenceStateError):
        bm.free("a")
    bm.check_invariants()


# issue 32, departure 4: the exact scenario (found by a seeded search over the docs' engine; 17 shared tokens)
_P = [2, 4, 3, 4, 5, 1, 5, 1, 1, 4, 3, 1, 2, 3, 2, 3, 2, 2, 2, 2, 3, 3, 4, 2, 4, 4, 5, 3, 4, 2, 1, 2, 1, 5, 4, 2,
      5, 2, 2, 2, 1, 2]
_D = [4, 2, 5]
_Q = _P[:17] + [6, 7, 8, 8, 8, 8, 9, 9, 6, 6, 8, 9, 8, 7, 9, 9, 8, 7]


def test_an_abort_does_not_reach_a_live_sequences_findability():
    """docs/engine-contract.md: free(seq, cache=False) withdraws what the sequence's last call cached, and
    docs/design.md: findability covers the hit points whose blocks a live sequence holds. A chunked admission S
    sharing live L's first 17 tokens, aborted in its step, leaves L's 44 findable tokens findable."""
    m = BlockManager(64, 2, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(9), SlidingWindowSpec(9)],
                           enable_prefix_caching=True, watermark=0.0, grouped_results=True)
    _step(m)
    m.allocate("L", _P, num_new_tokens=29)
    _step(m)
    m.decode_step(["L"], _P[29:], num_new_tokens=[len(_P) - 29])
    _step(m)
    for t in _D:
        m.decode_step(["L"], [t])
        _step(m)
    full = _P + _D
    assert m.lookup_prefix(full).num_cached_tokens == 44
    m.allocate("S", _Q, num_new_tokens=2)
    m.free("S", cache=False)
    m.check_invariants()
    assert m.lookup_prefix(full).num_cached_tokens == 44
    _step(m)
    m.free("L")
    m.check_invariants()
    assert m.lookup_prefix(full).num_cached_tokens == 44


@pytest.mark.parametrize("hybrid", [False, True])
def test_lookup_prefix_with_external_tokens_counts_the_blocks_allocate_takes(hybrid):
    """docs/external-kv.md: admission asks lookup_prefix / can_allocate about an external load with chunked
    prefill. ``num_new_tokens=E + k`` cannot know that allocate keeps only E' < E (a 28-token prompt, blocks of 2:
    E = 28 is cut to 26; k = 1, lookahead 3: it predicted 16 blocks, allocate took 15); ``num_external_tokens=E``
    with ``num_new_tokens=k`` counts exactly what allocate takes, and E + k stays an upper bound."""
    P = list(range(1, 29))
    if hybrid:
        m = BlockManager(96, 2, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)],
                               enable_prefix_caching=True, watermark=0, grouped_results=True)
        m.allocate("warm", P[:9])  # a hit of 4 blocks in both groups
        _step(m)
    else:
        m = BlockManager(64, 2, enable_prefix_caching=True, watermark=0)
    exact = m.lookup_prefix(P, 3, num_new_tokens=1, num_external_tokens=28)
    bound = m.lookup_prefix(P, 3, num_new_tokens=28 + 1)
    assert m.can_allocate(P, 3, num_new_tokens=1, num_external_tokens=28).name == "OK"
    free = m.num_free_gpu_blocks
    got = m.allocate("s", P, 3, num_new_tokens=1, num_external_tokens=28)
    used = free - m.num_free_gpu_blocks
    assert got == 26 and m.num_tokens("s") == 27
    assert exact.num_new_blocks == used and exact.num_cached_tokens == (8 if hybrid else 0)
    assert bound.num_new_blocks == used + (2 if hybrid else 1)  # the E + k form: one block more per group
    m.check_invariants()


def test_lookup_and_can_allocate_check_num_external_tokens_as_allocate_does():
    from pagedkv.errors import InvalidArgumentError

    m = BlockManager(16, 4, enable_prefix_caching=True)
    for bad in (3, -4, True, 2.0):
        with pytest.raises(InvalidArgumentError):
            m.lookup_prefix([1, 2, 3, 4, 5], num_external_tokens=bad)
        with pytest.raises(InvalidArgumentError):
            m.can_allocate([1, 2, 3, 4, 5], num_external_tokens=bad)
    w = BlockManager(16, 4, enable_prefix_caching=True, sliding_window=8)
    with pytest.raises(InvalidArgumentError):
        w.lookup_prefix([1, 2, 3, 4, 5], num_external_tokens=4)
    assert w.lookup_prefix([1, 2, 3, 4, 5], num_external_tokens=0).num_new_blocks == 2
