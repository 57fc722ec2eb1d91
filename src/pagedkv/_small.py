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

SMALL_BATCH = 16
"""Batches of at most this many sequences take the plain-Python step (the measured crossover: see README)."""
SMALL_TABLE = 16
"""Tables of at most this many blocks are forked and released element by element."""

_TOKEN_MAX = 2**31 - 1
_NO_COW = np.zeros((0, 2), dtype=np.int64)
_NO_COW.flags.writeable = False
_NULLS = memoryview(np.full(64, -1, dtype=np.int32))  # NULL_BLOCK x SMALL_TABLE (and more), to clear a row


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
                               memoryview(self._ckey), memoryview(self._table.reshape(-1)), self._table.shape[1])
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
        lens = []
        if cache is None:
            for r, w in zip(rows, written):
                n = ntok[r]
                slots.append(w * bs + n % bs)
                ntok[r] = n = n + 1
                lens.append(n)
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
        return rows, slots, pairs, lens

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

    def _small_result(self, rows: list, slots: list, pairs: list, lens: list) -> StepResult:
        """The StepResult of a small step: slot mapping, padded block tables, lengths, copy-on-write pairs."""
        nblk = self._mvs[1]
        if len(rows) == 1:
            r = rows[0]
            tables = self._table[r : r + 1, : self._fixed_w or nblk[r]].copy()
        else:  # (take: cheapest for a few rows)
            tables = self._table.take(rows, axis=0)[:, : self._fixed_w or max([nblk[r] for r in rows])]
        cow = np.array(pairs, dtype=np.int64) if pairs else _NO_COW
        return StepResult(np.array(slots, dtype=np.int64), tables, np.array(lens, dtype=np.int32), cow)

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
