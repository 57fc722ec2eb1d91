"""RedisBackend: KV values in a Redis (or Valkey) server that every replica reads and writes.

A value is one Redis string under ``<prefix><name>``; a batch is one round trip (``MGET``; a pipeline of
``SET NX`` with an optional expiry; a pipeline of ``EXISTS``). ``SET NX`` makes two replicas storing the same
block at once safe: the first wins, the second gets PRESENT; both values are whole. Capacity is the server's:
run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` to make it an LRU cache; with ``noeviction`` a
full server refuses writes with an OOM error, answered as FULL (one warning, counted).

**Fail soft.** A connection error, timeout or server error answers every name of the call as failed (reads
:data:`~pagedkv.tiers.FAILED`, writes ERROR, probes None), counts it (``failures``), logs one warning per
outage, and for ``retry_s`` seconds answers at once without trying (so requests do not each wait a connect
timeout while the store is down); the first call after that tries again, and redis-py reconnects: a restarted
server is used again without a restart of the engine. ``socket_timeout`` bounds a call on a hung server.

**A bound of our own** (``max_bytes``; ``pagedkv serve --kv-shared redis://... --kv-shared-gib N``): besides the
values, the backend keeps in the server a sorted set of the stored names by last use (``<prefix>~lru``), each
value's parent (``<prefix>~parent``), each name's number of stored children (``<prefix>~kids``) and the bytes
stored (``<prefix>~bytes``); past ``max_bytes`` the writing replica deletes values down to 90% of it, leaves
first, least recently used first (a chain's tail before its head, as the disk tier;
:class:`~pagedkv.tiers.chain_order.ChainOrder` without its orphan class), a page of 64 candidates per round trip.
A read touches the names it hits. Best effort across replicas (two may evict at once; a value Redis itself
evicted is dropped from the bookkeeping when met). Without ``max_bytes`` nothing of this is kept.

Needs the ``redis`` package (the ``router`` extra); imported when a RedisBackend is created.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Any, Sequence

from ..errors import InvalidArgumentError
from .backend import FAILED, Backend, PutStatus

__all__ = ["RedisBackend"]

log = logging.getLogger("pagedkv.tiers")


class RedisBackend(Backend):
    """A Redis tier (see the module docstring).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://``, ``unix://``).
        prefix: the key prefix of the values.
        ttl_s: expiry of each stored value in seconds (None: none; eviction is then the server's policy).
        socket_timeout: seconds a call may wait on the server (connect and each read).
        retry_s: after a failure, how long to answer "failed" at once before trying the server again.
        client: an existing ``redis.Redis`` to use instead of connecting to ``url`` (tests).
        max_bytes: a bound of the values' bytes kept by this backend (None: the server's own; see the module
            docstring).
    """

    medium = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379", *, prefix: str = "pagedkv:kv:",
                 ttl_s: int | None = None, socket_timeout: float = 0.5, retry_s: float = 1.0,
                 client: Any = None, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise InvalidArgumentError(f"max_bytes must be None or an int >= 1, got {max_bytes!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1):
            raise InvalidArgumentError(f"ttl_s must be None or an int >= 1, got {ttl_s!r}")
        if not socket_timeout > 0 or not retry_s >= 0:
            raise InvalidArgumentError("socket_timeout must be > 0 and retry_s >= 0")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("RedisBackend needs the redis package: pip install 'pagedkv[router]'") from e
        self._redis = redis
        self._oom = getattr(redis.exceptions, "OutOfMemoryError", ())
        self._client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0))
        self._prefix = prefix
        self._ttl = ttl_s
        self._retry_s = float(retry_s)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self._failures = 0
        self._outages = 0
        self._full = 0
        self._warned_full = False
        self._max = max_bytes
        self._lru, self._par, self._kids, self._bytes = (prefix + x for x in ("~lru", "~parent", "~kids", "~bytes"))
        self._evicting = threading.Lock()
        self._evictions = 0
        self._value_size = 0  # the last stored value's size (the bytes of a value Redis evicted behind our back)

    @property
    def failures(self) -> int:
        """Calls answered as failed: the server raised, or was deemed down."""
        return self._failures

    @property
    def outages(self) -> int:
        """Times the server went from answering to failing."""
        return self._outages

    @property
    def full_events(self) -> int:
        """Writes refused by a full server (OOM)."""
        return self._full

    def _skip(self) -> bool:
        with self._lock:
            if time.monotonic() < self._down_until:
                self._failures += 1
                return True
            return False

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self._failures += 1
            self._down_until = time.monotonic() + self._retry_s
            first = not self._down
            if first:
                self._down = True
                self._outages += 1
        if first:
            log.warning("pagedkv redis tier: the store failed (%s: %s); KV blocks are computed instead, retrying "
                        "every %.1f s", type(e).__name__, e, self._retry_s)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.warning("pagedkv redis tier: the store answers again")

    def _keys(self, names: Sequence[str]) -> list[str]:
        p = self._prefix
        return [p + n for n in names]

    def read_many(self, names: Sequence[str]) -> list:
        if not names:
            return []
        if self._skip():
            return [FAILED] * len(names)
        try:
            got = self._client.mget(self._keys(names))
            hit = [n for n, v in zip(names, got) if v is not None]
            if self._max is not None and hit:  # (a read makes a value the most recent)
                self._client.zadd(self._lru, dict.fromkeys(hit, time.time()), xx=True)
        except (self._redis.RedisError, OSError) as e:
            self._failed(e)
            return [FAILED] * len(names)
        self._ok()
        return list(got)

    #: write_many takes each value's parent's name (the bound evicts a chain's tail first)
    accepts_parents = True

    @property
    def max_bytes(self) -> int | None:
        return self._max

    @property
    def evictions(self) -> int:
        """Values this backend deleted to keep its bound."""
        return self._evictions

    def _account(self, names: Sequence[str], values: Sequence[bytes], parents, out: list) -> None:
        """The bookkeeping of the bound for the values just stored; evicts past it."""
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        total = 0
        for i, st in enumerate(out):
            if st is not PutStatus.STORED:
                continue
            n = names[i]
            pipe.zadd(self._lru, {n: now})
            p = None if parents is None else parents[i]
            if p is not None and p != n:
                pipe.hset(self._par, n, p)
                pipe.hincrby(self._kids, p, 1)
            total += len(values[i])
            self._value_size = len(values[i])
        if not total:
            return
        pipe.incrby(self._bytes, total)
        used = pipe.execute()[-1]
        if used > self._max and self._evicting.acquire(blocking=False):
            try:
                self._evict(used, int(self._max * 0.9))
            finally:
                self._evicting.release()

    def _evict(self, used: int, target: int) -> None:
        """Delete leaves, least recently used first, until the bytes are at most ``target``: each round reads the
        64 least recently used names (their children counts and parents), orders them as ChainOrder would (a
        parent in the page becomes a leaf once its children there are gone) and deletes what is needed. Three
        round trips per round."""
        c = self._client
        dec = (lambda x: x.decode() if isinstance(x, bytes) else x)
        while used > target:
            page = [(dec(n), sc) for n, sc in c.zrange(self._lru, 0, 63, withscores=True)]
            if not page:
                break
            names = [n for n, _ in page]
            pipe = c.pipeline(transaction=False)
            pipe.hmget(self._kids, names)
            pipe.hmget(self._par, names)
            for n in names:
                pipe.strlen(self._prefix + n)
            got = pipe.execute()
            kids = {n: int(k or 0) for n, k in zip(names, got[0])}
            parent = {n: dec(p) for n, p in zip(names, got[1]) if p is not None}
            size = dict(zip(names, got[2:]))
            score = dict(page)
            heap = [(score[n], n) for n in names if kids[n] <= 0]
            if not heap:  # (no leaf among the 64 oldest: the oldest goes; a drifted count)
                heap = [page[0][::-1]]
            heapq.heapify(heap)
            gone, freed = [], 0
            while heap and used - freed > target:
                _, n = heapq.heappop(heap)
                gone.append(n)
                freed += size[n] or self._value_size  # (gone already, Redis's own eviction: its likely size)
                p = parent.get(n)
                if p in kids:
                    kids[p] -= 1
                    if kids[p] == 0:
                        heapq.heappush(heap, (score[p], p))
            pipe = c.pipeline(transaction=False)
            pipe.delete(*(self._prefix + n for n in gone))
            pipe.zrem(self._lru, *gone)
            pipe.hdel(self._par, *gone)
            pipe.hdel(self._kids, *gone)
            for n in gone:
                if n in parent:
                    pipe.hincrby(self._kids, parent[n], -1)
            pipe.decrby(self._bytes, freed)
            used = pipe.execute()[-1]
            self._evictions += len(gone)

    def write_many(self, names: Sequence[str], values: Sequence[bytes],
                   parents: Sequence[str | None] | None = None) -> list[PutStatus]:
        if len(names) != len(values):
            raise ValueError("names and values differ in length")
        if not names:
            return []
        if self._skip():
            return [PutStatus.ERROR] * len(names)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, v in zip(self._keys(names), values):
                pipe.set(k, v, nx=True, ex=self._ttl)
            got = pipe.execute(raise_on_error=False)
        except (self._redis.RedisError, OSError) as e:
            self._failed(e)
            return [PutStatus.ERROR] * len(names)
        out, errs = [], []
        for r in got:
            if isinstance(r, Exception):
                errs.append(r)
                if isinstance(r, self._oom) or "OOM" in str(r) or "maxmemory" in str(r):
                    out.append(PutStatus.FULL)
                else:
                    out.append(PutStatus.ERROR)
            else:
                out.append(PutStatus.STORED if r else PutStatus.PRESENT)
        full = out.count(PutStatus.FULL)
        if full:
            with self._lock:
                self._full += full
                warn = not self._warned_full
                self._warned_full = True
            if warn:
                log.warning("pagedkv redis tier: the server is full (%s); blocks are not stored (counted; this "
                            "warning is not repeated)", errs[0])
        if len(errs) > full:
            with self._lock:
                self._failures += 1
        else:
            self._ok()
        if self._max is not None:
            try:
                self._account(names, values, parents, out)
            except (self._redis.RedisError, OSError) as e:  # (the values are stored; the bound catches up)
                self._failed(e)
        return out

    def exists_many(self, names: Sequence[str]) -> list:
        if not names:
            return []
        if self._skip():
            return [None] * len(names)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in self._keys(names):
                pipe.exists(k)
            got = pipe.execute()
        except (self._redis.RedisError, OSError) as e:
            self._failed(e)
            return [None] * len(names)
        self._ok()
        return [bool(r) for r in got]

    def discard_many(self, names: Sequence[str]) -> None:
        if not names or self._skip():
            return
        try:
            self._client.delete(*self._keys(names))
        except (self._redis.RedisError, OSError) as e:
            self._failed(e)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def location(self) -> str:
        """Where the values live, without credentials: ``redis://host:port/db`` (host lowercased), or
        ``unix://path?db=N``, plus the key prefix (two prefixes on one server are two stores). Names the store
        to another replica (a prefill/decode split through the shared store compares it). O(1)."""
        kw = getattr(getattr(self._client, "connection_pool", None), "connection_kwargs", {}) or {}
        db = kw.get("db", 0)
        if kw.get("path"):
            where = f"unix://{kw['path']}?db={db}"
        else:
            where = f"redis://{str(kw.get('host', '')).lower()}:{kw.get('port', '')}/{db}"
        return f"{where}#{self._prefix}"
