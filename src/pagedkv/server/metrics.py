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
``pagedkv:kv_handoff_holds_active``                  prefill/decode split, prefill side: live holds (gauge)
``pagedkv:kv_handoff_held_blocks``                   blocks of the live holds (gauge)
``pagedkv:kv_handoff_holds_total``                   holds taken for decode replicas
``pagedkv:kv_handoff_holds_ended_total{how}``        holds ended: released (by a decode replica, before the
                                                     lease ended), expired (the lease ended), dropped (the
                                                     request ended unanswered)
``pagedkv:kv_handoff_holds_served_total``            hold reads served; ``..._blocks_served_total``,
                                                     ``..._bytes_served_total`` what they sent
``pagedkv:kv_handoff_fetches_total{outcome}``        decode side: block reads from prefill replicas by outcome
                                                     (complete, partial: some leading blocks, failed: none)
``pagedkv:kv_handoff_blocks_fetched_total``          blocks read and checked; ``..._bytes_fetched_total`` the
                                                     bytes received
``pagedkv:kv_handoff_blocks_over_budget_total``      blocks not read (the staging budget was full): computed
``pagedkv:kv_handoff_releases_failed_total``         hold releases the prefill replica did not confirm
``pagedkv:kv_handoff_check_refused_total``           block reads stopped at a value with a wrong check digest
``pagedkv:kv_handoff_store_answers_total``           prefill side: answers sent once the held blocks were in the
                                                     shared store; ``..._store_waits_timed_out_total`` without;
                                                     ``..._store_wait_seconds_total`` their waits, summed
``pagedkv:kv_handoff_store_loads_total``             decode side: requests loaded through the shared store;
                                                     ``..._store_misses_total``: it held fewer blocks (HTTP read)
``pagedkv:kv_handoff_staged_bytes``                  fetched payloads in memory, not yet written (gauge);
                                                     ``..._staged_bytes_limit`` its bound
``pagedkv:kv_handoff_fetch_seconds``                 histogram: one request's block read
===================================================  ==========================================================

The ``kv_handoff`` families are there when the replica can hand KV over (:meth:`ServerMetrics.add_kv_handoff`).
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


#: KVHandoff.stats key -> (metric suffix, doc)
_HANDOFF_COUNTERS = {
    "holds": ("holds", "Holds taken: a prompt's blocks kept for a decode replica."),
    "holds_served": ("holds_served", "Hold reads served to decode replicas."),
    "blocks_served": ("blocks_served", "KV blocks sent to decode replicas."),
    "bytes_served": ("bytes_served", "KV bytes sent to decode replicas (checked values)."),
    "blocks_fetched": ("blocks_fetched", "KV blocks read from prefill replicas and checked."),
    "bytes_fetched": ("bytes_fetched", "Bytes received from prefill replicas."),
    "blocks_over_budget": ("blocks_over_budget", "KV blocks not read: the staging budget was full (computed)."),
    "releases_failed": ("releases_failed", "Hold releases the prefill replica did not confirm (its lease ends it)."),
    "check_refused": ("check_refused", "Block reads stopped at a value whose check digest was not the prompt's."),
    "store_answers": ("store_answers", "Prefill answers sent once the held blocks were in the shared store."),
    "store_waits_timed_out": ("store_waits_timed_out", "Prefill answers sent without the shared store: its "
                              "blocks were not all stored within --kv-store-wait."),
    "store_wait_seconds": ("store_wait_seconds", "Seconds prefill answers waited for their blocks in the shared "
                           "store, summed."),
    "store_loads": ("store_loads", "Requests whose blocks the engine loads from the shared store (no HTTP read)."),
    "store_misses": ("store_misses", "Requests whose shared store held fewer blocks than announced (read from the "
                     "hold over HTTP)."),
}


class _HandoffCollector:
    """The ``pagedkv:kv_handoff_*`` families, read from a :class:`~.kv_handoff.KVHandoff` at scrape time (on the
    event loop, where the handoff's counters change)."""

    def __init__(self, kv, model_name: str) -> None:
        self._kv = kv
        self._model = model_name

    def collect(self):
        kv, m = self._kv, [self._model]
        st = kv.stats
        g = GaugeMetricFamily("pagedkv:kv_handoff_holds_active", "Live holds for decode replicas.",
                              labels=["model_name"])
        g.add_metric(m, float(kv.num_holds))
        yield g
        g = GaugeMetricFamily("pagedkv:kv_handoff_held_blocks", "KV blocks of the live holds.", labels=["model_name"])
        g.add_metric(m, float(kv.num_held_blocks))
        yield g
        for key, (name, doc) in _HANDOFF_COUNTERS.items():
            c = CounterMetricFamily(f"pagedkv:kv_handoff_{name}", doc, labels=["model_name"])
            c.add_metric(m, float(st[key]))
            yield c
        c = CounterMetricFamily("pagedkv:kv_handoff_holds_ended", "Holds ended, by how: released by a decode "
                                "replica before the lease ended, expired, dropped (the request ended unanswered).",
                                labels=["model_name", "how"])
        for how in ("released", "expired", "dropped"):
            c.add_metric([self._model, how], float(st[f"holds_{how}"]))
        yield c
        c = CounterMetricFamily("pagedkv:kv_handoff_fetches", "Block reads from prefill replicas, by outcome: "
                                "complete, partial (some leading blocks), failed (none).",
                                labels=["model_name", "outcome"])
        partial, failed = st["fetches_partial"], st["fetches_failed"]
        for outcome, n in (("complete", st["fetches"] - partial - failed), ("partial", partial),
                           ("failed", failed)):
            c.add_metric([self._model, outcome], float(n))
        yield c
        g = GaugeMetricFamily("pagedkv:kv_handoff_staged_bytes", "Fetched KV payloads in memory, not yet written "
                              "into the cache.", labels=["model_name"])
        g.add_metric(m, float(kv.staging.used))
        yield g
        g = GaugeMetricFamily("pagedkv:kv_handoff_staged_bytes_limit", "The staging budget (--kv-fetch-buffer-mib).",
                              labels=["model_name"])
        g.add_metric(m, float(kv.staging.limit))
        yield g
        hist = kv.fetch_seconds
        cum = hist.counts
        h = HistogramMetricFamily("pagedkv:kv_handoff_fetch_seconds", "Time of one request's block read from a "
                                  "prefill replica.", labels=["model_name"])
        h.add_metric(m, [(repr(float(b)), float(n)) for b, n in zip(hist.buckets, cum[:-1])]
                     + [("+Inf", float(cum[-1]))], float(hist.total))
        yield h


class ServerMetrics:
    """The server's registry. ``snapshot`` returns the engine's current counters (``AsyncEngine.snapshot``)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = model_name
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

    def add_kv_handoff(self, kv) -> None:
        """Export a :class:`~.kv_handoff.KVHandoff`'s counters (``pagedkv:kv_handoff_*``) when it can hand KV over
        (a replica without an engine port has none to show)."""
        if kv is not None and kv.available:
            self.registry.register(_HandoffCollector(kv, self._model))

    def observe(self, kind: str, seconds: float) -> None:
        """Record a latency (``kind``: "ttft", "itl" or "e2e"); thread-safe."""
        self._hist[kind].observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
