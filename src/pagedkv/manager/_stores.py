"""Store plans by write policy (:class:`Stores`, a part of the manager; docs/external-kv.md, "Stores to tiers").

No I/O here: the part says which blocks to write to the storage tiers and pins each planned block (one more
reference) until its store completes, so that a store never reads a block that was evicted and reused::

    write_through   every content registered before the last take_copy_plan (its KV is written by that step's
                    forward), once: one vectorised compare of the content ids against two serials
    selective       a content once prefix hits took it ``min_hits`` times (the allocator's hit callback)
    write_back      the unreferenced cached blocks next in the evictor's order (the next to be evicted) whose
                    content is not stored yet, at most ``lookahead`` pinned at once: a block about to leave the
                    GPU prefix cache is written first (its eviction deferred until the store completes, after
                    which it re-enters the evictor at its most recently used end: a second chance).
                    **With the CPU tier** a GPU eviction is a demotion, not a loss: the plans take the CPU
                    tier's next victims instead (``StorePlan.medium == "CPU"``: CPU block ids, copied out of the
                    CPU KV), each kept out of the tier's evictor until its store completes
                    (:meth:`~pagedkv.tiers.cpu.CpuTier.pin_for_store`); the lookahead is the CPU pool's

Per-block state in flat arrays by block id (of the pool the plans read: the CPU pool's with write-back over the
CPU tier): the content id a successful store wrote from the block (``stored``), the content id a pending store
reads (``pinned``), and (selective) the hit counts. A content is known by its chained key across evictions
(evicted and computed again it gets a new content id): ``done`` remembers the keys successful stores wrote, one
slot per ``key % len(done)`` (direct-mapped, 8 slots per block of the pool, at least 4096: a later key may take an
older one's slot, whose content may then be planned once more), and a content whose key is there is not planned
again. Each plan carries its blocks' tokens and, when the manager keeps
parent keys (KV events on), each block's parent key, for the tiers' ``BlockStored`` events.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import InvalidArgumentError, UnknownStoreError

STORE_POLICIES = ("none", "write_through", "selective", "write_back")


class StorePlan(NamedTuple):
    """Blocks to write to the tiers (:meth:`BlockManager.take_store_plan`), pinned until
    :meth:`BlockManager.complete_store`: ``keys[i]`` is block ``block_ids[i]``'s chained content key (the
    namespace is part of the chain: its root's key)."""

    store_id: int
    block_ids: tuple
    keys: tuple
    #: the pool ``block_ids`` index: ``"GPU"``, or ``"CPU"`` (write-back over the CPU tier: copy them out of the
    #: CPU KV cache)
    medium: str = "GPU"
    #: each block's parent chain key (None for a namespace's first block); None when the manager keeps no parent
    #: keys (KV events off)
    parent_keys: tuple | None = None
    #: each block's token ids, an int32 array of shape (len(block_ids), block_size)
    token_ids: np.ndarray | None = None


