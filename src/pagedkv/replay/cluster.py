"""Cluster replay: a trace routed over N replicas, each a prefix-caching BlockManager, in sequence mode.

Each request is routed by a policy (:mod:`pagedkv.cluster.policy`), then allocated and freed on its replica (the Mooncake
paper's sequence method, per replica). The replicas run with ``enable_kv_events=True``; after every request the
replica's ``events.take()`` feed the router's index (:class:`~pagedkv.cluster.index.MemoryIndex`), the
same :meth:`~pagedkv.cluster.index.MemoryIndex.apply` path the live router takes for events that arrive over ZMQ. So the
``prefix`` policy sees exactly what a real router would, and nothing else; ``prefix-approx`` sees only its own
decisions. The load of a replica is the prompt tokens routed to it so far.

Figures per point (:class:`ClusterPoint`): hit rate over all prompt tokens, load imbalance (max / mean of the
prompt tokens served per replica), each replica's hit rate and share, the tokens the index predicted as cached
(the matched prefix of the chosen replica, at most ``(n - 1) // block_size`` blocks) and the pooled reference
(one manager of N x the capacity), computed once per capacity by :func:`replay_pooled`.

**A shared tier** (``shared_capacity_tokens`` > 0; ``pagedkv replay --replicas N --shared-capacity TOKENS``):
one store every replica reads and writes, below each replica's own pool, modelled as in the tiered replay
(:class:`pagedkv.replay.tiered.LruTier`, the eviction rules of the tiers' backends): **written through** (every
block that enters a replica's GPU prefix cache, its ``BlockStored`` event, is stored, children first), and
looked up past each replica's own hit block by block until a block it lacks (at most ``(n - 1) // block_size``
blocks); a block loaded from it enters the replica's pool like a computed one. A request is looked up before its
own blocks are written through. The router's index learns the shared store as a replica would report it
(:mod:`pagedkv.events`, medium ``"SHARED"``): a ``BlockStored`` for each block written through or loaded, a
``BlockRemoved`` for each block the store evicts (the replay knows them: an idealisation, a live store evicts
silently and the index bounds what it believes instead). Figures per replica split into GPU hits (the replica's
own pool) and shared hits (loads); ``shared_hit_tokens`` sums the loads of every replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..blocks.prefix_cache import block_hashes
from ..cluster.index import MemoryIndex, predicted_tokens
from ..cluster.policy import make_policy
from ..events import MEDIUM_GPU, MEDIUM_SHARED, BlockRemoved, BlockStored
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
    weights: dict | None = None  #: the prefix route's tier weights ({medium: weight})

    def to_json(self) -> dict:
        d = super().to_json()
        d["pooled_capacity_tokens"] = self.replicas * self.capacity_tokens
        return d


def replay_cluster(trace: Trace, capacity_tokens: int, replicas: int, route: str, *, block_size: int = 16,
                   balance_slack: float | None = 0.2, progress=None, shared_capacity_tokens: int = 0,
                   weights: dict | None = None, check_every: int = 0) -> ClusterPoint:
    """Replay ``trace`` over ``replicas`` managers of ``capacity_tokens // block_size`` blocks each, routed by
    ``route`` (:data:`~.policy.ROUTES`), with a shared tier of ``shared_capacity_tokens`` below them (0: none; see
    the module docstring). A request longer than one replica is skipped and counted. ``weights``: the prefix
    route's tier weights (:data:`pagedkv.cluster.policy.TIER_WEIGHTS` for those not given). ``check_every`` > 0:
    check the managers' and the shared tier's invariants every that many requests (tests). Cost: the
    single-manager replay's, plus hashing each prompt (prefix routes, shared tier) and applying the events to the
    index (O(blocks stored and evicted)) and the shared tier (O(1) per block written through or loaded)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if isinstance(shared_capacity_tokens, bool) or not isinstance(shared_capacity_tokens, int) \
            or shared_capacity_tokens < 0:
        raise ValueError(f"shared_capacity_tokens must be an int >= 0, got {shared_capacity_tokens!r}")
    from ..manager import BlockManager
    from .tiered import LruTier

    num_blocks = capacity_tokens // block_size
    bms = [BlockManager(num_blocks, block_size, enable_prefix_caching=True, watermark=0.0,
                        enable_kv_events=True, max_kv_events=10**9) for _ in range(replicas)]
    index = MemoryIndex()
    for r in range(replicas):
        index.add_replica(r)
    policy = make_policy(route, index, slack=balance_slack, capacity_blocks=num_blocks, weights=weights)
    shared = LruTier(shared_capacity_tokens // block_size) if shared_capacity_tokens else None
    wants_hashes = route in ("prefix", "prefix-approx") or shared is not None
    feeds_index = policy.uses_index
    names = list(range(replicas))
    loads = dict.fromkeys(names, 0)
    hits = [0] * replicas
    shared_hits = [0] * replicas
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
        got = bm.allocate(i, tokens)
        hits[r] += got
        loaded: list = []
        if shared is not None and len(shared):
            k, lim = got // block_size, (n - 1) // block_size
            while k < lim and hashes[k] in shared:
                loaded.append(hashes[k])
                k += 1
            if loaded:  # children first: a parent stays at least as recent as its children
                shared_hits[r] += shared.read_many(loaded[::-1]) * block_size
        bm.free(i)
        events = bm.events.take()
        if feeds_index:
            for e in events:
                index.apply(r, e)
        if shared is not None:
            _write_through(shared, events, loaded, index if feeds_index else None, r, block_size)
        if check_every and not (i + 1) % check_every:
            bm.check_invariants()
            if shared is not None:
                shared.check_invariants()
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
                       prompt_tokens=total, hit_tokens=sum(hits) + sum(shared_hits), seconds=seconds,
                       replicas=replicas, route=route, shared_capacity_tokens=shared_capacity_tokens,
                       shared_hit_tokens=sum(shared_hits) if shared is not None else None,
                       balance_slack=balance_slack if route in ("prefix", "prefix-approx") else None,
                       load_imbalance=max(loads.values()) / mean if mean else 1.0, predicted_hit_tokens=predicted,
                       index_blocks=(index if feeds_index else getattr(policy, "index", index)).num_blocks())
    res.per_replica = _per_replica(reqs, loads, hits, shared_hits)
    if route == "prefix":
        res.weights = dict(policy.weights)
    if shared is not None:
        res.extra.update({"shared_stored": shared.stored, "shared_evictions": shared.evictions,
                          "shared_blocks_held": len(shared)})
    res.evictions = sum(int(bm.stats.evictions) for bm in bms) if hasattr(bms[0].stats, "evictions") else None
    return res


