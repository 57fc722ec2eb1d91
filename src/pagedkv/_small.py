"""The per-step append and the single-sequence calls in plain Python, for small batches.

numpy costs about a microsecond per call whatever the size of the arrays, so the vectorised step
(:mod:`pagedkv._step`) has a floor of about ten microseconds that a batch of one sequence pays in full. Below
``SMALL_BATCH`` sequences the step runs here instead, reading and writing the *same* flat arrays element by
element through memoryviews (a memoryview item costs about a third of a numpy scalar access), so there is one
state and one statement of the semantics: this path handles the common case (one token per sequence, no
lookahead, no sliding window; copy-on-write included) and returns None, having changed nothing, for
everything else (bad input, out of blocks, a window), which the vectorised path then handles or reports.
The stateful tests drive both paths on the same operation sequences.

A batch of one (and ``append_slots(seq, [tok])``) takes :meth:`_Small._step_one`, the same step without the
batch's lists; it builds its one-element results by copying templates (cheaper than ``np.array`` of a list).
Larger small batches memoise their rows with the vectorised path's batch memo, so an engine that decodes the same
running set step after step pays one list compare instead of a dict lookup per sequence.

Work is O(B) Python operations plus O(1) per block taken, copied or registered.
"""

from __future__ import annotations

import numpy as np

from ._step import TABLES_DELTA, table_updates
from .types import StepDelta, StepResult

SMALL_BATCH = 24
"""Batches of at most this many sequences take the plain-Python step (the measured crossover with the vectorised
step: about 24 sequences with prefix caching off, 30 with it on; docs/benchmarks/speed-round3.md)."""
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


