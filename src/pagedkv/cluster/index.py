"""The router's prefix index: which replica holds which prefix-cache block, fed only by the replicas' KV events.

A block is named by its prefix-cache key (:func:`pagedkv.block_hashes`), which chains every earlier block of the
prompt, so "replica r holds blocks h0 .. h(k-1) of a prompt" is "r holds the first k keys". The index answers
:meth:`KVIndex.longest_prefix`: for each replica, how many leading keys of a prompt it holds.

Contract shared by :class:`MemoryIndex` and :class:`RedisIndex` (the :class:`KVIndex` protocol):

- ``apply(replica, event)`` takes one event, either a :mod:`pagedkv.events` tuple or the wire struct of
  :mod:`pagedkv.server.kv_events` (dispatch on the class name: ``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``; ``medium`` None reads as ``"GPU"``). Storing a block already present and removing one that
  is absent are no-ops, so applying a stream twice gives the same index. ``AllBlocksCleared`` forgets every block
  of that replica (the replica stays known). Cost: O(blocks in the event).
- ``longest_prefix(hashes, medium=None) -> {replica: matched blocks}``: the number of leading ``hashes`` each
  replica holds in ``medium`` (``"GPU"``, ``"CPU"``, or None: either tier, a block counting if it is in one of
  them). Replicas matching nothing are left out. Cost: O(matched length x replicas / word size) in memory,
  a pipelined round trip per chunk of 256 keys in Redis.
- ``drop_replica(replica)`` forgets a replica and all its blocks (a replica that died). O(its blocks).
- ``replicas()``, ``num_blocks(replica=None)`` (entries: (block, medium, replica) triples), ``has_cpu``.

A block whose parent was evicted stays in the index (the replica still holds it), but it is never counted: the
match stops at the first key a replica lacks, as the engine's own lookup does.

An index kept elsewhere can be unreachable: every :class:`RedisIndex` method then raises
:class:`IndexUnavailableError` (after one retry and at most a few seconds of socket timeout), and its ``ping()``
says when the store answers again. The router treats that as a stale index: it routes on load alone and rebuilds
the index from the replicas' replay sockets once the store is back (docs/router-reliability.md).
"""

from __future__ import annotations

import functools
from typing import Hashable, Iterable, Protocol, Sequence, runtime_checkable

from ..errors import PagedKVError
from ..events import MEDIUM_CPU, MEDIUM_GPU

__all__ = ["KVIndex", "MemoryIndex", "RedisIndex", "IndexUnavailableError", "open_index", "event_kind"]


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

_MEDIA = (MEDIUM_GPU, MEDIUM_CPU)


def event_kind(event: object) -> str:
    """``"BlockStored"``, ``"BlockRemoved"`` or ``"AllBlocksCleared"`` for an event of either layout; ValueError
    otherwise."""
    name = type(event).__name__
    if name not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        raise ValueError(f"not a KV event: {event!r}")
    return name


def _medium(event: object) -> str:
    m = getattr(event, "medium", None) or MEDIUM_GPU
    if m not in _MEDIA:
        raise ValueError(f"unknown medium {m!r} (expected GPU or CPU)")
    return m


@runtime_checkable
class KVIndex(Protocol):
    """What a router needs of a prefix index (see the module docstring for the contract)."""

    def apply(self, replica: Hashable, event: object) -> None: ...

    def longest_prefix(self, hashes: Sequence[int], medium: str | None = None) -> dict: ...

    def drop_replica(self, replica: Hashable) -> None: ...

    def replicas(self) -> list: ...

    def num_blocks(self, replica: Hashable | None = None) -> int: ...


