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

Needs the ``redis`` package (the ``router`` extra); imported when a RedisBackend is created.
"""

from __future__ import annotations

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
    """

    medium = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379", *, prefix: str = "pagedkv:kv:",
                 ttl_s: int | None = None, socket_timeout: float = 0.5, retry_s: float = 1.0,
                 client: Any = None) -> None:
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
        except (self._redis.RedisError, OSError) as e:
            self._failed(e)
            return [FAILED] * len(names)
        self._ok()
        return list(got)

    def write_many(self, names: Sequence[str], values: Sequence[bytes]) -> list[PutStatus]:
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
