"""HybridBlockManager: KV cache groups (full attention, sliding window) over ONE shared pool of block ids.

A hybrid model's layers fall into *groups* of equal size (Gemma 3 270M: 18 layers, 3 full-attention and 15
sliding-window ones of W = 512 -> 6 groups of 3 layers: group 0 full, groups 1..5 sliding). Every sequence has
one block table per group; every table draws its blocks from the same pool, so a block id holds, at any time,
the KV of one group (for that group's layers). The engine's KV tensor per layer slot j is ``(num_gpu_blocks,
block_size, heads, head_dim)``; layer L of group g at index j uses slot j with group g's table and slot mapping::

    sequence of 10 tokens, block_size 4, groups: 0 = full, 1 = sliding W = 4

    positions        0 1 2 3 | 4 5 6 7 | 8 9 . .
    group 0 table  [    17   |    3    |   42    ]    every block
    group 1 table  [    -1   |    8    |   11    ]    NULL_BLOCK: before every future query's window

**The composition** (explicit parts, no mixin reads another's state)::

    HybridBlockManager ── coordinator: validation, all-or-nothing planning across groups, results per group
      ├── shared parts (one of each): BlockPool (GPU), BlockPool (CPU), PrefixCache (one map, one LRU; keyed by
      │   content AND group: each group's chains start from its own root), CpuTier, the pending copy list
      └── one group manager per group: a BlockManager built on the shared parts (``BlockManager._sharing``),
          holding that group's rows and tables; a sliding group's manager has ``sliding_window = W``

Every call plans every group first (the managers separate planning from committing), checks the SUM of blocks
the groups need against the shared free count, then commits every group; a call either completes for every
group or raises and changes nothing. The group managers hold the same sequences in the same rows (every call
reaches every group in the same order), so one row validation serves every group.

**Hybrid prefix hits.** ``allocate`` returns the longest prefix L (a multiple of block_size, less than the
prompt) such that every full-attention group has all of its blocks ``[0, L)`` cached and every sliding group
has the blocks covering positions ``[L - W, L)`` cached (GPU or CPU tier). A sliding group's table holds
NULL_BLOCK before them. The chained keys of a prompt are computable without the blocks being present, so a
sliding group finds a window late in a prompt even after its early blocks were evicted; such a window block is
verified by its stored tokens and its 64-bit chained key (which covers every earlier token of the prompt),
since the content ids of blocks that are gone cannot be compared. :meth:`lookup_prefix` predicts ``allocate``.
Without a CPU tier, for prompts of four full blocks or more, the hit is found and committed vectorised over
blocks and groups (:mod:`pagedkv._hybrid_alloc`: one probe pass per full group, one for every sliding group's
window, sibling keys recorded per block of the first full group instead of hashing every sliding chain, one
commit of every group); otherwise block by block (:meth:`HybridBlockManager._plan_walk`), with the same result.

**KV events** carry the group (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, as
vLLM's). Group 0's keys are :func:`pagedkv.block_hashes`' (those of a single-group manager).

Complexity: a call costs about G times the same call on a BlockManager (G = number of groups); an allocation
with prefix caching costs O(prompt blocks) C-level hashing and map probes per full group, O(window blocks) probes
per sliding group (hashing only past the last recorded sibling key) and O(1) numpy calls per group.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from ._hybrid_alloc import commit_all, find_hit
from ._checks import as_tokens, batch_tokens, check_int, flat_tokens
from .errors import (DuplicateSequenceError, InvalidArgumentError, InvalidTokensError, OutOfBlocksError,
                     PromptTooLongError, TableWidthError)
from ._retention import WindowRetention, _SlidingGroup
from ._small import small_tokens
from ._step import _NO_UPDATES, TABLES_DELTA, table_updates
from .evictor import RetentionEvictor
from .kv_groups import FullAttentionSpec, SlidingWindowSpec
from .manager import BlockManager
from .prefix_cache import _GroupNS, _chain, _encode_namespace, _slices
from .types import NULL_BLOCK, AllocStatus, CopyPlan, PrefixHit, Stats

__all__ = ["HybridBlockManager", "HybridPrefillBatch", "HybridStepDelta", "HybridStepResult"]

_U64 = 2**64 - 1
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class HybridStepResult(NamedTuple):
    """:meth:`HybridBlockManager.decode_step`'s result: :class:`pagedkv.StepResult` per group."""

    slot_mapping: np.ndarray  #: int64 (G, T): slot of each new token in each group (batch order)
    block_tables: tuple  #: G int32 (B, width) arrays, NULL_BLOCK padded (and where a window released blocks)
    seq_lens: np.ndarray  #: int32 (B,): tokens of each sequence after the append
    cow: np.ndarray  #: int64 (m, 2): copy-on-write pairs of every group, in the order made (as in the copy plan)


class HybridStepDelta(NamedTuple):
    """:meth:`HybridBlockManager.decode_step`'s result with ``block_tables=False``: :class:`pagedkv.StepDelta` per
    group. The engine keeps one table matrix per group, all indexed by the same table rows (a sequence has one
    row, the same in every group), and applies ``table_updates[g]`` to group ``g``'s matrix after the step: row
    ``table_rows[i]`` of it then equals ``block_table(seq_ids[i], g)``."""

    slot_mapping: np.ndarray  #: int64 (G, T): as HybridStepResult.slot_mapping
    seq_lens: np.ndarray  #: int32 (B,): as HybridStepResult.seq_lens
    cow: np.ndarray  #: int64 (m, 2): as HybridStepResult.cow
    table_rows: np.ndarray  #: int64 (B,): the table row of each sequence of the batch (every group)
    table_updates: tuple  #: G :class:`pagedkv.TableUpdates`: the entries the step changed in each group's tables