class MemoryIndex:
    """The index in this process's memory: per medium a dict ``key -> bitmask of replicas`` (one bit per replica,
    so a prompt's walk is one dict lookup and one AND per block for all replicas at once), plus per replica and
    medium the set of its keys (for :meth:`drop_replica` and ``AllBlocksCleared`` in O(its blocks)).

    Memory: about 150 bytes per distinct (key, medium) plus about 60 per (key, medium, replica).
    """

    def __init__(self) -> None:
        self._bit: dict[Hashable, int] = {}  # replica -> its bit (a power of two)
        self._by_bit: dict[int, Hashable] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._masks: dict[str, dict[int, int]] = {m: {} for m in _MEDIA}
        self._members: dict[Hashable, dict[str, set]] = {}

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
        self._members[replica] = {m: set() for m in _MEDIA}

    def replicas(self) -> list:
        return list(self._bit)

    def drop_replica(self, replica: Hashable) -> None:
        """Forget ``replica`` and every block it held; unknown replicas are ignored. O(its blocks)."""
        if replica not in self._bit:
            return
        self._clear(replica)
        bit = self._bit.pop(replica)
        del self._by_bit[bit]
        self._free_bits.append(bit)
        del self._members[replica]

    def _clear(self, replica: Hashable) -> None:
        keep = ~self._bit[replica]
        for m, keys in self._members[replica].items():
            masks = self._masks[m]
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
        bit, masks, keys = self._bit[replica], self._masks[m], self._members[replica][m]
        hashes = event.block_hashes
        if kind == "BlockStored":
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

    def apply_all(self, replica: Hashable, events: Iterable[object]) -> None:
        """:meth:`apply` each event in order."""
        for e in events:
            self.apply(replica, e)

    # ---------------------------------------------------------------- queries
    @property
    def has_cpu(self) -> bool:
        """Whether any replica holds a block in the CPU tier."""
        return bool(self._masks[MEDIUM_CPU])

    def num_blocks(self, replica: Hashable | None = None) -> int:
        if replica is None:
            return sum(len(k) for r in self._members.values() for k in r.values())
        r = self._members.get(replica)
        return sum(len(k) for k in r.values()) if r else 0

    def longest_prefix(self, hashes: Sequence[int], medium: str | None = None) -> dict:
        if medium is None:
            g, c = self._masks[MEDIUM_GPU].get, self._masks[MEDIUM_CPU].get
            get = (lambda h: g(h, 0) | c(h, 0)) if self._masks[MEDIUM_CPU] else (lambda h: g(h, 0))
        else:
            if medium not in _MEDIA:
                raise ValueError(f"unknown medium {medium!r}")
            d = self._masks[medium].get
            get = lambda h: d(h, 0)  # noqa: E731
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


