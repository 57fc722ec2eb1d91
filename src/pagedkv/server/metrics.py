"""Prometheus metrics of the server, vLLM-style names under ``pagedkv:``, in a registry of their own.

Gauges and counters are read at scrape time from :attr:`AsyncEngine.snapshot` (so they never drift from the
engine's own counts); the three latency histograms are observed by the engine thread through
:meth:`ServerMetrics.observe`.

===================================================  ==========================================================
``pagedkv:num_requests_running``                     requests in the running batch
``pagedkv:num_requests_waiting``                     requests waiting for admission (queued, preempted, or loading KV)
``pagedkv:num_requests_swapped``                     requests swapped out to the CPU pool
``pagedkv:kv_cache_usage_perc``                      blocks held by requests / all blocks (0..1; cached blocks
                                                     no request holds count as free, so 0 when idle)
``pagedkv:prefix_cache_queries_total``               prompt tokens looked up in the prefix cache
``pagedkv:prefix_cache_hits_total``                  of those, tokens found in it
``pagedkv:num_preemptions_total``                    request preemptions (recompute or swap)
``pagedkv:prompt_tokens_total``                      prompt tokens of requests that produced a first token
``pagedkv:generation_tokens_total``                  generated tokens (every sample)
``pagedkv:request_success_total{finished_reason}``   finished requests by reason (stop, length, abort, error)
``pagedkv:time_to_first_token_seconds``              histogram: arrival to first token
``pagedkv:inter_token_latency_seconds``              histogram: gap between two steps that gave a request tokens
``pagedkv:e2e_request_latency_seconds``              histogram: arrival to the last token
``pagedkv:kv_tier_*_total{medium}``                 with --kv-disk-dir / --kv-shared, per tier (DISK, SHARED):
                                                     hit_blocks, hit_bytes, failed_blocks, skipped_slow,
                                                     stored_blocks, stored_bytes, store_full, store_errors,
                                                     corrupt, mismatched, check_refused, read_errors
``pagedkv:kv_tier_load_ms_per_block{medium}``        the crossover rule's average load time per block
``pagedkv:kv_tier_load_seconds``                     histogram: a request's tier lookup and load
===================================================  ==========================================================
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting for admission (queued, preempted by recompute, or loading KV).",
    "num_requests_swapped": "Requests swapped out to the CPU pool.",
    "kv_cache_usage_perc": "KV-cache usage: blocks held by requests / all GPU blocks (0..1).",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Request preemptions.",
    "prompt_tokens": "Prompt tokens processed.",
    "generation_tokens": "Generated tokens.",
}


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def collect(self):
        snap = self._snapshot()
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"pagedkv:{name}", doc, labels=["model_name"])
            g.add_metric([self._model], float(snap.get(name, 0)))
            yield g
        for name, doc in _COUNTERS.items():
            c = CounterMetricFamily(f"pagedkv:{name}", doc, labels=["model_name"])
            c.add_metric([self._model], float(snap.get(name, 0)))
            yield c
        c = CounterMetricFamily("pagedkv:request_success", "Finished requests by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason, count in sorted(snap.get("request_success", {}).items()):
            c.add_metric([self._model, reason], float(count))
        yield c
        tiers = snap.get("kv_tiers")
        if tiers is not None:
            yield from _tier_metrics(tiers, self._model)


#: per storage tier (label ``medium``: DISK, SHARED): TierCounters field or BlockStore stats field -> doc
_TIER_COUNTERS = {
    "hit_blocks": ("tiers", "KV blocks loaded from the tier."),
    "hit_bytes": ("tiers", "KV bytes loaded from the tier."),
    "failed_blocks": ("tiers", "Blocks the tier said it held that did not load (corrupt, foreign, store down)."),
    "skipped_slow": ("tiers", "Lookups that skipped the tier: its loads were slower than computing."),
    "stored_blocks": ("tiers", "KV blocks newly stored in the tier."),
    "stored_bytes": ("tiers", "KV bytes newly stored in the tier."),
    "store_full": ("tiers", "Blocks not stored: the tier was full (disk full)."),
    "store_errors": ("tiers", "Blocks not stored: the tier failed."),
    "corrupt": ("store_stats", "Values refused and dropped: cut short, bad checksum, bad magic."),
    "mismatched": ("store_stats", "Values refused and dropped: another model fingerprint, name or format."),
    "check_refused": ("store_stats", "Values refused: another prefix's check digest (a chain-key collision) or none."),
    "read_errors": ("store_stats", "Blocks the tier could not answer (down, timeout, I/O error)."),
}


def _tier_metrics(tiers: dict, model: str):
    """The storage tiers' families (``pagedkv:kv_tier_*``) from ``EngineTiers.snapshot()``."""
    for name, (part, doc) in _TIER_COUNTERS.items():
        c = CounterMetricFamily(f"pagedkv:kv_tier_{name}", doc, labels=["model_name", "medium"])
        for counters, stats in zip(tiers["tiers"], tiers["store_stats"]):
            src = counters if part == "tiers" else stats
            c.add_metric([model, counters.medium], float(getattr(src, name)))
        yield c
    g = GaugeMetricFamily("pagedkv:kv_tier_load_ms_per_block",
                          "The crossover rule's moving average of a tier's load time per block (ms).",
                          labels=["model_name", "medium"])
    for counters in tiers["tiers"]:
        g.add_metric([model, counters.medium], float(counters.load_ms_per_block))
    yield g
    buckets, cum, total, _count = tiers["latency"]
    h = HistogramMetricFamily("pagedkv:kv_tier_load_seconds",
                              "Time of a request's tier reads (every tier), for loads that loaded a block.",
                              labels=["model_name"])
    h.add_metric([model], [(repr(float(b)), float(n)) for b, n in zip(buckets, cum[:-1])]
                 + [("+Inf", float(cum[-1]))], float(total))
    yield h


class ServerMetrics:
    """The server's registry. ``snapshot`` returns the engine's current counters (``AsyncEngine.snapshot``)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(snapshot, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self._hist = {
            "ttft": Histogram("pagedkv:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model_name),
            "itl": Histogram("pagedkv:inter_token_latency_seconds", "Inter-token latency.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name),
            "e2e": Histogram("pagedkv:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_E2E_BUCKETS, **kw).labels(model_name),
        }

    def observe(self, kind: str, seconds: float) -> None:
        """Record a latency (``kind``: "ttft", "itl" or "e2e"); thread-safe."""
        self._hist[kind].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
