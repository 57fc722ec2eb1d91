"""The older, array layout of KV events (``pagedkv serve --kv-events-layout array``): vLLM 0.9 to 0.23's.

Each event is a msgpack array led by its type name: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``; an event of a KV cache group carries the longer arrays vLLM sent once it had groups
(``... medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`` and
``["BlockRemoved", block_hashes, medium, group_idx]``). The batch is ``[ts, events, data_parallel_rank]`` (rank
None). vLLM's array decoders ignore trailing elements they have no field for, and require every field without
a default: ``medium`` since 0.10.2, ``lora_name`` since 0.14 (read from their sources), so these arrays decode
in all of them. The class names are the event kinds (:func:`pagedkv.cluster.index.event_kind` dispatches on
them); :mod:`.kv_events` holds the default (map) layout and the publisher.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .. import events as ev

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "decoder", "to_wire"]


class _Event(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Base of the array-layout events: encoded as arrays led by the class name."""


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]  # (vLLM sends digests as bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None] = None
    extra_keys: Union[list, None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class _ShortBlockStored(_Event, tag="BlockStored"):
    """What a single-group BlockStored is sent as (the short layout, through ``lora_name``: vLLM 0.14 to 0.23
    require it, and the earlier versions' decoders ignore the trailing fields they lack; :class:`BlockStored`
    decodes it)."""

    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]


class _ShortBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None]


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


decoder = msgspec.msgpack.Decoder(KVEventBatch)


def to_wire(event: Any) -> _Event:
    """A :mod:`pagedkv.events` event as its array-layout struct (TypeError for anything else)."""
    if isinstance(event, ev.BlockStored):
        args = ([int(h) for h in event.block_hashes],
                None if event.parent_block_hash is None else int(event.parent_block_hash),
                [int(t) for t in event.token_ids], int(event.block_size),
                None if event.lora_id is None else int(event.lora_id), event.medium)
        g = getattr(event, "group_idx", None)
        if g is None:
            return _ShortBlockStored(*args, None)
        w = getattr(event, "kv_cache_spec_sliding_window", None)
        return BlockStored(*args, None, None, int(g), getattr(event, "kv_cache_spec_kind", None),
                           None if w is None else int(w))
    if isinstance(event, ev.BlockRemoved):
        g = getattr(event, "group_idx", None)
        if g is None:
            return _ShortBlockRemoved([int(h) for h in event.block_hashes], event.medium)
        return BlockRemoved([int(h) for h in event.block_hashes], event.medium, int(g))
    if isinstance(event, ev.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")
