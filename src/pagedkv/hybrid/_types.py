"""The result types of :class:`pagedkv.HybridBlockManager` (internal module; the names are exported from
:mod:`pagedkv` and :mod:`pagedkv.hybrid`): a single-group result's fields with one slot mapping row and one block
table (or table delta) per KV cache group."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["HybridPrefillBatch", "HybridStepDelta", "HybridStepResult", "frozen"]


def frozen(a: np.ndarray) -> np.ndarray:
    """``a``, made read-only (in place). O(1)."""
    a.flags.writeable = False
    return a


class HybridStepResult(NamedTuple):
    """:meth:`HybridBlockManager.decode_step`'s result: :class:`pagedkv.StepResult` per group."""

    slot_mapping: np.ndarray  #: int64 (G, T): slot of each new token in each group (batch order)
    block_tables: tuple  #: G int32 (B, width) arrays, NULL_BLOCK padded (and where a window released blocks)
    seq_lens: np.ndarray  #: int32 (B,): tokens of each sequence after the append
    cow: np.ndarray  #: int64 (m, 2): copy-on-write pairs of every group, in the order made (as in the copy plan)

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """``slot_mapping`` (G, T): the name every manager's result answers (:class:`pagedkv.StepResult` too). O(1)."""
        return self.slot_mapping

    @property
    def group_block_tables(self) -> tuple:
        """``block_tables`` (G matrices): the name every manager's result answers. O(1)."""
        return self.block_tables


class HybridStepDelta(NamedTuple):
    """:meth:`HybridBlockManager.decode_step`'s result with ``block_tables=False``: :class:`pagedkv.StepDelta` per
    group. The engine keeps one table matrix per group, all indexed by the same table rows (a sequence has one
    row, the same in every group), and applies ``table_updates[g]`` to group ``g``'s matrix after the step: row
    ``table_rows[i]`` of it then equals ``block_table(seq_ids[i], g)``."""

    slot_mapping: np.ndarray  #: int64 (G, T): as HybridStepResult.slot_mapping
    seq_lens: np.ndarray  #: int32 (B,): as HybridStepResult.seq_lens
    cow: np.ndarray  #: int64 (m, 2): as HybridStepResult.cow
    table_rows: np.ndarray  #: int64 (B,): the table row of each sequence of the batch (every group)
    table_updates: tuple  #: G :class:`pagedkv.TableUpdates`: the entries the step changed in each group's tables

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """``slot_mapping`` (G, T): the name every manager's result answers (:class:`pagedkv.StepResult` too). O(1)."""
        return self.slot_mapping

    @property
    def group_table_updates(self) -> tuple:
        """``table_updates`` (G :class:`pagedkv.TableUpdates`): the name every manager's result answers. O(1)."""
        return self.table_updates


class HybridPrefillBatch(NamedTuple):
    """:meth:`HybridBlockManager.allocate_batch`'s result: :class:`pagedkv.PrefillBatch` with per-group slot
    mappings and block tables."""

    seq_ids: tuple
    num_cached_tokens: np.ndarray  #: int32 (B,)
    query_start_loc: np.ndarray  #: int32 (B + 1,)
    token_ids: np.ndarray  #: int32 (T,)
    positions: np.ndarray  #: int64 (T,)
    slot_mapping: np.ndarray  #: int64 (G, T)
    block_tables: tuple  #: G int32 (B, width) arrays
    seq_lens: np.ndarray  #: int32 (B,)

    @property
    def group_slot_mapping(self) -> np.ndarray:
        """``slot_mapping`` (G, T): the name every manager's result answers (:class:`pagedkv.StepResult` too). O(1)."""
        return self.slot_mapping

    @property
    def group_block_tables(self) -> tuple:
        """``block_tables`` (G matrices): the name every manager's result answers. O(1)."""
        return self.block_tables
