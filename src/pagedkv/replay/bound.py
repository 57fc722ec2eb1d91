"""What any cache could do on a trace: the ceiling (infinite capacity) and Belady's offline optimum.

Both work on *prefix-tree nodes*: the full ``block_size``-token blocks of every prompt, numbered so that two blocks
are the same node iff they hold the same tokens after the same prefix (:meth:`Trace.nodes`). The replay's rules are
kept: a request's hit is the longest cached prefix of its full blocks, at most ``(n - 1) // block_size`` blocks (one
token is always left to compute); while a request runs it holds ``ceil(n / block_size)`` blocks (its partial last
block too); when it ends its full blocks may stay cached.

- :func:`ceiling`: with infinite capacity a block is a hit iff an earlier request had it. Seen blocks of a prompt
  always form a prefix (an earlier request that had block ``k`` had blocks ``0..k-1`` too), so the hit is the count
  of capped blocks seen before. One sort, O(B log B) for B blocks, numpy.
- :func:`belady`: at capacity ``C`` blocks, before request ``i`` evict the cached blocks used farthest in the future
  until the cache, minus request ``i``'s own blocks, fits in ``C - ceil(n_i / block_size)``; after it, cache its full
  blocks unless never used again. Next uses (the next request that can *hit* the block) come from one backward pass
  over the sorted occurrences; evictions pop a heap keyed by (next use, depth) with lazy deletion, so a block's
  descendants (same or later next use, deeper) always leave before it and the cache stays prefix-closed: every
  cached block is reachable as a hit. O(B log B). No online policy (LRU included) gets more hits at the same
  capacity under these rules.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .trace import Trace

__all__ = ["NodeTrace", "node_trace", "ceiling", "belady"]

_NEVER = np.iinfo(np.int64).max


@dataclass
class NodeTrace:
    """A trace as prefix-tree nodes at one block size (see the module docstring)."""

    block_size: int
    nodes: np.ndarray  # int64 (B,): full blocks of all prompts, request by request
    offsets: np.ndarray  # int64 (n + 1,)
    cap: np.ndarray  # int64 (n,): most blocks a hit can cover, (n_i - 1) // block_size
    slots: np.ndarray  # int64 (n,): blocks the request holds while it runs, ceil(n_i / block_size)
    next_use: np.ndarray  # int64 (B,): next request that can hit this block (_NEVER: none)
    prompt_tokens: int

    def __len__(self) -> int:
        return int(self.cap.size)


def _next_use(nodes: np.ndarray, offsets: np.ndarray, cap: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """For each occurrence: the next request (among ``keep``, all when None) that can hit the same node."""
    n = cap.size
    req = np.repeat(np.arange(n, dtype=np.int64), np.diff(offsets))
    depth = np.arange(nodes.size, dtype=np.int64) - offsets[req]
    hittable = depth < cap[req]
    if keep is not None:
        hittable &= keep[req]
    order = np.lexsort((req, nodes))  # by node, then request
    s_node, s_req, s_hit = nodes[order], req[order], hittable[order]
    # for each sorted occurrence j: the first hittable occurrence after j (same node), by a backward min-scan
    idx = np.where(s_hit, np.arange(order.size, dtype=np.int64), order.size)
    nxt_idx = np.minimum.accumulate(idx[::-1])[::-1]
    after = np.empty_like(nxt_idx)
    after[:-1] = nxt_idx[1:]
    after[-1:] = order.size
    valid = after < order.size
    same = np.zeros(order.size, dtype=bool)
    same[valid] = s_node[after[valid]] == s_node[valid]
    nxt_sorted = np.full(order.size, _NEVER, dtype=np.int64)
    nxt_sorted[same] = s_req[after[same]]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    return nxt


def node_trace(trace: Trace, block_size: int) -> NodeTrace:
    """Nodes, caps and next uses of ``trace`` at ``block_size`` (a divisor of the trace block). O(B log B)."""
    nodes, offsets = trace.nodes(block_size)
    lengths = trace.input_lengths
    cap = (lengths - 1) // block_size
    slots = -(-lengths // block_size)
    return NodeTrace(block_size, nodes, offsets, cap, slots, _next_use(nodes, offsets, cap, None),
                     trace.prompt_tokens)


def ceiling(nt: NodeTrace) -> int:
    """Prompt tokens served from an infinite cache (hits in tokens). O(B log B)."""
    n = len(nt)
    counts = np.diff(nt.offsets)
    req = np.repeat(np.arange(n, dtype=np.int64), counts)
    depth = np.arange(nt.nodes.size, dtype=np.int64) - nt.offsets[req]
    _, first = np.unique(nt.nodes, return_index=True)
    seen = np.ones(nt.nodes.size, dtype=bool)
    seen[first] = False  # first occurrence of each node: a miss
    return int(np.count_nonzero(seen & (depth < nt.cap[req]))) * nt.block_size


def belady(nt: NodeTrace, capacity_blocks: int, progress=None) -> tuple[int, int]:
    """Belady's offline optimum at ``capacity_blocks``: ``(hit tokens, skipped requests)``; a request needing more
    than ``capacity_blocks`` blocks is skipped (it counts in no hit and changes no cache state), as in the replay,
    and next uses are then recomputed without the skipped requests.
    ``progress(k)`` is called now and then with the number of requests done since the last call. O(B log B)."""
    C = int(capacity_blocks)
    nodes = nt.nodes.tolist()
    fits = nt.slots <= C
    # requests too long for the pool never run: their occurrences are no use to keep a block for
    nxt = (nt.next_use if fits.all() else _next_use(nt.nodes, nt.offsets, nt.cap, fits)).tolist()
    offs = nt.offsets.tolist()
    caps = nt.cap.tolist()
    slots = nt.slots.tolist()
    cache: dict[int, int] = {}  # node -> its next use (the heap entry that is current)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, node); stale when cache.get(node) differs
    push, pop = heapq.heappush, heapq.heappop
    never = int(_NEVER)
    hits = skipped = 0
    get = cache.get
    reported = 0
    for i in range(len(caps)):
        if progress is not None and i - reported >= 1024:
            progress(i - reported)
            reported = i
        s = slots[i]
        if s > C:
            skipped += 1
            continue
        a, b = offs[i], offs[i + 1]
        h, m = 0, caps[i]
        while h < m and nodes[a + h] in cache:
            h += 1
        hits += h
        own = nodes[a:b]
        for x in own:  # the request's own blocks are pinned while it runs
            cache.pop(x, None)
        room = C - s
        while len(cache) > room:
            nu, _, x = pop(heap)
            if get(x) == -nu:
                del cache[x]
        for d, (x, u) in enumerate(zip(own, nxt[a:b])):
            if u != never:
                cache[x] = u
                push(heap, (-u, -d, x))
        if len(heap) > 4 * C + 1024:  # drop stale entries now and then: memory stays O(C)
            heap = [e for e in heap if get(e[2]) == -e[0]]
            heapq.heapify(heap)
    if progress is not None and len(caps) > reported:
        progress(len(caps) - reported)
    return hits * nt.block_size, skipped
