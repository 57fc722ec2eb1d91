"""KV-cache events over ZMQ in vLLM's wire layout, with a replay socket for subscribers that missed messages.

Wire layout (what a router written for vLLM's ``ZmqEventPublisher`` reads):

* A **PUB** socket bound at ``endpoint`` sends one multipart message per engine step that produced events:
  ``[topic, seq, payload]``: ``topic`` the UTF-8 topic (default ``kv-events``), ``seq`` an 8-byte big-endian
  sequence number counting from 0 without gaps, ``payload`` a msgpack array ``[ts, events, data_parallel_rank]``
  (``ts``: UNIX time in seconds, float; ``data_parallel_rank``: None). Each event is an array whose first element
  is its type name: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``. Block hashes are pagedkv's prefix-cache
  keys (unsigned 64-bit ints; :func:`pagedkv.block_hashes` computes them from tokens). The ``namespace`` of
  :class:`pagedkv.events.BlockStored` is not sent (vLLM's layout has no field for it; keys of different
  namespaces never coincide anyway). An event of a KV cache group (:class:`pagedkv.HybridBlockManager`) carries
  its group as vLLM's do: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`` (``lora_name``
  and ``extra_keys`` None) and ``["BlockRemoved", block_hashes, medium, group_idx]``; single-group events keep
  the short layout above. :func:`decode_payload` reads all of them, and vLLM's longer arrays (fields after
  ``kv_cache_spec_sliding_window`` are ignored). ``medium`` is sent as the event holds it: ``"GPU"``, ``"CPU"``,
  ``"DISK"`` or ``"SHARED"`` (:data:`pagedkv.events.MEDIA`), at vLLM's position and type (a string or nil); a
  consumer reads nil as ``"GPU"`` (:func:`pagedkv.events.medium_of`).
* A **ROUTER** socket bound at ``replay_endpoint`` resends recent messages. A client (a DEALER socket) sends
  ``[b"", start]`` with ``start`` an 8-byte big-endian sequence number; it receives ``[b"", seq, payload]`` for
  every buffered message with ``seq >= start``, in order, then the end marker ``[b"", -1 as 8 signed big-endian
  bytes, b""]``. The buffer keeps the last ``buffer_size`` messages: a client that asks for an older number gets
  what is left, and sees from the first ``seq`` it receives that it must resynchronise from scratch.

A subscriber that sees a gap in ``seq`` asks the replay socket for the missing range and then goes on with the
live stream (dropping duplicates by ``seq``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Iterable, Union

import msgspec
import zmq

from .. import events as ev

__all__ = [
    "KVEventPublisher",
    "KVEventBatch",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "END_SEQ",
    "decode_payload",
    "to_wire",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Base of the wire events: encoded as arrays led by the class name."""


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None] = None
    extra_keys: Union[list, None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class _ShortBlockStored(_Event, tag="BlockStored"):
    """What a single-group BlockStored is sent as (the short layout; :class:`BlockStored` decodes it)."""

    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class _ShortBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None]


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_payload(payload: bytes) -> KVEventBatch:
    """Decode the third frame of a message (for subscribers and tests)."""
    return _decoder.decode(payload)


def to_wire(event: Any) -> _Event:
    """A :mod:`pagedkv.events` event as its wire struct."""
    if isinstance(event, ev.BlockStored):
        args = ([int(h) for h in event.block_hashes],
                None if event.parent_block_hash is None else int(event.parent_block_hash),
                [int(t) for t in event.token_ids], int(event.block_size),
                None if event.lora_id is None else int(event.lora_id), event.medium)
        g = getattr(event, "group_idx", None)
        if g is None:
            return _ShortBlockStored(*args)
        w = getattr(event, "kv_cache_spec_sliding_window", None)
        return BlockStored(*args, None, None, int(g), getattr(event, "kv_cache_spec_kind", None),
                           None if w is None else int(w))
    if isinstance(event, ev.BlockRemoved):
        g = getattr(event, "group_idx", None)
        if g is None:
            return _ShortBlockRemoved([int(h) for h in event.block_hashes], event.medium)
        return BlockRemoved([int(h) for h in event.block_hashes], event.medium, int(g))
    if isinstance(event, ev.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


class KVEventPublisher:
    """Publishes batches of :mod:`pagedkv.events` events (see the module docstring for the wire layout).

    :meth:`publish` is thread-safe and never blocks on the network: batches are queued and sent by the
    publisher's own thread, which owns both sockets (ZMQ sockets are not thread-safe). ``endpoint`` and
    ``replay_endpoint`` are ZMQ addresses to bind (``tcp://127.0.0.1:5557``; port ``*`` picks a free port, and
    :attr:`endpoint` / :attr:`replay_endpoint` then hold the bound address). ``replay_endpoint=None`` disables
    replay.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "kv-events",
                 buffer_size: int = 10_000) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._queue: queue.Queue = queue.Queue()
        self._ring: deque = deque(maxlen=buffer_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """Sequence number of the next message sent."""
        return self._seq

    def publish(self, events: Iterable[Any]) -> None:
        """Queue one batch (one message); an empty batch is not sent."""
        batch = [to_wire(e) for e in events]
        if batch:
            self._queue.put(KVEventBatch(time.time(), batch))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued batch has been sent."""
        deadline = time.monotonic() + timeout
        while not self._queue.empty() or self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError("KV events were not sent in time")
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(0)
        self._ctx.term()

    # -------------------------------------------------------------------------------- publisher thread
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            self._send_queued()
            if self._replay is not None:
                if dict(poller.poll(10)).get(self._replay):
                    self._serve_replay()
            else:
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._send(batch)
                self._queue.task_done()
        self._send_queued()

    def _send_queued(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(batch)
            self._queue.task_done()

    def _send(self, batch: KVEventBatch) -> None:
        seq = self._seq.to_bytes(8, "big")
        payload = self._encoder.encode(batch)
        self._ring.append((self._seq, seq, payload))
        self._seq += 1
        self._pub.send_multipart((self.topic, seq, payload))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request: ignore it
            identity, envelope, start = frames[0], frames[1:-1], int.from_bytes(frames[-1], "big")
            for num, seq, payload in list(self._ring):
                if num >= start:
                    self._replay.send_multipart((identity, *envelope, seq, payload))
            self._replay.send_multipart((identity, *envelope, END_SEQ, b""))
