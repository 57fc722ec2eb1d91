"""The router's prefix index: which replica holds which prefix-cache block, fed only by the replicas' KV events.

A block is named by its prefix-cache key (:func:`pagedkv.block_hashes`), which chains every earlier block of the
prompt, so "replica r holds blocks h0 .. h(k-1) of a prompt" is "r holds the first k keys". The index answers
:meth:`KVIndex.longest_prefix`: for each replica, how many leading keys of a prompt it holds.

Contract shared by :class:`MemoryIndex` and :class:`RedisIndex` (the :class:`KVIndex` protocol):

- ``apply(replica, event)`` takes one event, a :mod:`pagedkv.events` tuple, a wire struct of either layout of
  :mod:`pagedkv.server.kv_events`, or vLLM's own event object (dispatch on the class name: ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``; ``medium`` None reads as ``"GPU"``, see :mod:`pagedkv.events`; block
  hashes sent as vLLM's digest bytes are keyed by vLLM's int form of them, :func:`.vllm_hash.external_key`). Storing a block already
  present and removing one that is absent are no-ops, so applying a stream twice gives the same index.
  ``AllBlocksCleared`` forgets every block of that replica's own tiers (the replica stays known; the shared store
  is not emptied). Cost: O(blocks in the event).
- ``longest_prefix(hashes, medium=None) -> {replica: matched blocks}``: the number of leading ``hashes`` each
  known replica can read from the media ``medium`` names: one medium (``"GPU"``, ``"CPU"``, ``"DISK"``,
  ``"SHARED"``), a tuple / set of them (a block counts if it is in one of them), or None: all four. Replicas
  matching nothing are left out. Cost: O(matched length x replicas / word size) in memory, a pipelined round trip
  per chunk of 256 keys in Redis.
- ``shared_prefix(hashes) -> int``: the leading ``hashes`` the shared store holds (what a replica the index does
  not know yet can load).
- ``drop_replica(replica)`` forgets a replica and all the blocks of its own tiers (a replica that died; what it
  stored in the shared store stays there). O(its blocks).
- ``replicas()``, ``num_blocks(replica=None)`` (entries: (block, medium, replica) triples of the replicas' own
  tiers), ``num_shared_blocks()``, ``media`` (the media holding a block now, GPU always), ``has_cpu``.

**Media.** A replica's own tiers (GPU, CPU, DISK) are kept per block as the set of replicas holding it in that
medium. A block in the **shared** store (``"SHARED"``) is reachable from **every** replica, whichever one
reported it: the index keeps the set of shared blocks (per KV cache group), and a prompt's walk counts a shared
block for every known replica, so a replica's match may run through its own blocks and the shared ones
interleaved (the engine's lookup walks GPU -> CPU -> disk -> shared block by block). Nobody reports what the
shared store evicts by itself (Redis under ``allkeys-lru``, a swept directory): ``shared_capacity_blocks`` bounds
what the index believes it holds, least recently reported first out (a block reported again, stored or loaded,
becomes the most recent), to match the store's own LRU; None: unbounded. A chain reported parent first enters
children first, so its parent is the most recent and the bound drops a chain from its tail, as the store's LRU
and the tiers do.

A block whose parent was evicted stays in the index (the replica still holds it), but it is never counted: the
match stops at the first key a replica lacks, as the engine's own lookup does.

KV cache groups (a replica running :class:`pagedkv.HybridBlockManager`, or vLLM with a hybrid model). Its events
carry ``group_idx``, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``; an event without them belongs to
group 0, full attention (a single-group replica, read exactly as before). The index keeps each group's blocks
apart (a block of one group never counts for another, even when two groups name blocks with the same hash, as
vLLM's events do) and learns each replica's *layout* (group -> full attention or window W tokens) from its
``BlockStored`` events. A replica with more than group 0, or whose group 0 is not full attention, is scored by
the engine's own hybrid-hit rule: its match is the largest L (in blocks, within the prompt's hashes) such that
every full-attention group holds blocks [0, L) and every sliding-window group holds the blocks covering the
W - 1 tokens before L, the cached ones the first computed query reads (blocks [max(0, L - ceil((W - 1) /
block_size)), L)); other kinds (mamba, chunked local) are
read as needing block L-1 only. That needs the prompt's keys in each group: pass a
:class:`pagedkv.blocks.prefix_cache.PromptKeys` as ``hashes`` (a list of the group-0 keys that computes the others on
demand; the router does; its ``hit_blocks`` caps L where the engine caps a hit, one token before the prompt's
end). Given a plain list, a hybrid replica is scored on its group 0 alone when that is full attention (an upper
bound: its sliding windows are not checked), else not at all. Cost for hybrid replicas:
O(prompt blocks x groups) lookups plus O(blocks x log(window blocks)) bitmask ANDs per distinct layout.

An index kept elsewhere can be unreachable: every :class:`RedisIndex` method then raises
:class:`IndexUnavailableError` (after one retry and at most a few seconds of socket timeout), and its ``ping()``
says when the store answers again. The router treats that as a stale index: it routes on load alone and rebuilds
the index from the replicas' replay sockets once the store is back (docs/router-reliability.md).
"""

