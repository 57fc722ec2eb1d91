"""The router's prefix index with KV cache groups: events carrying ``group_idx`` / ``kv_cache_spec_kind`` /
``kv_cache_spec_sliding_window`` (as vLLM's do) are kept per group, a hybrid replica is scored by the engine's
hybrid-hit rule, and single-group events read exactly as before. MemoryIndex and RedisIndex side by side."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from pagedkv import block_hashes
from pagedkv.cluster import MemoryIndex
from pagedkv.cluster.index import hybrid_match
from pagedkv.cluster.policy import PrefixPolicy
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import BlockRemoved as PlainRemoved, BlockStored as PlainStored
from pagedkv.blocks.prefix_cache import PromptKeys


class BlockStored(NamedTuple):  # a group-carrying BlockStored (the index dispatches on the class name)
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object = None
    medium: str = "GPU"
    namespace: object = None
    group_idx: object = None
    kv_cache_spec_kind: object = None
    kv_cache_spec_sliding_window: object = None


class BlockRemoved(NamedTuple):
    block_hashes: list
    medium: str = "GPU"
    group_idx: object = None


BS = 4
W = 8  # tokens: a hit at L blocks needs the sliding group's blocks L-2 and L-1


def stored(keys, group, window=None, medium="GPU"):
    kind = "full_attention" if window is None else "sliding_window"
    return BlockStored(list(keys), None, [], BS, medium=medium, group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def hybrid_events(prompt, released=(), full_until=None):
    """A Gemma-like replica (group 0 full, group 1 window W) that cached ``prompt``'s blocks, then released the
    sliding group's blocks ``released`` (and the full group's from ``full_until`` on)."""
    k = PromptKeys(prompt, BS)
    ev = [stored(k.group(0), 0), stored(k.group(1), 1, W)]
    if released:
        ev.append(BlockRemoved([k.group(1)[i] for i in released], group_idx=1))
    if full_until is not None:
        ev.append(BlockRemoved(k.group(0)[full_until:], group_idx=0))
    return ev


def brute(n, layout, masks_of, bit):
    """The hybrid hit of one replica by its definition."""
    def has(g, i):
        return bool(masks_of[g][i] & bit)
    for L in range(n, 0, -1):
        ok = all(all(has(g, i) for i in range(L)) if k is None else all(has(g, i) for i in range(max(0, L - k), L))
                 for g, k in layout.items())
        if ok:
            return L
    return 0


def test_block_hashes_of_a_group_start_from_their_own_root():
    toks = list(range(40))
    assert block_hashes(toks, BS, group=0) == block_hashes(toks, BS)
    g1, g2 = block_hashes(toks, BS, group=1), block_hashes(toks, BS, group=2)
    assert len(g1) == 10 and not set(g1) & set(block_hashes(toks, BS)) and not set(g1) & set(g2)
    assert block_hashes(toks, BS, "tenant", group=1) != g1
    k = PromptKeys(toks, BS, "tenant")
    assert k == block_hashes(toks, BS, "tenant") and k.group(1) == block_hashes(toks, BS, "tenant", group=1)
    assert k.group(1) is k.group(1)  # computed once
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            block_hashes(toks, BS, group=bad)


@pytest.mark.parametrize("seed", range(5))
def test_hybrid_match_is_the_definition(seed):
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(1, 40)
        layout = {0: None}
        for g in range(1, rng.randint(1, 4)):
            layout[g] = rng.choice([None, 1, 2, 3, 5, 8])
        if rng.random() < 0.2:
            layout[0] = rng.choice([1, 4])
        nrep = rng.randint(1, 5)
        dens = rng.choice([0.7, 0.9, 1.0])
        masks_of = {g: [sum(1 << r for r in range(nrep) if rng.random() < dens) for _ in range(n)] for g in layout}
        got = hybrid_match(n, layout, (1 << nrep) - 1, lambda g, m: masks_of[g][:m])
        for r in range(nrep):
            want = brute(n, layout, masks_of, 1 << r)
            assert got.get(1 << r, 0) == want, (layout, r)


def test_groups_are_kept_apart_and_single_group_events_read_as_before():
    ix = MemoryIndex()
    # vLLM names a block by the same hash in every group: a sliding group's blocks must not count as a prefix
    ix.apply("h", BlockStored([1], None, [], BS, group_idx=0, kv_cache_spec_kind="full_attention"))
    ix.apply("h", stored([1, 2, 3], 1, W))
    ix.apply("p", PlainStored([1, 2, 3], None, [], BS))
    assert ix.longest_prefix([1, 2, 3]) == {"h": 1, "p": 3}
    assert ix.layout("h") == {0: None, 1: 2} and ix.layout("p") == {}
    assert ix.num_blocks("h") == 4
    ix.apply("h", BlockRemoved([1], group_idx=1))  # removes group 1's block 1 only
    assert ix.num_blocks("h") == 3 and ix.longest_prefix([1, 2, 3])["h"] == 1
    ix.apply("p", PlainRemoved([2]))
    assert ix.longest_prefix([1, 2, 3]) == {"h": 1, "p": 1}
    ix.drop_replica("h")
    assert ix.num_blocks() == 2 and ix.layout("h") == {}


@pytest.mark.parametrize("released, full_until, want", [
    ((), None, 10),  # everything cached
    ((9,), None, 9),  # L=10 needs 8, 9; L=9 needs 7, 8
    ((8,), None, 8),  # L=10 and 9 need 8; L=8 needs 6, 7
    ((2, 3, 4, 5, 7, 8), None, 2),  # L=10 .. 3 each miss one of their two; L=2 needs 0, 1
    ((0, 1, 2, 3, 4, 5, 6, 7), None, 10),  # only the last window matters
    ((), 6, 6),  # the full group caps it
    ((4,), 6, 4),  # L=6 needs 4, 5; L=5 needs 3, 4; L=4 needs 2, 3
])
def test_a_hybrid_replica_is_scored_by_the_engine_rule(released, full_until, want):
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(10 * BS)]
    ix = MemoryIndex()
    ix.apply_all("h", hybrid_events(prompt, released, full_until))
    ix.apply("p", PlainStored(block_hashes(prompt, BS)[:5], None, [], BS))
    keys = PromptKeys(prompt + [7], BS)  # (one token past the blocks: a hit may cover all 10)
    assert ix.longest_prefix(keys) == {"h": want, "p": 5}
    # given only the group-0 keys, a hybrid replica is scored on its full group 0 (an upper bound)
    assert ix.longest_prefix(list(keys)) == {"h": 10 if full_until is None else full_until, "p": 5}
    # a longer prompt: the same blocks lead it
    longer = PromptKeys(prompt + [1] * (3 * BS), BS)
    assert ix.longest_prefix(longer)["h"] == want
    assert ix.longest_prefix(keys, "CPU") == {}
    # the prompt alone: a hit stops before its last token, so the windows must end one block earlier
    exact = PromptKeys(prompt, BS)
    assert exact.hit_blocks == 9 and ix.longest_prefix(exact).get("h", 0) == brute_cap(released, full_until, 9)


def brute_cap(released, full_until, cap):
    """The hybrid hit of ``hybrid_events(prompt, released, full_until)`` with L <= cap (k = 2)."""
    for L in range(cap, 0, -1):
        if (full_until is None or L <= full_until) and not {L - 2, L - 1} & set(released):
            return L
    return 0


def test_cpu_tier_blocks_count_for_either_medium_per_group():
    rng = random.Random(4)
    prompt = [rng.randrange(1000) for _ in range(6 * BS)]
    k = PromptKeys(prompt, BS)
    ix = MemoryIndex()
    ix.apply("h", stored(k.group(0), 0))
    ix.apply("h", stored(k.group(1)[:4], 1, W))
    ix.apply("h", stored(k.group(1)[4:], 1, W, medium="CPU"))
    assert ix.has_cpu
    assert ix.longest_prefix(k) == {"h": 5}  # (a hit stops before the prompt's last token)
    assert ix.longest_prefix(k, "GPU") == {"h": 4}


def test_the_prefix_policy_routes_to_the_replica_whose_windows_are_there():
    """Two hybrid replicas hold the whole prompt in their full group; only one still holds the sliding group's
    last window. Scored by group 0 alone they tie; with the prompt's group keys the right one wins."""
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(12 * BS)]
    ix = MemoryIndex()
    ix.apply_all("a", hybrid_events(prompt, released=range(3, 12)))  # windows gone (an early release)
    ix.apply_all("b", hybrid_events(prompt, released=range(0, 9)))  # the last window kept
    pol = PrefixPolicy(ix, slack=None)
    keys = PromptKeys(prompt + [7], BS)
    assert pol.scores(keys)[1] == {"a": 3, "b": 12}
    assert pol.choose(["a", "b"], {"a": 0, "b": 1}, keys).replica == "b"


