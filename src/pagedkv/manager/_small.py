"""The append's one fast path: the per-step append and the single-sequence calls in plain Python, for small batches.

numpy costs about a microsecond per call whatever the size of the arrays, so the vectorised step
(:mod:`pagedkv.manager._step`) has a floor of about ten microseconds that a batch of one sequence pays in full. Below
``SMALL_BATCH`` sequences the step runs here instead (:class:`Small`, over the same parts as the
:class:`~pagedkv.manager._step.Stepper`), reading and writing the *same* flat arrays (the
:class:`~pagedkv.manager._rows.SeqTables`') element by element through memoryviews (``SeqTables.views()``; a
memoryview item costs about a third of a numpy scalar access), so there is one state and one statement of
the semantics: this path handles the common case (one token per sequence, no lookahead, no sliding window;
copy-on-write included) and returns None, having changed nothing, for everything else (bad input, out of
blocks, a window), which the vectorised path then handles or reports. The stateful tests drive both paths on
the same operation sequences.

A batch of one (and ``append_slots(seq, [tok])``) takes :meth:`Small.step_one`, the same step without the
batch's lists; it builds its one-element results by copying templates (cheaper than ``np.array`` of a list).
Larger small batches memoise their rows with the vectorised path's batch memo, so an engine that decodes the same
running set step after step pays one list compare instead of a dict lookup per sequence.

Work is O(B) Python operations plus O(1) per block taken, copied or registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import numpy as np

from ._step import TABLES_DELTA, table_updates
from ..errors import SequenceStateError
from ..types import StepDelta, StepResult

if TYPE_CHECKING:
    from ._external import Hold

SMALL_BATCH = 24
"""Batches of at most this many sequences take the plain-Python step (the measured crossover with the vectorised
step: about 24 sequences with prefix caching off, 30 with it on; docs/benchmarks/speed-round3.md).

