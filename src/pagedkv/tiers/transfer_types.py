"""What :class:`~pagedkv.tiers.connector.TierConnector` hands back and counts: the tiers' media names, a lookup's
and a load's results (:class:`LookupDone`, :class:`LoadDone`), each tier's counters and the load-latency histogram
(torch-free)."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

__all__ = ["MEDIUM_DISK", "MEDIUM_SHARED", "DEFAULT_MAX_LOAD_MS_PER_BLOCK", "RESTORED_BATCH", "LATENCY_BUCKETS_S",
           "LoadDone", "LookupDone", "TierCounters", "LoadLatencyHistogram"]

MEDIUM_DISK = "DISK"
MEDIUM_SHARED = "SHARED"

#: the prefill time of one 16-token block of SmolLM2-135M measured by benchmarks/tier_crossover.py on this
#: machine (683 ms; Gemma 3 270M: 802 ms): a tier whose loads take longer per block than this is not read
DEFAULT_MAX_LOAD_MS_PER_BLOCK = 683.0

#: blocks per BlockStored event when a restarted tier publishes what it found (TierConnector start)
RESTORED_BATCH = 1024

#: the load-latency histogram's upper bounds in seconds (Prometheus ``le`` labels), +Inf implied
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoadDone(NamedTuple):
    """A finished load (:meth:`TierConnector.poll`)."""

    request_id: Any
    start_block: int  # the first block loaded (the GPU/CPU hit, in blocks, when the load was asked)
    payloads: tuple  # read-only buffers, one per good leading block from start_block on
    ok: bool  # every block the tiers said they hold came back checked
    num_asked: int  # blocks the tiers said they hold (len(payloads) <= num_asked; == when ok)
    by_tier: tuple  # (medium, blocks loaded from it) per tier, in lookup order
    seconds: float  # wall time of the lookup and the reads
    #: KV cache groups (:meth:`TierConnector.request_read_groups`): per group, the good leading payloads of the
    #: blocks it was asked for (``payloads`` is then empty); None without groups
    group_payloads: tuple | None = None


class LookupDone(NamedTuple):
    """A finished lookup (:meth:`TierConnector.request_lookup`): the tiers hold ``num_blocks`` leading blocks
    from ``start_block`` on; ``runs``: ``(tier index, blocks)`` in order, each tier's part of that run (a tier
    skipped or holding nothing there is left out)."""

    request_id: Any
    start_block: int
    num_blocks: int
    runs: tuple
    seconds: float
    #: KV cache groups (:meth:`TierConnector.request_lookup` with ``windows``): per group ``(first, tiers)``,
    #: the blocks ``[first, start_block + num_blocks)`` a load needs from the tiers in that group and, for each,
    #: the index of the first tier holding it (``runs`` is then empty); None without groups
    group_tiers: tuple | None = None


class TierCounters(NamedTuple):
    """One tier's counters as the connector saw them (a snapshot)."""

    medium: str
    lookups: int = 0  # load jobs that asked this tier
    hit_blocks: int = 0  # blocks loaded from it
    hit_bytes: int = 0
    failed_blocks: int = 0  # blocks it said it holds that did not come back checked
    skipped_slow: int = 0  # lookups skipped because its loads were slower than computing (crossover)
    stored_blocks: int = 0  # blocks newly stored in it
    stored_bytes: int = 0
    store_full: int = 0  # blocks refused because it was full (disk full: one warning, this metric)
    store_errors: int = 0
    load_ms_per_block: float = 0.0  # the moving average the crossover rule reads


class LoadLatencyHistogram:
    """A cumulative histogram of load latencies (seconds), Prometheus-style. Thread-safe; O(buckets) per
    observation."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            i = 0
            while i < len(self.buckets) and seconds > self.buckets[i]:
                i += 1
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[tuple, float, int]:
        """(cumulative counts per bucket with +Inf last, sum, count)."""
        with self._lock:
            cum, c = [], 0
            for n in self._counts:
                c += n
                cum.append(c)
            return tuple(cum), self._sum, c


class _Tier:
    __slots__ = ("medium", "store", "groups", "c", "ema_ms", "n_lookups")

    def __init__(self, medium: str, stores: tuple, initial_ms: float) -> None:
        self.medium = medium
        self.store = stores[0]
        self.groups = stores  # one BlockStore per KV cache group (one backend, group g's fingerprint)
        self.c = dict.fromkeys(TierCounters._fields[1:-1], 0)
        self.ema_ms = float(initial_ms)
        self.n_lookups = 0
