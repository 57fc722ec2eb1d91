"""The engine-facing contract added for engine builders: allocate_batch (PrefillBatch), lookup_prefix
(PrefixHit), allocate's lookahead slots, and fixed-width block tables (block_table_width)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pagedkv import NULL_BLOCK, AllocStatus, BlockManager, PrefixHit
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PromptTooLongError,
    TableWidthError,
)
from test_errors import check_raises, snapshot


def _prompts(rng: random.Random, k: int, bs: int) -> list[list[int]]:
    """Prompts drawn from a few stems, so that they share prefixes (and sometimes are identical)."""
    stems = [[rng.randrange(6) for _ in range(4 * bs)] for _ in range(3)]
    out = []
    for _ in range(k):
        stem = rng.choice(stems)
        cut = rng.randrange(1, len(stem) + 1)
        out.append(stem[:cut] + [rng.randrange(6) for _ in range(rng.randrange(0, 2 * bs))])
    return out


def _manager(rng: random.Random, tier: bool, bs: int = 2, blocks: int = 40) -> BlockManager:
    return BlockManager(blocks, bs, enable_prefix_caching=True, num_cpu_blocks=24 if tier else 0,
                        cpu_prefix_cache=tier, enable_kv_events=True, watermark=0.0)


def _history(bm: BlockManager, rng: random.Random, n: int, live: list) -> None:
    """Random allocations, decodes and frees (cached blocks, evictions, demotions to the CPU tier)."""
    bs = bm.block_size
    bm.take_copies()  # (the caller's step ends: its sequences' KV is written before any of them is freed)
    for i in range(n):
        ns = rng.choice([None, "t1"])
        p = _prompts(rng, 1, bs)[0]
        sid = f"h{i}-{rng.random()}"
        if live and rng.random() < 0.5:  # (before this step's calls: a sequence is freed once its KV is written)
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        try:
            bm.allocate(sid, p, namespace=ns)
            live.append(sid)
        except OutOfBlocksError:
            pass
        if live and rng.random() < 0.5:
            try:
                bm.decode_step(live, np.array([rng.randrange(6) for _ in live]))
            except OutOfBlocksError:
                pass
        bm.take_copies()


def _own_tokens_ok(bm: BlockManager, sid, prompt) -> None:
    """Every block of the sequence's table holds exactly its own prompt tokens (a shared block is right only if
    its content is the prompt's)."""
    bs = bm.block_size
    t = bm.block_table(sid)
    for j in range(len(prompt) // bs):
        assert bm._cache.tok[t[j]].tolist() == list(prompt[j * bs : (j + 1) * bs]), (sid, j)


# ---------------------------------------------------------------------- lookup_prefix
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), tier=st.booleans())
def test_lookup_prefix_predicts_allocate_and_changes_nothing(seed, tier):
    rng = random.Random(seed)
    bm = _manager(rng, tier)
    live: list = []
    for step in range(12):
        _history(bm, rng, 2, live)
        bm.events.take()
        p = _prompts(rng, 1, bm.block_size)[0]
        ns = rng.choice([None, "t1", 7])
        la = rng.randrange(3)
        before = snapshot(bm)
        lru_cpu = list(bm._tier.evictor) if tier else None
        hit = bm.lookup_prefix(p, la, namespace=ns)
        assert snapshot(bm) == before  # no LRU touch, no stats, no new namespace root
        assert bm.events.take() == []
        if tier:
            assert list(bm._tier.evictor) == lru_cpu
        assert isinstance(hit, PrefixHit)
        assert hit.num_cached_tokens == hit.num_cached_blocks * bm.block_size
        free = bm.num_free_gpu_blocks
        cpu_hits = bm.stats.cpu_hit_blocks
        try:
            got = bm.allocate(f"q{step}", p, la, namespace=ns)
        except OutOfBlocksError:
            assert hit.num_new_blocks > free
            continue
        live.append(f"q{step}")
        assert got == hit.num_cached_tokens
        assert free - bm.num_free_gpu_blocks == hit.num_new_blocks
        assert bm.stats.cpu_hit_blocks - cpu_hits == hit.num_cpu_blocks
        assert len(bm.block_table(f"q{step}")) == -(-(len(p) + la) // bm.block_size)
        bm.check_invariants()


def test_lookup_prefix_without_caching_and_bad_input():
    bm = BlockManager(16, 4)
    assert bm.lookup_prefix([1, 2, 3, 4, 5], 3) == PrefixHit(0, 0, 0, 2)
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate("a", list(range(9)))
    assert bm.lookup_prefix(list(range(9))) == PrefixHit(8, 2, 0, 1)  # held by "a": only the last block is new
    assert bm.lookup_prefix(list(range(9)), namespace="other") == PrefixHit(0, 0, 0, 3)
    for bad in ([], [-1], "abc"):
        with pytest.raises(InvalidTokensError):
            bm.lookup_prefix(bad)
    with pytest.raises(InvalidArgumentError):
        bm.lookup_prefix([1], -1)
    with pytest.raises(InvalidArgumentError):
        bm.lookup_prefix([1], namespace=1.5)


# ---------------------------------------------------------------------- allocate with lookahead
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**9))
def test_allocate_lookahead_agrees_with_can_allocate(seed):
    rng = random.Random(seed)
    bm = _manager(rng, tier=rng.random() < 0.5, blocks=24)
    live: list = []
    for i in range(15):
        _history(bm, rng, 1, live)
        p = _prompts(rng, 1, bm.block_size)[0]
        la = rng.randrange(6)
        status = bm.can_allocate(p, la)
        try:
            bm.allocate(f"s{i}", p, la)
        except PromptTooLongError:
            assert status is AllocStatus.NEVER
            continue
        except OutOfBlocksError:
            assert status is AllocStatus.LATER
            continue
        live.append(f"s{i}")
        assert status is AllocStatus.OK  # watermark 0: the same count
        assert len(bm.block_table(f"s{i}")) == -(-(len(p) + la) // bm.block_size)
        # the reserved slots are addressable, and the next decode with the same lookahead needs no new block
        assert bm.slot_mapping(f"s{i}", 0, len(p) + la).size == len(p) + la
        bm.check_invariants()


def test_allocate_lookahead_blocks_are_never_cached_and_fill_in_place():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4, 5, 6], 5)  # 11 slots: 3 blocks, the last lookahead-only
    t = bm.block_table("a").tolist()
    assert len(t) == 3 and bm.stats.num_cached_blocks == 1
    r = bm.decode_step(["a"], np.array([7]), 5)
    assert r.slot_mapping.tolist() == [t[1] * 4 + 2] and r.block_tables[0].tolist() == t  # no new block
    check_raises(bm, PromptTooLongError, bm.allocate, "b", [1] * 100, 40, must_mention=("lookahead",))
    check_raises(bm, InvalidArgumentError, bm.allocate, "b", [1], -2)


