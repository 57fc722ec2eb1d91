"""The prefix cache's cold parts: what a plain request (allocate, decode, free) never calls.

:class:`CachePeriphery` is the base class of :class:`pagedkv.blocks.prefix_cache.PrefixCache` (it holds no state of
its own: every attribute is the cache's, see that module's docstring); the cache keeps the per-request hot path
(namespace roots, registration, runs, eviction) and this module holds the rest:

- KV events (:mod:`pagedkv.events`): recorded only after ``enable_events``; every emission point of the hot path
  tests ``self.events is not None`` first;
- held copies of cached contents (below; recording one, ``note_copy`` and ``forget_copies``, is on the hot path
  and stays in the cache): the inheritance of a content by a held copy when its block is evicted; orphans;
- swap-in's and the CPU tier's lookups by content id and their adoption of a known content;
- withdrawal on an aborted step (``free(cache=False)``), the namespace sweep, the reset and introspection.

Copies. A sequence that fills a block whose content another block caches already (held or idle) keeps its block
uncached (one block a key) and chains on from the cached content: an abort of the step (``free(cache=False)``)
then withdraws only contents its call cached anew, never one another sequence's chain runs through. It records
the copy: ``dupc[b]`` is the content id and ``dups`` lists the copies of each content id. When the cached block is
evicted, a copy that is still held takes its cache identity (same key, content id and parent: no KV event, no
demotion) and the evicted block leaves as usual, so the content stays findable while a sequence holds it. A record
is valid only while ``dupc[b]`` still names the content: an uncached block that returns to the free ring clears it
(:meth:`~pagedkv.blocks.prefix_cache.PrefixCache.forget_copies`), a copy that takes an identity clears it, a reset clears all. O(1) a copy;
an eviction pays one dict probe a block while copies are recorded.

The helpers this code shares with the hot module come through the cache's class attributes ``_encode`` (a
namespace's encoding), ``_stored_event`` and ``_group_of`` (a namespace's KV cache group, None for a bare one), so
that nothing here imports :mod:`pagedkv.blocks.prefix_cache` (which imports this module).
"""

from __future__ import annotations

import collections

import numpy as np

from ..events import AllBlocksCleared, BlockRemoved


