"""Eviction policies of the prefix cache: which unreferenced cached GPU block goes first when blocks are needed.

Every policy is a small subclass of :class:`pagedkv.blocks.policy.EvictionPolicy`, which owns the evictor API the
prefix cache calls (``push`` / ``push_many``: a block became unreferenced, in release order, a freed sequence's
blocks tail first; ``discard`` / ``discard_many``: a hit took it back; ``pop`` / ``pop_many``: evict the policy's
choice; ``len``, ``in``, iteration in eviction order) and its bookkeeping (per-block flat arrays, segments of
blocks in push order); a policy adds its hooks: where a released block is filed (``place``), which blocks go
(``choose``), and what it learns from a hit (``on_hit``) or from ``hint(blocks, session)``, called by the manager
just before a sequence that carries a session hint releases its blocks. ``lru`` (the default, and the only one on
the hot path when no other policy is asked for) has no hook. The policy only orders blocks: which blocks are cached,
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

:data:`POLICIES` is the table of policies by name (a subclass defined with ``name="..."`` joins it);
:func:`make_evictor` builds one from a name, a subclass or an instance's class. Costs: ``slru`` as LRU (two
segments, a few numpy calls per batch);
``arc`` as two LRUs plus a dict probe per block pushed and a dict insert per block evicted (its ghost lists);
``session`` O(1) per block plus O(levels) per release a pop reaches (push logs, one per bonus); ``density`` O(1) per
block plus an O(R log R) sort of the R live releases after a hint (see its module).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import numpy as np

from ..blocks.evictor import LRUEvictor
from ..blocks.policy import POLICIES, EvictionPolicy, make_policy, policy_class

__all__ = ["EVICTION_POLICIES", "POLICIES", "EvictionPolicy", "LRUEvictor", "SLRUEvictor", "SessionEvictor",
           "make_evictor", "policy_class"]


def make_evictor(policy, num_blocks: int, cache=None) -> EvictionPolicy:
    """A new evictor of ``policy`` for a pool of ``num_blocks``: a name of :data:`POLICIES` (the registry, one
    entry per :class:`~pagedkv.blocks.policy.EvictionPolicy` subclass defined with ``name=``), a subclass, or an
    instance (a new one of its class). ``cache``: the :class:`~pagedkv.blocks.prefix_cache.PrefixCache` whose
    blocks it orders; a policy that needs the content identity of the blocks (``arc``: its ghost lists hold
    evicted blocks' keys) reads the cache's per-block ``key`` and ``cid`` arrays by block id (never rebound);
    without a cache ``arc`` raises InvalidArgumentError. Raises InvalidArgumentError naming the known policies for
    anything else."""
    return make_policy(policy, num_blocks, cache)


class SLRUEvictor(EvictionPolicy, name="slru"):
    """Segmented LRU: a *probation* segment (0) of blocks not hit since they were cached, evicted first, and a
    *protected* segment (1) of blocks that were hit (a discard is a hit: a prefix hit took the block back); keys
    0 and 1, so the default choice (smallest key first) takes probation, least recent first, then protected. The
    protected segment holds at most ``protected_fraction x num_blocks`` blocks; a push past that moves its least
    recent blocks to the most recent end of probation. ``hit`` (bool per block) is cleared when the block is
    evicted. O(1) per block, batch forms a few numpy calls (as LRU)."""

    __slots__ = ("hit", "hit_mv", "cap")

    def __init__(self, num_blocks: int, protected_fraction: float = 0.8) -> None:
        super().__init__(num_blocks)
        self.hit = np.zeros(num_blocks, dtype=np.bool_)
        self.hit_mv = memoryview(self.hit)
        self.cap = max(1, int(protected_fraction * num_blocks))

    def place_one(self, block: int) -> None:
        if self.hit_mv[block]:
            self.append_one(1, block, 1)
            if self.count(1) > self.cap:
                self.append(0, self.take(1, self.count(1) - self.cap))
        else:
            self.append_one(0, block)

    def choose_one(self) -> int:
        b = self.take_one(0 if self.count(0) else 1)
        self.hit_mv[b] = False
        return b

    def place(self, blocks: np.ndarray) -> None:
        h = self.hit[blocks]
        if not h.any():
            self.append(0, blocks)
            return
        self.append(0, blocks[~h])
        self.append(1, blocks[h], 1)
        over = self.count(1) - self.cap
        if over > 0:
            self.append(0, self.take(1, over))

    def on_hit(self, blocks) -> None:
        if type(blocks) is int:
            self.hit_mv[blocks] = True
        else:
            self.hit[blocks] = True

    def choose(self, n: int) -> np.ndarray:
        k = min(n, self.count(0))
        got = self.take(0, k) if k == n else np.concatenate((self.take(0, k), self.take(1, n - k)))
        self.hit[got] = False
        return got


class SessionEvictor(EvictionPolicy, name="session"):
    """GreedyDual over a release clock with a per-session bonus. Each block pushed advances the clock (the
    evictor's serials) by one; the blocks of one push (one release: a freed sequence's blocks) are filed under
    ``first serial + bonus``, the smallest key evicted first (ties, and within a push: the earlier push, tail
    first): the default choice of :class:`~pagedkv.blocks.policy.EvictionPolicy` over one segment per bonus (a
    *level*, in key order since the clock only grows). Without hints every bonus is 0 and the order is exactly
    LRU. :meth:`hint` (``blocks`` of the ``t``-th request seen for ``session``, about to be released) sets their
    bonus to ``(t - 1) x span`` for their next push, ``span = lifetimes x num_blocks`` releases. Sessions are
    counted in a bounded table (the ``max_sessions`` most recently hinted; a forgotten session starts again at its
    first request).

    ``bonus`` (int64 per block) is a flat array; push / discard O(1) amortised, batch forms a few numpy calls;
    ``pop_many`` O(levels) per release it reaches into (levels: the distinct turn counts of the blocks held, a
    handful) plus numpy work for the blocks taken. (Until round four: one key per block, in a binary heap in
    Python, one entry per push, 3-5x LRU's replay time; a key per release changes the order only between releases
    whose keys were interleaved.)"""

    __slots__ = ("bonus", "bonus_mv", "span", "sessions", "max_sessions")

    def __init__(self, num_blocks: int, lifetimes: float = 4.0, max_sessions: int = 1 << 16) -> None:
        super().__init__(num_blocks)
        self.bonus = np.zeros(num_blocks, dtype=np.int64)
        self.bonus_mv = memoryview(self.bonus)
        self.span = max(1, int(lifetimes * num_blocks))
        self.sessions: OrderedDict = OrderedDict()
        self.max_sessions = max_sessions

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

    def place(self, blocks: np.ndarray) -> None:
        serials = self.new_serials(blocks.size)
        c1 = int(serials[0])
        bon = self.bonus[blocks]
        b0 = int(bon[0])
        if (bon == b0).all():
            self.append(b0, blocks, c1 + b0, serials)
        else:
            for v in np.unique(bon).tolist():
                m = bon == v
                self.append(v, blocks[m], c1 + v, serials[m])
        self.bonus[blocks] = 0

    def place_one(self, block: int) -> None:
        b = self.bonus_mv[block]
        if b:
            self.bonus_mv[block] = 0
        self.append_one(b, block, self._serial + 1 + b)


from . import density as _density, arc as _arc  # noqa: E402  (registered after slru and session: the table's order)

EVICTION_POLICIES = tuple(POLICIES)  # the built-in policies' names, in the table's order
