"""Chunked prefill in HybridBlockManager (``num_new_tokens=`` on allocate / allocate_batch / can_allocate /
lookup_prefix): the hybrid hit is found on the whole prompt, then every group holds the hit plus one chunk; later
chunks are multi-token ``decode_step`` appends (a sliding group releasing what its window no longer needs
between them); fork waits for the whole prompt in every group; free / abort / swap of a partly prefilled
sequence work. The hybrid stateful machine (tests/test_hybrid_stateful.py) and the KV-content model
(tests/kv_model.py, ``Config.draw_hybrid``) drive the same calls at random."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import NULL_BLOCK, AllocStatus, FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import (InvalidArgumentError, OutOfBlocksError, PromptTooLongError, SequenceStateError,
                            TableWidthError)

F, S = FullAttentionSpec, SlidingWindowSpec


def tables(m, seq):
    return [m.block_table(seq, g).tolist() for g in range(m.config.num_groups)]


def snap(m):
    """Everything a refused call could change, in every group."""
    return (m.num_free_gpu_blocks, m.stats.num_free_cpu_blocks, m.stats.num_cached_blocks, m._gpu.ref.tolist(),
            {s: (m.num_tokens(s), m.is_swapped(s), tables(m, s)) for s in m.seq_ids},
            [dict(g._t.partial) for g in m._g])


def refused(m, exc, fn, *args, **kwargs):
    before = snap(m)
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert snap(m) == before
    m.check_invariants()
    return str(info.value)


def chunks(m, sid, prompt, k):
    """Append the rest of ``prompt`` to ``sid`` in chunks of ``k`` tokens, one step each; checks each step's
    slots against slot_mapping() in every group."""
    while (n := m.num_tokens(sid)) < len(prompt):
        c = min(k, len(prompt) - n)
        r = m.decode_step([sid], np.asarray(prompt[n : n + c]), num_new_tokens=[c])
        for g in range(m.config.num_groups):
            assert r.slot_mapping[g].tolist() == m.slot_mapping(sid, n, n + c, g).tolist()
        assert r.seq_lens.tolist() == [n + c]
        m.take_copy_plan()
        m.check_invariants()


def test_chunks_mid_block_and_on_block_edges_and_the_window_releases_between_chunks():
    """Golden tables: 4-token chunks end on block edges, the sliding group (W = 4) lets a block go as soon as the
    next chunk's first query no longer sees it; 3-token chunks end mid-block."""
    m = BlockManager(32, 4, kv_cache_groups=[F(), S(4)], watermark=0, enable_prefix_caching=True, grouped_results=True)
    p = list(range(1, 21))
    assert m.allocate("a", p, num_new_tokens=4) == 0
    assert m.num_tokens("a") == 4 and tables(m, "a") == [[0], [1]]
    assert all(g._t.partial == {"a": 20} for g in m._g)
    m.take_copy_plan()
    got = []
    for c in (4, 4, 4, 4):
        n = m.num_tokens("a")
        r = m.decode_step(["a"], np.asarray(p[n : n + c]), num_new_tokens=[c])
        m.take_copy_plan()
        got.append([t[0].tolist() for t in r.block_tables])
    assert got == [
        [[0, 2], [1, 3]],
        [[0, 2, 4], [-1, 3, 5]],  # the query at 8 sees (4, 8]: block 0 of the window group goes
        [[0, 2, 4, 6], [-1, -1, 5, 7]],
        [[0, 2, 4, 6, 8], [-1, -1, -1, 7, 9]],
    ]
    m.fork("a", "f")  # complete: forkable, and no longer recorded as partly prefilled
    assert all(g._t.partial == {} for g in m._g)
    m.check_invariants()

    m2 = BlockManager(32, 4, kv_cache_groups=[S(6), F()], watermark=0, grouped_results=True)
    q = list(range(14))
    m2.allocate("b", q, num_new_tokens=3)
    assert m2.num_tokens("b") == 3 and [len(t) for t in tables(m2, "b")] == [1, 1]
    m2.take_copy_plan()
    chunks(m2, "b", q, 3)  # ends at 6, 9, 12 (mid-block), 14
    t_s, t_f = tables(m2, "b")
    assert len(t_s) == len(t_f) == 4 and NULL_BLOCK not in t_f
    assert t_s[0] == NULL_BLOCK and NULL_BLOCK not in t_s[1:]  # the last chunk (12) sees (6, 12]: blocks 1..
    m2.check_invariants()