The switch of the append's one fast path: managers built while it is 0 always take the vectorised plan and commit
(:mod:`pagedkv.manager._step`); ``BlockManager._small_batch`` / ``HybridStepper.small_batch`` hold one manager's
copy. The stateful tests and the KV-content soak (``scripts/soak_kv.py --small-path off``) run both ways; what it
buys is measured by ``scripts/bench_step_paths.py --paths`` (about 7x at a batch of one, 2x at eight)."""
SMALL_TABLE = 16
"""Tables of at most this many blocks are forked and released element by element."""

_TOKEN_MAX = 2**31 - 1


def small_tokens(token_ids: object, b: int) -> list | None:
    """The tokens of a small step as a list of ``b`` ints in [0, 2**31), or None when ``token_ids`` is anything
    else (a (b,) integer array or a list of b ints; the vectorised path then handles or reports it). O(b)."""
    if type(token_ids) is np.ndarray:
        if token_ids.ndim != 1 or token_ids.size != b or token_ids.dtype.kind not in "iu":
            return None
        toks = token_ids.tolist()
    elif type(token_ids) is list and len(token_ids) == b:
        toks = token_ids
        for t in toks:
            if type(t) is not int:
                return None
    else:
        return None
    if min(toks) < 0 or max(toks) > _TOKEN_MAX:
        return None
    return toks
_NO_COW = np.zeros((0, 2), dtype=np.int64)
_NO_COW.flags.writeable = False
_ONE_I64 = np.zeros(1, dtype=np.int64)  # templates of one-element results (a copy is cheaper than np.array)
_ONE_I32 = np.zeros(1, dtype=np.int32)
_new_result = StepResult._make  # (cheaper than StepResult(...); raises if the fields change)
_new_delta = StepDelta._make
_NULLS = memoryview(np.full(64, -1, dtype=np.int32))  # NULL_BLOCK x SMALL_TABLE (and more), to clear a row


class Small:
    """The plain-Python twin of :class:`~pagedkv.manager._step.Stepper` (same parts, same semantics) for small batches,
    and fork / free of short tables. Counts its copy-on-write copies (``cow_copies``)."""

    def __init__(self, t, blocks, reg, cache, copies: list, bs: int, fixed_w: int) -> None:
        self.t, self.blocks, self.reg, self.cache = t, blocks, reg, cache
        self.gpu, self.cpu = blocks.gpu, blocks.cpu
        self.take_one = blocks.take_one
        self.copies, self.bs, self.fixed_w = copies, bs, fixed_w
        self.cow_copies = 0
        self.row1: dict[int, np.ndarray] = {}  # row -> its read-only one-element table_rows array (delta_one)

    def step_one(self, seq_id: object, token_ids: object, result: int):
        """One token appended to one sequence: ``decode_step`` at batch 1 (``result`` True: returns its
        StepResult; TABLES_DELTA: its StepDelta) and ``append_slots(seq, [tok])`` (``result`` False:
        returns the copy-on-write pairs). None, having changed nothing, when
        the call is not this path's case (bad input, a swapped sequence, out of blocks). :meth:`step_small`
        for one sequence, without the batch's lists."""
        if type(token_ids) is np.ndarray:
            if token_ids.dtype.kind not in "iu":
                return None
            toks = token_ids.tolist()  # (a 0-d array gives an int, a 2-d one a list of lists: rejected below)
            if type(toks) is not list or len(toks) != 1:
                return None
            t = toks[0]
            if type(t) is not int:
                return None
        elif type(token_ids) is list and len(token_ids) == 1:
            t = token_ids[0]
            if type(t) is not int:
                return None
        else:
            return None
        if not 0 <= t <= _TOKEN_MAX:
            return None
        tb = self.t
        try:
            r = tb.row_of[seq_id]
        except (KeyError, TypeError):
            return None
        v = tb.mvs or tb.views()
        if v.swapped[r]:
            return None
        ntok, nblk, table, ref, nreg, pend = v.ntok, v.nblk, v.table, v.ref, v.nreg, v.pend
        bs = self.bs
        n = ntok[r]
        j = n // bs
        off = n - j * bs
        cache = self.cache
        pair = None
        nb = nblk[r]
        if j == nb:  # the token opens a new block
            if j >= self.fixed_w > 0:
                return None  # past block_table_width: the vectorised path reports it
            if not self.gpu.nfree and (cache is None or not len(cache.evictor)):
                return None
            # ---- mutation: nothing below can fail
            w = self.take_one()
            if j >= v.cols:
                tb.ensure_cols(j + 1)
                table = tb.views().table  # (_ensure_cols dropped the old views)
            table[r, j] = w
            nblk[r] = j + 1
        else:
            w = table[r, j]
            if ref[w] > 1:  # held by others too: copy-on-write
                if not self.gpu.nfree and (cache is None or not len(cache.evictor)):
                    return None
                # ---- mutation: nothing below can fail
                dst = self.take_one()
                table[r, j] = dst
                if cache is not None:
                    cache.tok[dst] = cache.tok[w]
                ref[w] -= 1
                pair = (w, dst)
                self.cow_copies += 1
                self.copies.append((2, [w], [dst]))  # the plan's COW part
                w = dst
        ntok[r] = n + 1
        if cache is not None:
            cache.tok_mv[w, off] = t
            pend[r] = nreg[r]  # this call confirms the row's earlier KV
            if off == bs - 1:  # the block is full: cache it now (burst sharing)
                self.reg.register1(r, w, j)
        if not result:
            return [] if pair is None else [pair]
        slots = _ONE_I64.copy()
        slots[0] = w * bs + off
        lens = _ONE_I32.copy()
        lens[0] = n + 1
        if result is True:
            return _new_result((slots, tb.table[r : r + 1, : self.fixed_w or nblk[r]].copy(), lens,
                                _NO_COW if pair is None else np.array([pair], dtype=np.int64)))
        return self.delta_one(r, j, w, slots, lens, pair, j == nb or pair is not None)  # (TABLES_DELTA)

    def delta_one(self, r: int, j: int, w: int, slots: np.ndarray, lens: np.ndarray, pair, changed: bool) -> StepDelta:
        """:meth:`step_one`'s StepDelta: row ``r``, and the entry (r, j) = w if the step changed it."""
        row = self.row1.get(r)
        if row is None:  # made read-only once per row (freezing an array costs more than the rest of the step)
            row = _ONE_I64.copy()
            row[0] = r
            row.flags.writeable = False
            self.row1[r] = row
        if changed:
            col = _ONE_I64.copy()
            col[0] = j
            blk = _ONE_I32.copy()
            blk[0] = w
            row2 = row.copy()
            upd = table_updates([], [(row2, col, blk)])
        else:
            upd = table_updates([], [])
        return _new_delta((slots, lens, _NO_COW if pair is None else np.array([pair], dtype=np.int64), row, upd))

    def step_small(self, seq_ids: list, token_ids: object, b: int, result: int = 1) -> StepResult | StepDelta | None:
        """``decode_step`` of a few sequences (``b`` >= 2), one token each: returns its StepResult (its StepDelta
        when ``result`` is TABLES_DELTA), or None (nothing changed) when the call is not this path's case; the
        vectorised path then handles or reports it. The batch's rows are memoised with the vectorised path's memo (see :meth:`SeqTables.small_rows`)."""
        toks = small_tokens(token_ids, b)  # the tokens: one valid int per sequence
        if toks is None:
            return None
        if type(seq_ids) is not list:
            seq_ids = list(seq_ids)
        tb = self.t
        memo = tb.memo_small
        if memo is not None and memo.ids is tb.memo_ids and seq_ids == memo.ids:
            rows = memo.rows  # (validated: live, distinct, GPU-resident)
        else:
            rows = tb.small_rows(seq_ids)
            if rows is None:
                return None
        v = tb.views()
        ntok, nblk, table, ref, nreg, pend = v.ntok, v.nblk, v.table, v.ref, v.nreg, v.pend
        bs = self.bs
        written = []  # block each row writes (-1: a new block), before copy-on-write
        n_grow = 0
        shared = None  # block -> number of writers in this batch, for shared written blocks
        for r in rows:
            j = ntok[r] // bs
            if j == nblk[r]:
                if j >= self.fixed_w > 0:
                    return None  # past block_table_width: the vectorised path reports it
                written.append(-1)
                n_grow += 1
                continue
            w = table[r, j]
            written.append(w)
            if ref[w] > 1:
                if shared is None:
                    shared = {}
                shared[w] = shared.get(w, 0) + 1
        cows = []  # batch positions that copy, in batch order
        if shared is not None:
            keeper = {w: None for w, c in shared.items() if c == ref[w]}  # every holder writes it
            for i in range(len(rows) - 1, -1, -1):  # the last writer in batch order keeps the original
                w = written[i]
                if w in keeper and keeper[w] is None:
                    keeper[w] = i
            cows = [i for i, w in enumerate(written) if w in shared and keeper.get(w) != i]
        need = n_grow + len(cows)
        if need and need > self.blocks.num_free:
            return None
        # ---- mutation: nothing below can fail
        take = self.take_one
        cache = self.cache
        pairs = []
        changed = [] if result == TABLES_DELTA else None  # (row, col, block) entries the step set
        for i in cows:  # copy-on-write destinations first, in batch order
            r, src = rows[i], written[i]
            dst = take()
            table[r, ntok[r] // bs] = dst
            if changed is not None:
                changed.append((r, ntok[r] // bs, dst))
            if cache is not None:
                cache.tok[dst] = cache.tok[src]
            ref[src] -= 1
            written[i] = dst
            pairs.append((src, dst))
        if pairs:
            self.cow_copies += len(pairs)
            self.copies.append((2, [p[0] for p in pairs], [p[1] for p in pairs]))  # the plan's COW part
        if n_grow:
            need = max([nblk[r] for r in rows]) + 1
            if need > tb.table.shape[1]:
                tb.ensure_cols(need)
                table = tb.views().table  # (_ensure_cols dropped the old views)
            for i, r in enumerate(rows):
                if written[i] < 0:
                    j = ntok[r] // bs
                    written[i] = w = take()
                    table[r, j] = w
                    nblk[r] = j + 1
                    if changed is not None:
                        changed.append((r, j, w))
        slots = []
        lens = []
        width = 0
        if cache is None:
            for r, w in zip(rows, written):
                n = ntok[r]
                slots.append(w * bs + n % bs)
                ntok[r] = n = n + 1
                lens.append(n)
                if nblk[r] > width:
                    width = nblk[r]
        else:
            tok = cache.tok_mv
            for r, w, t in zip(rows, written, toks):
                n = ntok[r]
                off = n % bs
                slots.append(w * bs + off)
                ntok[r] = n + 1
                lens.append(n + 1)
                tok[w, off] = t
                pend[r] = nreg[r]  # this call confirms the row's earlier KV
                if off == bs - 1:  # the block is full: cache it now (burst sharing)
                    self.reg.register1(r, w, n // bs)
                if nblk[r] > width:
                    width = nblk[r]
        if changed is not None:
            upd = table_updates([], [tuple(np.array(c, dtype=np.int64) for c in zip(*changed))] if changed else [])
            return _new_delta((np.array(slots, dtype=np.int64), np.array(lens, dtype=np.int32),
                               np.array(pairs, dtype=np.int64) if pairs else _NO_COW, tb.memo_rows, upd))
        tables = tb.table.take(rows, axis=0)[:, : self.fixed_w or width]  # (take: cheapest for a few rows)
        return _new_result((np.array(slots, dtype=np.int64), tables, np.array(lens, dtype=np.int32),
                            np.array(pairs, dtype=np.int64) if pairs else _NO_COW))

    def fork_row(self, prow: int, child) -> None:
        """Give ``child`` (a new, valid id) a new row, a copy of row ``prow``, and add its references (element by
        element up to ``SMALL_TABLE`` blocks, vectorised beyond). :meth:`SeqTables.new_row`'s work is inlined: fork is a
        per-sequence call."""
        tb = self.t
        if not tb.free_rows:
            tb.grow()
        crow = tb.free_rows.pop()
        tb.row_of[child] = crow
        tb.seq_of[crow] = child
        # (the batch memo stays valid: it maps live ids only, and a new id was in no memoised batch)
        v = tb.mvs or tb.views()
        ntok, nblk, swapped, nrel = v.ntok, v.nblk, v.swapped, v.nrel
        ntok[crow] = ntok[prow]
        nblk[crow] = nb = nblk[prow]
        a = nrel[prow]
        if a:  # a free row has nrel 0 and is not swapped (drop_row, free_small): copy only what differs
            nrel[crow] = a
        sw = swapped[prow]
        if sw:
            swapped[crow] = True
        if self.cache is not None:  # (without a cache the chain fields stay 0)
            nreg, ccid, ckey = v.nreg, v.ccid, v.ckey
            nreg[crow], ccid[crow], ckey[crow] = nreg[prow], ccid[prow], ckey[prow]
            v.pend[prow] = v.pend[crow] = nreg[prow]  # the parent's KV is written (it is forked)
            tb.ns_of[crow] = tb.ns_of[prow]
        if nb <= SMALL_TABLE and not sw:
            ref, flat = v.ref, v.flat
            p0, c0 = prow * v.cols, crow * v.cols
            flat[c0 : c0 + nb] = flat[p0 : p0 + nb]  # one C-level copy of the table row
            for b in flat[p0 + a : p0 + nb].tolist():
                ref[b] += 1
            return
        tb.table[crow, :nb] = tb.table[prow, :nb]
        pool = self.cpu if sw else self.gpu
        pool.ref[tb.table[prow, a:nb]] += 1

    def free_small(self, seq_id, row: int) -> bool:
        """free() of a GPU-resident row of at most ``SMALL_TABLE`` blocks, element by element: release its blocks
        tail first (as :meth:`Blocks.release`) and drop the row (as :meth:`SeqTables.drop_row`). False (nothing done)
        for any other row."""
        tb = self.t
        v = tb.mvs or tb.views()
        a, z = v.nrel[row], v.nblk[row]
        if z > SMALL_TABLE or v.swapped[row]:
            return False
        ref, flat = v.ref, v.flat
        r0 = row * v.cols
        cache, pool = self.cache, self.gpu
        cid = cache.cid_mv if cache is not None else None
        ring, size = pool.ring_mv, pool.num_blocks
        held = flat[r0 + a : r0 + z].tolist()
        held.reverse()  # released tail first
        for b in held:
            n = ref[b] - 1
            ref[b] = n
            if n == 0:
                if cid is not None and cid[b]:
                    cache.evictor.push(b)
                else:  # to the tail of the free ring (BlockPool.give, one block, inlined)
                    if cid is not None and cache.has_copies:
                        cache.dupc_mv[b] = 0  # (PrefixCache.forget_copies)
                    ring[(pool.head + pool.nfree) % size] = b
                    pool.nfree += 1
        flat[r0 : r0 + z] = _NULLS[:z]  # NULL_BLOCK, one C-level copy
        v.nrel[row] = v.ccid[row] = 0  # the fields allocate does not set (fork sets them all)
        del tb.row_of[seq_id]
        tb.seq_of[row] = tb.ns_of[row] = None
        tb.free_rows.append(row)
        tb.memo_ids = None
        return True


class LifeCalls:
    """BlockManager's ``fork`` and ``free`` (a base class of the facade; Small does the short-table work). Uses
    the facade's ``_t``, ``_small``, ``_cache``, ``_reg``, ``_blocks``, ``_ext``, ``_hints`` and ``_steered``."""

    __slots__ = ()

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Create ``child_seq_id`` sharing every block of the parent (refcounts + 1); a later write into a shared
        block gets a copy-on-write pair. Works for swapped-out parents too (the child is swapped out as well).
        A parent allocated a chunk of its prompt (``allocate(..., num_new_tokens=)``) is forked only once its
        whole prompt is appended (SequenceStateError before, changing nothing). O(table length)."""
        t = self._t
        row_of = t.row_of
        try:  # (the checks of SeqTables.row and check_new_id, inlined: fork is a per-sequence call)
            prow = row_of[parent_seq_id]
            fresh = child_seq_id not in row_of
        except (KeyError, TypeError):
            prow = t.row(parent_seq_id)
            fresh = False
        if not fresh or t.loading or t.parked:
            t.check_new_id(child_seq_id)
        if t.partial and parent_seq_id in t.partial:
            n = t.partial[parent_seq_id]
            if t.ntok[prow] < n:
                raise SequenceStateError(
                    f"fork({parent_seq_id!r}, ...): only {int(t.ntok[prow])} of its {n} prompt tokens are "
                    "appended (chunked prefill); fork it once the whole prompt is")
        if t.stepping and t.ntok[prow] != t.ntok0[prow]:
            raise SequenceStateError(
                f"fork({parent_seq_id!r}, ...): the parent was handed slots in this step and their KV is written "
                "only by the step's forward; fork after it (after take_copy_plan() and the forward)")
        if t.partial:
            t.partial.pop(parent_seq_id, None)  # (complete: forget it only once the fork cannot fail)
        self._small.fork_row(prow, child_seq_id)
        if self._hints:
            self._inherit(parent_seq_id, child_seq_id)
        if t.stepping:
            t.ntok0[t.row_of[child_seq_id]] = t.ntok0[prow]


    def free(self, seq_id: Hashable, *, cache: bool = True, hold_for: float | None = None,
             now: float | None = None) -> Hold | None:
        """Release every block of the sequence and forget it. With prefix caching its full blocks stay cached
        until evicted; they are released tail first, so under memory pressure a long prefix loses its tail
        before its head. Freeing an unknown or already freed id raises UnknownSequenceError.
        O(table length).

        ``cache=False`` is for a request whose last call's KV was never written (aborted before the forward of
        its step ran): the blocks that call put in the prefix cache are withdrawn from it (``BlockRemoved``
        events), so nobody finds them as computed. If another sequence already holds one of them (a prefix hit
        in the same step, or a fork), that sequence relies on KV nobody wrote: the call raises
        SequenceStateError naming it and changes nothing; free the dependent sequences first (sequences
        allocated later in the same step are the ones that can depend on it, so freeing in reverse order of
        allocation always works), or run the step. Cached blocks chained after the withdrawn ones are withdrawn
        too; a sequence that holds one of those but none of the withdrawn blocks wrote equal content itself
        (registration deduplicated it): it keeps its blocks, uncached, and caches nothing more. Any other call
        that touches the sequence (decode_step, append_slots, fork, swap_out) confirms that its earlier calls'
        KV was written.

        ``cache=True`` says the sequence's KV is written: before the step's forward it is for sequences not handed
        slots in the step; abort one that was with ``cache=False`` and leave it out of the forward (see
        docs/engine-contract.md). With prefix caching, once the same-step checks are on (after the first
        :meth:`take_copy_plan`), ``free(seq_id)`` of a sequence handed slots in the current step (by ``allocate``,
        ``decode_step`` or ``append_slots``) raises SequenceStateError and changes nothing: its
        blocks would become prefix hits before anybody wrote their KV.

        ``hold_for=s`` (seconds): ``external.hold`` the sequence's blocks for a reader outside with a lease of ``s``
        (clock ``now``), then free it, all or nothing; returns the :class:`Hold` (None without ``hold_for``).

        A LOADING sequence (external KV still arriving) is aborted: its blocks are released except those a
        transfer may still write, which stay PARKED until ``external.finish_external`` reports the sequence
        (docs/external-kv.md)."""
        if hold_for is not None:
            return self._hold_and_free(seq_id, hold_for, now, cache)
        t = self._t
        try:
            row = t.row(seq_id)
        except SequenceStateError:
            if seq_id in t.loading:
                self._hints.pop(seq_id, None)
                self._ext.abort(seq_id)
                return None
            raise
        if not cache:
            self._check_unheld(seq_id)
        if self._cache is not None and not t.swapped[row]:
            if not cache:
                self._reg.withdraw_pending(seq_id, row)  # may raise; changes nothing then
            elif t.stepping and t.ntok[row] != t.ntok0[row]:
                raise SequenceStateError(
                    f"free({seq_id!r}): it was handed slots in this step and their KV is written only by the step's "
                    "forward, so its blocks cannot be cached as computed; free it after the step (after "
                    "take_copy_plan() and the forward), or abort it with free(..., cache=False)")
        if self._hints or self._steered:
            self._retain(seq_id, row)
        if t.partial:
            t.partial.pop(seq_id, None)
        if self._small.free_small(seq_id, row):
            return None
        if t.swapped[row]:
            self._blocks.release_cpu(t.table[row, t.nrel[row] : t.nblk[row]][::-1].copy())
        else:
            self._blocks.release(t.table[row, t.nrel[row] : t.nblk[row]][::-1].copy())
        t.drop_row(seq_id, row)
        return None
