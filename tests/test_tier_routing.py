"""KV events with their medium and a router that counts the shared tier (issue 24, items 3 and 6): the medium on
the wire (vLLM's field and position; None reads as GPU), the index's answers and the prefix policy's scores with
a replica's own tiers (GPU, CPU, DISK) and the shared store reachable from every replica (golden values worked
out by hand, the memory and the Redis index side by side), the cluster replay with a shared tier on a hand trace,
and the router choosing a replica by shared-tier blocks learnt over ZMQ."""

from __future__ import annotations

import time

import pytest

from pagedkv import block_hashes
from pagedkv.cluster import MemoryIndex, RedisIndex
from pagedkv.cluster.policy import TIER_WEIGHTS, PrefixPolicy, make_policy
from pagedkv.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, medium_of
from pagedkv.replay.cluster import replay_cluster
from pagedkv.replay.trace import parse_trace_lines


def stored(hashes, medium="GPU", **kw):
    return BlockStored(list(hashes), None, [], 16, None, medium, **kw)


# ------------------------------------------------------------------------------------------ the medium on the wire
def test_medium_of_reads_none_and_absent_as_gpu_and_refuses_unknown_ones():
    assert MEDIA == ("GPU", "CPU", "DISK", "SHARED")
    assert medium_of(stored([1], None)) == "GPU" and medium_of(BlockRemoved([1], None)) == "GPU"
    assert medium_of(object()) == "GPU"  # a producer that leaves the field out
    for m in MEDIA:
        assert medium_of(stored([1], m)) == m and medium_of(BlockRemoved([1], m)) == m
    for bad in ("gpu", "TAPE", ""):
        with pytest.raises(ValueError):
            medium_of(BlockRemoved([1], bad))
    assert medium_of(BlockRemoved([1], "STORAGE")) == "DISK"  # vLLM's offloading tier of that replica


@pytest.mark.parametrize("medium", [*MEDIA, None])
@pytest.mark.parametrize("group", [None, 2])
def test_every_medium_round_trips_in_vllms_array_layout(medium, group):
    """Encoded as the publisher sends them and decoded as a router reads them: the medium keeps vLLM's position
    (7th field of BlockStored, 3rd of BlockRemoved) and type (a string, or nil), in the short and the group layout."""
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.server.kv_events import decode_payload, to_wire
    from pagedkv.server.kv_events_array import KVEventBatch

    kw = {} if group is None else {"group_idx": group, "kv_cache_spec_kind": "sliding_window",
                                   "kv_cache_spec_sliding_window": 64}
    events = [BlockStored([5, 2**64 - 1], 4, list(range(32)), 16, None, medium, None, **kw),
              BlockRemoved([5], medium, group)]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(1.5, [to_wire(e, "array") for e in events]))
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored" and raw[1][0][6] == medium
    assert raw[1][1][0] == "BlockRemoved" and raw[1][1][2] == medium
    assert len(raw[1][0]) == (8 if group is None else 12) and len(raw[1][1]) == (3 if group is None else 4)
    back = decode_payload(payload).events
    assert [type(e).__name__ for e in back] == ["BlockStored", "BlockRemoved"]
    assert back[0].block_hashes == [5, 2**64 - 1] and back[1].block_hashes == [5]
    assert [e.medium for e in back] == [medium, medium]
    assert [medium_of(e) for e in back] == [medium or "GPU"] * 2
    assert [e.group_idx for e in back] == [group, group]


@pytest.mark.parametrize("medium", [*MEDIA, None])
@pytest.mark.parametrize("group", [None, 2])
def test_every_medium_round_trips_in_vllm_0_33_map_layout(medium, group):
    """The default layout: the medium is the map's "medium" entry (a string, or nil), always there; the group
    fields only when set."""
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.server.kv_events import KVEventBatch, decode_payload, to_wire

    kw = {} if group is None else {"group_idx": group, "kv_cache_spec_kind": "sliding_window",
                                   "kv_cache_spec_sliding_window": 64}
    events = [BlockStored([5, 2**64 - 1], 4, list(range(32)), 16, None, medium, None, **kw),
              BlockRemoved([5], medium, group)]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(1.5, [to_wire(e) for e in events], 0))
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["medium"] == medium
    assert raw[1][1]["type"] == "BlockRemoved" and raw[1][1]["medium"] == medium
    assert ("group_idx" in raw[1][0]) == (group is not None) and raw[1][1].get("group_idx") == group
    back = decode_payload(payload).events
    assert back[0].block_hashes == [5, 2**64 - 1] and back[1].block_hashes == [5]
    assert [e.medium for e in back] == [medium, medium]
    assert [medium_of(e) for e in back] == [medium or "GPU"] * 2
    assert [e.group_idx for e in back] == [group, group]


