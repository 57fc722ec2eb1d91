"""The per-step path of :class:`pagedkv.HybridBlockManager` (internal): :class:`HybridStepper` appends tokens in
every KV cache group, all or nothing across them.

Every group's manager has its own :class:`~pagedkv.manager._step.Stepper` (the vectorised append) and
:class:`~pagedkv.manager._small.Small` (the plain-Python one), over its own tables and the shared blocks. The
coordinator's step decides, before any group changes, that every group's step succeeds::

    decode_step ─┬─ up to small_batch sequences, one token each: step_small (plain Python; declines, changing
                 │  nothing, unless every group's new blocks and copy-on-write copies are free together)
                 └─ otherwise: plans (every group's Stepper.plan; the SUM against the free blocks) ──
                    commit_order ── every group's Stepper.commit, in that order

The groups hold the same sequences in the same rows (every call reaches every group in the same order), so one
row lookup (group 0's tables) serves every group. Results are stacked per group (:mod:`pagedkv.hybrid._types`).

Cost: O(B x groups) numpy work, plus O(1) per block filled, released or evicted; up to ``small_batch``
sequences with one token each, O(B x groups) plain Python.
"""

from __future__ import annotations

import numpy as np

from ._types import HybridStepDelta, HybridStepResult, frozen
from ..manager import _small as small_path
from ..manager._small import small_tokens
from ..manager._step import _NO_UPDATES, TABLES_DELTA, table_updates
from ..errors import InvalidTokensError, OutOfBlocksError, TableWidthError

__all__ = ["HybridStepper"]


