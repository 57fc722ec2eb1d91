"""The append (decode_step / append_slots): :class:`Stepper`, planning, the one-token fast path and the general
path.

::

    decode_step ─┬─ one token each, no lookahead ─> step1  (a dozen numpy operations; None if it needs CoW
                 │                                           or the pool looks short)
                 └─ anything else, or step1 declined ─> plan (blocks needed, CoW pairs, window releases)
                                                        └─> append (all or nothing)

Both paths register in the prefix cache the blocks that the step fills (burst sharing: findable as soon as
the call returns, through the :class:`~pagedkv.manager._registry.Registry`) and release what the sliding window lets
go before writing (through the :class:`~pagedkv.manager._window.Window`). The step's state is the tables'
(:class:`~pagedkv.manager._rows.SeqTables`); the Stepper itself holds only its copy-on-write counter.

What the step hands back about the block tables (``tables``): the batch's tables in full, padded
(:class:`StepResult`, the default: O(B x width) to gather), or only the entries the step changed
(:class:`StepDelta`, ``decode_step(..., block_tables=False)``: O(B + changes) whatever the context length)::

    table row r   [ 17 |  3 | 42 |    ]   before the step
                  [ -1 |  3 | 42 |  8 ]   after: the window released column 0, column 3 was appended
    updates       (r, 0, -1), (r, 3, 8)    copy-on-write adds (r, col, destination) likewise
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidTokensError, OutOfBlocksError, TableWidthError
from ..types import NULL_BLOCK, StepDelta, StepResult, TableUpdates

_NO_COW = np.zeros((0, 2), dtype=np.int64)
_NO_COW.flags.writeable = False

# what the append hands back about the block tables (True / False keep their old meaning)
TABLES_NONE, TABLES_FULL, TABLES_DELTA = 0, 1, 2


def _frozen(a: np.ndarray, dtype: type) -> np.ndarray:
    a = a.astype(dtype, copy=False)
    a.flags.writeable = False
    return a


_NO_UPDATES = TableUpdates(_frozen(np.zeros(0, np.int64), np.int64), _frozen(np.zeros(0, np.int64), np.int64),
                           _frozen(np.zeros(0, np.int32), np.int32))


def table_updates(released: list, parts: list) -> TableUpdates:
    """:class:`TableUpdates` from the (rows, cols) the window released and the (rows, cols, blocks) parts that
    received a block (copy-on-write destinations, appended blocks). Every array passed in is owned by the
    caller's step (fresh), so it is frozen in place, not copied. O(changes)."""
    for r, c in released:
        parts.insert(0, (r, c, np.full(c.size, NULL_BLOCK, dtype=np.int32)))
    if not parts:
        return _NO_UPDATES
    if len(parts) == 1:
        r, c, b = parts[0]
    else:
        r, c, b = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return TableUpdates(_frozen(r, np.int64), _frozen(c, np.int64), _frozen(b, np.int32))


def _frozen_rows(rows: np.ndarray) -> np.ndarray:
    if rows.flags.writeable:  # (the batch memo's rows are frozen once, when memoised)
        rows = rows.copy()
        rows.flags.writeable = False
    return rows


