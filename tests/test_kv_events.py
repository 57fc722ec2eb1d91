"""KV events over ZMQ (pagedkv.server.kv_events): vLLM's wire layouts (0.33's maps, the default, and the
older arrays), gap-free sequence numbers, replay framed as each vLLM version frames it.

These tests feed the publisher hand-made events (no model, no block manager): a subscriber rebuilds the set of
cached block keys from the live stream, and a late subscriber rebuilds the same set from the replay socket.
"""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from pagedkv import events as ev  # noqa: E402
from pagedkv.server.kv_events import END_SEQ, KVEventPublisher, decode_payload  # noqa: E402

TIMEOUT_MS = 5000


def apply(keys: set, batch) -> None:
    """What a router does with one batch: maintain the set of cached block keys."""
    for e in batch.events:
        name = type(e).__name__
        if name == "BlockStored":
            keys.update(e.block_hashes)
        elif name == "BlockRemoved":
            keys.difference_update(e.block_hashes)
        else:
            keys.clear()


BATCHES = [
    [ev.BlockStored([11, 12], None, list(range(8)), 4)],
    [ev.BlockStored([13], 12, [8, 9, 10, 11], 4), ev.BlockStored([2**64 - 1], None, [1, 2, 3, 4], 4, medium="GPU")],
    [ev.BlockRemoved([11])],
    [ev.AllBlocksCleared(), ev.BlockStored([21], None, [5, 5, 5, 5], 4)],
    [ev.BlockRemoved([21, 99])],
    [ev.BlockStored([31, 32], 13, list(range(8)), 4, lora_id=None)],
]


def expected_keys(batches) -> set:
    keys: set = set()
    for b in batches:
        for e in b:
            if isinstance(e, ev.BlockStored):
                keys.update(e.block_hashes)
            elif isinstance(e, ev.BlockRemoved):
                keys.difference_update(e.block_hashes)
            else:
                keys.clear()
    return keys


@pytest.fixture(params=["map", "array"])
def publisher(request):
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test", buffer_size=4,
                           layout=request.param)
    yield pub
    pub.close()


def subscribe(ctx, endpoint: str):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-test")
    sub.connect(endpoint)
    return sub


def replay(ctx, endpoint: str, start: int, layout: str = "map") -> list:
    """The (seq, payload) answers of a replay from ``start``, each frame checked: vLLM 0.33 frames them
    ``[b"", topic, seq, payload]`` and ends with ``[b"", b"", END, b""]`` (layout "map"); the array layout's
    vLLM versions ``[b"", seq, payload]`` and ``[b"", END, b""]``."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    try:
        while True:
            frames = dealer.recv_multipart()
            if layout == "map":
                empty, topic, seq, payload = frames
                assert topic == (b"" if seq == END_SEQ else b"kv-test")
            else:
                empty, seq, payload = frames
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_wire_layout_sequence_and_key_set(layout):
    """A subscriber rebuilds the key set from the live stream, filling any gap (messages a PUB socket sends
    before the subscription has propagated are lost) from the replay socket."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test",
                                 layout=layout)
    ctx = zmq.Context.instance()
    sub = subscribe(ctx, publisher.endpoint)
    try:
        time.sleep(0.3)
        for b in BATCHES:
            publisher.publish(b)
        publisher.publish([])  # nothing to send: no message, no sequence number
        publisher.flush()
        keys: set = set()
        expect = 0
        while expect < len(BATCHES):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-test" and len(seq) == 8
            num = int.from_bytes(seq, "big")
            if num > expect:  # missed messages: resync from the replay socket
                for s2, p2 in replay(ctx, publisher.replay_endpoint, expect, layout):
                    if s2 < num:
                        apply(keys, decode_payload(p2))
                expect = num
            assert num == expect
            raw = msgspec.msgpack.decode(payload)  # the untyped layout a vLLM router decodes
            assert isinstance(raw[0], float) and abs(raw[0] - time.time()) < 60
            if layout == "map":  # vLLM 0.33: data_parallel_rank 0, each event a map tagged "type"
                assert raw[2] == 0
                assert [e["type"] for e in raw[1]] == [type(e).__name__ for e in BATCHES[num]]
            else:
                assert raw[2] is None
                assert [e[0] for e in raw[1]] == [type(e).__name__ for e in BATCHES[num]]
            apply(keys, decode_payload(payload))
            expect += 1
        assert keys == expected_keys(BATCHES)
        assert publisher.next_seq == len(BATCHES)
    finally:
        sub.close(0)
        publisher.close()


