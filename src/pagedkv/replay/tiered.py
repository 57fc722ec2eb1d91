"""Tiered replay: the prefix cache (GPU, CPU tier) of a real manager, plus a disk tier and a shared tier below it,
modelled as bounded LRU maps of block keys (no bytes), in sequence mode.

How the tiers are wired (issue 24; the same wiring the engine will have):

- **GPU and CPU** are the manager's own (:class:`pagedkv.BlockManager`, ``cpu_prefix_cache=True`` when a CPU
  capacity is given): its ``allocate`` returns the GPU + CPU hit, its stats the CPU part.
- **disk** takes what falls out of the tier above: each block the CPU tier evicts (its ``BlockRemoved`` event,
  medium CPU), or, without a CPU tier, each block the GPU evicts (``BlockRemoved``, medium GPU), is *demoted*
  to disk. The disk tier is **inclusive** like the CPU tier: a block loaded from it stays there.
- **shared** is **written through**: every block that enters the GPU prefix cache (``BlockStored``, medium GPU)
  is stored in it at once, as a replica storing to Redis / a shared directory would. It is inclusive too.
- **Lookup** walks the prompt's full blocks GPU -> CPU -> disk -> shared block by block: the manager answers the
  GPU + CPU prefix, then from the first block it does not hold each next block is looked up in disk, then in
  shared, and the walk stops at the first block no tier holds (at most ``(n - 1) // block_size`` blocks, one
  token always left to compute, as the manager does). A block found in a lower tier is loaded into the GPU: in
  the manager it is then a block like a computed one (it enters the GPU cache), so the manager's state does not
  depend on where a block came from. A block the walk does not reach is not counted even if a tier holds it.
- Both lower tiers follow :class:`pagedkv.tiers.DiskBackend`'s eviction rules (checked against a real
  DiskBackend in ``tests/test_replay_tiers.py``): ``tier_order="chain"`` (the default, :class:`ChainTier`, as
  the DiskBackend given each block's parent): blocks whose parent left go first, then leaves, least recently
  used first (a chain's tail before its head); ``"lru"`` (:class:`LruTier`, as before issue 34): a put of a new
  block first evicts least recently used blocks until it fits. Either way a read or a re-put of a present block
  makes it the most recent, and a put into a tier of zero capacity stores nothing (DiskBackend: TOO_LARGE).
  Each block's parent comes from the manager's ``BlockStored`` events. Capacities are in tokens
  (``capacity // block_size`` blocks).
  The order of the names in a batch is the wiring's: a chain of a prompt is loaded and written through children
  first, so a parent is always at least as recent as its children (as in the CPU tier) and LRU evicts a chain
  from its tail; demotions arrive in the order the tier above evicts (the GPU and the CPU tier evict tails first).

Each request is walked before its own evictions and stores reach the lower tiers (a lookup precedes the
allocation), then the events of its allocation and step are applied in order. Per request: one allocate and one
free, the chained keys of its blocks past the manager's hit (O(prompt tokens) hashing when a lower tier is
non-empty), O(1) dict operations per looked-up, demoted and stored block.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ..errors import InvalidArgumentError
from ..events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from ..blocks.prefix_cache import block_hashes
from ..tiers.chain_order import ChainOrder
from .point import PointResult, make_manager, setting, tier_figures
from .trace import Trace

__all__ = ["ChainTier", "LruTier", "replay_tiered"]


class LruTier:
    """A bounded LRU set of block keys with :class:`pagedkv.tiers.DiskBackend`'s eviction rules (see the module
    docstring); ``capacity`` in blocks (0: stores nothing). Read-only public state: ``capacity``, ``len()``,
    ``stored``, ``evictions``, ``hits``. O(1) per key (plus the evictions)."""

    __slots__ = ("_capacity", "_keys", "stored", "evictions", "hits")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"tier capacity must be an int >= 0 blocks, got {capacity!r}")
        self._capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stored = self.evictions = self.hits = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        """Membership without touching the order (a probe, as ``exists_many``)."""
        return key in self._keys

    def keys(self) -> list[int]:
        """The held keys, least recently used first. O(len)."""
        return list(self._keys)

    def read_many(self, keys) -> int:
        """Loads, in order: each held key becomes the most recent; returns how many were held."""
        d, got = self._keys, 0
        for k in keys:
            if k in d:
                d.move_to_end(k)
                got += 1
        self.hits += got
        return got

    def put_many(self, keys, evicted: list | None = None) -> None:
        """Store ``keys`` in order: a present one becomes the most recent; a new one evicts the least recently
        used keys until it fits (nothing is stored in a tier of zero capacity). ``evicted``: a list the evicted
        keys are appended to, in eviction order."""
        cap = self._capacity
        if not cap:
            return
        d = self._keys
        for k in keys:
            if k in d:
                d.move_to_end(k)
                continue
            if len(d) >= cap:
                gone = d.popitem(last=False)[0]
                if evicted is not None:
                    evicted.append(gone)
                self.evictions += 1
            d[k] = None
            self.stored += 1

    def check_invariants(self) -> None:
        if len(self._keys) > self._capacity:
            raise AssertionError(f"LruTier holds {len(self._keys)} keys over its capacity {self._capacity}")
        if self.stored - self.evictions != len(self._keys):
            raise AssertionError("LruTier: stored - evictions != held keys")


class ChainTier:
    """A bounded set of block keys with :class:`pagedkv.tiers.DiskBackend`'s chain-aware eviction (see the module
    docstring and :class:`pagedkv.tiers.chain_order.ChainOrder`), ``capacity`` in blocks: a put that would evict
    its own parent is refused, and so are its descendants' puts while it stays refused (remembered: the last
    4096). The same interface as :class:`LruTier` (``put_many`` takes each key's parent); ``keys()`` in eviction
    order, the next victim first. O(log n) per key."""

    __slots__ = ("_capacity", "_order", "_refused", "stored", "evictions", "hits", "refused")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"tier capacity must be an int >= 0 blocks, got {capacity!r}")
        self._capacity = capacity
        self._order = ChainOrder()
        self._refused: dict = {}
        self.stored = self.evictions = self.hits = self.refused = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_orphans(self) -> int:
        """Held blocks whose parent left the tier (no load reaches them; evicted first)."""
        return self._order.num_orphans

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: int) -> bool:
        return key in self._order

    def keys(self) -> list[int]:
        """The held keys, the next to be evicted first. O(n log n)."""
        return self._order.eviction_order()

    def detached(self) -> int:
        """Held blocks with a parent this tier does not hold (orphans, and suffixes whose head lives elsewhere or
        nowhere). O(n)."""
        o = self._order
        return sum(1 for k in o if (p := o.parent(k)) is not None and p not in o)

    def read_many(self, keys) -> int:
        o, got = self._order, 0
        for k in keys:
            if k in o:
                o.touch(k)
                got += 1
        self.hits += got
        return got

    def put_many(self, keys, evicted: list | None = None, parents=None) -> None:
        """Store ``keys`` in order, ``parents[i]`` the parent of ``keys[i]`` (None: a root or unknown)."""
        cap = self._capacity
        if not cap:
            return
        o, refused = self._order, self._refused
        for i, k in enumerate(keys):
            p = None if parents is None else parents[i]
            if k in o:
                o.touch(k)
                continue
            if p is not None and p in refused and p not in o:
                self._refuse(k)
                continue
            cut = False
            while len(o) >= cap:
                v = o.victim(k)
                if v is None or v == p:
                    cut = True
                    break
                o.remove(v)
                if evicted is not None:
                    evicted.append(v)
                self.evictions += 1
            if cut:
                self._refuse(k)
                continue
            refused.pop(k, None)
            o.add(k, p)
            self.stored += 1

    def _refuse(self, k: int) -> None:
        self.refused += 1
        self._refused[k] = None
        if len(self._refused) > 4096:
            del self._refused[next(iter(self._refused))]

    def check_invariants(self) -> None:
        if len(self._order) > self._capacity:
            raise AssertionError(f"ChainTier holds {len(self._order)} keys over its capacity {self._capacity}")
        if self.stored - self.evictions != len(self._order):
            raise AssertionError("ChainTier: stored - evictions != held keys")
        self._order.check_invariants()


def replay_tiered(trace: Trace, capacity_tokens: int, *, block_size: int = 16, cpu_capacity_tokens: int = 0,
                  disk_capacity_tokens: int = 0, shared_capacity_tokens: int = 0, manager_cls=None,
                  impl: str = "pagedkv", progress=None, check_every: int = 0,
                  tier_order: str = "chain") -> PointResult:
    """Replay ``trace`` in sequence mode through GPU -> CPU -> disk -> shared (see the module docstring).

    The result's ``hit_tokens`` counts every tier; ``cpu_hit_tokens`` (None without a CPU tier),
    ``disk_hit_tokens`` and ``shared_hit_tokens`` (None without that tier) the parts served from each, so
    ``gpu_hit_rate`` is the rest. ``extra`` holds each lower tier's stores, evictions and final size.
    ``check_every`` > 0: check the manager's and the tiers' invariants every that many requests (tests).
    ``manager_cls`` must record KV events (``enable_kv_events``); default :class:`pagedkv.BlockManager`.
    ``tier_order``: ``"chain"`` (:class:`ChainTier`), ``"lru"`` (:class:`LruTier`, fed children first) or
    ``"lru-engine"`` (:class:`LruTier` fed as the engine writes: parents first, the disk tier before issue 34);
    ``extra`` then also holds
    each tier's blocks held past a block it lacks (``*_detached_held``: no load from it reaches them) and, with
    chain tiers, the blocks whose parent left (``*_orphans_held``) and the puts refused."""
    if tier_order not in ("chain", "lru", "lru-engine"):
        raise InvalidArgumentError(f"tier_order must be chain, lru or lru-engine, got {tier_order!r}")
    # lru-engine: plain LRU fed in the engine's order (a chain written parents first, loads read head first),
    # which is how the DiskBackend held blocks before issue 34 (a prompt's first blocks the oldest)
    rev = -1 if tier_order == "lru" else 1
    for name, v in (("disk_capacity_tokens", disk_capacity_tokens), ("shared_capacity_tokens",
                                                                     shared_capacity_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"{name} must be an int >= 0, got {v!r}")
    if manager_cls is None:
        from ..manager import BlockManager as manager_cls
    bs = block_size
    num_blocks = capacity_tokens // bs
    bm = make_manager(manager_cls, num_blocks, bs, cpu_capacity_tokens // bs, enable_kv_events=True,
                      max_kv_events=1 << 22)
    has_cpu = bool(setting(bm, "cpu_prefix_cache", False))
    tier_cls = ChainTier if tier_order == "chain" else LruTier
    disk = tier_cls(disk_capacity_tokens // bs)
    shared = tier_cls(shared_capacity_tokens // bs)
    chains = tier_order == "chain"
    parent_of: dict = {}  # chain key -> its parent's (from the BlockStored events): the chain tiers' parents
    demote_from = MEDIUM_CPU if has_cpu else MEDIUM_GPU
    limit = num_blocks - int(setting(bm, "watermark_blocks", 0) or 0)
    need = (-(-trace.input_lengths // bs)).tolist()
    lengths = trace.input_lengths.tolist()
    allocate, free, tokens, take_events = bm.allocate, bm.free, trace.tokens, bm.events.take
    step = bm.take_copy_plan if has_cpu else None
    hits = disk_hits = shared_hits = skipped = prompt = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, nb in enumerate(need):
        if progress is not None and not i & 511 and i:
            progress(512)
        if nb > limit:
            skipped += 1
            continue
        n = lengths[i]
        toks = tokens(i)
        h = allocate(i, toks) // bs
        lim = (n - 1) // bs
        k = h
        if k < lim and (len(disk) or len(shared)):
            keys = block_hashes(toks[: lim * bs], bs)
            from_disk, from_shared = [], []
            while k < lim:
                x = keys[k]
                if x in disk:
                    from_disk.append(x)
                elif x in shared:
                    from_shared.append(x)
                else:
                    break
                k += 1
            # the loads touch each tier children first: a parent stays at least as recent as its children
            disk_hits += disk.read_many(from_disk[::rev])
            shared_hits += shared.read_many(from_shared[::rev])
        hits += k
        if step is not None:
            step()
        free(i)
        for ev in take_events():
            t = type(ev)
            if t is BlockRemoved:
                if ev.medium == demote_from:
                    if chains:
                        disk.put_many(ev.block_hashes, parents=[parent_of.get(k) for k in ev.block_hashes])
                    else:
                        disk.put_many(ev.block_hashes)
            elif t is BlockStored:
                if ev.medium == MEDIUM_GPU:  # a chain, parent first: stored children first (see above)
                    hs = ev.block_hashes
                    ps = [ev.parent_block_hash] + hs[:-1]
                    parent_of.update(zip(hs, ps))
                    if chains:
                        shared.put_many(hs, parents=ps)  # (parents first, as the engine writes through)
                    else:
                        shared.put_many(hs[::rev])
            elif t is AllBlocksCleared:  # pragma: no cover - an overflow: the figures would be wrong
                raise RuntimeError("tiered replay: the manager's KV event buffer overflowed")
        prompt += n
        if check_every and not (i + 1) % check_every:
            bm.check_invariants()
            disk.check_invariants()
            shared.check_invariants()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    if progress is not None and need:
        progress(len(need) - ((len(need) - 1) // 512) * 512)
    res = PointResult(impl, "sequence", capacity_tokens, cpu_capacity_tokens, bs, requests=len(need) - skipped,
                      skipped=skipped, prompt_tokens=prompt, hit_tokens=hits * bs, seconds=seconds)
    for key, v in tier_figures(bm.stats, has_cpu).items():
        setattr(res, key, v)
    res.cpu_seconds = cpu_seconds
    res.disk_capacity_tokens = disk_capacity_tokens
    res.shared_capacity_tokens = shared_capacity_tokens
    res.disk_hit_tokens = disk_hits * bs if disk_capacity_tokens else None
    res.shared_hit_tokens = shared_hits * bs if shared_capacity_tokens else None
    for name, tier in (("disk", disk), ("shared", shared)):
        if tier.capacity:
            res.extra.update({f"{name}_stored": tier.stored, f"{name}_evictions": tier.evictions,
                              f"{name}_blocks_held": len(tier)})
            held = set(tier.keys())  # blocks held past a block the tier lacks (no load from it reaches them)
            res.extra[f"{name}_detached_held"] = sum(1 for k in held if parent_of.get(k) is not None
                                                     and parent_of[k] not in held)
            if chains:
                res.extra.update({f"{name}_orphans_held": tier.num_orphans, f"{name}_refused": tier.refused})
    return res