def test_a_vllm_payload_with_a_nil_medium_reads_as_gpu_and_the_router_accepts_every_medium():
    msgspec = pytest.importorskip("msgspec")
    pytest.importorskip("zmq")
    from pagedkv.router.events import BadPayload, EventSubscriber

    enc = msgspec.msgpack.Encoder()
    sub = EventSubscriber({}, lambda r, e: None, lambda r: None)
    try:
        # what vLLM sends (its longer arrays: lora_name and extra_keys after the medium), medium nil
        vllm = enc.encode([2.0, [["BlockStored", [7], None, [1, 2], 2, None, None, None, None],
                                 ["BlockRemoved", [7], None]], 0])
        ix = MemoryIndex()
        ix.apply_all("r", sub._decode(vllm).events)
        assert ix.num_blocks("r") == 0  # stored then removed, both on the GPU
        for m in MEDIA:
            batch = sub._decode(enc.encode([2.0, [["BlockStored", [7], None, [1, 2], 2, None, m]], None]))
            assert batch.events[0].medium == m
        with pytest.raises(BadPayload):
            sub._decode(enc.encode([2.0, [["BlockRemoved", [7], "TAPE"]], None]))
    finally:
        sub.ctx.term()


# ------------------------------------------------------------------------------------------ the index and the scores
K = list(range(100, 108))  # a prompt's 8 block keys


def feed(ix) -> None:
    """The golden state (blocks of the prompt K):

    - a: GPU K0 K1, CPU K2;
    - b: GPU K0, DISK K1 K2 K3, and it stored K0..K5 in the shared store;
    - c: GPU K0 K1 and K3 (a hole at K2);
    - e: not known to the index (no event yet).
    """
    ix.apply("a", stored(K[:2]))
    ix.apply("a", stored(K[2:3], "CPU"))
    ix.apply("b", stored(K[:1]))
    ix.apply("b", stored(K[1:4], "DISK"))
    ix.apply("b", stored(K[:6], "SHARED"))
    ix.apply("c", stored(K[:2]))
    ix.apply("c", stored(K[3:4]))


@pytest.fixture(params=["memory", "redis"])
def any_index(request):
    if request.param == "memory":
        yield MemoryIndex()
        return
    url = request.getfixturevalue("redis_url")
    ix = RedisIndex(url, prefix=f"tr{abs(hash(request.node.name))}")
    yield ix
    for k in ix.r.scan_iter(f"{ix.p}:*"):
        ix.r.delete(k)


