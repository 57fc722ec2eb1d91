"""ChainOrder: the eviction order of a tier that keeps what prefixes need (a chain's tail goes before its head).

A block of KV is usable only after its whole prefix: a load walks a prompt's chain from its first block and stops
at the first block missing. Plain LRU evicts a prompt's *first* blocks first (they were stored first), leaving
tails that no request can reach. This order evicts:

1. **orphans** first: present blocks whose parent *left* this tier (evicted or dropped while they were here, or
   found absent at a restart: ``add(..., orphan=True)``), least recently used first: no load reaches them. A
   removed block's present children become orphans, so a dead subtree goes entirely before any live block;
2. then **leaves**: present blocks none of whose children is present, least recently used first; a block becomes
   a leaf once its last present child leaves, so a chain is evicted from its tail towards its head.

A block whose parent was never here (a suffix whose head lives in a tier above: a demotion, or a write-back, sends
a chain's tail first) is not an orphan: its parent may come; once it does, they are one chain. A block with
present children is never a victim unless it is an orphan; a forest always has a leaf, so a victim exists
whenever a block is present. A parent not given (None) makes a block a root (plain LRU among roots and leaves).

Kept as: the parent of each present block, the present children of each parent (present or not), the orphans, a
last-use serial per present block, and a heap of (class, serial, name) entries checked when popped (an entry
whose block's class or serial changed since is dropped; the heap is rebuilt when it holds more than 4 entries a
block). O(log n) per :meth:`add` / :meth:`touch` / :meth:`remove` / :meth:`victim` (amortized), plus
O(children x log n) when a parent is added or removed. Names are any hashable (store names, chain keys). Not
thread-safe (the owner locks).
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterator

__all__ = ["ChainOrder", "ORPHAN", "LEAF"]

ORPHAN, LEAF = 0, 1


class ChainOrder:
    """The chain-aware eviction order (see the module docstring). Public state read-only: ``len()``, ``in``."""

    __slots__ = ("_parent", "_kids", "_stamp", "_heap", "_serial", "_lost")

    def __init__(self) -> None:
        self._parent: dict = {}  # present name -> its parent's name (None: a root, or not known)
        self._kids: dict = {}  # name (present or not) -> set of its present children
        self._stamp: dict = {}  # present name -> serial of its last use
        self._heap: list = []  # (class, serial, name), checked when popped
        self._serial = 0
        self._lost: set = set()  # present names whose parent left (orphans)

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._stamp

    def __iter__(self) -> Iterator:
        return iter(self._stamp)

    def parent(self, name: Hashable):
        """The parent given when ``name`` was added (None: a root or unknown). KeyError if absent."""
        return self._parent[name]

    def has_children(self, name: Hashable) -> bool:
        return bool(self._kids.get(name))

    def klass(self, name: Hashable) -> int | None:
        """ORPHAN, LEAF, or None (an inner block: not evictable now) for a present ``name``. O(1)."""
        if name in self._lost:
            return ORPHAN
        return None if self._kids.get(name) else LEAF

    @property
    def num_orphans(self) -> int:
        """Present blocks whose parent left (dead weight, evicted first). O(1)."""
        return len(self._lost)

    def _push(self, name: Hashable) -> None:
        c = self.klass(name)
        if c is not None:
            heapq.heappush(self._heap, (c, self._stamp[name], name))
            if len(self._heap) > 4 * len(self._stamp) + 64:
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(c, self._stamp[n], n) for n in self._stamp for c in (self.klass(n),) if c is not None]
        heapq.heapify(self._heap)

    def add(self, name: Hashable, parent: Hashable | None = None, orphan: bool = False) -> None:
        """A block is now present, the most recently used; ``parent``: its parent's name (None: a root or not
        known); ``orphan``: its parent is known to be gone (a restart found it absent), unless present. Its
        present children (added before it) stop being orphans. ``name`` must be absent."""
        if name in self._stamp:
            raise KeyError(f"{name!r} is present already")
        if parent == name:
            parent = None
        self._serial += 1
        self._stamp[name] = self._serial
        self._parent[name] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(name)
            if orphan and parent not in self._stamp:
                self._lost.add(name)
        for k in self._kids.get(name, ()):  # (no longer orphans: each a leaf or an inner block now)
            self._lost.discard(k)
            self._push(k)
        self._push(name)

    def touch(self, name: Hashable) -> None:
        """``name`` (present) was used: the most recently used now."""
        self._serial += 1
        self._stamp[name] = self._serial
        self._push(name)

    def remove(self, name: Hashable) -> None:
        """``name`` leaves (evicted or dropped); its parent may become a leaf, its present children orphans.
        Absent: nothing."""
        if self._stamp.pop(name, None) is None:
            return
        self._lost.discard(name)
        p = self._parent.pop(name)
        if p is not None:
            ks = self._kids[p]
            ks.discard(name)
            if not ks:
                del self._kids[p]
            if p in self._stamp:
                self._push(p)
        for k in self._kids.get(name, ()):
            self._lost.add(k)
            self._push(k)

    def victim(self, spare_children_of: Hashable | None = None):
        """The next block to evict (see the module docstring) without removing it, or None when none is
        present. ``spare_children_of``: a block about to be added; its present children (orphans until it comes)
        are passed over. O(log n) amortized, plus O(its children x log n)."""
        h = self._heap
        st = self._stamp
        spared = []
        found = None
        while h:
            c, s, n = h[0]
            if st.get(n) == s and self.klass(n) == c:
                if spare_children_of is None or self._parent[n] != spare_children_of:
                    found = n
                    break
                spared.append(h[0])
            heapq.heappop(h)
        for e in spared:
            heapq.heappush(h, e)
        return found

    def pop(self):
        """Remove and return :meth:`victim` (None when empty)."""
        n = self.victim()
        if n is not None:
            self.remove(n)
        return n

    def copy(self) -> "ChainOrder":
        """An independent copy. O(n)."""
        o = ChainOrder()
        o._parent, o._stamp, o._lost = dict(self._parent), dict(self._stamp), set(self._lost)
        o._kids = {p: set(ks) for p, ks in self._kids.items()}
        o._heap, o._serial = list(self._heap), self._serial
        return o

    def eviction_order(self) -> list:
        """Every present block, the next victim first (as successive :meth:`pop` calls would evict them; without
        parents: least recently used first). O(n log n), on a copy."""
        o = self.copy()
        return [o.pop() for _ in range(len(o))]

    def check_invariants(self) -> None:
        """Every present evictable block has a live heap entry; children sets hold present names only. O(n)."""
        live = {(c, s, n) for c, s, n in self._heap if self._stamp.get(n) == s and self.klass(n) == c}
        for n in self._stamp:
            c = self.klass(n)
            assert c is None or (c, self._stamp[n], n) in live, n
            p = self._parent[n]
            assert p is None or n in self._kids[p], n
        for p, ks in self._kids.items():
            assert ks and all(k in self._stamp and self._parent[k] == p for k in ks), p
        assert self._lost <= self._stamp.keys()
        assert all(self._parent[n] is not None and self._parent[n] not in self._stamp for n in self._lost)
        if self._stamp:
            assert self.victim() is not None