def test_redis_index_answers_as_the_memory_index(redis_url):
    from pagedkv.cluster import RedisIndex

    ix = RedisIndex(redis_url, prefix="groups-test")
    try:
        rng = random.Random(6)
        prompts = [[rng.randrange(1000) for _ in range(n * BS)] for n in (10, 300)]  # 300 blocks: > one chunk
        mem = MemoryIndex()
        events = [("h", e) for e in hybrid_events(prompts[0], (8,))]
        events += [("g", e) for e in hybrid_events(prompts[1], range(0, 250), full_until=280)]
        events += [("p", PlainStored(block_hashes(prompts[0], BS)[:5], None, [], BS))]
        for r, e in events:
            mem.apply(r, e)
            ix.apply(r, e)
        for pr in prompts:
            k = PromptKeys(pr, BS)
            for medium in (None, "GPU", "CPU"):
                assert ix.longest_prefix(k, medium) == mem.longest_prefix(k, medium)
                assert ix.longest_prefix(list(k), medium) == mem.longest_prefix(list(k), medium)
        assert ix.longest_prefix(PromptKeys(prompts[0], BS)) == {"h": 8, "p": 5}
        assert ix.longest_prefix(PromptKeys(prompts[1], BS)) == {"g": 280}
        assert ix.layout("h") == {0: None, 1: 2} and ix.num_blocks("h") == mem.num_blocks("h") == 19
        assert ix.r.smembers(f"{ix.p}:rep:h:GPU:g1")
        ix.drop_replica("h")
        assert not ix.r.exists(f"{ix.p}:rep:h:GPU:g1") and not ix.r.exists(f"{ix.p}:layout:h")
        assert not ix.r.exists(f"{ix.p}:blk:GPU:g1:{PromptKeys(prompts[0], BS).group(1)[0]}")
        assert ix.longest_prefix(PromptKeys(prompts[0], BS)) == {"p": 5}
    finally:
        for key in ix.r.scan_iter(f"{ix.p}:*"):
            ix.r.delete(key)


