"""BlockManager: sequences -> block tables over a GPU pool (and a CPU pool for swapping).

Token and block regions of one sequence (block_size 4, sliding window off)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . . | . . . .
    table       [  17   |    3    |   42    |   8    ]
                 full     full      partial   lookahead-only block
                 ^ cached as soon as it is full   ^ num_tokens = 10   ^ reserved slots (num_lookahead_slots = 5)

With a sliding window of W tokens the leading blocks that no query can see any more are released and their
table positions hold ``NULL_BLOCK`` (-1)::

    table       [  -1   |   -1    |   42    |   8    |  11  ]
                 released by the window      still visible

This module is the facade: the public contract of every call, argument checks, and a call into the part that
does the work. The parts are objects with their own state, built by :meth:`BlockManager._wire`, each given the
objects it works on (no part reaches another's private state; dependencies point down only)::

    _alloc.py     Allocator                allocate / allocate_batch / lookup_prefix: plan, then commit
    _step.py      Stepper, AppendCalls     the append: plan (blocks, copy-on-write, releases), then commit;
                                           decode_step / append_slots / can_append_slots
    _small.py     Small, LifeCalls         the same append in plain Python for small batches; fork / free
    _offstep.py   OffStep                  swaps, retention, lookahead slots, reset, audit (off a request's path)
    _swap.py, _window.py, _registry.py     Swapper; sliding-window releases; prefix-cache registration, lookup
    _rows.py      SeqTables                seq_id -> row; per-sequence row arrays and the block-table matrix
    _external.py, _stores.py               external KV (loads, holds with leases); store plans by write policy
    parts.py      Surface, ManagerConfig   the named parts (bm.config, .external, .retention, .events) and the
                                           deprecated old names; shared with pagedkv.hybrid.GroupedManager
    blocks/       pool, prefix_cache, policy   per-block flat arrays (refcounts, free ring; keys; eviction order)

**KV layout.** A *slot* is ``block_id * block_size + offset``: the row of one token's K (or V) in a layer's KV
tensor viewed as ``(num_gpu_blocks * block_size, num_kv_heads, head_dim)`` (e.g. ``kv_cache[layer, i]
.flatten(0, 1)`` of a ``(layers, 2, num_gpu_blocks, block_size, heads, head_dim)`` tensor); position ``p`` of a
sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``. docs/engine-contract.md is the
engine builder's guide: the prefill and decode metadata, which token a decode step takes, what ``seq_lens``
counts, lookahead slots, fixed-width tables and the order of a step's copies.

**The engine contract** (docs/engine-contract.md): once per step, after the step's calls, the engine executes
:meth:`BlockManager.take_copy_plan` in order, then the step's forward, which writes the KV of every token of the
step before any attention of it reads it; a block full of known tokens is findable from the moment the call that
hands it out returns (burst sharing: a prompt admitted in the same step as an identical one shares its blocks).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from .._checks import as_tokens as _as_tokens, batch_args, check_int as _check_int
from ._alloc import Allocator
from ._registry import Registry
from ._rows import SeqTables, Views
from . import _small as small_path
from ._small import LifeCalls, Small
from ._step import AppendCalls, Stepper
from ._swap import Swapper
from ._window import Window
from ._external import External
from .parts import Events, ExternalKV, ManagerConfig, Surface, check_groups, init_signature, settings
from ._offstep import OffStep
from ._stores import Stores
from ..errors import InvalidArgumentError, OutOfBlocksError, SequenceStateError
from ..tiers.cpu import CpuTier
from ..kv_groups import FullAttentionSpec, SlidingWindowSpec
from ..retention.eviction import EvictionPolicy, make_evictor
from ..blocks.pool import BlockPool, Blocks
from ..blocks.prefix_cache import PrefixCache, _encode_namespace
from ..tiers.cpu import DEMOTE, PROMOTE
from ..types import (_EMPTY_PLAN, NULL_BLOCK, AllocStatus, CacheCopies, CopyKind, CopyPlan, PrefillBatch, PrefixHit,
                    Stats, StepDelta, StepResult, TableUpdates)

__all__ = ["AllocStatus", "BlockManager", "CacheCopies", "CopyKind", "CopyPlan", "NULL_BLOCK", "PrefillBatch",
           "PrefixHit", "StepDelta", "StepResult", "Stats", "TableUpdates"]

# tags of the parts of the pending copy plan (the Swapper's, Stepper's and Small's; the CPU tier's are DEMOTE, PROMOTE)
SWAP_OUT, SWAP_IN, COW = 0, 1, 2
_KIND_OF_TAG = (CopyKind.GPU_TO_CPU, CopyKind.CPU_TO_GPU, CopyKind.GPU_TO_GPU, CopyKind.GPU_TO_CPU,
                CopyKind.CPU_TO_GPU)


_GROUPED: list = []  # the many-group manager class (pagedkv.hybrid's GroupedManager, set when it is imported)


def set_grouped_class(cls: type) -> None:
    """Set the class ``BlockManager(..., kv_cache_groups=[several])`` builds (pagedkv.hybrid does, on import)."""
    _GROUPED[:] = [cls]


class BlockManager(Views, AppendCalls, LifeCalls, Surface, OffStep):
    """Paged KV-cache block manager (see module docstring).

    Args:
        num_gpu_blocks: blocks in the GPU pool (>= 1). Block ids are ``range(num_gpu_blocks)``.
        block_size: tokens per block (>= 1).
        num_cpu_blocks: blocks in the CPU pool used by swap_out/swap_in (>= 0).
        enable_prefix_caching: find full blocks again by content and share them between sequences.
        sliding_window: attention window in tokens (a query at position p sees (p - W, p]); blocks entirely
            before every future query's window are released. None disables it.
        watermark: fraction of GPU blocks that admission (can_allocate / can_swap_in) keeps free for running
            sequences, in [0, 1).
        enable_kv_events: record the prefix cache's KV events (:mod:`pagedkv.events`) for ``events.take()``.
        cpu_prefix_cache: a CPU tier of the prefix cache in the CPU pool (:mod:`pagedkv.tiers.cpu`): evicted GPU
            blocks are demoted to it and prompts get them back as hits; the engine then makes the copies that
            :meth:`take_copy_plan` returns once per step. Needs prefix caching and ``num_cpu_blocks``.
        max_kv_events: events kept until taken; past it the buffer is dropped and the next ``events.take()``
            returns a full resynchronisation (``AllBlocksCleared`` then a ``BlockStored`` per cached block).
        block_table_width: give every batch block table (``StepResult.block_tables``,
            ``PrefillBatch.block_tables``) exactly this many columns, NULL_BLOCK padded (CUDA graphs want fixed
            shapes); a call that would give a sequence more blocks raises TableWidthError, changing nothing.
            None (default): as wide as the batch's longest table. Set it to ``ceil((max_model_len +
            num_lookahead_slots) / block_size)``.
        eviction_policy: the order in which unreferenced cached blocks are evicted (:mod:`pagedkv.retention.eviction`):
            ``"lru"`` (default), ``"slru"`` (frequency-aware), ``"session"`` or ``"density"`` (both use
            ``retention.set_retention``'s session hint) or ``"arc"`` (adaptive replacement), any name registered in
            ``POLICIES``, an :class:`~pagedkv.EvictionPolicy` subclass, or a new instance of one made for
            ``num_gpu_blocks`` (priority classes get new ones of its class). Needs prefix caching for anything
            but ``"lru"``.
        pin_budget_blocks: the most distinct GPU blocks ``retention.pin_prefix`` may hold pinned (0: no pins).
        store_policy: which blocks ``external.take_store_plan`` hands out to write to the storage tiers:
            ``"none"`` (default), ``"write_through"`` (every block once registered in the prefix cache) or
            ``"selective"`` (a cached block once prefix hits took it ``store_min_hits`` times) or ``"write_back"``
            (the unreferenced cached blocks next to be evicted whose content is not stored yet, at most
            ``max(16, num_gpu_blocks // 32)`` pinned at once: written before they leave the GPU). Needs prefix
            caching for anything but ``"none"`` (docs/external-kv.md).
        store_min_hits: the selective policy's hit count (>= 1).
        kv_cache_groups: one spec per KV cache group (:class:`~pagedkv.FullAttentionSpec`,
            :class:`~pagedkv.SlidingWindowSpec`), in group index order; None: one full-attention group (or one
            sliding group with ``sliding_window``). One group is this class; several build the many-group
            manager, a subclass with the same calls (docs/guide/kv-groups.md): one block table per group over the
            one pool, results with a slot-mapping row and a block table per group.
        window_retention: (several groups, prefix caching) released sliding-group blocks outside the windows before
            useful points are evicted before any other cached block (:mod:`pagedkv.hybrid._retention`).
        retention_interval: window retention's spacing of useful points in tokens (None: 16 windows of the
            widest group; 0: none).
        grouped_results: whether the results' plain names are per group (``slot_mapping`` (G, T), G tables);
            None (default): with several groups. True builds the many-group manager for one group too.

    The surface: the per-step calls and read-only views here; the settings, external KV, retention and KV events
    as named parts (``bm.config``, ``bm.external``, ``bm.retention``, ``bm.events``: :mod:`pagedkv.manager.parts`).
    Sequences are keyed by any hashable ``seq_id`` chosen by the caller. Every method either completes or raises
    a :mod:`pagedkv.errors` exception and leaves the manager exactly as it was.
    """

    _steered = False  # priority classes and pins installed (the first set_retention priority or pin_prefix)
    _store = ("none", 1)  # (store policy, min hits); a KV cache group's manager (_sharing) stores nothing itself
    _write_through = False  # (take_copy_plan's one test)

    def __new__(cls, *args: object, kv_cache_groups: Sequence[object] | None = None,
                grouped_results: bool | None = None, **kwargs: object) -> "BlockManager":
        # One class for every model: several KV cache groups (or grouped_results=True) build the grouped manager, a
        # subclass (isinstance(x, BlockManager) holds); construction only, nothing on the per-step path.
        if cls is BlockManager and (grouped_results or (kv_cache_groups is not None and grouped_results is None
                                                        and len(check_groups(kv_cache_groups)) > 1)):
            cls = _GROUPED[0]
        return object.__new__(cls)

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        watermark: float = 0.01,
        enable_kv_events: bool = False,
        max_kv_events: int = 100_000,
        cpu_prefix_cache: bool = False,
        block_table_width: int | None = None,
        eviction_policy: str = "lru",
        pin_budget_blocks: int = 0,
        store_policy: str = "none",
        store_min_hits: int = 1,
        kv_cache_groups: Sequence[object] | None = None,
        window_retention: bool = True,
        retention_interval: int | None = None,
        grouped_results: bool | None = None,
    ) -> None:
        c = settings(num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching, sliding_window, watermark,
                     enable_kv_events, max_kv_events, cpu_prefix_cache, block_table_width, eviction_policy,
                     pin_budget_blocks, store_policy, store_min_hits, kv_cache_groups, window_retention,
                     retention_interval)  # (checked; InvalidArgumentError, nothing built)
        num_gpu_blocks, block_size, num_cpu_blocks, sliding_window = (c.num_gpu_blocks, c.block_size,
                                                                      c.num_cpu_blocks, c.sliding_window)
        max_kv_events, block_table_width, pin_budget_blocks = c.max_kv_events, c.block_table_width, c.pin_budget_blocks
        self._store = (c.store_policy, c.store_min_hits)
        self._write_through = c.store_policy == "write_through"
        self._bs = block_size
        self._gpu = BlockPool(num_gpu_blocks)
        self._cpu = BlockPool(num_cpu_blocks)
        self._cache = PrefixCache(num_gpu_blocks, block_size) if enable_prefix_caching else None
        self._policy, self._pin_budget = eviction_policy, pin_budget_blocks
        if isinstance(eviction_policy, EvictionPolicy):  # (a user's instance: made for this pool)
            if eviction_policy.stamp.size != num_gpu_blocks or len(eviction_policy):
                raise InvalidArgumentError(f"an eviction_policy instance must be new and made for num_gpu_blocks="
                                           f"{num_gpu_blocks} blocks; got one for {eviction_policy.stamp.size}")
            self._cache.evictor = eviction_policy
        elif eviction_policy != "lru":
            self._cache.evictor = make_evictor(eviction_policy, num_gpu_blocks, self._cache)
        if self._cache is not None and enable_kv_events:
            self._cache.enable_events(max_kv_events)
        self._kv_events = bool(enable_kv_events)
        # with prefix caching a swapped-out block keeps its tokens and cache identity (0: none) on the CPU side
        self._cpu_tok = np.zeros((num_cpu_blocks, block_size), np.int32) if enable_prefix_caching else None
        # cid, key, pcid, parent key, namespace index (the last two for KV events)
        self._cpu_id = np.zeros((5, num_cpu_blocks), np.int64) if enable_prefix_caching else None
        # the step's copies, (tag, src, dst) parts in call order, until take_copy_plan (the CPU tier appends too)
        self._copies: list = []
        self._tier = CpuTier(self._cpu, self._cpu_tok, self._cpu_id, self._cache, self._copies) \
            if cpu_prefix_cache else None
        if self._cache is not None and num_cpu_blocks and self._tier is None:
            # each GPU block says in which step it was cached (the CPU tier keeps this too): a swap-in that gets
            # one back in its step marks its rows (Swapper.swap_in). One int32 write a registered block
            self._cache.fresh = np.zeros(num_gpu_blocks, np.int32)
            self._cache.fresh_serial = 1
        self._watermark_blocks = c.watermark_blocks
        self._fixed_w = block_table_width or 0  # fixed width of batch block tables (0: the batch's longest)
        self._blocks = Blocks(self._gpu, self._cpu, self._cache, self._cpu_id, self._tier)
        self._wire(sliding_window)
        # (one attribute for the three: a manager's instance dict stays within CPython's shared-keys size, which
        # keeps the per-step path's attribute reads specialised)
        self._parts = (c, ExternalKV(self._ext, self._stores), Events(self._cache, self._kv_events))

    @classmethod
    def _sharing(cls, parts: "BlockManager", sliding_window: int | None) -> "BlockManager":
        """A manager of its own sequences and tables over the *shared parts* of ``parts`` (internal): the GPU and
        CPU pools with the prefix cache (one :class:`~pagedkv.blocks._blocks.Blocks`), the CPU tier and its CPU-side
        arrays, the pending copy list, the watermark and the table width are the same objects.
        :class:`pagedkv.HybridBlockManager` runs one per KV cache group; each call on one of them keeps every
        invariant of the shared parts except the pools' refcount totals, which the coordinator checks over all
        of them (``HybridSeqs.check``). O(1)."""
        self = cls.__new__(cls)
        for name in ("_bs", "_gpu", "_cpu", "_cache", "_kv_events", "_cpu_tok", "_cpu_id", "_copies", "_tier",
                     "_watermark_blocks", "_fixed_w", "_blocks"):
            setattr(self, name, getattr(parts, name))
        self._wire(sliding_window)
        return self

    _Window = Window
    """The class of the sliding-window part (a KV cache group with window retention: ``RetainingWindow``)."""

    def _wire(self, sliding_window: int | None) -> None:
        """Build this manager's own parts (empty tables) over the shared ones; each part gets what it works on::

            SeqTables ─┬─ Window ────┬─ Stepper      every part takes and releases blocks through Blocks
                       ├─ Registry ──┼─ Small        (pools, prefix cache, evictor); Stepper, Small and
                       │             └─ Allocator    Swapper append to the pending copy list
                       └─ Swapper
        """
        self._window = sliding_window
        self._hints: dict = {}  # seq_id -> (priority, session) given by set_retention, used by free
        # the one fast path (manager/_small.py): batches up to this size take the plain-Python step; 0: never (the
        # switch: small_path.SMALL_BATCH = 0 before building a manager, or _small_batch = 0 on one)
        self._small_batch = small_path.SMALL_BATCH
        bs, blocks, cache, tier, copies = self._bs, self._blocks, self._cache, self._tier, self._copies
        t = self._t = SeqTables(self._gpu.ref_mv, max(4, self._fixed_w))
        win = self._win = self._Window(t, blocks, sliding_window, bs)
        reg = self._reg = Registry(t, blocks, cache, tier, self._cpu_tok, self._cpu_id, bs, self._kv_events)
        self._step = Stepper(t, blocks, win, reg, cache, copies, bs, self._fixed_w)
        self._small = Small(t, blocks, reg, cache, copies, bs, self._fixed_w)
        self._alloc = Allocator(t, blocks, reg, cache, tier, self._cpu_id, bs, self._watermark_blocks,
                                self._fixed_w, sliding_window)
        self._ext = External(t, blocks, reg, self._alloc, cache, bs)
        self._stores = Stores(blocks, cache, self._alloc, *self._store)
        self._swap = Swapper(t, blocks, cache, tier, self._cpu_tok, self._cpu_id, copies)

    # ------------------------------------------------------------------ read-only state
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._bs

    @property
    def config(self) -> ManagerConfig:
        """The construction settings (:class:`~pagedkv.manager.parts.ManagerConfig`, frozen)."""
        return self._parts[0]

    @property
    def num_free_gpu_blocks(self) -> int:
        """Plain free GPU blocks plus unreferenced cached ones (which are evicted on demand), every group's."""
        return self._blocks.num_free

    def _check_group(self, group: object) -> None:
        if _check_int("group", group, 0) != 0:
            raise InvalidArgumentError(f"group must be < 1 (a BlockManager has one KV cache group), got {group}")

    def take_copy_plan(self) -> CopyPlan:
        """Every KV block copy of the step, in the order to execute them, and end the step. O(copies + rows).

        A *step* is the calls made since the previous ``take_copy_plan()``. The plan holds every copy those calls
        handed out, in call order (and in order within a call): swap-out and CPU-tier demotion copies (GPU ->
        CPU), swap-in and CPU-tier promotion copies (CPU -> GPU), copy-on-write copies (GPU -> GPU). The engine
        takes it once per step, after the step's calls, executes it in order (:meth:`CopyPlan.batches`), then
        runs the step's forward. The calls' own return values (``swap_out``/``swap_in`` pairs,
        ``StepResult.cow``) are the same copies; executing those lists in any fixed order of kinds is not safe
        (a swap-out frees GPU blocks a later promotion of the same step writes; a swap-in frees CPU blocks a
        later demotion or swap-out writes): execute the plan. Why its order is safe: :mod:`pagedkv.tiers.cpu`
        and docs/engine-contract.md.

        The first call also switches on the same-step checks: from then on ``swap_out`` and ``fork`` refuse a
        sequence that was handed slots in the current step (SequenceStateError: its KV is written only by the
        step's forward, after every copy of the plan). Until a plan is taken, copies accumulate.
        """
        parts = self._copies
        tier = self._tier
        if tier is not None:
            dem = [p for t, s, d in parts if t == DEMOTE for p in zip(s, d)]
            pro = [p for t, s, d in parts if t == PROMOTE for p in zip(s, d)]
            tier.end_step(dem, pro)
        elif self._cache is not None and self._cache.fresh is not None:
            self._cache.fresh_serial += 1
        if parts:
            plan = CopyPlan.build([(_KIND_OF_TAG[t], s, d) for t, s, d in parts])
            parts.clear()
        else:
            plan = _EMPTY_PLAN
        self._t.end_step()
        if self._write_through:
            self._stores.end_step()
        return plan

    @property
    def stats(self) -> Stats:
        """The counters since construction and the pools' readings now (:class:`pagedkv.Stats`). O(1)."""
        return Stats(
            (a := self._alloc).query_tokens,
            a.hit_tokens,
            a.query_blocks,
            a.hit_blocks,
            self._cache.evictions if self._cache is not None else 0,
            self._step.cow_copies + self._small.cow_copies,
            self._swap.swapped_out,
            self._swap.swapped_in,
            *((t.hit_tokens, t.hit_blocks, t.demotions, t.promotions, t.evictions, t.dropped)
              if (t := self._tier) is not None else (0, 0, 0, 0, 0, 0)),
            len(self._cache) if self._cache is not None else 0,
            len(t) if t is not None else 0,
            (b := self._blocks).num_free_cpu,
            1.0 - b.num_free / self._gpu.num_blocks,
        )

    # __len__, __contains__, seq_ids, num_tokens, is_swapped, block_table, table_rows, slot_mapping: Views (_rows.py)

    # ------------------------------------------------------------------ admission and allocation
    def can_allocate(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *, namespace: object = None,
                     num_new_tokens: int | None = None, num_external_tokens: int = 0) -> AllocStatus:
        """Whether a new prompt fits: NEVER if its blocks (plus lookahead) exceed the pool minus the watermark,
        LATER if they do not fit now, else OK. With prefix caching, full blocks it would share with live
        sequences are not counted. ``num_new_tokens`` (chunked prefill): LATER / OK count only the blocks of
        the prefix-cache hit plus that many further prompt tokens, as ``allocate(..., num_new_tokens=)`` takes
        them (NEVER still looks at the whole prompt: it could never be completed). With a sliding window and
        ``num_new_tokens``, NEVER looks at the most blocks the prompt holds at once in chunks of that size (the
        window's ``W - 1`` tokens plus a chunk: the window releases blocks as the chunks go), so a prompt longer
        than the pool is admitted; the hit is then cut where it and the first chunk would not fit in the pool.
        ``num_external_tokens=E`` (with ``num_new_tokens``): the hit, the E' external tokens ``allocate`` would
        keep and one chunk, as it takes them (docs/external-kv.md). O(prompt blocks)."""
        arr = _as_tokens(token_ids)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else _check_int("num_new_tokens", num_new_tokens, 1)
        e = 0 if type(num_external_tokens) is int and num_external_tokens == 0 else \
            self._ext.check_lookup(num_external_tokens, self._window)  # (a plain request stays out of _external)
        needed = -(-(arr.size + la) // self._bs)
        if self._alloc.peak(arr.size, la, k) > self._gpu.num_blocks - self._watermark_blocks:
            return AllocStatus.NEVER
        if self._cache is None:
            _encode_namespace(namespace)  # validate it all the same
            if k is not None and k < arr.size:
                needed = -(-(min(arr.size, (e and self._ext.kept(arr.size, 0, e)) + k) + la) // self._bs)
        else:
            root = self._cache.root(namespace, intern=False)
            hits, chain = self._reg.lookup(arr, root)
            if self._window is not None and k is not None:
                hits, _ = self._alloc.fit_hit(hits, chain, root, arr.size, la, k)
            if k is not None and len(hits) * self._bs + k < arr.size:
                h = len(hits) * self._bs
                needed = -(-(min(arr.size, h + (e and self._ext.kept(arr.size, h, e)) + k) + la) // self._bs)
            ref = self._gpu.ref
            needed -= sum(1 for b in hits if b >= 0 and ref[b] > 0)  # (a CPU-tier hit needs a GPU block)
            if self._steered and self._cache.evictor.num_parked:  # pinned idle hits: not in the free count
                needed -= sum(1 for b in hits if b >= 0 and self._cache.evictor.parked[b])
        if self.num_free_gpu_blocks - needed >= self._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER


    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                 namespace: object = None, num_new_tokens: int | None = None, num_external_tokens: int = 0) -> int:
        """Create the block table of a new sequence holding the prompt ``token_ids``, with blocks for
        ``num_lookahead_slots`` empty slots after it (as :meth:`can_allocate` counts them).

        Returns the number of leading prompt tokens whose KV is already cached (a multiple of block_size, less
        than ``len(token_ids)``; 0 without prefix caching): the engine computes positions from there on, and
        :meth:`lookup_prefix` predicts this number without allocating. ``namespace`` (None, str, bytes or int)
        isolates prefix-cache sharing, e.g. per tenant or LoRA adapter.

        With prefix caching the prompt's full blocks enter the cache before this call returns (burst sharing:
        an identical prompt allocated next, even in the same step, gets them as a hit; see the module docstring
        for the engine contract this relies on).

        Blocks come from the free ring first (oldest free first), then by evicting the least recently used
        cached block. Raises PromptTooLongError if the prompt can never fit, OutOfBlocksError if it does not fit
        now (admission control with the watermark is :meth:`can_allocate`'s job), TableWidthError if it needs
        more than ``block_table_width`` blocks. :meth:`allocate_batch` is the same for several prompts at once,
        with the prefill metadata gathered. O(prompt blocks).

        **Chunked prefill** (``num_new_tokens=k``, k >= 1): the prefix lookup runs on the whole prompt, then the
        sequence holds only the hit plus the next ``min(k, len(token_ids) - hit)`` prompt tokens (and the
        lookahead slots after them); ``num_tokens(seq_id)`` says how many. The rest of the prompt is appended
        chunk by chunk with :meth:`decode_step` (e.g. flat tokens with ``num_new_tokens=counts``), whose filled
        blocks enter the prefix cache as they fill; the engine computes each chunk's KV in the step that hands
        it out and samples only after the last one. Until the whole prompt is appended the sequence cannot be
        forked (SequenceStateError); it can be swapped out and in, and freed (``cache=False`` too). The
        PromptTooLongError and TableWidthError checks look at the whole prompt (with a
        sliding window PromptTooLongError looks at the most blocks held at once: see :meth:`can_allocate`). ::

            prompt   [ hit (cached) | chunk 1 ][ chunk 2 ][ chunk 3 ]
                       allocate(num_new_tokens=k)  decode_step  decode_step (last: sample)

        **External KV** (``num_external_tokens=E``, a multiple of block_size; docs/external-kv.md): the E tokens
        after the hit H (cut to whole blocks before the prompt's last token) arrive from outside (a storage tier,
        a prefill replica) instead of being computed. Returns ``H + E'`` (E' the tokens kept); with E' > 0 the
        sequence is LOADING: ``external.external_blocks`` names the blocks to fill, nothing past the hit is
        registered, and its prefill waits for ``external.finish_external``. With ``num_new_tokens=k`` it holds the
        hit, the E' tokens and one chunk of k. Not with a sliding window (InvalidArgumentError).
        """
        if num_external_tokens:
            return self._allocate_external(seq_id, token_ids, num_lookahead_slots, namespace, num_new_tokens,
                                           num_external_tokens)
        self._t.check_new_id(seq_id)
        la = num_lookahead_slots if type(num_lookahead_slots) is int and num_lookahead_slots >= 0 else \
            _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if num_new_tokens is None:
            k = None
        else:
            k = _check_int("num_new_tokens", num_new_tokens, 1)
            token_ids = _as_tokens(token_ids)
        arr, n, nblocks, hits, cpu_hits, chain, need = self._alloc.plan(token_ids, la, namespace,
                                                                        checked=k is not None, chunk=k)
        if need > self._gpu.nfree and need > self.num_free_gpu_blocks:
            raise OutOfBlocksError(
                f"prompt of {n} tokens needs {need} new blocks; {self.num_free_gpu_blocks} are free"
            )
        # mutation starts here; nothing below can fail
        self._alloc.commit(seq_id, namespace, arr, n, nblocks, hits, cpu_hits, chain, referenced=False)
        if k is not None and n < token_ids.size:
            self._t.partial[seq_id] = token_ids.size
        return (len(hits) + (len(cpu_hits) if cpu_hits else 0)) * self._bs

    def _allocate_external(self, seq_id, token_ids, num_lookahead_slots, namespace, num_new_tokens, e) -> int:
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else _check_int("num_new_tokens", num_new_tokens, 1)
        e = self._ext.check_external(e)
        if e and self._window is not None:
            raise InvalidArgumentError("num_external_tokens is not available with a sliding window")
        return self._ext.allocate(seq_id, token_ids, la, namespace, k, e)

    def allocate_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                       num_lookahead_slots: int = 0, *, namespaces: Sequence[object] | None = None,
                       num_new_tokens: Sequence[int] | None = None,
                       num_external_tokens: Sequence[int] | None = None) -> PrefillBatch:
        """Allocate B new sequences at once (``seq_ids[i]`` holds the prompt ``token_ids[i]``) and return their
        prefill metadata, flat: :class:`PrefillBatch` (the cached-token count of each, the tokens to compute
        with their positions and slots, query start offsets, block tables, sequence lengths).

        The same as ``allocate(seq_ids[i], token_ids[i], num_lookahead_slots, namespace=namespaces[i])`` for i
        in order, burst sharing included (a prompt finds the full blocks of the batch's earlier prompts, so two
        identical prompts share blocks exactly as two allocate calls would), except that it is all or nothing
        for the whole batch and that every prefix hit of the batch is secured before any block is taken (no
        prompt of the batch evicts a cached block a later one hits, which consecutive calls could do). Raises
        what :meth:`allocate` raises (DuplicateSequenceError also for an id repeated in the batch; a bad
        prompt's message names it ``token_ids[i]``) and changes nothing then; OutOfBlocksError when the batch
        as a whole does not fit now. ``namespaces``: None, or one namespace per prompt.

        Block tables are as wide as the batch's longest table, or ``block_table_width`` when the manager has
        one. Every returned array is read-only. O(total prompt blocks) Python work plus O(tokens) numpy work.

        ``num_new_tokens`` (chunked prefill): None, or one chunk size (>= 1) per prompt, as for :meth:`allocate`;
        the batch's metadata then covers each sequence's hit plus its chunk (``seq_lens`` the held tokens).

        ``num_external_tokens``: None, or one count per prompt (as :meth:`allocate`'s); with any count > 0 the
        batch is checked as a whole, then allocated as consecutive :meth:`allocate` calls (sharing inside the
        batch as those calls share), and each LOADING sequence's metadata starts at its ``H + E'`` (its prefill
        waits for ``external.finish_external``).
        """
        seq_ids, prompts, namespaces, chunks = batch_args(seq_ids, token_ids, namespaces, num_new_tokens)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if num_external_tokens is not None:
            if isinstance(num_external_tokens, (int, np.integer)) or len(num_external_tokens) != len(seq_ids):
                raise InvalidArgumentError("num_external_tokens must be None or one count per prompt")
            exts = [self._ext.check_external(e) for e in num_external_tokens]
            if any(exts):
                if self._window is not None:
                    raise InvalidArgumentError("num_external_tokens is not available with a sliding window")
                ids = tuple(seq_ids)
                return self._ext.allocate_batch(
                    seq_ids, prompts, la, namespaces, chunks, exts,
                    lambda arrs, ntoks, rows, nhit: self._alloc.prefill_result(ids, arrs, ntoks, rows, nhit))
        return self._alloc.allocate_batch(seq_ids, prompts, la, namespaces, chunks)

    def lookup_prefix(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                      namespace: object = None, num_new_tokens: int | None = None,
                      num_external_tokens: int = 0) -> PrefixHit:
        """What :meth:`allocate` would find cached for this prompt if called now, without changing anything (no
        LRU touch, no stats, no KV events, no pinning): :class:`PrefixHit` (cached tokens and blocks, how many of
        them come from the CPU tier, how many free GPU blocks the allocation would consume). Both tiers and
        namespaces are searched exactly as allocate searches them; whether the prompt fits is
        :meth:`can_allocate`'s question. A token-budget scheduler uses it to charge only the tokens to compute
        (``len(token_ids) - num_cached_tokens``). Inside one :meth:`allocate_batch` a prompt may also hit the
        blocks of the batch's earlier prompts, which this lookup cannot know. ``num_new_tokens`` (chunked
        prefill): ``num_new_blocks`` counts the blocks of the hit plus that many further tokens, as
        ``allocate(..., num_new_tokens=)`` would take them; with ``num_external_tokens=E`` too, the blocks of the
        hit H, of the E' external tokens allocate would keep (E cut to whole blocks before the prompt's last
        token) and of one chunk, as ``allocate(..., num_new_tokens=, num_external_tokens=)`` takes them
        (``num_cached_tokens`` stays H: the external tokens are not cached here). O(prompt blocks)."""
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else _check_int("num_new_tokens", num_new_tokens, 1)
        e = 0 if type(num_external_tokens) is int and num_external_tokens == 0 else \
            self._ext.check_lookup(num_external_tokens, self._window)  # (a plain request stays out of _external)
        if self._cache is None:
            n = _as_tokens(token_ids).size
            _encode_namespace(namespace)  # validate it all the same
            nb = -(-((n if k is None else min(n, (e and self._ext.kept(n, 0, e)) + k)) + la) // self._bs)
            return PrefixHit(0, 0, 0, nb)
        arr = _as_tokens(token_ids)
        root = self._cache.root(namespace, intern=False)
        hits, chain = self._reg.lookup(arr, root)
        if self._window is not None and k is not None:
            hits, _ = self._alloc.fit_hit(hits, chain, root, arr.size, la, k)
        ref = self._gpu.ref_mv
        held = sum(1 for b in hits if b >= 0 and ref[b] > 0)
        if self._steered and self._cache.evictor.num_parked:  # pinned idle hits: not in the free count
            held += sum(1 for b in hits if b >= 0 and self._cache.evictor.parked[b])
        ncpu = sum(1 for b in hits if b < 0)
        h = len(hits) * self._bs
        n = arr.size if k is None else min(arr.size, h + (e and self._ext.kept(arr.size, h, e)) + k)
        nb = -(-(n + la) // self._bs)
        return PrefixHit(h, len(hits), ncpu, nb - held)

    # fork / free: LifeCalls (_small.py); can_append_slots / append_slots / decode_step: AppendCalls (_step.py)


BlockManager.__signature__ = init_signature(BlockManager)  # (not __new__'s: inspect, the docs)