# ---------------------------------------------------------------------- allocate_batch
def _batch_vs_sequential(seed: int, tier: bool, blocks: int, demote: bool = False):
    """Two managers with the same history; one allocates a batch, the other the same prompts one by one.
    ``demote``: the history ends by filling the pool with other prompts (their blocks then withdrawn, so that
    the GPU pool is mostly plain free), which demotes much of the cache to the CPU tier."""
    rng = random.Random(seed)
    a, b = _manager(rng, tier, blocks=blocks), _manager(rng, tier, blocks=blocks)
    r1, r2 = random.Random(seed + 1), random.Random(seed + 1)
    for bm, r in ((a, r1), (b, r2)):
        live: list = []
        _history(bm, r, 25, live)
        for s in live[1:]:  # (their blocks stay cached)
            bm.free(s)
        if demote:
            junk = []
            while bm.num_free_gpu_blocks > 8:
                junk.append(f"j{len(junk)}")
                bm.allocate(junk[-1], [100 + len(junk)] * 4 * bm.block_size)
            bm.take_copies()
            for s in reversed(junk):
                bm.free(s, cache=False)  # withdrawn: their blocks go back to the free ring, uncached
        bm.take_copies()
    a.events.take(), b.events.take()
    prompts = _prompts(rng, rng.randrange(1, 7), a.block_size)
    nss = [rng.choice([None, "t1", "t2"]) for _ in prompts]
    la = rng.randrange(3)
    ids = [f"n{i}" for i in range(len(prompts))]
    return a, b, ids, prompts, nss, la


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), tier=st.booleans())
def test_allocate_batch_equals_consecutive_allocates(seed, tier):
    """With room enough that no block is evicted, a batch is exactly the consecutive allocate calls: the same
    hits (burst sharing inside the batch included), tables, cache, stats and KV events."""
    a, b, ids, prompts, nss, la = _batch_vs_sequential(seed, tier, blocks=60, demote=True)
    assume(sum(-(-(len(p) + la) // a.block_size) for p in prompts) <= a._gpu.num_free)  # no eviction
    res = a.allocate_batch(ids, prompts, la, namespaces=nss)
    hits = [b.allocate(s, p, la, namespace=ns) for s, p, ns in zip(ids, prompts, nss)]
    assert res.num_cached_tokens.tolist() == hits
    assert snapshot(a) == snapshot(b)
    assert a.events.take() == b.events.take()
    assert a.take_copies().promotions.tolist() == b.take_copies().promotions.tolist()
    a.check_invariants()
    # the flat metadata is what slot_mapping / block_table give sequence by sequence
    assert res.seq_ids == tuple(ids) and res.seq_lens.tolist() == [len(p) for p in prompts]
    qsl = res.query_start_loc
    for i, (s, p) in enumerate(zip(ids, prompts)):
        c = hits[i]
        sl = slice(qsl[i], qsl[i + 1])
        assert res.slot_mapping[sl].tolist() == a.slot_mapping(s, c, len(p)).tolist()
        assert res.positions[sl].tolist() == list(range(c, len(p)))
        assert res.token_ids[sl].tolist() == p[c:]
        t = a.block_table(s)
        assert res.block_tables[i, : len(t)].tolist() == t.tolist()
        assert (res.block_tables[i, len(t) :] == NULL_BLOCK).all()
        _own_tokens_ok(a, s, p)
    assert res.block_tables.shape[1] == max(len(a.block_table(s)) for s in ids)
    for arr in (res.num_cached_tokens, res.query_start_loc, res.token_ids, res.positions, res.slot_mapping,
                res.block_tables, res.seq_lens):
        assert not arr.flags.writeable


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), tier=st.booleans())
def test_allocate_batch_under_pressure_is_all_or_nothing_and_right(seed, tier):
    """Small pools: the batch either raises OutOfBlocksError and changes nothing, or every sequence's blocks
    hold exactly its own prompt (hits shared inside the batch included) and every invariant holds."""
    a, b, ids, prompts, nss, la = _batch_vs_sequential(seed, tier, blocks=26)
    before = snapshot(a)
    try:
        res = a.allocate_batch(ids, prompts, la, namespaces=nss)
    except (OutOfBlocksError, PromptTooLongError):
        assert snapshot(a) == before
        return
    a.check_invariants()
    for s, p, c in zip(ids, prompts, res.num_cached_tokens.tolist()):
        _own_tokens_ok(a, s, p)
        assert a.num_tokens(s) == len(p) and c % a.block_size == 0 and c < len(p)
    # the batch never does worse than the calls one by one would have
    try:
        hits = [b.allocate(s, p, la, namespace=ns) for s, p, ns in zip(ids, prompts, nss)]
    except OutOfBlocksError:
        return
    assert sum(res.num_cached_tokens.tolist()) >= sum(hits)


def test_allocate_batch_identical_prompts_share_like_allocate():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    p = list(range(10))
    res = bm.allocate_batch(["a", "b", "c"], [p, p, p[:9]])
    assert res.num_cached_tokens.tolist() == [0, 8, 8]
    t = res.block_tables
    assert t[0, :2].tolist() == t[1, :2].tolist() == t[2, :2].tolist()
    assert res.query_start_loc.tolist() == [0, 10, 12, 13]
    assert bm.stats.prefix_hit_tokens == 16


def test_allocate_batch_errors_change_nothing():
    bm = BlockManager(12, 4, enable_prefix_caching=True, watermark=0.0)
    bm.allocate("x", list(range(8)))
    check_raises(bm, DuplicateSequenceError, bm.allocate_batch, ["a", "a"], [[1], [2]], must_mention=("'a'",))
    check_raises(bm, DuplicateSequenceError, bm.allocate_batch, ["a", "x"], [[1], [2]], must_mention=("'x'",))
    check_raises(bm, InvalidTokensError, bm.allocate_batch, ["a", "b"], [[1], []], must_mention=("token_ids[1]",))
    check_raises(bm, InvalidTokensError, bm.allocate_batch, ["a", "b"], [[1]])
    check_raises(bm, PromptTooLongError, bm.allocate_batch, ["a", "b"], [[1], [1] * 60])
    check_raises(bm, InvalidArgumentError, bm.allocate_batch, ["a"], [[1]], namespaces="t")
    check_raises(bm, InvalidArgumentError, bm.allocate_batch, ["a"], [[1]], namespaces=["t", "u"])
    # 8 + 8 + 8 tokens of distinct prompts need 6 new blocks; 10 are free: fits one by one up to the last
    check_raises(bm, OutOfBlocksError, bm.allocate_batch, ["a", "b", "c"],
                 [[50] * 16, [60] * 16, [70] * 9], must_mention=("batch",))
    res = bm.allocate_batch([], [])
    assert res.slot_mapping.size == 0 and res.block_tables.shape == (0, 0)
    # without prefix caching
    bm = BlockManager(8, 4)
    res = bm.allocate_batch(["a", "b"], [[1, 2, 3, 4, 5], np.array([7, 8])])
    assert res.num_cached_tokens.tolist() == [0, 0] and res.token_ids.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert res.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9]


