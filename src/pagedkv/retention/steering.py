"""Retention a user steers: request priorities and pinned prefixes over an eviction policy (:class:`SteeredEvictor`).

A :class:`pagedkv.BlockManager` installs it the first time a sequence is given a non-default priority or a
prefix is pinned (``set_retention``, ``pin_prefix``); until then the plain policy evictor runs alone and the hot
path is unchanged.

- *Priority classes* (vLLM's ``priority``: a lower value is a higher priority, the default is 0). When a sequence
  is freed its blocks are tagged with its priority; a block that becomes unreferenced goes into its tag's class
  (an evictor of the manager's policy), and the class of the largest value is evicted first. A block shared by
  several sequences takes the priority of the one that releases it last. Untagged releases (a sliding window
  dropping blocks, a sequence without priority) count as priority 0.
- *Pins* (a system prompt, a tool list): a pinned block is never evicted while pinned. When it becomes
  unreferenced it is *parked* (cached, out of every class); unpinned, it goes to the most recent end of its
  class. Pins hold at most ``budget`` distinct blocks; a pin past it is refused (PinBudgetError) and changes
  nothing. A pin may have a TTL in seconds, refreshed each time its last block is taken back by a hit or
  released; expired pins are dropped lazily, by the next call that counts or evicts evictable blocks. A block
  whose content left the cache while pinned (an aborted write) is no longer held by its pin.
- *Spare blocks* (:class:`pagedkv.HybridBlockManager`'s window retention, :mod:`pagedkv.hybrid._retention`): over a
  :class:`~pagedkv.blocks.evictor.RetentionEvictor` the steered evictor keeps its *spare* LRU (released
  sliding-window blocks no hit point needs) above every class: spare blocks of any priority are evicted before
  any block of a class (:meth:`SteeredEvictor.demote_many` moves idle blocks there; pinned ones stay parked).

Costs: O(1) per block on top of the policy (a class lookup); a pin or unpin O(its blocks); expiry O(pins).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, NamedTuple

import numpy as np

from ..errors import PinBudgetError, UnknownPinError

__all__ = ["Pin", "SteeredEvictor"]


def _now() -> float:
    """The pins' clock (seconds, monotonic)."""
    return time.monotonic()


class Pin(NamedTuple):
    """A pinned prefix: its id (for ``unpin``), the tokens and GPU blocks it holds, its TTL (None: until unpinned)."""

    pin_id: int
    num_tokens: int
    num_blocks: int
    ttl: float | None