from __future__ import annotations

import functools
from typing import Callable, Hashable, Iterable, Protocol, Sequence, runtime_checkable

from ..errors import PagedKVError
from collections import OrderedDict

from ..events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED, medium_of
from .vllm_hash import external_key

__all__ = ["KVIndex", "MemoryIndex", "IndexUnavailableError", "event_kind",
           "hybrid_match"]


class IndexUnavailableError(PagedKVError, ConnectionError):
    """The store holding the index (Redis) did not answer: what the failed call changed there is unknown."""


def _guard(method):
    """``method`` with the Redis client's connection and timeout errors raised as :class:`IndexUnavailableError`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except self._outage as e:
            raise IndexUnavailableError(f"the Redis index is unreachable: {e}") from e

    return wrapper

_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)  # a replica's own tiers (SHARED: every replica's)
_ALL_MEDIA = frozenset((*_MEDIA, MEDIUM_SHARED))


def media_set(medium) -> frozenset:
    """The media a query names: None -> all four, a string -> that one, a tuple / set -> those (ValueError for
    an unknown or empty one)."""
    if medium is None:
        return _ALL_MEDIA
    ms = frozenset((medium,)) if isinstance(medium, str) else frozenset(medium)
    if not ms or not ms <= _ALL_MEDIA:
        raise ValueError(f"unknown medium {medium!r} (expected GPU, CPU, DISK, SHARED or a set of them)")
    return ms
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
_SLIDING_KINDS = (SLIDING_WINDOW, "sliding_window_mla")


def _group(event: object) -> int:
    """The event's KV cache group (``group_idx``; None reads as 0)."""
    g = getattr(event, "group_idx", None)
    if g is None:
        return 0
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise ValueError(f"group_idx must be an int >= 0, got {g!r}")
    return g


