"""GroupedManager: KV cache groups (full attention, sliding window) over ONE shared pool of block ids; what
``BlockManager(..., kv_cache_groups=[...])`` builds with several groups (a subclass of it).

A hybrid model's layers fall into *groups* of equal size (Gemma 3 270M: 18 layers, 3 full-attention and 15
sliding-window ones of W = 512 -> 6 groups of 3 layers: group 0 full, groups 1..5 sliding). Every sequence has
one block table per group; every table draws its blocks from the same pool, so a block id holds, at any time,
the KV of one group (for that group's layers). The engine's KV tensor per layer slot j is ``(num_gpu_blocks,
block_size, heads, head_dim)``; layer L of group g at index j uses slot j with group g's table and slot mapping::

    sequence of 10 tokens, block_size 4, groups: 0 = full, 1 = sliding W = 4

    positions        0 1 2 3 | 4 5 6 7 | 8 9 . .
    group 0 table  [    17   |    3    |   42    ]    every block
    group 1 table  [    -1   |    8    |   11    ]    NULL_BLOCK: before every future query's window

**The composition** (explicit parts; no part reads another's private state)::

    GroupedManager       facade: every call's contract, argument checks, a call into a coordinator part
      ├── coordinator parts (each given, at construction, the per-group parts and the shared ones it works on)
      │     HybridAllocator (_allocator.py, _hit.py)   allocate*, lookup_prefix, can_allocate
      │     HybridStepper   (_step.py)     decode_step / append_slots / can_append_slots
      │     HybridSwapper   (_swap.py)     swap_out / swap_in / can_*
      │     HybridSeqs      (_seqs.py)     fork / free / take_copy_plan / reset_prefix_cache / audit
      ├── one group manager per group: a BlockManager built on the shared parts (``BlockManager._sharing``),
      │   holding that group's SeqTables, Stepper, Small, Registry, Allocator, Swapper and Window (a sliding
      │   group's manager has ``sliding_window = W``; with window retention, a RetainingWindow)
      └── shared parts (one of each): Blocks over the GPU and CPU BlockPools, PrefixCache (one map, one LRU;
          keyed by content AND group: each group's chains start from its own root), CpuTier, the pending copy
          list, WindowRetention (pagedkv.hybrid._retention)

**Hybrid prefix hits.** ``allocate`` returns the longest prefix L (a multiple of block_size, less than the
prompt) such that every full-attention group has all of its blocks ``[0, L)`` cached and every sliding group
has the blocks covering positions ``(L - W, L)`` cached (GPU or CPU tier): the W - 1 cached positions the first
computed query, at L, reads (a window of one token needs none). A sliding group's table holds
NULL_BLOCK before them. The chained keys of a prompt are computable without the blocks being present, so a
sliding group finds a window late in a prompt even after its early blocks were evicted; such a window block is
verified by its stored tokens and its 64-bit chained key (which covers every earlier token of the prompt),
since the content ids of blocks that are gone cannot be compared. :meth:`lookup_prefix` predicts ``allocate``.
Without a CPU tier, for prompts of four full blocks or more, the hit is found and committed vectorised over
blocks and groups (:mod:`pagedkv.hybrid._hit`: one probe pass per full group, one for every sliding group's
window, sibling keys recorded per block of the first full group instead of hashing every sliding chain, one
commit of every group); otherwise block by block (``HybridAllocator.plan_walk``), with the same result.

**KV events** carry the group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, as
vLLM's). Group 0's keys are :func:`pagedkv.block_hashes`' (those of a single-group manager).

Complexity: a call costs about G times the same call on a BlockManager (G = number of groups); an allocation
with prefix caching costs O(prompt blocks) C-level hashing and map probes per full group, O(window blocks) probes
per sliding group (hashing only past the last recorded sibling key) and O(1) numpy calls per group.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import numpy as np

from .._checks import as_tokens, batch_args, batch_tokens, check_int, flat_tokens, new_token_counts
from ._allocator import HybridAllocator
from ._seqs import HybridSeqs
from ._step import HybridStepper
from ._swap import HybridSwapper
from ._types import HybridPrefillBatch, HybridStepDelta, HybridStepResult
from ._retention import WindowRetention, _SlidingGroup
from ..errors import (InvalidArgumentError, InvalidTokensError, OutOfBlocksError,
                      SequenceStateError, UnknownPinError)
from ..blocks.evictor import RetentionEvictor
from ..kv_groups import FullAttentionSpec, SlidingWindowSpec
from ..manager import BlockManager
from ..manager.core import set_grouped_class
from ..manager import _invariants
from ..manager._external import External, Hold
from ..manager.parts import Events, ExternalKV, ManagerConfig, check_groups, init_signature
from ..manager._stores import STORE_POLICIES, Stores
from ..retention.eviction import make_evictor
from ..retention.steering import Pin, SteeredEvictor
from ..types import AllocStatus, CopyPlan, PrefixHit, Stats

__all__ = ["GroupedManager", "HybridPrefillBatch", "HybridStepDelta", "HybridStepResult"]


class GroupedManager(BlockManager):
    """Paged KV-cache block manager for hybrid models: one block table per KV cache group, one shared pool (see
    the module docstring).

    Args: as :class:`pagedkv.BlockManager` (without ``sliding_window``), plus ``kv_cache_groups``: one spec per
    group, :class:`~pagedkv.FullAttentionSpec` or :class:`~pagedkv.SlidingWindowSpec`, in group index order;
    ``window_retention`` (default on; with prefix caching and a sliding group): released sliding-group blocks
    outside the windows before useful points (prompt end, sequence end, every ``retention_interval`` tokens:
    by default 16 windows of the widest group, 0 for none) are evicted before any other cached block, so hybrid
    prefix hits survive memory pressure (:mod:`pagedkv.hybrid._retention`); ``eviction_policy`` and
    ``pin_budget_blocks`` as BlockManager's (the policy orders the cached blocks that window retention does not
    make spare; spare blocks go first whatever their priority), with ``retention.set_retention``, ``retention.pin_prefix``
    and ``retention.unpin`` over every group's blocks.

    Same method names and semantics as :class:`pagedkv.BlockManager`; per-group results (``decode_step`` ->
    :class:`HybridStepResult`, ``allocate_batch`` -> :class:`HybridPrefillBatch`), and ``block_table`` /
    ``slot_mapping`` take the group index (default 0, as a BlockManager's; every result also answers the grouped
    names ``group_slot_mapping`` / ``group_block_tables`` / ``group_table_updates`` that a BlockManager's answer
    with G = 1). ``take_copy_plan()`` returns one plan for every group (block ids are
    pool-wide: an engine copies block src to dst in every layer slot). Every call is all or nothing across
    groups. Admission counts every group: a prompt of n tokens needs ``G * ceil((n + lookahead) / block_size)``
    blocks at most (NEVER when that exceeds the pool less the watermark), less its hits and the positions
    before a sliding group's window at the hit point.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        kv_cache_groups: Sequence[object] | None = None,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        watermark: float = 0.01,
        enable_kv_events: bool = False,
        max_kv_events: int = 100_000,
        cpu_prefix_cache: bool = False,
        block_table_width: int | None = None,
        window_retention: bool = True,
        retention_interval: int | None = None,
        store_policy: str = "none",
        store_min_hits: int = 1,
        eviction_policy: str = "lru",
        pin_budget_blocks: int = 0,
        sliding_window: int | None = None,
        grouped_results: bool | None = None,
    ) -> None:
        if grouped_results is False:
            raise InvalidArgumentError("grouped_results=False needs one KV cache group")
        specs = check_groups(kv_cache_groups, sliding_window=sliding_window)  # (None: the shorthand's one group)
        if store_policy not in STORE_POLICIES:
            raise InvalidArgumentError(f"store_policy must be one of {STORE_POLICIES}, got {store_policy!r}")
        store_min_hits = check_int("store_min_hits", store_min_hits, 1)
        if store_policy != "none" and not enable_prefix_caching:
            raise InvalidArgumentError("store_policy needs enable_prefix_caching=True")
        self._store = (store_policy, store_min_hits)
        if retention_interval is None:  # auto: 16 windows of the widest group
            retention_interval = 16 * max((s.window for s in specs if s.window is not None), default=0)
        retention_interval = check_int("retention_interval", retention_interval, 0)
        retain = bool(window_retention) and enable_prefix_caching and any(s.window is not None for s in specs)
        first = (_SlidingGroup if retain and specs[0].window is not None else BlockManager)(
                             num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                             enable_prefix_caching=enable_prefix_caching, sliding_window=specs[0].window,
                             watermark=watermark, enable_kv_events=enable_kv_events, max_kv_events=max_kv_events,
                             cpu_prefix_cache=cpu_prefix_cache, block_table_width=block_table_width,
                             eviction_policy=eviction_policy, pin_budget_blocks=pin_budget_blocks)
        self._specs = specs
        self._policy, self._pin_budget = first._policy, first._pin_budget
        self._hints: dict = {}  # seq_id -> (priority, session) given by set_retention, used by free
        self._g = [first] + [(_SlidingGroup if retain and s.window is not None else BlockManager)._sharing(first, s.window)
                             for s in specs[1:]]
        self._m0 = first
        self._wire(retain, retention_interval)
        c = first.config
        config = ManagerConfig(c.num_gpu_blocks, c.block_size, c.num_cpu_blocks, specs, None,
                                     c.enable_prefix_caching, c.watermark, c.watermark_blocks, c.enable_kv_events,
                                     c.max_kv_events, c.cpu_prefix_cache, c.block_table_width, c.eviction_policy,
                                     c.pin_budget_blocks, store_policy, store_min_hits, bool(window_retention),
                                     retention_interval, True)
        self._parts = (config, ExternalKV(self._ext, self._stores), Events(self._cache, self._kv_events))

    def _wire(self, retain: bool, retention_interval: int) -> None:
        """Build the coordinator's parts over the group managers' parts and the shared ones (the only place that
        reads the group managers' internals: each part is handed what it works on)::

            HybridAllocator ─┐                  per group: SeqTables, Registry, Allocator / Stepper, Small,
            HybridStepper  ──┼── group parts    Window / Swapper
            HybridSwapper  ──┤
            HybridSeqs     ──┘── shared: Blocks (GPU / CPU pools, prefix cache), CpuTier, WindowRetention
        """
        gs, m0 = self._g, self._m0
        self._bs = bs = m0._bs
        self._gpu, self._cpu, self._cache, self._tier = m0._gpu, m0._cpu, m0._cache, m0._tier
        self._blocks = blocks = m0._blocks
        self._kv_events, self._watermark_blocks = m0._kv_events, m0._watermark_blocks  # (read by PoolState)
        for m in gs:  # every group's blocks stay in the prefix cache's map (see pagedkv.hybrid._hit)
            m._reg.use_runs = False
        # window retention (pagedkv.hybrid._retention): spare sliding blocks are evicted first
        self._retention = None
        if retain:  # (the policy, if not LRU, orders the blocks that are not spare)
            main = None if self._policy == "lru" else self._cache.evictor
            self._cache.evictor = RetentionEvictor(self._gpu.num_blocks, main)
            self._retention = WindowRetention(bs, retention_interval, self._cache, self._gpu.ref)
            for m, s in zip(gs, self._specs):
                if s.window is not None:
                    m._win.retention, m._win.k = self._retention, -(-s.window // bs)
        for m, s in zip(gs, self._specs):  # (a sliding group's hits check a window's blocks by key and tokens)
            m._swap.by_key = s.window is not None
        tables = [m._t for m in gs]
        wins = [m._win if m._window is not None else None for m in gs]
        self._t0 = tables[0]
        self._alloc = HybridAllocator(self._specs, tables, [m._reg for m in gs], [m._alloc for m in gs], blocks,
                                      self._gpu, self._cache, self._tier, m0._cpu_tok, m0._cpu_id, self._retention,
                                      bs, m0._watermark_blocks, m0._fixed_w)
        self._step = HybridStepper(tables, [m._step for m in gs], [m._small for m in gs], wins, blocks, self._gpu,
                                   bs, m0._fixed_w)
        self._swap = HybridSwapper(tables, [m._swap for m in gs], blocks, self._gpu, bs, m0._watermark_blocks)
        self._seqs = HybridSeqs(gs, tables, [m._reg for m in gs], wins, [m._window for m in gs], self._retention,
                                blocks, self._gpu, self._cache, self._tier, bs, self._hints)
        self._seqs.take_copies0 = m0._take_copies  # (the deprecated take_copies)
        # holds and store plans over every group (external loads: not on the hybrid manager yet)
        self._ext = External(self._t0, blocks, m0._reg, self._alloc, self._cache, bs, tables=tables,
                             regs=[m._reg for m in gs])
        self._stores = Stores(blocks, self._cache, self._alloc, *self._store)

    # ------------------------------------------------------------------ read-only state
    @property
    def stats(self) -> Stats:
        """Prefix-hit counters of the hybrid hit (counted once, not per group); evictions, copy-on-write copies and
        swapped blocks of every group."""
        s = self._m0.stats
        rest = self._g[1:]
        rs = [m.stats for m in rest]
        return s._replace(cow_copies=s.cow_copies + sum(r.cow_copies for r in rs),
                          swapped_out_blocks=s.swapped_out_blocks + sum(r.swapped_out_blocks for r in rs),
                          swapped_in_blocks=s.swapped_in_blocks + sum(r.swapped_in_blocks for r in rs))

    def __len__(self) -> int:
        return len(self._m0)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._m0

    @property
    def seq_ids(self) -> tuple:
        return self._m0.seq_ids

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._m0.num_tokens(seq_id)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._m0.is_swapped(seq_id)

    def _group(self, group: object) -> BlockManager:
        g = check_int("group", group, 0)
        if g >= len(self._g):
            raise InvalidArgumentError(f"group must be < {len(self._g)} (the number of KV cache groups), got {g}")
        return self._g[g]

    def block_table(self, seq_id: Hashable, group: int = 0) -> np.ndarray:
        """Group ``group``'s block table of the sequence (read-only int32 copy; NULL_BLOCK where a sliding window
        released blocks). O(table length)."""
        return self._group(group).block_table(seq_id)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> np.ndarray:
        """Group ``group``'s slots of positions ``[start, end)`` (int64); see BlockManager.slot_mapping."""
        return self._group(group).slot_mapping(seq_id, start, end)

    def lookahead_slots(self, seq_ids: Sequence[Hashable], num_lookahead_slots: int) -> np.ndarray:
        """Every group's slots of each sequence's ``k`` reserved lookahead positions: int64 ``(G, B * k)``, row g
        group g's, sequence 0's first (see BlockManager.lookahead_slots; a window never releases them: they are
        the newest positions). Changes nothing. O(B x k x groups)."""
        ids = seq_ids if type(seq_ids) is list else list(seq_ids)
        return np.concatenate([m.lookahead_slots(ids, num_lookahead_slots) for m in self._g])

    def table_rows(self, seq_ids: Iterable[Hashable]) -> np.ndarray:
        """The table row of each sequence (read-only int64 (B,)), the same in every group: the row of
        :class:`HybridStepDelta`'s ``table_rows`` and of every group's ``table_updates`` (see
        :meth:`pagedkv.BlockManager.table_rows`). O(B)."""
        return self._m0.table_rows(seq_ids)

    # ------------------------------------------------------------------ steps, events, invariants
    def take_copy_plan(self) -> CopyPlan:
        """Every KV block copy of the step, all groups, in the order to execute them (block ids are pool-wide: copy
        block src to dst in every layer slot), and end the step. See BlockManager.take_copy_plan.
        O(copies + rows x groups)."""
        plan = self._seqs.take_copy_plan()
        if self._store[0] == "write_through":
            self._stores.end_step()
        return plan

    def _take_copies(self):
        """Deprecated ``take_copies``: :meth:`take_copy_plan` narrowed to the CPU tier's copies."""
        return self._seqs.take_copies()

    def check_invariants(self) -> None:
        """Every invariant of every group and of the shared parts (refcounts summed over the groups' tables), and
        that the groups hold the same sequences in the same rows, token counts and partly prefilled sequences
        (chunked prefill: every group records the same prompt lengths). O(blocks + total table length)."""
        self._seqs.check(self._ext.extra_refs() + self._stores.extra_refs())
        self._ext.check(_invariants.fail)
        self._stores.check(_invariants.fail)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block of every group (see BlockManager.reset_prefix_cache). Returns how many blocks
        were freed. O(cached blocks + live sequences)."""
        return self._seqs.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                 namespace: object = None, num_new_tokens: int | None = None, num_external_tokens: int = 0,
                 external_window_only: bool = False) -> int:
        """Create the sequence's block table in every group; returns the hybrid hit (tokens cached in every group,
        a multiple of block_size, less than the prompt). See BlockManager.allocate; raises what it raises
        (PromptTooLongError counting every group) and changes nothing then. O(prompt blocks x groups).

        **Chunked prefill** (``num_new_tokens=k``, k >= 1), as BlockManager.allocate's: the hybrid hit L is found
        on the whole prompt, then the sequence holds its first ``min(L + k, len(token_ids))`` tokens in every
        group; the rest is appended with :meth:`decode_step` (multi-token), a sliding group releasing what its
        window no longer needs between chunks. Until the whole prompt is appended :meth:`fork` raises
        SequenceStateError (no group changes); swap and free (``cache=False`` too) work. PromptTooLongError /
        TableWidthError look at the whole prompt. ::

            group 0 (full)     [ hit ........ | chunk 1 ][ chunk 2 ][ chunk 3 ]
            group 1 (sliding)  [ NULL | window | chunk 1 ][ chunk 2 ][ chunk 3 ]
                                 allocate(num_new_tokens=k)  decode_step  decode_step

        ``num_external_tokens=E`` (external KV, docs/external-kv.md): as BlockManager.allocate's, in every group:
        each group reserves the blocks of the E' tokens after the hybrid hit (a sliding group too: its window
        releases those it no longer needs once the sequence runs), registers nothing past the hit until
        ``external.finish_external``, and the sequence is LOADING until then.

        ``external_window_only=True`` (with ``num_external_tokens``): a sliding group of window W reserves only
        the external blocks its window still sees at the load's end ``P = L + E'`` (blocks ``(P - W + 1) //
        block_size`` on, the hybrid hit's rule); its positions before them hold NULL_BLOCK in
        ``external_blocks(seq).group_block_ids[g]`` (no KV to write there) and its hit blocks before them return
        to the cache. Such a group then registers nothing more of this sequence (its chain would run through
        blocks it never holds). The KV a sliding group needs before P exists nowhere in this manager, so such a
        load completes whole (``finish_external(done=)``) or is aborted (:meth:`free`, then reported);
        ``finish_external(failed=)`` of it raises InvalidArgumentError. A load whose external range the windows
        still see whole is not cut and behaves as without the flag.
        """
        if num_external_tokens:
            e = self._ext.check_external(num_external_tokens)
            self._t0.check_new_id(seq_id)
            la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
            k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
            if not isinstance(external_window_only, bool):
                raise InvalidArgumentError(f"external_window_only must be a bool, got {external_window_only!r}")
            arr = as_tokens(token_ids)
            nhit, ext, cut = self._alloc.allocate_external(seq_id, arr, la, self._alloc.gns(namespace), k, e,
                                                           external_window_only)
            if ext:
                self._ext.start_load(seq_id, arr, nhit, ext, namespace, cut)
            return nhit * self._bs + ext
        self._t0.check_new_id(seq_id)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        gns = self._alloc.gns(namespace)
        return self._alloc.allocate(seq_id, as_tokens(token_ids), la, gns, k)

    def allocate_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                       num_lookahead_slots: int = 0, *, namespaces: Sequence[object] | None = None,
                       num_new_tokens: Sequence[int] | None = None,
                       num_external_tokens: Sequence[int] | None = None) -> HybridPrefillBatch:
        """Allocate B sequences at once and return their prefill metadata per group (:class:`HybridPrefillBatch`).
        Like consecutive :meth:`allocate` calls (a prompt hits the blocks the batch's earlier prompts cached),
        all or nothing, and every hit planned for the batch is held before any block is taken. Admission counts
        each prompt's blocks without the sharing inside the batch (a batch that fits only thanks to it raises
        OutOfBlocksError; allocate its prompts one by one). A later prompt whose burst hit would take more blocks
        than it was admitted for (chunks: hits on unreferenced cached blocks are taken, not saved) keeps its admitted
        plan, so the batch never takes more than admitted. O(total prompt blocks x groups).

        ``num_new_tokens`` (chunked prefill): None, or one chunk size (>= 1) per prompt, as for :meth:`allocate`;
        the metadata then covers each sequence's hit plus its chunk (``seq_lens``: the tokens held)."""
        seq_ids, prompts, namespaces, chunks = batch_args(seq_ids, token_ids, namespaces, num_new_tokens)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if chunks is None:
            chunks = [None] * len(seq_ids)
        if num_external_tokens is not None:
            return self._allocate_batch_external(seq_ids, prompts, la, namespaces, chunks, num_external_tokens)
        self._t0.check_new_ids(seq_ids)
        gnss = [self._alloc.gns(ns) for ns in namespaces]
        arrs = [as_tokens(p, f"token_ids[{i}]") for i, p in enumerate(prompts)]
        return self._alloc.allocate_batch(seq_ids, arrs, gnss, chunks, la)

    def _allocate_batch_external(self, seq_ids: list, prompts: list, la: int, namespaces: list, chunks: list,
                                 exts: object) -> HybridPrefillBatch:
        """allocate_batch with ``num_external_tokens`` (the other arguments checked by allocate_batch): checked as
        a whole (ids, prompts, and the blocks of every prompt counted without its hit against the free ones),
        then consecutive :meth:`allocate` calls: all or nothing. O(total prompt blocks x groups)."""
        b = len(seq_ids)
        if isinstance(exts, (int, np.integer)) or len(exts) != b:
            raise InvalidArgumentError("num_external_tokens must be None or one count per prompt")
        exts = [self._ext.check_external(e) for e in exts]
        self._t0.check_new_ids(seq_ids)
        arrs = [as_tokens(p, f"token_ids[{i}]") for i, p in enumerate(prompts)]
        plans = [self._alloc.plan(a, la, self._alloc.gns(ns)) for a, ns in zip(arrs, namespaces)]
        # admitted against the blocks every prompt needs without any hit (an earlier prompt may evict or demote a
        # later one's CPU-tier hit, and a lost hybrid hit costs a sliding group more than the block lost), plus the
        # idle hits held below: all or nothing; allocate the prompts one by one to count on their hits
        G = len(self._g)
        need = sum(G * p.nblocks + max(0, p.need - G * (p.nblocks - p.nhit)) for p in plans)
        if need > self.num_free_gpu_blocks:
            raise OutOfBlocksError(f"the batch of {b} prompts needs up to {need} new blocks (counted without their "
                                   f"hits); {self.num_free_gpu_blocks} are free")
        # every planned GPU hit held first: no prompt of the batch evicts a later one's hit
        held = list(dict.fromkeys(x for p in plans for x in self._alloc.hold_list(p)))
        if held and self._cache is not None:
            self._alloc.hold_blocks(held)
        nhit, ntoks = [], []
        try:
            for s, a, ns, c, e in zip(seq_ids, arrs, namespaces, chunks, exts):
                cached = self.allocate(s, a, la, namespace=ns, num_new_tokens=c, num_external_tokens=e)
                nhit.append(cached // self._bs)
                ntoks.append(self.num_tokens(s))
        finally:
            if held and self._cache is not None:
                self._alloc.unhold(held)
        return self._alloc.result(seq_ids, arrs, ntoks, nhit)

    def lookup_prefix(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                      namespace: object = None, num_new_tokens: int | None = None,
                      num_external_tokens: int = 0) -> PrefixHit:
        """What :meth:`allocate` would find cached now (the hybrid hit), changing nothing: cached tokens and
        blocks (per group), CPU-tier promotions (all groups) and the free GPU blocks the allocation would consume
        (all groups; with ``num_new_tokens``, those of the hit plus that chunk, as ``allocate(...,
        num_new_tokens=)`` takes them; with ``num_external_tokens`` too, the hit, the external tokens allocate
        keeps and one chunk, without ``external_window_only``'s cut). O(prompt blocks x groups)."""
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        e = self._ext.check_external(num_external_tokens)
        arr = as_tokens(token_ids)
        gns = self._alloc.gns(namespace)
        plan = self._alloc.external_plan(arr, la, gns, k, e, check=False)[0] if e else \
            self._alloc.plan(arr, la, gns, check=False, chunk=k)
        return PrefixHit(plan.nhit * self._bs, plan.nhit, plan.ncpu, plan.need)

    def can_allocate(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                     namespace: object = None, num_new_tokens: int | None = None,
                     num_external_tokens: int = 0) -> AllocStatus:
        """NEVER if the prompt's blocks in every group exceed the pool less the watermark (the whole prompt in a
        full-attention group; with ``num_new_tokens``, a sliding-window group counts at most its window plus one
        chunk, all it ever holds while the prompt is appended chunk by chunk), LATER if the blocks the allocation
        would consume (every group, hits counted; with ``num_new_tokens``, only the hit plus that chunk) do not fit
        now, else OK; ``num_external_tokens`` as in :meth:`lookup_prefix`. O(prompt blocks x groups)."""
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        e = self._ext.check_external(num_external_tokens)
        arr = as_tokens(token_ids)
        return self._alloc.can_allocate(arr, la, self._alloc.gns(namespace), k, e)

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Create ``child_seq_id`` sharing every block of the parent in every group (see BlockManager.fork). A
        parent allocated a chunk of its prompt is forked only once its whole prompt is appended
        (SequenceStateError before, no group changing: group 0 checks first and every group holds the same
        token counts). O(table length x groups)."""
        self._seqs.fork(parent_seq_id, child_seq_id)

    def free(self, seq_id: Hashable, *, cache: bool = True, hold_for: float | None = None,
             now: float | None = None) -> Hold | None:
        """Release the sequence's blocks in every group (see BlockManager.free; with ``cache=False`` every group's
        blocks of the last call are withdrawn, or, if another sequence holds one, SequenceStateError and nothing
        changes). ``hold_for``: ``external.hold`` first, all or nothing (see BlockManager.free). O(table length x
        groups)."""
        if hold_for is not None:
            return self._hold_and_free(seq_id, hold_for, now, cache)
        if not cache:
            self._check_unheld(seq_id)
        try:
            self._seqs.free(seq_id, cache)
        except SequenceStateError:
            if seq_id in self._t0.loading:  # an abort while LOADING: every group's arriving blocks park
                self._ext.abort(seq_id)
                return None
            raise
        return None

    # ------------------------------------------------------------------ appending
    def decode_step(self, seq_ids: Sequence[Hashable], token_ids: object, num_lookahead_slots: int = 0, *,
                    num_new_tokens: object = None, block_tables: bool = True) -> HybridStepResult | HybridStepDelta:
        """The batched hot path in every group (see BlockManager.decode_step for the token forms, lookahead and
        the contract): returns :class:`HybridStepResult` (slot mapping and block tables per group), or with
        ``block_tables=False`` :class:`HybridStepDelta` (each group's changed table entries instead of its
        padded tables: the step's cost does not grow with the context length). All or nothing across groups.
        O(B x groups) numpy work, plus O(1) per block filled, released or evicted."""
        if block_tables is not True and block_tables is not False:
            raise InvalidArgumentError(f"block_tables must be True or False, got {block_tables!r}")
        delta = not block_tables
        step = self._step
        if num_new_tokens is None and num_lookahead_slots == 0 and type(num_lookahead_slots) is int:
            b = len(seq_ids)
            if 0 < b <= step.small_batch:
                res = step.step_small(seq_ids, token_ids, b, delta)
                if res is not None:
                    return res
        rows = self._t0.rows(seq_ids)
        b = rows.size
        if num_new_tokens is not None:
            arr, counts = flat_tokens(token_ids, num_new_tokens, b)
        elif type(token_ids) is np.ndarray and token_ids.ndim == 1 and token_ids.size == b:
            arr, counts = token_ids, None
        else:
            arr, counts = batch_tokens(token_ids, b)
        if arr.dtype.kind not in "iu":
            raise InvalidTokensError(f"token_ids must be integers, got dtype {arr.dtype}")
        if arr.size and np.count_nonzero(arr >> 31):
            raise InvalidTokensError("token_ids must lie in [0, 2**31)")
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        return step.step(rows, arr, counts, la, delta)

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0
                     ) -> list[tuple[int, int]]:
        """Append tokens to one sequence in every group; returns every group's copy-on-write pairs. O(groups)."""
        arr = as_tokens(token_ids)
        res = self.decode_step([seq_id], arr, num_lookahead_slots, num_new_tokens=np.array([arr.size]))
        return [(int(s), int(d)) for s, d in res.cow]

    def can_append_slots(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0, *,
                         num_new_tokens: int | Sequence[int] = 1) -> bool:
        """Whether the append fits in every group together (see BlockManager.can_append_slots; ``num_new_tokens``
        one count or one per sequence). O(B x groups)."""
        rows = self._t0.rows(list(seq_ids))
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        counts = new_token_counts(num_new_tokens, rows.size)
        if rows.size == 0:
            return True
        return self._step.fits(rows, counts, la)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the CPU pool takes every group's blocks of the sequences. O(total table length x groups)."""
        return self._swap.can_swap_out(self._t0.rows_where(list(seq_ids), swapped=False))

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks of every group to the CPU pool; (gpu, cpu) pairs of every group. All or
        nothing (OutOfBlocksError when the CPU pool cannot take every group's blocks). O(total table length x
        groups)."""
        return self._swap.swap_out(list(seq_ids))

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0) -> AllocStatus:
        """Whether swapped-out sequences fit back on the GPU in every group (with the watermark and
        ``num_lookahead_slots`` extra slots each): NEVER, LATER or OK. O(total table length x groups)."""
        rows = self._t0.rows_where(list(seq_ids), swapped=True)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        return self._swap.can_swap_in(rows, la)

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back in every group; (cpu, gpu) pairs of every group. All or nothing.
        O(total table length x groups)."""
        return self._swap.swap_in(list(seq_ids))

    # ------------------------------------------------------------------ retention (priority, session, pins)
    def _set_retention(self, seq_id: Hashable, priority: object, session: Hashable) -> None:
        """``retention.set_retention`` over every group (:class:`pagedkv.manager.parts.Retention`). O(1)."""
        row = self._t0.row(seq_id)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if self._cache is None:
            raise InvalidArgumentError("set_retention needs enable_prefix_caching=True")
        hash(session)
        if priority:
            self._steering()
        self._hints[seq_id] = (int(priority), session)
        if self._retention is not None:
            self._retention.set_priority(row, int(priority))

    def _pin_prefix(self, token_ids: Sequence[int], ttl: float | None, namespace: object) -> Pin:
        """``retention.pin_prefix`` over every group (:class:`pagedkv.manager.parts.Retention`). O(prompt blocks x
        groups)."""
        if self._cache is None or not self._pin_budget:
            raise InvalidArgumentError("pin_prefix needs enable_prefix_caching=True and pin_budget_blocks > 0")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise InvalidArgumentError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        arr = as_tokens(token_ids)
        gns = self._alloc.gns(namespace)
        bs = self._bs
        nfull = arr.size // bs
        while True:
            # (one token more: a hit leaves the last token to compute; a pin covers every full block)
            probe = np.append(arr[: nfull * bs], arr[:1])
            plan = self._alloc.plan(probe, 0, gns, check=False)
            cpu = [j for _, c, _, _ in plan.groups if c for j, _ in c]
            if not cpu:
                break
            nfull = min(cpu)  # a hit point past a CPU-tier block needs it: stop before it
        L = plan.nhit
        parts = [[int(b) for b in gpu if b >= 0] for gpu, _, _, _ in plan.groups] if L else []
        if not any(parts):
            return Pin(0, 0, 0, ttl)
        last = next((g for g, s in enumerate(self._specs) if s.window is None), 0)
        order = [g for g in range(len(parts)) if g != last] + [last]  # the anchor's last block last (TTL refresh)
        blocks = np.array([b for g in order for b in parts[g]], dtype=np.int64)
        return self._steering().pin(blocks, L * bs, ttl)

    def _unpin(self, pin_id: int) -> None:
        """``retention.unpin``. O(its blocks)."""
        ev = self._cache.evictor if self._cache is not None else None
        if not isinstance(ev, SteeredEvictor):
            raise UnknownPinError(f"no pin {pin_id!r} (unpinned already, expired, or never made)")
        ev.unpin(pin_id)

    def _steering(self) -> SteeredEvictor:
        """The prefix cache's evictor as a SteeredEvictor, installed once over the current one (over window
        retention's evictor, its spare blocks stay first); the coordinator's parts are told."""
        cache = self._cache
        ev = cache.evictor
        if not isinstance(ev, SteeredEvictor):
            policy = self._policy
            ev = cache.evictor = SteeredEvictor(ev, self._gpu.num_blocks, lambda n: make_evictor(policy, n, cache),
                                                cache.cid, self._pin_budget)
            self._seqs.steer = ev
            if self._retention is not None:
                self._retention.steer = ev
        return ev


set_grouped_class(GroupedManager)  # (BlockManager(kv_cache_groups=[...several]) builds one)
GroupedManager.__signature__ = init_signature(GroupedManager)
