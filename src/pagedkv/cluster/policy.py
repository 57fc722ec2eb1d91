"""Routing policies: which replica serves a request. Shared by the cluster replay and the live router.

Every policy has ``choose(replicas, loads, hashes, cost) -> Decision`` and ``routed(replica, hashes)``:

- ``replicas``: the replicas that may serve (in a fixed order; the order breaks the last ties).
- ``loads``: ``{replica: load}``, in whatever unit the caller keeps: the replay uses prompt tokens routed so far,
  the live router the prompt tokens still to compute of its requests in flight. ``cost`` is this request's
  load in the same unit: a number, or ``{replica: cost}`` when it depends on the replica (the live router
  counts only the tokens a replica does not hold already).
- ``hashes``: the request's block hashes (:func:`pagedkv.block_hashes`); only prefix policies read them.
- ``tiebreak`` (optional, ``{replica: number}``): among equally loaded replicas the lowest wins (the live router
  passes its decision counts, so sequential traffic, where nothing is ever in flight, still spreads).
- ``routed`` is called once the request was sent (``prefix-approx`` learns from it; the others ignore it).

Policies (:func:`make_policy` builds one by name):

- ``round-robin``: each replica in turn.
- ``least-loaded``: the lowest load (ties: the first in order).
- ``prefix``: the replica with the longest cached prefix according to the KV-event-fed index, each block
  weighted by the tier it is read from (:meth:`PrefixPolicy.scores`: a GPU block counts 1, a CPU-tier block
  ``cpu_weight``, a disk block ``disk_weight``, a block of the shared store, reachable from every replica,
  ``shared_weight``: a load costs something, so a replica holding the blocks beats one that would load them);
  but a replica whose load would exceed the balance
  limit is skipped: ``load + cost > (1 + slack) * (sum of loads + cost) / len(replicas) + abs_slack``. Ties go
  to the least loaded. When every replica is over the limit the least loaded one serves. ``slack=None``:
  no limit (the longest prefix alone). ``min_match`` (a fraction of the prompt's blocks, 0 by default): a
  shorter match counts as none, so a prefix every request shares (a system prompt) does not pull all traffic
  to one replica when loads are equal.
- ``prefix-approx``: the same choice over an index the policy builds from its own decisions only (as llm-d's
  approximate scorer does): a request's blocks are assumed cached on the replica it was sent to, each replica
  keeping at most ``capacity_blocks`` of them, least recently routed evicted first (a prompt's tail before its
  head, like the engine's tail-first release).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Mapping, NamedTuple, Sequence

from ..events import MEDIA, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED, BlockRemoved, BlockStored
from .index import MemoryIndex

__all__ = ["Decision", "RoundRobin", "LeastLoaded", "PrefixPolicy", "ApproxPrefixPolicy", "make_policy",
           "ROUTES", "TIER_WEIGHTS"]

#: the default weight of a block by the tier it is read from (see :meth:`PrefixPolicy.scores` and docs/tiers.md)
TIER_WEIGHTS = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.5, MEDIUM_DISK: 0.4, MEDIUM_SHARED: 0.3}

ROUTES = ("round-robin", "least-loaded", "prefix", "prefix-approx")


class Decision(NamedTuple):
    """A routing decision: the replica, the leading blocks the policy believes it holds (0 when the policy
    does not look), and the policy's name."""

    replica: Hashable
    matched_blocks: int
    policy: str


def _least_loaded(replicas: Sequence, loads: Mapping, tiebreak: Mapping | None = None) -> Hashable:
    if tiebreak:
        return min(replicas, key=lambda r: (loads.get(r, 0), tiebreak.get(r, 0)))
    return min(replicas, key=lambda r: loads.get(r, 0))


class RoundRobin:
    name = "round-robin"
    uses_index = False

    def __init__(self) -> None:
        self._i = 0

    def choose(self, replicas: Sequence, loads: Mapping, hashes: Sequence[int] | None = None,
               cost: float = 1.0, tiebreak: Mapping | None = None) -> Decision:
        if not replicas:
            raise ValueError("no replica to route to")
        r = replicas[self._i % len(replicas)]
        self._i += 1
        return Decision(r, 0, self.name)

    def routed(self, replica: Hashable, hashes: Sequence[int] | None) -> None:
        pass