# ---------------------------------------------------------------------- block_table_width
@pytest.mark.parametrize("small", [True, False])
def test_block_table_width_is_fixed_and_enforced(small):
    bm = BlockManager(64, 2, enable_prefix_caching=True, block_table_width=4)
    if not small:
        bm._small_batch = 0  # the vectorised paths
    res = bm.allocate_batch(["a", "b"], [[1, 2, 3], [1, 2, 3, 4, 5]])
    assert res.block_tables.shape == (2, 4)
    r = bm.decode_step(["a"], np.array([9]))
    assert r.block_tables.shape == (1, 4)
    r = bm.decode_step(["a", "b"], np.array([9, 9]))
    assert r.block_tables.shape == (2, 4)
    r = bm.decode_step(["a", "b"], [[1], [2, 3]])  # ragged: the general path
    assert r.block_tables.shape == (2, 4) and r.seq_lens.tolist() == [6, 8]
    check_raises(bm, TableWidthError, bm.decode_step, ["a", "b"], np.array([1, 2]), must_mention=("'b'", "4"))
    check_raises(bm, TableWidthError, bm.decode_step, ["b"], np.array([1]))
    check_raises(bm, TableWidthError, bm.decode_step, ["a"], np.array([1]), 2)
    check_raises(bm, TableWidthError, bm.allocate, "c", [1] * 9)
    check_raises(bm, TableWidthError, bm.allocate, "c", [1] * 7, 2)
    check_raises(bm, TableWidthError, bm.allocate_batch, ["c", "d"], [[1], [1] * 9])
    assert bm.decode_step(["a"], np.array([1])).block_tables.shape == (1, 4)  # a fits: 7 tokens, 4 blocks
    with pytest.raises(InvalidArgumentError):
        BlockManager(8, 2, block_table_width=0)


