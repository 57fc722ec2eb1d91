"""Sliding window (:class:`Window`, a part of the manager): which leading blocks no future query can see, and
their release.

With a window of W tokens a query at position p sees positions (p - W, p]; before appending at position ``ntok``
every block wholly before ``ntok - W + 1`` is released (tail first) and its table position becomes NULL_BLOCK::

    table   [ -1 | -1 | 42 | 8 ]      nrel = 2 leading positions released
"""

from __future__ import annotations

import numpy as np

from ..types import NULL_BLOCK


class Window:
    """Sliding-window releases of one manager: ``window`` (tokens, or None: no window) over its tables ``t``
    (:class:`~pagedkv.manager._rows.SeqTables`), releasing through ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`).
    A KV cache group with window retention uses a subclass (:class:`pagedkv.hybrid._retention.RetainingWindow`)."""

    def __init__(self, t, blocks, window: int | None, bs: int) -> None:
        self.t, self.blocks, self.window, self.bs = t, blocks, window, bs
        self.cache, self.gpu = blocks.cache, blocks.gpu

    def plan(self, rows: np.ndarray, ntok: np.ndarray) -> tuple | None:
        """Table ranges the sliding window lets go before appending at positions ``ntok``: (rows, first, stop)
        of the rows whose leading blocks no query of the step can see any more, or None."""
        if self.window is None:
            return None
        target = np.maximum(ntok - self.window + 1, 0) // self.bs
        nrel = self.t.nrel[rows]
        rel = target > nrel
        return (rows[rel], nrel[rel], target[rel]) if rel.any() else None

    def release(self, release: tuple, changed: list | None = None) -> None:
        """Release table ranges ``[a, z)`` of rows (tail first) and mark them NULL_BLOCK. When every row lets
        one block go (the steady state of a decode batch) and the blocks are distinct, in a few numpy calls.
        ``changed``: a list that receives the (rows, cols) of the entries that held a block (for
        :class:`TableUpdates`)."""
        rows, first, stop = release
        if rows.size > 2 and not np.count_nonzero(stop - first - 1):
            blk = self.t.table[rows, first]
            held = blk >= 0
            live = blk[held]
            if np.unique(live).size == live.size:  # (forks advancing in lockstep share blocks: row by row)
                self.blocks.release(live)
                if changed is not None:
                    changed.append((rows[held], first[held]))
                self.t.table[rows, first] = NULL_BLOCK
                self.t.nrel[rows] = stop
                return
        for r, a, z in zip(*release):
            blk = self.t.table[r, a:z]
            held = blk >= 0
            self.blocks.release(blk[held][::-1].copy())
            if changed is not None:
                cols = np.flatnonzero(held) + a
                changed.append((np.full(cols.size, r, dtype=np.int64), cols))
            self.t.table[r, a:z] = NULL_BLOCK
            self.t.nrel[r] = z

    def release_small(self, rows: list, changed: list | None = None) -> None:
        """:meth:`plan` and :meth:`release` of a few rows about to append one token each, in
        plain Python (the small-batch step of KV cache groups; rows in batch order, each tail first).
        ``changed``: a list that receives the (row, col) of each entry that held a block."""
        v = self.t.mvs or self.t.views()
        ntok, table, ref, nrel = v.ntok, v.table, v.ref, v.nrel
        w, bs = self.window, self.bs
        cache, pool = self.cache, self.gpu
        cid = cache.cid_mv if cache is not None else None
        ring, size = pool.ring_mv, pool.num_blocks
        for r in rows:
            target = ntok[r] - w + 1
            if target <= 0:
                continue
            target //= bs
            a = nrel[r]
            if target <= a:
                continue
            for j in range(target - 1, a - 1, -1):
                b = table[r, j]
                if b < 0:
                    continue
                table[r, j] = -1
                if changed is not None:
                    changed.append((r, j))
                n = ref[b] - 1
                ref[b] = n
                if n == 0:
                    if cid is not None and cid[b]:
                        cache.evictor.push(b)
                    else:  # to the tail of the free ring (BlockPool.give of one block, inlined)
                        if cid is not None and cache.has_copies:
                            cache.dupc_mv[b] = 0  # (PrefixCache.forget_copies)
                        ring[(pool.head + pool.nfree) % size] = b
                        pool.nfree += 1
            nrel[r] = target