def test_wire_layout_reads_vllm_group_events_and_keeps_the_short_single_group_one():
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.events import BlockStored as Stored
    from pagedkv.server.kv_events import decode_payload, to_wire

    enc = msgspec.msgpack.Encoder()
    # the array layout, with every field vLLM has added since, in its order (lora_name, extra_keys, group
    # fields, locality, ...)
    payload = enc.encode([1.0, [
        ["BlockStored", [5, 6], None, list(range(8)), BS, None, "GPU", None, None, 1, "sliding_window", W,
         "LOCAL", None, None, None],
        ["BlockStored", [5, 6], None, list(range(8)), BS, None, "GPU", None, None, 0, "full_attention", None,
         None, None, None, None],
        ["BlockRemoved", [5], "GPU", 1, None, None],
        ["BlockStored", [7], 6, [1, 2, 3, 4], BS, None, "GPU"],  # pagedkv's single-group layout
    ], None])
    batch = decode_payload(payload)
    assert [getattr(e, "group_idx", None) for e in batch.events] == [1, 0, 1, None]
    ix = MemoryIndex()
    ix.apply_all("v", batch.events)
    assert ix.layout("v") == {0: None, 1: 2}
    assert ix._members["v"][("GPU", 1)] == {6} and ix._members["v"][("GPU", 0)] == {5, 6, 7}
    # a single-group event still goes out in the short array layout (--kv-events-layout array)
    assert msgspec.msgpack.decode(enc.encode(to_wire(Stored([1], None, [1, 2, 3, 4], BS), "array"))) == \
        ["BlockStored", [1], None, [1, 2, 3, 4], BS, None, "GPU", None]
    # and in vLLM 0.33's map layout (the default) without the group fields
    assert msgspec.msgpack.decode(enc.encode(to_wire(Stored([1], None, [1, 2, 3, 4], BS)))) == \
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


