"""Eviction policies of the prefix cache: which unreferenced cached GPU block goes first when blocks are needed.

Every policy is one small class with the methods of :class:`pagedkv.blocks.evictor.LRUEvictor` (the default, and the
only one on the hot path when no other policy is asked for): ``push`` / ``push_many`` (a block became
unreferenced, in release order: a freed sequence's blocks tail first), ``discard`` / ``discard_many`` (a hit took
it back), ``pop`` / ``pop_many`` (evict: the policy's choice), ``len``, ``in`` and iteration in eviction order;
plus ``hint(blocks, session)``, called by the manager just before a sequence that carries a session hint
releases its blocks (a no-op for policies that take none). The policy only orders blocks: which blocks are cached,
the KV events and every counter stay the manager's, so a policy changes hit rates and nothing else.

==========  =====================================================================================================
``lru``     least recently released first (:class:`~pagedkv.blocks.evictor.LRUEvictor`)
``slru``    segmented LRU (frequency-aware): blocks never hit since they were cached are evicted before blocks
            that were (the protected segment, at most ``protected_fraction`` of the pool; its overflow goes back
            to the most recent end of the probation segment)
``session`` conversation-aware (a GreedyDual over a release clock): a block released by the ``t``-th request of
            a session is kept ``(t - 1) x lifetimes x num_blocks`` releases longer than LRU would keep it;
            requests without a hint behave as LRU. On the Mooncake conversation trace a conversation that has
            come back is the better bet, and keeping *some* conversations long beats keeping all of them briefly.
``density`` the release of least hit density first (:mod:`pagedkv.retention.density`): expected hits per block per
            unit of time given its age, learnt online per class of turn and size; unhinted blocks first, as LRU
``arc``     adaptive replacement (:mod:`pagedkv.retention.arc`): recency (T1) and frequency (T2) classes, the
            target size of T1 adapted by ghost lists of evicted blocks' content keys (read from the prefix
            cache's ``key`` array by block id)
==========  =====================================================================================================

:func:`make_evictor` builds one by name. Costs: ``slru`` as LRU (two LRU logs, a few numpy calls per batch);
``arc`` as two LRUs plus a dict probe per block pushed and a dict insert per block evicted (its ghost lists);
``session`` O(1) per block plus O(levels) per release a pop reaches (push logs, one per bonus); ``density`` O(1) per
block plus an O(R log R) sort of the R live releases after a hint (see its module).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

import numpy as np

from ..errors import InvalidArgumentError
from ..blocks.evictor import LRUEvictor
from ._logs import PushLog

__all__ = ["EVICTION_POLICIES", "SLRUEvictor", "SessionEvictor", "make_evictor"]

EVICTION_POLICIES = ("lru", "slru", "session", "density", "arc")


def make_evictor(policy: str, num_blocks: int, cache=None):
    """The evictor of ``policy`` (one of :data:`EVICTION_POLICIES`) for a pool of ``num_blocks``. ``cache``: the
    :class:`~pagedkv.blocks.prefix_cache.PrefixCache` whose blocks it orders; a policy that needs the content
    identity of the blocks (``arc``: its ghost lists hold evicted blocks' keys) reads the cache's per-block
    ``key`` and ``cid`` arrays by block id (never rebound); without a cache ``arc`` raises InvalidArgumentError.
    Raises InvalidArgumentError naming the known policies for any other name."""
    if policy == "lru":
        return LRUEvictor(num_blocks)
    if policy == "slru":
        return SLRUEvictor(num_blocks)
    if policy == "session":
        return SessionEvictor(num_blocks)
    if policy == "density":
        from .density import DensityEvictor

        return DensityEvictor(num_blocks)
    if policy == "arc":
        if cache is None:
            raise InvalidArgumentError("eviction_policy 'arc' needs the prefix cache's key and cid arrays")
        from .arc import ARCEvictor

        return ARCEvictor(num_blocks, cache.key, cache.cid)
    raise InvalidArgumentError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}; got {policy!r}")


class SLRUEvictor:
    """Segmented LRU: a *probation* LRU of blocks not hit since they were cached, evicted first, and a
    *protected* LRU of blocks that were hit (a :meth:`discard` is a hit: a prefix hit took the block back). The
    protected segment holds at most ``protected_fraction x num_blocks`` blocks; a push past that moves its least
    recent blocks to the most recent end of probation. ``hit`` (bool per block) is cleared when the block is
    evicted. O(1) per block, batch forms a few numpy calls (as LRUEvictor)."""

    __slots__ = ("probation", "protected", "hit", "cap")

    def __init__(self, num_blocks: int, protected_fraction: float = 0.8) -> None:
        self.probation = LRUEvictor(num_blocks)
        self.protected = LRUEvictor(num_blocks)
        self.hit = np.zeros(num_blocks, dtype=np.bool_)
        self.cap = max(1, int(protected_fraction * num_blocks))

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, block: int) -> bool:
        return block in self.probation or block in self.protected

    def hint(self, blocks, session) -> None:
        return None

    def _spill(self) -> None:
        over = len(self.protected) - self.cap
        if over > 0:
            self.probation.push_many(self.protected.pop_many(over))

    def push(self, block: int) -> None:
        if self.hit[block]:
            self.protected.push(block)
            self._spill()
        else:
            self.probation.push(block)

    def push_many(self, blocks: np.ndarray) -> None:
        if blocks.size == 0:
            return
        h = self.hit[blocks]
        if h.any():
            self.probation.push_many(blocks[~h])
            self.protected.push_many(blocks[h])
            self._spill()
        else:
            self.probation.push_many(blocks)

    def discard(self, block: int) -> None:
        if self.probation.stamp_mv[block]:
            self.probation.discard(block)
        else:
            self.protected.discard(block)
        self.hit[block] = True

    def discard_many(self, blocks: np.ndarray) -> None:
        if blocks.size == 0:
            return
        p = self.probation.stamp[blocks] != 0
        self.probation.discard_many(blocks[p])
        self.protected.discard_many(blocks[~p])
        self.hit[blocks] = True

    def pop(self) -> int:
        b = self.probation.pop() if len(self.probation) else self.protected.pop()
        self.hit[b] = False
        return b

    def pop_many(self, n: int) -> np.ndarray:
        k = min(n, len(self.probation))
        if k == n:
            got = self.probation.pop_many(n)
        elif k == 0:
            got = self.protected.pop_many(n)
        else:
            got = np.concatenate((self.probation.pop_many(k), self.protected.pop_many(n - k)))
        self.hit[got] = False
        return got

    def __iter__(self) -> Iterator[int]:
        """Eviction order: probation (least recent first), then protected."""
        yield from self.probation
        yield from self.protected


class SessionEvictor:
    """GreedyDual over a release clock with a per-session bonus. Each block pushed advances ``clock`` by one; the
    blocks of one push (one release: a freed sequence's blocks) are filed under ``first serial + bonus``, the
    smallest key evicted first (ties, and within a push: the earlier push, tail first). Without hints every bonus
    is 0 and the order is exactly LRU. :meth:`hint` (``blocks`` of the ``t``-th request seen for ``session``, about
    to be released) sets their bonus to ``(t - 1) x span`` for their next push, ``span = lifetimes x num_blocks``
    releases. Sessions are counted in a bounded table (the ``max_sessions`` most recently hinted; a forgotten
    session starts again at its first request).

    Blocks of one bonus are one *level*: a :class:`~pagedkv.retention._logs.PushLog`, in key order since the clock
    only grows. ``cur`` (int64 per block, the push serial, 0: not in the evictor) and ``bonus`` (int64 per block)
    are flat arrays; a pop merges the heads of the levels, a release at a time. push / discard O(1) amortised,
    batch forms a few numpy calls; ``pop_many`` O(levels) per release it reaches into (levels: the distinct turn
    counts of the blocks held, a handful) plus numpy work for the blocks taken. (Until round four: one key per
    block, in a binary heap in Python, one entry per push, 3-5x LRU's replay time; a key per release changes the
    order only between releases whose keys were interleaved.)"""

    __slots__ = ("cur", "bonus", "levels", "clock", "n", "span", "sessions", "max_sessions")

    def __init__(self, num_blocks: int, lifetimes: float = 4.0, max_sessions: int = 1 << 16) -> None:
        self.cur = np.zeros(num_blocks, dtype=np.int64)
        self.bonus = np.zeros(num_blocks, dtype=np.int64)
        self.levels: dict = {}  # bonus -> PushLog of the blocks pushed with it
        self.clock = 0
        self.n = 0
        self.span = max(1, int(lifetimes * num_blocks))
        self.sessions: OrderedDict = OrderedDict()
        self.max_sessions = max_sessions

    def __len__(self) -> int:
        return self.n

    def __contains__(self, block: int) -> bool:
        return self.cur[block] != 0

    def hint(self, blocks: np.ndarray, session: Hashable) -> None:
        """Count one more request of ``session`` and give its ``blocks`` that request's bonus at their next push."""
        if session is None:
            return
        s = self.sessions
        t = s.pop(session, 0) + 1
        s[session] = t
        if len(s) > self.max_sessions:
            s.popitem(last=False)
        self.bonus[blocks] = (t - 1) * self.span

    def _level(self, bonus: int) -> PushLog:
        log = self.levels.get(bonus)
        if log is None:
            log = self.levels[bonus] = PushLog()
        return log

    def push(self, block: int) -> None:
        c = self.clock = self.clock + 1
        self.cur[block] = c
        b = int(self.bonus[block])
        if b:
            self.bonus[block] = 0
        self._level(b).append(np.array([block], dtype=np.int32), np.array([c], dtype=np.int64), self.cur, c + b)
        self.n += 1

    def push_many(self, blocks: np.ndarray) -> None:
        n = blocks.size
        if n == 0:
            return
        c0 = self.clock
        serials = np.arange(c0 + 1, c0 + n + 1, dtype=np.int64)
        self.clock = c0 + n
        self.cur[blocks] = serials
        bon = self.bonus[blocks]
        b0 = int(bon[0])
        if (bon == b0).all():
            self._level(b0).append(blocks, serials, self.cur, c0 + 1 + b0)
        else:
            for v in np.unique(bon).tolist():
                m = bon == v
                self._level(v).append(blocks[m], serials[m], self.cur, c0 + 1 + v)
        self.bonus[blocks] = 0
        self.n += n

    def discard(self, block: int) -> None:
        self.cur[block] = 0
        self.n -= 1

    def discard_many(self, blocks: np.ndarray) -> None:
        self.cur[blocks] = 0
        self.n -= blocks.size

    def _heads(self) -> list:
        """``[(key, serial, bonus)]`` of each level's oldest live entry, smallest first; empty levels dropped."""
        out = []
        for b, log in list(self.levels.items()):
            blk, c, k = log.head_entry(self.cur)
            if blk < 0:
                del self.levels[b]
            else:
                out.append((k, c, b))
        out.sort()
        return out

    def pop(self) -> int:
        return int(self.pop_many(1)[0])

    def pop_many(self, n: int) -> np.ndarray:
        out = []
        want = n
        while want:
            heads = self._heads()
            key, c, b = heads[0]
            if len(heads) == 1:
                got = self.levels[b].take(want, self.cur)
            else:  # take while (key, serial) stays below the next level's head
                got = self.levels[b].take(want, self.cur, heads[1][:2])
            out.append(got)
            want -= got.size
        self.n -= n
        if len(out) == 1:
            return out[0].astype(np.int32, copy=False)
        return np.concatenate(out).astype(np.int32) if out else np.empty(0, dtype=np.int32)

    def __iter__(self) -> Iterator[int]:
        """Eviction order (smallest key first)."""
        blocks, keys = [], []
        for log in self.levels.values():
            h, z = log.head, log.tail
            live = self.cur[log.b[h:z]] == log.c[h:z]
            blocks.append(log.b[h:z][live])
            keys.append(log.k[h:z][live])
        if not blocks:
            return iter(())
        blocks, keys = np.concatenate(blocks), np.concatenate(keys)
        return iter(blocks[np.lexsort((self.cur[blocks], keys))].tolist())