def _write_through(shared, events: list, loaded: list, index: MemoryIndex | None, r: int, block_size: int) -> None:
    """The shared tier after replica ``r``'s request: the blocks it stored on its GPU written through (the store's
    evictions reported to ``index`` as removed), and ``loaded`` (read from the tier) reported stored again, since a
    load refreshes the store's LRU. ``index`` None: the route reads no index. O(blocks stored + loaded)."""
    if loaded and index is not None:
        index.apply(r, BlockStored(loaded, None, [], block_size, None, MEDIUM_SHARED))
    for e in events:
        if type(e) is BlockStored and e.medium == MEDIUM_GPU:
            gone: list = []
            shared.put_many(e.block_hashes[::-1], gone)
            if index is not None:
                index.apply(r, BlockStored(e.block_hashes, None, [], block_size, None, MEDIUM_SHARED))
                if gone:
                    index.apply(r, BlockRemoved(gone, MEDIUM_SHARED))


def _per_replica(reqs: list, loads: dict, hits: list, shared_hits: list) -> list[dict]:
    """The per-replica figures of a cluster replay."""
    return [{"requests": reqs[r], "prompt_tokens": loads[r], "hit_tokens": hits[r] + shared_hits[r],
             "hit_rate": (hits[r] + shared_hits[r]) / loads[r] if loads[r] else 0.0,
             "gpu_hit_tokens": hits[r], "shared_hit_tokens": shared_hits[r]} for r in range(len(reqs))]


def replay_pooled(trace: Trace, capacity_tokens: int, replicas: int, *, block_size: int = 16,
                  progress=None) -> PointResult:
    """The pooled reference: one manager of ``replicas * capacity_tokens`` tokens (sequence mode)."""
    return replay_sequence(trace, replicas * capacity_tokens, block_size=block_size, progress=progress)
