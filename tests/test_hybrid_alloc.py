"""HybridBlockManager's vectorised allocation (pagedkv.hybrid._hit) against the block-by-block walk it replaces.

The plan of :func:`pagedkv.hybrid._hit.find_hit` (hit, blocks per group, blocks consumed) must equal
``HybridAllocator.plan_walk``'s on every state a random workload reaches (shared prefixes, decode steps that
fill blocks, windows released, evictions under a small pool, frees with and without caching, namespaces, prefix
cache resets); the sibling keys it records must be each group's ``block_hashes``; a key that names a block with
other tokens (a hash collision) must end the hit there, in a full group and in a sliding window alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import FullAttentionSpec as F, BlockManager, HybridBlockManager, SlidingWindowSpec as S, block_hashes
from pagedkv._checks import as_tokens
from pagedkv.errors import SequenceStateError
from pagedkv.types import NULL_BLOCK

BS = 4


def walk_and_fast(m: HybridBlockManager, prompt, namespace=None):
    """(fast plan, walk plan) of the prompt, nothing changed."""
    arr = as_tokens(prompt)
    gns = m._alloc.gns(namespace)
    fast = m._alloc.plan(arr, 0, gns, check=False)
    roots = [m._cache.root(ns, intern=False) for ns in gns]
    walk = m._alloc.plan_walk(arr, arr.size, -(-arr.size // BS), 0, roots, None)
    return fast, walk


def hit_blocks(plan) -> list:
    """Per group: the hit blocks, NULL_BLOCK before a sliding window (either plan's form)."""
    out = []
    for gpu, _, _, nnull in plan.groups:
        blocks = list(gpu) if plan.memo is None else [NULL_BLOCK] * nnull + np.asarray(gpu).tolist()
        out.append([int(b) for b in blocks])
    return out


def assert_same(m, prompt, namespace=None) -> bool:
    fast, walk = walk_and_fast(m, prompt, namespace)
    assert fast.nhit == walk.nhit
    assert fast.need == walk.need
    assert hit_blocks(fast) == hit_blocks(walk)
    assert [c for _, _, c, _ in fast.groups] == [c for _, _, c, _ in walk.groups]
    return fast.memo is not None


@pytest.mark.parametrize("groups", [[F(), S(8), S(12)], [S(8), F(), S(5)], [F(), S(16), S(16), S(16)], [S(8), S(12)]])
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_hit_equals_the_walk(groups, seed):
    rng = np.random.default_rng([seed, len(groups)])
    m = BlockManager(int(rng.integers(60, 140)), BS, kv_cache_groups=groups, enable_prefix_caching=True,
                           watermark=0, enable_kv_events=bool(seed % 2), grouped_results=True)
    bases = [rng.integers(0, 3, size=int(rng.integers(8, 60))).tolist() for _ in range(4)]
    live: list = []
    fast_seen = 0
    for step in range(200):
        op = rng.random()
        if op < 0.45 or not live:
            base = bases[int(rng.integers(len(bases)))]
            prompt = base[: int(rng.integers(1, len(base) + 1))] + rng.integers(0, 3, size=int(rng.integers(0, 12))).tolist()
            ns = None if rng.random() < 0.8 else "tenant"
            fast_seen += assert_same(m, prompt, ns)
            sid = f"s{step}"
            try:
                m.allocate(sid, prompt, namespace=ns)
            except Exception as exc:  # out of blocks: nothing changed
                assert type(exc).__name__ in ("OutOfBlocksError", "PromptTooLongError")
            else:
                live.append(sid)
        elif op < 0.75:
            batch = [s for s in live if rng.random() < 0.5] or live[:1]
            counts = rng.integers(1, 6, size=len(batch))
            toks = rng.integers(0, 3, size=int(counts.sum()))
            try:
                m.decode_step(batch, toks, num_new_tokens=counts)
            except Exception as exc:
                assert type(exc).__name__ == "OutOfBlocksError"
        elif op < 0.97:
            sid = live[int(rng.integers(len(live)))]
            try:
                m.free(sid, cache=bool(rng.random() < 0.9))
            except SequenceStateError:  # cache=False while another sequence holds its unwritten blocks
                pass
            else:
                live.remove(sid)
        else:
            m.take_copy_plan()
            m.reset_prefix_cache()
        if rng.random() < 0.5:
            m.take_copy_plan()
        m.check_invariants()
    assert fast_seen > 10  # the vectorised path was exercised


def test_allocate_after_lookup_prefix_is_the_walks_hit():
    """A conversation: each turn hits the previous one's full group and last windows; lookup_prefix, allocate
    and the walk agree at every turn (sibling keys in play from the second turn on)."""
    m = BlockManager(400, BS, kv_cache_groups=[F(), S(8), S(8)], enable_prefix_caching=True, watermark=0, grouped_results=True)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 50, size=30).tolist()
    for turn in range(6):
        assert_same(m, prompt)
        want = m.lookup_prefix(prompt)
        got = m.allocate(f"t{turn}", prompt)
        assert got == want.num_cached_tokens
        if turn:  # the previous turn's prompt and answer, but the partly filled last block
            assert got == (len(prompt) - 3) // BS * BS
        answer = rng.integers(0, 50, size=7)
        m.decode_step([f"t{turn}"], answer, num_new_tokens=[7])
        m.take_copy_plan()
        prompt = prompt + answer.tolist() + rng.integers(0, 50, size=3).tolist()
        m.free(f"t{turn}")
        m.check_invariants()