def test_golden_index_answers_with_own_tiers_and_the_shared_store(any_index):
    ix = any_index
    feed(ix)
    assert ix.media == {"GPU", "CPU", "DISK", "SHARED"}
    assert ix.longest_prefix(K, "GPU") == {"a": 2, "b": 1, "c": 2}
    assert ix.longest_prefix(K, ("GPU", "CPU")) == {"a": 3, "b": 1, "c": 2}
    assert ix.longest_prefix(K, ("GPU", "CPU", "DISK")) == {"a": 3, "b": 4, "c": 2}
    # the shared store is every replica's: a walks GPU GPU CPU shared shared shared, c fills its hole from it
    assert ix.longest_prefix(K) == {"a": 6, "b": 6, "c": 6}
    assert ix.longest_prefix(K, "SHARED") == {"a": 6, "b": 6, "c": 6}
    assert ix.longest_prefix(K[1:]) == {"a": 5, "b": 5, "c": 5}  # a match starts at the first key
    assert ix.shared_prefix(K) == 6 and ix.shared_prefix(K[1:]) == 5 and ix.shared_prefix([7]) == 0
    assert ix.num_shared_blocks() == 6 and ix.num_blocks() == 3 + 4 + 3

    pol = PrefixPolicy(ix, slack=None)  # the default weights: CPU 0.5, DISK 0.4, SHARED 0.3
    assert (pol.cpu_weight, pol.disk_weight, pol.shared_weight) == (0.5, 0.4, 0.3)
    score, matched = pol.scores(K, ["a", "b", "c", "e"])
    # a: 2 GPU + 0.5 x 1 CPU + 0.3 x 3 shared = 3.4; b: 1 + 0.4 x 3 + 0.3 x 2 = 2.8; c: 2 + 0.3 x 4 (its GPU K3
    # lies past the hole, so it weighs as the shared tier the prefix needs) = 3.2; e: 0.3 x 6 = 1.8
    assert score == pytest.approx({"a": 3.4, "b": 2.8, "c": 3.2, "e": 1.8})
    assert matched == {"a": 6, "b": 6, "c": 6, "e": 6}
    d = pol.choose(["a", "b", "c", "e"], {}, K)
    assert d.replica == "a" and d.matched_blocks == 6

    # a block leaves the shared store (a replica found it gone): a loses its tail, c keeps its own K3
    ix.apply("c", BlockRemoved(K[3:4], "SHARED"))
    score, matched = pol.scores(K, ["a", "b", "c", "e"])
    assert score == pytest.approx({"a": 2.5, "b": 2.8, "c": 3.2, "e": 0.9})
    assert matched == {"a": 3, "b": 6, "c": 6, "e": 3}
    assert pol.choose(["a", "b", "c", "e"], {}, K).replica == "c"

    # a replica's reset and its death leave the shared store alone
    ix.apply("b", AllBlocksCleared())
    ix.drop_replica("c")
    assert ix.shared_prefix(K) == 3 and ix.num_shared_blocks() == 5
    assert ix.longest_prefix(K) == {"a": 3, "b": 3}
    assert pol.scores(K, ["a", "b", "e"])[0] == pytest.approx({"a": 2.5, "b": 0.9, "e": 0.9})


def test_shared_weight_decides_between_a_gpu_holder_and_a_shared_tail(any_index):
    """x holds K0..K3 on its GPU; y holds K0 on its GPU, and the shared store K0..K7 (every replica reaches 8
    blocks). x scores 4 + 4w, y 1 + 7w: x wins at every weight below 1 (0: 4 against 1; the default 0.3: 5.2
    against 3.1; 0.9: 7.6 against 7.3); at 1 a shared block weighs as a GPU one, both score 8 and the lower load
    (y) wins."""
    ix = any_index
    ix.apply("x", stored(K[:4]))
    ix.apply("y", stored(K[:1]))
    ix.apply("y", stored(K, "SHARED"))
    loads = {"x": 10, "y": 0}
    got = {}
    for w in (0.0, 0.3, 0.9, 1.0):
        pol = make_policy("prefix", ix, slack=None, weights={"SHARED": w})
        got[w] = (pol.choose(["x", "y"], loads, K).replica, pol.scores(K, ["x", "y"])[0])
    assert got[0.0] == ("x", pytest.approx({"x": 4.0, "y": 1.0}))
    assert got[0.3] == ("x", pytest.approx({"x": 5.2, "y": 3.1}))
    assert got[0.9] == ("x", pytest.approx({"x": 7.6, "y": 7.3}))
    assert got[1.0] == ("y", pytest.approx({"x": 8.0, "y": 8.0}))


