"""The ``density`` eviction policy: evict the release with the fewest expected hits per block per unit of time.

A cached block pays for itself only if a later request hits it; on conversational traffic that is the next turn
of its conversation, which comes minutes later (on the Mooncake conversation trace a median 422 requests; a
1M-token cache holds about 80 prompts), seldom in the first seconds (people read the answer), and more likely the
more turns the conversation has had. Recency (LRU) is the wrong signal there: the newest release is the one least
likely to be hit *now*. This policy estimates, per release, its *hit density* (LHD, Beckmann et al., NSDI'18):
the probability that its conversation returns within a horizon over the block-time spent waiting for it, at the
best horizon, given how long it has waited already::

    HD(k, a) = max over H > a of  (S_k(a) - S_k(H)) / sum_{a <= x < H} S_k(x)

``S_k`` the survival curve of the time to the next turn of a release of *class* ``k`` (no return yet after
``x``), ``a`` its age. Blocks cost the same and a hit serves the blocks that were kept, so the density per block is
the density of the release. The release of least density goes first, oldest first among equals, and within a
release tail first (as pushed): a partly evicted conversation keeps its prefix, which is what a hit needs.

- **Time** is the count of hinted releases (:meth:`DensityEvictor.hint`: one request of a conversation ending).
- **Classes**: the conversation's turn (1, 2, 3, 4 or more) x ``log2`` of the blocks this turn added (the whole
  prompt for a first turn): 64 classes. A large pasted document rarely comes back; a short follow-up does.
- **Learning, online, from the past only**: each hinted release is recorded; when the same session hints again
  its gap is a return of the earlier release's class. The survival curves are Kaplan-Meier estimates over the last
  ``window`` releases (releases still waiting are censored at their age), in ``bins`` bins of ``bin_width``
  releases, each class shrunk towards the pooled curve (``prior`` pseudo-releases), recomputed every ``every``
  releases. Until data comes every density is 0 and the order is LRU's.
- **Blocks without a hint** (no session) are an *anonymous* release of density 0: evicted first, least recently
  released first. With no hints at all the order is exactly LRU.
- **Blocks shared across conversations** (hinted by a second session while cached: a system prompt, a shared
  document) leave the release they came in with: their density is their own hit rate, the hints by other
  sessions per clock tick since their first hint (the density's unit), the fewest and newest of a push's shared
  blocks for all of them. A system prompt every request hits is then the last block to go, whatever release
  brought it back last. What is known of a block is forgotten when it is evicted, or hinted again without having
  been pushed since (freed uncached: new content).

Data: per block the base class's ``stamp`` (push serial, 0: not in the evictor) and ``seg`` (release slot), the
class and clock of the last hint (int32, int64), the last hinting session's hash, shared hits, first hint (int64)
and a pending flag; per release slot its class, clock and creation serial, and the base class's segment (its
blocks in push order, their live count). A release is one push (a freed sequence's blocks) or several pushes
between two hints with the same class and clock; never one object per block. Costs: push, discard O(1) amortised
(batch forms a few numpy calls); a pop computes the order of the live releases when a hint or a push changed it
(O(R log R) numpy for R live releases, a few hundred on the trace) and then takes blocks in O(1) amortised each;
``hint`` O(1), every ``every``-th O(window + classes x bins^2) numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import numpy as np

from ..blocks.policy import EvictionPolicy

__all__ = ["DensityEvictor", "HitDensity"]

TURNS = 4  # turn classes: 1, 2, 3, 4 or more
SIZES = 16  # log2 classes of the blocks a turn adds
ANONYMOUS = TURNS * SIZES  # the class of a release without a hint (density 0)
SHARED = ANONYMOUS + 1  # blocks hinted by two sessions while cached (a system prompt): density = their hit rate


class HitDensity:
    """The online estimate of the hit density per class and age (see the module docstring). :meth:`tick` records
    a hinted release and returns its class and clock; ``table`` ``(ANONYMOUS + 1, bins + 1)`` float64 holds the
    densities (the anonymous row stays 0); :meth:`density` reads it for arrays of releases."""

    def __init__(self, bin_width: int = 20, bins: int = 200, every: int = 256, prior: float = 20.0,
                 window: int = 1 << 15, max_sessions: int = 1 << 16) -> None:
        self.bin_width, self.bins, self.every, self.prior = bin_width, bins, every, prior
        self.window, self.max_sessions = window, max_sessions
        self.clock = 0
        self.sessions: OrderedDict = OrderedDict()  # session -> (turn, clock, blocks, class) of its last release
        self._rel_k: list = []  # hinted releases: class, clock (in clock order)
        self._rel_t: list = []
        self._ret: list = []  # returns: (class, release clock, gap)
        self.table = np.zeros((ANONYMOUS + 1, bins + 1))
        self._due = every
        self.version = 0  # bumped by each refresh

    @staticmethod
    def klass(turn: int, new_blocks: int) -> int:
        """The class of a release: turn (capped at 4) x log2 classes of the blocks the turn added."""
        return (min(turn, TURNS) - 1) * SIZES + min(max(new_blocks, 0).bit_length(), SIZES - 1)

    def tick(self, session: Hashable, num_blocks: int) -> tuple[int, int]:
        """Record one release of ``num_blocks`` blocks by ``session``; return ``(class, clock)``. O(1), every
        ``every``-th call a refresh."""
        c = self.clock = self.clock + 1
        prev = self.sessions.pop(session, None)
        if prev is None:
            turn, new = 1, num_blocks
        else:
            turn, new = prev[0] + 1, num_blocks - prev[2]
            self._ret.append((prev[3], prev[1], c - prev[1]))
        k = self.klass(turn, new)
        self.sessions[session] = (turn, c, num_blocks, k)
        if len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        self._rel_k.append(k)
        self._rel_t.append(c)
        if c >= self._due:
            self.refresh()
            self._due = c + self.every
        return k, c

    def refresh(self) -> None:
        """Recompute ``table`` from the releases and returns of the last ``window`` clock ticks."""
        B, T, K, c = self.bin_width, self.bins, ANONYMOUS, self.clock
        old = c - self.window
        if self._rel_t and self._rel_t[0] <= old:
            cut = int(np.searchsorted(np.asarray(self._rel_t), old, "right"))
            del self._rel_k[:cut], self._rel_t[:cut]
            self._ret = [r for r in self._ret if r[1] > old]
        rk = np.asarray(self._rel_k, dtype=np.int64)
        age = np.minimum((c - np.asarray(self._rel_t, dtype=np.int64)) // B, T)
        risk = np.zeros((K, T + 2))
        np.add.at(risk, (rk, 0), 1.0)  # a release is at risk in bins 0..age
        np.add.at(risk, (rk, age + 1), -1.0)
        ev = np.zeros((K, T + 2))
        if self._ret:
            q = np.asarray(self._ret, dtype=np.int64)
            qk, gb = q[:, 0], q[:, 2] // B
            qa = np.minimum((c - q[:, 1]) // B, T)
            inb = gb <= T
            np.add.at(ev, (qk[inb], gb[inb]), 1.0)
            out = gb < qa  # returned: no longer at risk in bins gb + 1 .. age
            np.add.at(risk, (qk[out], gb[out] + 1), -1.0)
            np.add.at(risk, (qk[out], qa[out] + 1), 1.0)
        risk = np.cumsum(risk, axis=1)[:, : T + 1]
        ev = ev[:, : T + 1]
        pooled = ev.sum(0) / np.maximum(risk.sum(0), 1.0)
        h = np.clip((ev + self.prior * pooled) / (np.maximum(risk, 0.0) + self.prior), 0.0, 1.0)
        S = np.ones((K, T + 2))
        S[:, 1:] = np.cumprod(1.0 - h, axis=1)  # S[b]: no return before bin b
        cs = np.zeros((K, T + 3))
        cs[:, 1:] = np.cumsum(S, axis=1)
        a = np.arange(T + 1)[:, None]
        hh = np.arange(T + 2)[None, :]
        later = hh > a
        table = np.zeros((K + 1, T + 1))
        for k in range(K):
            num = S[k, : T + 1, None] - S[k, None, :]
            den = (cs[k, None, : T + 2] - cs[k, : T + 1, None]) * B
            d = np.where(later & (den > 0), num / np.where(den > 0, den, 1.0), 0.0)
            table[k] = d.max(axis=1)
        self.table = table
        self.version += 1

    def density(self, klass: np.ndarray, clock: np.ndarray) -> np.ndarray:
        """The density of releases of class ``klass`` made at ``clock`` (arrays), now."""
        age = np.minimum((self.clock - clock) // self.bin_width, self.bins)
        return self.table[klass, age]


class DensityEvictor(EvictionPolicy, name="density"):
    """The ``density`` policy (see the module docstring): an :class:`~pagedkv.blocks.policy.EvictionPolicy`
    whose segments are the releases (slots, reused), with the hooks ``place`` (a push joins the newest release or
    opens one), ``choose`` and ``order`` (releases by density), ``emptied`` (a release's slot is freed) and
    :meth:`hint`. ``est`` is its :class:`HitDensity`."""

    __slots__ = ("hk", "ht", "own", "shd", "born", "pend", "est", "s_k", "s_t", "s_ser", "s_h", "s_b", "free",
                 "nslots", "rank", "oi", "stale", "last")

    def __init__(self, num_blocks: int, **options) -> None:
        super().__init__(num_blocks)
        self.hk = np.full(num_blocks, ANONYMOUS, dtype=np.int32)  # class and clock of the block's last hint
        self.ht = np.zeros(num_blocks, dtype=np.int64)
        self.own = np.zeros(num_blocks, dtype=np.int64)  # the session (a hash, 0: none) that last hinted the block
        self.shd = np.zeros(num_blocks, dtype=np.int64)  # hints by another session since it was cached
        self.born = np.zeros(num_blocks, dtype=np.int64)  # clock of its first hint since it was cached
        self.pend = np.zeros(num_blocks, dtype=np.bool_)  # hinted and not pushed since
        self.est = HitDensity(**options)
        cap = 16
        self.s_k = np.zeros(cap, dtype=np.int64)  # per release slot (segment): class, clock, creation serial
        self.s_t = np.zeros(cap, dtype=np.int64)
        self.s_ser = np.zeros(cap, dtype=np.int64)
        self.s_h = np.zeros(cap, dtype=np.int64)  # shared releases: fewest shared hits, latest first hint
        self.s_b = np.zeros(cap, dtype=np.int64)
        self.free: list = list(range(cap - 1, 0, -1))  # free slots (segment 0 is not used: it never goes away)
        self.nslots = 1  # slots ever used (the order looks at [1, nslots))
        self.rank = np.empty(0, dtype=np.int64)  # live slots in eviction order (valid while not stale)
        self.oi = 0
        self.stale = False
        self.last = -1  # the newest release slot (a push with its class and clock joins it)

    def hint(self, blocks: np.ndarray, session: Hashable) -> None:
        """One request of ``session`` ends: its ``blocks`` (the sequence's table, head first) are about to be
        released; their next push files them under this release's class and clock. O(1) plus the estimator."""
        if session is None:
            return
        k, c = self.est.tick(session, int(blocks.size))
        self.hk[blocks] = k
        self.ht[blocks] = c
        # (0 means "none": a session hashing to 0 takes the largest value; `| 1` would merge sessions 2k and 2k + 1)
        h = (hash(session) & 0x7FFFFFFFFFFFFFFF) or 0x7FFFFFFFFFFFFFFF
        gone = self.pend[blocks]  # hinted before and never pushed since: freed uncached, new content now
        if gone.any():
            self.own[blocks[gone]] = 0
            self.shd[blocks[gone]] = 0
        self.pend[blocks] = True
        prev = self.own[blocks]
        self.shd[blocks] += (prev != 0) & (prev != h)
        self.born[blocks] = np.where(prev == 0, c, self.born[blocks])
        self.own[blocks] = h
        self.stale = True

    # ------------------------------------------------------------------ releases
    def _slot(self, k: int, t: int, blocks: np.ndarray, serials: np.ndarray) -> None:
        s = self.last
        if s < 0 or not self.count(s) or self.s_k[s] != k or self.s_t[s] != t or k == SHARED:
            if not self.free:
                cap = self.s_k.size
                for name in ("s_k", "s_t", "s_ser", "s_h", "s_b"):
                    a = getattr(self, name)
                    b = np.zeros(2 * cap, dtype=a.dtype)
                    b[:cap] = a
                    setattr(self, name, b)
                self.free = list(range(2 * cap - 1, cap - 1, -1))
            s = self.free.pop()
            self.nslots = max(self.nslots, s + 1)
            self.s_k[s], self.s_t[s], self.s_ser[s] = k, t, int(serials[0])
            if k == SHARED:
                self.s_h[s], self.s_b[s] = int(self.shd[blocks].min()), int(self.born[blocks].max())
            self.last = s
            self.stale = True
        self.append(s, blocks, 0, serials)

    def place(self, blocks: np.ndarray) -> None:
        serials = self.new_serials(blocks.size)
        now = self.est.clock
        hk = self.hk[blocks]
        k = np.where(self.ht[blocks] == now, hk, ANONYMOUS)  # a hint counts until the next one
        k[self.shd[blocks] > 0] = SHARED
        self.hk[blocks] = ANONYMOUS
        self.pend[blocks] = False
        k0 = int(k[0])
        if (k == k0).all():
            self._slot(k0, now, blocks, serials)
        else:  # blocks of two kinds (hinted now, and not): one release each, in push order
            for v in dict.fromkeys(k.tolist()):
                m = k == v
                self._slot(v, now, blocks[m], serials[m])

    def emptied(self, segment: int) -> None:
        self.free.append(segment)
        if self.last == segment:
            self.last = -1

    # ------------------------------------------------------------------ eviction order
    def _rank(self) -> np.ndarray:
        if self.stale:
            live = np.fromiter((s for s, log in self._logs.items() if log.live), dtype=np.int64)
            k = self.s_k[live]
            sh = k == SHARED
            d = self.est.density(np.where(sh, ANONYMOUS, k), self.s_t[live])
            if sh.any():  # hits per tick since first hinted, the density's unit
                d[sh] = self.s_h[live[sh]] / (self.est.clock - self.s_b[live[sh]] + 1.0)
            self.rank = live[np.lexsort((self.s_ser[live], d))]
            self.oi = 0
            self.stale = False
        return self.rank

    def choose(self, n: int) -> np.ndarray:
        rank = self._rank()
        out = []
        want = n
        i = self.oi
        while want:
            s = int(rank[i])
            if not self.count(s):  # gone since the order was made (a slot is only reused after a push restales it)
                i += 1
                continue
            got = self.take(s, want)
            out.append(got)
            want -= got.size
            if not self.count(s):
                i += 1
        self.oi = i
        got = out[0] if len(out) == 1 else np.concatenate(out)
        self.own[got] = 0  # the content leaves: its sessions and shared hits with it
        self.shd[got] = 0
        return got

    def order(self) -> np.ndarray:
        """Eviction order: releases by density (then age), each tail first (as pushed)."""
        rank = self._rank()
        parts = [self.segment(s).blocks() for s in rank[self.oi :].tolist() if self.count(s)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
