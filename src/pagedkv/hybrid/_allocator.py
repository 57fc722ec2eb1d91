"""Allocation in every KV cache group of :class:`pagedkv.HybridBlockManager` (internal): :class:`HybridAllocator`.

An allocation is planned for every group, checked as a whole, then committed, so that it completes in every
group or changes nothing::

    plan     the hybrid hit (module docstring of pagedkv.hybrid): vectorised over blocks and groups
             (pagedkv.hybrid._hit.find_hit; no CPU tier, four full blocks or more) or block by block
             (plan_walk), with the same result; the blocks every group consumes   -> _Plan (nothing changed)
    hold     every GPU hit of every group referenced, every CPU-tier hit pinned, before any group takes a block
             (no group evicts another's hit)
    commit   the sequence's row in every group: one pass over every group (pagedkv.hybrid._hit.commit_all) or
             each group's Allocator.commit; the sibling keys recorded; the retention policy told the prompt
    unhold   (a batch) the extra references of its hold dropped

A batch plans every prompt, admits the sum, holds every hit planned, then replans each later prompt (burst
hits on the batch's earlier prompts) before committing it.

Cost: O(prompt blocks x groups) per allocation (see pagedkv.hybrid._hit for the vectorised path's).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Hashable, NamedTuple

import numpy as np

from ._hit import HitMemo, commit_all, find_hit
from ._types import HybridPrefillBatch, frozen
from ..errors import OutOfBlocksError, PromptTooLongError, TableWidthError
from ..blocks.prefix_cache import _GroupNS, _chain, _encode_namespace, _slices
from ..types import NULL_BLOCK, AllocStatus

__all__ = ["HybridAllocator"]

_U64 = 2**64 - 1


class _Plan(NamedTuple):
    """An allocation planned for every group (nothing changed yet)."""

    arr: np.ndarray  # the whole prompt
    n: int  # tokens the sequence holds: the whole prompt, or (chunked prefill) the hit plus one chunk
    nblocks: int  # blocks of those n tokens (plus lookahead), every group
    nhit: int  # L // block_size, every group
    groups: list  # per group: (gpu hits with nnull leading NULL_BLOCKs, cpu_hits or None, chain, nnull)
    need: int  # free GPU blocks the allocation consumes, all groups
    ncpu: int  # CPU-tier hits, all groups (each a promotion)
    memo: HitMemo | None = None  # for the registration and the sibling keys
    held: np.ndarray | None = None  # every group's GPU hits (int64, distinct), when ``memo``: then each group's
    #                                 first item is an int64 array of its hits without the leading NULL_BLOCKs


class HybridAllocator:
    """allocate / allocate_batch / lookup_prefix / can_allocate over every group.

    Holds ``specs`` (the group specs), ``full`` / ``sliding`` (the indices of the full-attention and
    sliding-window groups), per group ``tables`` (:class:`~pagedkv.manager._rows.SeqTables`), ``regs``
    (:class:`~pagedkv.manager._registry.Registry`), ``allocs`` (:class:`~pagedkv.manager._alloc.Allocator`) and ``windows``
    (tokens, None for full attention); shared: ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`), ``gpu`` (the GPU
    pool), ``cache`` (:class:`~pagedkv.blocks.prefix_cache.PrefixCache` or None), ``tier`` (the CPU tier or None),
    ``cpu_tok`` / ``cpu_id`` (the CPU blocks' tokens and identities), ``retention`` (the window retention
    policy or None), ``bs``, ``watermark`` and ``fixed_w``. Owns ``ns_memo`` (namespace encoding -> its
    ``_GroupNS`` per group) and the sibling keys ``sib`` / ``sib_rows`` (:mod:`pagedkv.hybrid._hit`)."""

    def __init__(self, specs: tuple, tables: list, regs: list, allocs: list, blocks, gpu, cache, tier,
                 cpu_tok, cpu_id, retention, bs: int, watermark: int, fixed_w: int) -> None:
        self.specs = specs
        self.G = len(specs)
        self.full = [g for g, s in enumerate(specs) if s.window is None]
        self.sliding = [g for g, s in enumerate(specs) if s.window is not None]
        self.windows = [s.window for s in specs]
        self.tables, self.t0, self.regs, self.allocs = tables, tables[0], regs, allocs
        self.blocks, self.gpu, self.cache, self.tier = blocks, gpu, cache, tier
        self.cpu_tok, self.cpu_id, self.retention = cpu_tok, cpu_id, retention
        self.bs, self.watermark, self.fixed_w = bs, watermark, fixed_w
        self.ns_memo: dict = {}
        self.on_hits = None  # called with every group's GPU hit blocks of a committed prompt (selective stores)
        # sibling keys (pagedkv.hybrid._hit): per block of the first full group, the content id it held when the
        # sliding groups' keys of the same prefix were recorded, and those keys (one column per sliding group)
        self.sib = self.sib_rows = None
        if cache is not None and self.full and self.sliding:
            n = gpu.num_blocks
            self.sib = (np.zeros(n, dtype=np.int64), np.zeros((n, len(self.sliding)), dtype=np.uint64))
            a, z = self.sliding[0], self.sliding[-1] + 1
            self.sib_rows = slice(a, z) if self.sliding == list(range(a, z)) else np.array(self.sliding)

    def gns(self, namespace: object) -> tuple:
        """The namespace as each group's _GroupNS (validated; memoised per namespace)."""
        data = _encode_namespace(namespace)
        got = self.ns_memo.get(data)
        if got is None:
            if len(self.ns_memo) > 4096:
                self.ns_memo.clear()
            g = len(self.specs)
            got = self.ns_memo[data] = tuple(_GroupNS(namespace, i, s.kind, s.window, g)
                                             for i, s in enumerate(self.specs))
        return got

    # ------------------------------------------------------------------ planning (nothing changes)
    def plan(self, arr: np.ndarray, la: int, gns: tuple, check: bool = True, chunk: int | None = None) -> _Plan:
        """The allocation of prompt ``arr`` in every group, without changing anything (see the module docstring
        of pagedkv.hybrid for the hit rule). Raises PromptTooLongError / TableWidthError when ``check`` (on the
        whole prompt). ``chunk`` (chunked prefill): the hit L is found on the whole prompt, then the sequence
        holds only its first ``L + chunk`` tokens in every group (the hit rule looks only at tokens before the
        hit point, so this is also the hit of the truncated prompt). O(prompt blocks x groups)."""
        bs, n = self.bs, arr.size
        G = self.G
        nblocks = -(-(n + la) // bs)
        if check:
            avail = self.gpu.num_blocks - self.watermark
            if chunk is not None and chunk < n:  # a sliding group never holds more than its window plus a chunk
                peak = sum(nblocks if w is None else min(nblocks, -(-(w - 1 + chunk + la) // bs) + 1)
                           for w in self.windows)
            else:
                peak = G * nblocks
            if peak > avail:
                raise PromptTooLongError(
                    f"prompt of {n} tokens{f' plus {la} lookahead slots' if la else ''} needs {nblocks} blocks in "
                    f"each full-attention group, {peak} in its {G} KV cache groups at most"
                    f"{f' (in chunks of {chunk} tokens)' if chunk is not None and chunk < n else ''}; the pool has "
                    f"{self.gpu.num_blocks} with {self.watermark} kept free")
            if self.fixed_w and nblocks > self.fixed_w:
                raise TableWidthError(f"prompt of {n} tokens needs {nblocks} blocks; block_table_width is "
                                      f"{self.fixed_w}")
        cache = self.cache
        if cache is None:
            if chunk is not None and chunk < n:
                n = chunk
                nblocks = -(-(n + la) // bs)
            return _Plan(arr, n, nblocks, 0, [([], None, (0, 0), 0)] * G, G * nblocks, 0)
        roots = [cache.root(ns, intern=False) for ns in gns]
        fast = find_hit(self, arr, roots) if self.tier is None else None
        if fast is None:
            return self.plan_walk(arr, n, nblocks, la, roots, chunk)
        L, blks, keys, datas, fresh = fast
        if chunk is not None and L * bs + chunk < n:  # chunked prefill: the hit plus one chunk
            n = L * bs + chunk
            nblocks = -(-(n + la) // bs)
        if L:
            held = np.concatenate(blks)
            last = [max(x - 1, 0) for x in accumulate(b.size for b in blks)] if held.size else [0] * G
            cids, cks = (cache.cid[held[last]].tolist(), cache.key[held[last]].tolist()) if held.size else (last, last)
            # (a window of one token holds no block: its chain is not known past the hit)
            groups = [(b, None, (c, k) if b.size else (0, 0), L - b.size) for b, c, k in zip(blks, cids, cks)]
            idle = self.gpu.ref[held] == 0
            if getattr(cache.evictor, "num_parked", 0):  # pinned idle hits are not in num_free: they take none
                idle &= ~cache.evictor.parked[held]
            need = G * (nblocks - L) + int(np.count_nonzero(idle))
        else:
            held = None
            groups = [(blks[g], None, roots[g], 0) for g in range(G)]
            need = G * nblocks
        return _Plan(arr, n, nblocks, L, groups, need, 0, HitMemo(datas, keys, roots, fresh), held)

    def plan_walk(self, arr: np.ndarray, n: int, nblocks: int, la: int, roots: list, chunk: int | None) -> _Plan:
        """:meth:`plan`'s hit found block by block (with the CPU tier, and for prompts of fewer than four full
        blocks; :mod:`pagedkv.hybrid._hit` otherwise, with the same result). O(prompt blocks x groups)."""
        bs, cache = self.bs, self.cache
        h = (n - 1) // bs
        full_hits = {}
        for g in self.full:
            hits, _ = self.regs[g].lookup(arr, roots[g])
            full_hits[g] = hits
            h = min(h, len(hits))
        L = h
        present: dict = {}
        if self.sliding and L > 0:
            data = arr.tobytes()
            datas = [data[s] for s in _slices(L, 4 * bs)]
            keys = {g: _chain(iter(datas), roots[g][1]) for g in self.sliding}
            if cache.ndl:
                cache.flush()  # (the window check reads the map directly; see prefix_cache "Runs")
            cmap, ctok = cache.map, cache.tok
            tier = self.tier
            tmap = tier.map if tier is not None else None
            ctok_cpu = self.cpu_tok

            def pres(g: int, j: int):
                got = present.get((g, j), 0)
                if got != 0:
                    return got
                k, d = keys[g][j], datas[j]
                b = cmap.get(k)
                if b is not None and ctok[b].tobytes() == d:
                    got = b
                else:
                    c = tmap.get(k) if tmap else None
                    got = ~c if c is not None and ctok_cpu[c].tobytes() == d else None
                present[(g, j)] = got
                return got

            while L > 0:
                ok = True
                for g in self.sliding:
                    first = max(0, L * bs - self.specs[g].window + 1) // bs
                    for j in range(L - 1, first - 1, -1):
                        if pres(g, j) is None:
                            ok, L = False, j  # every hit point whose window covers block j fails too
                            break
                    if not ok:
                        break
                if ok:
                    break
        if chunk is not None and L * bs + chunk < n:  # chunked prefill: the hit plus one chunk
            n = L * bs + chunk
            nblocks = -(-(n + la) // bs)
        ref = self.gpu.ref_mv
        cid, ckey, cpu_id = cache.cid, cache.key, self.cpu_id
        parked = cache.evictor.parked if getattr(cache.evictor, "num_parked", 0) else None
        groups, need, ncpu = [], 0, 0
        for g, spec in enumerate(self.specs):
            if spec.window is None:
                ents = full_hits[g][:L]
                nnull = 0
            else:
                nnull = max(0, L * bs - spec.window + 1) // bs if L else 0
                ents = [present[(g, j)] for j in range(nnull, L)]
            gpu = [NULL_BLOCK] * nnull
            cpu = None
            reused = 0
            for j, e in enumerate(ents, nnull):
                if e >= 0:
                    gpu.append(e)
                    if ref[e] == 0 and (parked is None or not parked[e]):  # (a pinned idle hit takes none)
                        reused += 1
                else:
                    if cpu is None:
                        cpu = []
                    cpu.append((j, ~e))
            if L and ents:
                e = ents[-1]
                chain = (int(cid[e]), int(ckey[e])) if e >= 0 else (int(cpu_id[0, ~e]), int(cpu_id[1, ~e]) & _U64)
            elif L:  # a window of one token needs no cached block: the group's chain is not known past the hit
                chain = (0, 0)
            else:
                chain = roots[g]
            nc = len(cpu) if cpu else 0
            ncpu += nc
            need += nblocks - L + nc + reused
            groups.append((gpu, cpu, chain, nnull))
        return _Plan(arr, n, nblocks, L, groups, need, ncpu)

    def can_allocate(self, arr: np.ndarray, la: int, gns: tuple, chunk: int | None, e: int = 0) -> AllocStatus:
        """NEVER / LATER / OK (see HybridBlockManager.can_allocate)."""
        try:
            plan = self.external_plan(arr, la, gns, chunk, e)[0] if e else self.plan(arr, la, gns, chunk=chunk)
        except (PromptTooLongError, TableWidthError):
            return AllocStatus.NEVER
        if self.blocks.num_free - plan.need >= self.watermark:
            return AllocStatus.OK
        return AllocStatus.LATER

    # ------------------------------------------------------------------ committing (nothing fails)
    def hold(self, plan: _Plan) -> list:
        """Reference every GPU hit of every group and pin every CPU-tier hit (before any group takes a block, so
        that no group evicts another's hit). Returns the GPU blocks referenced."""
        if self.cache is None:
            return []
        ref, ev = self.gpu.ref_mv, self.cache.evictor
        if plan.memo is not None:  # (a plan of pagedkv.hybrid._hit: no CPU-tier hit)
            h = plan.held
            if h is not None:
                gref = self.gpu.ref
                ev.discard_many(h[gref[h] == 0])
                gref[h] += 1
            return h
        held = [b for gpu, _, _, nnull in plan.groups for b in gpu[nnull:]]
        if len(held) > 32:  # a long hit: a few numpy calls (the blocks are distinct: one group each)
            h = np.array(held, dtype=np.int64)
            gref = self.gpu.ref
            ev.discard_many(h[gref[h] == 0])
            gref[h] += 1
        else:
            for b in held:
                if ref[b] == 0:
                    ev.discard(b)
                ref[b] += 1
        pins = [c for _, cpu, _, _ in plan.groups if cpu for _, c in cpu]
        if pins:
            self.tier.pin_many(pins)
        return held

    def commit(self, seq_id: Hashable, gns: tuple, plan: _Plan, defer: bool = False) -> None:
        """Create the sequence in every group (hits held by :meth:`hold`); nothing here can fail. ``defer``
        (external KV, a plan without ``memo``): register nothing past the hit in any group."""
        cache = self.cache
        memo = plan.memo
        if memo is not None:  # a plan of pagedkv.hybrid._hit: every group at once, with the plan's keys
            if not commit_all(self, seq_id, gns, plan) and self.sib is not None:
                self.record_siblings(seq_id, memo.fresh)
        else:
            for g, (al, (gpu, cpu, chain, nnull)) in enumerate(zip(self.allocs, plan.groups)):
                if cache is not None and plan.nhit == 0:
                    chain = cache.root(gns[g], intern=True)  # (a new namespace's root gets its content id now)
                al.commit(seq_id, gns[g], plan.arr, plan.n, plan.nblocks, gpu, cpu, chain, True, nnull, defer)
        if self.on_hits is not None and plan.nhit:
            hits = [b for gpu, _, _, _ in plan.groups for b in (gpu.tolist() if hasattr(gpu, "tolist") else gpu)
                    if b >= 0]
            if hits:
                self.on_hits(hits)
        if plan.n < plan.arr.size:  # a chunk: fork waits for the rest of the prompt (every group records it)
            for t in self.tables:
                t.partial[seq_id] = plan.arr.size
        if self.retention is not None:
            self.retention.set_prompt(self.t0.row_of[seq_id], plan.arr.size)  # (the whole prompt, chunked too)
        if cache is not None:
            for ns in gns:
                cache.intern(ns)
            if len(cache.roots) > cache.sweep_at:
                self.regs[0].release_namespaces()

    def record_siblings(self, seq_id: Hashable, fresh: int) -> None:
        """Record the sibling keys of the new sequence's prompt blocks (see :mod:`pagedkv.hybrid._hit`): for each
        position from the sliding groups' first held block to the registered ones, the anchor group's block, the
        content id it holds, and the keys of the sliding groups' blocks at that position (read from the prefix
        cache: each is the key of the same prefix in its group), skipping the positions before ``fresh`` (whose
        keys the plan read from valid records). A position where a block is not cached records content id 0
        (never valid). O(blocks recorded x groups), numpy."""
        t = self.tables[self.full[0]]
        row = t.row_of[seq_id]
        z = int(t.nreg[row])
        a = max(fresh, max(int(self.tables[g].nrel[row]) for g in self.sliding))
        if z <= a:
            return
        cid, key = self.cache.cid, self.cache.key
        b0 = t.table[row, a:z]
        bs = np.stack([self.tables[g].table[row, a:z] for g in self.sliding])  # (S, z - a)
        c0 = cid[b0]
        ok = (cid[bs] != 0).all(axis=0)
        sib_cid, sib_key = self.sib
        sib_cid[b0] = np.where(ok, c0, 0)
        sib_key[b0] = key[bs].T

    def unhold(self, held: list) -> None:
        """Drop the extra references of a batch's holds; blocks left unreferenced are parked."""
        if held:
            b = np.array(held, dtype=np.int64)
            ref = self.gpu.ref
            ref[b] -= 1  # (distinct blocks)
            self.blocks.park(b[ref[b] == 0].astype(np.int32))

    @staticmethod
    def hold_list(plan: _Plan) -> list:
        """The GPU hits a plan holds."""
        if plan.memo is not None:
            return [] if plan.held is None else plan.held.tolist()
        return [b for gpu, _, _, nnull in plan.groups for b in gpu[nnull:]]

    def hold_blocks(self, blocks: list) -> None:
        """One more reference on each of these (distinct) blocks, taken out of the LRU where unreferenced."""
        ref, ev = self.gpu.ref_mv, self.cache.evictor
        for b in blocks:
            if ref[b] == 0:
                ev.discard(b)
            ref[b] += 1

    # ------------------------------------------------------------------ the calls
    def allocate(self, seq_id: Hashable, arr: np.ndarray, la: int, gns: tuple, chunk: int | None) -> int:
        """Plan, admit, hold, commit one prompt (validated arguments); the hit in tokens."""
        plan = self.plan(arr, la, gns, chunk=chunk)
        free = self.blocks.num_free
        if plan.need > free:
            raise OutOfBlocksError(f"prompt of {plan.n} tokens needs {plan.need} new blocks in "
                                   f"{self.G} KV cache groups; {free} are free")
        self.hold(plan)
        self.commit(seq_id, gns, plan)
        return plan.nhit * self.bs

    def allocate_external(self, seq_id: Hashable, arr: np.ndarray, la: int, gns: tuple, chunk: int | None,
                          e: int, window_only: bool = False) -> tuple:
        """External KV (manager/_external.py): the hybrid hit L, then ``e`` tokens after it (cut to whole blocks
        before the prompt's last token) whose blocks every group reserves unregistered. Returns ``(L, e', cut)``;
        ``e' == 0``: a plain allocation (chunked as asked). ``window_only``: then :meth:`cut_windows` at the
        load's end (``cut``: whether it cut a group). O(prompt blocks x groups)."""
        bs, G = self.bs, self.G
        plan, ext = self.external_plan(arr, la, gns, chunk, e)
        h = plan.nhit * bs
        if not ext:
            return self.allocate(seq_id, arr, la, gns, chunk) // bs, 0, False
        free = self.blocks.num_free
        if plan.need > free:
            raise OutOfBlocksError(f"prompt of {plan.n} tokens needs {plan.need} new blocks in {G} KV cache groups; "
                                   f"{free} are free")
        if plan.memo is not None:  # the per-group commit (it can defer registration): hits with leading NULLs
            plan = plan._replace(memo=None, held=None, groups=[
                ([NULL_BLOCK] * nn + (b.tolist() if hasattr(b, "tolist") else list(b)), cpu, chain, nn)
                for b, cpu, chain, nn in plan.groups])
        self.hold(plan)
        self.commit(seq_id, gns, plan, defer=True)
        cut = self.cut_windows(seq_id, plan.nhit, h + ext) if window_only else False
        return plan.nhit, ext, cut

    def external_plan(self, arr: np.ndarray, la: int, gns: tuple, chunk: int | None, e: int,
                      check: bool = True) -> tuple:
        """``(plan, e')``: the plan of a prompt with ``e`` external tokens after its hybrid hit L (``e'`` of them
        kept: whole blocks before the prompt's last token), holding the hit, the ``e'`` tokens and one chunk with
        ``chunk``; with ``e' == 0`` the plain (chunked) plan. Changes nothing. O(prompt blocks x groups)."""
        bs, G = self.bs, self.G
        plan = self.plan(arr, la, gns, check=check)
        h = plan.nhit * bs
        ext = max(0, min(e, (arr.size - 1) // bs * bs - h))
        if not ext:
            return (plan if chunk is None else self.plan(arr, la, gns, check=check, chunk=chunk)), 0
        if chunk is not None and h + ext + chunk < plan.n:  # the hit, the external tokens, one chunk
            n = h + ext + chunk
            nb = -(-(n + la) // bs)
            plan = plan._replace(n=n, nblocks=nb, need=plan.need - G * (plan.nblocks - nb))
        return plan, ext

    def cut_windows(self, seq_id: Hashable, nhit: int, p: int) -> bool:
        """A load of window blocks only (``allocate(..., external_window_only=True)``), just committed with its
        external range ``[nhit * bs, p)`` deferred: each sliding group of window W whose first block still seen
        at ``p`` (``(p - W + 1) // bs``, as a hybrid hit's NULL_BLOCK positions) lies past its hit releases its
        positions before that block (its hit blocks back to the cache's LRU, its new blocks to the free ring),
        holds NULL_BLOCK there, and ends its chain (``ccid`` 0: that group registers nothing more of this
        sequence, since the blocks after the cut chain through blocks it never holds). Returns whether a group
        was cut. Nothing here can fail. O(groups + released blocks)."""
        bs, cut_any = self.bs, False
        for g in self.sliding:
            t = self.tables[g]
            row = t.row_of[seq_id]
            cut = max(0, p - self.windows[g] + 1) // bs
            a = int(t.nrel[row])
            if cut <= nhit or cut <= a:  # (the window at p still sees the hit: every external block is needed)
                continue
            gone = t.table[row, a:cut].astype(np.int64)
            t.table[row, a:cut] = NULL_BLOCK
            t.nrel[row] = cut
            t.ccid[row] = t.ckey[row] = 0
            t.memo_ids = None
            self.blocks.release(gone[gone >= 0][::-1])  # (tail first, as free)
            cut_any = True
        return cut_any

    def allocate_batch(self, seq_ids: list, arrs: list, gnss: list, chunks: list, la: int) -> HybridPrefillBatch:
        """A batch of validated prompts (see HybridBlockManager.allocate_batch), all or nothing."""
        plans = [self.plan(a, la, gns, chunk=c) for a, gns, c in zip(arrs, gnss, chunks)]
        need = sum(p.need for p in plans)
        free = self.blocks.num_free
        if need > free:
            raise OutOfBlocksError(f"the batch of {len(plans)} prompts needs {need} new blocks; "
                                   f"{free} are free")
        # ---- mutation: nothing below can fail
        held = list(dict.fromkeys(b for p in plans for b in self.hold_list(p)))
        if held:
            self.hold_blocks(held)
        if self.tier is not None:
            pins = [c for p in plans for _, cpu, _, _ in p.groups if cpu for _, c in cpu]
            if pins:
                self.tier.pin_many(list(dict.fromkeys(pins)))
        nhit, ntoks = [], []
        G = self.G
        for i, (s, gns) in enumerate(zip(seq_ids, gnss)):
            plan = plans[i]
            if i and self.cache is not None:
                again = self.plan(arrs[i], la, gns, False, chunks[i])  # (burst hits on the earlier prompts)
                # The admitted plan's hits are held, so it costs exactly its new blocks and CPU promotions now.
                # A burst hit that would cost more (a chunk holds the hit plus k tokens, so hits past the admitted
                # ones that sit unreferenced in the cache are taken, not saved) keeps the admitted plan (one without
                # CPU-tier hits, which an earlier prompt may have promoted).
                if plan.ncpu or again.need <= G * (plan.nblocks - plan.nhit):
                    plan = again
            self.hold(plan)
            self.commit(s, gns, plan)
            nhit.append(plan.nhit)
            ntoks.append(plan.n)
        self.unhold(held)
        return self.result(seq_ids, arrs, ntoks, nhit)

    def result(self, seq_ids: list, arrs: list, ntoks: list, nhit: list) -> HybridPrefillBatch:
        """The prefill metadata of committed prompts, per group (LOADING ones included: their tokens to compute
        start after the external range, ``nhit`` counting it). O(tokens x groups)."""
        sids = tuple(seq_ids)
        res = [al.prefill_result(sids, arrs, ntoks, [t.row_of[s] if s in t.row_of else t.loading[s]
                                                       for s in seq_ids], nhit)
               for al, t in zip(self.allocs, self.tables)]
        r0 = res[0]
        return HybridPrefillBatch(sids, r0.num_cached_tokens, r0.query_start_loc, r0.token_ids, r0.positions,
                                  frozen(np.stack([r.slot_mapping for r in res])),
                                  tuple(r.block_tables for r in res), r0.seq_lens)