class LeastLoaded(RoundRobin):
    name = "least-loaded"

    def choose(self, replicas: Sequence, loads: Mapping, hashes: Sequence[int] | None = None,
               cost: float = 1.0, tiebreak: Mapping | None = None) -> Decision:
        if not replicas:
            raise ValueError("no replica to route to")
        return Decision(_least_loaded(replicas, loads, tiebreak), 0, self.name)


class PrefixPolicy:
    """Longest cached prefix within the balance limit (see the module docstring). ``index`` is any
    :class:`pagedkv.cluster.index.KVIndex`."""

    name = "prefix"
    uses_index = True

    def __init__(self, index, *, slack: float | None = 0.2, abs_slack: float = 0.0,
                 cpu_weight: float = TIER_WEIGHTS[MEDIUM_CPU], disk_weight: float = TIER_WEIGHTS[MEDIUM_DISK],
                 shared_weight: float = TIER_WEIGHTS[MEDIUM_SHARED], min_match: float = 0.0) -> None:
        if slack is not None and slack < 0:
            raise ValueError(f"balance slack must be >= 0, got {slack}")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match must lie in [0, 1], got {min_match}")
        for name, w in (("cpu_weight", cpu_weight), ("disk_weight", disk_weight), ("shared_weight", shared_weight)):
            if not 0 <= w <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {w}")
        self.min_match = min_match
        self.index = index
        self.slack = slack
        self.abs_slack = abs_slack
        self.cpu_weight = cpu_weight
        self.disk_weight = disk_weight
        self.shared_weight = shared_weight

    @property
    def weights(self) -> dict:
        """``{medium: weight}`` of a block read from that medium (GPU 1)."""
        return {MEDIUM_GPU: 1.0, MEDIUM_CPU: self.cpu_weight, MEDIUM_DISK: self.disk_weight,
                MEDIUM_SHARED: self.shared_weight}

    def scores(self, hashes: Sequence[int] | None, replicas: Sequence | None = None) -> tuple[dict, dict]:
        """``({replica: score}, {replica: leading blocks it can read from any tier})`` for a prompt's hashes.

        A replica's match walks its own tiers and the shared store block by block (the engine's lookup). Its
        score counts the match by nested prefixes, fastest tier first: with ``L(GPU)``, ``L(GPU+CPU)``,
        ``L(GPU+CPU+DISK)`` and ``L(all)`` the leading blocks readable from those media, the score is
        ``L(GPU) + cpu_weight x (L(GPU+CPU) - L(GPU)) + disk_weight x (...) + shared_weight x (L(all) -
        L(GPU+CPU+DISK))``: each block weighs as the slowest tier the prefix up to it needs (exact when the
        tiers hold nested prefixes, as LRU tiers filled from the GPU do; a lower bound when they interleave and
        the weights decrease). A shared block counts for every replica: a replica of ``replicas`` the index
        does not know yet (no event so far) scores the shared store's prefix alone. Cost: one index walk per
        medium present (:attr:`media`; only GPU: one walk)."""
        if not hashes:
            return {}, {}
        index = self.index
        any_tier = index.longest_prefix(hashes)
        media = getattr(index, "media", None)
        if media is None:  # an index without the property: the CPU tier only
            media = frozenset((MEDIUM_GPU, MEDIUM_CPU)) if index.has_cpu else frozenset((MEDIUM_GPU,))
        if MEDIUM_SHARED in media and replicas:
            s = index.shared_prefix(hashes)
            if s:
                for r in replicas:
                    if r not in any_tier:
                        any_tier[r] = s
        if not any_tier or len(media) == 1:
            return any_tier, any_tier
        tiers = [m for m in MEDIA if m in media]
        w = self.weights
        score = dict.fromkeys(any_tier, 0.0)
        prev: dict = {}
        for k, m in enumerate(tiers):
            got = any_tier if k == len(tiers) - 1 else index.longest_prefix(hashes, tuple(tiers[: k + 1]))
            wm = w[m]
            for r in any_tier:
                n = got.get(r, 0)
                score[r] += wm * (n - prev.get(r, 0))
                prev[r] = n
        return score, any_tier

    def choose(self, replicas: Sequence, loads: Mapping, hashes: Sequence[int] | None = None,
               cost: float | Mapping = 1.0, tiebreak: Mapping | None = None, *, scored: tuple | None = None) -> Decision:
        """``scored``: :meth:`scores`'s answer for ``hashes`` when the caller already has it."""
        if not replicas:
            raise ValueError("no replica to route to")
        score, matched = scored if scored is not None else self.scores(hashes, replicas)
        if self.min_match and score:
            floor = self.min_match * len(hashes)
            score = {r: v for r, v in score.items() if v >= floor}
        allowed = replicas
        if self.slack is not None:
            total, n, f, a = sum(loads.get(r, 0) for r in replicas), len(replicas), 1 + self.slack, self.abs_slack
            costs = cost if isinstance(cost, Mapping) else dict.fromkeys(replicas, cost)
            allowed = [r for r in replicas if loads.get(r, 0) + costs[r] <= f * (total + costs[r]) / n + a]
            if not allowed:
                r = _least_loaded(replicas, loads, tiebreak)
                return Decision(r, matched.get(r, 0), self.name)
        tb = tiebreak or {}
        best = allowed[0]
        key = (score.get(best, 0), -loads.get(best, 0), -tb.get(best, 0))
        for r in allowed[1:]:
            k = (score.get(r, 0), -loads.get(r, 0), -tb.get(r, 0))
            if k > key:
                best, key = r, k
        return Decision(best, matched.get(best, 0), self.name)

    def routed(self, replica: Hashable, hashes: Sequence[int] | None) -> None:
        pass