def _spec(event: object) -> tuple[int, int | None] | None:
    """``(group, blocks its hit needs before the hit point: None = all)`` from a BlockStored's group fields, or
    None when it names no group (a single-group replica)."""
    g = getattr(event, "group_idx", None)
    kind = getattr(event, "kv_cache_spec_kind", None)
    if g is None and kind is None:
        return None
    g = _group(event)
    if kind is None or kind == FULL_ATTENTION or kind == "sink_full_attention" or kind == "mla_attention":
        return g, None
    w = getattr(event, "kv_cache_spec_sliding_window", None)
    bs = getattr(event, "block_size", 0) or 0
    if kind in _SLIDING_KINDS and isinstance(w, int) and w > 0 and bs > 0:
        return g, -(-(w - 1) // bs)  # (the first computed query at L reads positions (L - W, L))
    return g, 1  # another kind (mamba, chunked local, ...): the state at the hit point only


def _is_hybrid(layout: dict) -> bool:
    return bool(layout) and (len(layout) > 1 or layout.get(0, 0) is not None)


def _window_and(vals: list, k: int) -> list:
    """``out[i]`` = AND of ``vals[max(0, i - k + 1) .. i]`` (bitmasks), in O(len x log k)."""
    cur, span = vals, 1
    while span * 2 <= k:
        cur = [a & b for a, b in zip(cur, [-1] * span + cur[:-span])]
        span *= 2
    if span < k:
        shift = k - span
        cur = [a & b for a, b in zip(cur, [-1] * shift + cur[:-shift])]
    return cur


def hybrid_match(n: int, layout: dict, bits: int, masks: Callable[[int, int], list]) -> dict:
    """The engine's hybrid hit for the replicas whose bits are in ``bits``, all with ``layout`` (group -> None
    for full attention, else the number of blocks before the hit point its hit needs): ``{bit: L}`` for every
    replica with L >= 1, L the largest number of leading blocks (<= ``n``) such that each full group holds blocks
    [0, L) and each other group blocks [max(0, L - k), L). ``masks(g, m)``: for group g, the bitmasks of the
    replicas holding each of the prompt's first m blocks."""
    full = [g for g, k in layout.items() if k is None]
    part: dict[int, list[int]] = {}
    for g, k in layout.items():
        if k is not None:
            part.setdefault(k, []).append(g)
    # prefix AND over the full groups: pref[i] = replicas holding blocks 0..i of every full group
    if full:
        cols = [masks(g, n) for g in full]
        pref = []
        acc = bits
        for i in range(n):
            for c in cols:
                acc &= c[i]
            if not acc:
                break
            pref.append(acc)
    else:
        pref = [bits] * n
    m = len(pref)
    if not m:
        return {}
    for k, gs in part.items():
        if k == 0:  # (a window of one token needs no cached block)
            continue
        both = None
        for g in gs:
            c = masks(g, m)
            both = c if both is None else [a & b for a, b in zip(both, c)]
        win = _window_and(both, k)
        pref = [a & b for a, b in zip(pref, win)]
    out: dict = {}
    left = bits
    for i in range(m - 1, -1, -1):
        got = pref[i] & left
        if got:
            left &= ~got
            while got:
                low = got & -got
                out[low] = i + 1
                got ^= low
            if not left:
                break
    return out


def event_kind(event: object) -> str:
    """``"BlockStored"``, ``"BlockRemoved"`` or ``"AllBlocksCleared"`` for an event of either layout; ValueError
    otherwise."""
    name = type(event).__name__
    if name not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        raise ValueError(f"not a KV event: {event!r}")
    return name


def _medium(event: object) -> str:
    return medium_of(event)


def _keys(event: object) -> list:
    """The event's block hashes as ints: vLLM's digests sent as bytes become vLLM's int form of them (the
    keys :mod:`pagedkv.cluster.vllm_hash` computes); ints as they are. O(1) for ints, O(blocks) otherwise."""
    hs = event.block_hashes
    if hs and not isinstance(hs[0], int):
        return [external_key(h) for h in hs]
    return hs


@runtime_checkable
class KVIndex(Protocol):
    """What a router needs of a prefix index (see the module docstring for the contract)."""

    def apply(self, replica: Hashable, event: object) -> None: ...

    def longest_prefix(self, hashes: Sequence[int], medium=None) -> dict: ...

    def shared_prefix(self, hashes: Sequence[int]) -> int: ...

    def drop_replica(self, replica: Hashable) -> None: ...

    def replicas(self) -> list: ...

    def num_blocks(self, replica: Hashable | None = None) -> int: ...


class MemoryIndex:
    """The index in this process's memory: per (medium, group) a dict ``key -> bitmask of replicas`` (one bit per
    replica, so a prompt's walk is one dict lookup and one AND per block for all replicas at once), plus per
    replica, medium and group the set of its keys (for :meth:`drop_replica` and ``AllBlocksCleared`` in O(its
    blocks)), and per replica its group layout (see the module docstring).

    Shared blocks: per group an ordered dict ``key -> None`` (least recently reported first), bounded by
    ``shared_capacity_blocks`` (see the module docstring).

    Memory: about 150 bytes per distinct (key, medium, group) plus about 60 per (key, medium, group, replica).
    """

    def __init__(self, *, shared_capacity_blocks: int | None = None) -> None:
        if shared_capacity_blocks is not None and (isinstance(shared_capacity_blocks, bool) or not isinstance(
                shared_capacity_blocks, int) or shared_capacity_blocks < 0):
            raise ValueError(f"shared_capacity_blocks must be None or an int >= 0, got {shared_capacity_blocks!r}")
        self.shared_capacity_blocks = shared_capacity_blocks
        self._shared: dict[int, OrderedDict] = {0: OrderedDict()}  # group -> shared keys, least recent first
        self._bit: dict[Hashable, int] = {}  # replica -> its bit (a power of two)
        self._by_bit: dict[int, Hashable] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._gm: dict[tuple[str, int], dict[int, int]] = {(m, 0): {} for m in _MEDIA}  # (medium, group) -> masks
        self._masks: dict[str, dict[int, int]] = {m: self._gm[(m, 0)] for m in _MEDIA}  # group 0's
        self._members: dict[Hashable, dict[tuple[str, int], set]] = {}
        self._layout: dict[Hashable, dict[int, int | None]] = {}  # replica -> {group: None | blocks needed}

    # ---------------------------------------------------------------- replicas
    def add_replica(self, replica: Hashable) -> None:
        """Make ``replica`` known (done implicitly by its first event). O(1)."""
        if replica in self._bit:
            return
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        self._bit[replica] = bit
        self._by_bit[bit] = replica
        self._members[replica] = {(m, 0): set() for m in _MEDIA}

    def replicas(self) -> list:
        return list(self._bit)

    def layout(self, replica: Hashable) -> dict:
        """``{group: None (full attention) or blocks its hit needs before the hit point}`` as learnt from the
        replica's events (empty for a single-group replica)."""
        return dict(self._layout.get(replica, {}))

    def drop_replica(self, replica: Hashable) -> None:
        """Forget ``replica`` and every block it held; unknown replicas are ignored. O(its blocks)."""
        if replica not in self._bit:
            return
        self._clear(replica)
        bit = self._bit.pop(replica)
        del self._by_bit[bit]
        self._free_bits.append(bit)
        del self._members[replica]
        self._layout.pop(replica, None)

    def _clear(self, replica: Hashable) -> None:
        keep = ~self._bit[replica]
        for mg, keys in self._members[replica].items():
            masks = self._gm[mg]
            for h in keys:
                v = masks[h] & keep
                if v:
                    masks[h] = v
                else:
                    del masks[h]
            keys.clear()

    # ---------------------------------------------------------------- events
    def apply(self, replica: Hashable, event: object) -> None:
        kind = event_kind(event)
        if replica not in self._bit:
            self.add_replica(replica)
        if kind == "AllBlocksCleared":
            self._clear(replica)
            return
        m = _medium(event)
        g = _group(event)
        if m == MEDIUM_SHARED:
            self._apply_shared(replica, kind, event, g)
            return
        if g:
            mg = (m, g)
            masks = self._gm.get(mg)
            if masks is None:
                masks = self._gm[mg] = {}
            keys = self._members[replica].get(mg)
            if keys is None:
                keys = self._members[replica][mg] = set()
        else:
            masks, keys = self._masks[m], self._members[replica][(m, 0)]
        bit = self._bit[replica]
        hashes = _keys(event)
        if kind == "BlockStored":
            spec = _spec(event)
            if spec is not None:
                lay = self._layout.get(replica)
                if lay is None:
                    lay = self._layout[replica] = {}
                lay[spec[0]] = spec[1]
            get = masks.get
            for h in hashes:
                masks[h] = get(h, 0) | bit
            keys.update(hashes)
        else:
            keep = ~bit
            for h in hashes:
                if h in keys:
                    v = masks[h] & keep
                    if v:
                        masks[h] = v
                    else:
                        del masks[h]
            keys.difference_update(hashes)

    def _apply_shared(self, replica: Hashable, kind: str, event: object, g: int) -> None:
        """A shared-store event: the keys enter (or become the most recent of) the shared set, or leave it."""
        d = self._shared.get(g)
        if d is None:
            d = self._shared[g] = OrderedDict()
        if kind == "BlockStored":
            spec = _spec(event)
            if spec is not None:
                self._layout.setdefault(replica, {})[spec[0]] = spec[1]
            cap = self.shared_capacity_blocks
            if cap == 0:
                return
            move = d.move_to_end
            for h in reversed(_keys(event)):  # children first: the chain's parent ends the most recent
                if h in d:
                    move(h)
                else:
                    d[h] = None
            if cap is not None:
                while len(d) > cap:
                    d.popitem(last=False)
        else:
            for h in _keys(event):
                d.pop(h, None)

    def apply_all(self, replica: Hashable, events: Iterable[object]) -> None:
        """:meth:`apply` each event in order."""
        for e in events:
            self.apply(replica, e)

    # ---------------------------------------------------------------- queries
    @property
    def has_cpu(self) -> bool:
        """Whether any replica holds a block in the CPU tier."""
        return any(d for (m, _g), d in self._gm.items() if m == MEDIUM_CPU)

    @property
    def media(self) -> frozenset:
        """The media holding at least one block now (GPU always). O(media x groups)."""
        out = {MEDIUM_GPU}
        out.update(m for (m, _g), d in self._gm.items() if d)
        if any(self._shared.values()):
            out.add(MEDIUM_SHARED)
        return frozenset(out)

    def num_shared_blocks(self) -> int:
        """Blocks the index believes the shared store holds (every group). O(groups)."""
        return sum(len(d) for d in self._shared.values())

    def shared_prefix(self, hashes: Sequence[int]) -> int:
        """The leading ``hashes`` (group 0's keys) the shared store holds. O(that length)."""
        d = self._shared[0]
        n = 0
        for h in hashes:
            if h not in d:
                break
            n += 1
        return n

    def num_blocks(self, replica: Hashable | None = None) -> int:
        if replica is None:
            return sum(len(k) for r in self._members.values() for k in r.values())
        r = self._members.get(replica)
        return sum(len(k) for k in r.values()) if r else 0

    def _getter(self, media: frozenset, group: int):
        """``h -> bitmask of the replicas that can read block h`` from ``media`` (-1, every replica, for a shared
        block)."""
        gets = [d.get for m in _MEDIA if m in media for d in (self._gm.get((m, group)),) if d]
        shared = self._shared.get(group) if MEDIUM_SHARED in media else None
        if shared:
            if not gets:
                return lambda h: -1 if h in shared else 0
            if len(gets) == 1:
                g = gets[0]
                return lambda h: -1 if h in shared else g(h, 0)
            return lambda h: -1 if h in shared else _or(gets, h)
        if not gets:
            return lambda h: 0
        if len(gets) == 1:
            g = gets[0]
            return lambda h: g(h, 0)
        if len(gets) == 2:
            g, c = gets
            return lambda h: g(h, 0) | c(h, 0)
        return lambda h: _or(gets, h)

    def longest_prefix(self, hashes: Sequence[int], medium=None) -> dict:
        medium = media_set(medium)
        out = self._plain(hashes, medium)
        if self._layout:
            self._hybrid(hashes, medium, out)
        return out

    def _plain(self, hashes: Sequence[int], medium: str | None) -> dict:
        get = self._getter(medium, 0)
        out: dict = {}
        mask = -1
        i = 0
        for i, h in enumerate(hashes):
            m = mask & get(h)
            if m != mask:
                if i:
                    self._record(mask & ~m, i, out)
                mask = m
                if not mask:
                    return out
        else:
            if hashes and mask:
                self._record(mask, len(hashes), out)
        return out

    def _hybrid(self, hashes: Sequence[int], medium: str | None, out: dict) -> None:
        """Replace the group-0 answer of every hybrid replica by its hybrid hit (see the module docstring)."""
        classes: dict[tuple, int] = {}
        for r, lay in self._layout.items():
            if _is_hybrid(lay):
                key = tuple(sorted(lay.items()))
                classes[key] = classes.get(key, 0) | self._bit[r]
        if not classes:
            return
        keys_of = getattr(hashes, "group", None)
        for key, bits in classes.items():
            for b in _bits(bits):
                out.pop(self._by_bit[b], None)
            lay = dict(key)
            if keys_of is None:  # only group 0's keys: its prefix when it is full attention (an upper bound)
                if lay.get(0, 1) is None:
                    lay = {0: None}
                else:
                    continue
            n = min(len(hashes), getattr(hashes, "hit_blocks", len(hashes)))
            if not n:
                continue

            def masks(g: int, m: int, _medium=medium) -> list:
                get = self._getter(_medium, g)
                return [get(h) for h in (hashes if g == 0 else keys_of(g))[:m]]

            for b, L in hybrid_match(n, lay, bits, masks).items():
                out[self._by_bit[b]] = L

    def _record(self, bits: int, n: int, out: dict) -> None:
        if bits < 0:  # the all-ones start: only known replicas
            bits = sum(self._bit.values())
        by_bit = self._by_bit
        while bits:
            low = bits & -bits
            r = by_bit.get(low)
            if r is not None:
                out[r] = n
            bits ^= low


def _or(gets: list, h) -> int:
    v = 0
    for g in gets:
        v |= g(h, 0)
    return v


def _bits(bits: int):
    while bits:
        low = bits & -bits
        yield low
        bits ^= low


def predicted_tokens(matched_blocks: int, num_tokens: int, block_size: int) -> int:
    """Tokens a prefix-cache hit of ``matched_blocks`` saves on a ``num_tokens`` prompt: the engine always
    computes at least one token, so at most ``(num_tokens - 1) // block_size`` blocks count."""
    return min(matched_blocks, max(num_tokens - 1, 0) // block_size) * block_size

