"""The router's event subscriber against real publishers (pagedkv.server.kv_events) fed by real block managers,
on the loopback, without the model: the index it builds equals each manager's cached blocks, through lost
messages (resync through the replay socket), a replica restart (numbering from 0) and a late start."""

import time

import pytest
from stub_replica import wait_for

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv import BlockManager, block_hashes  # noqa: E402
from pagedkv.cluster import MemoryIndex  # noqa: E402
from pagedkv.router.events import EventSubscriber, replay_endpoint_for  # noqa: E402
from pagedkv.server.kv_events import KVEventPublisher  # noqa: E402

BS = 4


def manager():
    return BlockManager(64, BS, enable_prefix_caching=True, watermark=0.0, enable_kv_events=True)


def run(bm, pub, seq_id, prompt):
    """One request: allocate, free, and publish its events as one message."""
    bm.allocate(seq_id, prompt)
    bm.free(seq_id)
    pub.publish(bm.events.take())
    pub.flush()


def cached_keys(bm):
    return {e.block_hashes[0] for e in bm._cache.snapshot_events()}


def index_keys(ix, replica):
    return set(ix._members[replica][("GPU", 0)]) if replica in ix._members else set()


@pytest.fixture
def pair():
    pubs = [KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    bms = [manager(), manager()]
    ix = MemoryIndex()
    cleared = []

    def clear(r):
        cleared.append(r)
        ix.drop_replica(r)

    sub = EventSubscriber({f"r{i}": (p.endpoint, p.replay_endpoint) for i, p in enumerate(pubs)},
                          lambda r, evs: ix.apply_all(r, evs), clear).start()
    time.sleep(0.3)  # let the SUB sockets connect
    yield pubs, bms, ix, sub, cleared
    sub.close()
    for p in pubs:
        p.close()


def test_index_follows_two_replicas_and_repairs_a_gap(pair):
    pubs, bms, ix, sub, _ = pair
    for i in range(6):
        run(bms[i % 2], pubs[i % 2], i, [i % 3] * 4 + list(range(100 * i, 100 * i + 9)))
    assert wait_for(lambda: all(index_keys(ix, f"r{k}") == cached_keys(bms[k]) for k in range(2)))
    assert sub.feeds["r0"].resyncs == 0
    # lose two messages of r0: the next one reveals the gap, the replay socket fills it
    sub.drop_next("r0", 2)
    for i in range(6, 9):
        run(bms[0], pubs[0], i, list(range(1000 * i, 1000 * i + 13)))
    assert wait_for(lambda: index_keys(ix, "r0") == cached_keys(bms[0]))
    assert sub.feeds["r0"].resyncs == 1 and sub.feeds["r0"].incomplete == 0 and sub.feeds["r1"].resyncs == 0
    p = list(range(8000, 8013))
    assert ix.longest_prefix(block_hashes(p, BS)) == {"r0": 3}


def test_a_restarted_replica_is_cleared_and_followed_from_zero(pair):
    pubs, bms, ix, sub, cleared = pair
    for i in range(3):
        run(bms[0], pubs[0], i, list(range(10 * i, 10 * i + 12)))
    assert wait_for(lambda: index_keys(ix, "r0") == cached_keys(bms[0]) != set())
    # restart r0: a new manager (empty cache) and a new publisher on the same endpoints, numbering from 0
    ep, rep = pubs[0].endpoint, pubs[0].replay_endpoint
    pubs[0].close()
    time.sleep(0.2)
    pubs[0] = KVEventPublisher(ep, replay_endpoint=rep)
    bms[0] = manager()
    time.sleep(0.5)  # the SUB socket reconnects
    run(bms[0], pubs[0], 0, list(range(500, 509)))
    assert wait_for(lambda: "r0" in cleared and index_keys(ix, "r0") == cached_keys(bms[0]))
    assert sub.feeds["r0"].restarts == 1


def test_a_late_subscriber_learns_everything_from_the_replay():
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    bm = manager()
    try:
        for i in range(4):
            run(bm, pub, i, list(range(20 * i, 20 * i + 11)))
        ix = MemoryIndex()
        sub = EventSubscriber({"r": (pub.endpoint, pub.replay_endpoint)}, lambda r, evs: ix.apply_all(r, evs),
                              ix.drop_replica).start()
        try:
            assert wait_for(lambda: index_keys(ix, "r") == cached_keys(bm) != set())
            assert sub.feeds["r"].seq == 3
        finally:
            sub.close()
    finally:
        pub.close()


def test_replay_endpoint_default():
    assert replay_endpoint_for("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    with pytest.raises(ValueError):
        replay_endpoint_for("ipc:///tmp/x")


def test_restarts_are_counted_across_a_replica_leaving_and_coming_back(pair):
    """The health checks take a replica out (``forget``) and back in (``forget`` again): its numbering is
    rebuilt from the replay. A replica that was only unreachable is not a restart; one that came back with its
    numbering from 0 is, whether its first message comes through the replay or live."""
    pubs, bms, ix, sub, cleared = pair
    for i in range(3):
        run(bms[0], pubs[0], i, list(range(10 * i, 10 * i + 12)))
    assert wait_for(lambda: index_keys(ix, "r0") == cached_keys(bms[0]) != set())
    sub.forget("r0")  # down ...
    sub.forget("r0")  # ... and up again: same process, same numbering
    run(bms[0], pubs[0], 3, list(range(300, 309)))
    assert wait_for(lambda: index_keys(ix, "r0") == cached_keys(bms[0]))
    assert sub.feeds["r0"].restarts == 0
    for restart in (1, 2):
        sub.forget("r0")  # down: the process dies ...
        ep, rep = pubs[0].endpoint, pubs[0].replay_endpoint
        pubs[0].close()
        time.sleep(0.2)
        pubs[0] = KVEventPublisher(ep, replay_endpoint=rep)  # ... and a new one starts, numbering from 0
        bms[0] = manager()
        if restart == 2:  # its first message is already in its replay buffer when it comes back
            run(bms[0], pubs[0], 0, list(range(600, 609)))
        time.sleep(0.5)  # the SUB socket reconnects
        sub.forget("r0")  # up
        time.sleep(0.3)
        run(bms[0], pubs[0], 1, list(range(500 + restart, 509 + restart)))

        def caught_up():
            return index_keys(ix, "r0") == cached_keys(bms[0]) and sub.feeds["r0"].seq is not None

        if not wait_for(caught_up, 3.0):  # sent before the SUB socket rejoined: the next message shows the gap
            run(bms[0], pubs[0], 2, list(range(700 + restart, 709 + restart)))
        assert wait_for(caught_up)
        assert sub.feeds["r0"].restarts == restart
    assert sub.feeds["r1"].restarts == 0
