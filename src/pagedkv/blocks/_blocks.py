"""The GPU and CPU blocks of one manager (shared by the KV cache groups of a hybrid one): :class:`Blocks`.

Taking and releasing blocks over the pools (:mod:`pagedkv.blocks.pool`) and the prefix cache's LRU evictor
(:mod:`pagedkv.blocks.prefix_cache`), the block-level half of vLLM V1's block pool::

    take(n)      free ring first (oldest free first), then evict the least recently used cached blocks
    release(bs)  refcount - 1; a block reaching 0 goes to the evictor if cached, else to the free ring's tail

Depends on the pools and the prefix cache only; every other part takes and releases GPU blocks through it.
"""

from __future__ import annotations

import numpy as np


class Blocks:
    """Block-level operations over ``gpu`` / ``cpu`` (:class:`pagedkv.blocks.pool.BlockPool`), ``cache``
    (:class:`pagedkv.blocks.prefix_cache.PrefixCache` or None) and ``cpu_id`` (the CPU blocks' cache identities, or
    None without prefix caching). O(1) per block unless stated."""

    __slots__ = ("gpu", "cpu", "cache", "cpu_id", "tier")

    def __init__(self, gpu, cpu, cache, cpu_id, tier) -> None:
        self.gpu, self.cpu, self.cache, self.cpu_id, self.tier = gpu, cpu, cache, cpu_id, tier
        if cache is not None:
            cache.pool = gpu

    @property
    def num_free(self) -> int:
        """Plain free GPU blocks plus unreferenced cached ones (which are evicted on demand)."""
        return self.gpu.nfree + (len(self.cache.evictor) if self.cache is not None else 0)

    @property
    def num_free_cpu(self) -> int:
        """Plain free CPU blocks plus the CPU tier's evictable cached ones (swap evicts them on demand)."""
        return self.cpu.nfree + (self.tier.num_evictable if self.tier is not None else 0)

    def take(self, n: int) -> np.ndarray:
        """``n`` GPU blocks with refcount 1 (int32): from the free ring first, then by evicting LRU cached
        blocks (the caller checked that they exist)."""
        pool = self.gpu
        if n <= 4:  # a few blocks: element by element beats numpy's fixed costs
            if n <= pool.nfree:
                return np.array(pool.take_few(n), dtype=np.int32)
            take = self.take_one
            return np.array([take() for _ in range(n)], dtype=np.int32)
        k = min(n, pool.nfree)
        if k == n:
            return pool.take(k)
        extra = self.cache.evict_many(n - k)
        pool.ref[extra] = 1
        return np.concatenate((pool.take(k), extra)) if k else extra

    def take_one(self) -> int:
        """One GPU block with refcount 1: the oldest free block, else the LRU cached one (evicted)."""
        pool = self.gpu
        if pool.nfree:
            return pool.take_one()
        b = self.cache.evict()
        pool.ref[b] = 1
        return b

    def release(self, blocks: np.ndarray) -> None:
        """Drop one reference to each of ``blocks`` (distinct, in release order); blocks reaching zero go to the
        evictor if cached, else to the tail of the free ring."""
        if blocks.size == 0:
            return
        ref = self.gpu.ref
        ref[blocks] -= 1
        self.park(blocks[ref[blocks] == 0])

    def park(self, zero: np.ndarray) -> None:
        """Put unreferenced blocks (in release order) where they belong: cached ones at the MRU end of the
        evictor, the others at the tail of the free ring."""
        if self.cache is None:
            self.gpu.give(zero)
            return
        cached = self.cache.cid[zero] != 0
        self.cache.evictor.push_many(zero[cached])
        loose = zero[~cached]
        if self.cache.has_copies:
            self.cache.forget_copies(loose)
        self.gpu.give(loose)

    def release_cpu(self, blocks: np.ndarray) -> None:
        """Drop one reference to each of the CPU ``blocks`` (distinct); freed ones lose their cache identity."""
        if blocks.size == 0:
            return
        ref = self.cpu.ref
        ref[blocks] -= 1
        zero = blocks[ref[blocks] == 0]
        if self.cpu_id is not None:
            self.cpu_id[0, zero] = 0
        self.cpu.give(zero)
