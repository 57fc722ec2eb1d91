"""KV-cache events over ZMQ in vLLM's wire layout, with a replay socket for subscribers that missed messages.

Wire layout, by default vLLM 0.33's (``--kv-events-layout map``; what a consumer built on vLLM 0.33's
``vllm.distributed.kv_events`` reads, checked with vLLM's own classes by tests/compat/):

* A **PUB** socket bound at ``endpoint`` sends one multipart message per engine step that produced events:
  ``[topic, seq, payload]``: ``topic`` the UTF-8 topic (default ``kv-events``), ``seq`` an 8-byte big-endian
  sequence number counting from 0 without gaps, ``payload`` a msgpack array ``[ts, events,
  data_parallel_rank]`` (``ts``: UNIX time in seconds, float; ``data_parallel_rank``: 0). Each event is a
  msgpack **map** tagged by its ``type``: ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}`` plus, when set, ``"extra_keys"``,
  ``"group_idx"``, ``"kv_cache_spec_kind"``, ``"kv_cache_spec_sliding_window"`` (fields left at their default
  are left out, as vLLM's encoder does); ``{"type": "BlockRemoved", "block_hashes", "medium"}`` plus
  ``"group_idx"``; ``{"type": "AllBlocksCleared"}``. ``lora_id`` and ``lora_name`` are nil (pagedkv has no
  LoRA); ``extra_keys`` carries the request's ``cache_salt`` (its namespace) as vLLM does: one entry per block,
  ``[salt]`` for the first block of a prompt, nil for the others, the whole field left out without a salt.
* A **ROUTER** socket bound at ``replay_endpoint`` resends recent messages. A client (a DEALER socket) sends
  ``[b"", start]`` with ``start`` an 8-byte big-endian sequence number; it receives ``[b"", topic, seq,
  payload]`` for every buffered message with ``seq >= start``, in order, then the end marker ``[b"", b"", -1 as
  8 signed big-endian bytes, b""]`` (vLLM 0.33's framing). The buffer keeps the last ``buffer_size`` messages: a
  client that asks for an older number gets what is left, and sees from the first ``seq`` it receives that it
  must resynchronise from scratch.

``--kv-events-layout array`` sends the older layout instead (:mod:`.kv_events_array`: events as arrays led by
their type name, vLLM 0.9 to 0.23's, ``data_parallel_rank`` nil) and frames replay answers as those versions
did: ``[b"", seq, payload]``, end ``[b"", END, b""]``. (vLLM 0.25 sent maps with that older replay framing;
vLLM 0.28 frames replays as 0.33 does.)

Block hashes are pagedkv's prefix-cache keys (unsigned 64-bit ints; :func:`pagedkv.block_hashes` computes them
from tokens), not vLLM's digests. ``medium`` is sent as the event holds it: ``"GPU"``, ``"CPU"``, ``"DISK"`` or
``"SHARED"`` (:data:`pagedkv.events.MEDIA`; vLLM's own strings are ``"GPU"``, ``"CPU"`` and ``"STORAGE"``).
:func:`decode_payload` reads both layouts, vLLM's block hashes sent as digest bytes, and fields newer vLLM
versions add (ignored).

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
from . import kv_events_array as _array

__all__ = [
    "KVEventPublisher",
    "KVEventBatch",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "END_SEQ",
    "LAYOUTS",
    "decode_payload",
    "to_wire",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: the wire layouts: "map" (vLLM 0.33's, the default), "array" (vLLM 0.9 to 0.23's)
LAYOUTS = ("map", "array")
_Hash = Union[int, bytes]  # vLLM sends its digests as bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0


class _Event(msgspec.Struct, omit_defaults=True, tag=True, gc=False):
    """Base of the map-layout events: msgpack maps tagged ``type`` = the class name, defaults left out."""


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: Union[_Hash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[list, None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None
    session_id: Union[str, None] = None
    lookahead_token_ids: Union[list[list[int]], None] = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def _key(h):
    """A digest sent as bytes -> vLLM's int form of it (low 64 bits, big-endian); ints unchanged."""
    return h if isinstance(h, int) else int.from_bytes(bytes(h)[-8:], "big")


