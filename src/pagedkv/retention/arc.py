"""ARC (Megiddo and Modha, FAST'03) over the prefix cache's unreferenced cached blocks: the ``arc`` policy.

ARC splits the cache into *T1* (contents seen once since they were cached: recency) and *T2* (contents hit while
cached, or cached again soon after an eviction: frequency), and remembers the content keys of recent evictions
in two *ghost* lists, *B1* (evicted from T1) and *B2* (evicted from T2). ``p``, the target size of T1, adapts:
a content cached again while its key is in B1 (T1 was too small) raises ``p`` by ``max(1, |B2| / |B1|)``, one
in B2 lowers it by ``max(1, |B1| / |B2|)``. An eviction takes T1's least recent block while T1 holds more than
``p`` blocks (or T2 is empty), else T2's. Scan resistance: a burst of one-off prompts fills T1 and leaves T2.

Mapping onto the evictor API (:class:`pagedkv.blocks.policy.EvictionPolicy`'s hooks): only unreferenced blocks
are in an evictor, so T1 and T2 here hold the idle blocks of each class (in a sequence replay, where every cached
block is idle between requests, that is the whole cache, as in the paper). A ``discard`` (a prefix hit took the
block back) is ARC's hit: the block's next ``push`` files it in T2. A ``push`` of a block whose content key is in
a ghost list is ARC's ghost hit (the content was evicted and has been cached again): ``p`` adapts, the key leaves
the ghost list, the block goes to T2. Anything else goes to T1. (The paper adapts ``p`` at the miss; here the
evictor sees a content cached again at its first release, which in a sequence replay is the same request.)

The hook: a policy that needs a block's content identity reads the prefix cache's per-block ``key`` (chained
content key) and ``cid`` (content id, never reused; 0: not cached) arrays by block id
(:func:`pagedkv.retention.eviction.make_evictor` hands them over). An evicted block's key is still in ``key``
when ``pop`` returns it (the cache clears its ``cid`` after), so no call of the cache changes. A block counts as
hit while ``hcid[block] == cid[block] != 0`` (the content id it had when hit), so a block whose content changed
(evicted, reset, handed over) is never mistaken for a hit one, with no clean-up call.

State: the base class's two segments (T1, T2), ``hcid`` int64 per block, two :class:`_Ghost` lists of uint64 keys (a dict key ->
serial and a FIFO of (key, serial) in numpy arrays, stale entries skipped). Ghost sizes: ``|T1| + |B1| <= c`` and
``|T1| + |T2| + |B1| + |B2| <= 2c`` (``c`` = num_blocks), oldest keys dropped first. Costs: ``push_many`` two dict
probes per block not hit (the ghost lookups, C-level through ``map``) plus a few numpy calls; ``discard`` O(1);
``pop_many`` a few numpy calls plus one dict insert per evicted block (and the trims, one dict delete per key
dropped, amortised O(1)); about 30 bytes a block plus up to 2c ghost keys (~100 bytes each in the dict and the
FIFO).
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from ..blocks.policy import EvictionPolicy
from ..errors import InvalidArgumentError

__all__ = ["ARCEvictor"]


class _Ghost:
    """A bounded LRU set of content keys (uint64): ``add_many`` appends keys as the most recent, ``take(key)`` tells
    whether ``key`` is in and removes it, ``trim(n)`` drops the oldest keys until at most ``n`` are left. ``d``: key
    -> serial of its live FIFO entry; the FIFO (``k``, ``s``, entries ``[head, tail)``) keeps insertion order, an
    entry live iff ``d.get(key) == serial``; it is compacted when full (O(1) amortised)."""

    __slots__ = ("d", "k", "s", "head", "tail", "serial")

    def __init__(self) -> None:
        self.d: dict[int, int] = {}
        self.k = np.zeros(64, dtype=np.uint64)
        self.s = np.zeros(64, dtype=np.int64)
        self.head = self.tail = 0
        self.serial = 0

    def __len__(self) -> int:
        return len(self.d)

    def __contains__(self, key: int) -> bool:
        return key in self.d

    def take(self, key: int) -> bool:
        return self.d.pop(key, None) is not None

    def add_many(self, keys: np.ndarray) -> None:
        n = keys.size
        if n == 0:
            return
        if self.tail + n > self.k.size:
            self._compact(n)
        z, s0 = self.tail, self.serial + 1
        ser = np.arange(s0, s0 + n, dtype=np.int64)
        self.k[z : z + n] = keys
        self.s[z : z + n] = ser
        self.tail, self.serial = z + n, s0 + n - 1
        self.d.update(zip(keys.tolist(), ser.tolist()))  # (a key added twice: the later entry is the live one)

    def _compact(self, extra: int) -> None:
        h, z = self.head, self.tail
        ks, ss = self.k[h:z].tolist(), self.s[h:z].tolist()
        d = self.d
        live = [i for i, (k, s) in enumerate(zip(ks, ss)) if d.get(k) == s]
        m = len(live)
        size = max(64, 2 * (m + extra))
        nk, ns = np.zeros(size, dtype=np.uint64), np.zeros(size, dtype=np.int64)
        idx = np.asarray(live, dtype=np.int64)
        nk[:m], ns[:m] = self.k[h:z][idx], self.s[h:z][idx]
        self.k, self.s, self.head, self.tail = nk, ns, 0, m

    def trim(self, n: int) -> None:
        """Drop the oldest keys until at most ``max(n, 0)`` are left."""
        d = self.d
        over = len(d) - max(n, 0)
        h = self.head
        while over > 0:  # (vectorised: the live entries of a chunk of the FIFO, the first ``over`` deleted)
            e = min(self.tail, h + max(2 * over, 64))
            ks = self.k[h:e].tolist()
            cur = np.fromiter(map(d.get, ks, itertools.repeat(0)), dtype=np.int64, count=len(ks))
            live = np.flatnonzero(cur == self.s[h:e])
            if live.size >= over:
                live = live[:over]
                e = h + int(live[-1]) + 1
            collections.deque(map(d.__delitem__, [ks[i] for i in live.tolist()]), maxlen=0)
            over -= live.size
            h = e
        self.head = h

    def keys(self) -> list[int]:
        """The live keys, oldest first (O(entries); tests and checks)."""
        d = self.d
        return [k for k, s in zip(self.k[self.head : self.tail].tolist(), self.s[self.head : self.tail].tolist())
                if d.get(k) == s]


class ARCEvictor(EvictionPolicy, name="arc"):
    """Adaptive replacement (see the module docstring) over the blocks of a prefix cache whose per-block content
    ``key`` (uint64) and ``cid`` (int64) arrays it reads: an :class:`~pagedkv.blocks.policy.EvictionPolicy` with
    segments 0 (T1) and 1 (T2) and the hooks ``place`` (T1 or T2, ghost hits adapting ``p``), ``on_hit``,
    ``choose`` (ARC's replace) and ``order``. ``t1``, ``t2``: views of the two classes (``len``, iteration);
    ``b1``, ``b2``: the ghost lists; ``p``: the target number of T1 blocks (a float in ``[0, c]``)."""

    __slots__ = ("b1", "b2", "p", "c", "hcid", "key", "cid")

    def __init__(self, num_blocks: int, key: np.ndarray, cid: np.ndarray) -> None:
        super().__init__(num_blocks)
        self.b1, self.b2 = _Ghost(), _Ghost()
        self.p = 0.0
        self.c = num_blocks
        self.hcid = np.zeros(num_blocks, dtype=np.int64)
        self.key, self.cid = key, cid

    @classmethod
    def build(cls, num_blocks: int, cache=None) -> "ARCEvictor":
        if cache is None:
            raise InvalidArgumentError("eviction_policy 'arc' needs the prefix cache's key and cid arrays")
        return cls(num_blocks, cache.key, cache.cid)

    @property
    def t1(self):
        return self.segment(0)

    @property
    def t2(self):
        return self.segment(1)

    def place(self, blocks: np.ndarray) -> None:
        """File each block in T2 if it was hit while cached or its key is in a ghost list (adapting ``p`` per ghost
        hit, in order), else in T1; the order of ``blocks`` is kept within each class."""
        cid = self.cid[blocks]
        freq = (self.hcid[blocks] == cid) & (cid != 0)
        if len(self.b1) or len(self.b2):
            rest = np.flatnonzero(~freq)
            if rest.size:
                b1, b2, c = self.b1, self.b2, self.c
                p = self.p
                keys = self.key[blocks[rest]].tolist()
                # which keys are in a ghost list: C-level membership tests; Python only for the ghost hits
                in1 = np.fromiter(map(b1.d.__contains__, keys), dtype=np.bool_, count=len(keys))
                in2 = np.fromiter(map(b2.d.__contains__, keys), dtype=np.bool_, count=len(keys))
                ghost = []
                for j in np.flatnonzero(in1 | in2).tolist():
                    k = keys[j]
                    n1, n2 = len(b1.d), len(b2.d)
                    if b1.take(k):
                        p = min(c, p + max(1.0, n2 / n1))
                    elif b2.take(k):
                        p = max(0.0, p - max(1.0, n1 / n2))
                    else:  # (a key twice in one push: taken already)
                        continue
                    ghost.append(rest[j])
                self.p = p
                if ghost:
                    g = np.asarray(ghost, dtype=np.int64)
                    freq[g] = True
                    self.hcid[blocks[g]] = cid[g]
        if freq.all():
            self.append(1, blocks)
        elif not freq.any():
            self.append(0, blocks)
        else:
            self.append(0, blocks[~freq])
            self.append(1, blocks[freq])
        if len(self.b1) or len(self.b2):
            self._trim()

    def place_one(self, block: int) -> None:
        """:meth:`place` of one block, in scalar steps."""
        c = int(self.cid[block])
        two = c != 0 and int(self.hcid[block]) == c
        b1, b2 = self.b1, self.b2
        if not two and (b1.d or b2.d):
            k = int(self.key[block])
            n1, n2 = len(b1.d), len(b2.d)
            if b1.take(k):
                self.p = min(self.c, self.p + max(1.0, n2 / n1))
                two = True
            elif b2.take(k):
                self.p = max(0.0, self.p - max(1.0, n1 / n2))
                two = True
            if two:
                self.hcid[block] = c
        self.append_one(1 if two else 0, block)
        if b1.d or b2.d:
            self._trim()

    def _trim(self) -> None:
        """Drop the oldest ghost keys past ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``."""
        c, n1 = self.c, self.count(0)
        if n1 + len(self.b1.d) > c:
            self.b1.trim(c - n1)
        over = 2 * c - n1 - self.count(1) - len(self.b1.d)
        if len(self.b2.d) > over:
            self.b2.trim(over)

    def on_hit(self, blocks) -> None:
        """A hit took ``blocks`` back: their next push files them in T2."""
        self.hcid[blocks] = self.cid[blocks]

    def _split(self, n: int) -> int:
        """How many of the next ``n`` evictions come from T1 (ARC's replace: T1 while it holds more than ``p``
        blocks, then T2, then T1 again once T2 is empty)."""
        n1, n2 = self.count(0), self.count(1)
        k = min(n, max(0, n1 - int(self.p)))
        if n - k > n2:
            k = n - n2
        return k

    def choose(self, n: int) -> np.ndarray:
        """Evict ``n`` blocks (``n <= len(self)``), in ARC's order; their keys go to B1 (from T1) or B2 (from
        T2), and the ghost lists are trimmed to their bounds."""
        k = self._split(n)
        a = self.take(0, k) if k else None
        b = self.take(1, n - k) if n - k else None
        key = self.key
        if a is not None:
            self.b1.add_many(key[a])
        if b is not None:
            self.b2.add_many(key[b])
        self._trim()
        if a is None:
            return b if b is not None else np.empty(0, dtype=np.int32)
        if b is None:
            return a
        return np.concatenate((a, b))

    def order(self) -> np.ndarray:
        """Eviction order (as successive pops would take them with ``p`` unchanged)."""
        o1, o2 = self.segment(0).blocks(), self.segment(1).blocks()
        k = min(o1.size, max(0, o1.size - int(self.p)))
        return np.concatenate((o1[:k], o2, o1[k:]))

    def check_ghosts(self) -> None:
        """Assert ``p``'s range, the ghost bounds and that T1 and T2 are disjoint (tests). O(num_blocks)."""
        c = self.c
        assert 0.0 <= self.p <= c
        self.verify()
        assert len(self.t1) + len(self.b1) <= c
        assert len(self) + len(self.b1) + len(self.b2) <= 2 * c
