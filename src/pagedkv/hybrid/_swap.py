"""Swapping in every KV cache group of :class:`pagedkv.HybridBlockManager` (internal): :class:`HybridSwapper`.

Each group's :class:`~pagedkv.manager._swap.Swapper` moves that group's blocks; the coordinator counts every group's
blocks against the shared pool before any group moves, so a swap completes in every group or changes nothing::

    swap_out   refuse rows handed slots this step (group 0's snapshot: every group holds the same) ── the SUM of
               the groups' distinct blocks against the free CPU blocks ── every group's Swapper.swap_out
    swap_in    the SUM of what the groups consume (distinct blocks + growth, less reused cached ones) against
               the free GPU blocks ── every group's Swapper.swap_in ── rows marked pending in one group (a block
               cached this step reused) marked in every group

Cost: O(total table length x groups).
"""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError
from ..types import AllocStatus

__all__ = ["HybridSwapper"]


class HybridSwapper:
    """swap_out / swap_in over every group. Holds, per group: ``tables`` (:class:`~pagedkv.manager._rows.SeqTables`) and
    ``swaps`` (:class:`~pagedkv.manager._swap.Swapper`); shared: ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`), ``gpu``
    (the GPU :class:`~pagedkv.blocks.pool.BlockPool`), ``bs`` and ``watermark`` (GPU blocks kept free)."""

    __slots__ = ("tables", "t0", "swaps", "blocks", "gpu", "bs", "watermark")

    def __init__(self, tables: list, swaps: list, blocks, gpu, bs: int, watermark: int) -> None:
        self.tables, self.t0, self.swaps = tables, tables[0], swaps
        self.blocks, self.gpu, self.bs, self.watermark = blocks, gpu, bs, watermark

    def can_swap_out(self, rows: np.ndarray) -> bool:
        """Whether the CPU pool takes every group's distinct blocks of these (GPU-resident) rows."""
        return sum(t.unique_blocks(rows).size for t in self.tables) <= self.blocks.num_free_cpu

    def swap_out(self, seq_ids: list) -> list[tuple[int, int]]:
        """Every group's swap-out; (gpu, cpu) pairs of every group, in group order. All or nothing."""
        rows = self.t0.rows_where(seq_ids, swapped=False)
        self.swaps[0].refuse_pending(seq_ids, rows)  # (every group holds the same snapshot: group 0's answers)
        need = sum(t.unique_blocks(rows).size for t in self.tables)
        if need > self.blocks.num_free_cpu:
            raise OutOfBlocksError(f"swap_out needs {need} CPU blocks in {len(self.tables)} KV cache groups; "
                                   f"{self.blocks.num_free_cpu} are free")
        out = []
        for s in self.swaps:
            out += s.swap_out(seq_ids)
        return out

    def need(self, rows: np.ndarray, la: int) -> tuple[int, int]:
        """(blocks swap_in consumes, blocks it needs at most) over every group."""
        need = most = 0
        ref = self.gpu.ref
        bs = self.bs
        for t, s in zip(self.tables, self.swaps):
            uniq = t.unique_blocks(rows)
            reuse = s.reuse(uniq, rows)
            extra = int(np.maximum(-(-(t.ntok[rows] + la) // bs) - t.nblk[rows], 0).sum())
            most += uniq.size + extra
            need += uniq.size + extra - sum(1 for g in reuse.tolist() if g >= 0 and ref[g] > 0)
        return need, most

    def can_swap_in(self, rows: np.ndarray, la: int) -> AllocStatus:
        """NEVER / LATER / OK for swapped-out rows, every group counted, with the watermark."""
        need, most = self.need(rows, la)
        wm = self.watermark
        if most > self.gpu.num_blocks - wm:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.blocks.num_free - need >= wm else AllocStatus.LATER

    def swap_in(self, seq_ids: list) -> list[tuple[int, int]]:
        """Every group's swap-in; (cpu, gpu) pairs of every group, in group order. All or nothing."""
        rows = self.t0.rows_where(seq_ids, swapped=True)
        need, _ = self.need(rows, 0)
        if need > self.blocks.num_free:
            raise OutOfBlocksError(f"swap_in needs {need} GPU blocks in {len(self.tables)} KV cache groups; "
                                   f"{self.blocks.num_free} are free")
        out: list = []
        for s in self.swaps:
            out += s.swap_in(seq_ids)
        if self.t0.stepping:  # a group that reused a block cached in this step marks the rows pending: all do
            pend = np.zeros(rows.size, dtype=bool)
            for t in self.tables:
                pend |= t.ntok0[rows] < 0
            if pend.any():
                for t in self.tables:
                    t.ntok0[rows[pend]] = -1
        return out
