"""The toy engine of tests/toy_engine.py (a tiny random numpy transformer written against the public API and
docs only) runs every feature of the block manager through a paged KV store; every logit it computes equals a
non-paged recomputation of the same model. Counters show that each feature was really exercised."""

from __future__ import annotations

import os
import random

import pytest

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
from toy_engine import ToyEngine, ToyModel, check_against_reference


def _workload(engine: ToyEngine, seed: int, n_requests: int, samples: tuple, namespaces: tuple) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(engine.m.V) for _ in range(rng.randrange(9, 17))] for _ in range(3)]
    for i in range(n_requests):
        stem = rng.choice(stems)
        if rng.random() < 0.3:  # a burst: the same prompt again, admitted in the same batch
            prompt = list(stem)
        else:
            prompt = stem[: rng.randrange(4, len(stem) + 1)] + [rng.randrange(engine.m.V) for _ in range(rng.randrange(0, 7))]
        engine.add(f"r{i}", prompt, n=rng.choice(samples), max_new=rng.randrange(3, 10),
                   namespace=rng.choice(namespaces))


def test_toy_engine_prefix_bursts_forks_swap_recompute_tier_namespaces():
    model = ToyModel(seed=1)
    bm = BlockManager(30, 4, num_cpu_blocks=8, enable_prefix_caching=True, cpu_prefix_cache=True, watermark=0.0)
    engine = ToyEngine(model, bm, swap=True, token_budget=48, seed=2)
    _workload(engine, 3, 40, samples=(1, 1, 2, 3), namespaces=(None, "tenant-b"))
    engine.run()
    checked = check_against_reference(engine)
    c, st = engine.counts, bm.stats
    print(c, st)
    assert checked > 500
    assert c["cached_tokens"] > 0 and c["burst_shared"] > 0  # prefix hits, some only inside a batch
    assert c["forks"] > 0 and st.cow_copies > 0
    assert c["swap_outs"] > 0 and c["swap_ins"] > 0 and c["recomputes"] > 0
    assert st.demotions > 0 and st.promotions > 0 and st.cpu_hit_blocks > 0
    assert len(bm) == 0


