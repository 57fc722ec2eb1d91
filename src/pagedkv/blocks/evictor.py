"""The eviction order of the prefix cache's unreferenced cached blocks (one policy per class, this one LRU)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["LRUEvictor", "RetentionEvictor"]


class LRUEvictor:
    """Unreferenced cached blocks, least recently released first: O(1) push, discard and pop, and batch forms
    that cost a few numpy calls whatever their size.

    A log of pushes in two flat arrays (block id, stamp) plus each block's current stamp (0: not in the list).
    A push appends ``(block, stamp)``; a discard zeroes the block's stamp, which makes its log entry stale; a pop
    takes the oldest entry whose stamp is still current. The live entries, oldest first, are exactly the LRU
    order. When the log is full it is compacted (live entries moved to the front, stamps renumbered): the log
    holds 1.25 x num_blocks + 64 entries, so a compaction comes at most every num_blocks / 4 + 64 pushes and costs
    O(num_blocks) numpy work, O(1) amortised::

        log   [ 7@3  2@4  9@5  2@6  4@7 | . . . ]      stamp[2] = 6, stamp[7] = 0 (discarded), stamp[9] = 5
               ^head  ^stale (2 pushed again)  ^tail   LRU order: 9, 2, 4

    14 bytes a block (the previous design, a doubly linked list in two arrays, cost 8 but popped and pushed one
    block per Python call). This is the eviction-policy hook: another policy is another class with these methods.
    """

    # ``stamp`` (int32 per block, 0: not in the evictor) and ``stamp_mv`` (its memoryview) are public: the CPU tier
    # and RetentionEvictor test membership of many blocks at once with them (read only)
    __slots__ = ("stamp", "_lb", "_ls", "_head", "_tail", "_next", "_len", "stamp_mv", "_lb_mv", "_ls_mv")

    def __init__(self, num_blocks: int) -> None:
        cap = num_blocks + num_blocks // 4 + 64
        self.stamp = np.zeros(num_blocks, dtype=np.int32)
        self._lb = np.zeros(cap, dtype=np.int32)
        self._ls = np.zeros(cap, dtype=np.int32)
        self.stamp_mv, self._lb_mv, self._ls_mv = memoryview(self.stamp), memoryview(self._lb), memoryview(self._ls)
        self._head = self._tail = 0
        self._next = 1  # next stamp
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self.stamp_mv[block] != 0

    def hint(self, blocks: np.ndarray, session: object) -> None:
        """The policy hook for a session hint (:mod:`pagedkv.retention.eviction`): LRU takes none."""

    def push(self, block: int) -> None:
        """Make ``block`` (not in the list) the most recently used."""
        if self._tail == len(self._lb):
            self._compact()
        t = self._next
        self._next = t + 1
        self.stamp_mv[block] = t
        self._lb_mv[self._tail] = block
        self._ls_mv[self._tail] = t
        self._tail += 1
        self._len += 1

    def push_many(self, blocks: np.ndarray) -> None:
        """:meth:`push` of each of ``blocks`` (distinct, not in the list), in order."""
        n = blocks.size
        if n == 0:
            return
        if self._tail + n > len(self._lb):
            self._compact()
        t, z = self._next, self._tail
        st = np.arange(t, t + n, dtype=np.int32)
        self.stamp[blocks] = st
        self._lb[z : z + n] = blocks
        self._ls[z : z + n] = st
        self._next, self._tail, self._len = t + n, z + n, self._len + n

    def discard(self, block: int) -> None:
        """Remove ``block`` (it is in the list)."""
        self.stamp_mv[block] = 0
        self._len -= 1

    def discard_many(self, blocks: np.ndarray) -> None:
        """:meth:`discard` of each of ``blocks`` (distinct, in the list)."""
        self.stamp[blocks] = 0
        self._len -= blocks.size

    def pop(self) -> int:
        """Remove and return the least recently used block (the list is not empty)."""
        lb, ls, st = self._lb_mv, self._ls_mv, self.stamp_mv
        h = self._head
        while True:
            b = lb[h]
            if st[b] == ls[h]:
                break
            h += 1
        self._head = h + 1
        st[b] = 0
        self._len -= 1
        return b

    def pop_many(self, n: int) -> np.ndarray:
        """Remove and return the ``n`` least recently used blocks, LRU first (int32; ``n <= len(self)``)."""
        if n <= 2:
            return np.array([self.pop() for _ in range(n)], dtype=np.int32)
        out = []
        h, tail = self._head, self._tail
        while n:
            z = min(tail, h + max(2 * n, 64))
            lb = self._lb[h:z]
            live = np.flatnonzero(self.stamp[lb] == self._ls[h:z])
            if live.size >= n:
                out.append(lb[live[:n]])
                h += int(live[n - 1]) + 1
                break
            out.append(lb[live])
            n -= live.size
            h = z
        got = out[0] if len(out) == 1 else np.concatenate(out)
        self._head = h
        self.stamp[got] = 0
        self._len -= got.size
        return got

    def _compact(self) -> None:
        """Move the live entries to the front of the log and renumber their stamps 1..len."""
        h, z = self._head, self._tail
        lb = self._lb[h:z]
        keep = lb[self.stamp[lb] == self._ls[h:z]]
        k = keep.size
        st = np.arange(1, k + 1, dtype=np.int32)
        self._lb[:k] = keep
        self._ls[:k] = st
        self.stamp[keep] = st
        self._head, self._tail, self._next = 0, k, k + 1

    def head(self, n: int) -> list:
        """The first ``n`` blocks from the least recently used on (fewer if the evictor holds fewer), without
        changing anything. O(n + stale entries passed) numpy work in chunks."""
        out: list = []
        h, z = self._head, self._tail
        step = max(64, 2 * n)
        while h < z and len(out) < n:
            e = min(z, h + step)
            lb = self._lb[h:e]
            out.extend(lb[self.stamp[lb] == self._ls[h:e]][: n - len(out)].tolist())
            h = e
        return out

    def __iter__(self) -> Iterator[int]:
        """Blocks from least to most recently used."""
        h, z = self._head, self._tail
        lb = self._lb[h:z]
        return iter(lb[self.stamp[lb] == self._ls[h:z]].tolist())


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
        main = self.main
        if type(main) is LRUEvictor:
            live = blocks[main.stamp[blocks] != 0]
        else:  # (another policy: membership block by block)
            live = blocks[np.fromiter((b in main for b in blocks.tolist()), dtype=np.bool_, count=blocks.size)]
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

    def __iter__(self) -> Iterator[int]:
        """Blocks in eviction order: the spare ones, then the others (each least recently used first)."""
        yield from self.spare
        yield from self.main
