"""The prefix cache's chained keys, however they are computed (one chain, several chains in one call, block by
block), equal :func:`pagedkv.block_hashes` of the sequence's tokens."""

import numpy as np

from pagedkv import BlockManager, block_hashes
from pagedkv.blocks.prefix_cache import _chain, _xxh3


def test_chain_equals_the_loop():
    rng = np.random.default_rng(0)
    datas = [rng.integers(0, 256, size=64, dtype=np.uint8).tobytes() for _ in range(40)]
    k, want = 12345, []
    for d in datas:
        k = _xxh3(d, seed=k)
        want.append(k)
    assert _chain(iter(datas), 12345) == want
    assert _chain(iter(datas[:1]), 12345) == want[:1]
    assert _chain(iter([]), 12345) == []


def _cached_keys(bm, seq, toks):
    """The keys the cache holds for the sequence's full blocks, in table order (None where not cached)."""
    c = bm._cache
    return [int(c.key[b]) if c.cid[b] else None for b in bm.block_table(seq)[: len(toks) // bm.block_size].tolist()]


def test_registered_keys_are_the_block_hashes():
    rng = np.random.default_rng(1)
    bs = 4
    bm = BlockManager(4096, bs, enable_prefix_caching=True)
    toks = {}
    for s in range(6):  # one chain per allocate (long prompts: the batch call; short: block by block)
        toks[s] = rng.integers(0, 50, size=int(rng.integers(1, 60))).tolist()
        bm.allocate(s, toks[s])
    for k in (1, 3, 9):  # decode steps of k tokens each: several chains in one call (counts > 1 when k >= bs)
        step = rng.integers(0, 50, size=(6, k))
        bm.decode_step(list(range(6)), step)
        for s in range(6):
            toks[s] += step[s].tolist()
    for s, t in toks.items():
        assert _cached_keys(bm, s, t) == block_hashes(t, bs), s
    bm.check_invariants()