def test_event_arrays_match_vllm_field_order():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test",
                                 layout="array")
    try:
        publisher.publish([ev.BlockStored([7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", "tenant-a"),
                           ev.BlockRemoved([5])])
        publisher.flush()
        ((_, payload),) = replay(zmq.Context.instance(), publisher.replay_endpoint, 0, "array")
        raw = msgspec.msgpack.decode(payload)
        # (lora_name, nil, after the medium: vLLM 0.14 to 0.23 require it, earlier versions ignore it)
        assert raw[1] == [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", None],
                          ["BlockRemoved", [5], "GPU"]]
    finally:
        publisher.close()


def test_event_maps_match_vllm_0_33_fields():
    """The default layout: vLLM 0.33's maps, its required fields always there (lora_id, medium, lora_name), the
    ones at their default left out, a cache salt (the namespace) in extra_keys on the prompt's first block."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test")
    try:
        publisher.publish([ev.BlockStored([7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", "tenant-a"),
                           ev.BlockStored([3, 4], None, [1, 2, 3, 4], 2, None, "CPU", "tenant-a"),
                           ev.BlockStored([9], None, [5, 6], 2, group_idx=1, kv_cache_spec_kind="sliding_window",
                                          kv_cache_spec_sliding_window=4),
                           ev.BlockRemoved([5]), ev.BlockRemoved([6], group_idx=2), ev.AllBlocksCleared()])
        publisher.flush()
        ((_, payload),) = replay(zmq.Context.instance(), publisher.replay_endpoint, 0)
        raw = msgspec.msgpack.decode(payload)
        assert raw[2] == 0 and len(raw) == 3
        stored = {"block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": [1, 2, 3, 4], "block_size": 2,
                  "lora_id": None, "medium": "GPU", "lora_name": None}
        assert raw[1] == [
            {"type": "BlockStored", **stored},
            {"type": "BlockStored", **stored, "block_hashes": [3, 4], "parent_block_hash": None, "medium": "CPU",
             "extra_keys": [["tenant-a"], None]},
            {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [5, 6],
             "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 1,
             "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4},
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU", "group_idx": 2},
            {"type": "AllBlocksCleared"},
        ]
        back = decode_payload(payload).events
        assert [type(e).__name__ for e in back] == ["BlockStored"] * 3 + ["BlockRemoved"] * 2 + ["AllBlocksCleared"]
        assert back[2].group_idx == 1 and back[4].group_idx == 2 and back[1].extra_keys == [["tenant-a"], None]
    finally:
        publisher.close()


def test_decode_reads_vllm_digests_sent_as_bytes():
    """vLLM sends its digests as bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the decoder gives vLLM's int
    form (low 64 bits, big-endian), the key the router computes; a newer field it does not know is ignored."""
    d1, d2 = bytes(range(32)), bytes(range(100, 132))
    payload = msgspec.msgpack.encode([1.5, [
        {"type": "BlockStored", "block_hashes": [d1, d2], "parent_block_hash": d2, "token_ids": [1, 2],
         "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None, "some_future_field": 3},
        {"type": "BlockRemoved", "block_hashes": [d1], "medium": None}], 0])
    e1, e2 = decode_payload(payload).events
    assert e1.block_hashes == [int.from_bytes(d1[-8:], "big"), int.from_bytes(d2[-8:], "big")]
    assert e1.parent_block_hash == int.from_bytes(d2[-8:], "big") and e2.block_hashes == [e1.block_hashes[0]]
    assert decode_payload(payload, int_keys=False).events[0].block_hashes == [d1, d2]
    with pytest.raises(msgspec.DecodeError):  # neither layout
        decode_payload(msgspec.msgpack.encode([1.5, [{"type": "BlockStored", "block_hashes": [1]}], 0]))


def test_replay_resends_from_a_sequence_number_and_the_ring_is_bounded(publisher):
    for b in BATCHES:
        publisher.publish(b)
    publisher.flush()
    ctx = zmq.Context.instance()
    lay = publisher.layout
    got = replay(ctx, publisher.replay_endpoint, 3, lay)
    assert [s for s, _ in got] == [3, 4, 5]
    # buffer_size=4: messages 0 and 1 are gone; asking for 0 returns what is left, from 2
    got = replay(ctx, publisher.replay_endpoint, 0, lay)
    assert [s for s, _ in got] == [2, 3, 4, 5]
    assert replay(ctx, publisher.replay_endpoint, 6, lay) == []
    # a subscriber that knows the state up to message 2 catches up by replay alone
    keys = expected_keys(BATCHES[:3])
    for _, payload in replay(ctx, publisher.replay_endpoint, 3, lay):
        apply(keys, decode_payload(payload))
    assert keys == expected_keys(BATCHES)


def test_publish_rejects_what_is_not_an_event(publisher):
    with pytest.raises(TypeError):
        publisher.publish([("BlockStored", [1])])
    assert publisher.next_seq == 0
