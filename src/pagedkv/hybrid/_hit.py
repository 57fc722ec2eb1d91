"""The hybrid prefix hit of :class:`pagedkv.HybridBlockManager`, vectorised over blocks and groups (internal).

:func:`find_hit` finds the hit of a prompt in every KV cache group in a few C-level passes and numpy calls,
without a Python step per block::

    prompt blocks      0   1   2 ...                      h-1 | (at most (n - 1) // bs: one token left to compute)
    keys, full group   chain(datas, root_g)      one xxh3 pass (each group's keys chain from its own root)
    keys, sliding g    sibling keys, hashed on   the window's keys read from the records of the full group's hit
                       from the last record      blocks (below), hashed from the last recorded block on
    full group         map.get of every key      -> candidate blocks; the hit h is the first block that is not
                       parent cid == previous cid   cached, breaks the content-id chain, or holds other tokens
    sliding group g    map.get + token compare   -> present_g[j] for j < h (only the last window of h first;
                                                    every block below h only when a window there has a hole)
    hit L              the largest L <= h with every sliding group's blocks covering (L - W_g, L) present: a cumulative
                       count of holes per group, compared at every candidate L at once

The semantics are exactly those of the block-by-block walk it replaces (:meth:`HybridAllocator.plan_walk <pagedkv.hybrid._allocator.HybridAllocator.plan_walk>`,
still used with the CPU tier and for prompts of fewer than four blocks): a full group's hit block must be
the dict's block for the key, chained by content id to the previous hit and hold the prompt's tokens (a hash
collision ends the hit there: a miss, never another sequence's KV); a sliding group's window block must be the
dict's block for the group's chained key and hold the prompt's tokens (its parent may be gone, so its content id
cannot be compared; the 64-bit chained key stands for every earlier token). Returns the keys it computed, so
that the allocation registers the prompt's new blocks without hashing again (``Registry.keys_memo``).

**Sibling keys.** A sliding group's keys chain from block 0 like any group's, so finding its window late in a
long prompt would hash the whole prompt once per sliding group. Instead ``HybridAllocator.sib`` records, per
block b of the first full-attention group (the *anchor*), the content id b held and the keys of the same prefix
in every sliding group (``(num_gpu_blocks,)`` int64 and ``(num_gpu_blocks, sliding groups)`` uint64, written when
a prompt's blocks are registered: :func:`commit_all`, ``HybridAllocator.record_siblings``). A later prompt
whose full-group hit includes b, still holding that content id, reads the sliding keys at b's position there; a
content id is never reused, so a record whose block changed content no longer matches. Positions with no valid
record are hashed on from the last valid one (decode-filled blocks, which nothing records), or from the root.
A record is a lookup hint like a key: what it finds is still verified by tokens.

Cost: O(prompt blocks) of C-level hashing (about 40 ns a block) and one ``map(dict.get)`` pass per full group,
one pass over every sliding group's last window together, and O(1) numpy calls a group.
"""

from __future__ import annotations

from itertools import repeat
from typing import NamedTuple

import numpy as np

from ..blocks.prefix_cache import _chain, _extend_chain
from ..types import NULL_BLOCK


class HitMemo(NamedTuple):
    """What :func:`find_hit` computed that the allocation reuses (a plan's ``memo``): no block is hashed twice."""

    datas: list  #: token bytes of the prompt's full blocks
    keys: list  #: chained keys per group (sliding groups: padded before the blocks a hit reads)
    roots: list  #: each group's namespace root ``(cid, key)``
    fresh: int  #: the first block whose sibling keys are not recorded yet

__all__ = ["commit_all", "find_hit"]


def _probe(get, keys: list) -> np.ndarray:
    """The dict's block for each key, -1 where absent (int64). One C-level pass."""
    return np.fromiter(map(get, keys, repeat(-1)), dtype=np.int64, count=len(keys))