@pytest.mark.parametrize("small", [True, False])
def test_forked_lookahead_blocks_are_copied_on_write(small):
    """A fork shares the parent's lookahead-only blocks; when both decode with lookahead, each must get its own
    lookahead slots (their drafts' KV would collide in one block otherwise)."""
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    if not small:
        bm._small_batch = 0
    bm.allocate("p", [1, 2, 3, 4, 5, 6], 5)  # 11 slots: blocks [full | 2 tokens + 2 lookahead | lookahead]
    bm.fork("p", "c")
    assert bm.can_append_slots(["p", "c"], 5)
    r = bm.decode_step(["p", "c"], np.array([7, 8]), 5)
    assert len(r.cow) == 2  # the partial block and the lookahead-only block, for the first writer
    lp, lc = bm.slot_mapping("p", 7, 12).tolist(), bm.slot_mapping("c", 7, 12).tolist()
    assert not set(lp) & set(lc)
    assert r.slot_mapping[0] != r.slot_mapping[1]
    bm.check_invariants()


def test_allocate_batch_takes_an_idle_hit_like_consecutive_allocates():
    """A block idle in the cache that a later prompt of the batch hits, while an earlier prompt registers a new block
    of the same content (the earlier prompt cannot hit it: its last token is computed): the consecutive calls keep
    the idle block cached and record the new, held block as its copy, and the later prompt hits the idle one
    (hypothesis found the difference, seed=343683); the batch does the same, block for block. (Until issue 32 the
    idle block's identity was handed over to the new block, whose KV an abort of the step leaves unwritten: the
    withdrawal then took the content, and a live sequence's findability, with it: departure 4.)"""
    managers = [BlockManager(16, 2, enable_prefix_caching=True, watermark=0.0, enable_kv_events=True)
                for _ in range(2)]
    for bm in managers:
        bm.allocate("old", [0, 2, 7])
        bm.free("old")  # its block [0, 2] stays cached, idle
        bm.take_copies()
        bm.events.take()
    a, b = managers
    idle = a.lookup_prefix([0, 2, 5]).num_cached_tokens
    assert idle == 2
    prompts = [[0, 2], [0, 2, 5, 6]]
    res = a.allocate_batch(["p", "q"], prompts)
    hits = [b.allocate(s, p) for s, p in zip(["p", "q"], prompts)]
    assert res.num_cached_tokens.tolist() == hits == [0, 2]
    assert a.block_table("q")[0] != a.block_table("p")[0]  # the idle block, not the new one (a copy)
    assert snapshot(a) == snapshot(b)
    assert a.events.take() == b.events.take()
    a.check_invariants()
    for s, p in zip(["p", "q"], prompts):
        _own_tokens_ok(a, s, p)
    assert a.lookup_prefix([0, 2, 5, 6, 1]).num_cached_tokens == 4