class RedisIndex:
    """The index in Redis, shared by every router that opens the same server and ``prefix``.

    Key layout (``<p>`` is the prefix, ``pagedkv`` by default; hashes and sequence numbers in decimal):

    - ``<p>:blk:<medium>:<hash>``: SET of the replica ids holding block ``hash`` in ``medium`` (GPU or CPU).
    - ``<p>:rep:<replica>:<medium>``: SET of the hashes ``replica`` holds in ``medium`` (to clean up after it).
    - ``<p>:replicas``: SET of known replica ids.
    - ``<p>:seq:<replica>``: the last event-message sequence number applied for ``replica`` (written by the
      router's subscriber through :meth:`set_seq`, read by a restarted router to replay what it missed).

    Cleanup of a vanished replica (:meth:`drop_replica`): its membership sets are scanned (SSCAN, 1000 at a
    time) and the replica is removed from each block's set in one pipeline per batch (Redis deletes a set when
    its last member goes), then its membership and sequence keys are deleted and it leaves ``<p>:replicas``.
    Every write of one event is one pipeline (MULTI/EXEC). Replica ids are strings (``str(replica)``).
    Several routers may apply the same events: SADD and SREM make that idempotent (a router lagging behind
    another can briefly re-add a block the other already removed; the next removal fixes it).

    Outages: the client made from ``url`` gives up after ``timeout`` seconds per socket operation and one retry,
    and every method then raises :class:`IndexUnavailableError`; :meth:`ping` is True once Redis answers again.
    The constructor pings (and raises) so that a wrong URL is reported at start-up.
    """

    CHUNK = 256

    def __init__(self, url: str = "redis://127.0.0.1:6379", *, prefix: str = "pagedkv", client=None,
                 timeout: float = 2.0) -> None:
        import redis

        if client is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                          retry=Retry(NoBackoff(), 1))
        self._outage = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.r = client
        self.p = prefix
        self._has_cpu, self._cpu_checked = False, -1e9
        self._ping()

    @_guard
    def _ping(self) -> None:
        self.r.ping()

    def ping(self) -> bool:
        """True when Redis answers (never raises)."""
        try:
            self._ping()
        except IndexUnavailableError:
            return False
        return True

    def _blk(self, medium: str, h: int) -> str:
        return f"{self.p}:blk:{medium}:{int(h)}"

    def _rep(self, replica, medium: str) -> str:
        return f"{self.p}:rep:{replica}:{medium}"

    @_guard
    def replicas(self) -> list:
        return sorted(x.decode() for x in self.r.smembers(f"{self.p}:replicas"))

    @_guard
    def add_replica(self, replica) -> None:
        self.r.sadd(f"{self.p}:replicas", str(replica))

    @_guard
    def apply(self, replica, event: object) -> None:
        kind = event_kind(event)
        rid = str(replica)
        if kind == "AllBlocksCleared":
            self._clear(rid, forget=False)
            return
        m = _medium(event)
        hashes = [int(h) for h in event.block_hashes]
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(f"{self.p}:replicas", rid)
        if hashes:
            if kind == "BlockStored":
                for h in hashes:
                    pipe.sadd(self._blk(m, h), rid)
                pipe.sadd(self._rep(rid, m), *hashes)
            else:
                for h in hashes:
                    pipe.srem(self._blk(m, h), rid)
                pipe.srem(self._rep(rid, m), *hashes)
        pipe.execute()

    def apply_all(self, replica, events: Iterable[object]) -> None:
        for e in events:
            self.apply(replica, e)

    @_guard
    def drop_replica(self, replica) -> None:
        self._clear(str(replica), forget=True)

    def _clear(self, rid: str, *, forget: bool) -> None:
        for m in _MEDIA:
            key = self._rep(rid, m)
            batch: list = []
            for h in self.r.sscan_iter(key, count=1000):
                batch.append(int(h))
                if len(batch) >= 1000:
                    self._srem_blocks(rid, m, batch)
                    batch = []
            if batch:
                self._srem_blocks(rid, m, batch)
            self.r.delete(key)
        if forget:
            self.r.delete(f"{self.p}:seq:{rid}")
            self.r.srem(f"{self.p}:replicas", rid)

    def _srem_blocks(self, rid: str, m: str, hashes: list) -> None:
        pipe = self.r.pipeline(transaction=False)
        for h in hashes:
            pipe.srem(self._blk(m, h), rid)
        pipe.execute()

    @property
    @_guard
    def has_cpu(self) -> bool:
        """Whether any replica holds a CPU-tier block (asked of Redis at most once a second)."""
        import time

        now = time.monotonic()
        if now - self._cpu_checked > 1.0:
            reps = self.replicas()
            pipe = self.r.pipeline(transaction=False)
            for r in reps:
                pipe.scard(self._rep(r, MEDIUM_CPU))
            self._has_cpu = any(pipe.execute()) if reps else False
            self._cpu_checked = now
        return self._has_cpu

    @_guard
    def num_blocks(self, replica=None) -> int:
        reps = self.replicas() if replica is None else [str(replica)]
        pipe = self.r.pipeline(transaction=False)
        for r in reps:
            for m in _MEDIA:
                pipe.scard(self._rep(r, m))
        return int(sum(pipe.execute()))

    @_guard
    def longest_prefix(self, hashes: Sequence[int], medium: str | None = None) -> dict:
        if medium is not None and medium not in _MEDIA:
            raise ValueError(f"unknown medium {medium!r}")
        media = _MEDIA if medium is None else (medium,)
        out: dict = {}
        alive: set | None = None
        n = len(hashes)
        for start in range(0, n, self.CHUNK):
            chunk = hashes[start : start + self.CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for h in chunk:
                pipe.sunion(*[self._blk(m, h) for m in media])
            for j, members in enumerate(pipe.execute()):
                now = {x.decode() for x in members}
                cur = now if alive is None else alive & now
                if alive is not None:
                    for r in alive - cur:
                        out[r] = start + j
                alive = cur
                if not alive:
                    return out
        for r in alive or ():
            out[r] = n
        return out

    # ---------------------------------------------------------------- subscriber bookkeeping
    @_guard
    def get_seq(self, replica) -> int | None:
        v = self.r.get(f"{self.p}:seq:{replica}")
        return None if v is None else int(v)

    @_guard
    def set_seq(self, replica, seq: int) -> None:
        self.r.set(f"{self.p}:seq:{replica}", int(seq))


def open_index(spec: str | None) -> MemoryIndex | RedisIndex:
    """``None`` or ``"memory"``: a :class:`MemoryIndex`; ``"redis://HOST:PORT[/DB]"``: a :class:`RedisIndex`
    (ValueError for anything else)."""
    if spec in (None, "", "memory"):
        return MemoryIndex()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisIndex(spec)
    raise ValueError(f"--index must be 'memory' or redis://HOST:PORT, got {spec!r}")


def predicted_tokens(matched_blocks: int, num_tokens: int, block_size: int) -> int:
    """Tokens a prefix-cache hit of ``matched_blocks`` saves on a ``num_tokens`` prompt: the engine always
    computes at least one token, so at most ``(num_tokens - 1) // block_size`` blocks count."""
    return min(matched_blocks, max(num_tokens - 1, 0) // block_size) * block_size
