"""What the anchor adapters share: the status enum, errors, the step result and a base class."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

try:  # pagedkv's own enum once it exists, so statuses compare equal across pagedkv and the anchors
    from pagedkv import AllocStatus  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the state of pagedkv's public API

    class AllocStatus(enum.Enum):  # type: ignore[no-redef]
        """Local stand-in for ``pagedkv.AllocStatus`` (OK / LATER / NEVER)."""

        OK = "OK"
        LATER = "LATER"
        NEVER = "NEVER"


try:
    from pagedkv import OutOfBlocksError as _OutOfBlocksBase  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    _OutOfBlocksBase = RuntimeError  # type: ignore[assignment,misc]


FEATURES = frozenset({"prefix_caching", "fork", "swap", "lookahead", "sliding_window", "eviction_order"})


class AnchorUnavailable(ImportError):
    """The anchor's package is not installed in this interpreter (the message says how to get it)."""


class AnchorOutOfBlocks(_OutOfBlocksBase):  # type: ignore[misc,valid-type]
    """The anchor's block manager refused an allocation for lack of free blocks."""


class AnchorStep(NamedTuple):
    """What an adapter's ``decode_step`` hands back.

    ``block_tables``: what the anchor's scheduler hands to its model runner for the batch, in the
    anchor's own form (vLLM v2 and nano-vllm: each sequence's full block-id list, the live list
    object; vLLM V1: only the block ids newly allocated this step, or None, per request, because V1's
    workers keep persistent block tables and receive deltas).
    ``cow``: copy-on-write ``(src, dst)`` block pairs produced by this step (empty where none).
    """

    block_tables: list[Any]
    cow: list[tuple[int, int]]


def token_rows(token_ids: Any) -> list[list[int]]:
    """``(B,)`` or ``(B, k)`` tokens (numpy array, list or tuple) as B lists of python ints."""
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    rows: list[list[int]] = []
    for t in token_ids:
        if isinstance(t, (list, tuple)):
            rows.append([int(x) for x in t])
        elif hasattr(t, "tolist"):
            v = t.tolist()
            rows.append([int(x) for x in v] if isinstance(v, list) else [int(v)])
        else:
            rows.append([int(t)])
    return rows


class AnchorAdapter:
    """Base of the adapters: the subset of ``pagedkv.BlockManager`` that the benchmark scheduler uses.

    Calling convention per decode step (the benchmark drives pagedkv and the anchors alike)::

        if not bm.can_append_slots(seq_ids, k): ...preempt...
        bm.prepare_step(seq_ids, token_ids)      # untimed: engine-side bookkeeping of the anchor
        bm.decode_step(seq_ids, token_ids, k)    # timed: the anchor scheduler's block-manager calls

    ``prepare_step`` must be called, with the same batch, before each ``decode_step``.
    Sequences of a batch must be running (allocated, not swapped out).

    Keyword arguments of pagedkv's API that an anchor cannot honour raise NotImplementedError
    (``namespace=``), except ``free(cache=False)``, which the anchors ignore.

    ``check_in_step``: when True, ``decode_step`` also makes the per-sequence capacity check the anchor's
    scheduler makes before appending (vLLM v2 ``can_append_slots`` per group, nano-vllm ``can_append``
    per sequence).  Off by default: the benchmark calls ``can_append_slots`` itself.
    """

    name: str = "anchor"
    supports: frozenset[str] = frozenset()
    missing: str = ""
    check_in_step: bool = False

    _seqs: dict  # seq_id -> the anchor's own sequence (or request) object; set by each adapter
    _allocations = _prompt_tokens = _hit_tokens = 0  # allocate() counters kept by each adapter

    # -- shared introspection -----------------------------------------------------------------------------
    def is_swapped(self, seq_id: int) -> bool:
        if seq_id not in self._seqs:
            raise KeyError(seq_id)
        return False

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def stats(self) -> dict[str, float]:
        return {
            "allocations": self._allocations,
            "prompt_tokens": self._prompt_tokens,
            "prefix_hit_tokens": self._hit_tokens,
        }

    # -- helpers for subclasses -------------------------------------------------------------------------
    def _lacks(self, feature: str) -> NotImplementedError:
        return NotImplementedError(f"{self.name} does not support {feature} ({self.missing})")

    def _no_namespace(self, namespace: object) -> None:
        if namespace is not None:
            raise self._lacks("prefix-cache namespaces")

    # -- optional operations (overridden where the anchor has them) --------------------------------------
    def fork(self, parent_id: int, child_id: int) -> None:
        raise self._lacks("fork")

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        raise self._lacks("swap")

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        raise self._lacks("swap")

    def can_swap_in(self, seq_ids: Sequence[int], num_lookahead_slots: int = 0) -> AllocStatus:
        raise self._lacks("swap")

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        raise self._lacks("swap")

    @property
    def num_free_cpu_blocks(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
