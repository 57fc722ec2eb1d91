"""The prefix index in Redis (:class:`RedisIndex`), shared by several routers: the :class:`~.index.KVIndex`
contract of :mod:`pagedkv.cluster.index`; and :func:`open_index`, which opens either index from a ``--index`` value.
Both are exported by :mod:`pagedkv.cluster`."""

from __future__ import annotations

from typing import Iterable, Sequence

from ..events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED
from .index import (_MEDIA, IndexUnavailableError, MemoryIndex, _group, _guard, _is_hybrid, _keys,
                    _medium, _spec, event_kind, hybrid_match, media_set)

__all__ = ["RedisIndex", "open_index"]


class RedisIndex:
    """The index in Redis, shared by every router that opens the same server and ``prefix``.

    Key layout (``<p>`` is the prefix, ``pagedkv`` by default; hashes and sequence numbers in decimal):

    - ``<p>:blk:<medium>:<hash>``: SET of the replica ids holding block ``hash`` in ``medium`` (GPU, CPU or DISK).
    - ``<p>:rep:<replica>:<medium>``: SET of the hashes ``replica`` holds in ``medium`` (to clean up after it).
    - ``<p>:blk:<medium>:g<group>:<hash>`` and ``<p>:rep:<replica>:<medium>:g<group>``: the same for KV cache group
      ``group`` > 0 (group 0, and every single-group replica, use the keys above).
    - ``<p>:layout:<replica>``: HASH group -> ``full`` or the blocks its hybrid hit needs before the hit point
      (written from the replica's ``BlockStored`` group fields; absent for a single-group replica). Queries read
      the layouts at most once a second (and at once after this object wrote a new one).
    - ``<p>:shared`` (``<p>:shared:g<group>`` for group > 0): ZSET of the blocks in the shared store, scored by
      ``<p>:shared_clock`` (INCRBY: the most recently reported highest), trimmed to ``shared_capacity_blocks``
      (ZREMRANGEBYRANK in the same MULTI) when bounded.
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
                 timeout: float = 2.0, shared_capacity_blocks: int | None = None) -> None:
        import redis

        MemoryIndex(shared_capacity_blocks=shared_capacity_blocks)  # (the same checks)
        self.shared_capacity_blocks = shared_capacity_blocks
        if client is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                          retry=Retry(NoBackoff(), 1))
        self._outage = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.r = client
        self.p = prefix
        self._has_cpu, self._cpu_checked = False, -1e9
        self._layouts: dict = {}
        self._layouts_at = -1e9
        self._seen: set = set()  # (replica, group, need) layout fields this object wrote
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

    def _blk(self, medium: str, h: int, group: int = 0) -> str:
        if group:
            return f"{self.p}:blk:{medium}:g{group}:{int(h)}"
        return f"{self.p}:blk:{medium}:{int(h)}"

    def _rep(self, replica, medium: str, group: int = 0) -> str:
        if group:
            return f"{self.p}:rep:{replica}:{medium}:g{group}"
        return f"{self.p}:rep:{replica}:{medium}"

    def _shared_key(self, group: int = 0) -> str:
        return f"{self.p}:shared:g{group}" if group else f"{self.p}:shared"

    def _groups_of(self, rid: str) -> list[int]:
        return sorted({0} | {int(g) for g in self.r.hkeys(f"{self.p}:layout:{rid}")})

    @_guard
    def layout(self, replica) -> dict:
        """As :meth:`MemoryIndex.layout`, read from Redis."""
        raw = self.r.hgetall(f"{self.p}:layout:{replica}")
        return {int(g): (None if v == b"full" else int(v)) for g, v in raw.items()}

    def _all_layouts(self) -> dict:
        import time

        now = time.monotonic()
        if now - self._layouts_at > 1.0:
            reps = self.replicas()
            pipe = self.r.pipeline(transaction=False)
            for r in reps:
                pipe.hgetall(f"{self.p}:layout:{r}")
            got = {}
            for r, raw in zip(reps, pipe.execute()):
                if raw:
                    got[r] = {int(g): (None if v == b"full" else int(v)) for g, v in raw.items()}
            self._layouts, self._layouts_at = got, now
        return self._layouts

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
        g = _group(event)
        hashes = [int(h) for h in _keys(event)]
        clock = 0
        if m == MEDIUM_SHARED and kind == "BlockStored" and hashes:
            clock = int(self.r.incrby(f"{self.p}:shared_clock", len(hashes)))
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(f"{self.p}:replicas", rid)
        new_field = None
        if kind == "BlockStored":
            spec = _spec(event)
            if spec is not None:
                pipe.hset(f"{self.p}:layout:{rid}", str(spec[0]), "full" if spec[1] is None else str(spec[1]))
                new_field = (rid, spec[0], spec[1])
        if hashes and m == MEDIUM_SHARED:
            key, cap = self._shared_key(g), self.shared_capacity_blocks
            if kind == "BlockRemoved":
                pipe.zrem(key, *hashes)
            elif cap != 0:  # the parent scored the highest: a chain leaves from its tail (MemoryIndex's order)
                pipe.zadd(key, {h: clock - i for i, h in enumerate(hashes)})
                if cap is not None:
                    pipe.zremrangebyrank(key, 0, -cap - 1)
        elif hashes:
            if kind == "BlockStored":
                for h in hashes:
                    pipe.sadd(self._blk(m, h, g), rid)
                pipe.sadd(self._rep(rid, m, g), *hashes)
            else:
                for h in hashes:
                    pipe.srem(self._blk(m, h, g), rid)
                pipe.srem(self._rep(rid, m, g), *hashes)
        pipe.execute()
        if new_field is not None and new_field not in self._seen:
            self._seen.add(new_field)
            self._layouts_at = -1e9  # read the layouts again at the next query

    def apply_all(self, replica, events: Iterable[object]) -> None:
        for e in events:
            self.apply(replica, e)

    @_guard
    def drop_replica(self, replica) -> None:
        self._clear(str(replica), forget=True)

    def _clear(self, rid: str, *, forget: bool) -> None:
        for g in self._groups_of(rid):
            for m in _MEDIA:
                key = self._rep(rid, m, g)
                batch: list = []
                for h in self.r.sscan_iter(key, count=1000):
                    batch.append(int(h))
                    if len(batch) >= 1000:
                        self._srem_blocks(rid, m, batch, g)
                        batch = []
                if batch:
                    self._srem_blocks(rid, m, batch, g)
                self.r.delete(key)
        if forget:
            self.r.delete(f"{self.p}:seq:{rid}", f"{self.p}:layout:{rid}")
            self.r.srem(f"{self.p}:replicas", rid)
            self._seen = {f for f in self._seen if f[0] != rid}
            self._layouts_at = -1e9

    def _srem_blocks(self, rid: str, m: str, hashes: list, group: int = 0) -> None:
        pipe = self.r.pipeline(transaction=False)
        for h in hashes:
            pipe.srem(self._blk(m, h, group), rid)
        pipe.execute()

    @property
    @_guard
    def has_cpu(self) -> bool:
        """Whether any replica holds a CPU-tier block (asked of Redis at most once a second)."""
        import time

        now = time.monotonic()
        if now - self._cpu_checked > 1.0:
            reps = self.replicas()
            lays = self._all_layouts()
            pipe = self.r.pipeline(transaction=False)
            for r in reps:
                for g in sorted({0} | set(lays.get(r, ()))):
                    pipe.scard(self._rep(r, MEDIUM_CPU, g))
            self._has_cpu = any(pipe.execute()) if reps else False
            self._cpu_checked = now
        return self._has_cpu

    @property
    @_guard
    def media(self) -> frozenset:
        """As :attr:`MemoryIndex.media` (asked of Redis at each call: one pipeline)."""
        reps = self.replicas()
        lays = self._all_layouts()
        groups = sorted({0}.union(*[set(lays.get(r, ())) for r in reps]))
        pipe = self.r.pipeline(transaction=False)
        asked = []
        for m in (MEDIUM_CPU, MEDIUM_DISK):
            for r in reps:
                for g in sorted({0} | set(lays.get(r, ()))):
                    pipe.scard(self._rep(r, m, g))
                    asked.append(m)
        for g in groups:
            pipe.zcard(self._shared_key(g))
            asked.append(MEDIUM_SHARED)
        out = {MEDIUM_GPU}
        out.update(m for m, n in zip(asked, pipe.execute()) if n)
        return frozenset(out)

    @_guard
    def num_shared_blocks(self) -> int:
        lays = self._all_layouts()
        groups = sorted({0}.union(*[set(v) for v in lays.values()]))
        pipe = self.r.pipeline(transaction=False)
        for g in groups:
            pipe.zcard(self._shared_key(g))
        return int(sum(pipe.execute()))

    @_guard
    def shared_prefix(self, hashes: Sequence[int]) -> int:
        n = 0
        key = self._shared_key(0)
        for start in range(0, len(hashes), self.CHUNK):
            chunk = [int(h) for h in hashes[start : start + self.CHUNK]]
            for sc in self.r.zmscore(key, chunk):
                if sc is None:
                    return n
                n += 1
        return n

    @_guard
    def num_blocks(self, replica=None) -> int:
        reps = self.replicas() if replica is None else [str(replica)]
        pipe = self.r.pipeline(transaction=False)
        for r in reps:
            for g in self._groups_of(r):
                for m in _MEDIA:
                    pipe.scard(self._rep(r, m, g))
        return int(sum(pipe.execute()))

    @_guard
    def longest_prefix(self, hashes: Sequence[int], medium=None) -> dict:
        media = media_set(medium)
        out = self._plain(hashes, media)
        lays = {r: lay for r, lay in self._all_layouts().items() if _is_hybrid(lay)}
        if lays:
            self._hybrid(hashes, media, lays, out)
        return out

    def _column(self, keys: Sequence[int], media: frozenset, group: int) -> list:
        """Per key (in order): the set of replica ids (bytes) holding it in the own media of ``media``, or None
        when the shared store holds it (every replica). One pipeline per chunk of :attr:`CHUNK` keys."""
        own = [m for m in _MEDIA if m in media]
        shared = MEDIUM_SHARED in media
        skey = self._shared_key(group)
        col: list = []
        for start in range(0, len(keys), self.CHUNK):
            chunk = [int(h) for h in keys[start : start + self.CHUNK]]
            pipe = self.r.pipeline(transaction=False)
            if own:
                for h in chunk:
                    pipe.sunion(*[self._blk(m, h, group) for m in own])
            if shared:
                pipe.zmscore(skey, chunk)
            got = pipe.execute()
            sets = got[: len(chunk)] if own else [set()] * len(chunk)
            scores = got[-1] if shared else [None] * len(chunk)
            col.extend(None if sc is not None else members for members, sc in zip(sets, scores))
        return col

    def _hybrid(self, hashes: Sequence[int], media: frozenset, lays: dict, out: dict) -> None:
        """As :meth:`MemoryIndex._hybrid`: the hybrid replicas' answers replaced by their hybrid hits."""
        classes: dict[tuple, list] = {}
        for r, lay in lays.items():
            classes.setdefault(tuple(sorted(lay.items())), []).append(r)
        keys_of = getattr(hashes, "group", None)
        n = min(len(hashes), getattr(hashes, "hit_blocks", len(hashes)))
        for key, reps in classes.items():
            for r in reps:
                out.pop(r, None)
            lay = dict(key)
            if keys_of is None:
                if lay.get(0, 1) is None:
                    lay = {0: None}
                else:
                    continue
            if not n:
                continue
            bit_of = {r.encode(): 1 << i for i, r in enumerate(reps)}

            def masks(g: int, m: int) -> list:
                col: list = []
                for members in self._column((hashes if g == 0 else keys_of(g))[:m], media, g):
                    v = 0
                    if members is None:  # in the shared store: every replica
                        v = -1
                    else:
                        for x in members:
                            v |= bit_of.get(x, 0)
                    col.append(v)
                return col

            for b, L in hybrid_match(n, lay, (1 << len(reps)) - 1, masks).items():
                out[reps[b.bit_length() - 1]] = L

    def _plain(self, hashes: Sequence[int], media: frozenset) -> dict:
        out: dict = {}
        alive: set | None = None  # None: every known replica still matches (only shared blocks so far)
        n = len(hashes)
        known = None
        for start in range(0, n, self.CHUNK):
            for j, members in enumerate(self._column(hashes[start : start + self.CHUNK], media, 0)):
                if members is None:  # a shared block: nobody drops out
                    continue
                now = {x.decode() for x in members}
                if alive is None:
                    if known is None:
                        known = set(self.replicas()) if MEDIUM_SHARED in media else now
                    cur = known & now
                    gone = known - cur if start + j else ()
                else:
                    cur = alive & now
                    gone = alive - cur
                for r in gone:
                    out[r] = start + j
                alive = cur
                if not alive:
                    return out
        if alive is None:
            alive = set(self.replicas()) if n else set()
        for r in alive:
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


def open_index(spec: str | None, *, shared_capacity_blocks: int | None = None) -> "MemoryIndex | RedisIndex":
    """``None`` or ``"memory"``: a :class:`MemoryIndex`; ``"redis://HOST:PORT[/DB]"``: a :class:`RedisIndex`
    (ValueError for anything else). ``shared_capacity_blocks``: the bound on the shared blocks it keeps."""
    if spec in (None, "", "memory"):
        return MemoryIndex(shared_capacity_blocks=shared_capacity_blocks)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisIndex(spec, shared_capacity_blocks=shared_capacity_blocks)
    raise ValueError(f"--index must be 'memory' or redis://HOST:PORT, got {spec!r}")
