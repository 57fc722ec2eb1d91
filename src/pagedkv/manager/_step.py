"""The append (decode_step / append_slots / can_append_slots, and every group of a hybrid step): :class:`Stepper`,
one algorithm in two parts::

    plan    (changes nothing)  -> StepPlan: blocks needed and available, copy-on-write (rows, cols, sources),
                                  the window's releases, each row's table length afterwards
    commit  (cannot fail)      -> releases, copy-on-write destinations, new blocks, slots, registration

A caller checks the plan in between (one manager: :meth:`Stepper.check`; KV cache groups: the sum over the groups,
:class:`pagedkv.hybrid._step.HybridStepper`). One token per sequence without lookahead (the decode step) takes the
same two parts with one written block per row, read once (no per-token arrays). The only other path is the
plain-Python step of small batches (:mod:`pagedkv.manager._small`), behind its switch (``SMALL_BATCH``).

The step registers in the prefix cache the blocks that it fills (burst sharing: findable as soon as
the call returns, through the :class:`~pagedkv.manager._registry.Registry`) and releases what the sliding window lets
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

from typing import Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from .._checks import as_tokens as _as_tokens, batch_tokens, check_int as _check_int, flat_tokens, new_token_counts
from ..errors import InvalidArgumentError, InvalidTokensError, OutOfBlocksError, TableWidthError
from ..types import NULL_BLOCK, StepDelta, StepResult, TableUpdates
from ._rows import _EMPTY_I64

try:  # count_nonzero without its Python-level dispatcher (a quarter of a microsecond per call on the hot path)
    from numpy._core.multiarray import count_nonzero as _count_nonzero
except ImportError:  # pragma: no cover - numpy < 2
    _count_nonzero = np.count_nonzero
_max = np.maximum.reduce  # (ndarray.max without its Python-level wrapper)

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


class StepPlan(NamedTuple):
    """What an append needs, decided before anything changes (:meth:`Stepper.plan`)."""

    needed: int
    """Blocks the step takes: new blocks plus copy-on-write destinations."""
    available: int
    """Free blocks, plus those the window frees before writing. A lower bound, exact when it is less than
    ``needed`` or when the plan was made with ``exact=True``."""
    need: np.ndarray | None
    """Each row's table length afterwards (int64); None when no table grows (one token each)."""
    cow: tuple | None
    """(rows, cols, src) of the shared blocks the step writes, in write order (batch order, then column), or None."""
    release: tuple | None
    """(rows, first, stop) of the table ranges the window releases first, or None."""
    ntok: np.ndarray
    """Each row's token count before the step."""
    one: tuple | None
    """One token each and no lookahead: (j, off, written, grow): each row's written column and offset, the block
    it writes (before copy-on-write; a growing row's entry is replaced by its new block) and whether it takes a
    new block. None otherwise."""


_new_plan = tuple.__new__  # (StepPlan's fields, without the keyword-argument handling of StepPlan(...))


