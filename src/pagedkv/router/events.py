"""Subscription to every replica's KV events (the wire layout of :mod:`pagedkv.server.kv_events`).

One thread owns one ZMQ SUB socket per replica and applies each message's events, in sequence order, through a
callback (the router's index). Per replica it keeps the last applied sequence number ``seq`` and the timestamp of
that message:

- the next message (``seq + 1``) is applied;
- a jump (``seq + k``, k > 1: messages lost, or a subscriber that joined late) is a *gap*: the missing range is
  asked from the replica's replay socket (DEALER ``[b"", start]``, answers until the end marker), applied in
  order, then the live stream goes on and duplicates (``<= seq``) are dropped. If the replay cannot go back far
  enough (the replica's buffer no longer holds ``start``), the replica's blocks are cleared from the index and
  what the replay returned is applied: the index then under-reports that replica (a missed hit, never a wrong
  one) until its blocks are stored again. Both count as a resync;
- a message numbered ``<= seq`` but newer than the last one applied (its timestamp is later) means the replica
  restarted (its numbering starts again at 0): its blocks are cleared and the stream is followed from there;
- when the router starts, each replica is asked for a replay from ``start_seq(replica)`` (0, or the sequence
  number after the last one a shared Redis index recorded), so a replica that is idle is known at once.

``drop_next(replica, n)`` discards the next n live messages as if they were lost (a test hook for the resync).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["EventSubscriber", "Feed", "replay_endpoint_for"]

END = -1


def replay_endpoint_for(endpoint: str) -> str:
    """The replay endpoint ``pagedkv serve`` uses by default: the events port + 1."""
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot derive a replay endpoint from {endpoint!r}")
    return f"{head}:{int(port) + 1}"


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
    dropping: int = 0  #: live messages still to discard (test hook)
    reset: bool = False  #: forget the numbering before the next message
    sock: object = field(default=None, repr=False)


class EventSubscriber:
    """Follows the feeds of ``replicas`` (``{name: (events_endpoint, replay_endpoint or None)}``).

    ``apply(replica, events)`` receives each message's events (wire structs) in order; ``clear(replica)``
    forgets a replica's blocks; ``start_seq(replica)`` (optional) gives the first sequence number wanted;
    ``applied(replica, seq)`` (optional) is told each applied number. Callbacks run on the subscriber's thread.
    """

    def __init__(self, replicas: dict, apply: Callable, clear: Callable, *, topic: str = "kv-events",
                 start_seq: Callable | None = None, applied: Callable | None = None,
                 replay_timeout: float = 2.0) -> None:
        import zmq

        from ..server.kv_events import decode_payload

        self._zmq = zmq
        self._decode = decode_payload
        self._apply, self._clear = apply, clear
        self._start_seq = start_seq or (lambda r: 0)
        self._applied = applied
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.ctx = zmq.Context()
        self.feeds: dict[str, Feed] = {}
        for name, (ep, rep) in replicas.items():
            self.feeds[name] = Feed(name, ep, rep)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-router-events", daemon=True)
        self.ready = threading.Event()

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
            s.connect(f.endpoint)
            f.sock = s
            by_sock[s] = f
            poller.register(s, zmq.POLLIN)
        self.ready.set()
        for f in self.feeds.values():  # learn what idle replicas already cache
            with self._lock:
                start = self._start_seq(f.replica) if f.seq is None else f.seq + 1
            self._replay(f, start, initial=True)
        try:
            while not self._stop.is_set():
                for f in self.feeds.values():
                    if f.reset:  # the replica came back (health checks): rebuild it from its replay now
                        with self._lock:
                            f.seq, f.ts, f.reset = None, 0.0, False
                        self._replay(f, 0, initial=True)
                for s, _ in poller.poll(50):
                    f = by_sock[s]
                    while True:
                        try:
                            frames = s.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) == 3:
                            self._on_live(f, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            for s in by_sock:
                s.close(0)

    def _on_live(self, f: Feed, seq: int, payload: bytes) -> None:
        with self._lock:
            if f.reset:
                f.seq, f.ts, f.reset = None, 0.0, False
            if f.dropping:
                f.dropping -= 1
                return
        batch = self._decode(payload)
        if f.seq is None:
            start = self._start_seq(f.replica)
            if seq > start:
                f.resyncs += 1
                self._replay(f, start)
                if f.seq is not None and seq <= f.seq:
                    return
            elif seq < start:  # the replica restarted while no router followed it
                f.restarts += 1
                self._clear(f.replica)
        elif seq <= f.seq:
            if batch.ts <= f.ts:
                return  # a duplicate (seen live and in a replay)
            f.restarts += 1  # numbering started again: the replica restarted
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

    def _deliver(self, f: Feed, seq: int, batch) -> None:
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
            s.connect(f.replay_endpoint)
            s.send_multipart((b"", int(start).to_bytes(8, "big")))
            first = True
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    return False
                frames = s.recv_multipart()
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
                self._deliver(f, seq, self._decode(payload))
        finally:
            s.close(0)
