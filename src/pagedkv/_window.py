"""Sliding window: which leading blocks no future query can see, and their release.

With a window of W tokens a query at position p sees positions (p - W, p]; before appending at position ``ntok``
every block wholly before ``ntok - W + 1`` is released (tail first) and its table position becomes NULL_BLOCK::

    table   [ -1 | -1 | 42 | 8 ]      _nrel = 2 leading positions released
"""

from __future__ import annotations

import numpy as np

from .types import NULL_BLOCK


class _Window:
    """Mixin of :class:`pagedkv.BlockManager`: sliding-window releases."""

    def _window_release(self, rows: np.ndarray, ntok: np.ndarray) -> tuple | None:
        """Table ranges the sliding window lets go before appending at positions ``ntok``: (rows, first, stop)
        of the rows whose leading blocks no query of the step can see any more, or None."""
        if self._window is None:
            return None
        target = np.maximum(ntok - self._window + 1, 0) // self._bs
        nrel = self._nrel[rows]
        rel = target > nrel
        return (rows[rel], nrel[rel], target[rel]) if rel.any() else None

    def _release_window(self, release: tuple, changed: list | None = None) -> None:
        """Release table ranges ``[a, z)`` of rows (tail first) and mark them NULL_BLOCK. When every row lets
        one block go (the steady state of a decode batch) and the blocks are distinct, in a few numpy calls.
        ``changed``: a list that receives the (rows, cols) of the entries that held a block (for
        :class:`TableUpdates`)."""
        rows, first, stop = release
        if rows.size > 2 and not np.count_nonzero(stop - first - 1):
            blk = self._table[rows, first]
            held = blk >= 0
            live = blk[held]
            if np.unique(live).size == live.size:  # (forks advancing in lockstep share blocks: row by row)
                self._release_gpu(live)
                if changed is not None:
                    changed.append((rows[held], first[held]))
                self._table[rows, first] = NULL_BLOCK
                self._nrel[rows] = stop
                return
        for r, a, z in zip(*release):
            blk = self._table[r, a:z]
            held = blk >= 0
            self._release_gpu(blk[held][::-1].copy())
            if changed is not None:
                cols = np.flatnonzero(held) + a
                changed.append((np.full(cols.size, r, dtype=np.int64), cols))
            self._table[r, a:z] = NULL_BLOCK
            self._nrel[r] = z

    def _release_window_small(self, rows: list, changed: list | None = None) -> None:
        """:meth:`_window_release` and :meth:`_release_window` of a few rows about to append one token each, in
        plain Python (the small-batch step of KV cache groups; rows in batch order, each tail first).
        ``changed``: a list that receives the (row, col) of each entry that held a block."""
        ntok, _, table, _, ref, _, _, nrel = (self._mvs or self._views())[:8]
        w, bs = self._window, self._bs
        cache, pool = self._cache, self._gpu
        cid = cache._cid_mv if cache is not None else None
        ring, size = pool._ring_mv, pool.num_blocks
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
                        ring[(pool._head + pool._nfree) % size] = b
                        pool._nfree += 1
            nrel[r] = target

