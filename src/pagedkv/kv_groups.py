"""KV cache group specs: what one group of layers keeps (vLLM's ``KVCacheSpec`` vocabulary).

A hybrid model (Gemma 3, gpt-oss, ...) mixes layers that read every earlier token with layers that read only the
last W tokens. :class:`pagedkv.HybridBlockManager` gives each *group* of layers its own block table per sequence
over one shared pool of block ids; a group's spec says which blocks its table must keep:

- :class:`FullAttentionSpec`: every block of the sequence (``kind = "full_attention"``);
- :class:`SlidingWindowSpec`: a query at position p sees positions ``(p - W, p]``; the blocks entirely before
  every future query's window are released (``kind = "sliding_window"``, ``window = W`` tokens).

Both are frozen dataclasses; ``kind`` and ``window`` are also what the group's KV events carry
(``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from .errors import InvalidArgumentError

__all__ = ["FullAttentionSpec", "KVCacheGroupSpec", "SlidingWindowSpec"]


@dataclass(frozen=True)
class FullAttentionSpec:
    """A group of full-attention layers: its table keeps every block of the sequence."""

    kind: ClassVar[str] = "full_attention"
    window: ClassVar[None] = None


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A group of sliding-window layers: a query at position p sees ``(p - window, p]`` (``window`` >= 1 tokens,
    the query's own position included); blocks no future query sees are released (NULL_BLOCK in the table)."""

    window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise InvalidArgumentError(f"SlidingWindowSpec.window must be an int >= 1, got {w!r}")


KVCacheGroupSpec = Union[FullAttentionSpec, SlidingWindowSpec]
