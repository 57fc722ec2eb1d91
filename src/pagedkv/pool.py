"""One device's blocks: reference counts and the FIFO ring of plain free blocks.

Block ids are the ints ``range(num_blocks)``. Per-block state is two flat numpy arrays, 8 bytes a block:

    _ref   int32[num_blocks]   number of block tables holding the block
    _ring  int32[num_blocks]   circular FIFO of plain free block ids

::

    _ring:  [ . . . | 7 3 9 12 ... | . . . ]
                      ^ _head        ^ _head + _nfree   (mod num_blocks)
            oldest free block is taken first; released blocks join the tail

A new pool hands out 0, 1, 2, ... in order; a released block waits behind every block freed before it, so a
block that was just freed (and may still be in the prefix cache elsewhere) is reused as late as possible.
"""

from __future__ import annotations

import numpy as np

from .errors import OutOfBlocksError

__all__ = ["BlockPool"]


class BlockPool:
    """Refcounts and free ring of ``num_blocks`` blocks. Internal to pagedkv: the manager owns the policy and
    reads ``_ref`` directly on its hot path; this class keeps the ring arithmetic in one place.

    ``take`` and ``give`` are O(n) in the number of blocks moved and O(1) otherwise.
    """

    __slots__ = ("num_blocks", "_ref", "_ring", "_head", "_nfree", "_ref_mv", "_ring_mv")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        self._ring = np.arange(num_blocks, dtype=np.int32)
        self._head = 0
        self._nfree = num_blocks
        # element access for the plain-Python paths (a third of a numpy scalar access); same memory
        self._ref_mv = memoryview(self._ref)
        self._ring_mv = memoryview(self._ring)

    @property
    def num_free(self) -> int:
        """Plain free blocks (not counting cached blocks held by a prefix cache)."""
        return self._nfree

    def take(self, n: int) -> np.ndarray:
        """Remove the ``n`` oldest free blocks from the ring, set their refcount to 1 and return them (int32)."""
        if n > self._nfree:
            raise OutOfBlocksError(f"need {n} free blocks, the pool has {self._nfree}")
        size, h = self.num_blocks, self._head
        end = h + n
        if end <= size:
            ids = self._ring[h:end].copy()
        else:
            ids = np.concatenate((self._ring[h:], self._ring[: end - size]))
        self._head = end % size if size else 0
        self._nfree -= n
        self._ref[ids] = 1
        return ids

    def take_one(self) -> int:
        """:meth:`take` of one block, in plain Python (the pool is not empty)."""
        b = self._ring_mv[self._head]
        self._head = (self._head + 1) % self.num_blocks
        self._nfree -= 1
        self._ref_mv[b] = 1
        return b

    def take_few(self, n: int) -> list[int]:
        """:meth:`take` of a few blocks (``n <= num_free``), in plain Python; returns a list."""
        ring, ref, size, h = self._ring_mv, self._ref_mv, self.num_blocks, self._head
        ids = [ring[(h + i) % size] for i in range(n)]
        for b in ids:
            ref[b] = 1
        self._head = (h + n) % size
        self._nfree -= n
        return ids

    def give(self, ids: np.ndarray) -> None:
        """Append ``ids`` (blocks whose refcount is already 0) to the tail of the ring, in order."""
        n = len(ids)
        if n == 0:
            return
        size = self.num_blocks
        tail = (self._head + self._nfree) % size
        end = tail + n
        if end <= size:
            self._ring[tail:end] = ids
        else:
            cut = size - tail
            self._ring[tail:] = ids[:cut]
            self._ring[: end - size] = ids[cut:]
        self._nfree += n

    def free_ids(self) -> np.ndarray:
        """The free ring in order, oldest first (a copy; O(num_free), for invariants and tests)."""
        idx = (self._head + np.arange(self._nfree)) % max(self.num_blocks, 1)
        return self._ring[idx]