def _present(cache, blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``blocks`` where the block is found and holds the tokens ``rows`` (one row per block), else -1."""
    found = blocks >= 0
    if found.all():
        if cache.tok[blocks].tobytes() == rows.tobytes():
            return blocks
        ok = (cache.tok[blocks] == rows).all(axis=1)
    else:
        ok = found.copy()
        ok[found] = (cache.tok[blocks[found]] == rows[found]).all(axis=1)
    return np.where(ok, blocks, -1)


def find_hit(ha, arr: np.ndarray, roots: list):
    """The hybrid hit of prompt ``arr`` (int32) in every group of ``ha`` (the
    :class:`~pagedkv.hybrid._allocator.HybridAllocator` of a manager with prefix caching and no CPU tier), groups' roots ``roots`` ((cid, key) each). Returns ``(L, blocks, keys, datas,
    fresh)``: the hit in blocks; per group the int64 array of its hit blocks ``[nnull_g, L)`` (nnull_g: the
    blocks before a sliding group's window, 0 for a full group); per group the list of chained keys computed (at
    least blocks ``[nnull_g, L)``; a sliding group's list may start with placeholder zeros where its keys were
    not needed, never read: the registration extends the list from its last item); the full blocks' token bytes;
    the first block whose sibling keys are not recorded yet. None when it cannot decide exactly without the
    block-by-block walk (fewer than four full blocks, or blocks left out of the dict by a key collision)."""
    bs, n = ha.bs, arr.size
    lim = (n - 1) // bs
    full = n // bs
    if full < 4:
        return None
    cache = ha.cache
    if cache.ndl:
        cache.flush()  # (the probes read the map as the whole index)
        if cache.ndl:  # a 64-bit key collision left a block out of the map: the walk decides
            return None
    arr = np.ascontiguousarray(arr)
    rows = arr[: full * bs].reshape(full, bs)
    datas = rows.view(cache.void).ravel().tolist()
    get = cache.map.get
    specs = ha.specs
    G = len(specs)
    keys: list = [None] * G
    blocks: list = [None] * G
    h = lim
    pcid, cid = cache.pcid, cache.cid
    for g in ha.full:
        kg = keys[g] = _chain(datas, roots[g][1])  # (every full block: the registration reuses them)
        b = _probe(get, kg[:h])
        ok = b >= 0
        bb = np.where(ok, b, 0)
        par = np.empty(h, dtype=np.int64)
        if h:
            par[0] = roots[g][0]
            par[1:] = cid[bb[:-1]]
        ok &= pcid[bb] == par
        if not ok.all():
            h = int(ok.argmin())
            b = b[:h]
        if h and cache.tok[b].tobytes() != rows[:h].tobytes():  # a hash collision: the hit ends before it
            eq = (cache.tok[b] == rows[:h]).all(axis=1)
            h = int(eq.argmin())
            b = b[:h]
        blocks[g] = b
    L = h
    sliding = ha.sliding
    known = 0  # the sliding groups' keys are known from this block on (padding before it)
    fresh = 0  # the sibling keys of the blocks before this one (from ``known``) are recorded already
    if sliding and L:
        # the sliding groups' keys of the last window before L: the anchor's siblings where recorded, hashed on
        # from the last recorded one otherwise
        fs = [max(0, L * bs - specs[g].window + 1) // bs for g in sliding]
        known = min(fs)
        if ha.sib is not None:
            sib_cid, sib_key = ha.sib
            b0 = blocks[ha.full[0]]
            seg = b0[known:L]
            v = sib_cid[seg] == cid[seg]
            if v.all():
                p = L - 1
            else:
                j0 = known + int(v.argmin())
                vv = np.flatnonzero(sib_cid[b0[:j0]] == cid[b0[:j0]])
                p = int(vv[-1]) if vv.size else -1
            known, fresh = min(known, p + 1), p + 1
            sk = sib_key[b0[known : p + 1]].T if p >= known else None
            for i, g in enumerate(sliding):
                kl = [0] * known
                if sk is not None:
                    kl += sk[i].tolist()
                if p < L - 1:
                    kl += _chain(datas[p + 1 : L], int(sib_key[b0[p], i]) if p >= 0 else roots[g][1])
                keys[g] = kl
        else:
            known = 0
            for g in sliding:
                keys[g] = _chain(datas[:L], roots[g][1])
        # the windows first, every sliding group in one probe: the common case (a conversation's next turn)
        # needs nothing more
        parts = [keys[g][f:L] for g, f in zip(sliding, fs)]
        flat = parts[0] if len(parts) == 1 else [k for ks in parts for k in ks]
        got = _present(cache, _probe(get, flat), rows[fs[0]:L] if len(parts) == 1 else
                       np.concatenate([rows[f:L] for f in fs]))
        pres, a = {}, 0
        for g, f in zip(sliding, fs):
            pres[g] = (f, got[a : a + L - f])
            a += L - f
        if (got < 0).any():  # every block below h, then the largest L whose windows are whole in every group
            if known:
                for g in sliding:
                    keys[g] = _chain(datas[:L], roots[g][1])
                known = fresh = 0
            ok_all = np.ones(L + 1, dtype=bool)  # candidate hit points 0..h
            cand = np.arange(L + 1)
            for g in sliding:
                f, p = pres[g]
                if f:
                    p = np.concatenate((_present(cache, _probe(get, keys[g][:f]), rows[:f]), p))
                pres[g] = (0, p)
                c = np.zeros(L + 1, dtype=np.int64)
                np.cumsum(p < 0, out=c[1:])
                first = np.maximum(0, cand * bs - specs[g].window + 1) // bs
                ok_all &= c[cand] == c[first]
            L = int(np.flatnonzero(ok_all)[-1])
        for g in sliding:
            f, p = pres[g]
            nnull = max(0, L * bs - specs[g].window + 1) // bs if L else 0
            blocks[g] = p[nnull - f : L - f]
    for g in ha.full:
        blocks[g] = blocks[g][:L]
    if not L:
        for g in sliding:
            blocks[g] = np.zeros(0, dtype=np.int64)
            if keys[g] is None:
                keys[g] = []  # (the registration extends the keys)
    return L, blocks, keys, datas, fresh


def commit_all(ha, seq_id, gns: tuple, plan) -> bool:
    """Create the sequence in every group at once, for a plan of :func:`find_hit` (no CPU-tier hit; the hits held
    by ``HybridAllocator.hold``): one take of every group's new blocks, one token write, and one
    ``PrefixCache.register_chains`` call for every group's new full blocks with the plan's keys (no hashing but
    the new blocks'). The same state, stats and events, in the same order, as one ``Allocator.commit``
    per group: when the free ring cannot supply every group's blocks (a take evicts cached blocks, whose removal
    events come between the groups' stored blocks) each group takes and registers in turn; where the batch
    registration declines (a content cached already, a chain broken), each group registers block by block as
    ``Allocator.commit`` does. Nothing here can fail. O(G) numpy calls plus the new blocks.

    Returns True when it recorded the sibling keys of the prompt (``HybridAllocator.record_siblings``):
    those of its new full blocks, registered together, all the plan's hits having valid ones already."""
    arr, n, nblocks, L = plan.arr, plan.n, plan.nblocks, plan.nhit
    tables, allocs = ha.tables, ha.allocs
    G = len(tables)
    cache, bs = ha.cache, ha.bs
    m = nblocks - L  # new blocks in every group
    h = L * bs
    k = (n - h) // bs  # new full blocks of every group
    rest = n - h - k * bs
    take = ha.blocks.take
    together = G * m <= ha.gpu.nfree  # no eviction: every group's blocks in one take, registered in one call
    new = take(G * m).reshape(G, m) if together and m else None
    chains, rows = [], []
    for g, (tb, al) in enumerate(zip(tables, allocs)):
        gpu, _, chain, nnull = plan.groups[g]
        if L == 0:
            chain = cache.root(gns[g], intern=True)  # (a new namespace's root gets its content id now)
        row = tb.new_row(seq_id)
        tb.ns_of[row] = gns[g]
        tb.ntok0[row] = -1  # every position is handed out in this step
        if nblocks > tb.table.shape[1]:
            tb.ensure_cols(nblocks)
        t = tb.table[row]
        if L:
            t[:nnull] = NULL_BLOCK
            t[nnull:L] = gpu
        tb.ntok[row] = n
        tb.nblk[row] = nblocks
        tb.pend[row] = tb.nreg[row] = L
        if nnull:
            tb.nrel[row] = nnull
        tb.ccid[row], tb.ckey[row] = chain
        al.query_tokens += arr.size  # (the whole prompt was looked up)
        al.hit_tokens += h
        al.query_blocks += (arr.size - 1) // bs
        al.hit_blocks += L
        chains.append(chain)
        rows.append(row)
        if new is None:  # (a take that may evict: this group's blocks and registration now, as Allocator.commit)
            blk = take(m) if m else np.zeros(0, dtype=np.int32)
            t[L:nblocks] = blk
            _fill(ha, plan, [g], blk[None, :], [chain], [row], h, k, rest)
    if new is None:
        return False
    for g in range(G):
        tables[g].table[rows[g], L:nblocks] = new[g]
    if not _fill(ha, plan, range(G), new, chains, rows, h, k, rest) or ha.sib is None or plan.memo.fresh < L:
        return False
    # the sibling keys of the new full blocks: the sliding groups' blocks at the same positions, just registered
    a = new[ha.full[0], :k]
    sib_cid, sib_key = ha.sib
    sib_cid[a] = cache.cid[a]
    sib_key[a] = cache.key[new[ha.sib_rows, :k].T]
    return True


def _fill(ha, plan, gs, new: np.ndarray, chains: list, rows: list, h: int, k: int, rest: int) -> None:
    """Write the prompt's tokens into the new blocks ``new`` (one row per group of ``gs``) and register their
    full ones: one ``register_chains`` call with the plan's keys (True), else block by block per group."""
    arr, L, bs = plan.arr, plan.nhit, ha.bs
    datas, keys, roots = plan.memo.datas, plan.memo.keys, plan.memo.roots
    cache, G = ha.cache, len(gs)
    if k:
        tok = arr[h : h + k * bs].reshape(k, bs)
        cache.tok[new[:, :k].ravel()] = np.tile(tok, (G, 1)) if G > 1 else tok
    if rest:
        cache.tok[new[:, k], :rest] = arr[h + k * bs : plan.n]
    if not k:
        return False
    allkeys = []
    for g, c in zip(gs, chains):
        kg = keys[g]
        _extend_chain(kg, datas, L + k, roots[g][1])
        if len(kg) < L + k or (kg[L - 1] if L else roots[g][1]) != c[1]:
            allkeys = None  # (a chain that is not the plan's: hashed anew)
            break
        allkeys += kg[L : L + k]
    got = None
    if all(c[0] for c in chains):
        got = cache.register_chains(new[:, :k].ravel(), np.full(G, k, dtype=np.int64),
                                    np.array([c[0] for c in chains], dtype=np.int64),
                                    np.array([c[1] for c in chains], dtype=np.uint64),
                                    [ha.tables[g].ns_of[r] for g, r in zip(gs, rows)] if cache.events is not None
                                    else None, allkeys)
    if got is None:
        for g, row in zip(gs, rows):
            ha.regs[g].register(row)
        return False
    last_cid, last_key = got  # (each chain's last block's content id and key)
    for i, (g, row) in enumerate(zip(gs, rows)):
        t = ha.tables[g]
        t.ccid[row], t.ckey[row] = last_cid[i], last_key[i]
        t.nreg[row] = L + k
    return True