class HybridPrefillBatch(NamedTuple):
    """:meth:`HybridBlockManager.allocate_batch`'s result: :class:`pagedkv.PrefillBatch` with per-group slot
    mappings and block tables."""

    seq_ids: tuple
    num_cached_tokens: np.ndarray  #: int32 (B,)
    query_start_loc: np.ndarray  #: int32 (B + 1,)
    token_ids: np.ndarray  #: int32 (T,)
    positions: np.ndarray  #: int64 (T,)
    slot_mapping: np.ndarray  #: int64 (G, T)
    block_tables: tuple  #: G int32 (B, width) arrays
    seq_lens: np.ndarray  #: int32 (B,)


class _Plan(NamedTuple):
    """An allocation planned for every group (nothing changed yet)."""

    arr: np.ndarray  # the whole prompt
    n: int  # tokens the sequence holds: the whole prompt, or (chunked prefill) the hit plus one chunk
    nblocks: int  # blocks of those n tokens (plus lookahead), every group
    nhit: int  # L // block_size, every group
    groups: list  # per group: (gpu hits with nnull leading NULL_BLOCKs, cpu_hits or None, chain, nnull)
    need: int  # free GPU blocks the allocation consumes, all groups
    ncpu: int  # CPU-tier hits, all groups (each a promotion)
    memo: tuple | None = None  # (token bytes of the full blocks, keys per group, roots, the first block whose
    #                            sibling keys are not recorded yet): for the registration and the sibling keys
    held: np.ndarray | None = None  # every group's GPU hits (int64, distinct), when ``memo``: then each group's
    #                                 first item is an int64 array of its hits without the leading NULL_BLOCKs


def _check_groups(groups: object) -> tuple:
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise InvalidArgumentError("kv_cache_groups must be a sequence of FullAttentionSpec / SlidingWindowSpec")
    out = tuple(groups)
    if not out:
        raise InvalidArgumentError("kv_cache_groups must hold at least one group")
    for i, s in enumerate(out):
        if not isinstance(s, (FullAttentionSpec, SlidingWindowSpec)):
            raise InvalidArgumentError(
                f"kv_cache_groups[{i}] must be a FullAttentionSpec or SlidingWindowSpec, got {type(s).__name__}")
    return out