def test_the_shared_bound_drops_chains_from_their_tails():
    ix = MemoryIndex(shared_capacity_blocks=4)
    ix.apply("a", stored(K[:6], "SHARED"))  # parent first: entered children first, the parent most recent
    assert ix.num_shared_blocks() == 4 and ix.shared_prefix(K) == 4
    ix.apply("b", stored([1, 2], "SHARED"))  # two more: the oldest two (K3, K2) go
    assert ix.shared_prefix(K) == 2 and ix.shared_prefix([1, 2]) == 2
    ix.apply("a", stored(K[:1], "SHARED"))  # reported again (a load): K0 the most recent
    ix.apply("a", stored([3], "SHARED"))  # K1 goes, not K0
    assert ix.shared_prefix(K) == 1 and ix.num_shared_blocks() == 4
    assert MemoryIndex(shared_capacity_blocks=0).media == {"GPU"}
    nothing = MemoryIndex(shared_capacity_blocks=0)
    nothing.apply("a", stored(K, "SHARED"))
    assert nothing.num_shared_blocks() == 0 and nothing.longest_prefix(K) == {}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            MemoryIndex(shared_capacity_blocks=bad)
    with pytest.raises(ValueError):
        ix.longest_prefix(K, "TAPE")
    with pytest.raises(ValueError):
        ix.longest_prefix(K, ())
    with pytest.raises(ValueError):
        PrefixPolicy(ix, shared_weight=1.5)


def test_redis_shared_bound_matches_memory(redis_url):
    mem = MemoryIndex(shared_capacity_blocks=4)
    red = RedisIndex(redis_url, prefix="trbound", shared_capacity_blocks=4)
    try:
        for r, e in [("a", stored(K[:6], "SHARED")), ("b", stored([1, 2], "SHARED")), ("a", stored(K[:1], "SHARED")),
                     ("a", stored([3], "SHARED")), ("b", BlockRemoved([2], "SHARED")), ("c", stored(K[:2]))]:
            mem.apply(r, e)
            red.apply(r, e)
            for q in (K, [1, 2], [3]):
                assert red.shared_prefix(q) == mem.shared_prefix(q)
                assert red.longest_prefix(q) == mem.longest_prefix(q)
            assert red.num_shared_blocks() == mem.num_shared_blocks() and red.media == mem.media
    finally:
        for k in red.r.scan_iter("trbound:*"):
            red.r.delete(k)


def test_hybrid_replicas_count_shared_blocks_in_every_group():
    """A replica with a full-attention group 0 and a sliding group 1 (window 32 tokens = 2 blocks of 16): its hit
    at L needs group 0's blocks [0, L) and group 1's [L - 2, L); the shared store holds some of each."""
    from pagedkv.blocks.prefix_cache import PromptKeys

    toks = list(range(16 * 8 + 1))
    keys = PromptKeys(toks, 16)
    g1 = keys.group(1)
    ix = MemoryIndex()
    spec0 = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    spec1 = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}
    ix.apply("h", BlockStored(list(keys[:3]), None, [], 16, None, "GPU", None, **spec0))
    ix.apply("h", BlockStored(list(g1[1:3]), None, [], 16, None, "GPU", None, **spec1))
    assert ix.longest_prefix(keys)["h"] == 3
    # the shared store holds group 0's K3..K5 and group 1's blocks 4 and 5 (stored by another replica)
    ix.apply("o", BlockStored(list(keys[3:6]), None, [], 16, None, "SHARED", None, **spec0))
    ix.apply("o", BlockStored(list(g1[4:6]), None, [], 16, None, "SHARED", None, **spec1))
    assert ix.longest_prefix(keys)["h"] == 6
    assert ix.longest_prefix(keys, ("GPU", "CPU", "DISK"))["h"] == 3
    ix.apply("o", BlockRemoved(list(g1[4:5]), "SHARED", 1))  # group 1's block 4 gone: L = 5 needs [3, 5)
    assert ix.longest_prefix(keys)["h"] == 3


# ------------------------------------------------------------------------------------------ cluster replay
def trace_of(rows, name="hand"):
    """A trace of prompts given as lists of 512-token trace blocks (replayed with blocks of 512: one key each)."""
    import json

    return parse_trace_lines([json.dumps({"timestamp": t, "input_length": 512 * len(h), "output_length": 1,
                                          "hash_ids": h}) for t, h in enumerate(rows)], name)


