"""Window retention for :class:`pagedkv.HybridBlockManager`: which released sliding-window blocks to keep.

A hybrid prefix hit at L blocks needs, besides the full-attention groups' blocks [0, L), each sliding group's
last window before L: blocks [L - k, L) with ``k = ceil(W / block_size)``. A sliding group releases its blocks
as the window moves (and at ``free``), so under plain LRU they leave the cache in release order, mixed with
the full groups' blocks, and hits collapse although the full-attention prefix is still cached (vLLM issues
#48435, #42948). Most of a sliding group's blocks can never serve a hit anyway: only a window that ends where a
later prompt will stop matching is useful. Those *useful points* are, per sequence::

    prompt end     P = prompt tokens // block_size   the next turn of a conversation extends the prompt: its hit
                                                     ends at P (or at P - 1 for the same prompt sent again)
    sequence end   N = tokens at free // block_size  the next turn includes this answer
    interval       every R tokens                    a cached prefix whose tail LRU already evicted, or one
                   (default 16 windows)              shared up to an arbitrary point (system prompt,
                                                     document), hits at the last multiple of R it still holds

    sliding group positions   0 ......... P-k-1 [P-k-1 ... P) ......... [N-k ... N)
                              spare             kept (window at P)      kept (window at N)

When a sliding group releases a block, the block is *kept* (stays in the LRU with the full groups' blocks) if
its position lies in the window before a useful point, else it is made *spare*
(:meth:`pagedkv.blocks.evictor.RetentionEvictor.demote_many`): spare blocks are evicted before any other block. A cached
prefix then costs its full-attention blocks plus a few windows, not every group's blocks, so the same pool
keeps many more prefixes hittable (``pagedkv replay --groups``). Nothing changes for the blocks a sequence
holds, for hits, or for a manager without prefix caching.

Cost: a release's positions are classified with a few numpy operations (O(blocks released)); nothing is added
to a step that releases nothing.
"""

from __future__ import annotations

import numpy as np

from ..manager._window import Window
from ..manager import BlockManager

__all__ = ["WindowRetention"]


class WindowRetention:
    """The retention policy of one HybridBlockManager: the useful points per row (rows are shared by every group
    manager of the coordinator) and the demotion of released blocks that no useful point needs."""

    __slots__ = ("bs", "interval", "pblk", "prio", "cache", "ref", "steer")

    def __init__(self, block_size: int, interval: int | None, cache, ref: np.ndarray) -> None:
        self.bs = block_size
        self.interval = (interval // block_size) if interval else 0  # in blocks; 0: no interval points
        self.pblk = np.zeros(8, dtype=np.int64)  # per row: prompt tokens // block_size
        self.prio = np.zeros(8, dtype=np.int64)  # per row: the retention priority (set_retention)
        self.cache = cache
        self.ref = ref
        self.steer = None  # the SteeredEvictor once installed: window releases are tagged with the row's priority

    def set_prompt(self, row: int, prompt_tokens: int) -> None:
        if row >= self.pblk.size:
            n = max(2 * self.pblk.size, row + 1)
            p = np.zeros(n, dtype=np.int64)
            p[: self.pblk.size] = self.pblk
            self.pblk = p
            q = np.zeros(n, dtype=np.int64)
            q[: self.prio.size] = self.prio
            self.prio = q
        self.pblk[row] = prompt_tokens // self.bs
        self.prio[row] = 0

    def set_priority(self, row: int, priority: int) -> None:
        self.prio[row] = priority

    def copy_row(self, src: int, dst: int) -> None:
        self.set_prompt(dst, 0)
        self.pblk[dst] = self.pblk[src]
        self.prio[dst] = self.prio[src]

    def tag(self, rows, blocks: np.ndarray) -> None:
        """Tag window-released ``blocks`` (of ``rows``: one row, or one per block) with their rows' priority."""
        held = blocks >= 0
        self.steer.tag(blocks[held], self.prio[rows] if np.ndim(rows) == 0 else self.prio[rows][held])

    def kept(self, row: int, pos: np.ndarray, k: int, end_blk: int = -1) -> np.ndarray:
        """Which table positions ``pos`` of ``row`` lie in a window before a useful point (``k``: the group's
        window in blocks; ``end_blk``: the sequence end at free, -1 during a step)."""
        p = int(self.pblk[row]) if row < self.pblk.size else 0
        keep = (pos >= p - k - 1) & (pos < p)
        if end_blk >= 0:
            keep |= pos >= end_blk - k
        r = self.interval
        if r:
            keep |= (pos % r) >= r - k
        return keep

    def kept_rows(self, rows: np.ndarray, pos: np.ndarray, k: int) -> np.ndarray:
        """:meth:`kept` of one position per entry of ``rows`` (during a step), vectorised."""
        p = self.pblk[rows]
        keep = (pos >= p - k - 1) & (pos < p)
        r = self.interval
        if r:
            keep |= (pos % r) >= r - k
        return keep

    def demote(self, blocks: np.ndarray, keep: np.ndarray) -> None:
        """Make spare the released ``blocks`` (in release order) not ``keep``-marked that are now unreferenced and
        cached (the others are ignored)."""
        b = blocks[~keep]
        if b.size:
            b = b[(b >= 0)]
            b = b[(self.ref[b] == 0) & (self.cache.cid[b] != 0)]
            if b.size > 1:  # forks release a shared block once per holder: each block once, first release first
                _, first = np.unique(b, return_index=True)
                if first.size < b.size:
                    b = b[np.sort(first)]
            if b.size:
                self.cache.evictor.demote_many(b)


class RetainingWindow(Window):
    """The sliding-window part of a group with window retention: its releases go through the retention policy
    (``retention``, and ``k``: the group's window in blocks; both set by the coordinator)."""

    retention: WindowRetention | None = None
    k = 0

    def release(self, release: tuple, changed: list | None = None) -> None:
        ret = self.retention
        if ret is None:
            super().release(release, changed)
            return
        rows, first, stop = release
        if not np.count_nonzero(stop - first - 1):  # one block a row (a decode batch's steady state)
            rr, pos = rows, first
        else:
            rr = np.repeat(rows, stop - first)
            pos = np.concatenate([np.arange(a, z) for a, z in zip(first.tolist(), stop.tolist())])
        blk = self.t.table[rr, pos]  # (a copy: fancy indexing)
        if ret.steer is not None:
            ret.tag(rr, blk)
        super().release(release, changed)
        ret.demote(blk, ret.kept_rows(rr, pos, self.k))

    def release_small(self, rows: list, changed: list | None = None) -> None:
        ret = self.retention
        if ret is None:
            super().release_small(rows, changed)
            return
        t, w, bs = self.t, self.window, self.bs
        parts = []
        for r in rows:
            target = int(t.ntok[r]) - w + 1
            if target > 0:
                target //= bs
                a = int(t.nrel[r])
                if target > a:
                    parts.append((r, t.table[r, a:target].copy(), np.arange(a, target)))
        if ret.steer is not None:
            for r, blk, _ in parts:
                ret.tag(r, blk)
        super().release_small(rows, changed)
        for r, blk, pos in parts:
            ret.demote(blk, ret.kept(r, pos, self.k))


class _SlidingGroup(BlockManager):
    """A sliding-window group's manager whose window part is a :class:`RetainingWindow` (internal; built with
    ``BlockManager._sharing``, then its window part's ``retention`` and ``k`` are set)."""

    _Window = RetainingWindow