def test_toy_engine_speculative_lookahead_sliding_window_fixed_width():
    model = ToyModel(seed=4, window=10)
    k = 2
    bm = BlockManager(26, 4, num_cpu_blocks=16, enable_prefix_caching=True, cpu_prefix_cache=True, watermark=0.0,
                      sliding_window=10, block_table_width=-(-(16 + 6 + 9 + k) // 4))
    engine = ToyEngine(model, bm, lookahead=k, swap=True, token_budget=40, seed=5)
    # forks here share the lookahead-only blocks allocate reserved: they are copied on write at the first decode
    _workload(engine, 6, 30, samples=(1, 1, 2), namespaces=(None, 7))
    engine.run()
    checked = check_against_reference(engine)
    c, st = engine.counts, bm.stats
    print(c, st)
    assert checked > 300
    assert c["drafts_accepted"] > 0 and c["drafts_rejected"] > 0
    assert c["window_nulls"] > 0 and c["forks"] > 0 and st.cow_copies > 0
    assert c["cached_tokens"] > 0
    assert c["swap_outs"] + c["recomputes"] > 0
    assert len(bm) == 0


# ------------------------------------------------------------------------------------------------------------------
# The same engine over KV cache groups (HybridBlockManager) and over one table (BlockManager), no adapter.

def _manager(windows: tuple, bs: int, blocks_per_group: int, *, hybrid: bool, cpu_blocks: int = 0,
             cpu_tier: bool = False, cache: bool = True, width: int | None = None):
    kw = dict(num_cpu_blocks=cpu_blocks, enable_prefix_caching=cache, cpu_prefix_cache=cpu_tier, watermark=0.0,
              block_table_width=width)
    if not hybrid:
        (w,) = windows
        return BlockManager(blocks_per_group, bs, sliding_window=w, **kw)
    specs = [FullAttentionSpec() if w is None else SlidingWindowSpec(w) for w in windows]
    return BlockManager(blocks_per_group * len(windows), bs, kv_cache_groups=specs, **kw, grouped_results=True)


def _grouped_workload(engine: ToyEngine, seed: int, n_requests: int, samples=(1, 1, 2), namespaces=(None,)):
    """Prompts of 1-5 blocks from three shared stems (prefix hits, bursts), the block size's scale."""
    rng = random.Random(seed)
    bs = engine.bs
    stems = [[rng.randrange(engine.m.V) for _ in range(rng.randrange(2 * bs + 1, 4 * bs + 2))] for _ in range(3)]
    for i in range(n_requests):
        stem = rng.choice(stems)
        if rng.random() < 0.3:
            prompt = list(stem)
        else:
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(engine.m.V)
                                                               for _ in range(rng.randrange(0, bs + 3))]
        engine.add(f"r{i}", prompt, n=rng.choice(samples), max_new=rng.randrange(3, 9),
                   namespace=rng.choice(namespaces))


@pytest.mark.parametrize("windows", [(None,), (6,)], ids=["full", "window"])
def test_one_engine_drives_both_managers_to_the_same_tokens(windows):
    """The same engine code over BlockManager and over HybridBlockManager with the same one group: every logit
    equals the reference and every request generates the same tokens (generation does not depend on paging)."""
    finished = {}
    for hybrid in (False, True):
        model = ToyModel(seed=11, windows=windows)
        bm = _manager(windows, 4, 20, hybrid=hybrid, cpu_blocks=12)
        engine = ToyEngine(model, bm, lookahead=1, swap=True, token_budget=32, seed=3, chunk=5,
                           incremental=hybrid, strict_findable=True)
        _grouped_workload(engine, 21, 24)
        engine.run()
        assert check_against_reference(engine) > 300
        c = engine.counts
        assert c["chunks"] > 0 and c["swap_outs"] + c["recomputes"] > 0 and c["drafts_accepted"] > 0
        assert len(bm) == 0
        finished[hybrid] = {rid: sorted(g) for rid, g in engine.finished.items()}
    assert finished[False] == finished[True]


# (name, windows, block size, blocks per group, engine options)
GROUPED = [
    ("gemma-like", (None, 5, 5), 4, 16, dict(chunk=6, incremental=True, cpu_tier=True, p_abort=0.15)),
    ("six-groups", (None, 3, 7, None, 13, 1), 2, 26, dict(lookahead=2, incremental=False)),
    ("block-size-1", (None, 4), 1, 40, dict(chunk=3, incremental=True, lookahead=1)),
    ("block-size-16", (9, None), 16, 7, dict(chunk=20, incremental=True, lookahead=2, cpu_tier=True)),
    ("sliding-only", (4,), 4, 12, dict(chunk=4, incremental=True, p_abort=0.1)),
    ("three-bs8", (None, 8, 12), 8, 10, dict(chunk=5, p_abort=0.2, cpu_tier=True)),
]


def _run_grouped(name, windows, bs, nblocks, opts, strict):
    opts = dict(opts)
    cpu_tier = opts.pop("cpu_tier", False)
    model = ToyModel(seed=len(name), windows=windows)
    bm = _manager(windows, bs, nblocks, hybrid=True, cpu_blocks=3 * nblocks, cpu_tier=cpu_tier)
    engine = ToyEngine(model, bm, swap=True, token_budget=6 * bs, seed=len(name) + 1, strict_findable=strict,
                       **opts)
    _grouped_workload(engine, len(name) + 2, 22, samples=(1, 1, 2, 3), namespaces=(None, "t"))
    engine.run()
    return engine, bm, opts, cpu_tier


@pytest.mark.parametrize("name,windows,bs,nblocks,opts", GROUPED, ids=[g[0] for g in GROUPED])
def test_toy_engine_over_kv_cache_groups(name, windows, bs, nblocks, opts):
    engine, bm, opts, cpu_tier = _run_grouped(name, windows, bs, nblocks, opts, strict=True)
    checked = check_against_reference(engine)
    c, st = engine.counts, bm.stats
    print(name, c, st)
    assert checked > 200
    assert c["cached_tokens"] > 0 and c["forks"] > 0 and st.cow_copies > 0
    assert c["swap_outs"] + c["recomputes"] > 0
    assert c["findable_checks"] > 0
    assert c["findable_misses"] == 0, engine.findable_examples  # (six-groups, block-size-1: issue 23 A, fixed)
    if any(w is not None for w in windows):
        assert c["window_nulls"] > 0
    if opts.get("chunk"):
        assert c["chunks"] > 0
    if opts.get("incremental"):
        assert c["table_updates"] > 0 and c["table_loads"] > 0
    if opts.get("lookahead"):
        assert c["drafts_accepted"] > 0 and c["drafts_rejected"] > 0
    if opts.get("p_abort"):
        assert c["aborts_in_step"] + c["aborts"] > 0
    if cpu_tier:
        assert st.demotions > 0
    assert len(bm) == 0


SEEDS = int(os.environ.get("PAGEDKV_TOY_SEEDS", "4"))
STRICT = os.environ.get("PAGEDKV_TOY_STRICT", "") == "1"


# Random configurations whose findability check (lookup_prefix right after an allocation or a chunk finds every
# hit point whose blocks the sequence holds) failed with issue 23 A fixed, in seeds 0-59, no abort involved. Seeds 29
# and 53 were the check's own overreach: it wanted every full block, also where a sliding group's window had moved
# past the hit point (released, then evicted: test_findability.py::test_a_window_the_sequence_moved_past_is_not_promised).
# Seed 23: r7/0 held an uncached copy of a content other sequences cached first (deduplicated), and their block was
# evicted (test_findability.py::test_a_held_copy_inherits_the_content_when_the_cached_block_is_evicted: fixed).
# Seeds 78, 92 and 133 (found by PAGEDKV_TOY_SEEDS=200): a sequence holding copies was swapped out and in, and its
# blocks came back uncached and unrecorded (test_findability.py::test_a_copy_swapped_out_and_in_comes_back_as_the_
# content_it_copies). Seed 65: r11/0 was swapped out and in after its sliding group (W=3) had released block 0; its
# block 1 there, a copy, came back uncached, and a windowed row is not registered again from the root: lookup_prefix
# found 0 of 8 held tokens (test_findability.py::test_a_windowed_row_swapped_in_keeps_its_window_findable: a copy
# now carries its content through the CPU side).
_FINDABILITY_FORMER_MISSES = (23, 29, 53, 65, 78, 92, 133)


def _run_random(seed, strict):
    rng = random.Random(1000 + seed)
    G = rng.randint(1, 6)
    windows = tuple(None if rng.random() < 0.35 else rng.randint(1, 13) for _ in range(G))
    bs = rng.choice((1, 2, 3, 4, 5, 8, 16))
    hybrid = G > 1 or rng.random() < 0.5
    need = -(-(5 * bs + 16) // bs) + 1  # blocks of one sample's whole sequence, lookahead included
    nblocks = 2 * need + rng.randrange(0, 3 * need)
    cache = rng.random() < 0.85
    cpu_tier = cache and rng.random() < 0.4
    bm = _manager(windows, bs, nblocks, hybrid=hybrid, cpu_blocks=4 * nblocks * G, cpu_tier=cpu_tier, cache=cache)
    model = ToyModel(seed=seed, windows=windows)
    engine = ToyEngine(model, bm, lookahead=rng.choice((0, 0, 1, 2)), swap=rng.random() < 0.7,
                       token_budget=rng.randint(2, 8) * bs, seed=seed, chunk=rng.choice((None, 1, 3, bs + 1, 2 * bs)),
                       incremental=rng.random() < 0.5, p_abort=rng.choice((0.0, 0.1, 0.25)), strict_findable=strict)
    _grouped_workload(engine, seed, rng.randint(8, 24), samples=(1, 1, 2, 3), namespaces=(None, "t"))
    engine.run()
    print(seed, dict(G=G, windows=windows, bs=bs, hybrid=hybrid, nblocks=nblocks), engine.counts,
          engine.findable_examples)
    return engine, bm


@pytest.mark.parametrize("seed", range(SEEDS))
def test_toy_engine_random_configurations(seed):
    """A random configuration per seed: 1-6 groups (one group on either manager), windows 1-13, block sizes
    1-16, chunked prefill, incremental tables, lookahead drafts, the CPU tier, aborts, forks, both preemption
    modes. Every logit against the reference. Longer: PAGEDKV_TOY_SEEDS=200 pytest tests/test_toy_engine.py -k
    random (PAGEDKV_TOY_STRICT=1 also fails on a findability miss)."""
    engine, bm = _run_random(seed, STRICT)
    checked = check_against_reference(engine)
    assert checked > 0 and len(bm) == 0


@pytest.mark.parametrize("seed", _FINDABILITY_FORMER_MISSES)
def test_toy_engine_findability_former_misses(seed):
    """Every hit point whose blocks a sequence holds is found by lookup_prefix right after the allocate or chunk
    that filled them, in the random configurations where that failed (_FINDABILITY_FORMER_MISSES)."""
    engine, bm = _run_random(seed, strict=True)
    assert engine.counts["findable_checks"] > 30 and engine.counts["findable_misses"] == 0
    assert check_against_reference(engine) > 0 and len(bm) == 0
