"""Cluster replay: a trace routed over N replicas, each a prefix-caching BlockManager, in sequence mode.

Each request is routed by a policy (:mod:`pagedkv.cluster.policy`), then allocated and freed on its replica (the Mooncake
paper's sequence method, per replica). The replicas run with ``enable_kv_events=True``; after every request the
replica's :meth:`~pagedkv.BlockManager.take_events` feed the router's index (:class:`~pagedkv.cluster.index.MemoryIndex`), the
same :meth:`~pagedkv.cluster.index.MemoryIndex.apply` path the live router takes for events that arrive over ZMQ. So the
``prefix`` policy sees exactly what a real router would, and nothing else; ``prefix-approx`` sees only its own
decisions. The load of a replica is the prompt tokens routed to it so far.

Figures per point (:class:`ClusterPoint`): hit rate over all prompt tokens, load imbalance (max / mean of the
prompt tokens served per replica), each replica's hit rate and share, the tokens the index predicted as cached
(the matched prefix of the chosen replica, at most ``(n - 1) // block_size`` blocks) and the pooled reference
(one manager of N x the capacity), computed once per capacity by :func:`replay_pooled`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..blocks.prefix_cache import block_hashes
from ..cluster.index import MemoryIndex, predicted_tokens
from ..cluster.policy import make_policy
from .point import PointResult
from .sequence import replay_sequence
from .trace import Trace

__all__ = ["ClusterPoint", "replay_cluster", "replay_pooled"]


@dataclass
class ClusterPoint(PointResult):
    """A :class:`~pagedkv.replay.point.PointResult` of the whole cluster (``capacity_tokens`` per replica)."""

    replicas: int = 1
    route: str = ""
    balance_slack: float | None = None
    load_imbalance: float = 1.0  #: max / mean of prompt tokens served per replica
    per_replica: list = field(default_factory=list)  #: [{"requests", "prompt_tokens", "hit_tokens", "hit_rate"}]
    predicted_hit_tokens: int = 0  #: what the policy's index predicted on the chosen replicas
    index_blocks: int = 0  #: entries in the router's index at the end
    pooled_hit_rate: float | None = None  #: one manager of replicas x capacity_tokens

    def to_json(self) -> dict:
        d = super().to_json()
        d["pooled_capacity_tokens"] = self.replicas * self.capacity_tokens
        return d


def replay_cluster(trace: Trace, capacity_tokens: int, replicas: int, route: str, *, block_size: int = 16,
                   balance_slack: float | None = 0.2, progress=None) -> ClusterPoint:
    """Replay ``trace`` over ``replicas`` managers of ``capacity_tokens // block_size`` blocks each, routed by
    ``route`` (:data:`~.policy.ROUTES`). A request longer than one replica is skipped and counted. Cost: the
    single-manager replay's, plus hashing each prompt (prefix routes) and applying the events to the index
    (O(blocks stored and evicted))."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    from ..manager import BlockManager

    num_blocks = capacity_tokens // block_size
    bms = [BlockManager(num_blocks, block_size, enable_prefix_caching=True, watermark=0.0,
                        enable_kv_events=True, max_kv_events=10**9) for _ in range(replicas)]
    index = MemoryIndex()
    for r in range(replicas):
        index.add_replica(r)
    policy = make_policy(route, index, slack=balance_slack, capacity_blocks=num_blocks)
    wants_hashes = route in ("prefix", "prefix-approx")
    feeds_index = policy.uses_index
    names = list(range(replicas))
    loads = dict.fromkeys(names, 0)
    hits = [0] * replicas
    reqs = [0] * replicas
    lengths = trace.input_lengths.tolist()
    need = [-(-n // block_size) for n in lengths]
    skipped = predicted = 0
    t0 = time.perf_counter()
    for i, nb in enumerate(need):
        if progress is not None and not i & 511 and i:
            progress(512)
        if nb > num_blocks:
            skipped += 1
            continue
        tokens = trace.tokens(i)
        n = lengths[i]
        hashes = block_hashes(tokens, block_size) if wants_hashes else None
        d = policy.choose(names, loads, hashes, n)
        r = d.replica
        bm = bms[r]
        hits[r] += bm.allocate(i, tokens)
        bm.free(i)
        events = bm.take_events()
        if feeds_index:
            for e in events:
                index.apply(r, e)
        policy.routed(r, hashes)
        loads[r] += n
        reqs[r] += 1
        predicted += predicted_tokens(d.matched_blocks, n, block_size)
    seconds = time.perf_counter() - t0
    if progress is not None and need:
        progress(len(need) - ((len(need) - 1) // 512) * 512)
    total = sum(loads.values())
    mean = total / replicas
    res = ClusterPoint("pagedkv", "sequence", capacity_tokens, 0, block_size, requests=sum(reqs), skipped=skipped,
                       prompt_tokens=total, hit_tokens=sum(hits), seconds=seconds, replicas=replicas, route=route,
                       balance_slack=balance_slack if route in ("prefix", "prefix-approx") else None,
                       load_imbalance=max(loads.values()) / mean if mean else 1.0, predicted_hit_tokens=predicted,
                       index_blocks=(index if feeds_index else getattr(policy, "index", index)).num_blocks())
    res.per_replica = [{"requests": reqs[r], "prompt_tokens": loads[r], "hit_tokens": hits[r],
                        "hit_rate": hits[r] / loads[r] if loads[r] else 0.0} for r in range(replicas)]
    res.evictions = sum(int(bm.stats.evictions) for bm in bms) if hasattr(bms[0].stats, "evictions") else None
    return res


def replay_pooled(trace: Trace, capacity_tokens: int, replicas: int, *, block_size: int = 16,
                  progress=None) -> PointResult:
    """The pooled reference: one manager of ``replicas * capacity_tokens`` tokens (sequence mode)."""
    return replay_sequence(trace, replicas * capacity_tokens, block_size=block_size, progress=progress)
