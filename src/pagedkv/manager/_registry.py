"""Prefix-cache registration, lookup and withdrawal for the block manager's sequences.

:class:`Registry`, a part of the manager. A row's chain state (in :class:`~pagedkv.manager._rows.SeqTables`) is ``nreg``
(leading blocks offered to the cache), ``ccid``/``ckey`` (content id and key of block ``nreg - 1``, a namespace
root's before block 0; ``ccid == 0``: chain broken, nothing more is cached) and ``pend`` (blocks
``pend .. nreg - 1`` were cached by the row's last call, whose KV the engine may not have written yet)::

    table   [ 17 | 3 | 42 | 8 | 11 ]      ntok = 4.5 blocks
              hit  hit  new  new  partial
                        ^pend      ^nreg    (after allocate: 42 and 8 are cached, pending until the next call)

Burst sharing: every call that makes a block full of known tokens registers it before returning, so
``nreg == ntok // block_size`` after every call (lookahead slots are never part of ``ntok``).
"""

from __future__ import annotations

import numpy as np

from ..errors import SequenceStateError
from ..blocks.prefix_cache import _GroupNS, _encode_namespace, _extend_chain, block_key

_KEYS_FIRST = 16  # keys a lookup hashes before its first dict probe (then twice as many each time it needs more)


