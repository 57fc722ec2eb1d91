"""KV events over ZMQ (pagedkv.server.kv_events): vLLM's wire layout, gap-free sequence numbers, replay.

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


@pytest.fixture()
def publisher():
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test", buffer_size=4)
    yield pub
    pub.close()


def subscribe(ctx, endpoint: str):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-test")
    sub.connect(endpoint)
    return sub


def replay(ctx, endpoint: str, start: int) -> list:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    try:
        while True:
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


def test_wire_layout_sequence_and_key_set():
    """A subscriber rebuilds the key set from the live stream, filling any gap (messages a PUB socket sends
    before the subscription has propagated are lost) from the replay socket."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv-test")
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
                for s2, p2 in replay(ctx, publisher.replay_endpoint, expect):
                    if s2 < num:
                        apply(keys, decode_payload(p2))
                expect = num
            assert num == expect
            raw = msgspec.msgpack.decode(payload)  # the untyped layout a vLLM router decodes
            assert isinstance(raw[0], float) and abs(raw[0] - time.time()) < 60 and raw[2] is None
            assert [e[0] for e in raw[1]] == [type(e).__name__ for e in BATCHES[num]]
            apply(keys, decode_payload(payload))
            expect += 1
        assert keys == expected_keys(BATCHES)
        assert publisher.next_seq == len(BATCHES)
    finally:
        sub.close(0)
        publisher.close()


def test_event_arrays_match_vllm_field_order(publisher):
    publisher.publish([ev.BlockStored([7, 8], 6, [1, 2, 3, 4], 2, None, "GPU", "tenant-a"), ev.BlockRemoved([5])])
    publisher.flush()
    ((_, payload),) = replay(zmq.Context.instance(), publisher.replay_endpoint, 0)
    raw = msgspec.msgpack.decode(payload)
    assert raw[1] == [["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None, "GPU"], ["BlockRemoved", [5], "GPU"]]


def test_replay_resends_from_a_sequence_number_and_the_ring_is_bounded(publisher):
    for b in BATCHES:
        publisher.publish(b)
    publisher.flush()
    ctx = zmq.Context.instance()
    got = replay(ctx, publisher.replay_endpoint, 3)
    assert [s for s, _ in got] == [3, 4, 5]
    # buffer_size=4: messages 0 and 1 are gone; asking for 0 returns what is left, from 2
    got = replay(ctx, publisher.replay_endpoint, 0)
    assert [s for s, _ in got] == [2, 3, 4, 5]
    assert replay(ctx, publisher.replay_endpoint, 6) == []
    # a subscriber that knows the state up to message 2 catches up by replay alone
    keys = expected_keys(BATCHES[:3])
    for _, payload in replay(ctx, publisher.replay_endpoint, 3):
        apply(keys, decode_payload(payload))
    assert keys == expected_keys(BATCHES)


def test_publish_rejects_what_is_not_an_event(publisher):
    with pytest.raises(TypeError):
        publisher.publish([("BlockStored", [1])])
    assert publisher.next_seq == 0
