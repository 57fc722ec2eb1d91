"""The CPU tier of the prefix cache: evicted GPU blocks demoted to the CPU pool, found again by prompts.

With ``BlockManager(..., num_cpu_blocks=N, cpu_prefix_cache=True)`` an unreferenced cached GPU block that is
evicted is *demoted*: its content (KV, token ids, identity) moves to a CPU block instead of being dropped. A
prompt whose cached prefix continues in the CPU tier gets those blocks back: each is *promoted* into a new GPU
block (a CPU->GPU copy), and counts in the hit. The CPU copy stays cached (the tier is inclusive), so a block
promoted and evicted again costs no second copy.

The CPU pool is shared with swap. A CPU block is free (in the pool's ring), held by swapped-out sequences
(refcount > 0), or cached by the tier (refcount 0, in ``map``). Swapping comes first: swap_out evicts tier
blocks, least recently used first, when the ring is short; the tier itself evicts its LRU block to make room
for a demotion and drops the demotion when every CPU block is held.

**Write-back** (``store_policy="write_back"`` with the tier on): a GPU eviction is a demotion here, so the blocks
that leave the node are the tier's own victims. The manager's store plans take the tier's next victims whose
content is not stored yet (:meth:`pin_for_store`: out of the evictor, in ``store_pins``) until their store
completes (:meth:`unpin_stored`: back at the evictor's most recently used end, a second chance, or to the free ring
if uncached meanwhile), so a block leaves the CPU pool only once it is stored (or its store failed).

Per CPU block, the tier uses the manager's CPU-side arrays: ``cpu_tok`` (token ids) and ``cpu_id`` rows
(content id, key, parent content id, parent key, namespace index), plus the ``key -> CPU block`` dict, an
:class:`~pagedkv.blocks.prefix_cache.LRUEvictor` over the unpinned tier blocks and a GPU-sized int32 array ``fresh``.

**The copies of a step** are part of the manager's one ordered copy plan (``BlockManager.take_copy_plan``):
every call appends its copies when it makes them, so a demotion (GPU -> CPU) or promotion (CPU -> GPU) sits
among the step's swap-outs, swap-ins and copy-on-writes in call order, and within a call in the order it makes
them (an eviction's demotion before its block is reused). The engine executes the plan in that order, then the
forward::

    calls   swap_out(A)          allocate(B): evicts g, promotes into g     swap_in(C)
    plan    GPU>CPU A's blocks   GPU>CPU g -> c1      CPU>GPU c0 -> g       CPU>GPU C's blocks

This is the one place the order and why it is safe are stated (docs/design.md and docs/engine-contract.md
repeat it for readers of the docs):

- *Call order.* The bookkeeping moves a block's content the moment a copy is recorded and hands a block to a new
  use (a copy destination, new slots) only after every earlier use of its content is recorded. Executed in call
  order, when a copy runs every block holds what the bookkeeping said when that copy was recorded.
- *Nothing reads the forward's KV.* The forward runs after every copy of the plan, so no copy may read KV it
  writes: a block cached in the current step (``fresh``: stamped when registered or adopted, compared with the
  serial :meth:`end_step` advances) is dropped, never demoted; and the manager refuses ``swap_out`` and ``fork`` of
  a sequence handed slots in the current step.
- *Pins.* The CPU blocks that pending demotions write and promotions read are pinned (out of the evictor, not
  free) until the plan is taken, so no block is written twice within a step's tier copies.

Any fixed order of kinds is unsafe: the order documented before (demotions, promotions, then swap-out, swap-in,
copy-on-write) let a promotion overwrite a GPU block that a swap-out of the same step had freed but not yet
copied, and a demotion or swap-out overwrite CPU blocks a swap-in had released but not yet copied.
"""

from __future__ import annotations

import collections

import numpy as np
import xxhash

from ..events import BlockRemoved, BlockStored
from ..blocks.pool import BlockPool
from ..blocks.evictor import LRUEvictor
from ..blocks.prefix_cache import PrefixCache, _stored_event

__all__ = ["CpuTier"]

DEMOTE, PROMOTE = 3, 4  # tags of the tier's parts in the manager's pending plan (CopyKind GPU_TO_CPU, CPU_TO_GPU)

