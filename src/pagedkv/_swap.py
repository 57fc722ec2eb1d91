"""Swapping sequences between the GPU and CPU pools (preemption by swap).

A block shared by several swapped sequences moves once; with prefix caching a block keeps its content identity
on the CPU side (``_cpu_tok``, ``_cpu_id``) so that on the way back a block still cached on the GPU is reused
instead of copied, and one that is not is re-adopted under its old identity.
"""

from __future__ import annotations

import numpy as np

from .errors import OutOfBlocksError, SequenceStateError


_U64 = 2**64 - 1  # keys are stored as int64 bit patterns on the CPU side


class _Swapper:
    """Mixin of :class:`pagedkv.BlockManager`: swap_out / swap_in internals."""

    def _swap_out(self, seq_ids: list) -> list[tuple[int, int]]:
        seq_ids = list(seq_ids)
        rows = self._rows_where(seq_ids, swapped=False)
        self._refuse_pending_swap_out(seq_ids, rows)
        uniq = self._unique_blocks(rows)
        if uniq.size > self.num_free_cpu_blocks:
            raise OutOfBlocksError(f"swap_out needs {uniq.size} CPU blocks; {self.num_free_cpu_blocks} are free")
        if uniq.size > self._cpu._nfree:  # swapped sequences come first: evict CPU-tier blocks, LRU first
            self._tier.evict(uniq.size - self._cpu._nfree)
        if self._cache is not None:
            self._pend[rows] = self._nreg[rows]  # their KV is written (the engine copies it out)
        cpu_ids = self._cpu.take(uniq.size)
        self._cpu._ref[cpu_ids] = 0  # _remap adds one reference per holder
        self._remap(rows, uniq, cpu_ids, self._gpu._ref, self._cpu._ref)
        if self._cache is not None:
            cache = self._cache
            self._cpu_tok[cpu_ids] = cache.tok[uniq]
            ident = self._cpu_id
            ident[0, cpu_ids] = cache.cid[uniq]
            ident[1, cpu_ids] = cache.key[uniq].view(np.int64)
            ident[2, cpu_ids] = cache.pcid[uniq]
            if cache.pkey is not None:  # KV events: parent key and namespace travel too
                ident[3, cpu_ids] = cache.pkey[uniq].view(np.int64)
                ident[4, cpu_ids] = cache.nsid[uniq]
        self._swapped[rows] = True
        rev = uniq[::-1]  # tail blocks appear last: release them first
        self._park_gpu(rev[self._gpu._ref[rev] == 0])
        self._swapped_out += uniq.size
        self._memo_ids = None
        src, dst = uniq.tolist(), cpu_ids.tolist()
        if src:
            self._copies.append((0, src, dst))  # SWAP_OUT
        return list(zip(src, dst))

    def _swap_in(self, seq_ids: list) -> list[tuple[int, int]]:
        seq_ids = list(seq_ids)
        rows = self._rows_where(seq_ids, swapped=True)
        uniq = self._unique_blocks(rows)
        reuse = self._swap_in_reuse(uniq)
        ref = self._gpu._ref
        copy_mask = reuse < 0
        n_copy = int(copy_mask.sum())
        # distinct: two CPU blocks (swapped out separately) may both come back to the same cached GPU block
        from_evictor = {g for g in reuse.tolist() if g >= 0 and ref[g] == 0}
        if n_copy + len(from_evictor) > self.num_free_gpu_blocks:
            raise OutOfBlocksError(
                f"swap_in needs {n_copy + len(from_evictor)} GPU blocks; {self.num_free_gpu_blocks} are free"
            )
        if from_evictor:
            evictor = self._cache.evictor
            for g in from_evictor:
                evictor.discard(g)
        if self._tier is not None and self._stepping:
            cache, reused = self._cache, reuse[~copy_mask]
            if reused.size and (cache.fresh[reused] == cache.fresh_serial).any():
                # a block cached in this step is reused: its KV may be this step's forward's to write
                self._ntok0[rows] = -1
        gpu_ids = reuse.copy()
        new = self._take(n_copy)
        ref[new] = 0  # _remap adds one reference per holder
        gpu_ids[copy_mask] = new
        self._remap(rows, uniq, gpu_ids, self._cpu._ref, ref)
        if self._cache is not None:
            cache = self._cache
            c_new, g_new = uniq[copy_mask], gpu_ids[copy_mask]
            cache.tok[g_new] = self._cpu_tok[c_new]
            ident = self._cpu_id
            was_cached = ident[0, c_new] != 0
            for c, g in zip(c_new[was_cached].tolist(), g_new[was_cached].tolist()):
                ns = cache._ns_list[int(ident[4, c])] if cache.events is not None else None
                cache.adopt(g, int(ident[0, c]), int(ident[1, c]) & _U64, int(ident[2, c]), int(ident[3, c]) & _U64,
                            ns)
        self._swapped[rows] = False
        freed = uniq[self._cpu._ref[uniq] == 0]
        if self._cpu_id is not None:
            self._cpu_id[0, freed] = 0
        self._cpu.give(freed)
        self._swapped_in += uniq.size
        self._memo_ids = None
        src, dst = uniq[copy_mask].tolist(), gpu_ids[copy_mask].tolist()
        if src:
            self._copies.append((1, src, dst))  # SWAP_IN
        return list(zip(src, dst))

    def _refuse_pending_swap_out(self, seq_ids: list, rows: np.ndarray) -> None:
        """SequenceStateError if one of the rows was handed slots in this step (after a take_copy_plan): its KV is
        written only by the step's forward, after every copy, so a swap-out copy would read nothing. O(len(rows))."""
        if self._stepping:
            pending = np.flatnonzero(self._ntok[rows] != self._ntok0[rows])
            if pending.size:
                raise SequenceStateError(
                    f"swap_out: sequence {seq_ids[int(pending[0])]!r} was handed slots in this step, whose KV only "
                    "the step's forward writes (after every copy): swap it out in a later step, or free it with "
                    "cache=False (an abort)")

    def _unique_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Distinct non-null blocks of the rows, in order of first appearance (int64)."""
        parts = [self._table[r, self._nrel[r] : self._nblk[r]] for r in rows.tolist()]
        allb = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        allb = allb[allb >= 0]
        _, first = np.unique(allb, return_index=True)
        return allb[np.sort(first)].astype(np.int64)

    def _remap(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, src_ref: np.ndarray, dst_ref: np.ndarray) -> None:
        """Rewrite the rows' tables from ``src`` ids to ``dst`` ids; move one reference per holder."""
        order = np.argsort(src)
        s_sorted, d_sorted = src[order], dst[order]
        for r in rows.tolist():
            a, z = int(self._nrel[r]), int(self._nblk[r])
            t = self._table[r, a:z]
            live = t >= 0
            old = t[live].astype(np.int64)
            new = d_sorted[np.searchsorted(s_sorted, old)]
            t[live] = new
            src_ref[old] -= 1
            dst_ref[new] += 1

    def _swap_in_reuse(self, cpu_blocks: np.ndarray) -> np.ndarray:
        """For each CPU block: the GPU block still caching the same content (reuse instead of copy), or -1."""
        reuse = np.full(cpu_blocks.size, -1, dtype=np.int64)
        if self._cache is None:
            return reuse
        ident = self._cpu_id
        for i, c in enumerate(cpu_blocks.tolist()):
            if ident[0, c]:
                reuse[i] = self._cache.lookup(int(ident[0, c]), int(ident[1, c]) & _U64)
        return reuse

