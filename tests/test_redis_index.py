"""RedisIndex: the same contract as MemoryIndex (checked side by side on the same events), its key layout, the
cleanup of a vanished replica and sharing between two index objects (two routers). Starts its own
redis-server (skipped with a reason when the binary is absent)."""

import random

import pytest

from pagedkv import BlockManager, block_hashes
from pagedkv.cluster import MemoryIndex, RedisIndex, open_index
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored


@pytest.fixture
def index(redis_url, request):
    ix = RedisIndex(redis_url, prefix=f"t{abs(hash(request.node.name))}")
    yield ix
    for k in ix.r.scan_iter(f"{ix.p}:*"):
        ix.r.delete(k)


def stored(hashes, medium="GPU"):
    return BlockStored(list(hashes), None, [], 16, None, medium)


def test_same_answers_as_the_memory_index(index):
    mem = MemoryIndex()
    events = [("a", stored([1, 2, 3, 4])), ("b", stored([1, 2])), ("c", stored([9])), ("a", BlockRemoved([3])),
              ("b", stored([3, 4], "CPU")), ("c", AllBlocksCleared()), ("c", stored([1]))]
    for r, e in events:
        mem.apply(r, e)
        index.apply(r, e)
    for q in ([1, 2, 3, 4, 5], [1], [9], [], [7, 1]):
        for medium in (None, "GPU", "CPU"):
            assert index.longest_prefix(q, medium) == mem.longest_prefix(q, medium), (q, medium)
    assert index.num_blocks() == mem.num_blocks() and index.num_blocks("b") == 4 and index.has_cpu
    assert index.replicas() == ["a", "b", "c"]


def test_key_layout_and_cleanup_of_a_vanished_replica(index):
    p = index.p
    index.apply("r1", stored([11, 12]))
    index.apply("r2", stored([11]))
    index.set_seq("r1", 41)
    assert index.r.smembers(f"{p}:blk:GPU:11") == {b"r1", b"r2"}
    assert index.r.smembers(f"{p}:rep:r1:GPU") == {b"11", b"12"}
    assert index.r.smembers(f"{p}:replicas") == {b"r1", b"r2"} and index.get_seq("r1") == 41
    index.drop_replica("r1")
    assert index.r.smembers(f"{p}:blk:GPU:11") == {b"r2"} and not index.r.exists(f"{p}:blk:GPU:12")
    assert not index.r.exists(f"{p}:rep:r1:GPU") and index.get_seq("r1") is None
    assert index.replicas() == ["r2"] and index.longest_prefix([11, 12]) == {"r2": 1}


def test_two_routers_share_one_index_and_a_new_one_sees_it_at_once(index, redis_url):
    """Events from a real manager applied through one RedisIndex; a second object on the same server (another
    router, or this one restarted) answers the same, and long prompts cross the 256-key pipeline chunks."""
    bm = BlockManager(2000, 4, enable_prefix_caching=True, watermark=0.0, enable_kv_events=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(5000) for _ in range(1500)] for _ in range(2)]
    for i, pr in enumerate(prompts):
        bm.allocate(i, pr)
        bm.free(i)
    index.apply_all("r", bm.events.take())
    other = RedisIndex(redis_url, prefix=index.p)
    for pr in prompts:
        assert other.longest_prefix(block_hashes(pr, 4)) == {"r": 375}
    assert other.longest_prefix(block_hashes(prompts[0][:1000] + [7] * 500, 4)) == {"r": 250}


def test_open_index():
    assert isinstance(open_index(None), MemoryIndex) and isinstance(open_index("memory"), MemoryIndex)
    with pytest.raises(ValueError, match="redis://"):
        open_index("mongodb://x")
