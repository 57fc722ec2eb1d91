"""The router's own Prometheus metrics (``GET /metrics``), read from the state at each scrape.

- ``pagedkv_router_decisions_total{replica}``: requests routed to each replica.
- ``pagedkv_router_predicted_cached_tokens_total{replica}``: prompt tokens the index predicted as cached there.
- ``pagedkv_router_inflight{replica}``, ``pagedkv_router_inflight_prompt_tokens{replica}`` (the load), ``pagedkv_router_replica_healthy{replica}`` (1 or 0),
  ``pagedkv_router_replica_down_total{replica}`` (times it left routing).
- ``pagedkv_router_index_blocks``: entries in the index ((block, medium, replica) triples of the replicas' own
  tiers); ``pagedkv_router_index_shared_blocks``: blocks it believes the shared store holds (KV events with
  medium ``SHARED``; every replica reaches them).
- ``pagedkv_router_event_lag_seconds{replica}``: age of the last applied event message when it was applied.
- ``pagedkv_router_event_messages_total{replica}``, ``pagedkv_router_resyncs_total{replica}`` (gaps repaired
  through the replay socket), ``pagedkv_router_incomplete_resyncs_total{replica}``,
  ``pagedkv_router_restarts_total{replica}`` (restarts seen in the event numbering).
- ``pagedkv_router_event_bad_payloads_total{replica}``: malformed event messages dropped;
  ``pagedkv_router_event_subscriber_errors_total``: unexpected errors the subscriber logged and went on from;
  ``pagedkv_router_event_subscriber_up``: 1 while its thread runs.
- ``pagedkv_router_index_up`` (0 while the index is stale: unreachable, or not yet rebuilt),
  ``pagedkv_router_index_errors_total`` (calls that found it unreachable), ``pagedkv_router_index_outages_total``,
  ``pagedkv_router_index_resyncs_total`` (rebuilds from the replicas' replay sockets after an outage).
- ``pagedkv_router_retries_total``: requests sent again to another replica because theirs could not take them.
- ``pagedkv_router_client_disconnects_total``: requests whose client hung up first (aborted on the replica);
  ``pagedkv_router_upstream_failures_total`` (a replica lost mid-answer: error event or 502),
  ``pagedkv_router_upstream_timeouts_total`` (a replica silent past the read timeout: error event or 504),
  ``pagedkv_router_pool_timeouts_total`` (a replica's connection cap stayed full).
- Prefill/decode split (docs/pd-split.md): ``pagedkv_router_pd_recomputes_total`` (requests computed whole on one
  replica because no prefill replica answered), ``pagedkv_router_pd_prefill_failures_total``,
  ``pagedkv_router_pd_client_errors_total`` (4xx from the prefill step, answered as they are),
  ``pagedkv_router_pd_holds_released_total`` (holds released by the router: no decode replica took the request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["RouterMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    def __init__(self, state) -> None:
        self.state = state
        self.retries = 0
        self.client_disconnects = 0
        self.upstream_failures = 0
        self.upstream_timeouts = 0
        self.pool_timeouts = 0
        self.pd_recomputes = 0  # split requests computed whole on one replica (no prefill replica answered)
        self.pd_prefill_failures = 0  # prefill replicas that failed a split request (it went on elsewhere)
        self.pd_client_errors = 0  # split requests a prefill replica refused as the client's mistake (4xx)
        self.pd_holds_released = 0  # holds the router released because no decode replica took the request
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        st = self.state
        reps = st.replicas
        fams = {
            "decisions": CounterMetricFamily("pagedkv_router_decisions", "requests routed", labels=["replica"]),
            "pred": CounterMetricFamily("pagedkv_router_predicted_cached_tokens",
                                        "prompt tokens predicted cached on the chosen replica", labels=["replica"]),
            "inflight": GaugeMetricFamily("pagedkv_router_inflight", "requests in flight", labels=["replica"]),
            "load": GaugeMetricFamily("pagedkv_router_inflight_prompt_tokens",
                                      "prompt tokens still to compute of the requests in flight", labels=["replica"]),
            "healthy": GaugeMetricFamily("pagedkv_router_replica_healthy", "1 if routable", labels=["replica"]),
            "downs": CounterMetricFamily("pagedkv_router_replica_down", "times a replica left routing",
                                         labels=["replica"]),
        }
        for u, r in reps.items():
            fams["decisions"].add_metric([u], r.decisions)
            fams["pred"].add_metric([u], r.predicted_tokens)
            fams["inflight"].add_metric([u], r.inflight)
            fams["load"].add_metric([u], r.inflight_tokens)
            fams["healthy"].add_metric([u], 1 if r.healthy else 0)
            fams["downs"].add_metric([u], r.downs)
        yield from fams.values()
        g = GaugeMetricFamily("pagedkv_router_index_blocks", "entries in the prefix index")
        try:
            g.add_metric([], st.index_blocks())
        except Exception:  # the Redis index unreachable: leave the gauge out of this scrape
            pass
        else:
            yield g
        g = GaugeMetricFamily("pagedkv_router_index_shared_blocks", "blocks of the shared store in the prefix index")
        try:
            g.add_metric([], st.index_shared_blocks())
        except Exception:  # as above
            pass
        else:
            yield g
        sub = st.subscriber
        if sub is not None:
            lag = GaugeMetricFamily("pagedkv_router_event_lag_seconds", "age of the last applied event message",
                                    labels=["replica"])
            msgs = CounterMetricFamily("pagedkv_router_event_messages", "event messages applied", labels=["replica"])
            rs = CounterMetricFamily("pagedkv_router_resyncs", "gaps repaired through the replay socket",
                                     labels=["replica"])
            inc = CounterMetricFamily("pagedkv_router_incomplete_resyncs", "gaps the replay could not repair",
                                      labels=["replica"])
            rst = CounterMetricFamily("pagedkv_router_restarts", "replica restarts seen in the numbering",
                                      labels=["replica"])
            bad = CounterMetricFamily("pagedkv_router_event_bad_payloads", "malformed event messages dropped",
                                      labels=["replica"])
            for u, f in sub.feeds.items():
                lag.add_metric([u], f.lag)
                msgs.add_metric([u], f.messages)
                rs.add_metric([u], f.resyncs)
                inc.add_metric([u], f.incomplete)
                rst.add_metric([u], f.restarts)
                bad.add_metric([u], f.bad_payloads)
            yield from (lag, msgs, rs, inc, rst, bad)
            yield _one(CounterMetricFamily, "pagedkv_router_event_subscriber_errors",
                       "unexpected errors the event subscriber logged and went on from", sub.errors)
            yield _one(GaugeMetricFamily, "pagedkv_router_event_subscriber_up", "1 while the event subscriber runs",
                       1 if sub.alive else 0)
            yield _one(CounterMetricFamily, "pagedkv_router_index_resyncs",
                       "index rebuilds from the replay sockets after an outage", sub.index_resyncs)
        yield _one(GaugeMetricFamily, "pagedkv_router_index_up", "0 while the prefix index is stale",
                   1 if st.index_ok else 0)
        yield _one(CounterMetricFamily, "pagedkv_router_index_errors", "index calls that found it unreachable",
                   st.index_errors)
        yield _one(CounterMetricFamily, "pagedkv_router_index_outages", "times the index became unreachable",
                   st.index_outages)
        for name, doc, v in (
                ("retries", "requests sent again to another replica", self.retries),
                ("client_disconnects", "requests whose client hung up before the end", self.client_disconnects),
                ("upstream_failures", "replicas lost mid-answer", self.upstream_failures),
                ("upstream_timeouts", "replicas silent past the read timeout", self.upstream_timeouts),
                ("pool_timeouts", "requests that found a replica's connection cap full", self.pool_timeouts),
                ("pd_recomputes", "split requests computed whole because no prefill replica answered",
                 self.pd_recomputes),
                ("pd_prefill_failures", "prefill replicas that failed a split request", self.pd_prefill_failures),
                ("pd_client_errors", "split requests refused by the prefill step as the client's mistake",
                 self.pd_client_errors),
                ("pd_holds_released", "holds released by the router (no decode replica took the request)",
                 self.pd_holds_released)):
            yield _one(CounterMetricFamily, f"pagedkv_router_{name}", doc, v)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _one(cls, name: str, doc: str, value: float):
    fam = cls(name, doc)
    fam.add_metric([], value)
    return fam
