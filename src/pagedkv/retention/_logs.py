"""A push log with lazy deletion: the building block of the ``session`` and ``density`` policies' eviction orders.

A policy keeps one *serial* per block in a flat int64 array ``cur`` (the serial of the block's live entry; 0: the
block is in no log) and any number of :class:`PushLog` s. A push appends ``(block, serial)`` to a log, serials
increasing over the whole policy; a discard only zeroes ``cur[block]``, which makes the entry stale wherever it is.
An entry is live iff ``cur[block] == serial``, so a log's live entries, oldest first, are its blocks in push order.
Stale entries are skipped by the scans and dropped when the log grows (its size stays within twice its live
entries plus a constant, O(1) amortised per push). No per-block objects: two numpy arrays per log.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PushLog"]


class PushLog:
    """Blocks in push order, with their serials and an ordering key each (see the module docstring). ``b``
    (int32), ``c`` and ``k`` (int64) hold entries ``[head, tail)``; entries before ``head`` are gone. Keys do not
    decrease along the log (a policy's merge of several logs compares ``(key, serial)``)."""

    __slots__ = ("b", "c", "k", "head", "tail")

    def __init__(self, capacity: int = 16) -> None:
        self.b = np.empty(capacity, dtype=np.int32)
        self.c = np.empty(capacity, dtype=np.int64)
        self.k = np.empty(capacity, dtype=np.int64)
        self.head = self.tail = 0

    def append(self, blocks: np.ndarray, serials: np.ndarray, cur: np.ndarray, key: int = 0) -> None:
        """Append ``blocks`` with their ``serials`` (increasing, above every serial in the log) under one ``key``
        (not below the log's last). O(len) amortised: a full log drops its stale entries and doubles when still
        more than half live."""
        n = blocks.size
        if self.tail + n > self.b.size:
            h, z = self.head, self.tail
            lb, lc = self.b[h:z], self.c[h:z]
            live = cur[lb] == lc
            m = int(np.count_nonzero(live))
            size = max(16, 2 * (m + n))
            nb = np.empty(size, dtype=np.int32)
            nc = np.empty(size, dtype=np.int64)
            nk = np.empty(size, dtype=np.int64)
            nb[:m], nc[:m], nk[:m] = lb[live], lc[live], self.k[h:z][live]
            self.b, self.c, self.k, self.head, self.tail = nb, nc, nk, 0, m
        z = self.tail
        self.b[z : z + n] = blocks
        self.c[z : z + n] = serials
        self.k[z : z + n] = key
        self.tail = z + n

    def head_entry(self, cur: np.ndarray) -> tuple[int, int, int]:
        """``(block, serial, key)`` of the oldest live entry, dropping the stale ones before it; ``(-1, 0, 0)`` if
        none. O(stale entries skipped), a few numpy calls per 64 of them."""
        h, z = self.head, self.tail
        b, c = self.b, self.c
        while h < z:
            if cur[b[h]] == c[h]:
                self.head = h
                return int(b[h]), int(c[h]), int(self.k[h])
            e = min(z, h + 64)
            live = np.flatnonzero(cur[b[h:e]] == c[h:e])
            h = h + int(live[0]) if live.size else e
        self.head = h
        return -1, 0, 0

    def take(self, n: int, cur: np.ndarray, below: tuple[int, int] | None = None) -> np.ndarray:
        """Remove and return up to ``n`` live entries from the oldest on (int32 blocks, their ``cur`` zeroed), only
        those whose ``(key, serial)`` is below ``below`` when given. O(log entries + entries scanned), numpy."""
        out = []
        h, z = self.head, self.tail
        if below is not None:  # (key, serial) increases along the log: the entries below the bound are a prefix
            kl, cl = below
            kk = self.k[h:z]
            lo = int(np.searchsorted(kk, kl))
            hi = int(np.searchsorted(kk, kl, "right"))
            z = h + lo + int(np.searchsorted(self.c[h + lo : h + hi], cl))
        while n and h < z:
            e = min(z, h + max(2 * n, 64))
            lb = self.b[h:e]
            live = np.flatnonzero(cur[lb] == self.c[h:e])
            if live.size >= n:
                out.append(lb[live[:n]])
                h += int(live[n - 1]) + 1
                break
            if live.size:
                out.append(lb[live])
                n -= live.size
            h = e
        self.head = h
        got = out[0] if len(out) == 1 else (np.concatenate(out) if out else np.empty(0, dtype=np.int32))
        cur[got] = 0
        return got

    def live(self, cur: np.ndarray) -> np.ndarray:
        """The live blocks in push order (a fresh int32 array). O(entries)."""
        lb = self.b[self.head : self.tail]
        return lb[cur[lb] == self.c[self.head : self.tail]]

    def __len__(self) -> int:
        """Entries held, stale ones included (what the log costs)."""
        return self.tail - self.head
