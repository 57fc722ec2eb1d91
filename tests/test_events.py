"""KV cache events: exact event sequences, block_hashes, overflow and resynchronisation, and off by default."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager, block_hashes
from pagedkv.errors import InvalidArgumentError, InvalidTokensError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored


def manager(**kw):
    kw.setdefault("watermark", 0)
    return BlockManager(kw.pop("blocks", 8), 4, enable_prefix_caching=True, enable_kv_events=True, **kw)


def test_allocate_decode_evict_reset_event_sequence():
    bm = manager()
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    h = block_hashes(p, 4)
    assert len(h) == 2
    bm.allocate("a", p)
    assert bm.events.take() == [BlockStored(h, None, p[:8], 4, None, "GPU", None)]
    assert bm.events.take() == []  # taken
    for t in (10, 11, 12):
        bm.decode_step(["a"], np.array([t]))
    h3 = block_hashes(p + [10, 11, 12], 4)
    assert h3[:2] == h
    assert bm.events.take() == [BlockStored([h3[2]], h[1], [9, 10, 11, 12], 4, None, "GPU", None)]
    bm.free("a")
    assert bm.events.take() == []  # freeing keeps the blocks cached
    bm.allocate("b", list(range(100, 120)))  # 5 blocks: the free ring has 5 (3..7), no eviction yet
    bm.allocate("c", list(range(200, 204)))  # evicts the LRU cached block: a's tail block
    ev = bm.events.take()
    assert ev[0] == BlockStored(block_hashes(list(range(100, 120)), 4), None, list(range(100, 120)), 4, None, "GPU",
                                None)
    assert ev[1] == BlockRemoved([h3[2]], "GPU")
    assert ev[2].block_hashes == block_hashes(list(range(200, 204)), 4) and len(ev) == 3
    bm.reset_prefix_cache()
    assert bm.events.take() == [AllBlocksCleared()]


def test_namespaces_change_the_hashes_and_are_reported():
    bm = manager()
    p = list(range(8))
    bm.allocate("a", p + [1], namespace="tenant")
    (e,) = bm.events.take()
    assert e.block_hashes == block_hashes(p, 4, namespace="tenant") != block_hashes(p, 4)
    assert e.namespace == "tenant"
    assert block_hashes(p, 4, namespace=7) != block_hashes(p, 4, namespace="7")


def test_free_without_cache_reports_the_withdrawn_blocks():
    bm = manager()
    bm.allocate("a", list(range(9)))
    stored = bm.events.take()[0].block_hashes
    bm.free("a", cache=False)
    assert bm.events.take() == [BlockRemoved(stored, "GPU")]


def test_swap_round_trip_readopts_an_evicted_block_with_an_event():
    bm = manager(blocks=4, num_cpu_blocks=4)
    bm.allocate("a", [1, 2, 3, 4, 5])  # block 0 cached
    h = bm.events.take()[0].block_hashes
    bm.swap_out(["a"])  # GPU block 0 stays cached, unreferenced
    bm.allocate("b", list(range(10, 26)))  # 4 blocks: evicts block 0
    assert bm.events.take()[0] == BlockRemoved(h, "GPU")  # evicted first, then b's blocks stored
    bm.free("b")
    bm.events.take()
    bm.swap_in(["a"])  # the content comes back into the cache under its old key
    ev = [e for e in bm.events.take() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in ev] == [h] and ev[0].parent_block_hash is None
    bm.check_invariants()


def test_overflow_answers_with_a_full_resync():
    bm = manager(blocks=64, max_kv_events=3)
    for i in range(6):
        bm.allocate(i, [i] * 8 + [99])  # one BlockStored each
    ev = bm.events.take()
    assert bm.events.overflows == 1
    assert ev[0] == AllBlocksCleared()
    index = set()
    for e in ev[1:]:
        assert isinstance(e, BlockStored)
        index.update(e.block_hashes)
    assert index == set(bm._cache.mapping())
    assert bm.events.take() == []  # back to normal
    bm.allocate("x", [50] * 5)
    assert len(bm.events.take()) == 1


def test_events_are_off_by_default_and_without_prefix_caching():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    bm.allocate("a", list(range(9)))
    assert bm.events.take() == [] and not bm.config.enable_kv_events and bm._cache.events is None
    bm = BlockManager(8, 4, enable_kv_events=True)
    bm.allocate("a", list(range(9)))
    assert bm.events.take() == []


def test_block_hashes_bad_input():
    assert block_hashes([1, 2, 3], 4) == []
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2, 3, 4], 0)
    with pytest.raises(InvalidTokensError):
        block_hashes([-1, 2, 3, 4], 4)
    with pytest.raises(InvalidTokensError):
        block_hashes([[1, 2]], 1)
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], 1, namespace=2.5)
