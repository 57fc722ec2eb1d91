"""Swapping sequences between the GPU and CPU pools (preemption by swap): :class:`Swapper`, a part of the manager.

A block shared by several swapped sequences moves once; with prefix caching a block keeps its content identity
on the CPU side (``cpu_tok``, ``cpu_id``) so that on the way back a block still cached on the GPU is reused
instead of copied, and one that is not is re-adopted under its old identity.
"""

from __future__ import annotations

import numpy as np

from ..errors import OutOfBlocksError, SequenceStateError


_U64 = 2**64 - 1  # keys are stored as int64 bit patterns on the CPU side


class Swapper:
    """swap_out / swap_in of one manager's sequences: rewrites the tables ``t``
    (:class:`~pagedkv.manager._rows.SeqTables`) between the GPU and CPU pools of ``blocks``
    (:class:`~pagedkv.blocks._blocks.Blocks`), carrying the blocks' cache identity (``cpu_tok``, ``cpu_id``) with
    prefix caching, and records the copies in the pending copy list. Counts the blocks moved (``swapped_out``,
    ``swapped_in``). ``by_key``: the manager is a sliding group of a HybridBlockManager, whose hits check a
    window's blocks by chained key and tokens (see :meth:`copy_taken`; set by the hybrid manager)."""

    def __init__(self, t, blocks, cache, tier, cpu_tok, cpu_id, copies: list) -> None:
        self.t, self.blocks, self.cache, self.tier = t, blocks, cache, tier
        self.by_key = False
        self.gpu, self.cpu = blocks.gpu, blocks.cpu
        self.cpu_tok, self.cpu_id, self.copies = cpu_tok, cpu_id, copies
        self.swapped_out = self.swapped_in = 0

    def swap_out(self, seq_ids: list) -> list[tuple[int, int]]:
        seq_ids = list(seq_ids)
        rows = self.t.rows_where(seq_ids, swapped=False)
        self.refuse_pending(seq_ids, rows)
        uniq = self.t.unique_blocks(rows)
        if uniq.size > self.blocks.num_free_cpu:
            raise OutOfBlocksError(f"swap_out needs {uniq.size} CPU blocks; {self.blocks.num_free_cpu} are free")
        if uniq.size > self.cpu.nfree:  # swapped sequences come first: evict CPU-tier blocks, LRU first
            self.tier.evict(uniq.size - self.cpu.nfree)
        if self.cache is not None:
            self.t.pend[rows] = self.t.nreg[rows]  # their KV is written (the engine copies it out)
        cpu_ids = self.cpu.take(uniq.size)
        self.cpu.ref[cpu_ids] = 0  # _remap adds one reference per holder
        self.remap(rows, uniq, cpu_ids, self.gpu.ref, self.cpu.ref)
        if self.cache is not None:
            cache = self.cache
            self.cpu_tok[cpu_ids] = cache.tok[uniq]
            ident = self.cpu_id
            ident[0, cpu_ids] = cache.cid[uniq]
            ident[1, cpu_ids] = cache.key[uniq].view(np.int64)
            ident[2, cpu_ids] = cache.pcid[uniq]
            if cache.pkey is not None:  # KV events: parent key and namespace travel too
                ident[3, cpu_ids] = cache.pkey[uniq].view(np.int64)
                ident[4, cpu_ids] = cache.nsid[uniq]
            if cache.has_copies:  # a recorded copy carries the content it copies (same tokens, same parent)
                cp = np.flatnonzero((ident[0, cpu_ids] == 0) & (cache.dupc[uniq] != 0))
                if cp.size:
                    ident[0, cpu_ids[cp]] = cache.dupc[uniq[cp]]
        self.t.swapped[rows] = True
        rev = uniq[::-1]  # tail blocks appear last: release them first
        self.blocks.park(rev[self.gpu.ref[rev] == 0])
        self.swapped_out += uniq.size
        self.t.memo_ids = None
        src, dst = uniq.tolist(), cpu_ids.tolist()
        if src:
            self.copies.append((0, src, dst))  # SWAP_OUT
        return list(zip(src, dst))

    def swap_in(self, seq_ids: list) -> list[tuple[int, int]]:
        seq_ids = list(seq_ids)
        rows = self.t.rows_where(seq_ids, swapped=True)
        uniq = self.t.unique_blocks(rows)
        reuse = self.reuse(uniq, rows)
        ref = self.gpu.ref
        copy_mask = reuse < 0
        n_copy = int(copy_mask.sum())
        # distinct: two CPU blocks (swapped out separately) may both come back to the same cached GPU block
        from_evictor = {g for g in reuse.tolist() if g >= 0 and ref[g] == 0}
        if n_copy + len(from_evictor) > self.blocks.num_free:
            raise OutOfBlocksError(
                f"swap_in needs {n_copy + len(from_evictor)} GPU blocks; {self.blocks.num_free} are free"
            )
        if from_evictor:
            evictor = self.cache.evictor
            for g in from_evictor:
                evictor.discard(g)
        if self.t.stepping:
            cache, reused = self.cache, reuse[~copy_mask]
            # a block cached in this step is reused: its KV may be this step's forward's to write, so the rows are
            # marked handed slots in this step (a swap_out of them is refused until the next step). Each GPU
            # block says in which step it was cached (``fresh``: kept with a CPU pool, see BlockManager)
            if reused.size and (cache.fresh[reused] == cache.fresh_serial).any():
                self.t.ntok0[rows] = -1
        gpu_ids = reuse.copy()
        new = self.blocks.take(n_copy)
        ref[new] = 0  # _remap adds one reference per holder
        gpu_ids[copy_mask] = new
        self.remap(rows, uniq, gpu_ids, self.cpu.ref, ref)
        if self.cache is not None:
            cache = self.cache
            c_new, g_new = uniq[copy_mask], gpu_ids[copy_mask]
            cache.tok[g_new] = self.cpu_tok[c_new]
            ident = self.cpu_id
            was_cached = ident[0, c_new] != 0
            # a content shared under another content id (cached again while this one was out): what chains
            # after it chains after that id
            c_re, g_re = uniq[~copy_mask], reuse[~copy_mask]
            moved = (ident[0, c_re] != cache.cid[g_re]) & (ident[0, c_re] != 0)
            renamed = dict(zip(ident[0, c_re[moved]].tolist(), cache.cid[g_re[moved]].tolist())) if moved.any() \
                else {}
            taken = []
            for c, g in zip(c_new[was_cached].tolist(), g_new[was_cached].tolist()):
                ns = cache.ns_list[int(ident[4, c])] if cache.events is not None else None
                pcid = int(ident[2, c])
                pcid = renamed.get(pcid, pcid)
                if not cache.adopt(g, int(ident[0, c]), int(ident[1, c]) & _U64, pcid, int(ident[3, c]) & _U64, ns):
                    taken.append((g, int(ident[1, c]) & _U64, pcid))
            if taken:
                self.copy_taken(taken)
            self.rechain(rows)
        self.t.swapped[rows] = False
        freed = uniq[self.cpu.ref[uniq] == 0]
        if self.cpu_id is not None:
            self.cpu_id[0, freed] = 0
        self.cpu.give(freed)
        self.swapped_in += uniq.size
        self.t.memo_ids = None
        src, dst = uniq[copy_mask].tolist(), gpu_ids[copy_mask].tolist()
        if src:
            self.copies.append((1, src, dst))  # SWAP_IN
        return list(zip(src, dst))

    def copy_taken(self, taken: list) -> None:
        """Swapped-in blocks whose key another block took while they were out (``(block, key, parent cid)``): where
        that block caches the same tokens after the same parent, the held block is recorded as its copy (it takes
        the content's identity if that block is evicted first), as registering it would
        (:meth:`PrefixCache.register`). In a hybrid manager's sliding group the parent may be another content id (the
        prefix was evicted and cached again): its hits check a window's blocks by their chained key, which covers
        every earlier token, and tokens, never by parent, and a row with released blocks is not registered again
        from the root (:meth:`rechain`: its released positions' blocks are gone), so this is what keeps its window
        findable. (A windowed BlockManager's hits walk the chain from block 0 by content id: there a hash collision
        must stay a miss, so the parent must match.) O(1) a block."""
        cache = self.cache
        mp, tok = cache.map, cache.tok
        for g, key, pcid in taken:
            o = mp.get(key)
            if o is not None and (self.by_key or cache.pcid[o] == pcid) and np.array_equal(tok[o], tok[g]):
                cache.note_copy(g, int(cache.cid[o]), key, int(cache.pcid[o]))
                if cache.events is not None:
                    cache.pkey[g], cache.nsid[g] = cache.pkey[o], cache.nsid[o]

    def rechain(self, rows: np.ndarray) -> None:
        """A swapped-in row with a registered block that came back uncached (a copy's CPU block carries no identity
        to adopt; a block whose key another block took meanwhile), or whose chain ends in a content that left the
        cache while it was out (evicted, perhaps cached again under new content ids), would hold content nobody
        finds once the other holders go, and chain what it registers next to a gone content. Its full blocks are
        registered again from the root instead, as a prompt's are: each is found cached (its own identity, or it
        becomes a recorded copy of the content cached elsewhere) or is cached anew (a ``BlockStored`` event), and
        the chain continues from there. Their KV is the swap-in's copy, executed before the step's forward. A row
        with released (windowed) blocks cannot be registered from the root (the keys of its released positions are
        not kept); its blocks came back under their own identity (a recorded copy carries the content it copies
        through the CPU side) or as copies of the content cached again (:meth:`copy_taken`), and its chain goes on
        from its last block's content. O(registered blocks) per swapped-in row."""
        cache, t = self.cache, self.t
        if cache.ndl:
            cache.flush()
        for r in rows.tolist():
            c = int(t.ccid[r])
            if not c:
                continue
            if t.nrel[r]:  # (the chain goes on from its last block's content: its own, or the one it copies)
                e = int(t.nreg[r]) - 1
                if e >= t.nrel[r]:
                    b = int(t.table[r, e])
                    if not cache.cid[b] and cache.dupc[b] and cache.key[b] == t.ckey[r]:
                        t.ccid[r] = cache.dupc[b]
                continue
            blocks = t.table[r, : t.nreg[r]]
            if cache.cid[blocks].all() and cache.live_parent(c, int(t.ckey[r])):
                continue
            ns = t.ns_of[r]
            pcid, pkey = cache.root(ns, intern=True)
            for b in blocks.tolist():
                pcid, pkey = cache.register(b, pcid, pkey, ns)
                if not pcid:
                    break
            t.ccid[r], t.ckey[r] = pcid, pkey

    def refuse_pending(self, seq_ids: list, rows: np.ndarray) -> None:
        """SequenceStateError if one of the rows was handed slots in this step (after a take_copy_plan): its KV is
        written only by the step's forward, after every copy, so a swap-out copy would read nothing. O(len(rows))."""
        if self.t.stepping:
            pending = np.flatnonzero(self.t.ntok[rows] != self.t.ntok0[rows])
            if pending.size:
                raise SequenceStateError(
                    f"swap_out: sequence {seq_ids[int(pending[0])]!r} was handed slots in this step, whose KV only "
                    "the step's forward writes (after every copy): swap it out in a later step, or free it with "
                    "cache=False (an abort)")

    def remap(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, src_ref: np.ndarray, dst_ref: np.ndarray) -> None:
        """Rewrite the rows' tables from ``src`` ids to ``dst`` ids; move one reference per holder."""
        order = np.argsort(src)
        s_sorted, d_sorted = src[order], dst[order]
        for r in rows.tolist():
            a, z = int(self.t.nrel[r]), int(self.t.nblk[r])
            t = self.t.table[r, a:z]
            live = t >= 0
            old = t[live].astype(np.int64)
            new = d_sorted[np.searchsorted(s_sorted, old)]
            t[live] = new
            src_ref[old] -= 1
            dst_ref[new] += 1

    def reuse(self, cpu_blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """For each CPU block (``unique_blocks(rows)``): the GPU block caching the same content (reuse instead of
        copy), or -1. First by the block's own content id; then, for a row with no released blocks, by walking its
        registered blocks from the root as a prompt's lookup does (key, tokens and parent content): a content
        another sequence cached again while this one was out (under new content ids) is shared, not copied.
        O(distinct blocks) plus O(registered blocks) per row with a block not found by its content id."""
        reuse = np.full(cpu_blocks.size, -1, dtype=np.int64)
        cache = self.cache
        if cache is None:
            return reuse
        ident = self.cpu_id
        for i, c in enumerate(cpu_blocks.tolist()):
            if ident[0, c]:
                reuse[i] = cache.lookup(int(ident[0, c]), int(ident[1, c]) & _U64)
        if (reuse >= 0).all():
            return reuse
        t, tok = self.t, self.cpu_tok
        index = {c: i for i, c in enumerate(cpu_blocks.tolist())}
        for r in rows.tolist():
            if t.nrel[r] or not t.nreg[r]:
                continue
            pcid, pkey = cache.root(t.ns_of[r], intern=False)
            for c in t.table[r, : t.nreg[r]].tolist():
                if c < 0:  # (a position this group's row never held)
                    break
                i = index[c]
                g = int(reuse[i])
                if g < 0:
                    g, _ = cache.find(pcid, pkey, tok[c].tobytes())
                    if g < 0:
                        break
                    reuse[i] = g
                pcid, pkey = int(cache.cid[g]), int(cache.key[g])
        return reuse

