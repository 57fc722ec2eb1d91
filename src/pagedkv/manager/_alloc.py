"""Allocation of new sequences (:class:`Allocator`, a part of the manager): one prompt (``allocate``), a batch
(``allocate_batch``), and the side-effect-free prediction of a prompt's hit (``lookup_prefix``).

An allocation is *planned* without changing anything (the lookup, block counts, every check that can fail),
then *committed* (nothing in the commit can fail)::

    allocate(seq, prompt)       plan ─> enough free blocks? ─> commit
    allocate_batch(seqs, ps)    plan per prompt ─> batch_walk (sharing inside the batch, simulated)
                                ─> enough free blocks for the batch? ─> reference / pin every planned hit
                                ─> commit per prompt ─> prefill_result

A batch shares blocks between its prompts exactly as consecutive ``allocate`` calls would (a prompt finds the
full blocks that earlier prompts of the batch register or promote), with one difference, which only helps:
every hit of the batch is referenced (GPU) or pinned (CPU tier) before any block is taken, so no prompt of the
batch evicts a cached block that a later prompt of the same batch hits. Work: O(prompt blocks) per prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xxhash

from .._checks import as_tokens as _as_tokens, token_count
from ..errors import OutOfBlocksError, PromptTooLongError, TableWidthError
from ..blocks.prefix_cache import _encode_namespace
from ..types import PrefillBatch

_xxh3 = xxhash.xxh3_64_intdigest
_COL = 1 << 24  # a planned hit on column c of the batch's prompt i is encoded ~(i * _COL + c) until commit


def _what(n: int, la: int) -> str:
    return f"prompt of {n} tokens" + (f" plus {la} lookahead slots" if la else "")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class AllocPlan(NamedTuple):
    """Everything an allocation of one prompt needs (:meth:`Allocator.plan`), without changing anything."""

    arr: np.ndarray | None  #: the prompt, int32 (None without prefix caching: only the count matters)
    n: int  #: tokens the sequence holds (the hit plus a chunk in chunked prefill)
    nblocks: int  #: its table length (lookahead included)
    hits: list  #: GPU hit blocks in table order (CPU-tier hits left out; < 0: a batch's planned block)
    cpu_hits: list | None  #: ``[(table position, CPU block)]`` or None
    chain: tuple  #: ``(cid, key)`` after the last hit
    need: int  #: free GPU blocks the allocation consumes


class Allocator:
    """Allocation of one manager's new sequences over its parts: the tables ``t``
    (:class:`~pagedkv.manager._rows.SeqTables`), ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`), the registry ``reg``
    (:class:`~pagedkv.manager._registry.Registry`: lookups, registration, promotion), the prefix cache and the CPU tier.
    Counts the prefix-cache queries and hits (``query_tokens``, ``hit_tokens``, ``query_blocks``,
    ``hit_blocks``)."""

    def __init__(self, t, blocks, reg, cache, tier, cpu_id, bs: int, watermark: int, fixed_w: int,
                 window: int | None = None) -> None:
        self.t, self.blocks, self.reg, self.cache, self.tier = t, blocks, reg, cache, tier
        self.gpu, self.cpu_id = blocks.gpu, cpu_id
        self.bs, self.watermark, self.fixed_w = bs, watermark, fixed_w
        self.window = window  # the sliding window (tokens) or None: chunked prompts may outgrow the pool
        self.query_tokens = self.hit_tokens = self.query_blocks = self.hit_blocks = 0
        # called with the GPU hit blocks of each committed allocation (the selective store policy counts hits:
        # manager/_external.py); None: no call
        self.on_hits = None

    def plan(self, token_ids: object, la: int, namespace: object, root: tuple | None = None,
             lookup: bool = True, checked: bool = False, chunk: int | None = None) -> tuple:
        """Everything an allocation of ``token_ids`` needs, without changing anything: the fields of
        :class:`AllocPlan` as a plain tuple ``(arr, n, nblocks, hits, cpu_hits, chain, need)``, which the
        one-prompt paths unpack at once (an AllocPlan costs ~0.2 us more per allocate; a batch makes one with
        ``AllocPlan._make``). ``hits``: GPU hit blocks in table order (CPU-tier hits left out); ``cpu_hits``:
        ``[(table position, CPU block)]`` or None; ``chain``: (cid, key) after the last hit; ``need``: free GPU
        blocks the allocation consumes. Raises InvalidTokensError, InvalidArgumentError (namespace),
        PromptTooLongError, TableWidthError. ``root`` replaces the namespace's root (a batch's new namespaces);
        ``lookup=False`` leaves the hits out (a batch walks its prompts itself); ``checked``: ``token_ids`` is
        already a validated int32 array. ``chunk`` (chunked prefill): the sequence holds the hit plus at most
        ``chunk`` more prompt tokens; ``n`` and ``nblocks`` are then those of the held tokens while ``arr`` stays
        the whole prompt (the lookup and the checks of PromptTooLongError / TableWidthError use all of it)."""
        if self.cache is None:
            # without a cache only the count matters: a short list is checked in Python, never converted
            arr = None
            n = token_ids.size if checked else \
                token_count(token_ids) if type(token_ids) is list else _as_tokens(token_ids).size
            if namespace is not None:
                _encode_namespace(namespace)  # validate it all the same
        else:
            arr = token_ids if checked else _as_tokens(token_ids)
            n = arr.size
            if root is None:
                root = self.cache.root(namespace, intern=False)
        bs = self.bs
        nblocks = -(-(n + la) // bs)
        if self.peak(n, la, chunk) > self.gpu.num_blocks - self.watermark:
            raise PromptTooLongError(
                f"{_what(n, la)} needs {self.peak(n, la, chunk)} blocks at once"
                f"{f' (in chunks of {chunk} tokens)' if nblocks != self.peak(n, la, chunk) else ''}; the pool has "
                f"{self.gpu.num_blocks} with {self.watermark} kept free"
            )
        if self.fixed_w and nblocks > self.fixed_w:
            raise TableWidthError(f"{_what(n, la)} needs {nblocks} blocks; block_table_width is {self.fixed_w}")
        if arr is None or not lookup:
            if chunk is not None and arr is None and chunk < n:  # (a batch's walk cuts its chunks itself)
                n = chunk
                nblocks = -(-(n + la) // bs)
            return arr, n, nblocks, [], None, (0, 0), nblocks
        hits, chain = self.reg.lookup(arr, root, memo=True)
        if self.window is not None and chunk is not None:
            hits, chain = self.fit_hit(hits, chain, root, n, la, chunk)
        if chunk is not None and len(hits) * bs + chunk < n:  # chunked prefill: the hit plus one chunk
            n = len(hits) * bs + chunk
            nblocks = -(-(n + la) // bs)
        cpu_hits = None  # [(table position, CPU block)] of hits in the CPU tier (encoded ~block by _lookup)
        if hits and self.tier is not None and min(hits) < 0:
            cpu_hits = [(j, ~b) for j, b in enumerate(hits) if b < 0]
            hits = [b for b in hits if b >= 0]
        ref = self.gpu.ref_mv
        reused_free = sum(1 for b in hits if ref[b] == 0) if hits else 0
        if reused_free and getattr(self.cache.evictor, "num_parked", 0):  # pinned idle hits are not in num_free
            pk = self.cache.evictor.parked
            reused_free -= sum(1 for b in hits if pk[b])
        return arr, n, nblocks, hits, cpu_hits, chain, nblocks - len(hits) + reused_free

    def peak(self, n: int, la: int, chunk: int | None) -> int:
        """The most blocks a prompt of ``n`` tokens (plus ``la`` lookahead slots) holds at once: all of them, or
        with a sliding window and chunked prefill (chunks of ``chunk`` tokens, the window releasing the blocks
        before each chunk's first query's window) the window's ``W - 1`` tokens plus one chunk. O(1)."""
        nblocks = -(-(n + la) // self.bs)
        if self.window is None or chunk is None or chunk >= n:
            return nblocks
        return min(nblocks, -(-(self.window - 1 + chunk + la) // self.bs) + 1)

    def fit_hit(self, hits: list, chain: tuple, root: tuple, n: int, la: int, chunk: int) -> tuple[list, tuple]:
        """A windowed manager's chunked allocation holds its whole hit plus the chunk: the hit cut (and its
        ``chain``, the ``(cid, key)`` after the last hit, ``root`` when none is left) so that they fit in the pool minus the watermark, as a
        prompt that :meth:`peak` admits can complete. O(1) unless it cuts."""
        h = self.fit_len(len(hits), n, la, chunk)
        if h == len(hits):
            return hits, chain
        hits = hits[:h]
        if not h:
            return hits, root
        b = hits[-1]
        if b >= 0:
            return hits, (int(self.cache.cid[b]), int(self.cache.key[b]))
        return hits, (int(self.cpu_id[0, ~b]), int(self.cpu_id[1, ~b]) & 0xFFFFFFFFFFFFFFFF)

    def fit_len(self, nhit: int, n: int, la: int, chunk: int) -> int:
        """How many of ``nhit`` hit blocks a windowed manager's chunked allocation of ``n`` tokens keeps: all when
        they and the chunk fit in the pool minus the watermark, else as many as leave room for the chunk. O(1)."""
        bs = self.bs
        avail = self.gpu.num_blocks - self.watermark
        if -(-(min(n, nhit * bs + chunk) + la) // bs) <= avail:
            return nhit
        return min(nhit, max(0, (avail * bs - chunk - la) // bs))

    def commit(self, seq_id, namespace, arr, n: int, nblocks: int, hits: list, cpu_hits, chain,
               referenced: bool, nnull: int = 0, defer: bool = False) -> int:
        """Create the row of a planned allocation; nothing here can fail. ``referenced``: the GPU hits hold their
        new reference already and the CPU hits are pinned (a batch takes them all first). ``nnull``: the first
        ``nnull`` entries of ``hits`` are NULL_BLOCK, positions a sliding window no longer needs (a KV cache
        group's hybrid hit; ``referenced`` then). ``defer``: register nothing past the hit (external KV arrives
        in the new blocks later: manager/_external.py registers them when the load is reported). Returns the
        row."""
        if cpu_hits and not referenced:  # pinned first: taking GPU blocks below may demote into the CPU tier
            self.tier.pin_many([c for _, c in cpu_hits])
        if referenced:
            pass
        elif len(hits) > 8:
            h = np.array(hits, dtype=np.int64)
            gref = self.gpu.ref
            self.cache.evictor.discard_many(h[gref[h] == 0])
            gref[h] += 1
        elif hits:
            ref = self.gpu.ref_mv
            evictor = self.cache.evictor
            for b in hits:
                if ref[b] == 0:
                    evictor.discard(b)
                ref[b] += 1
        m = nblocks - len(hits)
        new = self.gpu.take_few(m) if m <= 4 and m <= self.gpu.nfree else self.blocks.take(m)
        if cpu_hits:
            hits, new = self.reg.promote(hits, cpu_hits, new)
        tb = self.t
        row = tb.new_row(seq_id)
        tb.ns_of[row] = namespace
        tb.ntok0[row] = -1  # every position is handed out in this step
        if nblocks > tb.table.shape[1]:
            tb.ensure_cols(nblocks)
        v = tb.mvs or tb.views()
        if nblocks <= 4:
            table = v.table
            for c, b in enumerate(hits):
                table[row, c] = b
            for c, b in enumerate(new, len(hits)):
                table[row, c] = b
        else:
            trow = tb.table[row]
            trow[: len(hits)] = hits
            trow[len(hits) : nblocks] = new
        v.ntok[row] = n
        v.nblk[row] = nblocks
        v.nreg[row] = v.pend[row] = len(hits)
        if nnull:
            v.nrel[row] = nnull
        if self.cache is not None:
            bs = self.bs
            if self.cache.intern(namespace) and len(self.cache.roots) > self.cache.sweep_at:
                self.reg.release_namespaces()  # bounded state per tenant (amortised O(1) per new namespace)
            tb.ccid[row], tb.ckey[row] = chain
            if defer:
                self.reg.keys_memo = None
            else:
                self.reg.fill_prompt(row, arr if arr.size == n else arr[:n], new, len(hits))  # (a chunk: its tokens)
            if self.on_hits is not None and hits:
                self.on_hits(hits)
            self.query_tokens += arr.size  # (the whole prompt was looked up)
            self.hit_tokens += len(hits) * bs
            self.query_blocks += (arr.size - 1) // bs
            self.hit_blocks += len(hits)
            if cpu_hits:
                self.tier.hit_tokens += len(cpu_hits) * bs
                self.tier.hit_blocks += len(cpu_hits)
        return row

    # ------------------------------------------------------------------ batches
    def allocate_batch(self, seq_ids: list, prompts: list, la: int, namespaces: list,
                       chunks: list | None = None) -> PrefillBatch:
        self.reg.keys_memo = None  # (a failed allocate's: its prompt may have changed since)
        if self.cache is not None and self.cache.ndl:
            self.cache.flush()  # (the batch walk reads the map directly)
        self.t.check_new_ids(seq_ids)
        roots = self.batch_roots(namespaces)
        arrs = [_as_tokens(p, f"token_ids[{i}]") for i, p in enumerate(prompts)]
        walk = self.cache is not None and len(arrs) > 1  # sharing inside the batch: walked below instead
        if chunks is None:
            chunks = [None] * len(arrs)
        plans = [AllocPlan._make(self.plan(a, la, ns, r, not walk, True, c))
                 for a, ns, r, c in zip(arrs, namespaces, roots, chunks)]
        if walk:
            virt: dict = {}
            plans = [self.batch_walk(i, p, roots[i], virt, la, chunks[i]) for i, p in enumerate(plans)]
        need = sum(p.nblocks - len(p.hits) for p in plans)  # new blocks (CPU hits take one each) ...
        ref = self.gpu.ref
        reused = {h for p in plans for h in p.hits if h >= 0 and ref[h] == 0}
        if reused and getattr(self.cache.evictor, "num_parked", 0):  # pinned idle hits are not in num_free
            reused = {h for h in reused if not self.cache.evictor.parked[h]}
        need += len(reused)  # ... plus each evictable cached hit, once
        if need > self.blocks.num_free:
            raise OutOfBlocksError(
                f"the batch of {len(plans)} prompts needs {need} new blocks; {self.blocks.num_free} are free"
            )
        # ---- mutation: nothing below can fail
        if self.cache is not None:  # every planned hit first: no prompt of the batch evicts a later one's hit
            held = [h for p in plans for h in p.hits if h >= 0]
            if held:
                if reused:
                    self.cache.evictor.discard_many(np.array(sorted(reused), dtype=np.int64))
                if len(plans) == 1:  # (distinct blocks)
                    self.gpu.ref[held] += 1
                else:  # a block hit by several prompts gains one reference each
                    np.add.at(self.gpu.ref, np.array(held, dtype=np.int64), 1)
            pins = [c for p in plans if p.cpu_hits for _, c in p.cpu_hits]
            if pins:
                self.tier.pin_many(list(dict.fromkeys(pins)))
        rows: list[int] = []
        for s, ns, p in zip(seq_ids, namespaces, plans):
            arr, n, nblocks, hits, cpu_hits, chain = p.arr, p.n, p.nblocks, p.hits, p.cpu_hits, p.chain
            if hits and min(hits) < 0:
                hits, chain = self.resolve(hits, cpu_hits, chain, rows)
            rows.append(self.commit(s, ns, arr, n, nblocks, hits, cpu_hits, chain, referenced=True))
            if n < arrs[len(rows) - 1].size:  # a chunk: fork waits for the rest of the prompt
                self.t.partial[s] = arrs[len(rows) - 1].size
        nhit = [len(p.hits) + (len(p.cpu_hits) if p.cpu_hits else 0) for p in plans]
        return self.prefill_result(tuple(seq_ids), arrs, [p.n for p in plans], rows, nhit)

    def batch_roots(self, namespaces: list) -> list:
        """The namespace root of each prompt, new namespaces numbered in order of first appearance (as
        committing the batch interns them). Nones without prefix caching."""
        if self.cache is None:
            return [None] * len(namespaces)
        known = self.cache.roots
        new: dict[bytes, tuple[int, int]] = {}
        out = []
        for ns in namespaces:
            data = _encode_namespace(ns)
            r = known.get(data) or new.get(data)
            if r is None:
                r = new[data] = (-(len(known) + len(new) + 1), _xxh3(b"pagedkv-ns:" + data))
            out.append(r)
        return out

    def batch_walk(self, i: int, plan: AllocPlan, root: tuple, virt: dict, la: int = 0,
                   chunk: int | None = None) -> AllocPlan:
        """Prompt ``i``'s plan as it stands once the batch's earlier prompts are committed: the cache as it is
        plus ``virt`` (key -> (parent cid, tokens, encoded hit, cid)), the blocks those prompts register or
        promote. Walks the prompt as the lookup would (GPU, then the batch's blocks, then the CPU tier), then
        records in ``virt`` what committing it will register (as ``Registry.register`` would); with ``chunk`` only the
        hit plus that many tokens are held (and registered). Changes nothing else."""
        arr, n, nblocks = plan.arr, plan.n, plan.nblocks
        bs, cache, tier = self.bs, self.cache, self.tier
        width = 4 * bs
        cmap, ctok, cpcid, ccid = cache.map, cache.tok, cache.pcid, cache.cid
        data = arr.tobytes()
        pcid, pkey = root
        hits: list[int] = []
        cpu_hits: list = []
        after: list = []  # (cid, key) after each hit, and the key of each promotion recorded in virt (or None)
        for j in range((n - 1) // bs):
            d = data[j * width : (j + 1) * width]
            key = _xxh3(d, seed=pkey)
            b = cmap.get(key)
            if b is not None and cpcid[b] == pcid and ctok[b].tobytes() == d:
                hits.append(b)
                pcid, pkey = int(ccid[b]), key
                after.append((pcid, pkey, None))
                continue
            v = virt.get(key)  # (an earlier prompt's block, new or replacing an orphan under this key)
            if v is not None and v[0] == pcid and v[1] == d:
                hits.append(v[2])
                pcid, pkey = v[3], key
                after.append((pcid, pkey, None))
                continue
            c = tier.find_keyed(pcid, key, d) if tier is not None else -1
            if c < 0:
                break
            cpu_hits.append((len(hits) + len(cpu_hits), c))
            newc = int(self.cpu_id[0, c])
            promoted = b is None and v is None
            if promoted:  # the promoted block is cached on the GPU from then on
                virt[key] = (pcid, d, ~(i * _COL + j), newc)
            pcid, pkey = newc, key
            after.append((pcid, pkey, key if promoted else None))
        nhit = len(hits) + len(cpu_hits)
        if self.window is not None and chunk is not None and nhit:  # the hit cut of plan (fit_hit), as allocate
            h = self.fit_len(nhit, n, la, chunk)
            if h < nhit:
                for _, _, k in after[h:]:
                    if k is not None:
                        del virt[k]  # (a promotion past the cut: the block is this prompt's new one instead)
                cpu_hits = [(j, c) for j, c in cpu_hits if j < h]
                hits = hits[: h - len(cpu_hits)]
                nhit = h
                pcid, pkey = after[h - 1][:2] if h else root
        chain = (pcid, pkey)
        if chunk is not None and nhit * bs + chunk < n:  # chunked prefill: the hit plus one chunk
            n = nhit * bs + chunk
            nblocks = -(-(n + la) // bs)
        for j in range(nhit, n // bs):  # what committing it registers: its new full blocks, chained
            if pcid == 0:
                break
            d = data[j * width : (j + 1) * width]
            key = _xxh3(d, seed=pkey)
            other = cmap.get(key)
            v = virt.get(key)
            if v is not None:  # (an earlier prompt of the batch registers it)
                if v[0] == pcid and v[1] == d:
                    pcid, pkey = v[3], key
                else:
                    pcid = 0
            elif other is None or (ctok[other].tobytes() == d and cpcid[other] != pcid and (
                    cache.live_parent(pcid, pkey) or virt.get(pkey, (0,) * 4)[3] == pcid)):
                # (registration replaces an orphan when its own parent is the content reached: PrefixCache.register)
                t = tier.find_keyed(pcid, key, d) if tier is not None and other is None else -1
                # (a content id of its own, distinct from every real one, for the batch's later walks)
                newc = int(self.cpu_id[0, t]) if t >= 0 else cache.serial + 1 + len(virt)
                virt[key] = (pcid, d, ~(i * _COL + j), newc)
                pcid, pkey = newc, key
            elif cpcid[other] == pcid and ctok[other].tobytes() == d:
                pcid, pkey = int(ccid[other]), key
            else:
                pcid = 0
        return AllocPlan(arr, n, nblocks, hits, cpu_hits or None, chain, 0)

    def resolve(self, hits: list, cpu_hits, chain: tuple, rows: list) -> tuple[list, tuple]:
        """Planned hits on blocks of the batch's committed prompts -> their block ids (one more reference each).
        When the prompt's last hit is one of them, its chain continues from the content that block is cached as
        (its real content id; the plan only knew a stand-in)."""
        table, ref = self.t.table, self.gpu.ref
        out = []
        for h in hits:
            if h < 0:
                i, c = divmod(~h, _COL)
                h = int(table[rows[i], c])
                ref[h] += 1
            out.append(h)
        last_is_cpu = bool(cpu_hits) and cpu_hits[-1][0] == len(hits) + len(cpu_hits) - 1
        if hits[-1] < 0 and not last_is_cpu:
            cid = int(self.cache.cid[out[-1]])
            chain = (cid, int(self.cache.key[out[-1]])) if cid else (0, 0)
        return out, chain

    def prefill_result(self, seq_ids: tuple, arrs: list, ntoks: list, rows: list, nhit: list) -> PrefillBatch:
        """The flat prefill metadata of committed allocations (see :class:`PrefillBatch`): ``ntoks[i]`` tokens
        held by prompt ``i``, ``nhit[i]`` of its blocks hit. O(tokens) numpy; a batch of one takes a shorter path
        (numpy's fixed costs dominate there)."""
        bs = self.bs
        b = len(rows)
        if b == 1:
            row, n, c = rows[0], ntoks[0], nhit[0] * bs
            pos = np.arange(c, n, dtype=np.int64)
            table = self.t.table[row]
            slots = table[pos // bs] * np.int64(bs) + pos % bs
            width = self.fixed_w or int(self.t.nblk[row])
            return PrefillBatch(seq_ids, _frozen(np.array([c], np.int32)), _frozen(np.array([0, n - c], np.int32)),
                                _frozen(arrs[0][c:n].copy()), _frozen(pos), _frozen(slots),
                                _frozen(table[None, :width].copy()), _frozen(np.array([n], np.int32)))
        r = np.array(rows, dtype=np.int64)
        n = np.array(ntoks, dtype=np.int64)
        cached = np.array(nhit, dtype=np.int64) * bs
        q = n - cached
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        t = int(qsl[-1])
        pos = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - cached, q)
        blk, off = np.divmod(pos, bs)
        slots = self.t.table[np.repeat(r, q), blk] * np.int64(bs) + off
        toks = np.concatenate([a[c:z] for a, c, z in zip(arrs, cached.tolist(), n.tolist())]) if b \
            else np.zeros(0, np.int32)
        width = self.fixed_w or (int(self.t.nblk[r].max()) if b else 0)
        tables = self.t.table[r, :width] if b else np.zeros((0, width), np.int32)
        return PrefillBatch(seq_ids, _frozen(cached.astype(np.int32)), _frozen(qsl.astype(np.int32)),
                            _frozen(toks.astype(np.int32, copy=False)), _frozen(pos),
                            _frozen(slots), _frozen(tables), _frozen(n.astype(np.int32)))
