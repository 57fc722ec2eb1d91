"""Chunked prefill in the block manager: ``allocate(..., num_new_tokens=k)`` holds the prefix-cache hit plus one
chunk after a lookup on the whole prompt; later chunks are ``decode_step`` multi-token appends whose filled
blocks are findable at once (burst sharing); admission (``can_allocate``, ``lookup_prefix``) counts the chunk;
a partly prefilled sequence is swapped, aborted with ``free(cache=False)``, but forked only once complete.
The stateful machines (tests/test_stateful.py) and the KV-content model (tests/kv_model.py) drive the same
calls at random."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pagedkv import AllocStatus, BlockManager
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PromptTooLongError, SequenceStateError
from test_contract import _batch_vs_sequential
from test_errors import check_raises, snapshot


def _chunks(bm, sid, prompt, k):
    """Append the rest of ``prompt`` to ``sid`` in chunks of ``k`` tokens, one step each."""
    while (n := bm.num_tokens(sid)) < len(prompt):
        c = min(k, len(prompt) - n)
        r = bm.decode_step([sid], np.asarray(prompt[n : n + c]), num_new_tokens=[c])
        assert r.slot_mapping.tolist() == bm.slot_mapping(sid, n, n + c).tolist()
        assert r.seq_lens.tolist() == [n + c]
        bm.take_copy_plan()


def test_a_chunk_holds_the_hit_plus_k_tokens_and_the_lookup_sees_the_whole_prompt():
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    p = list(range(1, 23))  # 22 tokens: 5 full blocks + 2
    assert bm.allocate("a", p) == 0
    bm.take_copy_plan()
    # a lookup on the first chunk alone would find one block; on the whole prompt it finds five
    assert bm.lookup_prefix(p, num_new_tokens=3) == (20, 5, 0, 1)
    free = bm.num_free_gpu_blocks
    assert bm.allocate("b", p, num_new_tokens=3) == 20
    assert bm.num_tokens("b") == 22 and "b" not in bm._t.partial  # the chunk completes the prompt
    assert free - bm.num_free_gpu_blocks == 1
    bm.take_copy_plan()
    bm.free("a")
    bm.free("b")
    q = p[:8] + [99] * 14
    assert bm.allocate("c", q, num_new_tokens=5) == 8
    assert bm.num_tokens("c") == 13 and len(bm.block_table("c")) == 4
    assert bm.stats.prefix_query_tokens == 3 * 22  # the whole prompt is counted as looked up
    bm.check_invariants()


def test_burst_sharing_follows_the_chunks():
    """Identical prompts admitted while the first is being prefilled find exactly the blocks its chunks filled."""
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    p = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3, 5, 5, 6, 6, 1, 1]  # 18 tokens
    assert bm.allocate("a", p, num_new_tokens=6) == 0  # positions 0..5: block 0 full
    hits = []
    for i, k in enumerate((6, 6)):
        assert bm.lookup_prefix(p).num_cached_tokens == 4 * (bm.num_tokens("a") // 4)
        hits.append(bm.allocate(f"burst{i}", p, num_new_tokens=2))
        n = bm.num_tokens("a")
        bm.decode_step(["a"], np.asarray(p[n : n + k]), num_new_tokens=[k])
        bm.take_copy_plan()
    assert hits == [4, 12]
    assert bm.allocate("late", p) == 16  # the whole prompt is there now: every full block but the last token's
    assert bm.block_table("late")[:4].tolist() == bm.block_table("a")[:4].tolist()
    bm.check_invariants()


def test_admission_counts_the_next_chunk_and_never_looks_at_the_whole_prompt():
    bm = BlockManager(10, 4, watermark=0.0)
    bm.allocate("x", [1] * 24)  # 6 blocks held: 4 free
    long = list(range(30))  # 8 blocks: fits the pool, not the free blocks
    assert bm.can_allocate(long) is AllocStatus.LATER
    assert bm.can_allocate(long, num_new_tokens=16) is AllocStatus.OK
    assert bm.can_allocate(long, num_new_tokens=17) is AllocStatus.LATER
    assert bm.lookup_prefix(long, num_new_tokens=5).num_new_blocks == 2
    assert bm.can_allocate(list(range(41)), num_new_tokens=1) is AllocStatus.NEVER
    check_raises(bm, PromptTooLongError, bm.allocate, "y", list(range(41)), num_new_tokens=1)
    check_raises(bm, OutOfBlocksError, bm.allocate, "y", long, num_new_tokens=17)
    for bad in (0, -1, True, 2.0):
        check_raises(bm, InvalidArgumentError, bm.allocate, "y", long, num_new_tokens=bad)
        with pytest.raises(InvalidArgumentError):
            bm.can_allocate(long, num_new_tokens=bad)
    check_raises(bm, InvalidArgumentError, bm.allocate_batch, ["y"], [long], num_new_tokens=[0])
    check_raises(bm, InvalidArgumentError, bm.allocate_batch, ["y"], [long], num_new_tokens=3)
    bm.allocate("y", long, num_new_tokens=16)
    assert bm.num_tokens("y") == 16 and bm.num_free_gpu_blocks == 0
    with pytest.raises(OutOfBlocksError):
        bm.decode_step(["y"], np.asarray(long[16:20]), num_new_tokens=[4])
    bm.free("x")
    _chunks(bm, "y", long, 7)
    assert bm.num_tokens("y") == 30
    bm.check_invariants()


def test_fork_waits_for_the_whole_prompt():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    p = list(range(13))
    bm.allocate("a", p, num_new_tokens=4)
    bm.take_copy_plan()
    check_raises(bm, SequenceStateError, bm.fork, "a", "b", must_mention=("4 of its 13",))
    bm.swap_out(["a"]) if bm.config.num_cpu_blocks else None
    bm.decode_step(["a"], np.asarray(p[4:12]), num_new_tokens=[8])
    bm.take_copy_plan()
    check_raises(bm, SequenceStateError, bm.fork, "a", "b")
    bm.decode_step(["a"], np.asarray(p[12:]), num_new_tokens=[1])
    bm.take_copy_plan()
    bm.fork("a", "b")
    assert bm.block_table("b").tolist() == bm.block_table("a").tolist()
    # a freed id allocated again is a new sequence
    bm.free("a")
    bm.allocate("a", p + [5, 5], num_new_tokens=1)
    assert bm.num_tokens("a") == 13  # the hit (12) plus one
    bm.take_copy_plan()
    check_raises(bm, SequenceStateError, bm.fork, "a", "c")
    bm.check_invariants()


def test_swap_and_recompute_in_the_middle_of_a_prefill():
    bm = BlockManager(16, 4, num_cpu_blocks=16, enable_prefix_caching=True, watermark=0.0)
    p = list(range(30))
    bm.allocate("a", p, num_new_tokens=9)
    bm.take_copy_plan()
    out = bm.swap_out(["a"])
    assert len(out) == 3 and bm.is_swapped("a")
    check_raises(bm, SequenceStateError, bm.fork, "a", "b")
    bm.take_copy_plan()
    bm.swap_in(["a"])
    bm.take_copy_plan()
    _chunks(bm, "a", p, 10)
    bm.fork("a", "b")
    # recompute: free mid-prefill, allocate again: the chunks already computed come back as a hit
    bm.allocate("c", p[:20] + [1] * 10, num_new_tokens=6)
    bm.take_copy_plan()
    bm.free("c")
    assert bm.allocate("c", p[:20] + [1] * 10, num_new_tokens=6) == 24  # a's 5 blocks and c's own first chunk
    bm.check_invariants()


def test_abort_mid_prefill_withdraws_only_the_last_chunk():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    p = list(range(24))
    bm.allocate("a", p, num_new_tokens=8)  # blocks 0, 1
    bm.take_copy_plan()
    bm.decode_step(["a"], np.asarray(p[8:16]), num_new_tokens=[8])  # blocks 2, 3: never written (aborted)
    bm.free("a", cache=False)
    assert "a" not in bm._t.partial
    assert bm.lookup_prefix(p).num_cached_tokens == 8
    bm.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), tier=st.booleans())
def test_allocate_batch_with_chunks_equals_consecutive_allocates(seed, tier):
    a, b, ids, prompts, nss, la = _batch_vs_sequential(seed, tier, blocks=60, demote=True)
    rng = random.Random(seed)
    chunks = [rng.choice([1, 2, 3, 5, 100]) for _ in prompts]
    assume(sum(-(-(len(p) + la) // a.block_size) for p in prompts) <= a._gpu.num_free)  # no eviction
    res = a.allocate_batch(ids, prompts, la, namespaces=nss, num_new_tokens=chunks)
    hits = [b.allocate(s, p, la, namespace=ns, num_new_tokens=c) for s, p, ns, c in zip(ids, prompts, nss, chunks)]
    assert res.num_cached_tokens.tolist() == hits
    assert snapshot(a) == snapshot(b)
    assert a.events.take() == b.events.take()
    a.check_invariants()
    qsl = res.query_start_loc
    for i, (s, p, c) in enumerate(zip(ids, prompts, chunks)):
        held = min(len(p), hits[i] + c)
        assert a.num_tokens(s) == held == res.seq_lens[i]
        sl = slice(qsl[i], qsl[i + 1])
        assert res.token_ids[sl].tolist() == p[hits[i] : held]
        assert res.slot_mapping[sl].tolist() == a.slot_mapping(s, hits[i], held).tolist()
