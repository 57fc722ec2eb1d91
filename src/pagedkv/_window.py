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
        """Release table ranges ``[a, z)`` of rows (tail first) and mark them NULL_BLOCK. ``changed``: a list
        that receives the (rows, cols) of the entries that held a block (for :class:`TableUpdates`)."""
        for r, a, z in zip(*release):
            blk = self._table[r, a:z]
            held = blk >= 0
            self._release_gpu(blk[held][::-1].copy())
            if changed is not None:
                cols = np.flatnonzero(held) + a
                changed.append((np.full(cols.size, r, dtype=np.int64), cols))
            self._table[r, a:z] = NULL_BLOCK
            self._nrel[r] = z