@pytest.mark.parametrize("shared_blocks", [8, 6])
def test_cluster_replay_shared_tier_by_hand(shared_blocks):
    """Round robin over two replicas of 4 blocks: r0 gets requests 0 and 2, r1 gets 1 and 3, and each second
    request carries the *other* replica's prefix. Keys below name a prompt's chained block keys by their last
    trace block. Worked by hand:

    - req0 [1, 2, 3, 10] on r0: nothing cached. Written through children first: 10, 3, 2, 1 (1 most recent).
    - req1 [4, 5, 6, 11] on r1: nothing. Written through: 11, 6, 5, 4. A 6-block tier evicts 10 and 3 for 5 and 4:
      it holds 2, 1, 11, 6, 5, 4; an 8-block tier holds all 8.
    - req2 [4, 5, 6, 12] on r0: its GPU holds nothing of it; the shared tier has 4, 5, 6: 3 blocks loaded (the 4th
      block is always computed). Written through: 12 is new (the 6-block tier evicts 2), the rest refreshed.
    - req3 [1, 2, 3, 13] on r1: the 8-block tier holds 1, 2, 3: 3 blocks loaded. The 6-block tier holds 1 but
      no longer 2: 1 block loaded, and the walk stops at the first block no tier holds.

    Without the shared tier every request computes everything (0 hits)."""
    tr = trace_of([[1, 2, 3, 10], [4, 5, 6, 11], [4, 5, 6, 12], [1, 2, 3, 13]])
    none = replay_cluster(tr, 4 * 512, 2, "round-robin", block_size=512)
    assert none.hit_tokens == 0 and none.shared_hit_tokens is None
    p = replay_cluster(tr, 4 * 512, 2, "round-robin", block_size=512, shared_capacity_tokens=shared_blocks * 512,
                       check_every=1)
    r1_loads = 3 if shared_blocks == 8 else 1
    assert [(x["gpu_hit_tokens"], x["shared_hit_tokens"]) for x in p.per_replica] == [(0, 3 * 512),
                                                                                     (0, r1_loads * 512)]
    assert p.shared_hit_tokens == p.hit_tokens == (3 + r1_loads) * 512
    assert p.per_replica[1]["hit_rate"] == r1_loads * 512 / (8 * 512)  # r1 got 4 + 4 blocks
    # stores: 4 + 4 + 1 (12) + 1 (13) with 8 blocks; with 6, req3 also rewrites 3 and 2 (evicted): 12 stores
    stored = 10 if shared_blocks == 8 else 12
    assert p.extra == {"shared_stored": stored, "shared_evictions": stored - shared_blocks,
                       "shared_blocks_held": shared_blocks}
    # a shared tier of less than one block holds nothing
    assert replay_cluster(tr, 4 * 512, 2, "round-robin", block_size=512, shared_capacity_tokens=511).hit_tokens == 0


def test_cluster_replay_a_prefix_computed_on_one_replica_is_loaded_on_the_other():
    """Round robin sends [1, 2, 3, 10] to r0 and then [1, 2, 3, 12] to r1: without a shared tier r1 computes it
    all; with one, r1 loads blocks 1, 2, 3 (3 x 512 tokens) from the shared store, and prefix routing (which
    sees the shared blocks as every replica's) predicts those loads exactly."""
    tr = trace_of([[1, 2, 3, 10], [1, 2, 3, 12], [1, 2, 3, 14], [1, 2, 3, 16]])
    # r0: req0 0; r1: req1 0 (nothing of it on r1); r0: req2 3 (GPU); r1: req3 3 (GPU, req1's blocks)
    rr = replay_cluster(tr, 4 * 512, 2, "round-robin", block_size=512)
    assert [p["hit_tokens"] for p in rr.per_replica] == [3 * 512, 3 * 512] and rr.shared_hit_tokens is None
    sh = replay_cluster(tr, 4 * 512, 2, "round-robin", block_size=512, shared_capacity_tokens=8 * 512,
                        check_every=1)
    # req1 on r1 now loads 1, 2, 3 from the shared store (written through by req0); req2 and req3 hit on GPU
    assert [(p["gpu_hit_tokens"], p["shared_hit_tokens"]) for p in sh.per_replica] == [(3 * 512, 0),
                                                                                      (3 * 512, 3 * 512)]
    assert sh.shared_hit_tokens == 3 * 512 and sh.hit_tokens == 9 * 512
    assert sh.extra["shared_stored"] == 4 + 1 + 1 + 1  # 1, 2, 3 once; 10, 12, 14, 16 once each
    # prefix routing, balance slack 0.2 (loads in prompt tokens): req0 -> r0 (tie), req1: r0 holds 1, 2, 3 but
    # would carry 4096 > 1.2 x 4096 / 2: r1, which scores the shared tier's 3 blocks: loads them (as round robin)
    px = replay_cluster(tr, 4 * 512, 2, "prefix", block_size=512, shared_capacity_tokens=8 * 512, check_every=1)
    assert px.hit_tokens == 9 * 512 and px.shared_hit_tokens == 3 * 512
    assert px.predicted_hit_tokens == px.hit_tokens  # the index saw the shared store as the replicas reported it
    assert px.weights == TIER_WEIGHTS