def test_hits_with_chunks_use_the_whole_prompt():
    m = BlockManager(64, 4, kv_cache_groups=[F(), S(4)], watermark=0, enable_prefix_caching=True, grouped_results=True)
    p = list(range(1, 23))  # 22 tokens: 5 full blocks + 2
    assert m.allocate("a", p) == 0
    m.take_copy_plan()
    # the whole prompt's hit is 20; a lookup on the first chunk alone could not see past it
    assert m.lookup_prefix(p, num_new_tokens=3) == (20, 5, 0, 2)  # one new block per group
    free = m.num_free_gpu_blocks
    assert m.allocate("b", p, num_new_tokens=3) == 20
    assert m.num_tokens("b") == 22 and "b" not in m._m0._t.partial  # the chunk completes the prompt
    assert free - m.num_free_gpu_blocks == 2
    ta, tb = tables(m, "a"), tables(m, "b")
    assert tb[0][:5] == ta[0][:5]
    assert tb[1][:4] == [NULL_BLOCK] * 4 and tb[1][4] == ta[1][4]  # the window of the hit only
    q = p[:12] + [99] * 10
    hit = m.lookup_prefix(q, num_new_tokens=5)
    assert m.allocate("c", q, num_new_tokens=5) == hit.num_cached_tokens == 12
    assert m.num_tokens("c") == 17 and [len(t) for t in tables(m, "c")] == [5, 5]
    assert m._m0._t.partial == {"c": 22}
    m.take_copy_plan()
    chunks(m, "c", q, 4)
    # a prompt chunked to its end caches what a whole one does
    assert m.lookup_prefix(q + [1]).num_cached_tokens == 20
    m.check_invariants()


def test_admission_counts_the_chunk_and_never_looks_at_the_whole_prompt():
    m = BlockManager(20, 4, kv_cache_groups=[F(), S(8)], watermark=0.0, grouped_results=True)
    m.allocate("x", [1] * 24)  # 6 blocks in each group: 8 free
    long = list(range(36))  # 9 blocks per group: fits the pool (18 <= 20), not the free blocks
    assert m.can_allocate(long) is AllocStatus.LATER
    assert m.can_allocate(long, num_new_tokens=16) is AllocStatus.OK  # 4 blocks in each group
    assert m.can_allocate(long, num_new_tokens=17) is AllocStatus.LATER
    assert m.lookup_prefix(long, num_new_tokens=5).num_new_blocks == 4
    assert m.can_allocate(list(range(41))) is AllocStatus.NEVER  # whole: 11 blocks x 2 groups > 20
    # in chunks the sliding group holds at most its window and a chunk: 11 + 3 <= 20
    assert m.can_allocate(list(range(41)), num_new_tokens=1) is not AllocStatus.NEVER
    assert m.can_allocate(list(range(81)), num_new_tokens=1) is AllocStatus.NEVER  # the full group alone: 21 > 20
    refused(m, PromptTooLongError, m.allocate, "y", list(range(81)), num_new_tokens=1)
    refused(m, OutOfBlocksError, m.allocate, "y", long, num_new_tokens=17)
    for bad in (0, -1, True, 2.0):
        refused(m, InvalidArgumentError, m.allocate, "y", long, num_new_tokens=bad)
        with pytest.raises(InvalidArgumentError):
            m.can_allocate(long, num_new_tokens=bad)
        with pytest.raises(InvalidArgumentError):
            m.lookup_prefix(long, num_new_tokens=bad)
    refused(m, InvalidArgumentError, m.allocate_batch, ["y"], [long], num_new_tokens=[0])
    refused(m, InvalidArgumentError, m.allocate_batch, ["y"], [long], num_new_tokens=3)
    refused(m, InvalidArgumentError, m.allocate_batch, ["y", "z"], [long, long], num_new_tokens=[3])
    m.allocate("y", long, num_new_tokens=16)
    assert m.num_tokens("y") == 16 and m.num_free_gpu_blocks == 0
    m.take_copy_plan()
    # the next chunk's first query (16) sees (8, 16]: the window group's blocks 0, 1 go, the two new blocks fit
    m.decode_step(["y"], np.asarray(long[16:20]), num_new_tokens=[4])
    assert m.num_free_gpu_blocks == 0 and m.block_table("y", 1).tolist()[:3] == [NULL_BLOCK, NULL_BLOCK, 18]
    m.take_copy_plan()
    # the query at 20 releases one block (8..11), two are needed: refused, nothing changes in any group
    refused(m, OutOfBlocksError, m.decode_step, ["y"], np.asarray(long[20:24]), num_new_tokens=[4])
    assert m.can_append_slots(["y"], num_new_tokens=4) is False
    m.free("x")
    chunks(m, "y", long, 7)
    assert m.num_tokens("y") == 36
    w = BlockManager(40, 4, kv_cache_groups=[F(), S(4)], block_table_width=4, grouped_results=True)
    assert "block_table_width" in refused(w, TableWidthError, w.allocate, "t", list(range(17)), num_new_tokens=2)