class Registry:
    """The prefix-cache side of one manager's sequences: registering their full blocks (burst sharing), looking
    prompts up in both tiers, promoting CPU-tier hits, withdrawing a sequence's last blocks. Works on the
    tables ``t`` (:class:`~pagedkv.manager._rows.SeqTables`: the chain fields ``nreg``, ``pend``, ``ccid``, ``ckey``,
    ``ns_of``), the prefix cache ``cache``, the CPU tier ``tier`` (or None) and the CPU blocks' cache identity
    (``cpu_tok``, ``cpu_id``). Called only with prefix caching."""

    def __init__(self, t, blocks, cache, tier, cpu_tok, cpu_id, bs: int, kv_events: bool) -> None:
        self.t, self.blocks, self.cache, self.tier = t, blocks, cache, tier
        self.gpu = blocks.gpu
        self.cpu_tok, self.cpu_id, self.bs, self.kv_events = cpu_tok, cpu_id, bs, kv_events
        # (arr, datas, keys, root key) of the prompt an allocation's lookup just walked: its blocks' token bytes
        # and the chained keys computed so far, reused by the registration of the same allocation (fill_prompt)
        # instead of hashing the prompt twice. Set only by Allocator.plan's lookup, taken (cleared) by
        # fill_prompt, cleared by a batch.
        self.keys_memo: tuple | None = None  # (a plain tuple, unpacked by name: made on every allocate)
        # whether a prompt's new blocks may be registered as a run (dict-less but its first; PrefixCache.register_run).
        # A HybridBlockManager's groups say no: its lookup probes every group's keys in the map at once.
        self.use_runs = True

    def register(self, row: int) -> None:
        """Offer the row's full blocks (``nreg .. ntok // bs - 1``) to the prefix cache, one after the other
        (each key chains from the previous one). O(1) per block."""
        full = int(self.t.ntok[row]) // self.bs
        j = int(self.t.nreg[row])
        if full <= j:
            return
        pcid, pkey = int(self.t.ccid[row]), int(self.t.ckey[row])
        cache, ns = self.cache, self.t.ns_of[row]
        register, cid = cache.register, cache.cid
        events = cache.events is not None
        run: list[tuple[int, int]] = []  # (block, key) of newly cached consecutive blocks: one event per run
        start = (pcid, pkey)
        for b in self.t.table[row, j:full].tolist():
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
                self.stored_run(run, start, ns)
                run = []
        if run:
            self.stored_run(run, start, ns)
        self.t.ccid[row], self.t.ckey[row] = pcid, pkey
        self.t.nreg[row] = full

    def register1(self, r: int, w: int, j: int) -> None:
        """:meth:`register` of the one block ``w`` (column ``j``) a small step filled, through memoryviews."""
        mvs = self.t.mvs
        nreg, ccid, ckey = mvs.nreg, mvs.ccid, mvs.ckey
        if nreg[r] != j:  # not the plain case (a chain to catch up): the general form
            self.register(r)
            return
        pcid = ccid[r]
        if pcid:  # (register records the block's KV event itself when it caches it)
            ccid[r], ckey[r] = self.cache.register(w, pcid, ckey[r], self.t.ns_of[r])
        nreg[r] = j + 1

    def stored_run(self, run: list, parent: tuple[int, int], ns: object) -> None:
        self.cache.emit_stored([b for b, _ in run], [k for _, k in run], parent[0], parent[1], ns)

    def register_rows(self, rows: np.ndarray, j: np.ndarray, full: np.ndarray) -> None:
        """:meth:`register` for a batch of rows whose ``nreg`` is ``j`` and whose full blocks number ``full``
        (``full > j``): one :meth:`PrefixCache.register_chains` call, or row by row when that declines."""
        if rows.size <= 3:  # below this the batch call's fixed cost (~6 us) exceeds block-by-block (~1.5 us each)
            for row in rows.tolist():
                self.register(row)
            return
        self.register_rows_batch(rows, j, full)

    def fill_prompt(self, row: int, arr: np.ndarray, new: np.ndarray, nhit: int) -> None:
        """Write a new prompt's tokens into its new blocks and register its full blocks (burst sharing)."""
        bs, n = self.bs, arr.size
        h = nhit * bs  # the hit blocks already hold the tokens before h
        k = (n - h) // bs
        tok = self.cache.tok
        tok[new[:k]] = arr[h : h + k * bs].reshape(k, bs)
        if h + k * bs < n:
            tok[new[k], : n - h - k * bs] = arr[h + k * bs :]
        memo, self.keys_memo = self.keys_memo, None
        if k >= 4:  # one chain of k blocks in one batch call
            keys = None
            marr, datas, mkeys, rkey = memo if memo is not None else (None, None, None, None)
            if memo is not None and marr is arr:  # the lookup's keys (this allocation's own prompt)
                keys = mkeys
                _extend_chain(keys, datas, nhit + k, rkey)  # the rest of the chain, in one C-level pass
                # (the chain continues from the last hit's key; a stand-in chain, e.g. a batch's, hashes anew)
                parent = keys[nhit - 1] if nhit else rkey
                if parent != int(self.t.ckey[row]):
                    keys = None
                elif nhit or len(keys) != k:
                    keys = keys[nhit : nhit + k]
            # (one chain: its blocks are the new ones, in table order; no gather from the table)
            blocks = new[:k] if isinstance(new, np.ndarray) else np.array(new[:k], dtype=np.int32)
            got = None
            if keys is not None and self.use_runs:  # a run: one map insert for the chain (its parent: the last hit, or the root)
                got = self.cache.register_run(blocks, keys, int(self.t.ccid[row]), int(self.t.ckey[row]),
                                               int(self.t.table[row, nhit - 1]) if nhit else -1, self.t.ns_of[row])
            if got is None:
                got = self.cache.register_chains(blocks, np.array([k], np.int64), self.t.ccid[row : row + 1],
                                                  self.t.ckey[row : row + 1], [self.t.ns_of[row]] if self.kv_events
                                                  else None, keys)
            if got is None:
                self.register(row)
            else:
                last_cid, last_key = got  # (the chain's last block's content id and key)
                self.t.ccid[row], self.t.ckey[row] = last_cid[0], last_key[0]
                self.t.nreg[row] = nhit + k
        elif k:
            self.register(row)

    def register_rows_batch(self, rows: np.ndarray, j: np.ndarray, full: np.ndarray) -> None:
        """:meth:`register_rows` without its small-batch cut-off: one batch call, or row by row if it declines."""
        counts = full - j
        if np.count_nonzero(counts - 1):  # some row has several new full blocks (a prompt, a k-token append)
            cr = np.repeat(rows, counts)
            cols = np.repeat(j - np.cumsum(counts) + counts, counts) + np.arange(cr.size)
            blocks = self.t.table[cr, cols]
        else:
            blocks = self.t.table[rows, j]
        nss = [self.t.ns_of[r] for r in rows.tolist()] if self.kv_events else None
        got = self.cache.register_chains(blocks, counts, self.t.ccid[rows], self.t.ckey[rows], nss)
        if got is None:
            for row in rows.tolist():
                self.register(row)
            return
        self.t.ccid[rows], self.t.ckey[rows] = got
        self.t.nreg[rows] = full

    def release_namespaces(self) -> None:
        """Forget the prefix-cache namespaces that no live sequence and no cached block uses (bounded state per
        tenant: memory proportional to the namespaces in use, not to all ever seen). Amortised O(1) per new
        namespace (see :meth:`PrefixCache.release_namespaces`)."""
        keep = {b""}
        for ns in self.t.ns_of:
            if ns is not None:
                if type(ns) is _GroupNS:  # (a KV cache group's rows keep the roots of every group)
                    keep.update(ns.family)
                else:
                    keep.add(_encode_namespace(ns))
        self.cache.release_namespaces(keep, self.cpu_id)

    def withdraw_pending(self, seq_id, row: int) -> None:
        """``free(seq_id, cache=False)``: uncache the blocks the row's last call filled (its own blocks in
        ``pend .. nreg - 1``; those still cached were cached by it), and every cached block chained after them
        in either tier (a lookup reaches them only through the withdrawn content). Raises SequenceStateError,
        changing nothing, if another sequence holds one of the row's own blocks (a prefix hit: it relies on KV
        nobody wrote). A sequence that holds only a *descendant* is not refused: it wrote the KV of that position
        itself and registration chained it to the equal content already cached (deduplication), so its blocks
        stay, uncached, and its chain is broken (``ccid = 0``), like the chain of every row that ends in
        withdrawn content. O(cached blocks + rows) when there is one to withdraw."""
        a, z = int(self.t.pend[row]), int(self.t.nreg[row])
        if z <= a:
            return
        blocks = self.t.table[row, a:z]
        blocks = blocks[blocks >= 0]
        cache = self.cache
        # another holder of one of these blocks got it as a prefix hit (forks confirm, writes copy on write),
        # cached or not by now (reset_prefix_cache may have uncached it since)
        shared = blocks[self.gpu.ref[blocks] > 1].tolist()
        if shared:
            holders = [s for s, r in self.t.row_of.items() if r != row and not self.t.swapped[r]
                       and np.isin(self.t.table[r, self.t.nrel[r] : self.t.nblk[r]], shared).any()]
            raise SequenceStateError(
                f"free({seq_id!r}, cache=False): sequences {holders!r} hold blocks whose KV {seq_id!r} never "
                "wrote (prefix hits in the same step); free them first, or run the step and free with cache=True"
            )
        own = blocks[cache.cid[blocks] > 0]
        gpu_kids, cpu_kids = self.descendants(own)
        dead = np.concatenate((cache.cid[own], cache.cid[gpu_kids], self.cpu_id[0, cpu_kids])).astype(np.int64)
        cache.withdraw(own.tolist())
        if gpu_kids.size:
            idle = gpu_kids[self.gpu.ref[gpu_kids] == 0]  # unreferenced: they wait in the evictor
            cache.evictor.discard_many(idle)
            cache.withdraw(gpu_kids.tolist())  # held ones stay with their sequences, uncached
            self.gpu.give(idle.astype(np.int32))
        if cpu_kids.size:
            self.tier.withdraw(cpu_kids)
        if dead.size:  # rows whose chain ends in withdrawn content cache nothing more (it would be unreachable)
            self.t.ccid[np.isin(self.t.ccid, dead[dead > 0])] = 0

    def descendants(self, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cached GPU blocks (other than ``roots``) and CPU-tier blocks whose chain passes through the content of
        one of the cached GPU blocks ``roots``. O(cached blocks) per generation of descendants."""
        none = np.zeros(0, dtype=np.int64)
        if not roots.size:
            return none, none
        cache = self.cache
        frontier = cache.cid[roots]
        gpu = np.flatnonzero(cache.cid)
        gpu = gpu[~np.isin(gpu, roots)]
        tier = self.tier
        cpu = np.fromiter(tier.map.values(), dtype=np.int64, count=len(tier.map)) if tier is not None else none
        found_g, found_c = [], []
        while frontier.size:
            kg = np.isin(cache.pcid[gpu], frontier)
            kc = np.isin(self.cpu_id[2, cpu], frontier) if cpu.size else np.zeros(0, dtype=bool)
            if not kg.any() and not kc.any():
                break
            found_g.append(gpu[kg])
            found_c.append(cpu[kc])
            frontier = np.concatenate((cache.cid[gpu[kg]], self.cpu_id[0, cpu[kc]]))
            gpu, cpu = gpu[~kg], cpu[~kc]
        return (np.concatenate(found_g).astype(np.int64) if found_g else none,
                np.concatenate(found_c).astype(np.int64) if found_c else none)

    def lookup(self, arr: np.ndarray, root: tuple[int, int], memo: bool = False) -> tuple[list[int], tuple[int, int]]:
        """Cached blocks matching the prompt's leading full blocks (at most (len - 1) // block_size, so at least
        one token is left to compute), and the (cid, key) of the last hit (the root's if none). With the CPU tier
        a block missing on the GPU may be found there: it is listed as ``~cpu_block`` (negative). O(hit blocks).

        The prompt's chained keys are computed ahead of the walk in C-level passes (16, then twice as many as
        computed so far each time the walk needs more: at most about twice the hit plus 16 keys), from its full
        blocks' token bytes (one numpy ``tolist`` of a void view). The walk then costs one dict probe and two
        element reads a block; the hit blocks' tokens are compared in one bytes compare at the end (a mismatch,
        a hash collision, re-walks block by block: exactly the block-by-block semantics). ``memo``: keep the
        bytes and keys for this allocation's registration (:attr:`keys_memo`)."""
        bs = self.bs
        lim = (arr.size - 1) // bs
        if lim <= 0:
            return [], root
        cache = self.cache
        full = arr.size // bs
        if full < 4:  # too short to register a run: block by block, nothing kept
            return self.lookup_few(arr, root, lim)
        datas = np.ascontiguousarray(arr[: full * bs]).view(cache.void).tolist()
        rkey = root[1]
        keys: list[int] = []
        _extend_chain(keys, datas, _KEYS_FIRST, rkey)
        if memo:
            self.keys_memo = (arr, datas, keys, rkey)
        if self.tier is not None:
            return self.lookup_slow(datas, keys, root, lim)
        get, pcm, cim = cache.map.get, cache.pcid_mv, cache.cid_mv
        # with dict-less blocks a block is found as the run successor of the previous hit, else in the map
        succ, kym = (cache.succ_mv, cache.key_mv) if cache.ndl else (None, None)
        hits: list[int] = []
        pcid = root[0]
        nk = len(keys)
        j = b = 0
        while j < lim:
            if j == nk:  # more keys: as many again as computed so far
                _extend_chain(keys, datas, 2 * nk, rkey)
                nk = len(keys)
            if succ is not None and j:
                s = succ[b]
                b = s if s >= 0 and kym[s] == keys[j] and cim[s] else get(keys[j], -1)
            else:
                b = get(keys[j], -1)
            if b < 0 or pcm[b] != pcid:
                break
            hits.append(b)
            pcid = cim[b]
            j += 1
        if not j:
            return hits, root
        if cache.tok[hits].tobytes() != arr[: j * bs].tobytes():  # a hash collision somewhere: block by block
            return self.lookup_slow(datas, keys, root, lim)
        return hits, (pcid, keys[j - 1])

    def lookup_few(self, arr: np.ndarray, root: tuple[int, int], lim: int) -> tuple[list[int], tuple[int, int]]:
        """:meth:`lookup` of a prompt of fewer than 4 full blocks: hashed and checked block by block."""
        cache, tier = self.cache, self.tier
        w = 4 * self.bs
        data = arr.tobytes()
        get, pcm, cim, tok = cache.map.get, cache.pcid_mv, cache.cid_mv, cache.tok
        succ = cache.succ_mv if cache.ndl else None
        hits: list[int] = []
        pcid, pkey = root
        prev = -1
        for j in range(lim):
            d = data[j * w : (j + 1) * w]
            key = block_key(pkey, d)
            b = -1
            if succ is not None and prev >= 0:  # (a dict-less block: the run successor of the previous hit)
                b = succ[prev]
                if b < 0 or cache.key_mv[b] != key or not cim[b]:
                    b = -1
            if b < 0:
                b = get(key, -1)
            if b < 0 or pcm[b] != pcid or tok[b].tobytes() != d:  # a miss (a hash collision is never a hit)
                if tier is None:
                    break
                c = tier.find_keyed(pcid, key, d)  # the prefix continues in the CPU tier?
                if c < 0:
                    break
                hits.append(~c)
                pcid, pkey, prev = int(self.cpu_id[0, c]), key, -1
                continue
            hits.append(b)
            pcid, pkey, prev = cim[b], key, b
        return hits, (pcid, pkey)

    def lookup_slow(self, datas: list, keys: list, root: tuple[int, int], lim: int) -> tuple[list[int], tuple[int, int]]:
        """:meth:`lookup` block by block, each candidate's parent and tokens checked before the next one, the CPU
        tier looked up where the GPU misses (``keys`` is extended as needed). O(hit blocks)."""
        cache = self.cache
        if cache.ndl:
            cache.flush()
        tok, pcm, cim, get = cache.tok, cache.pcid_mv, cache.cid_mv, cache.map.get
        hits: list[int] = []
        pcid, pkey = root
        tier = self.tier
        for j in range(lim):
            if j == len(keys):
                _extend_chain(keys, datas, 2 * j, root[1])
            key, d = keys[j], datas[j]
            b = get(key, -1)
            if b < 0 or pcm[b] != pcid or tok[b].tobytes() != d:  # a miss (a hash collision is never a hit)
                if tier is None:
                    break
                c = tier.find_keyed(pcid, key, d)  # the prefix continues in the CPU tier?
                if c < 0:
                    break
                hits.append(~c)
                pcid, pkey = int(self.cpu_id[0, c]), key
                continue
            hits.append(b)
            pcid, pkey = cim[b], key
        return hits, (pcid, pkey)

    def promote(self, hits: list, cpu_hits: list, taken) -> tuple[list, list]:
        """Give each CPU-tier hit the next of the ``taken`` GPU blocks: the block adopts the CPU block's content
        (tokens and identity, so chains continue) and a CPU -> GPU copy is recorded. Returns the prompt's hit
        blocks in table order and the taken blocks left for the rest of the prompt. Vectorised over the hits."""
        taken = taken.tolist() if isinstance(taken, np.ndarray) else taken
        cache, tier, k = self.cache, self.tier, len(cpu_hits)
        cs = [c for _, c in cpu_hits]
        gs = taken[:k]
        ca, ga = np.array(cs, dtype=np.int64), np.array(gs, dtype=np.int64)
        ident = self.cpu_id[:, ca]
        cache.tok[ga] = self.cpu_tok[ca]
        cache.adopt_many(ga, ident[0], ident[1].view(np.uint64), ident[2], ident[3].view(np.uint64), ident[4])
        tier.promote_many(cs, gs)
        out = list(hits)
        for (j, _), g in zip(cpu_hits, gs):
            out.insert(j, g)
        return out, taken[k:]
