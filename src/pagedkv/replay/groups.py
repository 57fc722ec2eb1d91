"""Hybrid replay (``pagedkv replay TRACE --groups gemma3``): KV cache groups against one table for all layers, at
equal KV bytes.

A hybrid model's KV per token is the same whichever manager holds it; what differs is how much of it a cached
prefix keeps. With one block table for all layers (:class:`pagedkv.BlockManager`) a block holds every layer's
KV of its tokens; with groups (:class:`pagedkv.HybridBlockManager`) a block holds one group's layers, so the same
bytes make G times as many blocks, and a cached prefix needs its full-attention blocks plus, per sliding-window
group, only the windows before the points where later prompts stop matching (window retention,
:mod:`pagedkv.hybrid._retention`). For each ``--capacity`` C (tokens of the one-table manager's pool):

- ``one table``: ``BlockManager(C / block_size)`` blocks of all layers;
- ``groups``: ``BlockManager(G x C / block_size, kv_cache_groups=preset, grouped_results=True)``: the same bytes, retention on;
- ``groups, plain LRU``: the same without retention (``window_retention=False``), to show what it does.

With ``--eviction-policy P`` (not ``lru``) every manager evicts in P's order and the names end in `` P``
(``one table arc``, ``groups arc``, ``groups, no retention arc``); ``session`` and ``density`` get each request's
conversation hint (:mod:`pagedkv.replay.sessions`).

Each replays the trace in sequence mode (allocate then free each request, :mod:`pagedkv.replay.sequence`) and
reports its hit rate, and every 64 requests the tokens whose full-attention KV is cached (one table: cached
blocks x block size; groups: group 0's, the full-attention group of the presets), averaged over the second half
of the replay: how many more tokens the same bytes hold.

Presets (group 0 full attention, then sliding-window groups, equal layers per group):

- ``gemma3``: Gemma 3 (270M .. 27B): 5 sliding layers (W = 512) per full one -> 1 full + 5 sliding groups;
- ``gpt-oss``: alternating sliding (W = 128) and full layers -> 1 full + 1 sliding group.
"""

from __future__ import annotations

import time

import numpy as np

from ..kv_groups import FullAttentionSpec, SlidingWindowSpec
from .point import PointResult
from .trace import Trace

__all__ = ["PRESETS", "preset_groups", "replay_groups"]

PRESETS = {"gemma3": (None, 512, 512, 512, 512, 512), "gpt-oss": (None, 128)}
_SAMPLE_EVERY = 64


def preset_groups(name: str) -> list:
    """The group specs of preset ``name`` (KeyError naming the presets otherwise)."""
    try:
        windows = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown --groups preset {name!r}; presets: {', '.join(PRESETS)}") from None
    return [FullAttentionSpec() if w is None else SlidingWindowSpec(w) for w in windows]


def replay_groups(trace: Trace, capacity_tokens: int, groups: list | None, *, block_size: int = 16,
                  retention: bool = True, progress=None, eviction_policy: str = "lru",
                  sessions=None) -> PointResult:
    """One sequence-mode replay at equal KV bytes: ``groups`` None is the one-table manager of
    ``capacity_tokens // block_size`` blocks, else one with the KV cache groups and ``len(groups)`` times as many. The
    result's ``extra`` holds ``tokens_held`` (mean full-attention tokens cached over the second half) and, for
    groups, ``sliding_blocks_held`` (mean sliding-group blocks cached, in one-table block equivalents).
    ``eviction_policy`` (:mod:`pagedkv.retention.eviction`) orders either manager's evictions (over the groups:
    after window retention's spare blocks); ``sessions`` (one conversation id per request,
    :func:`pagedkv.replay.sessions.conversation_ids`): each request's ``set_retention(session=)`` before its
    free, as :func:`pagedkv.replay.sequence.replay_sequence` does."""
    from ..manager import BlockManager

    nb = capacity_tokens // block_size
    if groups is None:
        bm = BlockManager(nb, block_size, enable_prefix_caching=True, watermark=0.0,
                          eviction_policy=eviction_policy)
        G = 1
    else:
        G = len(groups)
        bm = BlockManager(G * nb, block_size, kv_cache_groups=groups, enable_prefix_caching=True, watermark=0.0,
                          window_retention=retention, eviction_policy=eviction_policy, grouped_results=True)
        tag = np.full(G * nb, -1, dtype=np.int8)  # the group each block was last taken by
        cid = bm._cache.cid
    limit = G * nb
    need = (-(-trace.input_lengths // block_size)).tolist()
    lengths = trace.input_lengths.tolist()
    allocate, free, tokens = bm.allocate, bm.free, trace.tokens
    hint = bm.retention.set_retention if sessions is not None else None
    sess = sessions.tolist() if sessions is not None else None
    hits = skipped = prompt = 0
    held: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    for i, n in enumerate(need):
        if progress is not None and not i & 511 and i:
            progress(512)
        if G * n > limit:
            skipped += 1
            continue
        hits += allocate(i, tokens(i))
        if G > 1:
            for g in range(G):
                t = bm.block_table(i, g)
                tag[t[t >= 0]] = g
        if hint is not None:
            hint(i, session=sess[i])
        free(i)
        prompt += lengths[i]
        if not i % _SAMPLE_EVERY:
            if G == 1:
                held.append((bm.stats.num_cached_blocks, 0))
            else:
                cached = cid != 0
                full = int(np.count_nonzero(cached & (tag == 0)))
                held.append((full, int(np.count_nonzero(cached)) - full))
    seconds = time.perf_counter() - t0
    if progress is not None and need:
        progress(len(need) - ((len(need) - 1) // 512) * 512)
    name = "one table" if groups is None else ("groups" if retention else "groups, plain LRU")
    if eviction_policy != "lru":  # (without retention the groups' order is the policy's, not LRU)
        name = f"{'groups, no retention' if groups is not None and not retention else name} {eviction_policy}"
    res = PointResult(name, "sequence", capacity_tokens, 0, block_size, requests=len(need) - skipped,
                      skipped=skipped, prompt_tokens=prompt, hit_tokens=hits, seconds=seconds)
    res.evictions = int(bm.stats.evictions)
    late = held[len(held) // 2:] or held
    res.extra = {"tokens_held": float(np.mean([f for f, _ in late])) * block_size if late else 0.0,
                 "sliding_blocks_held": float(np.mean([s for _, s in late])) / G if late else 0.0,
                 "groups": G, "eviction_policy": eviction_policy}
    return res
