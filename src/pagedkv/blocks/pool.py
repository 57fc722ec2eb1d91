"""The blocks of one manager: each device's :class:`BlockPool` (reference counts and the FIFO ring of plain free
blocks) and :class:`Blocks`, taking and releasing blocks over the pools and the prefix cache's evictor.

Block ids are the ints ``range(num_blocks)``. Per-block state is two flat numpy arrays, 8 bytes a block:

    ref   int32[num_blocks]   number of block tables holding the block
    ring  int32[num_blocks]   circular FIFO of plain free block ids

::

    ring:  [ . . . | 7 3 9 12 ... | . . . ]
                     ^ head        ^ head + nfree   (mod num_blocks)
            oldest free block is taken first; released blocks join the tail

A new pool hands out 0, 1, 2, ... in order; a released block waits behind every block freed before it, so a
block that was just freed (and may still be in the prefix cache elsewhere) is reused as late as possible.

:class:`Blocks` (the GPU and CPU pools of one manager, shared by the KV cache groups of a hybrid one) is the
block-level half of vLLM V1's block pool::

    take(n)      free ring first (oldest free first), then evict the least recently used cached blocks
    release(bs)  refcount - 1; a block reaching 0 goes to the evictor if cached, else to the free ring's tail

It depends on the pools and the prefix cache only; every other part takes and releases GPU blocks through it.
"""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError

__all__ = ["BlockPool", "Blocks"]


class BlockPool:
    """Refcounts and free ring of ``num_blocks`` blocks. Internal to pagedkv: the manager's parts own the policy;
    this class keeps the ring arithmetic in one place.

    **Shared state** (public attributes, read and written by the manager's parts on their hot paths, never
    rebound): ``ref`` (int32 refcounts; the parts change a block's count as tables take and drop it) and
    ``ref_mv`` (its memoryview, for plain-Python element access: a third of a numpy scalar access); ``ring``
    (int32 free ring) and ``ring_mv``; ``head`` (ring index of the oldest free block) and ``nfree`` (plain free
    blocks). Only :meth:`take` / :meth:`take_one` / :meth:`take_few` move ``head``; a release appends at
    ``(head + nfree) % num_blocks`` and increments ``nfree`` (:meth:`give`, or inlined for one block by the
    plain-Python releases of ``pagedkv.manager._small`` and ``pagedkv.manager._window``), only for blocks whose ``ref`` is 0.

    ``take`` and ``give`` are O(n) in the number of blocks moved and O(1) otherwise.
    """

    __slots__ = ("num_blocks", "ref", "ring", "head", "nfree", "ref_mv", "ring_mv")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.ring = np.arange(num_blocks, dtype=np.int32)
        self.head = 0
        self.nfree = num_blocks
        # element access for the plain-Python paths (a third of a numpy scalar access); same memory
        self.ref_mv = memoryview(self.ref)
        self.ring_mv = memoryview(self.ring)

    @property
    def num_free(self) -> int:
        """Plain free blocks (not counting cached blocks held by a prefix cache)."""
        return self.nfree

    def take(self, n: int) -> np.ndarray:
        """Remove the ``n`` oldest free blocks from the ring, set their refcount to 1 and return them (int32)."""
        if n > self.nfree:
            raise OutOfBlocksError(f"need {n} free blocks, the pool has {self.nfree}")
        size, h = self.num_blocks, self.head
        end = h + n
        if end <= size:
            ids = self.ring[h:end].copy()
        else:
            ids = np.concatenate((self.ring[h:], self.ring[: end - size]))
        self.head = end % size if size else 0
        self.nfree -= n
        self.ref[ids] = 1
        return ids

    def take_one(self) -> int:
        """:meth:`take` of one block, in plain Python (the pool is not empty)."""
        b = self.ring_mv[self.head]
        self.head = (self.head + 1) % self.num_blocks
        self.nfree -= 1
        self.ref_mv[b] = 1
        return b

    def take_few(self, n: int) -> list[int]:
        """:meth:`take` of a few blocks (``n <= num_free``), in plain Python; returns a list."""
        ring, ref, size, h = self.ring_mv, self.ref_mv, self.num_blocks, self.head
        ids = [ring[(h + i) % size] for i in range(n)]
        for b in ids:
            ref[b] = 1
        self.head = (h + n) % size
        self.nfree -= n
        return ids

    def give(self, ids: np.ndarray) -> None:
        """Append ``ids`` (blocks whose refcount is already 0) to the tail of the ring, in order."""
        n = len(ids)
        if n == 0:
            return
        size = self.num_blocks
        tail = (self.head + self.nfree) % size
        end = tail + n
        if end <= size:
            self.ring[tail:end] = ids
        else:
            cut = size - tail
            self.ring[tail:] = ids[:cut]
            self.ring[: end - size] = ids[cut:]
        self.nfree += n

    def free_ids(self) -> np.ndarray:
        """The free ring in order, oldest first (a copy; O(num_free), for invariants and tests)."""
        idx = (self.head + np.arange(self.nfree)) % max(self.num_blocks, 1)
        return self.ring[idx]


class Blocks:
    """Block-level operations over ``gpu`` / ``cpu`` (:class:`BlockPool`), ``cache``
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