def test_fork_is_refused_in_every_group_until_the_whole_prompt_is_appended():
    m = BlockManager(40, 4, kv_cache_groups=[F(), S(4), F()], num_cpu_blocks=30, watermark=0,
                           enable_prefix_caching=True, grouped_results=True)
    p = list(range(13))
    m.allocate("a", p, num_new_tokens=4)
    m.take_copy_plan()
    assert "4 of its 13" in refused(m, SequenceStateError, m.fork, "a", "b")
    m.swap_out(["a"])
    m.take_copy_plan()
    refused(m, SequenceStateError, m.fork, "a", "b")  # swapped out mid-prefill: still refused
    m.swap_in(["a"])
    m.take_copy_plan()
    m.decode_step(["a"], np.asarray(p[4:12]), num_new_tokens=[8])
    m.take_copy_plan()
    refused(m, SequenceStateError, m.fork, "a", "b")
    m.decode_step(["a"], np.asarray(p[12:]), num_new_tokens=[1])
    # complete, but the last chunk's KV is written by this step's forward: refused, the record kept everywhere
    refused(m, SequenceStateError, m.fork, "a", "b")
    assert all(g._t.partial == {"a": 13} for g in m._g)
    m.take_copy_plan()
    m.fork("a", "b")
    assert tables(m, "b") == tables(m, "a")
    m.free("a")
    m.allocate("a", p + [5, 5], num_new_tokens=1)  # a freed id allocated again is a new sequence
    assert m.num_tokens("a") == 13  # the hit (12) plus one
    m.take_copy_plan()
    refused(m, SequenceStateError, m.fork, "a", "c")
    m.check_invariants()


def test_abort_mid_prefill_withdraws_the_last_chunk_in_every_group():
    m = BlockManager(40, 4, kv_cache_groups=[F(), S(8)], watermark=0, enable_prefix_caching=True, grouped_results=True)
    p = list(range(24))
    m.allocate("a", p, num_new_tokens=8)  # blocks 0, 1 of each group
    m.take_copy_plan()
    m.decode_step(["a"], np.asarray(p[8:16]), num_new_tokens=[8])  # blocks 2, 3: never written (aborted)
    m.free("a", cache=False)
    assert all("a" not in g._t.partial for g in m._g)
    assert m.lookup_prefix(p).num_cached_tokens == 8
    m.check_invariants()
    # a burst hit on the unwritten chunk in the same step: the abort is refused, changing nothing
    assert m.allocate("b", p, num_new_tokens=4) == 8  # holds 12: block 2 written by the step below
    m.take_copy_plan()
    m.decode_step(["b"], np.asarray(p[12:20]), num_new_tokens=[8])  # blocks 3, 4: never written
    assert m.allocate("c", p, num_new_tokens=4) == 20
    assert "'c'" in refused(m, SequenceStateError, m.free, "b", cache=False)
    m.free("c", cache=False)
    m.free("b", cache=False)
    assert m.lookup_prefix(p).num_cached_tokens == 12 and len(m) == 0
    m.check_invariants()


def test_swap_and_recompute_in_the_middle_of_a_prefill():
    m = BlockManager(24, 4, kv_cache_groups=[F(), S(4)], num_cpu_blocks=24, watermark=0,
                           enable_prefix_caching=True, grouped_results=True)
    p = list(range(30))
    m.allocate("a", p, num_new_tokens=9)
    m.take_copy_plan()
    out = m.swap_out(["a"])
    assert len(out) == 6 and m.is_swapped("a")  # 3 blocks per group (the window releases only on appends)
    m.take_copy_plan()
    m.swap_in(["a"])
    m.take_copy_plan()
    chunks(m, "a", p, 10)
    m.fork("a", "b")
    m.free("a")
    m.free("b")
    m.allocate("c", p[:20] + [1] * 10, num_new_tokens=6)  # hit 20 (a's blocks) plus 6
    assert m.num_tokens("c") == 26
    m.take_copy_plan()
    m.free("c")
    assert m.allocate("c", p[:20] + [1] * 10, num_new_tokens=6) == 24  # c's own first chunk came back as a hit
    m.check_invariants()


