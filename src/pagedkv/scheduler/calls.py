"""What the scheduler asks of its block manager beyond the plain calls, for :class:`pagedkv.BlockManager`, a
:class:`pagedkv.HybridBlockManager` (one table and slot mapping per KV cache group) and benchmark adapters of other
block managers (no ``slot_mapping``, no ``take_copy_plan``, ``free`` without ``cache``). The parts make the hot
calls (``decode_step``, ``allocate``, ``can_*``) on ``bm`` directly and go through :class:`BlockCalls` for the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..types import CopyPlan


def status_name(status: Any) -> str:
    """'OK' / 'LATER' / 'NEVER' for pagedkv's AllocStatus and for look-alike enums of benchmark adapters."""
    name = getattr(status, "name", None)
    return name if isinstance(name, str) else str(status)


class BlockCalls:
    """The block manager ``bm`` and what it can do.

    ``prepare``: its ``prepare_step`` (called before every ``decode_step``) or None; ``has_slots``: it has
    ``slot_mapping`` / ``block_table`` (prefills carry them); ``num_groups``: KV cache groups (None: one, plain
    arrays); ``own_plan``: it has no ``take_copy_plan``, so the step's copies are recorded here (``record``) in
    call order and :meth:`take_copy_plan` builds the plan from them."""

    __slots__ = ("bm", "prepare", "has_slots", "num_groups", "own_plan", "step_copies")

    def __init__(self, bm: Any) -> None:
        self.bm = bm
        self.prepare = getattr(bm, "prepare_step", None)
        self.has_slots = getattr(bm, "slot_mapping", None) is not None
        # per-group shapes when the manager's plain result names are per group (grouped_results; an adapter
        # without it: when it has num_groups); a BlockManager (num_groups 1) keeps the plain (T,) / one table
        grouped = getattr(bm, "grouped_results", None)
        self.num_groups = None if grouped is False else getattr(bm, "num_groups", None)
        self.own_plan = getattr(bm, "take_copy_plan", None) is None
        self.step_copies: list = []  # (kind, pairs) in call order (own_plan only)

    def begin_step(self) -> None:
        """A new step: nothing recorded yet."""
        self.step_copies = []

    def record(self, kind: Any, pairs: np.ndarray) -> None:
        """A call's copies of ``kind`` (own_plan only; the block manager keeps its own plan otherwise)."""
        if self.own_plan:
            self.step_copies.append((kind, pairs))

    def take_copy_plan(self) -> CopyPlan:
        """The step's copies in call order: the block manager's own plan, or one built from the recorded calls."""
        if not self.own_plan:
            return self.bm.take_copy_plan()
        return CopyPlan.build([(k, p[:, 0], p[:, 1]) for k, p in self.step_copies if len(p)])

    def free(self, seq_id: int, cache: bool) -> None:
        """``free(seq_id)``, or ``free(seq_id, cache=False)`` where the adapter takes the keyword."""
        if cache:
            self.bm.free(seq_id)
            return
        try:
            self.bm.free(seq_id, cache=False)
        except TypeError:  # an adapter without the keyword
            self.bm.free(seq_id)

    def table(self, seq_id: int):
        """The sequence's block table (a tuple of one per group for a HybridBlockManager)."""
        if self.num_groups is None:
            return self.bm.block_table(seq_id)
        return tuple(self.bm.block_table(seq_id, g) for g in range(self.num_groups))

    def slots(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """Slots of positions ``[start, end)``: int64 (T,), or (G, T) with KV cache groups."""
        bm = self.bm
        if self.num_groups is None:
            return np.asarray(bm.slot_mapping(seq_id, start, end), dtype=np.int64)
        return np.stack([np.asarray(bm.slot_mapping(seq_id, start, end, g), dtype=np.int64)
                         for g in range(self.num_groups)])

    def table_row(self, seq_id: int) -> int:
        """The sequence's row in the block manager's table matrix (incremental tables)."""
        return int(self.bm.table_rows([seq_id])[0])
