"""The speed baseline of sequence mode: the same LRU replay with a plain ``OrderedDict`` and no manager.

:func:`lru_replay` models what :func:`pagedkv.replay.replay_sequence` does with a :class:`pagedkv.BlockManager`,
rule for rule, but on the trace's prefix-tree nodes (:meth:`Trace.nodes`: one int per full block, equal for
equal prefixes) instead of tokens, so it needs no hashing, no token synthesis, no block ids and no manager::

    cache   OrderedDict node -> None   the unreferenced cached blocks, least recently released first
    free    int                        plain free blocks (never cached, or released uncached)

    per request of n tokens (nb = ceil(n / bs) blocks, full = n // bs of them full):
      hit     the longest run of leading nodes in the cache, at most (n - 1) // bs (one token left to compute)
      pin     the hit nodes leave the cache (in use)
      take    nb - hit blocks: plain free ones first, then evict the least recently released cached ones
      cache   the full blocks after the hit; a node still cached elsewhere (the last block when n % bs == 0,
              which the lookup does not reach) is computed again into a copy: the idle block keeps its place
              in the LRU order, and the copy is freed plainly with this request
      free    tail first: cached blocks become the most recently released, the others plain free blocks

Hits, evictions and skipped requests equal the manager's, to the block (``tests/test_replay.py`` checks it;
``benchmarks/replay_speed.py`` asserts it on the whole Mooncake trace while timing both). It is the yardstick of
the replay's speed: the manager does this much bookkeeping plus its own (hashing, tokens, tables).
Cost: O(full blocks) dict operations a request.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from .trace import Trace

__all__ = ["LruResult", "lru_replay"]


@dataclass
class LruResult:
    """Figures of one :func:`lru_replay` (the fields of :class:`pagedkv.replay.PointResult` it shares)."""

    capacity_tokens: int
    block_size: int
    requests: int
    skipped: int
    prompt_tokens: int
    hit_tokens: int
    evictions: int
    seconds: float  #: the replay loop (the nodes are computed before, untimed)
    cpu_seconds: float  #: the same, in the process's CPU time


def lru_replay(trace: Trace, capacity_tokens: int, *, block_size: int = 16) -> LruResult:
    """Replay ``trace`` in sequence mode through an ``OrderedDict`` LRU of ``capacity_tokens // block_size``
    blocks (see the module docstring). O(full blocks) dict operations."""
    num_blocks = capacity_tokens // block_size
    bs = block_size
    nodes, offsets = trace.nodes(bs)
    nodes, offsets = nodes.tolist(), offsets.tolist()
    lengths = trace.input_lengths.tolist()
    cache: OrderedDict = OrderedDict()
    contains, popitem = cache.__contains__, cache.popitem
    free = num_blocks
    hits = evictions = skipped = prompt = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, n in enumerate(lengths):
        nb = -(-n // bs)
        if nb > num_blocks:
            skipped += 1
            continue
        prompt += n
        ns = nodes[offsets[i] : offsets[i + 1]]
        lim = (n - 1) // bs
        k = 0
        while k < lim and contains(ns[k]):
            k += 1
        hits += k
        for x in ns[:k]:  # pinned: out of the LRU order while in use
            del cache[x]
        m = nb - k
        if m <= free:
            free -= m
        else:
            for _ in range(m - free):
                popitem(last=False)
            evictions += m - free
            free = 0
        # free, tail first: the blocks after the hit that a copy elsewhere does not already cache join the
        # cache (most recently released); the hit blocks rejoin it; the partial last block is plain free
        released = 0
        for x in reversed(ns):
            if x in cache:
                # (only the block the lookup did not reach: the manager computed it again into a copy of the idle
                # block's content; the idle block keeps its place in the LRU order and the copy is freed plainly)
                continue
            cache[x] = None
            released += 1
        free += nb - released
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return LruResult(capacity_tokens, bs, len(lengths) - skipped, skipped, prompt, hits * bs, evictions, seconds,
                     cpu_seconds)
