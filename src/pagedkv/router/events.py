"""Subscription to every replica's KV events (the wire layout of :mod:`pagedkv.server.kv_events`).

One thread owns one ZMQ SUB socket per replica and applies each message's events, in sequence order, through a
callback (the router's index). Per replica it keeps the last applied sequence number ``seq`` and the timestamp of
that message:

- the next message (``seq + 1``) is applied;
- a jump (``seq + k``, k > 1: messages lost, or a subscriber that joined late) is a *gap*: the missing range is
  asked from the replica's replay socket (DEALER ``[b"", start]``, answers until the end marker, framed as vLLM
  0.33 frames them, ``[b"", topic, seq, payload]``, or as older versions did, ``[b"", seq, payload]``), applied in
  order, then the live stream goes on and duplicates (``<= seq``) are dropped. If the replay cannot go back far
  enough (the replica's buffer no longer holds ``start``), the replica's blocks are cleared from the index and
  what the replay returned is applied: the index then under-reports that replica (a missed hit, never a wrong
  one) until its blocks are stored again. Both count as a resync;
- a message numbered ``<= seq`` but newer than the last one applied (its timestamp is later) means the replica
  restarted (its numbering starts again at 0): its blocks are cleared and the stream is followed from there;
- when the router starts, each replica is asked for a replay from ``start_seq(replica)`` (0, or the sequence
  number after the last one a shared Redis index recorded), so a replica that is idle is known at once;
- when a replica leaves routing or comes back (:meth:`EventSubscriber.forget`, from the health checks) its
  numbering is forgotten, its blocks cleared and rebuilt from its replay socket; the last numbering seen is kept
  aside so that the first message after it tells a restart (numbering back at or below it, with a later
  timestamp) from a replica that was only unreachable. Restarts are counted in :attr:`Feed.restarts` either way.

Faults (the thread never ends on one; see docs/router-reliability.md):

- *malformed messages* (not three frames, a sequence number that is not 8 bytes, a payload in neither msgpack
  layout of :mod:`pagedkv.server.kv_events` (vLLM 0.33's maps, the older arrays), an event with a medium other
  than None, GPU, CPU, DISK, SHARED or vLLM's STORAGE (read as DISK), a negative hash or a non-finite
  timestamp) are dropped and
  counted in :attr:`Feed.bad_payloads`; the numbering steps over it when it is the very next number (or it comes
  from the replay socket), otherwise it is left alone (a stray message proves nothing; a real one missing is a
  gap that the next good message reveals);
- *the index is unreachable* (the callbacks raise :class:`~pagedkv.cluster.index.IndexUnavailableError`, e.g.
  Redis is down): the ``health`` object is told (:meth:`IndexHealth.index_failed`), live messages are drained
  and dropped, and ``health.probe_index()`` is asked once per ``probe_interval``; when it answers, every replica
  is cleared and rebuilt from its replay socket (from 0), then ``health.index_recovered()`` is called;
- anything else raised while handling a message is logged and counted in :attr:`EventSubscriber.errors`.

``drop_next(replica, n)`` discards the next n live messages as if they were lost (a test hook for the resync).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..cluster.index import IndexUnavailableError
from ..events import MEDIA, MEDIUM_ALIASES

__all__ = ["EventSubscriber", "Feed", "IndexHealth", "replay_endpoint_for"]

END = -1
_MEDIA = (None, *MEDIA, *MEDIUM_ALIASES)  # (None reads as GPU; vLLM's STORAGE as DISK)
log = logging.getLogger("pagedkv.router")


def replay_endpoint_for(endpoint: str) -> str:
    """The replay endpoint ``pagedkv serve`` uses by default: the events port + 1."""
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot derive a replay endpoint from {endpoint!r}")
    return f"{head}:{int(port) + 1}"


class BadPayload(ValueError):
    """A message that is not in the wire layout (dropped and counted)."""


@dataclass
class Feed:
    """One replica's event stream."""

    replica: str
    endpoint: str
    replay_endpoint: str | None
    seq: int | None = None  #: last applied sequence number (None: nothing yet)
    ts: float = 0.0  #: timestamp of the last applied message
    lag: float = 0.0  #: seconds between the last applied message's timestamp and its application
    messages: int = 0
    events: int = 0
    resyncs: int = 0  #: gaps repaired through the replay socket
    incomplete: int = 0  #: gaps the replay could not fully repair (replica cleared)
    restarts: int = 0  #: restarts detected from the numbering
    bad_payloads: int = 0  #: malformed messages dropped
    dropping: int = 0  #: live messages still to discard (test hook)
    reset: bool = False  #: forget the numbering and rebuild from the replay before the next message
    prev: tuple | None = None  #: (seq, ts) before the last reset, to tell a restart on the next message
    sock: object = field(default=None, repr=False)