@pytest.mark.parametrize("seed", range(12))
def test_allocate_batch_with_chunks_equals_consecutive_allocates(seed):
    rng = random.Random(seed)
    groups = [F(), S(rng.choice([3, 4, 8, 12]))] + ([F()] if rng.random() < 0.5 else [S(6)])
    ms = [BlockManager(200, 4, kv_cache_groups=groups, num_cpu_blocks=0, watermark=0,
                             enable_prefix_caching=True, grouped_results=True) for _ in range(2)]
    base = [rng.randrange(3) for _ in range(30)]
    old = base[: rng.randint(5, 30)]
    for m in ms:  # the same history: some cached blocks
        m.allocate("old", old)
        m.take_copy_plan()
        m.free("old")
    prompts = [base[: rng.randint(1, 30)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))] for _ in range(4)]
    prompts = [p for p in prompts if p]
    ks = [rng.choice([1, 2, 3, 5, 100]) for _ in prompts]
    ids = [f"s{i}" for i in range(len(prompts))]
    res = ms[0].allocate_batch(ids, prompts, num_new_tokens=ks)
    hits = [ms[1].allocate(s, p, num_new_tokens=k) for s, p, k in zip(ids, prompts, ks)]
    assert res.num_cached_tokens.tolist() == hits
    qsl = res.query_start_loc
    for i, (s, p, k) in enumerate(zip(ids, prompts, ks)):
        held = min(len(p), hits[i] + k)
        assert ms[0].num_tokens(s) == ms[1].num_tokens(s) == held == res.seq_lens[i]
        assert tables(ms[0], s) == tables(ms[1], s)
        assert res.token_ids[qsl[i] : qsl[i + 1]].tolist() == p[hits[i] : held]
        for g in range(len(groups)):
            assert res.slot_mapping[g, qsl[i] : qsl[i + 1]].tolist() == \
                ms[0].slot_mapping(s, hits[i], held, g).tolist()
    assert [dict(g._t.partial) for g in ms[0]._g] == [dict(g._t.partial) for g in ms[1]._g]
    for m in ms:
        m.check_invariants()


def test_without_prefix_caching_a_chunk_is_the_first_k_tokens():
    m = BlockManager(30, 4, kv_cache_groups=[S(4), F()], watermark=0, grouped_results=True)
    p = list(range(18))
    assert m.lookup_prefix(p, num_new_tokens=5) == (0, 0, 0, 4)
    assert m.allocate("a", p, num_new_tokens=5) == 0 and m.num_tokens("a") == 5
    pb = m.allocate_batch(["b"], [p], num_new_tokens=[6])
    assert pb.seq_lens.tolist() == [6] and pb.token_ids.tolist() == p[:6] and pb.slot_mapping.shape == (2, 6)
    m.take_copy_plan()
    refused(m, SequenceStateError, m.fork, "b", "c")
    chunks(m, "a", p, 5)
    chunks(m, "b", p, 4)
    m.fork("b", "c")
    m.check_invariants()


def test_a_chunked_batch_never_takes_more_blocks_than_it_was_admitted_for():
    """Regression (found by scripts/soak_kv.py --hybrid yes, seed 1025): in a chunked allocate_batch a later
    prompt's burst hit on the batch's earlier prompts can reach cached blocks nobody references; a chunk holds the
    hit plus k tokens, so such hits are taken, not saved, and the pool ran dry inside the commit (IndexError in
    the evictor). The prompt now keeps its admitted plan then."""
    import kv_model

    r = kv_model.run(1025, 1000, hybrid=True)
    assert r.violations == 0, r.messages[:3]
    assert r.counts.get("chunked_batch_admits", 0) > 0


def test_a_prompt_too_long_for_every_group_at_once_fits_in_chunks():
    """A sliding-window group never holds more than its window and one chunk, so with ``num_new_tokens`` a prompt
    whose blocks in every group exceed the pool is admitted (NEVER only without chunks), and appended chunk by
    chunk it completes while the sliding group releases what its window left behind."""
    from pagedkv import AllocStatus, FullAttentionSpec, BlockManager, HybridBlockManager, SlidingWindowSpec
    from pagedkv.errors import PromptTooLongError

    bm = BlockManager(16, 4, kv_cache_groups=[FullAttentionSpec(), SlidingWindowSpec(8)], watermark=0, grouped_results=True)
    prompt = list(range(40))  # 10 blocks per group: 20 > 16
    assert bm.can_allocate(prompt) is AllocStatus.NEVER
    with pytest.raises(PromptTooLongError):
        bm.allocate("a", prompt)
    assert bm.can_allocate(prompt, num_new_tokens=4) is AllocStatus.OK  # 10 + (8 - 1 + 4) / 4 + 1 = 14 <= 16
    assert bm.can_allocate(prompt, num_new_tokens=40) is AllocStatus.NEVER  # (a chunk as long as the prompt)
    assert bm.allocate("a", prompt, num_new_tokens=4) == 0
    done = 4
    while done < len(prompt):
        bm.decode_step(["a"], np.asarray(prompt[done : done + 4]).reshape(1, -1))
        done += 4
        bm.check_invariants()
    assert bm.num_tokens("a") == 40
    assert (bm.block_table("a", 0) >= 0).all()  # the full group holds every block
    assert (bm.block_table("a", 1)[:7] < 0).all()  # the window released the blocks before position 33
    assert bm.num_free_gpu_blocks >= 16 - 10 - 4
