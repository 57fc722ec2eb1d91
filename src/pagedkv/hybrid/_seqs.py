"""A sequence's life in every KV cache group of :class:`pagedkv.HybridBlockManager` (internal):
:class:`HybridSeqs` forks, frees, ends a step, resets the prefix cache and audits the groups together.

Each group's manager (a :class:`~pagedkv.BlockManager` over the shared parts) does its own share through its
public call; the coordinator's share is what spans the groups::

    fork    group 0 first (its checks raise before any group changes), then the others; the retention
            policy's per-row prompt length copied to the child
    free    cache=False: every group's pending blocks checked (SequenceStateError before any group changes);
            with window retention, the sliding groups' blocks outside every useful window are demoted (made
            spare) once every group has released them, tail first
    end     take_copy_plan: group 0 builds the one plan (shared copy list and tier), every other group ends
            its step snapshot
    check   the groups hold the same rows, token counts, table lengths, swap states, step snapshots and partly
            prefilled sequences; then every group's tables and the shared parts (pagedkv.manager._invariants.check)

Cost: each call O(table length x groups); ``check`` O(blocks + total table length).
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from ..manager import _invariants
from ..types import CopyPlan

__all__ = ["HybridSeqs"]


class HybridSeqs:
    """fork / free / end of step / prefix-cache reset / audit over every group. Holds, per group: ``groups``
    (the group managers, called through their public methods), ``tables`` (:class:`~pagedkv.manager._rows.SeqTables`),
    ``regs`` (:class:`~pagedkv.manager._registry.Registry`), ``wins`` (the group's window part, None for a full-attention
    group) and ``windows`` (the window in tokens, None for full attention); shared: ``retention``
    (:class:`~pagedkv.hybrid._retention.WindowRetention` or None), ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`),
    ``gpu`` (the GPU pool), ``cache`` (the prefix cache or None), ``tier`` (the CPU tier or None) and ``bs``."""

    __slots__ = ("groups", "tables", "t0", "regs", "wins", "windows", "retention", "blocks", "gpu", "cache",
                 "tier", "bs", "hints", "steer", "take_copies0")

    def __init__(self, groups: list, tables: list, regs: list, wins: list, windows: list, retention, blocks,
                 gpu, cache, tier, bs: int, hints: dict | None = None) -> None:
        self.groups, self.tables, self.t0, self.regs = groups, tables, tables[0], regs
        self.wins, self.windows, self.retention = wins, windows, retention
        self.blocks, self.gpu, self.cache, self.tier, self.bs = blocks, gpu, cache, tier, bs
        self.hints = hints if hints is not None else {}  # the coordinator's set_retention hints (seq_id -> (p, s))
        self.steer = None  # the SteeredEvictor once installed (priority classes and pins)
        self.take_copies0 = None  # group 0's deprecated take_copies (set by the coordinator's _wire)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Every group's fork (group 0 first: it raises, changing nothing, before any group changes); the child
        takes the parent's retention priority (not its session hint)."""
        for m in self.groups:
            m.fork(parent, child)
        if self.retention is not None:
            row_of = self.t0.row_of
            self.retention.copy_row(row_of[parent], row_of[child])
        h = self.hints.get(parent) if self.hints else None
        if h is not None and h[0]:
            self.hints[child] = (h[0], None)

    def retain(self, seq_id: Hashable, row: int) -> None:
        """Tag every group's GPU blocks of the sequence with its retention hint (priority classes) and give the
        policy its session hint once, for all of them, just before the groups release them (their free)."""
        prio, session = self.hints.pop(seq_id, (0, None))
        if self.t0.swapped[row]:
            return
        parts = [t.table[row, int(t.nrel[row]) : int(t.nblk[row])] for t in self.tables]
        blocks = np.concatenate(parts).astype(np.int64)
        blocks = blocks[blocks >= 0]
        ev = self.cache.evictor
        if self.steer is not None:
            ev.tag(blocks, prio)
        if session is not None:
            ev.hint(blocks, session)

    def free(self, seq_id: Hashable, cache: bool) -> None:
        """Every group's free, all or nothing (``cache=False``: every group's withdrawal checked first); with
        window retention the sliding groups' released blocks outside every useful window are made spare."""
        t0 = self.t0
        row = t0.row(seq_id)
        if not cache and self.cache is not None and not t0.swapped[row]:
            ref = self.gpu.ref
            for t, reg in zip(self.tables, self.regs):
                blocks = t.table[row, int(t.pend[row]) : int(t.nreg[row])]
                blocks = blocks[blocks >= 0]
                if (ref[blocks] > 1).any():
                    reg.withdraw_pending(seq_id, row)  # raises, changing nothing
        if self.cache is not None and (self.hints or self.steer is not None):
            if cache and not t0.swapped[row] and t0.stepping and t0.ntok[row] != t0.ntok0[row]:
                self.groups[0].free(seq_id, cache=cache)  # refused (same step): raises, changing nothing
            self.retain(seq_id, row)
        ret = self.retention
        if ret is None or t0.swapped[row]:
            for m in self.groups:
                m.free(seq_id, cache=cache)
            return
        # window retention: the sliding groups' blocks outside every useful window become spare once released
        end = int(t0.ntok[row]) // self.bs
        parts = []
        for t, win in zip(self.tables, self.wins):
            if win is not None:
                a, z = int(t.nrel[row]), int(t.nblk[row])
                parts.append((t.table[row, a:z].copy(), ret.kept(row, np.arange(a, z), win.k, end)))
        for m in self.groups:
            m.free(seq_id, cache=cache)
        for blk, keep in parts:
            ret.demote(blk[::-1].copy(), keep[::-1].copy())  # (tail first, the release order)

    def take_copy_plan(self) -> CopyPlan:
        """The one copy plan of every group (group 0's: the copy list and the tier are shared); every group's
        step ends."""
        plan = self.groups[0].take_copy_plan()
        for t in self.tables[1:]:
            t.end_step()
        return plan

    def take_copies(self):
        """Group 0's deprecated ``take_copies`` (shared copy list); every group's step ends."""
        got = self.take_copies0()  # (group 0's, handed over by the coordinator's _wire)
        for t in self.tables[1:]:
            t.end_step()
        return got

    def reset_prefix_cache(self) -> int:
        """Group 0 forgets the shared cache; every other group's live chains are broken too."""
        freed = self.groups[0].reset_prefix_cache()
        if self.cache is not None:
            for t in self.tables[1:]:
                t.ccid[:] = 0  # break every live chain
        return freed

    def check(self, extra=()) -> None:
        """The cross-group invariants, then every group's tables and the shared parts; AssertionError."""
        t0 = self.t0
        for g, t in enumerate(self.tables[1:], 1):
            if t.row_of != t0.row_of:
                raise AssertionError(f"group {g} holds other sequences or rows than group 0")
            rows = np.fromiter(t0.row_of.values(), dtype=np.int64, count=len(t0.row_of))
            if not (np.array_equal(t.ntok[rows], t0.ntok[rows]) and np.array_equal(t.nblk[rows], t0.nblk[rows])
                    and np.array_equal(t.swapped[rows], t0.swapped[rows])):
                raise AssertionError(f"group {g}: token counts, table lengths or swap states differ from group 0")
            if t0.stepping and not np.array_equal(t.ntok0[rows], t0.ntok0[rows]):
                raise AssertionError(f"group {g}: the same-step snapshot (_ntok0) differs from group 0's: a same-step "
                                     "check would refuse in one group after another changed")
            if t.partial != t0.partial:
                raise AssertionError(f"group {g}: partly prefilled sequences {t.partial} differ from group 0's "
                                     f"{t0.partial}")
        _invariants.check(self.blocks, self.tier, self.bs, list(zip(self.tables, self.windows)), extra)