class Stores:
    """The store plans of one manager (every KV cache group of a hybrid one: they share the prefix cache) over
    ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`), the prefix cache and an allocator whose ``on_hits``
    it sets (selective). ``policy``: one of :data:`STORE_POLICIES`; nothing is planned with ``"none"``."""

    def __init__(self, blocks, cache, alloc, store_policy: str = "none", store_min_hits: int = 1) -> None:
        self.blocks, self.cache, self.gpu = blocks, cache, blocks.gpu
        self.policy, self.min_hits = store_policy, store_min_hits
        self.plans: dict = {}  # store_id -> (blocks int64, their content ids at plan time)
        self.next_store = 1
        # write-back over the CPU tier: the plans read the tier's CPU blocks (a GPU eviction is a demotion)
        self.tier = getattr(cache, "tier", None) if store_policy == "write_back" else None
        n = self.gpu.num_blocks if self.tier is None else blocks.cpu.num_blocks
        if store_policy != "none":
            self.stored = np.zeros(n, np.int64)  # content id a successful store wrote from the block (0: none)
            self.pinned = np.zeros(n, np.int64)  # content id a pending store reads from the block (0: none)
            # write_through: contents registered after last_serial and before the last step's end (step_serial,
            # taken by take_copy_plan: their KV is written by that step's forward) are candidates
            self.last_serial = self.step_serial = cache.serial
            self.done = np.zeros(1 << max(12, (8 * n - 1).bit_length()), np.uint64)  # keys stored (see above)
        if store_policy == "write_back":
            # how many blocks may wait for a write-back at once (pinned, so not evictable meanwhile): 1/32 of the
            # pool, at least 16 (a step rarely evicts more before the next plan)
            self.lookahead = min(n, max(16, n // 32))
            self.npinned = 0
        if store_policy == "selective":
            self.hits = np.zeros(n, np.int64)  # prefix hits on the block's content ...
            self.hits_cid = np.zeros(n, np.int64)  # ... counted for this content id
            self.cand: list = []
            alloc.on_hits = self.count_hits

    def count_hits(self, hits: list) -> None:
        """The selective policy's hit counter (Allocator.on_hits): a block's content becomes a candidate once it
        has been hit ``min_hits`` times. O(hits)."""
        cid, hc, hcid, stored, m = self.cache.cid, self.hits, self.hits_cid, self.stored, self.min_hits
        for b in hits:
            c = cid[b]
            if hcid[b] != c:
                hcid[b] = c
                hc[b] = 0
            hc[b] += 1
            if hc[b] == m and stored[b] != c:
                self.cand.append(b)

    def end_step(self) -> None:
        """take_copy_plan ends a step: the contents registered so far are written by its forward."""
        self.step_serial = self.cache.serial

    def take_store_plan(self) -> StorePlan | None:
        if self.policy == "none":
            return None
        if self.tier is not None:
            return self._take_cpu_plan()
        cache = self.cache
        cid = cache.cid
        if self.policy == "write_through":
            b = np.flatnonzero((cid > self.last_serial) & (cid <= self.step_serial))
            self.last_serial = self.step_serial
        elif self.policy == "write_back":
            b = self._next_victims()
        else:
            b = np.unique(np.array(self.cand, dtype=np.int64))
            self.cand = []
            if b.size:
                b = b[(cid[b] != 0) & (self.hits_cid[b] == cid[b])]  # the content that was hit is still there
        if b.size:
            c = cid[b]
            b = b[(c != 0) & (self.stored[b] != c) & (self.pinned[b] != c) & self.unstored(cache.key[b])]
        if not b.size:
            return None
        ref = self.gpu.ref
        idle = b[ref[b] == 0]
        if idle.size:
            cache.evictor.discard_many(idle)
        ref[b] += 1
        c = cid[b].copy()
        self.pinned[b] = c
        sid = self.next_store
        self.next_store += 1
        self.plans[sid] = (b, c, cache.key[b])
        if self.policy == "write_back":
            self.npinned += b.size
        parents = None
        if cache.pkey is not None:
            pk = cache.pkey[b].tolist()
            parents = tuple(None if p < 0 else k for p, k in zip(cache.pcid[b].tolist(), pk))
        return StorePlan(sid, tuple(b.tolist()), tuple(cache.key[b].tolist()), "GPU", parents, cache.tok[b].copy())

    def _take_cpu_plan(self) -> StorePlan | None:
        """write_back over the CPU tier: its next victims whose content is not stored, pinned in the tier.
        O(lookahead)."""
        room = self.lookahead - self.npinned
        if room <= 0:
            return None
        tier = self.tier
        b = tier.next_victims(4 * self.lookahead)
        ident = tier.cpu_id
        if b.size:
            c = ident[0, b]
            b = b[(c != 0) & (self.stored[b] != c) & self.unstored(ident[1, b].view(np.uint64))][:room]
        if not b.size:
            return None
        c = ident[0, b].copy()
        tier.pin_for_store(b)
        self.pinned[b] = c
        sid = self.next_store
        self.next_store += 1
        keys = ident[1, b].view(np.uint64)
        self.plans[sid] = (b, c, keys)
        self.npinned += b.size
        parents = None
        if self.cache.pkey is not None:
            pk = ident[3, b].view(np.uint64).tolist()
            parents = tuple(None if p < 0 else k for p, k in zip(ident[2, b].tolist(), pk))
        return StorePlan(sid, tuple(b.tolist()), tuple(keys.tolist()), "CPU", parents, tier.tokens_of(b))

    def complete_store(self, store_id: object, success: object) -> None:
        if not isinstance(success, (bool, np.bool_)):
            raise InvalidArgumentError(f"success must be a bool, got {success!r}")
        try:
            b, c, keys = self.plans.pop(store_id)
        except (KeyError, TypeError):
            raise UnknownStoreError(f"no pending store {store_id!r} (completed already, or never planned)") from None
        self.pinned[b] = 0
        if self.policy == "write_back":
            self.npinned -= b.size
        if success:
            self.stored[b] = c
            self.done[keys % np.uint64(self.done.size)] = keys
        elif self.policy == "selective":
            self.hits[b] = 0  # (counted again from zero: planned again once hit min_hits more times)
        if self.tier is not None:
            self.tier.unpin_stored(b)
        else:
            self.blocks.release(b)

    def _next_victims(self) -> np.ndarray:
        """write_back: up to ``lookahead`` minus the blocks pinned now of the evictor's next victims whose content
        is not stored, scanning at most 4 x ``lookahead`` of them. O(lookahead)."""
        room = self.lookahead - self.npinned
        if room <= 0:
            return np.zeros(0, np.int64)
        ev = self.cache.evictor
        head = getattr(ev, "head", None)
        window = 4 * self.lookahead
        if head is not None:
            b = np.array(head(window), dtype=np.int64)
        else:
            it = iter(ev)
            b = np.fromiter((x for _, x in zip(range(window), it)), dtype=np.int64)
        if b.size:
            c = self.cache.cid[b]
            b = b[(c != 0) & (self.stored[b] != c) & self.unstored(self.cache.key[b])][:room]
        return b

    def unstored(self, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` (uint64) no successful store wrote, as far as ``done`` remembers. O(len(keys))."""
        return self.done[keys % np.uint64(self.done.size)] != keys

    # ------------------------------------------------------------------ audit
    def extra_refs(self) -> list:
        """The GPU blocks pending stores pin (one reference each; a CPU-tier plan's blocks are pinned in the
        tier, not referenced)."""
        return [] if self.tier is not None else [b for b, _, _ in self.plans.values()]

    def check(self, fail) -> None:
        """This part's invariants (the refcounts are checked with the tables'). O(pinned blocks)."""
        for sid, (b, c, _) in self.plans.items():
            if sid >= self.next_store or (self.pinned[b] != c).any():
                fail(f"store {sid}: its pins are not recorded")
        if self.policy != "none":
            pending = np.concatenate([b for b, _, _ in self.plans.values()]) if self.plans else np.zeros(0, np.int64)
            if np.count_nonzero(self.pinned) != pending.size or np.unique(pending).size != pending.size:
                fail("a block is pinned by two stores, or pinned by none")
            if self.policy == "write_back" and not 0 <= self.npinned == pending.size <= self.lookahead:
                fail("write_back: the pinned count is wrong or past its lookahead")
            if self.tier is not None and set(pending.tolist()) != set(self.tier.store_pins):
                fail("write_back over the CPU tier: the tier's store pins are not the pending plans' blocks")