class HybridStepper:
    """The append in every group. Holds, per group (group order): ``tables`` (:class:`~pagedkv.manager._rows.SeqTables`),
    ``steps`` (:class:`~pagedkv.manager._step.Stepper`), ``smalls`` (:class:`~pagedkv.manager._small.Small`), ``wins`` (the
    group's :class:`~pagedkv.manager._window.Window`, None for a full-attention group); and the shared ``blocks``
    (:class:`~pagedkv.blocks._blocks.Blocks`), ``gpu`` (the GPU :class:`~pagedkv.blocks.pool.BlockPool`), ``bs``, ``fixed_w``
    (the fixed table width, 0 for none) and ``small_batch`` (batches up to this size try the plain-Python step;
    0: never)."""

    __slots__ = ("tables", "t0", "steps", "smalls", "wins", "blocks", "gpu", "bs", "fixed_w", "small_batch", "G")

    def __init__(self, tables: list, steps: list, smalls: list, wins: list, blocks, gpu, bs: int,
                 fixed_w: int) -> None:
        self.tables, self.t0, self.steps, self.smalls, self.wins = tables, tables[0], steps, smalls, wins
        self.blocks, self.gpu, self.bs, self.fixed_w = blocks, gpu, bs, fixed_w
        self.small_batch = small_path.SMALL_BATCH  # (0: never; see pagedkv.manager._small)
        self.G = len(tables)

    def plans(self, rows: np.ndarray, counts: np.ndarray | None, la: int) -> list:
        """Every group's :class:`~pagedkv.manager._step.StepPlan` (``counts`` None: one token each); raises
        OutOfBlocksError / TableWidthError (changing nothing) when the sum of the groups' new blocks exceeds the
        free ones (plus what the windows release). O(B x G)."""
        steps = self.steps
        plans = [s.plan(rows, counts, la) for s in steps]
        free = self.blocks.num_free
        needed = sum([p.needed for p in plans])
        if needed > free:  # (each plan counts the blocks its window frees only when it alone is short)
            plans = [s.plan(rows, counts, la, exact=True) for s in steps]
            available = free + sum([p.available - free for p in plans])
            if needed > available:
                raise OutOfBlocksError(f"the step needs {needed} new blocks in {len(plans)} KV cache groups; "
                                       f"{available} are free")
        if self.fixed_w:
            steps[0].check_width(rows, plans[0].need)
        return plans

    def fits(self, rows: np.ndarray, counts: np.ndarray, la: int) -> bool:
        """Whether appending ``counts[i]`` tokens to row ``rows[i]`` (plus lookahead) fits in every group together."""
        try:
            self.plans(rows, counts, la)
        except (OutOfBlocksError, TableWidthError):
            return False
        return True

    def commit_order(self, plans: list) -> list:
        """The order to commit the groups' append plans in: group order when each group finds its blocks free at
        its turn, else the groups whose windows release more than they take first (the total fits, so each then
        does). O(G)."""
        free = self.blocks.num_free
        net = [p.needed - (p.available - free) for p in plans]  # blocks taken less blocks the window releases
        acc = 0
        for x in net:
            acc += x
            if acc > free:
                return sorted(range(len(plans)), key=net.__getitem__)
        return list(range(len(plans)))

    def step_small(self, seq_ids, token_ids: object, b: int, delta: bool) -> HybridStepResult | HybridStepDelta | None:
        """One token each for a few sequences, every group in plain Python (numpy's fixed costs dominate there):
        sliding groups release what their windows let go, then every group takes the plain-Python step of
        BlockManager (:mod:`pagedkv.manager._small`). None, having changed nothing, unless every group's blocks (new
        ones and possible copy-on-write copies, releases not counted) are free together. O(B x G)."""
        toks = small_tokens(token_ids, b)
        if toks is None:
            return None
        t0 = self.t0
        ids = seq_ids if type(seq_ids) is list else list(seq_ids)
        memo = t0.memo_small
        if memo is not None and memo.ids is t0.memo_ids and ids == memo.ids:
            rows = memo.rows
        else:
            rows = t0.small_rows(ids)
            if rows is None:
                return None
        v0 = t0.mvs or t0.views()
        ntok, nblk = v0.ntok, v0.nblk
        bs, fw = self.bs, self.fixed_w
        grow = 0
        for r in rows:
            j = ntok[r] // bs
            if j == nblk[r]:
                if j >= fw > 0:
                    return None
                grow += 1
        need = grow * self.G
        ref = self.gpu.ref_mv
        for t in self.tables:
            table = (t.mvs or t.views()).table
            for r in rows:
                j = ntok[r] // bs
                if j < nblk[r] and ref[table[r, j]] > 1:
                    need += 1  # (an upper bound of the copy-on-write copies)
        if need > self.blocks.num_free:
            return None
        # ---- mutation: nothing below can fail (every group's step finds its blocks)
        mode = TABLES_DELTA if delta else True
        res, upds = [], []
        for small, win in zip(self.smalls, self.wins):
            released = [] if delta else None
            if win is not None:
                win.release_small(rows, released)
            if b == 1:
                got = small.step_one(ids[0], toks, mode)
            else:
                got = small.step_small(ids, toks, b, mode)
            assert got is not None, "a group's small step declined after the coordinator's checks"
            res.append(got)
            if delta:
                upd = got.table_updates
                if released:  # (the window's releases come first; no entry is both released and given a block)
                    rr, cc = zip(*released)
                    upd = table_updates([(np.array(rr, dtype=np.int64), np.array(cc, dtype=np.int64))],
                                        [(upd.rows, upd.cols, upd.blocks)] if upd.rows.size else [])
                upds.append(upd)
        cows = [r.cow for r in res if len(r.cow)]
        slots = np.concatenate([r.slot_mapping for r in res]).reshape(len(res), b)
        cow = res[0].cow if not cows else cows[0] if len(cows) == 1 else np.concatenate(cows)
        if delta:
            return HybridStepDelta(slots, res[0].seq_lens, cow, res[0].table_rows, tuple(upds))
        return HybridStepResult(slots, tuple([r.block_tables for r in res]), res[0].seq_lens, cow)

    def step(self, rows: np.ndarray, arr: np.ndarray, counts: np.ndarray | None, la: int,
             delta: bool) -> HybridStepResult | HybridStepDelta:
        """The vectorised step of validated rows and tokens (``counts`` None: one token each): every group's
        plan, checked together, committed in :meth:`commit_order`.
        All or nothing. O(B x G) numpy work plus O(1) per block filled, released or evicted."""
        G = self.G
        b = rows.size
        if b == 0:
            if delta:
                return HybridStepDelta(np.zeros((G, 0), np.int64), np.zeros(0, np.int32), np.zeros((0, 2), np.int64),
                                       frozen(np.zeros(0, np.int64)), tuple(_NO_UPDATES for _ in range(G)))
            return HybridStepResult(np.zeros((G, 0), np.int64), tuple(np.zeros((0, 0), np.int32) for _ in range(G)),
                                    np.zeros(0, np.int32), np.zeros((0, 2), np.int64))
        if arr.size != (b if counts is None else counts.sum()):
            raise InvalidTokensError(f"got {arr.size} tokens for counts summing to {b if counts is None else counts.sum()}")
        plans = self.plans(rows, counts, la)
        res = [None] * G
        order = self.commit_order(plans)
        mode = TABLES_DELTA if delta else True
        steps = self.steps
        for g in order:
            res[g] = steps[g].commit(rows, counts, arr, plans[g], mode)
        cows = [res[g].cow for g in order if res[g].cow.size]  # (in the order they were made)
        cow = np.concatenate(cows) if len(cows) > 1 else cows[0] if cows else res[0].cow
        slots = np.stack([r.slot_mapping for r in res])
        if delta:
            return HybridStepDelta(slots, res[0].seq_lens, cow, res[0].table_rows,
                                   tuple(r.table_updates for r in res))
        return HybridStepResult(slots, tuple(r.block_tables for r in res), res[0].seq_lens, cow)