class CachePeriphery:
    """The cold methods of :class:`~pagedkv.blocks.prefix_cache.PrefixCache` (its base class; no state)."""

    __slots__ = ()

    # ------------------------------------------- KV events (None when off: every emission point costs one test)
    def enable_events(self, max_events: int) -> None:
        """Record KV events (:mod:`pagedkv.events`), at most ``max_events`` until taken. Adds 12 bytes a block
        (each cached block's parent key and namespace, for the events and for a resynchronisation)."""
        n = self.cid.size
        self.events, self._ev_max = [], max_events
        self.pkey = np.zeros(n, dtype=np.uint64)
        self.nsid = np.zeros(n, dtype=np.int32)

    def _ns_index(self, namespace: object) -> int:
        data = self._encode(namespace)
        i = self._ns_ids.get(data)
        if i is None:
            if self._ns_free:
                i = self._ns_free.pop()
                self.ns_list[i] = namespace
            else:
                i = len(self.ns_list)
                self.ns_list.append(namespace)
            self._ns_ids[data] = i
            if self._group_of(namespace) is not None:
                self.grouped = True
        return i

    def emit(self, event) -> None:
        ev = self.events
        if len(ev) >= self._ev_max:  # overflow: drop the buffer; the next take answers with a full resync
            ev.clear()
            self._ev_lost = True
            self.event_overflows += 1
            return
        if not self._ev_lost:
            ev.append(event)

    def emit_stored(self, blocks: list[int], keys: list[int], pcid: int, pkey: int, namespace: object) -> None:
        """Record a BlockStored for a chain of newly cached ``blocks`` (and their parent key and namespace)."""
        nsi = self._ns_index(namespace)
        bl = np.asarray(blocks, dtype=np.int64)
        self.pkey[bl[0]] = pkey
        if bl.size > 1:
            self.pkey[bl[1:]] = np.asarray(keys[:-1], dtype=np.uint64)
        self.nsid[bl] = nsi
        self.emit(self._stored_event(list(keys), None if pcid < 0 else pkey, self.tok[bl].reshape(-1).tolist(), self.block_size,
                                 "GPU", namespace))

    def _stored_chains(self, blocks: np.ndarray, bl: list, keys: list, counts: np.ndarray, pcids: np.ndarray,
                       pkeys: np.ndarray, namespaces: list | None) -> None:
        """:meth:`emit_stored` for the chains of one :meth:`register_chains` call: the per-block arrays in a few
        vectorised writes, then one BlockStored per chain (a microsecond or so each)."""
        cl = counts.tolist()
        if len(cl) == len(keys):  # one block per chain
            self.pkey[blocks] = pkeys
        else:
            parent = np.empty(len(keys), dtype=np.uint64)
            parent[1:] = keys[:-1]
            heads = np.cumsum(counts) - counts
            parent[heads] = pkeys
            self.pkey[blocks] = parent
        nss = namespaces or [None] * len(cl)
        nsi = [self._ns_index(ns) for ns in nss]
        self.nsid[blocks] = np.repeat(np.array(nsi, dtype=np.int32), counts) if len(cl) != len(keys) else nsi
        toks = self.tok[blocks].tolist()
        bs, emit, pos = self.block_size, self.emit, 0
        for m, pc, pk, ns in zip(cl, pcids.tolist(), pkeys.tolist(), nss):
            if m == 1:
                emit(self._stored_event([keys[pos]], None if pc < 0 else pk, toks[pos], bs, "GPU", ns))
            else:
                emit(self._stored_event(keys[pos : pos + m], None if pc < 0 else pk,
                                   [t for row in toks[pos : pos + m] for t in row], bs, "GPU", ns))
            pos += m

    def emit_removed(self, keys: list, nsids, medium: str) -> None:
        """Record a BlockRemoved for ``keys`` (whose namespace indexes are ``nsids``): one event, or one per KV
        cache group, in order, when groups are in use."""
        if not self.grouped:
            self.emit(BlockRemoved(keys, medium))
            return
        by: dict = {}
        nsl = self.ns_list
        for k, i in zip(keys, nsids.tolist() if hasattr(nsids, "tolist") else nsids):
            ns = nsl[i]
            by.setdefault(self._group_of(ns), []).append(k)
        for g, ks in by.items():
            self.emit(BlockRemoved(ks, medium, g))

    def take_events(self) -> list:
        """The events since the last call, in order (and clear them); a full resync after an overflow."""
        if self._ev_lost:
            self._ev_lost = False
            self.events = []
            return [AllBlocksCleared()] + self.snapshot_events()
        out, self.events = self.events, []
        return out

    def snapshot_events(self) -> list:
        """One BlockStored per cached block, parents before children (content ids grow along a chain)."""
        cached = np.flatnonzero(self.cid)
        cached = cached[np.argsort(self.cid[cached], kind="stable")]
        bs, ns = self.block_size, self.ns_list
        out = []
        for b, k, p, pc, i in zip(cached.tolist(), self.key[cached].tolist(), self.pkey[cached].tolist(),
                                  self.pcid[cached].tolist(), self.nsid[cached].tolist()):
            out.append(self._stored_event([k], None if pc < 0 else p, self.tok[b].tolist(), bs, "GPU",
                                     ns[i] if ns else None))
        if self.tier is not None:
            out.extend(self.tier.snapshot_events())
        return out

    # ------------------------------------- held copies of cached contents (their eviction), and orphans
    def _heirs(self, blocks: np.ndarray) -> list:
        """For evicted ``blocks`` (still cached): ``(i, d)`` for each ``blocks[i]`` of which a held copy ``d``
        takes the identity (see Copies); each such content's record keeps its other copies. A few numpy calls
        over ``blocks`` and the recorded contents, then O(1) a block whose content has copies."""
        dups, dupc, ref, tok = self.dups, self.dupc_mv, self.pool.ref_mv, self.tok
        cid = self.cid_mv
        cids = self.cid[blocks]
        rec = np.fromiter(dups.keys(), dtype=np.int64, count=len(dups))
        out = []
        for i in np.flatnonzero(np.isin(cids, rec)).tolist():  # (a few numpy calls, however many blocks)
            b = int(blocks[i])
            c = cid[b]
            got = dups.pop(c, None)
            if not got:
                continue
            for n, d in enumerate(got):
                if dupc[d] == c and ref[d] > 0 and cid[d] == 0 and d != b and np.array_equal(tok[d], tok[b]):
                    out.append((i, d))
                    rest = [x for x in got[n + 1 :] if dupc[x] == c]
                    if rest:
                        dups[c] = rest
                    break
        return out

    def _inherit(self, blocks: np.ndarray, heirs: list, cids: np.ndarray) -> np.ndarray:
        """Give each heir ``d`` of ``heirs`` (from :meth:`_heirs`) the identity of the evicted ``blocks[i]`` whose
        content id was ``cids[i]`` (the map side of their eviction done). Returns the mask of ``blocks`` whose
        content left the cache. O(len(heirs))."""
        gone = np.ones(blocks.size, dtype=bool)
        mp = self.map
        for i, d in heirs:
            b = int(blocks[i])
            k = self.key_mv[b]
            if mp.setdefault(k, d) != d:  # (the key is cached again already: nothing to inherit)
                continue
            self.cid_mv[d], self.key_mv[d], self.pcid_mv[d] = int(cids[i]), k, self.pcid_mv[b]
            self.succ_mv[d] = -1
            self.dupc_mv[d] = 0
            if self.fresh is not None:  # (its KV is written by this step's forward: never demoted in this step)
                self.fresh[d] = self.fresh_serial
            if self.events is not None:
                self.pkey[d], self.nsid[d] = self.pkey[b], self.nsid[b]
            gone[i] = False
        return gone

    def _evict_with_heirs(self, blocks: np.ndarray, heirs: list) -> np.ndarray:
        """:meth:`evict_many`'s eviction of ``blocks`` when held copies inherit some of their contents: those
        contents stay cached (no removal event, no demotion, not counted as evictions)."""
        if self.ndl:
            self._forget_runs(blocks)
        else:
            collections.deque(map(self.map.__delitem__, self.key[blocks].tolist()), maxlen=0)
        cids = self.cid[blocks].copy()
        self.cid[blocks] = 0
        gone = self._inherit(blocks, heirs, cids)
        out = blocks[gone]
        self.evictions += int(out.size)
        if self.events is not None and out.size:
            self.emit_removed(self.key[out].tolist(), self.nsid[out], "GPU")
        if self.tier is not None and out.size:
            self.tier.demote(out, cids[gone])
        return blocks

    def _parked(self, block: int) -> bool:
        """Whether the idle ``block`` is parked by a pin (steering.SteeredEvictor): it cannot be evicted, so its
        content stays cached, and the pin holds that very block. O(1)."""
        parked = getattr(self.evictor, "parked", None)
        return parked is not None and bool(parked[block])

    def live_parent(self, pcid: int, pkey: int) -> bool:
        """Whether the content ``pcid`` (key ``pkey``) is the one a lookup reaches under ``pkey``: a namespace root,
        the GPU block cached under ``pkey``, or, with no GPU block under it, the CPU tier's. A cached block under
        the key chained from ``pkey`` whose parent is another content is then unreachable (an orphan: its parent
        was evicted; a content id is never reused). Map already flushed. O(1)."""
        if pcid < 0:
            return True
        p = self.map.get(pkey)
        if p is not None:
            return self.cid_mv[p] == pcid
        if self.tier is not None:
            c = self.tier.map.get(pkey)
            return c is not None and self.tier.cpu_id[0, c] == pcid
        return False

    def _uncache(self, block: int) -> None:
        """Forget the cached content of ``block`` (in the map, map flushed): unreferenced, it goes to the free
        ring; held, it stays with its sequences, uncached. A ``BlockRemoved`` event. O(1)."""
        k = self.key_mv[block]
        del self.map[k]
        if self.dups:
            self.dups.pop(self.cid_mv[block], None)
        self.cid_mv[block] = 0
        self.succ_mv[block] = -1
        if self.events is not None:
            self.emit_removed([k], [int(self.nsid[block])], "GPU")
        if self.pool is not None and self.pool.ref_mv[block] == 0:
            self.evictor.discard(block)
            self.pool.give(np.array([block], dtype=np.int32))

    # --------------------------------------------- swap-in and the CPU tier: lookups by content, adopting a content
    def find(self, pcid: int, pkey: int, data: bytes) -> tuple[int, int]:
        """``(block, key)``: the block caching ``data`` after parent ``(pcid, pkey)``, or -1, and the key of
        that content. O(1) plus one compare of ``data``."""
        if self.ndl:
            self.flush()
        key = self._block_key(pkey, data)
        b = self.map.get(key, -1)
        if b >= 0 and (self.pcid[b] != pcid or self.tok[b].tobytes() != data):
            return -1, key  # hash collision: never a hit
        return b, key

    def lookup(self, cid: int, key: int) -> int:
        """Block currently caching exactly the content ``cid`` (known by its ``key``), or -1."""
        if self.ndl:
            self.flush()
        b = self.map.get(key, -1)
        return b if b >= 0 and self.cid[b] == cid else -1

    def adopt(self, block: int, cid: int, key: int, pcid: int, pkey: int = 0, namespace: object = None) -> bool:
        """Cache ``block`` (uncached, ``tok`` written) as the existing content ``cid`` (swap-in of a block that
        was cached before it left: blocks chained after it stay reachable). False when the key is taken."""
        if self.ndl:
            self.flush()
        if key in self.map:
            return False
        self.cid[block], self.key[block], self.pcid[block] = cid, key, pcid
        self.map[key] = block
        if self.fresh is not None:
            self.fresh[block] = self.fresh_serial
        if self.events is not None:
            self.emit_stored([block], [key], pcid, pkey, namespace)
        return True

    def adopt_many(self, blocks: np.ndarray, cids: np.ndarray, keys: np.ndarray, pcids: np.ndarray,
                   pkeys: np.ndarray, nsids: np.ndarray) -> None:
        """:meth:`adopt` of several blocks (promotions from the CPU tier; namespaces as indexes of this cache's
        namespace list). A block whose key is taken stays uncached, unless the block holding the key is an orphan
        (another parent): that one is uncached instead."""
        if self.ndl:
            self.flush()
        kl = keys.tolist()
        mp = self.map
        free = np.fromiter((k not in mp for k in kl), dtype=bool, count=len(kl))
        if not free.all():
            # a key held by a block of another parent: an orphan (the promoted content's parent is the one a lookup
            # just reached), replaced as registration replaces one (PrefixCache.register)
            for i in np.flatnonzero(~free).tolist():
                o = mp[kl[i]]
                if self.pcid_mv[o] != pcids[i]:
                    if self.pool is not None and self._parked(o):  # a pinned orphan: chained under the live
                        if self.tok[o].tobytes() == self.tok[blocks[i]].tobytes():  # parent, the promoted block
                            self.pcid_mv[o] = pcids[i]  # its copy (as register)
                            self.note_copy(int(blocks[i]), self.cid_mv[o], kl[i], int(pcids[i]))
                            if self.events is not None:
                                self.pkey[blocks[i]], self.nsid[blocks[i]] = pkeys[i], nsids[i]
                        continue
                    self._uncache(o)
                    free[i] = True
        if not free.all():
            blocks, cids, keys, pcids, pkeys, nsids = (a[free] for a in (blocks, cids, keys, pcids, pkeys, nsids))
            kl = keys.tolist()
        self.cid[blocks], self.key[blocks], self.pcid[blocks] = cids, keys, pcids
        mp.update(zip(kl, blocks.tolist()))
        if self.fresh is not None:
            self.fresh[blocks] = self.fresh_serial
        if self.events is not None:
            for b, k, pc, pk, i in zip(blocks.tolist(), kl, pcids.tolist(), pkeys.tolist(), nsids.tolist()):
                self.emit_stored([b], [k], pc, pk, self.ns_list[i] if self.ns_list else None)

    # ------------------------------------------------------------------- abort, namespaces, reset, introspection
    def withdraw(self, blocks: list[int]) -> None:
        """Uncache ``blocks`` (cached, referenced: their KV was never written). O(len(blocks))."""
        if self.ndl:
            self.flush()
        keys = [int(self.key[b]) for b in blocks]
        for k in keys:
            del self.map[k]
        if self.dups:  # (their copies' records go with them: a swapped-out copy carries no withdrawn content)
            dupc = self.dupc_mv
            for c in self.cid[blocks].tolist():
                for d in self.dups.pop(c, ()):
                    if dupc[d] == c:
                        dupc[d] = 0
        self.cid[blocks] = 0
        self.succ[blocks] = -1
        if self.events is not None and keys:
            self.emit_removed(keys, self.nsid[blocks], "GPU")

    def release_namespaces(self, keep: set, cpu_ident: np.ndarray | None = None) -> int:
        """Forget the namespaces nothing uses: no cached block chains from their root (GPU, or CPU rows of
        ``cpu_ident`` with a content id: the tier's and swapped blocks), and their encoding is not in ``keep``
        (the namespaces of live sequences). A namespace seen again later gets a new root (a new content id):
        blocks cached under the old one cannot be hit then, and none exists. Then :attr:`sweep_at` becomes twice
        the namespaces kept (at least 1024), so that memory stays proportional to the namespaces in use and the
        sweeps cost O(1) amortised per new namespace. Returns how many were released. O(blocks + namespaces)."""
        cached = self.cid != 0
        pc = self.pcid[cached]
        used = set(pc[pc < 0].tolist())
        ns_used = set(self.nsid[cached].tolist()) if self.nsid is not None else set()
        if cpu_ident is not None:
            held = cpu_ident[0] != 0
            pc = cpu_ident[2, held]
            used.update(pc[pc < 0].tolist())
            if self.nsid is not None:
                ns_used.update(cpu_ident[4, held].tolist())
        before = len(self.roots)
        self.roots = {d: r for d, r in self.roots.items() if r[0] in used or d in keep}
        for d, i in list(self._ns_ids.items()):
            if i not in ns_used and d not in keep:
                del self._ns_ids[d]
                self.ns_list[i] = None
                self._ns_free.append(i)
        self.sweep_at = max(self._sweep_min, 2 * len(self.roots))
        return before - len(self.roots)

    def clear(self) -> list[int]:
        """Forget every cached content; return the unreferenced cached blocks (LRU first) for the free list."""
        if self.ndl:
            self.flush()
        self.succ[:] = -1
        self.dups.clear()
        self.dupc[:] = 0
        self.has_copies = False
        freed = list(self.evictor)
        self.evictor.discard_many(np.asarray(freed, dtype=np.int64))
        drop = getattr(self.evictor, "drop_pins", None)  # (pagedkv.retention.steering: pinned idle blocks are freed too)
        if drop is not None:
            freed += drop()
        self.cid[np.fromiter(self.map.values(), dtype=np.int64, count=len(self.map))] = 0
        self.map.clear()
        if self.events is not None:
            self.events.clear()  # nothing before the clear matters to a consumer any more
            self._ev_lost = False
            self.events.append(AllBlocksCleared())
        return freed

    def mapping(self) -> dict[int, int]:
        """``key -> block`` of every cached block: the map plus the dict-less blocks. Changes nothing (for checks
        and tests). O(cached blocks)."""
        out = dict(self.map)
        if self.ndl:
            b = np.flatnonzero(self.dl)
            out.update(zip(self.key[b].tolist(), b.tolist()))
        return out