class SteeredEvictor:
    """Priority classes and pins over evictors made by ``make(num_blocks)``; ``base`` (already holding blocks)
    becomes the class of priority 0. ``cid`` is the prefix cache's content-id array (a pin holds a block only
    while its content is the one pinned). The evictor methods of :class:`pagedkv.blocks.evictor.LRUEvictor`, plus
    :meth:`tag`, :meth:`pin`, :meth:`unpin`, :meth:`drop_pins` and :meth:`check`. ``len`` counts evictable
    blocks only (parked ones are neither free nor evictable)."""

    def __init__(self, base, num_blocks: int, make: Callable, cid: np.ndarray, budget: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        self._make, self._nb, self._cid = make, num_blocks, cid
        # over a RetentionEvictor (window retention): its spare LRU stays above every class, its main one is class 0
        self.spare = getattr(base, "spare", None)
        if self.spare is not None:
            base = base.main
        self.classes = {0: base}
        self._order = [0]  # eviction order: largest priority value first
        self.tagged = np.zeros(num_blocks, dtype=np.int64)  # the priority of the block's next push
        self.where = np.zeros(num_blocks, dtype=np.int64)  # the class a block in the evictor sits in
        self.pin_count = np.zeros(num_blocks, dtype=np.int32)
        self.pin_cid = np.zeros(num_blocks, dtype=np.int64)
        self.parked = np.zeros(num_blocks, dtype=np.bool_)
        self.num_parked = 0
        self.num_pinned = 0  # distinct pinned blocks (what the budget counts)
        self.budget = budget
        self.pins: dict = {}  # pin id -> [blocks, ttl, deadline, num_tokens]
        self._last: dict = {}  # a pin's last block -> its pin ids (a hit on the whole pin uses that block)
        self._next_id = 1
        self._deadline = math.inf
        self._clock = clock if clock is not None else (lambda: _now())

    # ------------------------------------------------------------------ classes
    def _class(self, prio: int):
        c = self.classes.get(prio)
        if c is None:
            c = self.classes[prio] = self._make(self._nb)
            self._order = sorted(self.classes, reverse=True)
        return c

    def tag(self, blocks: np.ndarray, priority: int) -> None:
        """The priority ``blocks`` (about to be released) take into the evictor."""
        self.tagged[blocks] = priority

    def hint(self, blocks: np.ndarray, session: object) -> None:
        """Pass a session hint to the policy of the class the blocks are tagged for."""
        if blocks.size:
            self._class(int(self.tagged[blocks[0]])).hint(blocks, session)

    def held(self, blocks: np.ndarray) -> np.ndarray:
        """Which ``blocks`` a pin holds (pinned for the content they hold now): parked, not evictable, once idle."""
        return (self.pin_count[blocks] > 0) & (self.pin_cid[blocks] == self._cid[blocks])

    def push(self, block: int) -> None:
        if self.pin_count[block] and self.pin_cid[block] == self._cid[block]:
            self.parked[block] = True
            self.num_parked += 1
            self._touch(block)
            return
        p = int(self.tagged[block])
        self.tagged[block] = 0
        self.where[block] = p
        self._class(p).push(block)

    def push_many(self, blocks: np.ndarray) -> None:
        if blocks.size == 0:
            return
        if self.num_pinned:
            held = self.held(blocks)
            if held.any():
                for b in blocks[held].tolist():
                    self.push(b)
                blocks = blocks[~held]
                if blocks.size == 0:
                    return
        p = self.tagged[blocks]
        self.tagged[blocks] = 0
        self.where[blocks] = p
        p0 = int(p[0])
        if (p == p0).all():
            self._class(p0).push_many(blocks)
            return
        for v in dict.fromkeys(p.tolist()):  # each class keeps the release order
            self._class(v).push_many(blocks[p == v])

    def discard(self, block: int) -> None:
        if self.parked[block]:
            self.parked[block] = False
            self.num_parked -= 1
            self._touch(block)
            return
        sp = self.spare
        if sp is not None and sp.stamp_mv[block]:
            sp.discard(block)
            return
        self.classes[int(self.where[block])].discard(block)

    def discard_many(self, blocks: np.ndarray) -> None:
        if blocks.size == 0:
            return
        if self.num_parked:
            pk = self.parked[blocks]
            if pk.any():
                for b in blocks[pk].tolist():
                    self.discard(b)
                blocks = blocks[~pk]
        sp = self.spare
        if sp is not None and len(sp):
            m = sp.stamp[blocks] != 0
            if m.any():
                sp.discard_many(blocks[m])
                blocks = blocks[~m]
        if len(self.classes) == 1:
            self.classes[0].discard_many(blocks)
            return
        w = self.where[blocks]
        for v in set(w.tolist()):
            self.classes[v].discard_many(blocks[w == v])

    def demote_many(self, blocks: np.ndarray) -> None:
        """Move idle ``blocks`` (distinct, in order) out of their classes to the most recent end of the spare LRU
        (window retention); blocks that are not in a class (referenced, parked, evicted, spare already) are
        ignored. O(blocks) numpy work plus one call per class touched."""
        sp = self.spare
        if sp is None or blocks.size == 0:
            return
        blocks = np.asarray(blocks, dtype=np.int64)
        inside = np.fromiter((b in self.classes[w] for b, w in zip(blocks.tolist(), self.where[blocks].tolist())),
                             dtype=np.bool_, count=blocks.size)
        blocks = blocks[inside]
        if blocks.size == 0:
            return
        w = self.where[blocks]
        for v in set(w.tolist()):
            self.classes[v].discard_many(blocks[w == v])
        sp.push_many(blocks)

    def pop(self) -> int:
        self._due()
        sp = self.spare
        if sp is not None and len(sp):
            return sp.pop()
        for p in self._order:
            c = self.classes[p]
            if len(c):
                return c.pop()
        raise IndexError("pop from an empty evictor")

    def pop_many(self, n: int) -> np.ndarray:
        self._due()
        out = []
        sp = self.spare
        if sp is not None and len(sp):
            k = min(n, len(sp))
            out.append(sp.pop_many(k).astype(np.int32))
            n -= k
            if not n:
                return out[0]
        for p in self._order:
            c = self.classes[p]
            k = min(n, len(c))
            if k:
                out.append(c.pop_many(k))
                n -= k
                if not n:
                    break
        return out[0] if len(out) == 1 else np.concatenate(out).astype(np.int32)

    def __len__(self) -> int:
        self._due()
        n = sum(len(c) for c in self.classes.values())
        return n + len(self.spare) if self.spare is not None else n

    def __contains__(self, block: int) -> bool:
        return (self.spare is not None and block in self.spare) or any(block in c for c in self.classes.values())

    def __iter__(self) -> Iterator[int]:
        """Evictable blocks in eviction order (spare ones first, then the lowest priority's class first)."""
        if self.spare is not None:
            yield from self.spare
        for p in self._order:
            yield from self.classes[p]

    # ------------------------------------------------------------------ pins
    def pin(self, blocks: np.ndarray, num_tokens: int, ttl: float | None) -> Pin:
        """Pin ``blocks`` (cached GPU blocks of one prefix, in order). Raises PinBudgetError, changing nothing,
        when the distinct pinned blocks would exceed the budget."""
        blocks = np.asarray(blocks, dtype=np.int64)
        new = np.unique(blocks[self.pin_count[blocks] == 0])
        if self.num_pinned + new.size > self.budget:
            raise PinBudgetError(
                f"pinning {blocks.size} blocks ({new.size} not pinned yet) would hold {self.num_pinned + new.size} "
                f"pinned blocks; the pin budget is {self.budget} (pin_budget_blocks)")
        fresh = blocks[~self.held(blocks)]  # not held until now (new, or their pinned content had left)
        self.pin_cid[blocks] = self._cid[blocks]
        self.pin_count[blocks] += 1
        self.num_pinned += new.size
        sp = self.spare
        for b in fresh.tolist():  # idle ones leave their class (or the spare LRU) for the parking
            if sp is not None and sp.stamp_mv[b]:
                sp.discard(b)
                self.parked[b] = True
                self.num_parked += 1
                continue
            c = self.classes.get(int(self.where[b]))
            if c is not None and b in c:
                c.discard(b)
                self.parked[b] = True
                self.num_parked += 1
        pid = self._next_id
        self._next_id += 1
        deadline = math.inf if ttl is None else self._clock() + ttl
        self.pins[pid] = [blocks, ttl, deadline, num_tokens]
        if blocks.size:
            self._last.setdefault(int(blocks[-1]), set()).add(pid)
        self._deadline = min(self._deadline, deadline)
        return Pin(pid, num_tokens, int(blocks.size), ttl)

    def unpin(self, pin_id: int) -> None:
        """Drop a pin; its blocks no other pin holds become evictable (idle ones at the most recent end)."""
        rec = self.pins.pop(pin_id, None)
        if rec is None:
            raise UnknownPinError(f"no pin {pin_id!r} (unpinned already, expired, or never made)")
        blocks = rec[0]
        if blocks.size:
            last = int(blocks[-1])
            s = self._last[last]
            s.discard(pin_id)
            if not s:
                del self._last[last]
        self.pin_count[blocks] -= 1
        gone = blocks[self.pin_count[blocks] == 0]
        self.num_pinned -= gone.size
        back = gone[self.parked[gone]]
        if back.size:
            self.parked[back] = False
            self.num_parked -= back.size
            self.push_many(back)

    def _touch(self, block: int) -> None:
        pids = self._last.get(block)
        if pids:
            now = self._clock()
            for pid in pids:
                rec = self.pins[pid]
                if rec[1] is not None:
                    rec[2] = now + rec[1]

    def _due(self) -> None:
        if self._deadline != math.inf and self._clock() >= self._deadline:
            now = self._clock()
            for pid in [p for p, r in self.pins.items() if r[2] <= now]:
                self.unpin(pid)
            self._deadline = min((r[2] for r in self.pins.values()), default=math.inf)

    def pin_list(self) -> tuple:
        """The live pins (expired ones dropped first)."""
        self._due()
        return tuple(Pin(pid, r[3], int(r[0].size), r[1]) for pid, r in self.pins.items())

    def drop_pins(self) -> list:
        """Drop every pin (the cache is being cleared); return the parked blocks, now unreferenced and
        unparked, for the free list."""
        out = np.flatnonzero(self.parked).tolist()
        self.parked[:] = False
        self.num_parked = 0
        self.pin_count[:] = 0
        self.num_pinned = 0
        self.pins.clear()
        self._last.clear()
        self._deadline = math.inf
        return out

    def verify(self) -> None:
        """Assert every class's (and the spare LRU's) bookkeeping (tests). O(entries)."""
        for c in self.classes.values():
            c.verify()
        if self.spare is not None:
            self.spare.verify()

    def check(self, ref: np.ndarray, fail) -> None:
        """Invariants: parked blocks are unreferenced, cached, pinned for their content and in no class; the
        pinned count is the budget's count; every class holds only blocks filed under it."""
        pk = np.flatnonzero(self.parked)
        if pk.size != self.num_parked:
            fail("parked count is wrong")
        if (ref[pk] != 0).any() or (self._cid[pk] == 0).any() or not self.held(pk).all():
            fail("a parked block is referenced, uncached or not pinned for its content")
        if int(np.count_nonzero(self.pin_count)) != self.num_pinned or self.num_pinned > self.budget:
            fail("pinned blocks are not counted within the budget")
        if (self.pin_count < 0).any():
            fail("a pin count is negative")
        spare = np.asarray(list(self.spare) if self.spare is not None else [], dtype=np.int64)
        if self.parked[spare].any():
            fail("a spare block is parked")
        for p, c in self.classes.items():
            inside = np.asarray(list(c), dtype=np.int64)
            if (self.where[inside] != p).any() or self.parked[inside].any():
                fail(f"priority class {p} holds a block filed elsewhere or parked")
            if np.intersect1d(inside, spare).size:
                fail(f"priority class {p} holds a spare block")
        counts = np.zeros_like(self.pin_count)
        for blocks, *_ in self.pins.values():
            np.add.at(counts, blocks, 1)
        if (counts != self.pin_count).any():
            fail("pin counts are not the pins' blocks")