class _Small:
    """Mixin of :class:`pagedkv.BlockManager`: the plain-Python step for small batches."""

    _mvs: tuple | None = None
    _memo_small: tuple | None = None  # (seq_ids list, rows list): see _small_rows

    def _views(self) -> tuple:
        """Memoryviews of the row arrays and the GPU refcounts (rebuilt after the row arrays grow)."""
        mvs = self._mvs  # reset to None wherever the row arrays or the table are reallocated
        if mvs is None:
            mvs = self._mvs = (memoryview(self._ntok), memoryview(self._nblk), memoryview(self._table),
                               memoryview(self._swapped), memoryview(self._gpu._ref), memoryview(self._nreg),
                               memoryview(self._pend), memoryview(self._nrel), memoryview(self._ccid),
                               memoryview(self._ckey), memoryview(self._table.reshape(-1)), self._table.shape[1])
        return mvs

    def _step_one(self, seq_id: object, token_ids: object, result: int):
        """One token appended to one sequence: ``decode_step`` at batch 1 (``result`` True: returns its
        StepResult; TABLES_DELTA: its StepDelta) and ``append_slots(seq, [tok])`` (``result`` False:
        returns the copy-on-write pairs). None, having changed nothing, when
        the call is not this path's case (bad input, a swapped sequence, out of blocks). :meth:`_step_small`
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
        try:
            r = self._row_of[seq_id]
        except (KeyError, TypeError):
            return None
        ntok, nblk, table, swapped, ref, nreg, pend, _, _, _, _, cols = self._mvs or self._views()
        if swapped[r]:
            return None
        bs = self._bs
        n = ntok[r]
        j = n // bs
        off = n - j * bs
        cache = self._cache
        pair = None
        nb = nblk[r]
        if j == nb:  # the token opens a new block
            if j >= self._fixed_w > 0:
                return None  # past block_table_width: the vectorised path reports it
            if not self._gpu._nfree and (cache is None or not len(cache.evictor)):
                return None
            # ---- mutation: nothing below can fail
            w = self._take_one()
            if j >= cols:
                self._ensure_cols(j + 1)
                table = self._views()[2]  # (_ensure_cols dropped the old views)
            table[r, j] = w
            nblk[r] = j + 1
        else:
            w = table[r, j]
            if ref[w] > 1:  # held by others too: copy-on-write
                if not self._gpu._nfree and (cache is None or not len(cache.evictor)):
                    return None
                # ---- mutation: nothing below can fail
                dst = self._take_one()
                table[r, j] = dst
                if cache is not None:
                    cache.tok[dst] = cache.tok[w]
                ref[w] -= 1
                pair = (w, dst)
                self._cow_copies += 1
                self._copies.append((2, [w], [dst]))  # the plan's COW part
                w = dst
        ntok[r] = n + 1
        if cache is not None:
            cache._tok_mv[w, off] = t
            pend[r] = nreg[r]  # this call confirms the row's earlier KV
            if off == bs - 1:  # the block is full: cache it now (burst sharing)
                self._register1(r, w, j)
        if not result:
            return [] if pair is None else [pair]
        slots = _ONE_I64.copy()
        slots[0] = w * bs + off
        lens = _ONE_I32.copy()
        lens[0] = n + 1
        if result is True:
            return _new_result((slots, self._table[r : r + 1, : self._fixed_w or nblk[r]].copy(), lens,
                                _NO_COW if pair is None else np.array([pair], dtype=np.int64)))
        return self._delta_one(r, j, w, slots, lens, pair, j == nb or pair is not None)  # (TABLES_DELTA)

    def _delta_one(self, r: int, j: int, w: int, slots: np.ndarray, lens: np.ndarray, pair, changed: bool) -> StepDelta:
        """:meth:`_step_one`'s StepDelta: row ``r``, and the entry (r, j) = w if the step changed it."""
        row = _ONE_I64.copy()
        row[0] = r
        row.flags.writeable = False
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

    def _step_small(self, seq_ids: list, token_ids: object, b: int, result: int = 1) -> StepResult | StepDelta | None:
        """``decode_step`` of a few sequences (``b`` >= 2), one token each: returns its StepResult (its StepDelta
        when ``result`` is TABLES_DELTA), or None (nothing changed) when the call is not this path's case; the
        vectorised path then handles or reports it. The batch's rows are memoised with the vectorised path's memo (see :meth:`_small_rows`)."""
        toks = small_tokens(token_ids, b)  # the tokens: one valid int per sequence
        if toks is None:
            return None
        if type(seq_ids) is not list:
            seq_ids = list(seq_ids)
        memo = self._memo_small
        if memo is not None and memo[0] is self._memo_ids and seq_ids == memo[0]:
            rows = memo[1]  # (validated: live, distinct, GPU-resident)
        else:
            rows = self._small_rows(seq_ids)
            if rows is None:
                return None
        ntok, nblk, table, swapped, ref, nreg, pend = self._views()[:7]
        bs = self._bs
        written = []  # block each row writes (-1: a new block), before copy-on-write
        n_grow = 0
        shared = None  # block -> number of writers in this batch, for shared written blocks
        for r in rows:
            j = ntok[r] // bs
            if j == nblk[r]:
                if j >= self._fixed_w > 0:
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
        if need and need > self.num_free_gpu_blocks:
            return None
        # ---- mutation: nothing below can fail
        take = self._take_one
        cache = self._cache
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
            self._cow_copies += len(pairs)
            self._copies.append((2, [p[0] for p in pairs], [p[1] for p in pairs]))  # the plan's COW part
        if n_grow:
            need = max([nblk[r] for r in rows]) + 1
            if need > self._table.shape[1]:
                self._ensure_cols(need)
                table = self._views()[2]  # (_ensure_cols dropped the old views)
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
            tok = cache._tok_mv
            for r, w, t in zip(rows, written, toks):
                n = ntok[r]
                off = n % bs
                slots.append(w * bs + off)
                ntok[r] = n + 1
                lens.append(n + 1)
                tok[w, off] = t
                pend[r] = nreg[r]  # this call confirms the row's earlier KV
                if off == bs - 1:  # the block is full: cache it now (burst sharing)
                    self._register1(r, w, n // bs)
                if nblk[r] > width:
                    width = nblk[r]
        if changed is not None:
            upd = table_updates([], [tuple(np.array(c, dtype=np.int64) for c in zip(*changed))] if changed else [])
            return _new_delta((np.array(slots, dtype=np.int64), np.array(lens, dtype=np.int32),
                               np.array(pairs, dtype=np.int64) if pairs else _NO_COW, self._memo_rows, upd))
        tables = self._table.take(rows, axis=0)[:, : self._fixed_w or width]  # (take: cheapest for a few rows)
        return _new_result((np.array(slots, dtype=np.int64), tables, np.array(lens, dtype=np.int32),
                            np.array(pairs, dtype=np.int64) if pairs else _NO_COW))

    def _small_rows(self, seq_ids: list) -> list | None:
        """The rows of a batch of live, distinct, GPU-resident sequences, memoised (None: not so). The memo is
        the vectorised path's (:meth:`_rows`): ``_memo_small`` holds the very list object that is
        ``_memo_ids``, so whatever drops or replaces that memo (a new or freed row, a swap) drops this one too."""
        row_of = self._row_of
        try:
            rows = [row_of[s] for s in seq_ids]
        except (KeyError, TypeError):
            return None
        if len(set(rows)) != len(rows):
            return None
        swapped = self._views()[3]
        for r in rows:
            if swapped[r]:
                return None
        ids = seq_ids.copy()
        memo_rows = np.array(rows, dtype=np.int64)
        memo_rows.flags.writeable = False  # (handed out as StepDelta.table_rows)
        self._memo_ids, self._memo_rows = ids, memo_rows
        self._memo_small = (ids, rows)
        return rows

    def _register1(self, r: int, w: int, j: int) -> None:
        """:meth:`_register` of the one block ``w`` (column ``j``) a small step filled, through memoryviews."""
        mvs = self._mvs
        nreg, ccid, ckey = mvs[5], mvs[8], mvs[9]
        if nreg[r] != j:  # not the plain case (a chain to catch up): the general form
            self._register(r)
            return
        pcid = ccid[r]
        if pcid:  # (register records the block's KV event itself when it caches it)
            ccid[r], ckey[r] = self._cache.register(w, pcid, ckey[r], self._ns_of[r])
        nreg[r] = j + 1

    def _fork_row(self, prow: int, child) -> None:
        """Give ``child`` (a new, valid id) a new row, a copy of row ``prow``, and add its references (element by
        element up to ``SMALL_TABLE`` blocks, vectorised beyond). :meth:`_new_row`'s work is inlined: fork is a
        per-sequence call."""
        if not self._free_rows:
            self._grow_rows()
        crow = self._free_rows.pop()
        self._row_of[child] = crow
        self._seq_of[crow] = child
        # (the batch memo stays valid: it maps live ids only, and a new id was in no memoised batch)
        ntok, nblk, table, swapped, ref, nreg, pend, nrel, ccid, ckey, flat, cols = self._mvs or self._views()
        ntok[crow] = ntok[prow]
        nblk[crow] = nb = nblk[prow]
        a = nrel[prow]
        if a:  # a free row has nrel 0 and is not swapped (_drop_row, _free_small): copy only what differs
            nrel[crow] = a
        sw = swapped[prow]
        if sw:
            swapped[crow] = True
        if self._cache is not None:  # (without a cache the chain fields stay 0)
            nreg[crow], ccid[crow], ckey[crow] = nreg[prow], ccid[prow], ckey[prow]
            pend[prow] = pend[crow] = nreg[prow]  # the parent's KV is written (it is forked)
            self._ns_of[crow] = self._ns_of[prow]
        if nb <= SMALL_TABLE and not sw:
            p0, c0 = prow * cols, crow * cols
            flat[c0 : c0 + nb] = flat[p0 : p0 + nb]  # one C-level copy of the table row
            for b in flat[p0 + a : p0 + nb].tolist():
                ref[b] += 1
            return
        self._table[crow, :nb] = self._table[prow, :nb]
        pool = self._cpu if sw else self._gpu
        pool._ref[self._table[prow, a:nb]] += 1

    def _free_small(self, seq_id, row: int) -> bool:
        """free() of a GPU-resident row of at most ``SMALL_TABLE`` blocks, element by element: release its blocks
        tail first (as :meth:`_release_gpu`) and drop the row (as :meth:`_drop_row`). False (nothing done)
        for any other row."""
        ntok, nblk, table, swapped, ref, nreg, pend, nrel, ccid, ckey, flat, cols = self._mvs or self._views()
        a, z = nrel[row], nblk[row]
        if z > SMALL_TABLE or swapped[row]:
            return False
        r0 = row * cols
        cache, pool = self._cache, self._gpu
        cid = cache._cid_mv if cache is not None else None
        ring, size = pool._ring_mv, pool.num_blocks
        held = flat[r0 + a : r0 + z].tolist()
        held.reverse()  # released tail first
        for b in held:
            n = ref[b] - 1
            ref[b] = n
            if n == 0:
                if cid is not None and cid[b]:
                    cache.evictor.push(b)
                else:  # to the tail of the free ring (BlockPool.give, one block, inlined)
                    ring[(pool._head + pool._nfree) % size] = b
                    pool._nfree += 1
        flat[r0 : r0 + z] = _NULLS[:z]  # NULL_BLOCK, one C-level copy
        nrel[row] = ccid[row] = 0  # the fields allocate does not set (fork sets them all)
        del self._row_of[seq_id]
        self._seq_of[row] = self._ns_of[row] = None
        self._free_rows.append(row)
        self._memo_ids = None
        return True

    def _take_one(self) -> int:
        """One GPU block with refcount 1: the oldest free block, else the LRU cached one (evicted)."""
        pool = self._gpu
        if pool._nfree:
            return pool.take_one()
        b = self._cache.evict()
        pool._ref[b] = 1
        return b
