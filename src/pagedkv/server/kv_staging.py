"""The decode side's staging budget (:class:`StagingBudget`: the bytes read from prefill replicas and not yet
written into their reserved cache blocks), the payload that gives its room back when dropped
(:class:`StagedPayload`) and the fetch-time histogram (:class:`LatencyHistogram`); see
:mod:`pagedkv.server.kv_handoff`."""

from __future__ import annotations

import asyncio
import bisect
import threading
from typing import Any, Sequence

__all__ = ["StagingBudget", "StagedPayload", "LatencyHistogram", "FETCH_BUCKETS"]

#: seconds: the buckets of the decode side's fetch-time histogram (pagedkv:kv_handoff_fetch_seconds)
FETCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StagingBudget:
    """The bytes of fetched KV payloads alive at once on a decode replica, under ``limit``. Thread-safe (payloads
    are dropped by the engine's thread). O(1) per call."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the staging budget must be >= 0 bytes, got {limit}")
        self.limit = int(limit)
        self._used = 0
        self.peak = 0  #: the most bytes ever staged at once
        self._lock = threading.Lock()
        self._waiters: list = []  # (loop, asyncio.Event) of fetches waiting for room

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, count: int, unit: int) -> int:
        """Reserve room for up to ``count`` payloads of ``unit`` bytes; the number reserved (those that fit)."""
        with self._lock:
            k = max(0, min(count, (self.limit - self._used) // unit)) if unit > 0 else count
            self._used += k * unit
            self.peak = max(self.peak, self._used)
            return k

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (a payload read into reserved cache blocks' way: the room was waited for with
        :meth:`room`, so this may pass the limit by what one HTTP chunk completes). O(1)."""
        with self._lock:
            self._used += nbytes
            self.peak = max(self.peak, self._used)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:  # (released by the engine's thread: wake the fetches on the event loop)
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # (its loop closed)
                pass

    async def room(self, nbytes: int) -> None:
        """Wait (on the event loop) until ``nbytes`` more fit under the limit; returns at once when they do. The
        caller bounds the wait (its fetch timeout); room comes back when the engine drops written payloads."""
        loop = asyncio.get_running_loop()
        while True:
            ev = asyncio.Event()
            with self._lock:
                if self._used + nbytes <= self.limit:
                    return
                self._waiters.append((loop, ev))
            await ev.wait()


class StagedPayload(bytes):
    """A fetched block's payload (``bytes``) that gives its room back to a :class:`StagingBudget` when the last
    reference to it goes (the engine wrote it into its block, or dropped its request)."""

    def __del__(self) -> None:
        budget = self.__dict__.get("_budget")
        if budget is not None:
            budget.release(len(self))

    @classmethod
    def staged(cls, data: Any, budget: StagingBudget) -> "StagedPayload":
        """A copy of ``data`` (bytes-like) counted against ``budget`` (whose room the caller reserved)."""
        p = cls(data)
        p._budget = budget
        return p


class LatencyHistogram:
    """Cumulative-bucket histogram of seconds (Prometheus' shape): ``buckets`` upper bounds, ``counts[i]``
    observations <= ``buckets[i]`` (the last entry: all), ``total`` their sum. Observed on the event loop."""

    def __init__(self, buckets: Sequence[float] = FETCH_BUCKETS) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self._n = [0] * (len(self.buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self._n[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    @property
    def counts(self) -> list[int]:
        out, acc = [], 0
        for n in self._n:
            acc += n
            out.append(acc)
        return out