class ApproxPrefixPolicy(PrefixPolicy):
    """``prefix`` over an index learnt from this policy's own decisions (see the module docstring)."""

    name = "prefix-approx"
    uses_index = False

    def __init__(self, capacity_blocks: int, *, slack: float | None = 0.2, abs_slack: float = 0.0,
                 min_match: float = 0.0) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        super().__init__(MemoryIndex(), slack=slack, abs_slack=abs_slack, min_match=min_match)
        self.capacity_blocks = capacity_blocks
        self._lru: dict[Hashable, OrderedDict] = {}

    def routed(self, replica: Hashable, hashes: Sequence[int] | None) -> None:
        if not hashes:
            return
        lru = self._lru.setdefault(replica, OrderedDict())
        new = []
        for h in reversed(hashes):  # the head ends most recent: the tail goes first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                new.append(h)
        gone = [lru.popitem(last=False)[0] for _ in range(max(len(lru) - self.capacity_blocks, 0))]
        if new:
            self.index.apply(replica, BlockStored(new, None, [], 0))
        if gone:
            self.index.apply(replica, BlockRemoved(gone))

    def forget(self, replica: Hashable) -> None:
        """A replica left (died or restarted): forget what was routed to it."""
        self._lru.pop(replica, None)
        self.index.drop_replica(replica)


def make_policy(route: str, index=None, *, slack: float | None = 0.2, abs_slack: float = 0.0,
                capacity_blocks: int | None = None, min_match: float = 0.0, weights: Mapping | None = None):
    """A policy by name (:data:`ROUTES`). ``prefix`` needs ``index``; ``prefix-approx`` needs
    ``capacity_blocks`` (each replica's prefix-cache size as the router assumes it). ``weights``: ``{medium:
    weight}`` for ``prefix`` (:data:`TIER_WEIGHTS` for the media not given)."""
    if route == "round-robin":
        return RoundRobin()
    if route == "least-loaded":
        return LeastLoaded()
    if route == "prefix":
        if index is None:
            raise ValueError("the prefix route needs an index")
        w = {**TIER_WEIGHTS, **(weights or {})}
        return PrefixPolicy(index, slack=slack, abs_slack=abs_slack, min_match=min_match, cpu_weight=w[MEDIUM_CPU],
                            disk_weight=w[MEDIUM_DISK], shared_weight=w[MEDIUM_SHARED])
    if route == "prefix-approx":
        if capacity_blocks is None:
            raise ValueError("the prefix-approx route needs the replicas' capacity in blocks")
        return ApproxPrefixPolicy(capacity_blocks, slack=slack, abs_slack=abs_slack, min_match=min_match)
    raise ValueError(f"unknown route {route!r} (choose from {', '.join(ROUTES)})")
