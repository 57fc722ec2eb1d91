"""The router's state: replicas (health, load), the prefix index, the policy, and one routing decision.

A replica is named by its base URL. It is *routable* while its health checks pass. When they fail (or a
request cannot even connect to it) the replica leaves routing and the index (``drop_replica``); when checks pass
again it comes back and the event subscriber rebuilds its blocks at once from the replica's replay socket (from
sequence number 0: a replica that restarted numbers from 0 again, one that was only slow still holds its
cache; either way the buffered messages give its current blocks, as far as the buffer reaches back). Load is the prompt tokens still to compute of the requests in flight through this router (see :meth:`choose`).

Index access is serialised by one lock (the event thread writes, request handlers read). Besides the events
index, the policy sees the prompts of the requests in flight (:class:`PendingIndex`): a burst of requests sharing
a prefix lands where the first went even before that replica's events report the prefix cached.

An index that cannot be reached (Redis down: ``IndexUnavailableError``) makes the state *stale*
(:attr:`RouterState.index_ok` False, shown by ``/health`` and ``/metrics``): routing then uses the pending
prompts and the loads alone, without asking the index, until the event subscriber (or, without one, the health
checker) finds it reachable again and it has been rebuilt (:meth:`RouterState.index_recovered`). Replicas going
down and coming back, and the index going and coming, are logged once each (logger ``pagedkv.router``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..cluster.index import IndexUnavailableError, MemoryIndex, media_set, predicted_tokens
from ..events import MEDIUM_GPU
from ..cluster.policy import ApproxPrefixPolicy, PrefixPolicy, make_policy

__all__ = ["Replica", "RouterState", "PendingIndex", "parse_backend"]

log = logging.getLogger("pagedkv.router")


class PendingIndex:
    """Prompts routed to a replica whose requests are still in flight: their blocks are about to be cached
    there, though the replica's events may not have said so yet (a request waits for admission and for its
    prefill before its blocks are stored). Reference-counted per (replica, block), so two requests sharing a
    prefix keep it until both end. A :class:`MemoryIndex` of the blocks with a count > 0 answers queries."""

    def __init__(self) -> None:
        self.index = MemoryIndex()
        self._count: dict = {}

    def add(self, replica, hashes) -> None:
        from ..events import BlockStored

        new = []
        for h in hashes:
            k = (replica, h)
            c = self._count.get(k, 0)
            self._count[k] = c + 1
            if not c:
                new.append(h)
        if new:
            self.index.apply(replica, BlockStored(new, None, [], 0))

    def remove(self, replica, hashes) -> None:
        from ..events import BlockRemoved

        gone = []
        for h in hashes:
            k = (replica, h)
            c = self._count.get(k, 0)
            if c <= 1:
                self._count.pop(k, None)
                if c:
                    gone.append(h)
            else:
                self._count[k] = c - 1
        if gone:
            self.index.apply(replica, BlockRemoved(gone))

    def drop_replica(self, replica) -> None:
        self.index.drop_replica(replica)
        self._count = {k: v for k, v in self._count.items() if k[0] != replica}


class _WithPending:
    """The policy's view: per replica the longer of the events index's match and the pending prompts' match
    (pending blocks count as GPU blocks; the shared store's blocks come from the index alone). While the index is stale (``state.index_ok`` False) it is not asked;
    an ``IndexUnavailableError`` makes it stale (``state.index_failed``) and the answer is the pending one."""

    def __init__(self, index, pending: PendingIndex, state) -> None:
        self.index, self.pending, self.state = index, pending, state

    @property
    def has_cpu(self) -> bool:
        if not self.state.index_ok:
            return False
        try:
            return self.index.has_cpu
        except IndexUnavailableError as e:
            self.state.index_failed(e)
            return False

    @property
    def media(self) -> frozenset:
        """The index's media (GPU alone while it is stale)."""
        if self.state.index_ok:
            try:
                m = getattr(self.index, "media", None)
                if m is not None:
                    return m
                return frozenset((MEDIUM_GPU, "CPU")) if self.index.has_cpu else frozenset((MEDIUM_GPU,))
            except IndexUnavailableError as e:
                self.state.index_failed(e)
        return frozenset((MEDIUM_GPU,))

    def shared_prefix(self, hashes) -> int:
        if self.state.index_ok:
            try:
                return self.index.shared_prefix(hashes)
            except IndexUnavailableError as e:
                self.state.index_failed(e)
        return 0

    def longest_prefix(self, hashes, medium=None) -> dict:
        out: dict = {}
        if self.state.index_ok:
            try:
                out = self.index.longest_prefix(hashes, medium)
            except IndexUnavailableError as e:
                self.state.index_failed(e)
        if MEDIUM_GPU in media_set(medium):
            for r, n in self.pending.index.longest_prefix(hashes).items():
                if n > out.get(r, 0):
                    out[r] = n
        return out


@dataclass
class Replica:
    url: str
    events: str | None = None
    replay: str | None = None
    healthy: bool = True
    inflight: int = 0
    inflight_tokens: int = 0  #: prompt tokens still to compute (predicted uncached) of the requests in flight
    decisions: int = 0
    predicted_tokens: int = 0
    failures: int = 0  #: consecutive failed health checks
    downs: int = 0  #: times it left routing
    since: float = 0.0  #: time.monotonic() of the last change of health
    role: str = "both"  #: "prefill" or "decode" in a prefill/decode split (--prefill / --decode), else "both"


def parse_backend(spec: str, role: str = "both") -> Replica:
    """``URL`` or ``URL,EVENTS_ENDPOINT`` (the replay endpoint is the events port + 1, as ``pagedkv serve``'s
    default) or ``URL,EVENTS_ENDPOINT,REPLAY_ENDPOINT``. ValueError on anything else."""
    from .events import replay_endpoint_for

    parts = [p.strip() for p in spec.split(",")]
    url = parts[0].rstrip("/")
    if not url.startswith(("http://", "https://")) or len(parts) > 3 or any(not p for p in parts):
        raise ValueError(f"--backend must be URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]], got {spec!r}")
    events = parts[1] if len(parts) > 1 else None
    replay = parts[2] if len(parts) > 2 else (replay_endpoint_for(events) if events else None)
    return Replica(url, events, replay, role=role)


class RouterState:
    """Replicas + index + policy. ``route`` is a name of :data:`pagedkv.cluster.policy.ROUTES`."""

    def __init__(self, replicas: list[Replica], index=None, *, route: str = "prefix", balance_slack: float = 0.2,
                 balance_abs: float = 1024.0, block_size: int = 16, approx_capacity_blocks: int = 65536,
                 min_match: float = 0.3, weights: dict | None = None) -> None:
        if not replicas:
            raise ValueError("at least one --backend is needed")
        urls = [r.url for r in replicas]
        if len(set(urls)) != len(urls):
            raise ValueError("a backend is listed twice")
        self.replicas = {r.url: r for r in replicas}
        self.order = urls
        self.index = index if index is not None else MemoryIndex()
        self.block_size = block_size
        self.pending = PendingIndex()
        self.index_down_since: float | None = None  #: time.monotonic() when the index became unreachable
        self.index_error: str | None = None  #: the last outage's message
        self.index_errors = 0  #: IndexUnavailableError seen (requests and events)
        self.index_outages = 0  #: times the index became unreachable
        self.policy = make_policy(route, _WithPending(self.index, self.pending, self), slack=balance_slack,
                                  abs_slack=balance_abs,
                                  capacity_blocks=approx_capacity_blocks, min_match=min_match, weights=weights)
        self.route = route
        self.lock = threading.Lock()
        self._health_lock = threading.Lock()
        self.subscriber = None

    # ------------------------------------------------------------------ index health (IndexHealth)
    @property
    def index_ok(self) -> bool:
        """False while the index is unreachable or not yet rebuilt after an outage (stale)."""
        return self.index_down_since is None

    def index_failed(self, error: BaseException) -> None:
        """The index did not answer: stop asking it when routing (logged once per outage)."""
        with self._health_lock:
            self.index_errors += 1
            self.index_error = str(error)
            if self.index_down_since is None:
                self.index_down_since = time.monotonic()
                self.index_outages += 1
                log.warning("prefix index unavailable (%s): routing on load alone until it is back", error)

    def probe_index(self) -> bool:
        """Whether the index answers now (an index without ``ping`` always does)."""
        ping = getattr(self.index, "ping", None)
        return True if ping is None else bool(ping())

    def index_recovered(self) -> None:
        """The index answers again and has been rebuilt: route with it again (logged)."""
        with self._health_lock:
            if self.index_down_since is not None:
                log.warning("prefix index back after %.1f s; rebuilt from the replicas' replay sockets",
                            time.monotonic() - self.index_down_since)
            self.index_down_since = None

    @property
    def index_stale_seconds(self) -> float:
        s = self.index_down_since
        return 0.0 if s is None else time.monotonic() - s

    # ------------------------------------------------------------------ events (subscriber thread)
    def apply_events(self, replica: str, events) -> None:
        with self.lock:
            if self.replicas[replica].healthy:
                for e in events:
                    self.index.apply(replica, e)

    def clear_replica(self, replica: str) -> None:
        with self.lock:
            self.pending.drop_replica(replica)
            if isinstance(self.policy, ApproxPrefixPolicy):
                self.policy.forget(replica)
            self.index.drop_replica(replica)

    # ------------------------------------------------------------------ health
    def mark(self, replica: str, healthy: bool, reason: str = "") -> bool:
        """Record a health result; True when the replica's state changed (logged: one line when it goes down,
        with ``reason``, one when it comes back). Going down drops it from the index; coming back (a restart)
        starts it empty."""
        with self._health_lock:
            r = self.replicas[replica]
            r.failures = 0 if healthy else r.failures + 1
            if r.healthy == healthy:
                return False
            r.healthy = healthy
            r.downs += not healthy
            now = time.monotonic()
            was, r.since = r.since, now
        if healthy:
            log.warning("replica %s is up again after %.1f s down: back in routing", replica, now - was)
        else:
            log.warning("replica %s is down (%s): out of routing", replica, reason or "health check failed")
        try:
            self.clear_replica(replica)
        except IndexUnavailableError as e:  # its blocks go when the index is rebuilt
            self.index_failed(e)
        if self.subscriber is not None and replica in self.subscriber.feeds:
            self.subscriber.forget(replica)
        return True

    def routable(self, exclude: set = frozenset(), roles: tuple | None = None) -> list[str]:
        """Healthy replicas not in ``exclude``, of one of ``roles`` (any role when None)."""
        return [u for u in self.order if self.replicas[u].healthy and u not in exclude
                and (roles is None or self.replicas[u].role in roles)]

    @property
    def split(self) -> bool:
        """True when the router has prefill and decode replicas: requests go through the split."""
        roles = {r.role for r in self.replicas.values()}
        return "prefill" in roles and "decode" in roles

    @property
    def plain_roles(self) -> tuple:
        """The roles a request computed whole on one replica goes to: colocated replicas, or (with none) the
        decode replicas (a recompute when no prefill replica can take it)."""
        return ("both",) if any(r.role == "both" for r in self.replicas.values()) else ("both", "decode")

    # ------------------------------------------------------------------ decisions
    def choose(self, hashes: list[int], num_tokens: int, exclude: set = frozenset(), roles: tuple | None = None):
        """``(replica url, predicted cached tokens, load added)`` or None when no replica is routable. The load of
        a replica is the prompt tokens it still has to compute for the requests in flight (each request's
        tokens minus what the index predicts it holds); the balance limit and ``least-loaded`` use it. Counts
        the decision and the request as in flight (call :meth:`done` with the load when it ends). ``roles``:
        only replicas of these roles (default: :attr:`plain_roles`); ``("decode",)`` picks the decode replica
        with the fewest requests in flight (its cache does not matter: the KV comes from the prefill replica)."""
        with self.lock:
            urls = self.routable(exclude, roles if roles is not None else self.plain_roles)
            if not urls:
                return None
            if roles == ("decode",):
                u = min(urls, key=lambda u: (self.replicas[u].inflight, self.replicas[u].decisions))
                r = self.replicas[u]
                r.inflight += 1
                r.inflight_tokens += num_tokens
                r.decisions += 1
                return u, 0, num_tokens
            loads = {u: self.replicas[u].inflight_tokens for u in urls}
            tiebreak = {u: self.replicas[u].decisions for u in urls}
            if isinstance(self.policy, PrefixPolicy):
                scored = self.policy.scores(hashes, urls)
                costs = {u: num_tokens - predicted_tokens(scored[1].get(u, 0), num_tokens, self.block_size)
                         for u in urls}
                d = self.policy.choose(urls, loads, hashes, costs, tiebreak, scored=scored)
            else:
                d = self.policy.choose(urls, loads, hashes, num_tokens, tiebreak)
            self.policy.routed(d.replica, hashes)
            if hashes:
                self.pending.add(d.replica, hashes)
            r = self.replicas[d.replica]
            pred = predicted_tokens(d.matched_blocks, num_tokens, self.block_size)
            r.inflight += 1
            r.inflight_tokens += num_tokens - pred
            r.decisions += 1
            r.predicted_tokens += pred
            return d.replica, pred, num_tokens - pred

    def done(self, replica: str, cost: int = 0, hashes=()) -> None:
        """A request routed with :meth:`choose` ended (``cost``: the third value choose returned; ``hashes``:
        the prompt's block hashes, leaving the pending index)."""
        with self.lock:
            if hashes:
                self.pending.remove(replica, hashes)
            r = self.replicas[replica]
            r.inflight -= 1
            r.inflight_tokens -= cost

    def index_blocks(self) -> int:
        with self.lock:
            return self.index.num_blocks()

    def index_shared_blocks(self) -> int:
        """Blocks the index believes the shared store holds (0 for an index without a shared store)."""
        with self.lock:
            f = getattr(self.index, "num_shared_blocks", None)
            return int(f()) if f is not None else 0