_xxh3 = xxhash.xxh3_64_intdigest
_U64 = 2**64 - 1


class CpuTier:
    """Cached CPU blocks of the prefix cache (see the module docstring). Internal to pagedkv.

    **Shared state** (public attributes the manager's parts read; only this class changes them): ``map`` (dict
    key -> CPU block of the tier's cached blocks: a lookup probes it directly), ``pinned`` (CPU blocks read or
    written by pending copies, in pinning order), ``cpu_id`` (the manager's CPU blocks' identities, the array
    it was given), ``evictor`` (the LRU of unpinned cached CPU blocks)."""

    def __init__(self, pool: BlockPool, cpu_tok: np.ndarray, cpu_id: np.ndarray, cache: PrefixCache,
                 plan: list) -> None:
        self._pool, self._tok, self.cpu_id, self._cache = pool, cpu_tok, cpu_id, cache
        self.map: dict[int, int] = {}  # key -> CPU block
        self.evictor = LRUEvictor(pool.num_blocks)
        self.pinned: dict[int, None] = {}  # CPU blocks read or written by pending copies, in pinning order
        self.store_pins: dict[int, None] = {}  # CPU blocks a pending store plan reads (write-back), in pinning order
        self._plan = plan  # the manager's pending copy plan: (tag, src, dst) parts in call order
        cache.fresh = np.zeros(cache.cid.size, dtype=np.int32)  # step serial at which a GPU block was cached
        cache.fresh_serial = 1
        cache.tier = self
        self.demotions = self.promotions = self.evictions = self.dropped = 0
        self.hit_tokens = self.hit_blocks = 0

    def held(self) -> set:
        """The CPU blocks the tier holds: cached, or pinned by a pending copy or store (neither free nor
        referenced). O(blocks held)."""
        return set(self.map.values()) | set(self.pinned) | set(self.store_pins)

    def __len__(self) -> int:
        """Cached CPU blocks (pinned or not)."""
        return len(self.map)

    @property
    def num_evictable(self) -> int:
        return len(self.evictor)

    # ------------------------------------------------------------------ lookup
    def find_keyed(self, pcid: int, key: int, data: bytes) -> int:
        """The CPU block caching ``data`` after parent content ``pcid`` (``key``, computed by the GPU lookup, is its
        key), or -1. A hit verifies the stored tokens and the parent content id: a hash collision costs a miss."""
        c = self.map.get(key, -1)
        if c >= 0 and (self.cpu_id[2, c] != pcid or self._tok[c].tobytes() != data):
            return -1
        return c

    def content(self, c: int) -> tuple[int, int, int, int, int]:
        """(cid, key, pcid, parent key, namespace index) of CPU block ``c``."""
        i = self.cpu_id[:, c].tolist()
        return i[0], i[1] & _U64, i[2], i[3] & _U64, i[4]

    # ------------------------------------------------------------------ promotion (CPU -> GPU)
    def pin_many(self, cs: list[int]) -> None:
        """Keep the cached CPU blocks ``cs`` (distinct) out of the evictor until :meth:`end_step`: they are the
        sources of promotions about to be recorded, and taking GPU blocks may demote into the tier meanwhile."""
        new = [c for c in cs if c not in self.pinned]
        arr = np.array(new, dtype=np.int64)
        self.evictor.discard_many(arr[self.evictor.stamp[arr] != 0])
        self.pinned.update(dict.fromkeys(new))

    def promote_many(self, cs: list[int], gs: list[int]) -> None:
        """Record the CPU -> GPU copies ``(cs[i], gs[i])``: the caller adopted each CPU block's identity and tokens
        into its GPU block; the CPU blocks are pinned already (:meth:`pin_many`)."""
        self._plan.append((PROMOTE, cs, gs))
        self.promotions += len(cs)

    # ------------------------------------------------------------------ demotion (GPU -> CPU)
    def demote(self, blocks: np.ndarray, cids: np.ndarray) -> None:
        """GPU ``blocks`` (just evicted; ``cids`` their content ids before eviction) move to the tier, in order.
        A block cached in the current step, or whose content the tier already holds, is not copied. CPU blocks
        come from the free ring first, then by evicting the tier's LRU blocks; when every CPU block is held by
        swapped sequences or pinned, the remaining demotions are dropped. A few numpy calls and C-level dict
        passes whatever the number of blocks."""
        cache = self._cache
        keep = cache.fresh[blocks] != cache.fresh_serial
        keys = cache.key[blocks]
        if self.map:
            keep &= ~np.fromiter(map(self.map.__contains__, keys.tolist()), dtype=bool, count=keys.size)
        if not keep.all():
            blocks, cids, keys = blocks[keep], cids[keep], keys[keep]
        k = blocks.size
        if not k:
            return
        pool = self._pool
        got = pool.take(min(k, pool.nfree))
        pool.ref[got] = 0
        if got.size < k and len(self.evictor):
            got = np.concatenate((got, self._forget(self.evictor.pop_many(min(k - got.size, len(self.evictor))))))
        if got.size < k:  # every CPU block is held by swapped sequences or pinned
            self.dropped += k - got.size
            blocks, cids, keys = blocks[: got.size], cids[: got.size], keys[: got.size]
            if not got.size:
                return
        self._tok[got] = cache.tok[blocks]
        ident = self.cpu_id
        ident[0, got] = cids
        ident[1, got] = keys.view(np.int64)
        ident[2, got] = cache.pcid[blocks]
        if cache.pkey is not None:
            ident[3, got] = cache.pkey[blocks].view(np.int64)
            ident[4, got] = cache.nsid[blocks]
        cl = got.tolist()
        self.map.update(zip(keys.tolist(), cl))
        self.pinned.update(dict.fromkeys(cl))
        self._plan.append((DEMOTE, blocks.tolist(), cl))
        self.demotions += len(cl)
        if cache.events is not None:
            for c in cl:
                cid, key, pcid, pk, ns = self.content(c)
                cache.emit(_stored_event([key], None if pcid < 0 else pk, self._tok[c].tolist(), cache.block_size,
                                          "CPU", cache.ns_list[ns] if cache.ns_list else None))

    def _forget(self, blocks: np.ndarray) -> np.ndarray:
        """Uncache tier ``blocks`` (popped from the evictor); returns them."""
        keys = (self.cpu_id[1, blocks].view(np.uint64)).tolist()
        collections.deque(map(self.map.__delitem__, keys), maxlen=0)
        self.cpu_id[0, blocks] = 0
        self.evictions += blocks.size
        if self._cache.events is not None and keys:
            self._cache.emit_removed(keys, self.cpu_id[4, blocks], "CPU")
        return blocks

    # ------------------------------------------------------------------ room for swap
    def evict(self, n: int) -> None:
        """Return ``n`` unpinned tier blocks (LRU first) to the pool's free ring (``n <= num_evictable``)."""
        if n > 0:
            self._pool.give(self._forget(self.evictor.pop_many(n)))

    # ------------------------------------------------------------------ write-back
    def next_victims(self, n: int) -> np.ndarray:
        """The tier's next ``n`` victims, least recently used first (without changing anything). O(n)."""
        return np.array(self.evictor.head(n), dtype=np.int64)

    def tokens_of(self, cs: np.ndarray) -> np.ndarray:
        """The token ids of CPU blocks ``cs`` (a copy, one row per block). O(len(cs) x block_size)."""
        return self._tok[cs].copy()

    def pin_for_store(self, cs: np.ndarray) -> None:
        """Keep the evictable cached blocks ``cs`` (distinct) out of the evictor until :meth:`unpin_stored`: a
        store plan copies them out, and a write-back block leaves the pool only once stored. O(len(cs))."""
        self.evictor.discard_many(cs)
        self.store_pins.update(dict.fromkeys(cs.tolist()))

    def unpin_stored(self, cs: np.ndarray) -> None:
        """A store plan of ``cs`` ended: each still cached and not pinned by a pending copy re-enters the evictor at
        its most recently used end (a second chance, as a GPU write-back block); one uncached meanwhile
        (reset_prefix_cache, a withdrawal) returns to the free ring; a copy-pinned one is left to :meth:`end_step`.
        O(len(cs))."""
        sp, pinned = self.store_pins, self.pinned
        for c in cs.tolist():
            del sp[c]
        loose = np.array([c for c in cs.tolist() if c not in pinned], dtype=np.int64)
        if loose.size:
            cached = self.cpu_id[0, loose] != 0
            self.evictor.push_many(loose[cached])
            self._pool.give(loose[~cached].astype(np.int32))

    # ------------------------------------------------------------------ the step's copies
    def end_step(self, dem: list[tuple[int, int]], pro: list[tuple[int, int]]) -> None:
        """The step's copies were taken (``dem``: its demotions, ``pro``: its promotions, in order): the pinned CPU
        blocks become evictable again (demoted ones most recently used), and the blocks cached from now on
        belong to the next step. O(copies)."""
        if self.pinned:
            # demotion destinations in demotion order (children first: the GPU evicts tail first), then promotion
            # sources children first too (recorded parent first): a parent is always more recent than its children
            order = dict.fromkeys(c for _, c in dem)
            order.update(dict.fromkeys(c for c, _ in reversed(pro)))
            order.update(self.pinned)
            if self.store_pins:  # (a pending store keeps them: unpin_stored places them)
                order = {c: None for c in order if c not in self.store_pins}
            pinned = np.fromiter(order, dtype=np.int64, count=len(order))
            cached = self.cpu_id[0, pinned] != 0
            self.evictor.push_many(pinned[cached])  # in pinning order: the most recently used last
            self._pool.give(pinned[~cached])  # uncached meanwhile (reset_prefix_cache): back to the free ring
            self.pinned.clear()
        self._cache.fresh_serial += 1

    def snapshot_events(self) -> list:
        """One BlockStored (medium CPU) per cached CPU block, parents before children."""
        blocks = sorted(self.map.values(), key=lambda c: self.cpu_id[0, c])
        cache, out = self._cache, []
        for c in blocks:
            cid, key, pcid, pk, ns = self.content(c)
            out.append(_stored_event([key], None if pcid < 0 else pk, self._tok[c].tolist(), cache.block_size, "CPU",
                                     cache.ns_list[ns] if cache.ns_list else None))
        return out

    def withdraw(self, blocks: np.ndarray) -> None:
        """Uncache tier ``blocks`` whose KV derives from KV nobody wrote (``free(seq, cache=False)``): unpinned ones
        return to the free ring now, pinned ones at :meth:`end_step`."""
        ev = self.evictor
        loose = blocks[ev.stamp[blocks] != 0]
        ev.discard_many(loose)
        self._forget(blocks)
        self.evictions -= blocks.size  # (not evictions)
        self._pool.give(loose.astype(np.int32))

    def clear(self) -> None:
        """Forget every cached CPU block (reset_prefix_cache); pinned ones return to the ring at end_step."""
        freed = list(self.evictor)
        self.evictor.discard_many(np.asarray(freed, dtype=np.int64))
        for c in self.map.values():
            self.cpu_id[0, c] = 0
        self.map.clear()
        self._pool.give(np.asarray(freed, dtype=np.int32))

    # ------------------------------------------------------------------ invariants
    def check(self, fail) -> None:
        pool, ident = self._pool, self.cpu_id
        ev = list(self.evictor)
        cached = set(self.map.values())
        if len(cached) != len(self.map):
            fail("CPU tier: a block under two keys")
        held = set(self.pinned) | set(self.store_pins)
        if set(ev) | held != cached | {c for c in held if not ident[0, c]}:
            fail("CPU tier: cached blocks are not exactly the evictable plus the pinned ones")
        if set(ev) & held:
            fail("CPU tier: a pinned block is evictable")
        for key, c in self.map.items():
            if pool.ref[c] != 0:
                fail(f"CPU tier: block {c} is cached and held by a swapped sequence")
            if not ident[0, c] or int(ident[1, c]) & _U64 != key:
                fail(f"CPU tier: block {c} does not carry the identity of its key")
            if self._cache.pkey is not None and ident[2, c] > 0 and \
                    _xxh3(self._tok[c].tobytes(), seed=int(ident[3, c]) & _U64) != key:
                fail(f"CPU tier: block {c}'s key is not the hash of its tokens after its parent")
        free = set(pool.free_ids().tolist())
        if free & (cached | held):
            fail("CPU tier: a cached or pinned block is in the free ring")
