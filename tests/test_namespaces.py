"""Bounded state per tenant: prefix-cache namespaces (``cache_salt``) are released when nothing uses them.

A namespace is *used* while a live sequence belongs to it or a cached block (GPU, CPU tier, swapped) chains from
its root. 100k distinct namespaces through a small pool leave the registry, and the process's traced memory,
flat; a namespace still in use keeps its cache hits, and a released one that comes back starts cold, isolated.
"""

from __future__ import annotations

import gc
import sys

import numpy as np

from pagedkv import BlockManager

BS = 4


def _roundtrip(bm: BlockManager, i: int, ns: object) -> int:
    """Allocate a 3-block prompt in ``ns``, write it, free it (its full blocks stay cached); the hit tokens."""
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    hit = bm.allocate(("s", i), prompt, namespace=ns)
    bm.free(("s", i))
    return hit


def test_100k_distinct_namespaces_leave_memory_flat():
    """Registry sizes, their bytes and the count of live Python objects after 20k and after 100k tenants."""
    bm = BlockManager(64, BS, num_cpu_blocks=16, enable_prefix_caching=True, cpu_prefix_cache=True,
                      enable_kv_events=True)
    cache = bm._cache

    def footprint() -> tuple:
        bm.events.take()  # (a server's publisher drains them every step)
        gc.collect()
        regs = (cache.roots, cache._ns_ids, cache.ns_list, cache._ns_free)
        return max(len(r) for r in regs), sum(sys.getsizeof(r) for r in regs), len(gc.get_objects())

    seen = []
    for i in range(100_000):
        _roundtrip(bm, i, f"tenant-{i}")
        if i % 5000 == 0:
            bm.events.take()
        if i in (20_000 - 1, 100_000 - 1):
            seen.append(footprint())
    (n20, bytes20, objs20), (n100, bytes100, objs100) = seen
    # the registry holds about twice what is in use (64 GPU + 16 CPU blocks here), at least 1024: never 100k
    assert n20 <= 2 * 1024 + 1 and n100 <= 2 * 1024 + 1, seen
    assert bytes100 <= 2 * bytes20, seen
    assert objs100 < objs20 + 5000, seen  # 80k more tenants, no more live objects (beyond noise)
    bm.check_invariants()


def test_namespaces_in_use_keep_their_hits_and_released_ones_come_back_cold():
    bm = BlockManager(4096, BS, enable_prefix_caching=True, enable_kv_events=True)
    cache = bm._cache
    assert _roundtrip(bm, -1, "kept") == 0
    bm.allocate("live", [1, 2, 3, 4, 5, 6, 7, 8, 9], namespace="running")  # a live sequence, nothing cached
    for i in range(1500):  # enough new namespaces for a sweep; the pool is large: "kept" stays cached
        _roundtrip(bm, i, f"t{i}")
    assert _roundtrip(bm, -2, "kept") == 8  # still hits: its blocks are cached under the same root
    assert b"s:running" in cache.roots  # a live sequence's namespace is never released
    bm.free("live")
    # reset: every namespace becomes unused; the next sweep releases them; a released one comes back cold
    bm.reset_prefix_cache()
    bm.events.take()
    for i in range(1500, 3000):
        _roundtrip(bm, i, f"t{i}")
    assert b"s:t0" not in cache.roots
    assert _roundtrip(bm, -3, "t0") == 0  # cold again
    assert _roundtrip(bm, -4, "t0") == 8 and _roundtrip(bm, -5, "t1") == 0  # isolated as before
    stored = [e for e in bm.events.take() if type(e).__name__ == "BlockStored"]
    assert stored and stored[-1].namespace == "t1"  # events still name the namespace (a reused slot)
    bm.check_invariants()
    # root content ids are never reused: every root in the registry has its own
    cids = [r[0] for r in cache.roots.values()]
    assert len(set(cids)) == len(cids) and all(c < 0 for c in cids)
    assert np.all(cache.pcid[cache.cid != 0] != 0)
