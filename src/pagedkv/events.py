"""KV cache events: what a KV-aware router learns about an engine's prefix cache.

The types and field names are those of vLLM V1's KV events (``vllm.distributed.kv_events``), so a router
written for vLLM (llm-d, NVIDIA Dynamo, SGLang's router) reads them unchanged once they are serialised in
vLLM's layout (:mod:`pagedkv.server` does that). A block's hash is its prefix-cache key, the chained xxh3 of
:func:`pagedkv.block_hashes`, so a router computes the keys of a prompt it has not routed yet from its tokens.

``BlockManager(..., enable_kv_events=True)`` records them; ``BlockManager.events.take()`` returns, in order, and
clears the events since the last call:

- :class:`BlockStored`: blocks entered the prefix cache (a chain of consecutive blocks of one sequence:
  ``block_hashes[i]`` is the parent of ``block_hashes[i + 1]``; ``parent_block_hash`` is the parent of the first,
  None for the first block of a prompt). ``token_ids`` holds the tokens of every block, concatenated.
- :class:`BlockRemoved`: blocks left the prefix cache (evicted, or withdrawn by ``free(seq, cache=False)``).
- :class:`AllBlocksCleared`: ``reset_prefix_cache()``, or a resynchronisation after the buffer overflowed (it is
  then followed by a :class:`BlockStored` for every block cached at that moment).

``medium`` says where the blocks are (vLLM's field, the same strings; None, or a field a producer leaves out, reads
as ``"GPU"``, so consumers written before the tiers read every event unchanged):

- ``"GPU"`` (:data:`MEDIUM_GPU`): the replica's prefix cache in device memory, the pool its forward reads;
- ``"CPU"`` (:data:`MEDIUM_CPU`): the replica's CPU tier (``cpu_prefix_cache=True``: demotions are stored, the
  tier's evictions removed);
- ``"DISK"`` (:data:`MEDIUM_DISK`): the replica's own disk tier (:class:`pagedkv.tiers.DiskBackend`); only that
  replica can load it. ``BlockStored`` for each block stored there (a put answered ``STORED``; after a restart,
  one for each block the rebuilt index found on disk), ``BlockRemoved`` for each block it evicted, dropped as
  corrupt or found gone;
- ``"SHARED"`` (:data:`MEDIUM_SHARED`): a store every replica of the cluster reads (Redis, a shared directory:
  :class:`pagedkv.tiers.RedisBackend`, :class:`pagedkv.tiers.SharedDirBackend`). A replica emits
  ``BlockStored(medium="SHARED")`` for each block it stored there or found already there (a put answered
  ``STORED`` or ``PRESENT``) and for each block it loaded from there (a hit refreshes the store's LRU), and
  ``BlockRemoved(medium="SHARED")`` for each block it found gone or refused (a load answered ``MISS``,
  ``CORRUPT`` or ``MISMATCH`` for a block it expected) or discarded. A router counts a shared block as
  reachable from **every** replica (:mod:`pagedkv.cluster.index`), whichever replica reported it; a
  ``reset_prefix_cache`` of one replica (``AllBlocksCleared``) does not empty the shared store. The store evicts
  on its own without telling anyone, so a router bounds what it believes the store holds
  (``MemoryIndex(shared_capacity_blocks=...)``).

:func:`medium_of` reads an event's medium with those rules. ``namespace`` is the request's prefix-cache
namespace (None for the default one: keys of different namespaces never coincide, the field only tells a router
which tenant or adapter a block belongs to; vLLM's ``lora_id`` plays the same part and is kept for layout
compatibility).

KV cache groups (:class:`pagedkv.HybridBlockManager`): as in vLLM, ``BlockStored`` carries the block's group
(``group_idx``, ``kv_cache_spec_kind`` = ``"full_attention"`` or ``"sliding_window"``,
``kv_cache_spec_sliding_window`` = W or None) and ``BlockRemoved`` its ``group_idx``; a removal that spans several
groups is one event per group. A single-group :class:`pagedkv.BlockManager` leaves the three fields None (their
defaults), so existing consumers read its events unchanged. Keys of different groups never coincide (each group
chains from its own root; group 0's keys are :func:`pagedkv.block_hashes`').
"""

from __future__ import annotations

from typing import NamedTuple, Union

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVCacheEvent", "MEDIUM_GPU", "MEDIUM_CPU",
           "MEDIUM_DISK", "MEDIUM_SHARED", "MEDIA", "MEDIUM_ALIASES", "medium_of"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_SHARED = "SHARED"
#: every medium an event may carry, fastest first (the order a lookup walks them)
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_SHARED)


class BlockStored(NamedTuple):
    """A chain of blocks entered the prefix cache (see the module docstring)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM_GPU
    namespace: object = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(NamedTuple):
    """Blocks left the prefix cache of ``medium``."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    group_idx: int | None = None


#: media other producers name, read as one of :data:`MEDIA`: vLLM's ``"STORAGE"`` (a KV-offloading connector's
#: storage tier of that replica) as ``"DISK"``
MEDIUM_ALIASES = {"STORAGE": MEDIUM_DISK}


def medium_of(event: object) -> str:
    """The event's medium: its ``medium`` field, None or absent read as ``"GPU"``, an alias of
    :data:`MEDIUM_ALIASES` as its medium; ValueError for a string that is none of these (vLLM spells them in
    capitals, as here). O(1)."""
    m = getattr(event, "medium", None)
    if m is None:
        return MEDIUM_GPU
    if m not in MEDIA:
        if m in MEDIUM_ALIASES:
            return MEDIUM_ALIASES[m]
        raise ValueError(f"unknown medium {m!r} (expected one of {', '.join(MEDIA)})")
    return m


class AllBlocksCleared(NamedTuple):
    """Every block left the prefix cache (reset, or the start of a resynchronisation after an overflow)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
