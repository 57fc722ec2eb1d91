"""Sequence mode (the Mooncake paper's Fig. 9 method): each request is allocated, then freed, in trace order.

Nothing runs concurrently, so the pool holds only cached blocks between requests and the hit rate measures the
prefix cache and its eviction policy alone (timestamps and output lengths are ignored).
"""

from __future__ import annotations

import time

from .point import PointResult, make_manager, setting, tier_figures
from .trace import Trace

__all__ = ["replay_sequence"]


def replay_sequence(trace: Trace, capacity_tokens: int, *, block_size: int = 16, cpu_capacity_tokens: int = 0,
                    manager_cls=None, impl: str = "pagedkv", progress=None, eviction_policy: str = "lru",
                    sessions=None) -> PointResult:
    """Replay ``trace`` through a prefix-caching manager of ``capacity_tokens // block_size`` GPU blocks (no
    watermark). ``manager_cls`` defaults to :class:`pagedkv.BlockManager`; an anchor adapter works the same.
    A request needing more blocks than the pool is skipped and counted. ``progress(k)`` is called every 512
    requests. Cost: one allocate and one free per request, plus O(prompt tokens) numpy work for its tokens.
    ``eviction_policy`` (:mod:`pagedkv.retention.eviction`); ``sessions`` (one conversation id per request,
    :func:`pagedkv.replay.sessions.conversation_ids`): each request's hint (``set_retention(session=)``) before
    its free.
    """
    if manager_cls is None:
        from ..manager import BlockManager as manager_cls
    num_blocks = capacity_tokens // block_size
    bm = make_manager(manager_cls, num_blocks, block_size, cpu_capacity_tokens // block_size,
                      eviction_policy=eviction_policy)
    hint = bm.retention.set_retention if sessions is not None else None
    sess = sessions.tolist() if sessions is not None else None
    limit = num_blocks - int(setting(bm, "watermark_blocks", 0) or 0)
    need = (-(-trace.input_lengths // block_size)).tolist()
    lengths = trace.input_lengths.tolist()
    allocate, free, tokens = bm.allocate, bm.free, trace.tokens
    # with the CPU tier each request is one engine step: its copies are taken (and the pinned blocks released)
    step = bm.take_copy_plan if setting(bm, "cpu_prefix_cache", False) else None
    hits = skipped = prompt = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, nb in enumerate(need):
        if progress is not None and not i & 511 and i:
            progress(512)
        if nb > limit:
            skipped += 1
            continue
        hits += allocate(i, tokens(i))
        if step is not None:
            step()
        if hint is not None:
            hint(i, session=sess[i])
        free(i)
        prompt += lengths[i]
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0
    if progress is not None and need:
        progress(len(need) - ((len(need) - 1) // 512) * 512)
    if eviction_policy != "lru":
        impl = f"{impl} {eviction_policy}"
    res = PointResult(impl, "sequence", capacity_tokens, cpu_capacity_tokens, block_size, requests=len(need) - skipped,
                      skipped=skipped, prompt_tokens=prompt, hit_tokens=hits, seconds=seconds)
    for k, v in tier_figures(bm.stats, bool(setting(bm, "cpu_prefix_cache", False))).items():
        setattr(res, k, v)
    res.cpu_seconds = cpu_seconds
    return res
