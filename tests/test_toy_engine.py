"""The toy engine of tests/toy_engine.py (a tiny random numpy transformer written against the public API and
docs only) runs every feature of the block manager through a paged KV store; every logit it computes equals a
non-paged recomputation of the same model. Counters show that each feature was really exercised."""

from __future__ import annotations

import random

from pagedkv import BlockManager
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
