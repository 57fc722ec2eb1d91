"""The per-step append and the single-sequence calls in plain Python, for small batches.

numpy costs about a microsecond per call whatever the size of the arrays, so the vectorised step
(:mod:`pagedkv._step`) has a floor of about ten microseconds that a batch of one sequence pays in full. Below
``SMALL_BATCH`` sequences the step runs here instead, reading and writing the *same* flat arrays element by
element through memoryviews (a memoryview item costs about a third of a numpy scalar access), so there is one
state and one statement of the semantics: this path handles the common case (one token per sequence, no
lookahead, no sliding window; copy-on-write included) and returns None, having changed nothing, for
everything else (bad input, out of blocks, a window), which the vectorised path then handles or reports.
The stateful tests drive both paths on the same operation sequences.

Work is O(B) Python operations plus O(1) per block taken, copied or registered.
"""

from __future__ import annotations

import numpy as np

from .types import StepResult

SMALL_BATCH = 8
"""Batches of at most this many sequences take the plain-Python step (the measured crossover: see README)."""
SMALL_TABLE = 16
"""Tables of at most this many blocks are forked and released element by element."""

_TOKEN_MAX = 2**31 - 1
_NO_COW = np.zeros((0, 2), dtype=np.int64)
_NO_COW.flags.writeable = False


class _Small:
    """Mixin of :class:`pagedkv.BlockManager`: the plain-Python step for small batches."""

    _mvs: tuple | None = None

    def _views(self) -> tuple:
        """Memoryviews of the row arrays and the GPU refcounts (rebuilt after the row arrays grow)."""
        mvs = self._mvs  # reset to None wherever the row arrays or the table are reallocated
        if mvs is None:
            mvs = self._mvs = (memoryview(self._ntok), memoryview(self._nblk), memoryview(self._table),
                               memoryview(self._swapped), memoryview(self._gpu._ref), memoryview(self._nreg),
                               memoryview(self._pend), memoryview(self._nrel), memoryview(self._ccid),
                               memoryview(self._ckey))
        return mvs

    def _small_tokens(self, token_ids: object, b: int) -> list | None:
        """The batch's tokens as a list of ints when they are one valid token per sequence, else None."""
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
        if b == 1:
            if not 0 <= toks[0] <= _TOKEN_MAX:
                return None
        elif min(toks) < 0 or max(toks) > _TOKEN_MAX:
            return None
        return toks

    def _step_small(self, seq_ids: list, toks: list) -> tuple | None:
        """Append one token to each of a few sequences. Returns (rows, slots, cow pairs) or None (nothing
        changed) when the call is not this path's case; the vectorised path then handles or reports it."""
        row_of = self._row_of
        try:
            rows = [row_of[s] for s in seq_ids]
        except (KeyError, TypeError):
            return None
        if len(rows) > 1 and len(set(rows)) != len(rows):
            return None
        ntok, nblk, table, swapped, ref, nreg, pend = self._views()[:7]
        bs = self._bs
        written = []  # block each row writes (-1: a new block), before copy-on-write
        n_grow = 0
        shared = None  # block -> number of writers in this batch, for shared written blocks
        for r in rows:
            if swapped[r]:
                return None
            j = ntok[r] // bs
            if j == nblk[r]:
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
        if shared is not None and len(rows) == 1:
            cows = [0]  # one writer of a block held by others: it copies
        elif shared is not None:
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
        for i in cows:  # copy-on-write destinations first, in batch order
            r, src = rows[i], written[i]
            dst = take()
            table[r, ntok[r] // bs] = dst
            if cache is not None:
                cache.tok[dst] = cache.tok[src]
            ref[src] -= 1
            written[i] = dst
            pairs.append((src, dst))
        if pairs:
            self._cow_copies += len(pairs)
        if n_grow:
            need = max([nblk[r] for r in rows]) + 1
            if need > self._table.shape[1]:
                self._ensure_cols(need)
                table = self._views()[2]  # (_ensure_cols dropped the old views)
            for i, r in enumerate(rows):
                if written[i] < 0:
                    j = ntok[r] // bs
                    written[i] = b = take()
                    table[r, j] = b
                    nblk[r] = j + 1
        slots = []
        if cache is None:
            for r, w in zip(rows, written):
                n = ntok[r]
                slots.append(w * bs + n % bs)
                ntok[r] = n + 1
        else:
            tok = cache.tok
            for r, w, t in zip(rows, written, toks):
                n = ntok[r]
                off = n % bs
                slots.append(w * bs + off)
                ntok[r] = n + 1
                tok[w, off] = t
                pend[r] = nreg[r]  # this call confirms the row's earlier KV
                if off == bs - 1:  # the block is full: cache it now (burst sharing)
                    self._register(r)
        return rows, slots, pairs

    def _small_result(self, rows: list, slots: list, pairs: list) -> StepResult:
        """The StepResult of a small step: slot mapping, padded block tables, lengths, copy-on-write pairs."""
        nblk, ntok = self._nblk, self._ntok
        if len(rows) == 1:
            r = rows[0]
            tables = self._table[r : r + 1, : nblk[r]].copy()
            lens = np.array([ntok[r]], dtype=np.int32)
        else:
            ra = np.array(rows)
            tables = self._table.take(ra, axis=0)[:, : nblk[ra].max()]
            lens = ntok[ra].astype(np.int32)
        cow = np.array(pairs, dtype=np.int64) if pairs else _NO_COW
        return StepResult(np.array(slots, dtype=np.int64), tables, lens, cow)

    def _fork_row(self, prow: int, crow: int) -> None:
        """Copy row ``prow`` into the new row ``crow`` and add the child's references (element by element up to
        ``SMALL_TABLE`` blocks, vectorised beyond)."""
        ntok, nblk, table, swapped, ref, nreg, pend, nrel, ccid, ckey = self._views()
        for mv in (ntok, nblk, nrel, nreg, swapped, ccid, ckey):
            mv[crow] = mv[prow]
        pend[prow] = pend[crow] = nreg[prow]  # the parent's KV is written (it is forked)
        self._ns_of[crow] = self._ns_of[prow]
        nb, a = nblk[prow], nrel[prow]
        self._table[crow, :nb] = self._table[prow, :nb]
        if swapped[prow]:
            self._cpu._ref[self._table[prow, a:nb]] += 1
        elif nb - a <= SMALL_TABLE:
            for c in range(a, nb):
                ref[table[prow, c]] += 1
        else:
            self._gpu._ref[self._table[prow, a:nb]] += 1

    def _release_row(self, row: int) -> None:
        """Release the GPU blocks of a row, tail first (as :meth:`_release_gpu`), element by element up to
        ``SMALL_TABLE`` blocks."""
        ntok, nblk, table, swapped, ref = self._views()[:5]
        a, z = self._nrel[row], nblk[row]
        if z - a > SMALL_TABLE:
            self._release_gpu(self._table[row, a:z][::-1].copy())
            return
        cache, pool = self._cache, self._gpu
        cid = cache._cid_mv if cache is not None else None
        for c in range(z - 1, a - 1, -1):
            b = table[row, c]
            n = ref[b] - 1
            ref[b] = n
            if n == 0:
                if cid is not None and cid[b]:
                    cache.evictor.push(b)
                else:
                    pool.give_one(b)

    def _take_one(self) -> int:
        """One GPU block with refcount 1: the oldest free block, else the LRU cached one (evicted)."""
        pool = self._gpu
        if pool._nfree:
            return pool.take_one()
        b = self._cache.evict()
        pool._ref[b] = 1
        return b