@pytest.mark.parametrize("retention", [True, False])
def test_index_fed_by_hybrid_events_predicts_every_hit_of_real_hybrid_managers(retention, redis_url_or_none):
    """Random prompts sharing prefixes over 3 small HybridBlockManagers (1 full + 2 sliding groups), some requests
    decoding a few steps: after every call the events go to the index (and over the wire layout), and the
    index's hybrid match for a PromptKeys, capped as the engine caps it, is exactly the manager's hit."""
    from pagedkv import FullAttentionSpec, BlockManager, SlidingWindowSpec
    from pagedkv.cluster import predicted_tokens
    from pagedkv.server.kv_events import KVEventBatch, decode_payload, to_wire

    msgspec = pytest.importorskip("msgspec")
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(11)
    groups = [FullAttentionSpec(), SlidingWindowSpec(8), SlidingWindowSpec(12)]
    bms = [BlockManager(90, BS, kv_cache_groups=groups, enable_prefix_caching=True, watermark=0.0,
                              enable_kv_events=True, window_retention=retention, grouped_results=True) for _ in range(3)]
    indexes = [MemoryIndex()]
    if redis_url_or_none is not None:
        from pagedkv.cluster import RedisIndex

        indexes.append(RedisIndex(redis_url_or_none, prefix=f"groups-real-{retention}"))

    def feed(r):
        evs = bms[r].events.take()
        wire = decode_payload(enc.encode(KVEventBatch(0.0, [to_wire(e) for e in evs]))).events if evs else []
        for ix in indexes:
            ix.apply_all(r, wire)

    stems = [[rng.randrange(1000) for _ in range(rng.randrange(8, 48))] for _ in range(5)]
    running: list = []
    checked = exact = 0
    try:
        for i in range(160):
            prompt = rng.choice(stems)[: rng.randrange(1, 49)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
            r = rng.randrange(3)
            while running and (len(running) > 2 or rng.random() < 0.5):
                rr, seq = running.pop(rng.randrange(len(running)))
                for _ in range(rng.randrange(0, 10)):
                    bms[rr].decode_step([seq], [rng.randrange(1000)])
                bms[rr].free(seq)
                feed(rr)
            keys = PromptKeys(prompt, BS)
            wants = [ix.longest_prefix(keys).get(k, 0) for ix, k in zip(indexes, (r, str(r)))]  # (Redis: str ids)
            assert len(set(wants)) == 1, wants
            if bms[r].can_allocate(prompt).name != "OK":
                continue
            got, pred = bms[r].allocate(i, prompt), predicted_tokens(wants[0], len(prompt), BS)
            # the index knows blocks by key; the engine also checks each block's parent by content id, and a
            # parent evicted and cached again (same key, new id) leaves its old children unverifiable: then the
            # engine hits less than the index says (never more)
            assert got <= pred, (i, r)
            exact += got == pred
            checked += 1
            feed(r)
            running.append((r, i))
        assert checked > 100 and exact >= 0.95 * checked, (exact, checked)
    finally:
        for ix in indexes[1:]:
            for key in ix.r.scan_iter(f"{ix.p}:*"):
                ix.r.delete(key)


@pytest.fixture
def redis_url_or_none(request):
    """A throwaway Redis when redis-server is installed (the memory index alone otherwise)."""
    import shutil

    if shutil.which("redis-server") is None:
        yield None
        return
    yield request.getfixturevalue("redis_url")
