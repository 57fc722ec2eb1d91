"""One decode-side transfer into reserved cache blocks (:class:`ExternalFetch`), shared by the server's read of a
prefill replica's hold (on the event loop) and :class:`pagedkv.engine.kv_port.EngineKVPort` on the engine's step
loop (docs/pd-split.md#the-decode-side)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

__all__ = ["ExternalFetch"]


class ExternalFetch:
    """One request's transfer into its reserved cache blocks (decode side), shared by the server's read (on the
    event loop) and the engine's step loop (its thread). Made by :meth:`EngineKVPort.expect_external`.

    Server side: ``await reserved()`` (the number of leading values the engine takes once the request's blocks
    are reserved: all of them, or 0 when the request ended first or needs none), then ``put(payload)`` for each
    checked value in wire order, then ``end(good, error)`` once (later calls are ignored); ``cancelled`` turns
    True when the request ended meanwhile (the read may stop: nothing more is written). Engine side: the port
    decides, takes the arrived payloads (:meth:`take`) and reads :attr:`ended`. Thread-safe; O(1) per call."""

    def __init__(self, request_id: Any, num_blocks: int, num_values: int, wake: threading.Event) -> None:
        self.request_id = request_id
        self.num_blocks = int(num_blocks)  # prompt blocks handed over (remote_block_ids)
        self.num_values = int(num_values)  # values on the wire (KV cache groups: several per block)
        self._wake = wake
        self._lock = threading.Lock()
        self._decided: int | None = None
        self._waiter: Any = None  # (loop, future) of the server's reserved()
        self._queue: deque = deque()
        self.ended: tuple | None = None  #: (good values, error) once the read ended
        self.cancelled = False
        self.taken = 0  #: values the engine took so far (written, or dropped)

    # ---------------------------------------------------------------- server side
    async def reserved(self, gone: Any = None, every_s: float = 0.5) -> int:
        """Wait for the engine's answer (the values to read; 0: none). ``gone``: a callable checked every
        ``every_s`` seconds meanwhile; once it returns True (the request's stream ended: the engine failed or
        dropped it before the scheduler saw it) the wait ends with 0 and the transfer is cancelled."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._decided is not None:
                return self._decided
            fut = loop.create_future()
            self._waiter = (loop, fut)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), every_s if gone is not None else None)
            except TimeoutError:
                if gone():
                    self.cancel()
                    return await fut

    def put(self, payload: Any) -> None:
        if self.cancelled:
            return  # (dropped at once: its room in the staging budget comes back)
        self._queue.append(payload)
        self._wake.set()

    def end(self, good: int, error: str | None) -> None:
        with self._lock:
            if self.ended is not None:
                return
            self.ended = (int(good), error)
        self._wake.set()

    # ---------------------------------------------------------------- engine side
    def decide(self, values: int) -> None:
        """The engine's answer to :meth:`reserved` (once; later calls are ignored)."""
        with self._lock:
            if self._decided is not None:
                return
            self._decided = int(values)
            w, self._waiter = self._waiter, None
        if w is not None:
            loop, fut = w
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(int(values)))
            except RuntimeError:  # (its loop closed)
                pass

    def cancel(self) -> None:
        """The request ended: the read may stop, nothing more is written, queued payloads are dropped."""
        self.cancelled = True
        self.decide(0)
        self._queue.clear()

    def take(self) -> list:
        out = []
        q = self._queue
        while q:
            out.append(q.popleft())
        return out
