"""The base class of every eviction policy (:class:`EvictionPolicy`) and the table of policies by name.

An evictor holds the prefix cache's *evictable* blocks (unreferenced, cached) and says which goes first when
blocks are needed. The base class owns everything the policies share; a policy adds only its choice::

    base (here)                                  a policy (one or two hooks)
    ------------------------------------------   ------------------------------------------------------------
    stamp[b]  int64, the serial of b's entry      place(blocks)  where released blocks are filed: segment and
              (0: not evictable); len, in            key (default: segment 0, key 0, i.e. LRU)
    segments: push logs with lazy deletion,      choose(n)      the n victims (default: smallest (key, serial)
              (block, serial, key) per entry         first over every segment's oldest entry)
    push / discard / pop (one and many),         optional: on_hit(blocks) (a hit took them back), emptied(s)
    head, iteration, verify (invariants)              (a segment lost its last block), hint(blocks, session),
                                                     order() (iteration, when choose is not the default)

A *segment* is an ordered class of blocks (LRU's only list; SLRU's probation and protected; ARC's T1 and T2; a
session level; a density release). Each entry is ``(block, serial, key)``: serials grow over the whole evictor, so
an entry is live iff ``stamp[block] == serial`` and a discard only zeroes ``stamp[block]`` (O(1), the entry goes
stale wherever it is). Keys must not decrease along a segment; the default ``choose`` then merges the segments by
``(key, serial)``. A log compacts itself when full (live entries to the front, doubled when still more than half
live): O(1) amortised per push, no per-block objects; 16 bytes per block (``stamp``, ``seg``) plus 12 per log
entry (20 for a policy that reads keys), at most about twice the blocks held.

Policies register by name in :data:`POLICIES` (``class MyPolicy(EvictionPolicy, name="mine")``);
:func:`make_policy` builds one from a name, a class or an instance's class. Costs of the plumbing: ``push`` /
``discard`` / ``pop`` of one block O(1) (memoryview writes), batch forms a few numpy calls whatever their size, the
default ``choose`` O(segments) per call plus numpy work for the blocks taken.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["EvictionPolicy", "POLICIES", "make_policy", "policy_class"]

POLICIES: dict = {}  # name -> EvictionPolicy subclass (filled by class definitions: ``name=`` in the class line)

_EMPTY = np.empty(0, dtype=np.int32)


class _Log:
    """One segment: entries ``[head, tail)`` of ``b`` (int32 block), ``c`` (int64 serial) and, for a policy
    that reads keys, ``k`` (int64 key; else None); ``live``: its live entries (blocks filed here and still
    evictable; not kept for a plain policy's segment)."""

    __slots__ = ("b", "c", "k", "bm", "cm", "km", "head", "tail", "live", "keyed", "cap")

    def __init__(self, keyed: bool, capacity: int = 64) -> None:
        self.keyed = keyed
        self._alloc(capacity)
        self.head = self.tail = 0
        self.live = 0

    def _alloc(self, size: int) -> None:
        self.cap = size
        self.b = np.empty(size, dtype=np.int32)
        self.c = np.empty(size, dtype=np.int64)
        self.bm, self.cm = memoryview(self.b), memoryview(self.c)
        self.k = np.empty(size, dtype=np.int64) if self.keyed else None
        self.km = memoryview(self.k) if self.keyed else None

    def room(self, n: int, stamp: np.ndarray) -> None:
        """Make room for ``n`` more entries: drop the stale ones (and reallocate to twice what stays)."""
        h, z = self.head, self.tail
        lb, lc = self.b[h:z], self.c[h:z]
        keep = stamp[lb] == lc
        lb, lc = lb[keep], lc[keep]  # (copies)
        lk = self.k[h:z][keep] if self.keyed else None
        m = lb.size
        size = max(64, 2 * (m + n))
        if size != self.cap:
            self._alloc(size)
        self.b[:m], self.c[:m] = lb, lc
        if self.keyed:
            self.k[:m] = lk
        self.head, self.tail = 0, m

    def first(self, smv) -> int:
        """The index of the oldest live entry (stale ones before it dropped), -1 if none."""
        h, z, bm, cm = self.head, self.tail, self.bm, self.cm
        while h < z:
            if smv[bm[h]] == cm[h]:
                self.head = h
                return h
            h += 1
        self.head = h
        return -1

    def take(self, n: int, stamp: np.ndarray, below: tuple | None = None) -> np.ndarray:
        """Remove the up to ``n`` oldest live entries (only those whose ``(key, serial)`` is below ``below``
        when given); return their blocks (int32), their stamps zeroed."""
        if n <= 2 and below is None:  # one or two blocks: element reads beat numpy's fixed costs
            h, z, bm, cm = self.head, self.tail, self.bm, self.cm
            out = []
            while h < z:
                b = bm[h]
                if stamp[b] == cm[h]:
                    out.append(b)
                    if len(out) == n:
                        h += 1
                        break
                h += 1
            self.head = h
            got = np.array(out, dtype=np.int32)
            stamp[got] = 0
            self.live -= got.size
            return got
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
            live = np.flatnonzero(stamp[lb] == self.c[h:e])
            if live.size >= n:
                out.append(lb[live[:n]])
                h += int(live[n - 1]) + 1
                break
            if live.size:
                out.append(lb[live])
                n -= live.size
            h = e
        self.head = h
        got = out[0] if len(out) == 1 else (np.concatenate(out) if out else _EMPTY)
        stamp[got] = 0
        self.live -= got.size
        return got

    def blocks(self, stamp: np.ndarray, n: int | None = None) -> np.ndarray:
        """The live blocks oldest first (the first ``n`` only, when given), without changing anything."""
        h, z = self.head, self.tail
        if n is None:
            lb = self.b[h:z]
            return lb[stamp[lb] == self.c[h:z]]
        out, got = [], 0
        step = max(64, 2 * n)
        while h < z and got < n:
            e = min(z, h + step)
            lb = self.b[h:e]
            lb = lb[stamp[lb] == self.c[h:e]][: n - got]
            out.append(lb)
            got += lb.size
            h = e
        return np.concatenate(out) if out else _EMPTY


class _Segment:
    """A read-only view of one segment: ``len`` (its blocks) and iteration (oldest first)."""

    __slots__ = ("_ev", "_s")

    def __init__(self, ev: "EvictionPolicy", s: int) -> None:
        self._ev, self._s = ev, s

    def __len__(self) -> int:
        return self._ev.count(self._s)

    def __iter__(self) -> Iterator[int]:
        return iter(self.blocks().tolist())

    def blocks(self) -> np.ndarray:
        """Its blocks, oldest first (a fresh int32 array)."""
        return self._ev.segment_blocks(self._s)


class EvictionPolicy:
    """An eviction order over the blocks ``0 .. num_blocks - 1`` (see the module docstring). The evictor API the
    prefix cache calls: :meth:`push` / :meth:`push_many` (blocks became evictable, in release order: a freed
    sequence's blocks tail first; not in the evictor), :meth:`discard` / :meth:`discard_many` (a hit took them
    back; in the evictor), :meth:`pop` / :meth:`pop_many` (evict the policy's choice; ``n <= len``),
    :meth:`head`, ``len``, ``in``, iteration in eviction order and :meth:`hint`. A subclass overrides the hooks
    only; ``stamp`` (and ``stamp_mv``) is public for membership tests of many blocks at once (read only).

    Subclass hooks, all optional (none: exactly LRU):

    - ``place(blocks)``: file released ``blocks`` (int array, in release order) with :meth:`append` (any
      segments, keys and order; every block exactly once); may move blocks with :meth:`take` + :meth:`append`.
    - ``choose(n)``: remove and return the ``n`` victims (int32 array, eviction order) with :meth:`take`.
    - ``order()``: the blocks in eviction order (an int array), for a policy whose ``choose`` is not the default.
    - ``on_hit(blocks)``: a hit took ``blocks`` back (an int or an int array: index flat arrays with it).
    - ``emptied(segment)``: the last block of ``segment`` left it (discarded or taken).
    - ``hint(blocks, session)``: a sequence carrying a session hint is about to release ``blocks``.
    - ``build(num_blocks, cache)`` (classmethod): construct for a pool, reading the prefix cache's flat arrays.
    - speed only, same meaning: ``place_one(block)`` and ``choose_one()`` (one block: write them with
      :meth:`append_one` and :meth:`take_one`, memoryview writes instead of numpy calls).
    """

    __slots__ = ("stamp", "stamp_mv", "seg", "seg_mv", "_logs", "_serial", "_n", "_log0")

    name: str | None = None
    # (set per subclass: which hooks it has)
    _plain, _merge, _hit_hook, _empty_hook, _keyed = True, True, False, False, False

    def __init_subclass__(cls, name: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        base = EvictionPolicy
        hit, empty = cls.on_hit is not base.on_hit, cls.emptied is not base.emptied
        merge = cls.choose is base.choose
        # plain: no hook but (maybe) hint, so one segment and LRU order: push, discard and pop take fast paths
        plain = (cls.place is base.place and cls.place_one is base.place_one and merge
                 and cls.choose_one is base.choose_one and not (hit or empty))
        keyed = (merge or cls.order is base.order) and not plain  # (whether anything reads the keys)
        for flag, value in (("_hit_hook", hit), ("_empty_hook", empty), ("_merge", merge), ("_plain", plain),
                            ("_keyed", keyed)):
            setattr(cls, flag, value)
        form = "plain" if plain else "hooked"
        for call in ("push", "push_many", "discard", "pop", "pop_many"):
            if call not in cls.__dict__:
                setattr(cls, call, getattr(base, f"_{call}_{form}"))
        if not plain:  # (one call less: push and pop are the hooks themselves)
            if "push" not in cls.__dict__:
                setattr(cls, "push", cls.place_one)
            if "pop" not in cls.__dict__:
                setattr(cls, "pop", cls.choose_one)
        if name is not None:
            cls.name = name
            POLICIES[name] = cls

    def __init__(self, num_blocks: int) -> None:
        self.stamp = np.zeros(num_blocks, dtype=np.int64)
        self.stamp_mv = memoryview(self.stamp)
        self.seg = np.zeros(num_blocks, dtype=np.int64)  # the segment a block in the evictor is filed in (any int)
        self.seg_mv = memoryview(self.seg)
        self._log0 = _Log(self._keyed)
        self._logs = {0: self._log0}  # segment -> _Log (segment 0 always present)
        self._serial = 0
        self._n = 0

    @classmethod
    def build(cls, num_blocks: int, cache=None) -> "EvictionPolicy":
        """The policy for a pool of ``num_blocks`` over ``cache`` (a PrefixCache; its flat arrays by block id)."""
        return cls(num_blocks)

    # ------------------------------------------------------------------ hooks (defaults: LRU)
    def place(self, blocks: np.ndarray) -> None:
        """Hook: file released ``blocks`` (default: segment 0, key 0, in order)."""
        self.append(0, blocks)

    def choose(self, n: int) -> np.ndarray:
        """Hook: remove and return ``n`` victims (default: smallest ``(key, serial)`` first over the segments; keys
        are kept unless a policy overrides both ``choose`` and ``order``)."""
        logs = self._logs
        if len(logs) == 1 or self._log0.live == self._n:
            return self.take(0, n)
        out = []
        smv = self.stamp_mv
        while n:
            heads = []
            for s, log in list(logs.items()):
                h = log.first(smv) if log.live else -1
                if h < 0:
                    if s:
                        del logs[s]
                else:
                    heads.append((log.km[h], log.cm[h], s))
            heads.sort()
            s = heads[0][2]
            got = self.take(s, n, heads[1][:2] if len(heads) > 1 else None)
            out.append(got)
            n -= got.size
        return out[0] if len(out) == 1 else (np.concatenate(out) if out else _EMPTY)

    def order(self) -> np.ndarray:
        """Hook: the blocks in eviction order (default: by ``(key, serial)``)."""
        if self._plain:
            return self._log0.blocks(self.stamp)
        logs = [log for log in self._logs.values() if log.live]
        if len(logs) <= 1:
            return logs[0].blocks(self.stamp) if logs else _EMPTY
        st = self.stamp
        b = np.concatenate([log.b[log.head : log.tail] for log in logs])
        c = np.concatenate([log.c[log.head : log.tail] for log in logs])
        k = np.concatenate([log.k[log.head : log.tail] for log in logs])
        live = st[b] == c
        b, c, k = b[live], c[live], k[live]
        return b[np.lexsort((c, k))]

    def place_one(self, block: int) -> None:
        """Speed hook: :meth:`place` of one block (default: ``place`` of an array of one)."""
        self.place(np.array([block], dtype=np.int32))

    def choose_one(self) -> int:
        """Speed hook: :meth:`choose` of one victim (default: ``choose(1)``)."""
        return int(self.choose(1)[0])

    def on_hit(self, blocks) -> None:
        """Hook: a hit took ``blocks`` back (default: nothing)."""

    def emptied(self, segment: int) -> None:
        """Hook: ``segment`` lost its last block (default: nothing)."""

    def hint(self, blocks: np.ndarray, session: object) -> None:
        """Hook: ``blocks`` of a sequence carrying ``session`` are about to be released (default: no hint taken)."""

    # ------------------------------------------------------------------ primitives for the hooks
    def new_serials(self, n: int) -> np.ndarray:
        """The next ``n`` serials (int64), reserved (for a policy that files one release's blocks apart)."""
        s = self._serial
        self._serial = s + n
        return np.arange(s + 1, s + n + 1, dtype=np.int64)

    def append(self, segment: int, blocks: np.ndarray, key: int = 0, serials: np.ndarray | None = None) -> None:
        """File ``blocks`` (not in the evictor) at the end of ``segment`` under ``key`` (not below the segment's
        last key), with fresh serials unless ``serials`` (from :meth:`new_serials`) are given."""
        n = blocks.size
        if n == 0:
            return
        if serials is None:
            serials = self.new_serials(n)
        log = self._logs.get(segment)
        if log is None:
            log = self._logs[segment] = _Log(self._keyed)
        if log.tail + n > log.cap:
            log.room(n, self.stamp)
        z = log.tail
        log.b[z : z + n] = blocks
        log.c[z : z + n] = serials
        if self._keyed:
            log.k[z : z + n] = key
        log.tail = z + n
        log.live += n
        self.stamp[blocks] = serials
        self.seg[blocks] = segment
        self._n += n

    def take(self, segment: int, n: int, below: tuple | None = None) -> np.ndarray:
        """Remove and return up to ``n`` of ``segment``'s oldest blocks (int32; only entries whose ``(key,
        serial)`` is below ``below`` when given)."""
        log = self._logs.get(segment)
        if log is None or n <= 0:
            return _EMPTY
        got = log.take(n, self.stamp, below)
        self._n -= got.size
        if self._empty_hook and got.size and not log.live:
            self.emptied(segment)
        return got

    def append_one(self, segment: int, block: int, key: int = 0) -> None:
        """:meth:`append` of one block (memoryview writes: the fast form for :meth:`place_one`)."""
        log = self._logs.get(segment)
        if log is None:
            log = self._logs[segment] = _Log(self._keyed)
        z = log.tail
        if z == log.cap:
            log.room(1, self.stamp)
            z = log.tail
        s = self._serial = self._serial + 1
        log.bm[z] = block
        log.cm[z] = s
        if self._keyed:
            log.km[z] = key
        log.tail = z + 1
        log.live += 1
        self.stamp_mv[block] = s
        self.seg_mv[block] = segment
        self._n += 1

    def take_one(self, segment: int) -> int:
        """:meth:`take` of one block (``segment`` is not empty; the fast form for :meth:`choose_one`)."""
        log = self._logs[segment]
        smv, bm, cm = self.stamp_mv, log.bm, log.cm
        h = log.head
        while True:
            b = bm[h]
            if smv[b] == cm[h]:
                break
            h += 1
        log.head = h + 1
        log.live -= 1
        smv[b] = 0
        self._n -= 1
        if self._empty_hook and not log.live:
            self.emptied(segment)
        return b

    def count(self, segment: int) -> int:
        """How many blocks ``segment`` holds."""
        if self._plain:
            return self._n if segment == 0 else 0
        log = self._logs.get(segment)
        return 0 if log is None else log.live

    def segment_blocks(self, segment: int) -> np.ndarray:
        """The blocks of ``segment``, oldest first (a fresh int32 array)."""
        log = self._logs.get(segment)
        return _EMPTY if log is None else log.blocks(self.stamp)

    def segment(self, segment: int) -> _Segment:
        """A read-only view of ``segment`` (``len``, iteration oldest first)."""
        return _Segment(self, segment)

    # ------------------------------------------------------------------ the evictor API
    def __len__(self) -> int:
        return self._n

    def __contains__(self, block: int) -> bool:
        return self.stamp_mv[block] != 0

    # the calls below come in two forms, bound per class when it is defined (no branch at run time): the plain
    # form (a policy with no hook: one segment, whose keys and live count are not kept, ``_n`` being its count)
    # and the hooked form
    def _push_plain(self, block: int) -> None:
        """``block`` (not in the evictor) became evictable."""
        log = self._log0
        z = log.tail
        if z == log.cap:
            log.room(1, self.stamp)
            z = log.tail
        s = self._serial = self._serial + 1
        log.bm[z] = block
        log.cm[z] = s
        log.tail = z + 1
        self.stamp_mv[block] = s
        self._n += 1

    def _push_hooked(self, block: int) -> None:
        """``block`` (not in the evictor) became evictable."""
        self.place_one(block)

    def _push_many_plain(self, blocks: np.ndarray) -> None:
        """:meth:`push` of each of ``blocks`` (distinct, not in the evictor), in release order."""
        n = blocks.size
        if n == 0:
            return
        log = self._log0
        if log.tail + n > log.cap:
            log.room(n, self.stamp)
        s, z = self._serial, log.tail
        serials = np.arange(s + 1, s + n + 1, dtype=np.int64)
        log.b[z : z + n] = blocks
        log.c[z : z + n] = serials
        self.stamp[blocks] = serials
        log.tail = z + n
        self._serial = s + n
        self._n += n

    def _push_many_hooked(self, blocks: np.ndarray) -> None:
        """:meth:`push` of each of ``blocks`` (distinct, not in the evictor), in release order."""
        if blocks.size:
            self.place(blocks)

    def _discard_plain(self, block: int) -> None:
        """A hit took ``block`` (in the evictor) back."""
        self.stamp_mv[block] = 0
        self._n -= 1

    def _discard_hooked(self, block: int) -> None:
        """A hit took ``block`` (in the evictor) back."""
        self.stamp_mv[block] = 0
        self._n -= 1
        s = self.seg_mv[block]
        log = self._logs[s]
        log.live -= 1
        if self._hit_hook:
            self.on_hit(block)
        if self._empty_hook and not log.live:
            self.emptied(s)

    def discard_many(self, blocks: np.ndarray) -> None:
        """:meth:`discard` of each of ``blocks`` (distinct, in the evictor)."""
        n = blocks.size
        if n == 0:
            return
        self.stamp[blocks] = 0
        self._n -= n
        logs = self._logs
        if len(logs) == 1:
            self._log0.live -= n
        else:
            u, cnt = np.unique(self.seg[blocks], return_counts=True)
            for s, c in zip(u.tolist(), cnt.tolist()):
                log = logs[s]
                log.live -= c
                if self._empty_hook and not log.live:
                    self.emptied(s)
        if self._hit_hook:
            self.on_hit(blocks)

    def _pop_plain(self) -> int:
        """Evict: remove and return the policy's next victim (the evictor is not empty)."""
        log = self._log0
        smv, bm, cm = self.stamp_mv, log.bm, log.cm
        h = log.head
        while True:
            b = bm[h]
            if smv[b] == cm[h]:
                break
            h += 1
        log.head = h + 1
        smv[b] = 0
        self._n -= 1
        return b

    def _pop_hooked(self) -> int:
        """Evict: remove and return the policy's next victim (the evictor is not empty)."""
        return self.choose_one()

    def _pop_many_plain(self, n: int) -> np.ndarray:
        """Remove and return the next ``n`` victims (int32, in eviction order; ``n <= len(self)``)."""
        if n <= 0:
            return _EMPTY
        got = self._log0.take(n, self.stamp)
        self._n -= got.size
        return got

    def _pop_many_hooked(self, n: int) -> np.ndarray:
        """Remove and return the next ``n`` victims (int32, in eviction order; ``n <= len(self)``)."""
        return self.choose(n) if n > 0 else _EMPTY

    push, push_many, discard, pop, pop_many = _push_plain, _push_many_plain, _discard_plain, _pop_plain, _pop_many_plain

    def head(self, n: int) -> list:
        """The next ``n`` victims (fewer if the evictor holds fewer), without changing anything."""
        if self._plain:
            return self._log0.blocks(self.stamp, n).tolist()
        return self.order()[:n].tolist()

    def __iter__(self) -> Iterator[int]:
        """The blocks in eviction order."""
        return iter(self.order().tolist())

    def verify(self) -> None:
        """Assert the bookkeeping (tests and the manager's check_invariants): every segment's live count is its live entries, they add up to
        ``len``, each evictable block has exactly one live entry, in the segment ``seg`` names. O(entries)."""
        st = self.stamp
        total, seen = 0, []
        for s, log in self._logs.items():
            b = log.blocks(st)
            assert b.size == self.count(s), f"segment {s}: {b.size} live entries, counted {self.count(s)}"
            assert (self.seg[b] == s).all(), f"segment {s} holds blocks filed elsewhere"
            if self._keyed and self._merge:
                assert (np.diff(log.k[log.head : log.tail]) >= 0).all(), f"segment {s}: keys decrease"
            total += b.size
            seen.append(b)
        assert total == self._n == int(np.count_nonzero(st)), "evictable count is wrong"
        if seen:
            allb = np.concatenate(seen)
            assert np.unique(allb).size == allb.size, "a block has two live entries"


def policy_class(policy) -> type:
    """The EvictionPolicy subclass of ``policy``: a registered name, a subclass, or an instance (its class).
    Raises InvalidArgumentError naming the registered policies for anything else."""
    if isinstance(policy, str):
        cls = POLICIES.get(policy)
        if cls is None:
            raise InvalidArgumentError(f"eviction_policy must be one of {', '.join(POLICIES)} (or an EvictionPolicy "
                                       f"subclass or instance); got {policy!r}")
        return cls
    if isinstance(policy, type) and issubclass(policy, EvictionPolicy):
        return policy
    if isinstance(policy, EvictionPolicy):
        return type(policy)
    raise InvalidArgumentError(f"eviction_policy must be one of {', '.join(POLICIES)} (or an EvictionPolicy subclass "
                               f"or instance); got {policy!r}")


def make_policy(policy, num_blocks: int, cache=None) -> EvictionPolicy:
    """A new evictor of ``policy`` (see :func:`policy_class`) for a pool of ``num_blocks`` over ``cache``."""
    return policy_class(policy).build(num_blocks, cache)