class HybridBlockManager:
    """Paged KV-cache block manager for hybrid models: one block table per KV cache group, one shared pool (see
    the module docstring).

    Args: as :class:`pagedkv.BlockManager` (without ``sliding_window``), plus ``kv_cache_groups``: one spec per
    group, :class:`~pagedkv.FullAttentionSpec` or :class:`~pagedkv.SlidingWindowSpec`, in group index order;
    ``window_retention`` (default on; with prefix caching and a sliding group): released sliding-group blocks
    outside the windows before useful points (prompt end, sequence end, every ``retention_interval`` tokens:
    by default 16 windows of the widest group, 0 for none) are evicted before any other cached block, so hybrid
    prefix hits survive memory pressure (:mod:`pagedkv._retention`).

    Same method names and semantics as :class:`pagedkv.BlockManager`; per-group results (``decode_step`` ->
    :class:`HybridStepResult`, ``allocate_batch`` -> :class:`HybridPrefillBatch`), and ``block_table`` /
    ``slot_mapping`` take the group index. ``take_copy_plan()`` returns one plan for every group (block ids are
    pool-wide: an engine copies block src to dst in every layer slot). Every call is all or nothing across
    groups. Admission counts every group: a prompt of n tokens needs ``G * ceil((n + lookahead) / block_size)``
    blocks at most (NEVER when that exceeds the pool less the watermark), less its hits and the positions
    before a sliding group's window at the hit point.
    """

    atomic_append = True

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        kv_cache_groups: Sequence[object],
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        watermark: float = 0.01,
        enable_kv_events: bool = False,
        max_kv_events: int = 100_000,
        cpu_prefix_cache: bool = False,
        block_table_width: int | None = None,
        window_retention: bool = True,
        retention_interval: int | None = None,
    ) -> None:
        specs = _check_groups(kv_cache_groups)
        if retention_interval is None:  # auto: 16 windows of the widest group
            retention_interval = 16 * max((s.window for s in specs if s.window is not None), default=0)
        retention_interval = check_int("retention_interval", retention_interval, 0)
        retain = bool(window_retention) and enable_prefix_caching and any(s.window is not None for s in specs)
        first = (_SlidingGroup if retain and specs[0].window is not None else BlockManager)(
                             num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                             enable_prefix_caching=enable_prefix_caching, sliding_window=specs[0].window,
                             watermark=watermark, enable_kv_events=enable_kv_events, max_kv_events=max_kv_events,
                             cpu_prefix_cache=cpu_prefix_cache, block_table_width=block_table_width)
        self._specs = specs
        self._g = [first] + [(_SlidingGroup if retain and s.window is not None else BlockManager)._sharing(first, s.window)
                             for s in specs[1:]]
        self._m0 = first
        for m in self._g:  # every group's blocks stay in the prefix cache's map (see pagedkv._hybrid_alloc)
            m._reg.use_runs = False
        # window retention (pagedkv._retention): spare sliding blocks are evicted first
        self._retention = None
        if retain:
            first._cache.evictor = RetentionEvictor(num_gpu_blocks)
            self._retention = WindowRetention(first._bs, retention_interval, first._cache, first._gpu._ref)
            for m, s in zip(self._g, specs):
                if s.window is not None:
                    m._win.retention, m._win.k = self._retention, -(-s.window // first._bs)
        # shared parts, named (the coordinator's only direct state besides the group managers)
        self._bs = first._bs
        self._gpu, self._cpu, self._cache, self._tier = first._gpu, first._cpu, first._cache, first._tier
        self._full = [g for g, s in enumerate(specs) if s.window is None]
        self._sliding = [g for g, s in enumerate(specs) if s.window is not None]
        self._ns_memo: dict = {}  # namespace encoding -> its _GroupNS per group
        # sibling keys (pagedkv._hybrid_alloc): per block of the first full group, the content id it held when the
        # sliding groups' keys of the same prefix were recorded, and those keys (one column per sliding group)
        self._sib = None
        if self._cache is not None and self._full and self._sliding:
            self._sib = (np.zeros(num_gpu_blocks, dtype=np.int64),
                         np.zeros((num_gpu_blocks, len(self._sliding)), dtype=np.uint64))
            a, z = self._sliding[0], self._sliding[-1] + 1
            self._sib_rows = slice(a, z) if self._sliding == list(range(a, z)) else np.array(self._sliding)

    # ------------------------------------------------------------------ read-only state
    @property
    def kv_cache_groups(self) -> tuple:
        """The group specs, in group index order."""
        return self._specs

    @property
    def num_groups(self) -> int:
        return len(self._specs)

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_gpu_blocks(self) -> int:
        return self._gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def cpu_prefix_cache(self) -> bool:
        return self._tier is not None

    @property
    def enable_kv_events(self) -> bool:
        return self._m0.enable_kv_events

    @property
    def watermark_blocks(self) -> int:
        return self._m0.watermark_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Plain free GPU blocks plus unreferenced cached ones, all groups (one pool)."""
        return self._m0.num_free_gpu_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._m0.num_free_cpu_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._m0.num_cached_blocks

    @property
    def num_cpu_cached_blocks(self) -> int:
        return self._m0.num_cpu_cached_blocks

    @property
    def gpu_usage(self) -> float:
        return self._m0.gpu_usage

    @property
    def kv_event_overflows(self) -> int:
        return self._m0.kv_event_overflows

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

    def block_table(self, seq_id: Hashable, group: int) -> np.ndarray:
        """Group ``group``'s block table of the sequence (read-only int32 copy; NULL_BLOCK where a sliding window
        released blocks). O(table length)."""
        return self._group(group).block_table(seq_id)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int) -> np.ndarray:
        """Group ``group``'s slots of positions ``[start, end)`` (int64); see BlockManager.slot_mapping."""
        return self._group(group).slot_mapping(seq_id, start, end)

    # ------------------------------------------------------------------ steps, events, invariants
    def take_copy_plan(self) -> CopyPlan:
        """Every KV block copy of the step, all groups, in the order to execute them (block ids are pool-wide: copy
        block src to dst in every layer slot), and end the step. See BlockManager.take_copy_plan."""
        plan = self._m0.take_copy_plan()  # (the copy list and the tier are shared: one plan)
        for m in self._g[1:]:
            m._t.end_step()
        return plan

    def take_copies(self):
        """Deprecated, as BlockManager.take_copies: :meth:`take_copy_plan` narrowed to the CPU tier's copies."""
        got = self._m0.take_copies()
        for m in self._g[1:]:
            m._t.end_step()
        return got

    def take_events(self) -> list:
        """KV events since the last call, every group's, in order (each carrying its group). O(events)."""
        return self._m0.take_events()

    def check_invariants(self) -> None:
        """Every invariant of every group and of the shared parts (refcounts summed over the groups' tables), and
        that the groups hold the same sequences in the same rows, token counts and partly prefilled sequences
        (chunked prefill: every group records the same prompt lengths). O(blocks + total table length)."""
        m0 = self._m0
        for g, m in enumerate(self._g[1:], 1):
            if m._t.row_of != m0._t.row_of:
                raise AssertionError(f"group {g} holds other sequences or rows than group 0")
            rows = np.fromiter(m0._t.row_of.values(), dtype=np.int64, count=len(m0._t.row_of))
            if not (np.array_equal(m._t.ntok[rows], m0._t.ntok[rows]) and np.array_equal(m._t.nblk[rows], m0._t.nblk[rows])
                    and np.array_equal(m._t.swapped[rows], m0._t.swapped[rows])):
                raise AssertionError(f"group {g}: token counts, table lengths or swap states differ from group 0")
            if m0._t.stepping and not np.array_equal(m._t.ntok0[rows], m0._t.ntok0[rows]):
                raise AssertionError(f"group {g}: the same-step snapshot (_ntok0) differs from group 0's: a same-step "
                                     "check would refuse in one group after another changed")
            if m._t.partial != m0._t.partial:
                raise AssertionError(f"group {g}: partly prefilled sequences {m._t.partial} differ from group 0's "
                                     f"{m0._t.partial}")
        m0._check_invariants_of(tuple(self._g))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block of every group (see BlockManager.reset_prefix_cache). Returns how many blocks
        were freed. O(cached blocks + live sequences)."""
        freed = self._m0.reset_prefix_cache()
        if self._cache is not None:
            for m in self._g[1:]:
                m._t.ccid[:] = 0  # break every live chain
        return freed

    # ------------------------------------------------------------------ allocation
    def _gns(self, namespace: object) -> tuple:
        """The namespace as each group's _GroupNS (validated; memoised per namespace)."""
        data = _encode_namespace(namespace)
        got = self._ns_memo.get(data)
        if got is None:
            if len(self._ns_memo) > 4096:
                self._ns_memo.clear()
            g = len(self._specs)
            got = self._ns_memo[data] = tuple(_GroupNS(namespace, i, s.kind, s.window, g)
                                              for i, s in enumerate(self._specs))
        return got

    def _plan(self, arr: np.ndarray, la: int, gns: tuple, check: bool = True, chunk: int | None = None) -> _Plan:
        """The allocation of prompt ``arr`` in every group, without changing anything (see the module docstring
        for the hit rule). Raises PromptTooLongError / TableWidthError when ``check`` (on the whole prompt).
        ``chunk`` (chunked prefill): the hit L is found on the whole prompt, then the sequence holds only its
        first ``L + chunk`` tokens in every group (the hit rule looks only at tokens before the hit point, so
        this is also the hit of the truncated prompt). O(prompt blocks x groups)."""
        bs, n = self._bs, arr.size
        G = len(self._g)
        nblocks = -(-(n + la) // bs)
        if check:
            m0 = self._m0
            avail = self._gpu.num_blocks - m0._watermark_blocks
            if chunk is not None and chunk < n:  # a sliding group never holds more than its window plus a chunk
                peak = sum(nblocks if m._window is None else min(nblocks, -(-(m._window - 1 + chunk + la) // bs) + 1)
                           for m in self._g)
            else:
                peak = G * nblocks
            if peak > avail:
                raise PromptTooLongError(
                    f"prompt of {n} tokens{f' plus {la} lookahead slots' if la else ''} needs {nblocks} blocks in "
                    f"each full-attention group, {peak} in its {G} KV cache groups at most"
                    f"{f' (in chunks of {chunk} tokens)' if chunk is not None and chunk < n else ''}; the pool has "
                    f"{self._gpu.num_blocks} with {m0._watermark_blocks} kept free")
            if m0._fixed_w and nblocks > m0._fixed_w:
                raise TableWidthError(f"prompt of {n} tokens needs {nblocks} blocks; block_table_width is "
                                      f"{m0._fixed_w}")
        cache = self._cache
        if cache is None:
            if chunk is not None and chunk < n:
                n = chunk
                nblocks = -(-(n + la) // bs)
            return _Plan(arr, n, nblocks, 0, [([], None, (0, 0), 0)] * G, G * nblocks, 0)
        roots = [cache.root(ns, intern=False) for ns in gns]
        fast = find_hit(self, arr, roots) if self._tier is None else None
        if fast is None:
            return self._plan_walk(arr, n, nblocks, la, roots, chunk)
        L, blks, keys, datas, fresh = fast
        if chunk is not None and L * bs + chunk < n:  # chunked prefill: the hit plus one chunk
            n = L * bs + chunk
            nblocks = -(-(n + la) // bs)
        if L:
            held = np.concatenate(blks)
            last = [x - 1 for x in accumulate(b.size for b in blks)]
            cids, cks = cache.cid[held[last]].tolist(), cache.key[held[last]].tolist()
            groups = [(b, None, (c, k), L - b.size) for b, c, k in zip(blks, cids, cks)]
            need = G * (nblocks - L) + int(np.count_nonzero(self._gpu._ref[held] == 0))
        else:
            held = None
            groups = [(blks[g], None, roots[g], 0) for g in range(G)]
            need = G * nblocks
        return _Plan(arr, n, nblocks, L, groups, need, 0, (datas, keys, roots, fresh), held)

    def _plan_walk(self, arr: np.ndarray, n: int, nblocks: int, la: int, roots: list, chunk: int | None) -> _Plan:
        """:meth:`_plan`'s hit found block by block (with the CPU tier, and for prompts of fewer than four full
        blocks; :mod:`pagedkv._hybrid_alloc` otherwise, with the same result). O(prompt blocks x groups)."""
        bs, cache, G = self._bs, self._cache, len(self._g)
        h = (n - 1) // bs
        full_hits = {}
        for g in self._full:
            hits, _ = self._g[g]._reg.lookup(arr, roots[g])
            full_hits[g] = hits
            h = min(h, len(hits))
        L = h
        present: dict = {}
        if self._sliding and L > 0:
            data = arr.tobytes()
            datas = [data[s] for s in _slices(L, 4 * bs)]
            keys = {g: _chain(iter(datas), roots[g][1]) for g in self._sliding}
            if cache._ndl:
                cache.flush()  # (the window check reads the map directly; see prefix_cache "Runs")
            cmap, ctok = cache._map, cache.tok
            tier = self._tier
            tmap = tier._map if tier is not None else None
            ctok_cpu = self._m0._cpu_tok

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
                for g in self._sliding:
                    first = max(0, L * bs - self._specs[g].window) // bs
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
        ref = self._gpu._ref_mv
        cid, ckey, cpu_id = cache.cid, cache.key, self._m0._cpu_id
        groups, need, ncpu = [], 0, 0
        for g, spec in enumerate(self._specs):
            if spec.window is None:
                ents = full_hits[g][:L]
                nnull = 0
            else:
                nnull = max(0, L * bs - spec.window) // bs if L else 0
                ents = [present[(g, j)] for j in range(nnull, L)]
            gpu = [NULL_BLOCK] * nnull
            cpu = None
            reused = 0
            for j, e in enumerate(ents, nnull):
                if e >= 0:
                    gpu.append(e)
                    if ref[e] == 0:
                        reused += 1
                else:
                    if cpu is None:
                        cpu = []
                    cpu.append((j, ~e))
            if L:
                e = ents[-1]
                chain = (int(cid[e]), int(ckey[e])) if e >= 0 else (int(cpu_id[0, ~e]), int(cpu_id[1, ~e]) & _U64)
            else:
                chain = roots[g]
            nc = len(cpu) if cpu else 0
            ncpu += nc
            need += nblocks - L + nc + reused
            groups.append((gpu, cpu, chain, nnull))
        return _Plan(arr, n, nblocks, L, groups, need, ncpu)

    def _hold(self, plan: _Plan) -> list:
        """Reference every GPU hit of every group and pin every CPU-tier hit (before any group takes a block, so
        that no group evicts another's hit). Returns the GPU blocks referenced."""
        if self._cache is None:
            return []
        ref, ev = self._gpu._ref_mv, self._cache.evictor
        if plan.memo is not None:  # (a plan of pagedkv._hybrid_alloc: no CPU-tier hit)
            h = plan.held
            if h is not None:
                gref = self._gpu._ref
                ev.discard_many(h[gref[h] == 0])
                gref[h] += 1
            return h
        held = [b for gpu, _, _, nnull in plan.groups for b in gpu[nnull:]]
        if len(held) > 32:  # a long hit: a few numpy calls (the blocks are distinct: one group each)
            h = np.array(held, dtype=np.int64)
            gref = self._gpu._ref
            ev.discard_many(h[gref[h] == 0])
            gref[h] += 1
        else:
            for b in held:
                if ref[b] == 0:
                    ev.discard(b)
                ref[b] += 1
        pins = [c for _, cpu, _, _ in plan.groups if cpu for _, c in cpu]
        if pins:
            self._tier.pin_many(pins)
        return held

    def _commit(self, seq_id: Hashable, gns: tuple, plan: _Plan) -> None:
        """Create the sequence in every group (hits held by :meth:`_hold`); nothing here can fail."""
        cache = self._cache
        memo = plan.memo
        if memo is not None:  # a plan of pagedkv._hybrid_alloc: every group at once, with the plan's keys
            if not commit_all(self, seq_id, gns, plan) and self._sib is not None:
                self._record_siblings(seq_id, memo[3])
        else:
            for g, (m, (gpu, cpu, chain, nnull)) in enumerate(zip(self._g, plan.groups)):
                if cache is not None and plan.nhit == 0:
                    chain = cache.root(gns[g], intern=True)  # (a new namespace's root gets its content id now)
                m._alloc.commit(seq_id, gns[g], plan.arr, plan.n, plan.nblocks, gpu, cpu, chain, True, nnull)
        if plan.n < plan.arr.size:  # a chunk: fork waits for the rest of the prompt (every group records it)
            for m in self._g:
                m._t.partial[seq_id] = plan.arr.size
        if self._retention is not None:
            self._retention.set_prompt(self._m0._t.row_of[seq_id], plan.arr.size)  # (the whole prompt, chunked too)
        if cache is not None:
            for ns in gns:
                cache.intern(ns)
            if len(cache._roots) > cache.sweep_at:
                self._m0._reg.release_namespaces()

    def _record_siblings(self, seq_id: Hashable, fresh: int) -> None:
        """Record the sibling keys of the new sequence's prompt blocks (see :mod:`pagedkv._hybrid_alloc`): for each
        position from the sliding groups' first held block to the registered ones, the anchor group's block, the
        content id it holds, and the keys of the sliding groups' blocks at that position (read from the prefix
        cache: each is the key of the same prefix in its group), skipping the positions before ``fresh`` (whose
        keys the plan read from valid records). A position where a block is not cached records content id 0
        (never valid). O(blocks recorded x groups), numpy."""
        m = self._g[self._full[0]]
        row = m._t.row_of[seq_id]
        z = int(m._t.nreg[row])
        a = max(fresh, max(int(self._g[g]._t.nrel[row]) for g in self._sliding))
        if z <= a:
            return
        cid, key = self._cache.cid, self._cache.key
        b0 = m._t.table[row, a:z]
        bs = np.stack([self._g[g]._t.table[row, a:z] for g in self._sliding])  # (S, z - a)
        c0 = cid[b0]
        ok = (cid[bs] != 0).all(axis=0)
        sib_cid, sib_key = self._sib
        sib_cid[b0] = np.where(ok, c0, 0)
        sib_key[b0] = key[bs].T

    def _unhold(self, held: list) -> None:
        """Drop the extra references of :meth:`_hold` (a batch's); blocks left unreferenced are parked."""
        if held:
            b = np.array(held, dtype=np.int64)
            self._gpu._ref[b] -= 1  # (distinct blocks)
            self._m0._blocks.park(b[self._gpu._ref[b] == 0].astype(np.int32))

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                 namespace: object = None, num_new_tokens: int | None = None) -> int:
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
        """
        self._m0._t.check_new_id(seq_id)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        gns = self._gns(namespace)
        plan = self._plan(as_tokens(token_ids), la, gns, chunk=k)
        if plan.need > self.num_free_gpu_blocks:
            raise OutOfBlocksError(f"prompt of {plan.n} tokens needs {plan.need} new blocks in "
                                   f"{len(self._g)} KV cache groups; {self.num_free_gpu_blocks} are free")
        self._hold(plan)
        self._commit(seq_id, gns, plan)
        return plan.nhit * self._bs

    def allocate_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]],
                       num_lookahead_slots: int = 0, *, namespaces: Sequence[object] | None = None,
                       num_new_tokens: Sequence[int] | None = None) -> HybridPrefillBatch:
        """Allocate B sequences at once and return their prefill metadata per group (:class:`HybridPrefillBatch`).
        Like consecutive :meth:`allocate` calls (a prompt hits the blocks the batch's earlier prompts cached),
        all or nothing, and every hit planned for the batch is held before any block is taken. Admission counts
        each prompt's blocks without the sharing inside the batch (a batch that fits only thanks to it raises
        OutOfBlocksError; allocate its prompts one by one). A later prompt whose burst hit would take more blocks
        than it was admitted for (chunks: hits on unreferenced cached blocks are taken, not saved) keeps its admitted
        plan, so the batch never takes more than admitted. O(total prompt blocks x groups).

        ``num_new_tokens`` (chunked prefill): None, or one chunk size (>= 1) per prompt, as for :meth:`allocate`;
        the metadata then covers each sequence's hit plus its chunk (``seq_lens``: the tokens held)."""
        seq_ids = list(seq_ids)
        prompts = list(token_ids) if not isinstance(token_ids, np.ndarray) or token_ids.ndim == 2 else None
        if prompts is None or len(prompts) != len(seq_ids):
            raise InvalidTokensError(f"token_ids must hold one prompt per sequence ({len(seq_ids)})")
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if namespaces is None:
            namespaces = [None] * len(seq_ids)
        else:
            if isinstance(namespaces, (str, bytes, int)):
                raise InvalidArgumentError("namespaces must be a sequence of one namespace per prompt")
            namespaces = list(namespaces)
            if len(namespaces) != len(seq_ids):
                raise InvalidArgumentError(f"got {len(namespaces)} namespaces for {len(seq_ids)} prompts")
        if num_new_tokens is None:
            chunks = [None] * len(seq_ids)
        else:
            if isinstance(num_new_tokens, (int, np.integer, str, bytes)) or len(num_new_tokens) != len(seq_ids):
                raise InvalidArgumentError("num_new_tokens must be None or one chunk size per prompt")
            chunks = [check_int(f"num_new_tokens[{i}]", c, 1) for i, c in enumerate(num_new_tokens)]
        seen: set = set()
        for s in seq_ids:
            self._m0._t.check_new_id(s)
            if s in seen:
                raise DuplicateSequenceError(f"sequence {s!r} appears twice in one batch")
            seen.add(s)
        gnss = [self._gns(ns) for ns in namespaces]
        arrs = [as_tokens(p, f"token_ids[{i}]") for i, p in enumerate(prompts)]
        plans = [self._plan(a, la, gns, chunk=c) for a, gns, c in zip(arrs, gnss, chunks)]
        need = sum(p.need for p in plans)
        if need > self.num_free_gpu_blocks:
            raise OutOfBlocksError(f"the batch of {len(plans)} prompts needs {need} new blocks; "
                                   f"{self.num_free_gpu_blocks} are free")
        # ---- mutation: nothing below can fail
        held = list(dict.fromkeys(b for p in plans for b in self._hold_list(p)))
        if held:
            self._hold_blocks(held)
        if self._tier is not None:
            pins = [c for p in plans for _, cpu, _, _ in p.groups if cpu for _, c in cpu]
            if pins:
                self._tier.pin_many(list(dict.fromkeys(pins)))
        nhit, shapes = [], []
        G = len(self._g)
        for i, (s, gns) in enumerate(zip(seq_ids, gnss)):
            plan = plans[i]
            if i and self._cache is not None:
                again = self._plan(arrs[i], la, gns, False, chunks[i])  # (burst hits on the earlier prompts)
                # The admitted plan's hits are held, so it costs exactly its new blocks and CPU promotions now.
                # A burst hit that would cost more (a chunk holds the hit plus k tokens, so hits past the admitted
                # ones that sit unreferenced in the cache are taken, not saved) keeps the admitted plan (one without
                # CPU-tier hits, which an earlier prompt may have promoted).
                if plan.ncpu or again.need <= G * (plan.nblocks - plan.nhit):
                    plan = again
            self._hold(plan)
            self._commit(s, gns, plan)
            nhit.append(plan.nhit)
            shapes.append((None, plan.n))
        self._unhold(held)
        sids = tuple(seq_ids)
        res = [m._alloc.prefill_result(sids, arrs, shapes, [m._t.row_of[s] for s in seq_ids], nhit) for m in self._g]
        r0 = res[0]
        return HybridPrefillBatch(sids, r0.num_cached_tokens, r0.query_start_loc, r0.token_ids, r0.positions,
                                  _frozen(np.stack([r.slot_mapping for r in res])),
                                  tuple(r.block_tables for r in res), r0.seq_lens)

    def _hold_list(self, plan: _Plan) -> list:
        if plan.memo is not None:
            return [] if plan.held is None else plan.held.tolist()
        return [b for gpu, _, _, nnull in plan.groups for b in gpu[nnull:]]

    def _hold_blocks(self, blocks: list) -> None:
        ref, ev = self._gpu._ref_mv, self._cache.evictor
        for b in blocks:
            if ref[b] == 0:
                ev.discard(b)
            ref[b] += 1

    def lookup_prefix(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                      namespace: object = None, num_new_tokens: int | None = None) -> PrefixHit:
        """What :meth:`allocate` would find cached now (the hybrid hit), changing nothing: cached tokens and
        blocks (per group), CPU-tier promotions (all groups) and the free GPU blocks the allocation would consume
        (all groups; with ``num_new_tokens``, those of the hit plus that chunk, as ``allocate(...,
        num_new_tokens=)`` takes them). O(prompt blocks x groups)."""
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        plan = self._plan(as_tokens(token_ids), la, self._gns(namespace), check=False, chunk=k)
        return PrefixHit(plan.nhit * self._bs, plan.nhit, plan.ncpu, plan.need)

    def can_allocate(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *,
                     namespace: object = None, num_new_tokens: int | None = None) -> AllocStatus:
        """NEVER if the prompt's blocks in every group exceed the pool less the watermark (the whole prompt in a
        full-attention group; with ``num_new_tokens``, a sliding-window group counts at most its window plus one
        chunk, all it ever holds while the prompt is appended chunk by chunk), LATER if the blocks the allocation would consume (every group, hits
        counted; with ``num_new_tokens``, only the hit plus that chunk) do not fit now, else OK."""
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = None if num_new_tokens is None else check_int("num_new_tokens", num_new_tokens, 1)
        arr = as_tokens(token_ids)
        try:
            plan = self._plan(arr, la, self._gns(namespace), chunk=k)
        except PromptTooLongError:
            return AllocStatus.NEVER
        except TableWidthError:
            return AllocStatus.NEVER
        if self.num_free_gpu_blocks - plan.need >= self._m0._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Create ``child_seq_id`` sharing every block of the parent in every group (see BlockManager.fork). A
        parent allocated a chunk of its prompt is forked only once its whole prompt is appended
        (SequenceStateError before, no group changing: group 0 checks first and every group holds the same
        token counts)."""
        self._m0.fork(parent_seq_id, child_seq_id)  # (raises, changing nothing, before any group changes)
        for m in self._g[1:]:
            m.fork(parent_seq_id, child_seq_id)
        if self._retention is not None:
            self._retention.copy_row(self._m0._t.row_of[parent_seq_id], self._m0._t.row_of[child_seq_id])

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release the sequence's blocks in every group (see BlockManager.free; with ``cache=False`` every group's
        blocks of the last call are withdrawn, or, if another sequence holds one, SequenceStateError and nothing
        changes)."""
        row = self._m0._t.row(seq_id)
        if not cache and self._cache is not None and not self._m0._t.swapped[row]:
            ref = self._gpu._ref
            for m in self._g:
                blocks = m._t.table[row, int(m._t.pend[row]) : int(m._t.nreg[row])]
                blocks = blocks[blocks >= 0]
                if (ref[blocks] > 1).any():
                    m._reg.withdraw_pending(seq_id, row)  # raises, changing nothing
        ret = self._retention
        if ret is None or self._m0._t.swapped[row]:
            for m in self._g:
                m.free(seq_id, cache=cache)
            return
        # window retention: the sliding groups' blocks outside every useful window become spare once released
        end = int(self._m0._t.ntok[row]) // self._bs
        parts = []
        for m in self._g:
            if m._window is not None:
                a, z = int(m._t.nrel[row]), int(m._t.nblk[row])
                parts.append((m._t.table[row, a:z].copy(), ret.kept(row, np.arange(a, z), m._win.k, end)))
        for m in self._g:
            m.free(seq_id, cache=cache)
        for blk, keep in parts:
            ret.demote(blk[::-1].copy(), keep[::-1].copy())  # (tail first, the release order)

    # ------------------------------------------------------------------ appending
    def _tokens(self, b: int, token_ids: object, num_new_tokens: object) -> tuple:
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
        return arr, counts

    def _fast_ok(self, rows: np.ndarray) -> bool:
        """Whether every group's one-token fast path (BlockManager._step1) succeeds for these rows: no shared
        written block in any group, every group's new blocks free together, no table past the fixed width."""
        m0, bs = self._m0, self._bs
        ntok = m0._t.ntok[rows]
        j = ntok // bs
        grow = j >= m0._t.nblk[rows]
        n_grow = int(np.count_nonzero(grow))
        if n_grow * len(self._g) > self.num_free_gpu_blocks:
            return False
        if n_grow and m0._fixed_w and int(j[grow].max()) >= m0._fixed_w:
            return False
        ref = self._gpu._ref
        col = j - grow
        for m in self._g:
            ref_w = ref[m._t.table[rows, col]]
            if ref_w.max() > 1 and (ref_w[~grow] > 1).any():
                return False
        return True

    def _plans(self, rows: np.ndarray, counts: np.ndarray, la: int) -> list:
        """Every group's append plan; raises OutOfBlocksError / TableWidthError (changing nothing) when the sum
        of the groups' new blocks exceeds the free ones (plus what the windows release)."""
        plans = [m._step.plan(rows, counts, la) for m in self._g]
        free = self.num_free_gpu_blocks
        needed = sum(p[0] for p in plans)
        available = free + sum(p[1] - free for p in plans)
        if needed > available:
            raise OutOfBlocksError(f"the step needs {needed} new blocks in {len(plans)} KV cache groups; "
                                   f"{available} are free")
        fw = self._m0._fixed_w
        if fw:
            need = plans[0][2]
            if int(need.max()) > fw:
                i = int(np.argmax(need))
                raise TableWidthError(f"sequence {self._m0._t.seq_of[int(rows[i])]!r} would need {int(need[i])} "
                                      f"blocks; block_table_width is {fw}")
        return plans

    def _commit_order(self, plans: list) -> list:
        """The order to commit the groups' append plans in: group order when each group finds its blocks free at
        its turn, else the groups whose windows release more than they take first (the total fits, so each then
        does). O(G)."""
        free = self.num_free_gpu_blocks
        net = [p[0] - (p[1] - free) for p in plans]  # blocks taken less blocks the window releases
        acc = 0
        for x in net:
            acc += x
            if acc > free:
                return sorted(range(len(plans)), key=net.__getitem__)
        return list(range(len(plans)))

    def _step_small(self, seq_ids, token_ids: object, b: int, delta: bool) -> HybridStepResult | HybridStepDelta | None:
        """One token each for a few sequences, every group in plain Python (numpy's fixed costs dominate there):
        sliding groups release what their windows let go, then every group takes the plain-Python step of
        BlockManager (:mod:`pagedkv._small`). None, having changed nothing, unless every group's blocks (new
        ones and possible copy-on-write copies, releases not counted) are free together."""
        toks = small_tokens(token_ids, b)
        if toks is None:
            return None
        m0 = self._m0
        ids = seq_ids if type(seq_ids) is list else list(seq_ids)
        memo = m0._t.memo_small
        if memo is not None and memo[0] is m0._t.memo_ids and ids == memo[0]:
            rows = memo[1]
        else:
            rows = m0._t.small_rows(ids)
            if rows is None:
                return None
        ntok, nblk = (m0._t.mvs or m0._t.views())[:2]
        bs, fw = self._bs, m0._fixed_w
        grow = 0
        for r in rows:
            j = ntok[r] // bs
            if j == nblk[r]:
                if j >= fw > 0:
                    return None
                grow += 1
        need = grow * len(self._g)
        ref = self._gpu._ref_mv
        for m in self._g:
            table = (m._t.mvs or m._t.views())[2]
            for r in rows:
                j = ntok[r] // bs
                if j < nblk[r] and ref[table[r, j]] > 1:
                    need += 1  # (an upper bound of the copy-on-write copies)
        if need > self.num_free_gpu_blocks:
            return None
        # ---- mutation: nothing below can fail (every group's step finds its blocks)
        mode = TABLES_DELTA if delta else True
        res, upds = [], []
        for m in self._g:
            released = [] if delta else None
            if m._window is not None:
                m._win.release_small(rows, released)
            if b == 1:
                got = m._small.step_one(ids[0], toks, mode)
            else:
                got = m._small.step_small(ids, toks, b, mode)
            assert got is not None, "a group's small step declined after the coordinator's checks"
            res.append(got)
            if delta:
                upd = got.table_updates
                if released:  # (the window's releases come first; no entry is both released and given a block)
                    rr, cc = zip(*released)
                    upd = table_updates([(np.array(rr, dtype=np.int64), np.array(cc, dtype=np.int64))],
                                        [(upd.rows, upd.cols, upd.blocks)] if upd.rows.size else [])
                upds.append(upd)
        cows = [r.cow for r in res if len(r.cow)]
        slots = np.concatenate([r.slot_mapping for r in res]).reshape(len(res), b)
        cow = res[0].cow if not cows else cows[0] if len(cows) == 1 else np.concatenate(cows)
        if delta:
            return HybridStepDelta(slots, res[0].seq_lens, cow, res[0].table_rows, tuple(upds))
        return HybridStepResult(slots, tuple([r.block_tables for r in res]), res[0].seq_lens, cow)

    def table_rows(self, seq_ids: Iterable[Hashable]) -> np.ndarray:
        """The table row of each sequence (read-only int64 (B,)), the same in every group: the row of
        :class:`HybridStepDelta`'s ``table_rows`` and of every group's ``table_updates`` (see
        :meth:`pagedkv.BlockManager.table_rows`). O(B)."""
        return self._m0.table_rows(seq_ids)

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
        if num_new_tokens is None and num_lookahead_slots == 0 and type(num_lookahead_slots) is int:
            b = len(seq_ids)
            if 0 < b <= self._m0._small_batch:
                res = self._step_small(seq_ids, token_ids, b, delta)
                if res is not None:
                    return res
        rows = self._m0._t.rows(seq_ids)
        b = rows.size
        arr, counts = self._tokens(b, token_ids, num_new_tokens)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        G = len(self._g)
        if b == 0:
            if delta:
                return HybridStepDelta(np.zeros((G, 0), np.int64), np.zeros(0, np.int32), np.zeros((0, 2), np.int64),
                                       _frozen(np.zeros(0, np.int64)), tuple(_NO_UPDATES for _ in self._g))
            return HybridStepResult(np.zeros((G, 0), np.int64), tuple(np.zeros((0, 0), np.int32) for _ in self._g),
                                    np.zeros(0, np.int32), np.zeros((0, 2), np.int64))
        if counts is None and la == 0 and self._fast_ok(rows):
            res = [m._step.step1(rows, arr, delta) for m in self._g]
            order = None
        else:
            if counts is None:
                counts = np.ones(b, dtype=np.int64)
            if arr.size != counts.sum():
                raise InvalidTokensError(f"got {arr.size} tokens for counts summing to {counts.sum()}")
            plans = self._plans(rows, counts, la)
            res = [None] * len(plans)
            order = self._commit_order(plans)
            mode = TABLES_DELTA if delta else True
            for g in order:
                res[g] = self._g[g]._step.append(rows, counts, arr, la, mode, plans[g])
        cows = [res[g].cow for g in (order or range(G)) if res[g].cow.size]  # (in the order they were made)
        cow = np.concatenate(cows) if len(cows) > 1 else cows[0] if cows else res[0].cow
        slots = np.stack([r.slot_mapping for r in res])
        if delta:
            return HybridStepDelta(slots, res[0].seq_lens, cow, res[0].table_rows,
                                   tuple(r.table_updates for r in res))
        return HybridStepResult(slots, tuple(r.block_tables for r in res), res[0].seq_lens, cow)

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0
                     ) -> list[tuple[int, int]]:
        """Append tokens to one sequence in every group; returns every group's copy-on-write pairs."""
        arr = as_tokens(token_ids)
        res = self.decode_step([seq_id], arr, num_lookahead_slots, num_new_tokens=np.array([arr.size]))
        return [(int(s), int(d)) for s, d in res.cow]

    def can_append_slots(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0, *,
                         num_new_tokens: int = 1) -> bool:
        """Whether the append fits in every group together (see BlockManager.can_append_slots)."""
        rows = self._m0._t.rows(list(seq_ids))
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = check_int("num_new_tokens", num_new_tokens, 1)
        if rows.size == 0:
            return True
        try:
            self._plans(rows, np.full(rows.size, k, dtype=np.int64), la)
        except (OutOfBlocksError, TableWidthError):
            return False
        return True

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        seq_ids = list(seq_ids)
        rows = self._m0._t.rows_where(seq_ids, swapped=False)
        return sum(m._t.unique_blocks(rows).size for m in self._g) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks of every group to the CPU pool; (gpu, cpu) pairs of every group. All or
        nothing (OutOfBlocksError when the CPU pool cannot take every group's blocks)."""
        seq_ids = list(seq_ids)
        m0 = self._m0
        rows = m0._t.rows_where(seq_ids, swapped=False)
        m0._swap.refuse_pending(seq_ids, rows)  # (every group holds the same snapshot: group 0's answers)
        need = sum(m._t.unique_blocks(rows).size for m in self._g)
        if need > self.num_free_cpu_blocks:
            raise OutOfBlocksError(f"swap_out needs {need} CPU blocks in {len(self._g)} KV cache groups; "
                                   f"{self.num_free_cpu_blocks} are free")
        out = self._m0.swap_out(seq_ids)  # (its same-step check raises before any group changes)
        for m in self._g[1:]:
            out += m.swap_out(seq_ids)
        return out

    def _swap_in_need(self, rows: np.ndarray, la: int) -> tuple[int, int]:
        """(blocks swap_in consumes, blocks it needs at most) over every group."""
        need = most = 0
        ref = self._gpu._ref
        for m in self._g:
            uniq = m._t.unique_blocks(rows)
            reuse = m._swap.reuse(uniq)
            extra = int(np.maximum(-(-(m._t.ntok[rows] + la) // self._bs) - m._t.nblk[rows], 0).sum())
            most += uniq.size + extra
            need += uniq.size + extra - sum(1 for g in reuse.tolist() if g >= 0 and ref[g] > 0)
        return need, most

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0) -> AllocStatus:
        rows = self._m0._t.rows_where(list(seq_ids), swapped=True)
        la = check_int("num_lookahead_slots", num_lookahead_slots, 0)
        need, most = self._swap_in_need(rows, la)
        wm = self._m0._watermark_blocks
        if most > self._gpu.num_blocks - wm:
            return AllocStatus.NEVER
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= wm else AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back in every group; (cpu, gpu) pairs of every group. All or nothing."""
        seq_ids = list(seq_ids)
        rows = self._m0._t.rows_where(seq_ids, swapped=True)
        need, _ = self._swap_in_need(rows, 0)
        if need > self.num_free_gpu_blocks:
            raise OutOfBlocksError(f"swap_in needs {need} GPU blocks in {len(self._g)} KV cache groups; "
                                   f"{self.num_free_gpu_blocks} are free")
        out: list = []
        for m in self._g:
            out += m.swap_in(seq_ids)
        if self._m0._t.stepping:  # a group that reused a block cached in this step marks the rows pending: all do
            pend = np.zeros(rows.size, dtype=bool)
            for m in self._g:
                pend |= m._t.ntok0[rows] < 0
            if pend.any():
                for m in self._g:
                    m._t.ntok0[rows[pend]] = -1
        return out