class Stepper:
    """The vectorised append of one manager over its parts: ``t`` (:class:`~pagedkv.manager._rows.SeqTables`), ``blocks``
    (:class:`~pagedkv.blocks._blocks.Blocks`), ``win`` (:class:`~pagedkv.manager._window.Window`), ``reg``
    (:class:`~pagedkv.manager._registry.Registry`), the prefix cache and the pending copy list. Counts its copy-on-write
    copies (``cow_copies``)."""

    def __init__(self, t, blocks, win, reg, cache, copies: list, bs: int, fixed_w: int) -> None:
        self.t, self.blocks, self.win, self.reg, self.cache = t, blocks, win, reg, cache
        self.gpu = blocks.gpu
        self.copies, self.bs, self.fixed_w = copies, bs, fixed_w
        self.cow_copies = 0

    def plan(self, rows: np.ndarray, counts: np.ndarray, la: int) -> tuple:
        """Blocks an append needs and can get, without changing anything.

        Returns (blocks_needed, blocks_available, need, cow, release), where ``need`` is each row's table length
        afterwards, ``cow`` is (rows, cols, src) of shared blocks that will be written, and ``release`` is
        (rows, first, stop) of table ranges the sliding window releases (or None)."""
        t = self.t
        bs = self.bs
        ntok = t.ntok[rows]
        end = ntok + counts
        nb = t.nblk[rows]
        need = np.maximum((end + la + bs - 1) // bs, nb)
        n_new = int(need.sum() - nb.sum())
        ref = self.gpu.ref
        available = self.blocks.num_free
        release = self.win.plan(rows, ntok)
        rel = None  # (blocks, counts): references the window drops in this step, before anything is written
        if release is not None:
            blk = np.concatenate([t.table[r, a:z] for r, a, z in zip(*release)])
            rel = np.unique(blk[blk >= 0], return_counts=True)
            # a block is freed when every holder releases it in this step (forks advancing in lockstep), unless a
            # pin holds it (pagedkv.retention.steering: it is parked, neither free nor evictable)
            freed = rel[0][ref[rel[0]] == rel[1]]
            available += freed.size
            ev = self.cache.evictor if self.cache is not None else None
            if freed.size and getattr(ev, "num_pinned", 0):
                available -= int(np.count_nonzero(ev.held(freed)))
        # copy-on-write: existing blocks that receive one of the new tokens, or hold one of the reserved lookahead
        # slots (the engine writes draft KV there), and are still shared once the window has released what it
        # releases (a fork shares the parent's lookahead-only blocks too)
        first = ntok // bs
        last = np.minimum((end + la - 1) // bs, nb - 1)
        span = int((last - first).max()) if last.size else -1
        cow = None
        if span == 0 and last.size:  # one written block per row (the common case)
            hit = first <= last
            src = t.table[rows, np.minimum(first, nb - 1)]
            shared = hit & (self.holders(src, rel) > 1)
            if shared.any():
                cow = (rows[shared], first[shared], src[shared].astype(np.int64))
        elif span > 0:
            bi, cs, ss = [], [], []
            for d in range(span + 1):
                col = first + d
                ok = np.flatnonzero(col <= last)
                src = t.table[rows[ok], col[ok]]
                shared = self.holders(src, rel) > 1
                bi.append(ok[shared]); cs.append(col[ok][shared]); ss.append(src[shared].astype(np.int64))
            bi, cs, ss = np.concatenate(bi), np.concatenate(cs), np.concatenate(ss)
            if bi.size:
                order = np.lexsort((cs, bi))  # batch order, then column: the order the writes happen in
                cow = (rows[bi[order]], cs[order], ss[order])
        if cow is not None:
            cow = self.last_writer_keeps(cow, rel)
        n_cow = 0 if cow is None else cow[0].size
        return n_new + n_cow, available, need, cow, release

    def holders(self, blocks: np.ndarray, rel: tuple | None) -> np.ndarray:
        """Refcounts of ``blocks`` less the references the window releases in this step (``rel``)."""
        held = self.gpu.ref[blocks]
        if rel is None or blocks.size == 0:
            return held
        rb, rc = rel
        i = np.minimum(np.searchsorted(rb, blocks), rb.size - 1)
        return held - np.where(rb[i] == blocks, rc[i], 0)

    def last_writer_keeps(self, cow: tuple, rel: tuple | None) -> tuple | None:
        """Sequential semantics inside one batch: when every (remaining) holder of a shared block writes it in
        this step, the earlier writers copy and the last one (in batch order) keeps the original. ``cow`` is in
        write order."""
        c_rows, c_cols, c_src = cow
        uniq, inv, cnt = np.unique(c_src, return_inverse=True, return_counts=True)
        full = cnt == self.holders(uniq, rel)  # every holder writes it
        if not full.any():
            return cow
        last = np.zeros(uniq.size, dtype=np.int64)
        np.maximum.at(last, inv, np.arange(c_src.size))  # the last writer of each block
        keep = np.ones(c_src.size, dtype=bool)
        keep[last[full]] = False
        if not keep.any():
            return None
        return c_rows[keep], c_cols[keep], c_src[keep]

    def step1(self, rows: np.ndarray, tokens: np.ndarray, delta: bool = False) -> StepResult | StepDelta | None:
        """Fast path of decode_step for one token per sequence and no lookahead: about a dozen numpy
        operations. Returns None (having changed nothing) when the step needs copy-on-write or more blocks than
        are free; the general path then handles or reports it. ``delta``: return :class:`StepDelta`."""
        t = self.t
        bs = self.bs
        ntok = t.ntok[rows]
        j, off = np.divmod(ntok, bs)  # the new token goes to table position j, offset off
        nb = t.nblk[rows]
        grow = j >= nb  # a new block is needed
        written = t.table[rows, j - grow]  # j <= nb: a growing row's last block stands in (it is replaced)
        ref_w = self.gpu.ref[written]
        if ref_w.max() > 1 and (ref_w[~grow] > 1).any():
            return None  # a shared block would be written: copy-on-write
        n_grow = int(np.count_nonzero(grow))
        release = self.win.plan(rows, ntok)
        if n_grow > self.blocks.num_free:
            return None  # (the general path also counts the blocks the window releases)
        if n_grow and self.fixed_w and int(j[grow].max()) >= self.fixed_w:
            return None  # past block_table_width: the general path reports it
        # ---- mutation: nothing below can fail
        released = [] if delta else None
        if release is not None:
            self.win.release(release, released)
        width = int(nb.max())
        if n_grow:
            ids = self.blocks.take(n_grow)
            g_rows, g_j = rows[grow], j[grow]
            width = max(width, int(g_j.max()) + 1)
            t.ensure_cols(width)
            t.table[g_rows, g_j] = ids
            t.nblk[g_rows] = g_j + 1
            written[grow] = ids
        end = ntok + 1
        t.ntok[rows] = end
        slots = written * np.int64(bs) + off  # int64
        if self.cache is not None:
            self.cache.tok.reshape(-1)[slots] = tokens
            nreg = t.nreg[rows]
            t.pend[rows] = nreg  # this call confirms the rows' earlier KV
            reg = off == bs - 1  # the new token fills its block: cache it now (burst sharing)
            if np.count_nonzero(reg):
                self.reg.register_rows(rows[reg], nreg[reg], j[reg] + 1)
        if delta:
            upd = table_updates(released, [(g_rows, g_j, ids)] if n_grow else [])
            return StepDelta(slots, end.astype(np.int32), _NO_COW, _frozen_rows(rows), upd)
        return StepResult(slots, t.table[rows, : self.fixed_w or width], end.astype(np.int32), _NO_COW)

    def append(self, rows: np.ndarray, counts: np.ndarray, flat: np.ndarray, la: int, tables: int,
                plan: tuple | None = None) -> StepResult | StepDelta:
        """The general append (all or nothing). ``tables``: TABLES_FULL (StepResult with the padded tables),
        TABLES_DELTA (StepDelta) or TABLES_NONE (StepResult with only the slots and copy-on-write pairs).
        ``plan``: this append's :meth:`plan`, already made and checked against the free blocks by a coordinator
        (KV cache groups)."""
        t = self.t
        if flat.size != counts.sum():
            raise InvalidTokensError(f"got {flat.size} tokens for counts summing to {counts.sum()}")
        needed, available, need, cow, release = plan or self.plan(rows, counts, la)
        if needed > available and plan is None:
            raise OutOfBlocksError(f"the step needs {needed} new blocks; {available} are free")
        if self.fixed_w and int(need.max()) > self.fixed_w:
            i = int(np.argmax(need))
            raise TableWidthError(
                f"sequence {t.seq_of[int(rows[i])]!r} would need {int(need[i])} blocks; block_table_width is "
                f"{self.fixed_w}"
            )
        # ---- mutation: nothing below can fail
        bs = self.bs
        ntok = t.ntok[rows]
        delta = tables == TABLES_DELTA
        released = [] if delta else None
        changed = []  # (rows, cols, blocks) that received a block, for StepDelta
        if release is not None:
            self.win.release(release, released)
        if cow is not None:
            c_rows, c_cols, c_src = cow
            dst = self.blocks.take(c_rows.size)
            t.table[c_rows, c_cols] = dst
            if self.cache is not None:
                self.cache.tok[dst] = self.cache.tok[c_src]
            np.subtract.at(self.gpu.ref, c_src, 1)  # a source may be copied by several writers
            cow_pairs = np.stack((c_src, dst.astype(np.int64)), axis=1)
            self.cow_copies += c_rows.size
            self.copies.append((2, c_src, dst))  # COW (the plan's copy-on-write part)
            if delta:
                changed.append((c_rows, c_cols, dst))
        else:
            cow_pairs = np.zeros((0, 2), dtype=np.int64)
        nb = t.nblk[rows]
        grow = need - nb
        n_grow = int(grow.sum())
        if n_grow:
            t.ensure_cols(int(need.max()))
            ids = self.blocks.take(n_grow)
            if (grow <= 1).all():  # at most one new block per row (n_grow == grow.size is not enough: [2, 0])
                g = grow > 0
                g_rows, g_cols = rows[g], nb[g]
            else:
                g_rows = np.repeat(rows, grow)
                g_cols = np.repeat(nb - (np.cumsum(grow) - grow), grow) + np.arange(n_grow)
            t.table[g_rows, g_cols] = ids
            t.nblk[rows] = need
            if delta:
                changed.append((g_rows, g_cols, ids))
        end = ntok + counts
        if counts.size == flat.size:  # one token per sequence
            tok_rows, pos = rows, ntok
        else:
            tok_rows = np.repeat(rows, counts)
            pos = np.repeat(ntok - (np.cumsum(counts) - counts), counts) + np.arange(flat.size)
        t.ntok[rows] = end
        blk, off = np.divmod(pos, bs)
        slots = t.table[tok_rows, blk] * np.int64(bs) + off
        if self.cache is not None:
            self.cache.tok.reshape(-1)[slots] = flat
            full, nreg = end // bs, t.nreg[rows]
            t.pend[rows] = nreg  # this call confirms the rows' earlier KV
            reg = full > nreg  # blocks this call filled: cache them now (burst sharing)
            if reg.any():
                self.reg.register_rows(rows[reg], nreg[reg], full[reg])
        if delta:
            return StepDelta(slots, end.astype(np.int32), cow_pairs, _frozen_rows(rows),
                             table_updates(released, changed))
        if not tables:
            return StepResult(slots, None, None, cow_pairs)
        width = self.fixed_w or int(need.max())
        return StepResult(slots, t.table[rows, :width], end.astype(np.int32), cow_pairs)
