"""Prefix-cache registration, lookup and withdrawal for the block manager's sequences.

A row's chain state is ``_nreg`` (leading blocks offered to the cache), ``_ccid``/``_ckey`` (content id and key of
block ``_nreg - 1``, a namespace root's before block 0; ``_ccid == 0``: chain broken, nothing more is cached) and
``_pend`` (blocks ``_pend .. _nreg - 1`` were cached by the row's last call, whose KV the engine may not have
written yet)::

    table   [ 17 | 3 | 42 | 8 | 11 ]      ntok = 4.5 blocks
              hit  hit  new  new  partial
                        ^_pend     ^_nreg   (after allocate: 42 and 8 are cached, pending until the next call)

Burst sharing: every call that makes a block full of known tokens registers it before returning, so
``_nreg == ntok // block_size`` after every call (lookahead slots are never part of ``ntok``).
"""

from __future__ import annotations

import numpy as np

from .errors import SequenceStateError


class _Registry:
    """Mixin of :class:`pagedkv.BlockManager`: registering full blocks, looking prompts up, withdrawing."""

    def _register(self, row: int) -> None:
        """Offer the row's full blocks (``nreg .. ntok // bs - 1``) to the prefix cache, one after the other
        (each key chains from the previous one). O(1) per block."""
        full = int(self._ntok[row]) // self._bs
        j = int(self._nreg[row])
        if full <= j:
            return
        pcid, pkey = int(self._ccid[row]), int(self._ckey[row])
        cache, ns = self._cache, self._ns_of[row]
        register, cid = cache.register, cache.cid
        events = cache.events is not None
        run: list[tuple[int, int]] = []  # (block, key) of newly cached consecutive blocks: one event per run
        start = (pcid, pkey)
        for b in self._table[row, j:full].tolist():
            if pcid == 0:
                break
            if b < 0:  # released by the window before it could be cached
                pcid = pkey = 0
                break
            if not events:
                pcid, pkey = register(b, pcid, pkey)
                continue
            was_cached = cid[b]
            prev = (pcid, pkey)
            pcid, pkey = register(b, pcid, pkey, ns, emit=False)
            if pcid and not was_cached and cid[b] == pcid:
                if not run:
                    start = prev
                run.append((b, pkey))
            elif run:
                self._stored_run(run, start, ns)
                run = []
        if run:
            self._stored_run(run, start, ns)
        self._ccid[row], self._ckey[row] = pcid, pkey
        self._nreg[row] = full

    def _stored_run(self, run: list, parent: tuple[int, int], ns: object) -> None:
        self._cache._stored([b for b, _ in run], [k for _, k in run], parent[0], parent[1], ns)

    def _register_rows(self, rows: np.ndarray, j: np.ndarray, full: np.ndarray) -> None:
        """:meth:`_register` for a batch of rows whose ``_nreg`` is ``j`` and whose full blocks number ``full``
        (``full > j``): one :meth:`PrefixCache.register_chains` call, or row by row when that declines."""
        if rows.size <= 3:  # below this the batch call's fixed cost (~6 us) exceeds block-by-block (~1.5 us each)
            for row in rows.tolist():
                self._register(row)
            return
        self._register_rows_batch(rows, j, full)

    def _fill_prompt(self, row: int, arr: np.ndarray, new: np.ndarray, nhit: int) -> None:
        """Write a new prompt's tokens into its new blocks and register its full blocks (burst sharing)."""
        bs, n = self._bs, arr.size
        h = nhit * bs  # the hit blocks already hold the tokens before h
        k = (n - h) // bs
        tok = self._cache.tok
        tok[new[:k]] = arr[h : h + k * bs].reshape(k, bs)
        if h + k * bs < n:
            tok[new[k], : n - h - k * bs] = arr[h + k * bs :]
        if k >= 4:  # one chain of k blocks in one batch call
            r = np.array([row], dtype=np.int64)
            self._register_rows_batch(r, np.array([nhit], np.int64), np.array([nhit + k], np.int64))
        elif k:
            self._register(row)

    def _register_rows_batch(self, rows: np.ndarray, j: np.ndarray, full: np.ndarray) -> None:
        """:meth:`_register_rows` without its small-batch cut-off: one batch call, or row by row if it declines."""
        counts = full - j
        if np.count_nonzero(counts - 1):  # some row has several new full blocks (a prompt, a k-token append)
            cr = np.repeat(rows, counts)
            cols = np.repeat(j - np.cumsum(counts) + counts, counts) + np.arange(cr.size)
            blocks = self._table[cr, cols]
        else:
            blocks = self._table[rows, j]
        nss = [self._ns_of[r] for r in rows.tolist()] if self._kv_events else None
        got = self._cache.register_chains(blocks, counts, self._ccid[rows], self._ckey[rows], nss)
        if got is None:
            for row in rows.tolist():
                self._register(row)
            return
        self._ccid[rows], self._ckey[rows] = got
        self._nreg[rows] = full

    def _withdraw_pending(self, seq_id, row: int) -> None:
        """``free(seq_id, cache=False)``: uncache the blocks the row's last call filled (its own blocks in
        ``_pend .. _nreg - 1``; those still cached were cached by it), and every cached block chained after them
        in either tier (a lookup reaches them only through the withdrawn content). Raises SequenceStateError,
        changing nothing, if another sequence holds one of the row's own blocks (a prefix hit: it relies on KV
        nobody wrote). A sequence that holds only a *descendant* is not refused: it wrote the KV of that position
        itself and registration chained it to the equal content already cached (deduplication), so its blocks
        stay, uncached, and its chain is broken (``_ccid = 0``), like the chain of every row that ends in
        withdrawn content. O(cached blocks + rows) when there is one to withdraw."""
        a, z = int(self._pend[row]), int(self._nreg[row])
        if z <= a:
            return
        blocks = self._table[row, a:z]
        blocks = blocks[blocks >= 0]
        cache = self._cache
        # another holder of one of these blocks got it as a prefix hit (forks confirm, writes copy on write),
        # cached or not by now (reset_prefix_cache may have uncached it since)
        shared = blocks[self._gpu._ref[blocks] > 1].tolist()
        if shared:
            holders = [s for s, r in self._row_of.items() if r != row and not self._swapped[r]
                       and np.isin(self._table[r, self._nrel[r] : self._nblk[r]], shared).any()]
            raise SequenceStateError(
                f"free({seq_id!r}, cache=False): sequences {holders!r} hold blocks whose KV {seq_id!r} never "
                "wrote (prefix hits in the same step); free them first, or run the step and free with cache=True"
            )
        own = blocks[cache.cid[blocks] > 0]
        gpu_kids, cpu_kids = self._descendants(own)
        dead = np.concatenate((cache.cid[own], cache.cid[gpu_kids], self._cpu_id[0, cpu_kids])).astype(np.int64)
        cache.withdraw(own.tolist())
        if gpu_kids.size:
            idle = gpu_kids[self._gpu._ref[gpu_kids] == 0]  # unreferenced: they wait in the evictor
            cache.evictor.discard_many(idle)
            cache.withdraw(gpu_kids.tolist())  # held ones stay with their sequences, uncached
            self._gpu.give(idle.astype(np.int32))
        if cpu_kids.size:
            self._tier.withdraw(cpu_kids)
        if dead.size:  # rows whose chain ends in withdrawn content cache nothing more (it would be unreachable)
            self._ccid[np.isin(self._ccid, dead[dead > 0])] = 0

    def _descendants(self, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cached GPU blocks (other than ``roots``) and CPU-tier blocks whose chain passes through the content of
        one of the cached GPU blocks ``roots``. O(cached blocks) per generation of descendants."""
        none = np.zeros(0, dtype=np.int64)
        if not roots.size:
            return none, none
        cache = self._cache
        frontier = cache.cid[roots]
        gpu = np.flatnonzero(cache.cid)
        gpu = gpu[~np.isin(gpu, roots)]
        tier = self._tier
        cpu = np.fromiter(tier._map.values(), dtype=np.int64, count=len(tier._map)) if tier is not None else none
        found_g, found_c = [], []
        while frontier.size:
            kg = np.isin(cache.pcid[gpu], frontier)
            kc = np.isin(self._cpu_id[2, cpu], frontier) if cpu.size else np.zeros(0, dtype=bool)
            if not kg.any() and not kc.any():
                break
            found_g.append(gpu[kg])
            found_c.append(cpu[kc])
            frontier = np.concatenate((cache.cid[gpu[kg]], self._cpu_id[0, cpu[kc]]))
            gpu, cpu = gpu[~kg], cpu[~kc]
        return (np.concatenate(found_g).astype(np.int64) if found_g else none,
                np.concatenate(found_c).astype(np.int64) if found_c else none)

    def _lookup(self, arr: np.ndarray, root: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
        """Cached blocks matching the prompt's leading full blocks (at most (len - 1) // block_size, so at least
        one token is left to compute), and the (cid, key) of the last hit (the root's if none). With the CPU tier
        a block missing on the GPU may be found there: it is listed as ``~cpu_block`` (negative). O(hit blocks)."""
        bs = self._bs
        data = arr.tobytes()
        step = 4 * bs
        cache = self._cache
        find, cid = cache.find, cache.cid
        hits: list[int] = []
        pcid, pkey = root
        tier = self._tier
        for j in range((arr.size - 1) // bs):
            d = data[j * step : (j + 1) * step]
            b, key = find(pcid, pkey, d)
            if b < 0:
                if tier is None:
                    break
                c = tier.find_keyed(pcid, key, d)  # the prefix continues in the CPU tier?
                if c < 0:
                    break
                hits.append(~c)
                pcid, pkey = int(self._cpu_id[0, c]), key
                continue
            hits.append(b)
            pcid, pkey = int(cid[b]), key
        return hits, (pcid, pkey)

    def _promote(self, hits: list, cpu_hits: list, taken) -> tuple[list, list]:
        """Give each CPU-tier hit the next of the ``taken`` GPU blocks: the block adopts the CPU block's content
        (tokens and identity, so chains continue) and a CPU -> GPU copy is recorded. Returns the prompt's hit
        blocks in table order and the taken blocks left for the rest of the prompt. Vectorised over the hits."""
        taken = taken.tolist() if isinstance(taken, np.ndarray) else taken
        cache, tier, k = self._cache, self._tier, len(cpu_hits)
        cs = [c for _, c in cpu_hits]
        gs = taken[:k]
        ca, ga = np.array(cs, dtype=np.int64), np.array(gs, dtype=np.int64)
        ident = self._cpu_id[:, ca]
        cache.tok[ga] = self._cpu_tok[ca]
        cache.adopt_many(ga, ident[0], ident[1].view(np.uint64), ident[2], ident[3].view(np.uint64), ident[4])
        tier.promote_many(cs, gs)
        out = list(hits)
        for (j, _), g in zip(cpu_hits, gs):
            out.insert(j, g)
        return out, taken[k:]