def _int_keys(batch):
    for e in batch.events:
        hs = getattr(e, "block_hashes", None)
        if hs and not all(type(h) is int for h in hs):
            e.block_hashes = [_key(h) for h in hs]
        p = getattr(e, "parent_block_hash", None)
        if p is not None and type(p) is not int:
            e.parent_block_hash = _key(p)
    return batch


def decode_payload(payload: bytes, *, int_keys: bool = True):
    """Decode the third frame of a message, of either layout (the map layout first; msgspec.DecodeError when
    neither reads it). ``int_keys``: block hashes sent as bytes (vLLM's digests) become vLLM's int form of
    them, the keys :mod:`pagedkv.cluster.vllm_hash` computes. O(payload)."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.ValidationError as e:
        try:
            batch = _array.decoder.decode(payload)
        except msgspec.DecodeError:
            raise e from None
    return _int_keys(batch) if int_keys else batch


def _extra_keys(event) -> list | None:
    """vLLM's per-block ``extra_keys`` of a pagedkv BlockStored: the namespace (a request's cache_salt) on the
    first block of a prompt, None elsewhere; None when there is nothing to say."""
    ns = getattr(event, "namespace", None)
    if not isinstance(ns, str) or not ns or event.parent_block_hash is not None or not event.block_hashes:
        return None
    return [[ns]] + [None] * (len(event.block_hashes) - 1)


def to_wire(event: Any, layout: str = "map"):
    """A :mod:`pagedkv.events` event as its wire struct in ``layout`` (:data:`LAYOUTS`)."""
    if layout == "array":
        return _array.to_wire(event)
    if layout != "map":
        raise ValueError(f"unknown KV-event layout {layout!r} (expected one of {', '.join(LAYOUTS)})")
    if isinstance(event, ev.BlockStored):
        g = getattr(event, "group_idx", None)
        w = getattr(event, "kv_cache_spec_sliding_window", None)
        return BlockStored(
            [int(h) for h in event.block_hashes],
            None if event.parent_block_hash is None else int(event.parent_block_hash),
            [int(t) for t in event.token_ids], int(event.block_size),
            None if event.lora_id is None else int(event.lora_id), event.medium, None,
            extra_keys=_extra_keys(event), group_idx=None if g is None else int(g),
            kv_cache_spec_kind=getattr(event, "kv_cache_spec_kind", None),
            kv_cache_spec_sliding_window=None if w is None else int(w))
    if isinstance(event, ev.BlockRemoved):
        g = getattr(event, "group_idx", None)
        return BlockRemoved([int(h) for h in event.block_hashes], event.medium, None if g is None else int(g))
    if isinstance(event, ev.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


class KVEventPublisher:
    """Publishes batches of :mod:`pagedkv.events` events (see the module docstring for the wire layout).

    :meth:`publish` is thread-safe and never blocks on the network: batches are queued and sent by the
    publisher's own thread, which owns both sockets (ZMQ sockets are not thread-safe). ``endpoint`` and
    ``replay_endpoint`` are ZMQ addresses to bind (``tcp://127.0.0.1:5557``; port ``*`` picks a free port, and
    :attr:`endpoint` / :attr:`replay_endpoint` then hold the bound address). ``replay_endpoint=None`` disables
    replay. ``layout``: :data:`LAYOUTS` (the payload layout and the replay framing that goes with it).
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "kv-events",
                 buffer_size: int = 10_000, layout: str = "map") -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV-event layout {layout!r} (expected one of {', '.join(LAYOUTS)})")
        self.layout = layout
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
        batch = [to_wire(e, self.layout) for e in events]
        if batch:
            if self.layout == "map":
                self._queue.put(KVEventBatch(time.time(), batch, 0))
            else:
                self._queue.put(_array.KVEventBatch(time.time(), batch))

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

    def _send(self, batch) -> None:
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
            topic = (self.topic,) if self.layout == "map" else ()  # (vLLM 0.33 frames the topic; 0.18 did not)
            for num, seq, payload in list(self._ring):
                if num >= start:
                    self._replay.send_multipart((identity, *envelope, *topic, seq, payload))
            self._replay.send_multipart((identity, *envelope, *(b"" for _ in topic), END_SEQ, b""))