class Stepper:
    """The vectorised append of one manager over its parts: ``t`` (:class:`~pagedkv.manager._rows.SeqTables`), ``blocks``
    (:class:`~pagedkv.blocks._blocks.Blocks`), ``win`` (:class:`~pagedkv.manager._window.Window`), ``reg``
    (:class:`~pagedkv.manager._registry.Registry`), the prefix cache and the pending copy list. Counts its copy-on-write
    copies (``cow_copies``).

    One algorithm for every batch shape: :meth:`plan` (blocks needed, copy-on-write, releases; changes nothing)
    then :meth:`commit` (all of it; nothing there can fail). One token each without lookahead takes the same steps
    with per-row scalars (one written block per row) instead of per-token arrays."""

    def __init__(self, t, blocks, win, reg, cache, copies: list, bs: int, fixed_w: int) -> None:
        self.t, self.blocks, self.win, self.reg, self.cache = t, blocks, win, reg, cache
        self.gpu = blocks.gpu
        self.copies, self.bs, self.fixed_w = copies, bs, fixed_w
        self.cow_copies = 0

    def released(self, release: tuple | None) -> tuple | None:
        """(blocks, counts): the references the window drops in this step (``release``), before anything is
        written; None when it releases nothing."""
        if release is None:
            return None
        blk = np.concatenate([self.t.table[r, a:z] for r, a, z in zip(*release)])
        return np.unique(blk[blk >= 0], return_counts=True)

    def freed(self, rel: tuple | None) -> int:
        """Blocks the window's releases ``rel`` return to the pool: those whose every holder releases them in this
        step (forks advancing in lockstep), unless a pin holds them (pagedkv.retention.steering: parked, neither
        free nor evictable)."""
        if rel is None:
            return 0
        freed = rel[0][self.gpu.ref[rel[0]] == rel[1]]
        ev = self.cache.evictor if self.cache is not None else None
        if freed.size and getattr(ev, "num_pinned", 0):
            return freed.size - int(np.count_nonzero(ev.held(freed)))
        return freed.size

    def plan(self, rows: np.ndarray, counts: np.ndarray | None, la: int, exact: bool = False) -> StepPlan:
        """The :class:`StepPlan` of appending ``counts[i]`` tokens (None: one each) and ``la`` lookahead slots to
        row ``rows[i]``, without changing anything. ``exact``: count the blocks the window frees even when the
        free ones suffice. O(B) numpy work (O(B x written blocks) with several tokens or lookahead)."""
        t = self.t
        ntok = t.ntok[rows]
        release = self.win.plan(rows, ntok)
        if counts is None and la == 0:  # one written block per row: the column of the token
            j, off = np.divmod(ntok, self.bs)
            try:  # (columns [nrel, nblk) hold blocks, the rest NULL_BLOCK, and nrel <= j <= nblk)
                written = t.table[rows, j]
            except IndexError:  # j == nblk == the table's width for some row (its column is NULL_BLOCK)
                inside = j < t.table.shape[1]
                written = np.full(rows.size, NULL_BLOCK, dtype=t.table.dtype)
                written[inside] = t.table[rows[inside], j[inside]]
            grow = written < 0  # j == nblk: a new block is needed
            needed = int(_count_nonzero(grow))
            need = t.nblk[rows] + grow if needed else None
            ref_w = self.gpu.ref[written]  # (a growing row's NULL_BLOCK reads the last block's count: masked below)
            cow = self.shared_one(rows, j, written, grow, ref_w, release) if _max(ref_w) > 1 else None
            one = (j, off, written, grow)
        else:
            needed, need, cow = self.shared_many(rows, ntok, counts, la, release)
            one = None
        if cow is not None:
            needed += cow[0].size
        available = self.blocks.num_free
        if release is not None and (exact or needed > available):
            available += self.freed(self.released(release))
        return _new_plan(StepPlan, (needed, available, need, cow, release, ntok, one))

    def shared_one(self, rows: np.ndarray, j: np.ndarray, written: np.ndarray, grow: np.ndarray, ref_w: np.ndarray,
                   release: tuple | None) -> tuple | None:
        """Copy-on-write of a one-token step: (rows, cols, src) of the rows whose written block is still shared once
        the window has released what it releases, less the last writer of a block every holder writes; or None."""
        shared = (ref_w > 1) & ~grow
        if not shared.any():
            return None
        rel = self.released(release)
        if rel is not None:
            shared &= self.holders(written, rel) > 1
            if not shared.any():
                return None
        return self.last_writer_keeps((rows[shared], j[shared], written[shared].astype(np.int64)), rel)

    def shared_many(self, rows: np.ndarray, ntok: np.ndarray, counts: np.ndarray | None, la: int,
                    release: tuple | None) -> tuple:
        """(new blocks, need, cow) of a step of several tokens or lookahead slots: the blocks the tables grow by,
        each row's table length afterwards, and the copy-on-write (rows, cols, src), or None: existing blocks that receive one of the new tokens, or hold one
        of the reserved lookahead slots (the engine writes draft KV there), and are still shared once the window
        has released what it releases (a fork shares the parent's lookahead-only blocks too)."""
        t, bs, ref = self.t, self.bs, self.gpu.ref
        nb = t.nblk[rows]
        end = ntok + (1 if counts is None else counts)
        need = np.maximum((end + la + bs - 1) // bs, nb)
        n_new = int(need.sum() - nb.sum())
        first = ntok // bs
        last = np.minimum((end + la - 1) // bs, nb - 1)
        span = int((last - first).max()) if last.size else -1
        rel = False  # (False: not computed yet; only a shared written block needs it)
        bi, cs, ss = [], [], []
        for d in range(span + 1):
            col = first + d
            ok = np.flatnonzero(col <= last)
            src = t.table[rows[ok], col[ok]]
            shared = ref[src] > 1
            if not _count_nonzero(shared):
                continue
            if rel is False:
                rel = self.released(release)
            if rel is not None:
                shared &= self.holders(src, rel) > 1
            bi.append(ok[shared]); cs.append(col[ok][shared]); ss.append(src[shared].astype(np.int64))
        if not bi:
            return n_new, need, None
        bi, cs, ss = np.concatenate(bi), np.concatenate(cs), np.concatenate(ss)
        if not bi.size:
            return n_new, need, None
        order = np.lexsort((cs, bi))  # batch order, then column: the order the writes happen in
        return n_new, need, self.last_writer_keeps((rows[bi[order]], cs[order], ss[order]), rel)

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

    def check(self, rows: np.ndarray, plan: StepPlan) -> None:
        """Raise OutOfBlocksError / TableWidthError (nothing changed) unless ``plan`` fits this manager alone."""
        if plan.needed > plan.available:
            raise OutOfBlocksError(f"the step needs {plan.needed} new blocks; {plan.available} are free")
        self.check_width(rows, plan.need)

    def check_width(self, rows: np.ndarray, need: np.ndarray) -> None:
        """Raise TableWidthError (nothing changed) when a row would need more than ``block_table_width`` blocks."""
        if self.fixed_w and need is not None and int(need.max()) > self.fixed_w:
            i = int(np.argmax(need))
            raise TableWidthError(
                f"sequence {self.t.seq_of[int(rows[i])]!r} would need {int(need[i])} blocks; block_table_width is "
                f"{self.fixed_w}"
            )

    def append(self, rows: np.ndarray, counts: np.ndarray | None, flat: np.ndarray, la: int,
               tables: int) -> StepResult | StepDelta:
        """The append of one manager (all or nothing): :meth:`plan`, :meth:`check`, :meth:`commit`. ``counts``
        None: one token each. ``tables``: TABLES_FULL (StepResult with the padded tables), TABLES_DELTA (StepDelta)
        or TABLES_NONE (StepResult with only the slots and copy-on-write pairs). (KV cache groups check the sum of
        every group's plan, then commit each: :class:`pagedkv.hybrid._step.HybridStepper`.)"""
        if flat.size != (rows.size if counts is None else counts.sum()):
            raise InvalidTokensError(f"got {flat.size} tokens for counts summing to "
                                     f"{rows.size if counts is None else counts.sum()}")
        plan = self.plan(rows, counts, la)
        self.check(rows, plan)
        return self.commit(rows, counts, flat, plan, tables)

    def commit(self, rows: np.ndarray, counts: np.ndarray | None, flat: np.ndarray, plan: StepPlan,
               tables: int) -> StepResult | StepDelta:
        """Carry out a checked :meth:`plan`: the window's releases, copy-on-write (destinations taken first, in
        write order), new blocks, the tokens' slots, and the registration of the blocks the step fills. Nothing
        here can fail. O(B) numpy work plus O(1) per block taken, released or registered."""
        t = self.t
        n_grow, _, need, cow, release, ntok, one = plan
        delta = tables == TABLES_DELTA
        released = changed = None  # (rows, cols) released and (rows, cols, blocks) set, for StepDelta
        if delta:
            released, changed = [], []
        if release is not None:
            self.win.release(release, released)
        if cow is None:
            cow_pairs = _NO_COW
        else:
            cow_pairs = self.copy_on_write(cow, changed)
            n_grow -= cow_pairs.shape[0]
        bs = self.bs
        if one is not None:  # one token each: one written block per row
            j, off, written, grow = one
            if n_grow:
                g_rows, g_cols = rows[grow], j[grow]
                ids = self.grow(g_rows, g_cols, n_grow, changed)
                t.nblk[g_rows] = g_cols + 1
                if cow is None:
                    written[grow] = ids
            slots = (written if cow is None else t.table[rows, j]) * np.int64(bs) + off  # int64
            end = ntok + 1
        else:
            if n_grow:
                nb = t.nblk[rows]
                grow = need - nb
                if (grow <= 1).all():  # at most one new block per row (n_grow == grow.size is not enough: [2, 0])
                    g = grow > 0
                    g_rows, g_cols = rows[g], nb[g]
                else:
                    g_rows = np.repeat(rows, grow)
                    g_cols = np.repeat(nb - (np.cumsum(grow) - grow), grow) + np.arange(n_grow)
                self.grow(g_rows, g_cols, n_grow, changed)
                t.nblk[rows] = need
            if counts is None or counts.size == flat.size:  # one token each (with lookahead)
                end = ntok + 1
                tok_rows, pos = rows, ntok
            else:
                end = ntok + counts
                tok_rows = np.repeat(rows, counts)
                pos = np.repeat(ntok - (np.cumsum(counts) - counts), counts) + np.arange(flat.size)
            blk, off = np.divmod(pos, bs)
            slots = t.table[tok_rows, blk] * np.int64(bs) + off
        t.ntok[rows] = end
        if self.cache is not None:
            self.cache.tok.reshape(-1)[slots] = flat
            nreg = t.nreg[rows]
            t.pend[rows] = nreg  # this call confirms the rows' earlier KV
            # blocks this call filled: cache them now (burst sharing; nreg == ntok // bs before the call)
            if one is not None:
                reg = off == bs - 1
                if _count_nonzero(reg):
                    self.reg.register_rows(rows[reg], nreg[reg], j[reg] + 1)
            else:
                full = end // bs
                reg = full > nreg
                if reg.any():
                    self.reg.register_rows(rows[reg], nreg[reg], full[reg])
        if delta:
            return StepDelta(slots, end.astype(np.int32), cow_pairs, _frozen_rows(rows),
                             table_updates(released, changed))
        if not tables:
            return StepResult(slots, None, None, cow_pairs)
        width = self.fixed_w or int(_max(t.nblk[rows] if need is None else need))
        return StepResult(slots, t.table[rows, :width], end.astype(np.int32), cow_pairs)

    def copy_on_write(self, cow: tuple, changed: list | None) -> np.ndarray:
        """Give each (row, col) of ``cow`` a copy of its source block (taken in write order); returns the (src, dst)
        pairs and adds them to the pending copy plan."""
        t = self.t
        c_rows, c_cols, c_src = cow
        dst = self.blocks.take(c_rows.size)
        t.table[c_rows, c_cols] = dst
        if self.cache is not None:
            self.cache.tok[dst] = self.cache.tok[c_src]
        np.subtract.at(self.gpu.ref, c_src, 1)  # a source may be copied by several writers
        self.cow_copies += c_rows.size
        self.copies.append((2, c_src, dst))  # COW (the plan's copy-on-write part)
        if changed is not None:
            changed.append((c_rows, c_cols, dst))
        return np.stack((c_src, dst.astype(np.int64)), axis=1)

    def grow(self, g_rows: np.ndarray, g_cols: np.ndarray, n: int, changed: list | None) -> np.ndarray:
        """Take ``n`` new blocks into the table entries (g_rows, g_cols); returns them (the caller sets ``nblk``)."""
        t = self.t
        t.ensure_cols(int(g_cols.max()) + 1)
        ids = self.blocks.take(n)
        t.table[g_rows, g_cols] = ids
        if changed is not None:
            changed.append((g_rows, g_cols, ids))
        return ids


class AppendCalls:
    """BlockManager's per-step append calls (a base class of the facade: the contracts beside the algorithm).
    Uses the facade's ``_t`` (SeqTables), ``_step`` (Stepper), ``_small`` (Small), ``_window`` and
    ``_small_batch``."""

    __slots__ = ()

    def can_append_slots(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0, *,
                         num_new_tokens: int | Sequence[int] = 1) -> bool:
        """Whether appending ``num_new_tokens`` to each sequence (plus lookahead) fits in the free GPU blocks,
        counting new blocks, copy-on-write copies and blocks the sliding window releases. ``num_new_tokens``:
        one count for every sequence, or one per sequence (a ragged batch, as ``decode_step``'s
        ``num_new_tokens``). O(batch)."""
        rows = self._t.rows(list(seq_ids))
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        counts = new_token_counts(num_new_tokens, rows.size)
        if rows.size == 0:
            return True
        plan = self._step.plan(rows, counts, la)
        return plan.needed <= plan.available

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Append ``token_ids`` (whose KV the engine is about to write) to one sequence and reserve
        ``num_lookahead_slots`` empty slots after them. Returns the copy-on-write pairs (src, dst) to copy before
        writing. A convenience over :meth:`decode_step`; raises OutOfBlocksError (changing nothing) when full."""
        if num_lookahead_slots == 0 and self._small_batch and self._window is None and \
                type(num_lookahead_slots) is int:
            got = self._small.step_one(seq_id, token_ids, False)
            if got is not None:  # the plain-Python path (see _small.py)
                return got
        rows = self._t.rows([seq_id])
        arr = _as_tokens(token_ids)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        res = self._step.append(rows, np.array([arr.size], dtype=np.int64), arr, la, tables=False)
        return [(int(s), int(d)) for s, d in res.cow]

    def decode_step(self, seq_ids: Sequence[Hashable], token_ids: object, num_lookahead_slots: int = 0, *,
                    num_new_tokens: object = None, block_tables: bool = True) -> StepResult | StepDelta:
        """The batched hot path: append new tokens to every sequence of a batch in one call.

        ``token_ids``: shape ``(B,)`` (one token per sequence), ``(B, k)``, or a ragged list of B token lists
        (speculative decoding with a different number of accepted tokens per sequence). A ragged batch can also
        come flat, as an engine's sampler produces it: ``token_ids`` 1-D with sequence 0's tokens first and
        ``num_new_tokens`` (B,) the count of each sequence (>= 1); this skips converting Python lists. Reserves
        ``num_lookahead_slots`` empty slots after each sequence's tokens. Returns :class:`StepResult`:

        - ``slot_mapping`` int64 (total new tokens,): slot of each new token, sequence 0's tokens first;
        - ``block_tables`` int32 (B, max table length, or ``block_table_width``) padded with NULL_BLOCK;
        - ``seq_lens`` int32 (B,): tokens per sequence after the append, the new ones included (the attention
          context length of each sequence's last new token; lookahead slots not counted);
        - ``cow`` int64 (m, 2): copy-on-write pairs (src, dst), to copy before writing the new KV.

        ``block_tables=False`` returns :class:`StepDelta` instead: the same slots, lengths and copy-on-write
        pairs, and in place of the padded tables (whose gather costs O(B x longest table)) each sequence's
        stable table row (``table_rows``) and the table entries the step changed (``table_updates``: blocks
        appended, copy-on-write destinations, NULL_BLOCK where the window released a block), so the step costs
        the same at 100k tokens of context as at 1k. An engine that keeps its own tables loads a sequence's row in
        full after ``allocate``, ``fork`` and ``swap_in`` (``block_table(seq)`` at ``table_rows([seq])``) and applies
        each step's updates (docs/engine-contract.md, "Incremental block tables").

        The tokens are those whose KV this step computes: the token sampled in the previous step (from the
        prompt's last logits after a prefill), or the tokens accepted by speculative decoding; they take
        positions ``num_tokens .. num_tokens + k - 1`` and the logits of the last one give the next token.
        Reserved lookahead slots (``slot_mapping(seq, num_tokens, num_tokens + num_lookahead_slots)`` after the
        call) take the drafts' KV; a block still shared (a fork) that holds one of them is copied on write like a
        written block. With ``block_table_width`` a step that would give a sequence more blocks raises
        TableWidthError.

        Blocks for the step come from the free ring (oldest first), then from evicting LRU cached blocks;
        copy-on-write destinations are taken before new blocks. All or nothing: raises OutOfBlocksError and
        changes nothing if the step does not fit (check with :meth:`can_append_slots`). Prefix caching: the
        blocks this step fills enter the cache before it returns (burst sharing). Sliding window: blocks no
        query of this step can see are released first. O(B) numpy work, plus O(1) C-level work per block that
        fills (its key and map entry) and O(1) Python work per block released by the window or evicted; up to
        ``SMALL_BATCH`` sequences with one token each take a plain-Python path of the same semantics (numpy's
        fixed costs dominate there).
        """
        if block_tables is True:
            mode = True  # (TABLES_FULL)
        elif block_tables is False:
            mode = TABLES_DELTA
        else:
            raise InvalidArgumentError(f"block_tables must be True or False, got {block_tables!r}")
        if num_new_tokens is None and num_lookahead_slots == 0 and self._window is None and \
                type(num_lookahead_slots) is int:  # the plain-Python path for small batches (see _small.py)
            b = len(seq_ids)
            if b == 1 and self._small_batch:
                (s,) = seq_ids  # (any iterable of one id)
                got = self._small.step_one(s, token_ids, mode)
                if got is not None:
                    return got
            elif 0 < b <= self._small_batch:
                got = self._small.step_small(seq_ids, token_ids, b, mode)
                if got is not None:
                    return got
        rows = self._t.rows(seq_ids)
        b = rows.size
        if num_new_tokens is not None:
            arr, counts = flat_tokens(token_ids, num_new_tokens, b)
        elif type(token_ids) is np.ndarray and token_ids.ndim == 1 and token_ids.size == b:
            arr, counts = token_ids, None  # the common case: one token each
        else:
            arr, counts = batch_tokens(token_ids, b)
        if arr.dtype.kind not in "iu":
            raise InvalidTokensError(f"token_ids must be integers, got dtype {arr.dtype}")
        if arr.size and np.count_nonzero(arr >> 31):  # negative or >= 2**31, in one pass
            raise InvalidTokensError("token_ids must lie in [0, 2**31)")
        la = num_lookahead_slots if type(num_lookahead_slots) is int and num_lookahead_slots >= 0 else \
            _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if b == 0:
            if mode == TABLES_DELTA:
                return StepDelta(_EMPTY_I64, np.zeros(0, np.int32), np.zeros((0, 2), np.int64), _EMPTY_I64,
                                 _NO_UPDATES)
            return StepResult(_EMPTY_I64, np.zeros((0, 0), np.int32), np.zeros(0, np.int32), np.zeros((0, 2), np.int64))
        step = self._step
        if counts is None and la == 0:  # one token each (validated above): plan, check, commit
            plan = step.plan(rows, None, 0)
            if plan.needed > plan.available or step.fixed_w:
                step.check(rows, plan)
            return step.commit(rows, None, arr, plan, mode)
        return step.append(rows, counts, arr, la, mode)