class IndexHealth:
    """What the subscriber tells and asks about the index (the router's :class:`~.state.RouterState` is one).
    This default keeps the state in itself and takes any index as reachable again at the first probe."""

    def __init__(self) -> None:
        self.index_ok = True

    def index_failed(self, error: BaseException) -> None:
        self.index_ok = False

    def probe_index(self) -> bool:
        return True

    def index_recovered(self) -> None:
        self.index_ok = True


class _Throttle:
    """At most one log line per key every ``every`` seconds (the first one at once)."""

    def __init__(self, every: float = 60.0) -> None:
        self.every, self._last = every, {}

    def __call__(self, key) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e18) >= self.every:
            self._last[key] = now
            return True
        return False


class EventSubscriber:
    """Follows the feeds of ``replicas`` (``{name: (events_endpoint, replay_endpoint or None)}``).

    ``apply(replica, events)`` receives each message's events (wire structs) in order; ``clear(replica)``
    forgets a replica's blocks; ``start_seq(replica)`` (optional) gives the first sequence number wanted;
    ``applied(replica, seq)`` (optional) is told each applied number; ``health`` (optional, an
    :class:`IndexHealth`) is told of index outages and probed until the index is back. Callbacks run on the
    subscriber's thread; any of them may raise ``IndexUnavailableError``.
    """

    def __init__(self, replicas: dict, apply: Callable, clear: Callable, *, topic: str = "kv-events",
                 start_seq: Callable | None = None, applied: Callable | None = None,
                 replay_timeout: float = 2.0, health: IndexHealth | None = None,
                 probe_interval: float = 1.0) -> None:
        import msgspec
        import zmq

        from ..server.kv_events import decode_payload

        self._zmq = zmq
        self._decode_error = msgspec.DecodeError
        self._decode_payload = decode_payload
        self._apply, self._clear = apply, clear
        self._start_seq = start_seq or (lambda r: 0)
        self._applied = applied
        self.health = health if health is not None else IndexHealth()
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.probe_interval = probe_interval
        self.ctx = zmq.Context()
        self.feeds: dict[str, Feed] = {}
        for name, (ep, rep) in replicas.items():
            self.feeds[name] = Feed(name, ep, rep)
        self.errors = 0  #: unexpected exceptions while handling messages (logged)
        self.index_resyncs = 0  #: full rebuilds after the index came back
        self._initial: set[str] = set(self.feeds)  # feeds whose start-up replay is still to do
        self._next_probe = 0.0
        self._throttle = _Throttle()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-router-events", daemon=True)
        self.ready = threading.Event()

    @property
    def alive(self) -> bool:
        """Whether the subscriber's thread runs."""
        return self._thread.is_alive()

    @property
    def bad_payloads(self) -> int:
        return sum(f.bad_payloads for f in self.feeds.values())

    def start(self) -> "EventSubscriber":
        self._thread.start()
        self.ready.wait(10)
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.term()

    def drop_next(self, replica: str, n: int) -> None:
        with self._lock:
            self.feeds[replica].dropping += n

    def forget(self, replica: str) -> None:
        """The replica left or came back (health checks): follow its numbering from scratch, replaying from 0
        (done by the subscriber's thread within one poll interval)."""
        with self._lock:
            self.feeds[replica].reset = True

    # ------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        by_sock = {}
        for f in self.feeds.values():
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, self.topic)
            try:
                s.connect(f.endpoint)
            except zmq.ZMQError as e:  # a malformed endpoint: that replica is routed on load alone
                log.error("KV events of %s: cannot connect to %s (%s); its cache is not indexed",
                          f.replica, f.endpoint, e)
                s.close(0)
                self._initial.discard(f.replica)
                continue
            f.sock = s
            by_sock[s] = f
            poller.register(s, zmq.POLLIN)
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    self._tick(poller, by_sock)
                except IndexUnavailableError as e:
                    self.health.index_failed(e)
                except Exception as e:  # a bug or an unforeseen input: log it, count it, keep following
                    self.errors += 1
                    if self._throttle(("error", type(e).__name__)):
                        log.exception("KV-event subscriber: unexpected %s (the subscriber goes on)", type(e).__name__)
                    self._stop.wait(0.05)
        finally:
            for s in by_sock:
                s.close(0)

    def _tick(self, poller, by_sock) -> None:
        if not self.health.index_ok:
            self._while_index_down(poller, by_sock)
            return
        for f in self.feeds.values():
            if f.reset:  # the replica left or came back (health checks): rebuild it from its replay now
                with self._lock:
                    self._forget_numbering(f)
                    f.reset = False
                self._initial.discard(f.replica)
                self._clear(f.replica)
                self._replay(f, 0, initial=True)
            elif f.replica in self._initial:  # learn what idle replicas already cache
                start = self._start_seq(f.replica) if f.seq is None else f.seq + 1
                self._replay(f, start, initial=True)
                self._initial.discard(f.replica)
        for s, _ in poller.poll(50):
            f = by_sock[s]
            while True:
                try:
                    frames = s.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                try:
                    self._on_frames(f, frames)
                except (BadPayload, self._decode_error) as e:
                    self._bad(f, e)

    def _while_index_down(self, poller, by_sock) -> None:
        """Drain the live messages (they will be replayed), probe the index, rebuild every replica when it is
        back."""
        for s, _ in poller.poll(50):
            while True:
                try:
                    s.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + self.probe_interval
        if not self.health.probe_index():
            return
        for f in self.feeds.values():
            with self._lock:
                self._forget_numbering(f)
                f.reset = False
            self._clear(f.replica)
            if f.sock is not None:
                self._replay(f, 0, initial=True)
        self._initial.clear()
        self.index_resyncs += 1
        self.health.index_recovered()

    @staticmethod
    def _forget_numbering(f: Feed) -> None:  # (under the lock)
        if f.seq is not None:
            f.prev = (f.seq, f.ts)
        f.seq, f.ts, f.dropping = None, 0.0, 0

    def _bad(self, f: Feed, e: Exception) -> None:
        f.bad_payloads += 1
        if self._throttle(("bad", f.replica)):
            log.warning("KV events of %s: dropped a malformed message (%s); %d so far", f.replica, e,
                        f.bad_payloads)

    def _decode(self, payload: bytes):
        """The batch of a payload, checked beyond its msgpack layout (BadPayload / msgspec.DecodeError)."""
        batch = self._decode_payload(payload)
        if not math.isfinite(batch.ts):
            raise BadPayload(f"timestamp {batch.ts!r}")
        for e in batch.events:
            if getattr(e, "medium", None) not in _MEDIA:
                raise BadPayload(f"unknown medium {e.medium!r}")
            if any(h < 0 for h in getattr(e, "block_hashes", ())):
                raise BadPayload("negative block hash")
        return batch

    def _on_frames(self, f: Feed, frames: list) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            raise BadPayload(f"{len(frames)} frames" if len(frames) != 3 else "sequence number not 8 bytes")
        with self._lock:
            if f.reset:
                return  # rebuilt from the replay at the next tick
            if f.dropping:
                f.dropping -= 1
                return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = self._decode(frames[2])
        except (BadPayload, self._decode_error):
            if f.seq is not None and seq == f.seq + 1:
                f.seq = seq  # the very next number: step over it (no gap to repair, the replay holds the same)
            raise
        self._on_live(f, seq, batch)

    def _on_live(self, f: Feed, seq: int, batch) -> None:
        if f.seq is None:
            start = self._start_seq(f.replica)
            if seq > start:
                f.resyncs += 1
                self._replay(f, start)
                if f.seq is not None and seq <= f.seq:
                    return
            elif seq < start and f.prev is None:  # the replica restarted while no router followed it
                f.restarts += 1
                log.warning("replica %s restarted (its KV-event numbering starts again)", f.replica)
                self._clear(f.replica)
        elif seq <= f.seq:
            if batch.ts <= f.ts:
                return  # a duplicate (seen live and in a replay)
            self._restarted(f)
            self._clear(f.replica)
            f.seq = None
            if seq > 0:
                f.resyncs += 1
                self._replay(f, 0)
                if f.seq is not None and seq <= f.seq:
                    return
        elif seq > f.seq + 1:
            f.resyncs += 1
            self._replay(f, f.seq + 1)
            if seq <= f.seq:
                return
        self._deliver(f, seq, batch)

    def _restarted(self, f: Feed) -> None:
        f.restarts += 1
        f.prev = None
        log.warning("replica %s restarted (its KV-event numbering starts again); restart %d seen", f.replica,
                    f.restarts)

    def _deliver(self, f: Feed, seq: int, batch) -> None:
        if f.seq is None and f.prev is not None:  # the first message after a reset: a restart in between?
            pseq, pts = f.prev
            if seq <= pseq and batch.ts > pts:
                self._restarted(f)
                self._clear(f.replica)
            f.prev = None
        self._apply(f.replica, batch.events)
        f.seq, f.ts = seq, batch.ts
        f.lag = max(time.time() - batch.ts, 0.0)
        f.messages += 1
        f.events += len(batch.events)
        if self._applied is not None:
            self._applied(f.replica, seq)

    def _replay(self, f: Feed, start: int, initial: bool = False) -> bool:
        """Ask ``f``'s replay socket for messages from ``start`` and apply them. False if it did not answer."""
        if f.replay_endpoint is None:
            if not initial:
                f.incomplete += 1
            return False
        zmq = self._zmq
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            try:
                s.connect(f.replay_endpoint)
            except zmq.ZMQError as e:
                if self._throttle(("replay", f.replica)):
                    log.error("KV events of %s: cannot connect to the replay socket %s (%s)", f.replica,
                              f.replay_endpoint, e)
                return False
            s.send_multipart((b"", int(start).to_bytes(8, "big")))
            first = True
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    return False
                frames = s.recv_multipart()
                if len(frames) < 2 or len(frames[-2]) != 8:
                    self._bad(f, BadPayload("replay answer not [seq, payload]"))
                    continue
                seqb, payload = frames[-2], frames[-1]
                seq = int.from_bytes(seqb, "big", signed=True)
                if seq == END:
                    return True
                if first and seq > start:  # the buffer no longer reaches back to start
                    f.incomplete += 1
                    if f.seq is not None or start > 0:
                        self._clear(f.replica)
                first = False
                if f.seq is not None and seq <= f.seq:
                    continue
                try:
                    batch = self._decode(payload)
                except (BadPayload, self._decode_error) as e:
                    self._bad(f, e)
                    if seq >= 0:  # the replica's own buffer numbers it: step over it, or every message is a gap
                        f.seq = seq
                    continue
                self._deliver(f, seq, batch)
        finally:
            s.close(0)
