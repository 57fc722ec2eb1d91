"""The default eviction policy (LRU) and window retention's two-class evictor over a policy."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .policy import EvictionPolicy

__all__ = ["LRUEvictor", "RetentionEvictor"]


class LRUEvictor(EvictionPolicy, name="lru"):
    """Unreferenced cached blocks, least recently released first: the default policy, :class:`EvictionPolicy`
    with no hook (one segment, key 0: eviction in push order). O(1) push, discard and pop of one block
    (memoryview writes, a pop skips the stale entries before the oldest live one), batch forms a few numpy calls
    whatever their size; 8 bytes of ``stamp`` per block plus its push log (compacted when full, O(1) amortised)::

        log   [ 7@3  2@4  9@5  2@6  4@7 | . . . ]      stamp[2] = 6, stamp[7] = 0 (discarded), stamp[9] = 5
               ^head  ^stale (2 pushed again)  ^tail   LRU order: 9, 2, 4

    ``stamp`` (int64 per block, 0: not in the evictor) and ``stamp_mv`` are public: the CPU tier and
    RetentionEvictor test membership of many blocks at once with them (read only)."""

    __slots__ = ()


class RetentionEvictor:
    """Two LRU classes of unreferenced cached blocks: *spare* ones, evicted first, and the others (``main``),
    evicted once no spare one is left; within each class least recently released first. The eviction-policy
    hook of :class:`pagedkv.HybridBlockManager`'s window retention (:mod:`pagedkv.hybrid._retention`): a sliding-window
    group's blocks that no likely hit point needs are made spare, so the full-attention blocks and the
    window-sized runs at request boundaries stay cached longer than plain LRU would keep them.

    The methods of :class:`LRUEvictor` (a push goes to ``main``), plus :meth:`demote_many`. O(1) per block as
    LRUEvictor; ``discard`` looks up the block's class in O(1). ``main``: the evictor of the other blocks, an
    eviction policy's (:mod:`pagedkv.retention.eviction`; default LRU), which then orders them and takes the
    session hints; the spare blocks are always LRU.
    """

    __slots__ = ("main", "spare")

    def __init__(self, num_blocks: int, main=None) -> None:
        self.main = main if main is not None else LRUEvictor(num_blocks)
        self.spare = LRUEvictor(num_blocks)

    def __len__(self) -> int:
        return len(self.main) + len(self.spare)

    def __contains__(self, block: int) -> bool:
        return block in self.main or block in self.spare

    def hint(self, blocks: np.ndarray, session: object) -> None:
        """The main evictor's session hint (:mod:`pagedkv.retention.eviction`)."""
        self.main.hint(blocks, session)

    def push(self, block: int) -> None:
        self.main.push(block)

    def push_many(self, blocks: np.ndarray) -> None:
        self.main.push_many(blocks)

    def demote_many(self, blocks: np.ndarray) -> None:
        """Move ``blocks`` (distinct, in order) to the most recent end of the spare class; blocks that are not in
        the main class (referenced, evicted, spare already) are ignored."""
        if blocks.size == 0:
            return
        live = blocks[self.main.stamp[blocks] != 0]
        if live.size:
            self.main.discard_many(live)
            self.spare.push_many(live)

    def discard(self, block: int) -> None:
        if self.spare.stamp_mv[block]:
            self.spare.discard(block)
        else:
            self.main.discard(block)

    def discard_many(self, blocks: np.ndarray) -> None:
        if not len(self.spare):
            self.main.discard_many(blocks)
            return
        sp = self.spare.stamp[blocks] != 0
        self.spare.discard_many(blocks[sp])
        self.main.discard_many(blocks[~sp])

    def pop(self) -> int:
        return self.spare.pop() if len(self.spare) else self.main.pop()

    def pop_many(self, n: int) -> np.ndarray:
        k = min(n, len(self.spare))
        if k == n:
            return self.spare.pop_many(n)
        if k == 0:
            return self.main.pop_many(n)
        return np.concatenate((self.spare.pop_many(k), self.main.pop_many(n - k)))

    def verify(self) -> None:
        """Assert both classes' bookkeeping and that they are disjoint (tests). O(entries)."""
        self.main.verify()
        self.spare.verify()
        assert not ((self.main.stamp != 0) & (self.spare.stamp != 0)).any(), "a block is both spare and main"

    def __iter__(self) -> Iterator[int]:
        """Blocks in eviction order: the spare ones, then the others (each least recently used first)."""
        yield from self.spare
        yield from self.main