def test_cluster_replay_cli_with_a_shared_tier(tmp_path):
    import json

    from pagedkv.cli import main as cli_main

    rows = [[1, 2, 3, 10], [1, 2, 3, 12], [1, 2, 3, 14], [1, 2, 3, 16]]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(h), "output_length": 1,
                                        "hash_ids": h}) + "\n" for t, h in enumerate(rows)))
    out = tmp_path / "o.json"
    assert cli_main(["replay", str(path), "--replicas", "2", "--capacity", "2048", "--block-size", "512",
                     "--route", "round-robin", "--shared-capacity", "4096", "--no-progress", "--json",
                     str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["shared_capacity_tokens"] == 4096
    (p,) = doc["points"]
    assert p["shared_hit_tokens"] == 3 * 512 and p["per_replica"][1]["shared_hit_tokens"] == 3 * 512
    assert cli_main(["replay", str(path), "--replicas", "2", "--disk-capacity", "4096", "--no-progress"]) == 2
    assert cli_main(["replay", str(path), "--shared-weight", "0.5", "--no-progress"]) == 2
    assert cli_main(["replay", str(path), "--replicas", "2", "--shared-weight", "2", "--no-progress"]) == 2


# ------------------------------------------------------------------------------------------ the router
def test_router_chooses_a_replica_by_shared_tier_blocks_learnt_over_zmq():
    """Two replicas publish KV events over ZMQ; the router's own subscriber feeds its state (as ``pagedkv
    router`` wires it); a third replica has sent nothing. Replica a holds the prompt's blocks 0-1 on its GPU, b
    holds 0-1 and 3-5 (block 2 was evicted). Then b reports blocks 0-5 stored in the shared store: every replica
    reaches 6 blocks, each scoring its own GPU prefix plus 0.3 per shared block (a: 2 + 1.2, b: 2 + 1.2, its own
    blocks 3-5 lying past the hole, c: 1.8), and the router predicts 6 cached blocks wherever it sends the prompt,
    even to c, which it chooses when a and b are over the balance limit."""
    pytest.importorskip("zmq")
    from pagedkv.router.events import EventSubscriber
    from pagedkv.router.state import Replica, RouterState
    from pagedkv.server.kv_events import KVEventPublisher

    toks = list(range(16 * 7))
    keys = block_hashes(toks, 16)  # 7 blocks
    pubs = {u: KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
            for u in ("http://a", "http://b")}
    state = RouterState([Replica("http://a"), Replica("http://b"), Replica("http://c")], route="prefix",
                        block_size=16, balance_abs=10**6, min_match=0.0)
    sub = EventSubscriber({u: (p.endpoint, p.replay_endpoint) for u, p in pubs.items()}, state.apply_events,
                          state.clear_replica).start()

    def wait_blocks(n_shared, n_own):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with state.lock:
                if state.index.num_shared_blocks() == n_shared and state.index.num_blocks() == n_own:
                    return
            time.sleep(0.02)
        raise AssertionError("the router did not learn the events in time")

    try:
        time.sleep(0.3)
        pubs["http://a"].publish([stored(keys[:2])])
        pubs["http://b"].publish([stored(keys[:2]), stored(keys[3:6])])
        for p in pubs.values():
            p.flush()
        wait_blocks(0, 7)
        # no shared block yet: a and b both match 2 blocks, c nothing; equal loads: the first in order, a
        first = state.choose(keys, len(toks))
        assert first[0] == "http://a" and first[1] == 32
        state.done(first[0], first[2], keys)
        # b reports the prompt's first 6 blocks in the shared store
        pubs["http://b"].publish([stored(keys[:6], "SHARED")])
        pubs["http://b"].flush()
        wait_blocks(6, 7)
        if pytest.importorskip("prometheus_client"):
            from pagedkv.router.metrics import RouterMetrics

            text = RouterMetrics(state).render().decode()
            assert "pagedkv_router_index_shared_blocks 6.0" in text and "pagedkv_router_index_blocks 7.0" in text
        score, matched = state.policy.scores(keys, state.routable())
        assert score == pytest.approx({"http://a": 3.2, "http://b": 3.2, "http://c": 1.8})
        assert matched == {"http://a": 6, "http://b": 6, "http://c": 6}
        # a tie between a and b: the tiebreak (decisions so far: a 1, b 0) picks b; predicted 6 blocks
        d = state.choose(keys, len(toks))
        assert d[0] == "http://b" and d[1] == 6 * 16
        state.done(d[0], d[2], keys)
        # b loads block 2 from the shared store (on its GPU now): its prefix is all GPU, 6 blocks
        pubs["http://b"].publish([stored(keys[2:3])])
        pubs["http://b"].flush()
        wait_blocks(6, 8)
        assert state.policy.scores(keys, state.routable())[0]["http://b"] == pytest.approx(6.0)
        # a and b busy: c, which holds nothing of its own, is chosen and predicted to load the 6 shared blocks
        state.replicas["http://a"].inflight_tokens = state.replicas["http://b"].inflight_tokens = 10**7
        state.policy.slack = 0.2
        state.policy.abs_slack = 0
        d = state.choose(keys, len(toks))
        assert d[0] == "http://c" and d[1] == 6 * 16
    finally:
        sub.close()
        for p in pubs.values():
            p.close()


def test_the_index_drops_blocks_the_disk_tier_evicted(any_index, tmp_path):
    """The disk tier's evictions reach the router: a replica's connector publishes BlockStored / BlockRemoved with
    medium "DISK" (a DiskBackend bounded to 3 values evicts the oldest as new ones come); applied to the index,
    the replica's DISK prefix is what the disk really holds."""
    import numpy as np

    import pagedkv
    from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint, check_digests
    from pagedkv.tiers.codec import encode
    from pagedkv.tiers.connector import TierConnector

    bs, pb = 4, 64
    fp = ModelFingerprint("w", "float32", bs, "L1,2,B4,H1,D2")
    size = len(encode(fp.digest, "0" * 32, bytes(pb)))
    disk = BlockStore(DiskBackend(tmp_path / "disk", 3 * size), fp, pb, track_removals=True)
    c = TierConnector([("DISK", disk)], bs, chain_names=True)
    ix = any_index
    try:
        keys = pagedkv.block_hashes(list(range(21)), bs)  # 5 blocks of one chain
        ck = check_digests(list(range(21)), bs)
        c.store(keys[:3], [np.full(pb // 4, i, np.float32) for i in range(3)], None, checks=ck[:3], store_id=1,
                chained=False)
        c.flush(10)
        ix.apply_all("r", c.take_events())
        assert ix.longest_prefix(keys, "DISK") == {"r": 3}
        c.store(keys[3:5], [np.full(pb // 4, i, np.float32) for i in range(3, 5)], None, checks=ck[3:5], store_id=2,
                chained=False)
        c.flush(10)
        ev = c.take_events()
        assert any(type(e).__name__ == "BlockRemoved" and e.medium == "DISK" for e in ev)
        ix.apply_all("r", ev)
        assert ix.longest_prefix(keys, "DISK") == {}  # blocks 0-1 left the disk: no prefix from the start
        assert ix.longest_prefix(keys[2:], "DISK") == {"r": 3}
        assert ix.num_blocks() == 3
    finally:
        c.close()
