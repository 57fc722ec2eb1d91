"""Dict-less runs (prefix_cache "Runs"): a manager whose prompt registrations leave all but each chain's first block
out of the map behaves exactly like one that maps every block (runs turned off), call for call: the same hits,
tables, evictions, stats and cached contents, with ``check_invariants()`` after every call."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.errors import PagedKVError
from pagedkv.blocks.prefix_cache import PrefixCache


class _NoRuns(PrefixCache):
    __slots__ = ()

    def register_run(self, *args, **kwargs):  # every prompt registers through register_chains
        return None


def _no_runs(bm: BlockManager) -> BlockManager:
    bm._cache.__class__ = _NoRuns
    return bm


def _state(bm: BlockManager) -> tuple:
    c = bm._cache
    return (sorted(c.mapping().items()), c.cid.tolist(), c.pcid.tolist(), list(c.evictor), c.evictions,
            tuple(bm.stats), bm._t.table.tolist(), bm.num_free_gpu_blocks)


def _prompt(rng: random.Random, bases: list, bs: int) -> list[int]:
    """A prompt sharing a random prefix with an earlier one (often), then new tokens."""
    n = rng.randint(1, 12 * bs)
    if bases and rng.random() < 0.7:
        base = rng.choice(bases)
        cut = rng.randint(0, len(base))
        p = base[:cut] + [rng.randrange(50_000) for _ in range(max(0, n - cut))]
    else:
        p = [rng.randrange(50_000) for _ in range(n)]
    bases.append(p)
    return p


@pytest.mark.parametrize("seed", range(6))
def test_runs_change_nothing(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    blocks = rng.choice([12, 24, 48])
    kw = dict(block_size=bs, enable_prefix_caching=True, watermark=0.0)
    a, b = BlockManager(blocks, **kw), _no_runs(BlockManager(blocks, **kw))
    live: list = []
    bases: list = []
    made_runs = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not live:
            sid, p = step, _prompt(rng, bases, bs)
            ns = rng.choice([None, None, "t"])
            got = []
            for m in (a, b):
                try:
                    got.append(m.allocate(sid, p, namespace=ns))
                except PagedKVError as e:
                    got.append(type(e))
            assert got[0] == got[1]
            if isinstance(got[0], int):
                live.append(sid)
        elif op < 0.75:
            sid = live.pop(rng.randrange(len(live)))
            cache = rng.random() < 0.85
            got = []
            for m in (a, b):
                try:
                    got.append(m.free(sid, cache=cache))
                except PagedKVError as e:  # (cache=False under a same-step hit: refused, nothing changed)
                    got.append(type(e))
            assert got[0] == got[1]
            if got[0] is not None:
                live.append(sid)
        elif op < 0.85:
            sid = rng.choice(live)
            toks = [rng.randrange(50_000) for _ in range(rng.randint(1, 2 * bs))]
            got = []
            for m in (a, b):
                try:
                    r = m.decode_step([sid], toks, num_new_tokens=[len(toks)])
                    got.append((r.slot_mapping.tolist(), r.block_tables.tolist()))
                except PagedKVError as e:
                    got.append(type(e))
            assert got[0] == got[1]
        elif op < 0.92:
            p = _prompt(rng, bases, bs)
            assert a.lookup_prefix(p) == b.lookup_prefix(p)
        else:
            ids = [(step, k) for k in range(rng.randint(1, 3))]
            ps = [_prompt(rng, bases, bs) for _ in ids]
            got = []
            for m in (a, b):
                try:
                    got.append(m.allocate_batch(ids, ps).num_cached_tokens.tolist())
                except PagedKVError as e:
                    got.append(type(e))
            assert got[0] == got[1]
            if isinstance(got[0], list):
                live.extend(ids)
        made_runs += a._cache.ndl > 0
        a.check_invariants()
        b.check_invariants()
        assert _state(a) == _state(b)
        assert b._cache.ndl == 0
    assert made_runs  # the comparison did exercise dict-less blocks


def test_run_successor_rejoins_the_map_when_its_predecessor_is_evicted():
    """A run's block whose predecessor leaves first (released head first: an eviction order the manager's tail-
    first release never makes, kept safe all the same) enters the map then, and the run's rest stays reachable."""
    from pagedkv.blocks.prefix_cache import _chain

    c = PrefixCache(8, 2)
    c.tok[:4] = np.arange(8, dtype=np.int32).reshape(4, 2)
    rcid, rkey = c.root(None)
    keys = _chain(c.tok[:4].view(c.void).ravel().tolist(), rkey)
    got = c.register_run(np.arange(4, dtype=np.int32), list(keys), rcid, rkey, -1)
    assert got is not None and int(got[1][0]) == keys[-1]
    assert c.ndl == 3 and list(c.map.items()) == [(keys[0], 0)] and len(c) == 4
    assert c.mapping() == dict(zip(keys, range(4)))
    c.evictor.push_many(np.array([0, 3, 2, 1], dtype=np.int32))  # the head least recently released
    assert c.evict_many(1).tolist() == [0]
    assert c.ndl == 2 and c.map == {keys[1]: 1} and c.mapping() == dict(zip(keys[1:], range(1, 4)))
    assert c.evict() == 3  # a dict-less tail block: nothing to delete from the map
    assert c.ndl == 1 and c.mapping() == {keys[1]: 1, keys[2]: 2}
    assert c.evict_many(2).tolist() == [2, 1]
    assert c.ndl == 0 and c.map == {} and len(c) == 0 and not c.cid.any()


def test_flush_is_invisible():
    bm = BlockManager(64, block_size=4, enable_prefix_caching=True, watermark=0.0)
    rng = np.random.default_rng(0)
    for i in range(20):
        bm.allocate(i, rng.integers(0, 100, 40).tolist() if i % 3 else list(range(40 + i)))
        bm.free(i)
    before = sorted(bm._cache.mapping().items())
    assert bm._cache.ndl
    bm._cache.flush()
    assert bm._cache.ndl == 0 and sorted(bm._cache.map.items()) == before
    bm.check_invariants()