def test_sibling_keys_are_each_groups_block_hashes():
    groups = [F(), S(8), S(12)]
    m = BlockManager(200, BS, kv_cache_groups=groups, enable_prefix_caching=True, watermark=0, grouped_results=True)
    prompt = list(range(40))
    m.allocate("a", prompt)
    m.free("a")
    m.allocate("b", prompt + [7, 7, 7, 7, 7])  # a hit: siblings read, the new blocks' recorded
    sib_cid, sib_key = m._alloc.sib
    cid = m._cache.cid
    table0 = m.block_table("b", 0)
    full = (len(prompt) + 5) // BS
    checked = 0
    for j in range(full):
        b0 = int(table0[j])
        if sib_cid[b0] and sib_cid[b0] == cid[b0]:
            for i, g in enumerate((1, 2)):
                assert int(sib_key[b0, i]) == block_hashes(prompt + [7] * 5, BS, group=g)[j]
            checked += 1
    assert checked >= full - 3  # every position the windows covered at admission


@pytest.mark.parametrize("group, pos, want", [(0, 2, 2), (1, 8, 8), (2, 9, 9), (2, 6, 10)])
def test_a_key_naming_other_tokens_is_a_miss(group, pos, want):
    """A cached block whose tokens are not the prompt's under the prompt's key (what a 64-bit collision looks
    like) ends the hit before it: the full group's chain stops there, a sliding group's window cannot cover it
    (a block outside the last window does not matter: (2, 6, 10))."""
    m = BlockManager(200, BS, kv_cache_groups=[F(), S(8), S(12)], enable_prefix_caching=True, watermark=0, grouped_results=True)
    prompt = list(range(1, 45))
    m.allocate("a", prompt)
    m.free("a")
    assert m.lookup_prefix(prompt).num_cached_blocks == 10
    key = block_hashes(prompt, BS, group=group)[pos]  # the group's cached block at that position
    blk = m._cache.map[key]
    m._cache.tok[blk, 0] += 1000  # other tokens under the same key
    assert_same(m, prompt)
    assert m.lookup_prefix(prompt).num_cached_blocks == want
    assert m.allocate("b", prompt) == want * BS  # (check_invariants would flag the tampered block's key)


def test_group_keys_follow_the_documented_derivation():
    """docs/guide/kv-groups.md: root_g = xxh3_64(b"pagedkv-ns:" + b"g<g>:" + enc(namespace)) for g > 0 (group 0
    without the tag), key_i = xxh3_64(int32 bytes of block i, seed=key_{i-1}); events and block_hashes agree."""
    import xxhash

    toks = np.arange(100, 140, dtype=np.int32)
    for g, ns, enc in [(0, None, b""), (2, None, b""), (3, "t", b"s:t"), (1, 7, b"i:7"), (4, b"x", b"b:x")]:
        k = xxhash.xxh3_64_intdigest(b"pagedkv-ns:" + (b"g%d:" % g if g else b"") + enc)
        want = []
        for i in range(10):
            k = xxhash.xxh3_64_intdigest(toks[4 * i : 4 * i + 4].tobytes(), seed=k)
            want.append(k)
        assert block_hashes(toks, BS, namespace=ns, group=g) == want
    m = BlockManager(100, BS, kv_cache_groups=[F(), S(8), S(8), S(8), S(8)], enable_prefix_caching=True,
                           enable_kv_events=True, watermark=0, grouped_results=True)
    m.allocate("a", toks.tolist(), namespace="t")
    stored = {e.group_idx: list(e.block_hashes) for e in m.events.take() if type(e).__name__ == "BlockStored"}
    assert stored == {g: block_hashes(toks, BS, namespace="t", group=g) for g in range(5)}
