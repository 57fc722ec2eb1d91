"""The calls of :class:`pagedkv.BlockManager` off a plain request's path (internal): swapping, retention (the
implementations behind ``bm.retention``), the lookahead slots of speculative decoding, cache maintenance, the
audit and the deprecated ``take_copies``. A stateless base class (empty ``__slots__``, no ``__init__``) whose
methods work on the manager's own parts, so ``manager/core.py`` keeps the per-step calls; a request that uses
none of these never enters this module. The many-group manager (:class:`pagedkv.hybrid.GroupedManager`)
overrides every call here with its own over every group.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import numpy as np

from .._checks import as_tokens as _as_tokens, check_int as _check_int
from . import _invariants
from ._rows import _EMPTY_I64
from ..errors import InvalidArgumentError, OutOfBlocksError
from ..retention.eviction import make_evictor
from ..retention.steering import Pin, SteeredEvictor
from ..tiers.cpu import DEMOTE, PROMOTE
from ..types import AllocStatus, CacheCopies

__all__ = ["OffStep"]


class OffStep:
    """BlockManager's calls off the per-step path (see the module docstring)."""

    __slots__ = ()

    def _take_copies(self) -> CacheCopies:
        """Deprecated: :meth:`take_copy_plan` (it ends the step the same way) narrowed to the CPU tier's copies,
        ``demotions`` (gpu, cpu) and ``promotions`` (cpu, gpu) pairs; the step's swap and copy-on-write copies
        are then only in the calls' return values. Executing these lists kind after kind is not safe when a step
        mixes swaps with tier copies (see :meth:`take_copy_plan`). O(copies + rows)."""
        parts = [(t, s, d) for t, s, d in self._copies if t in (DEMOTE, PROMOTE)]
        self.take_copy_plan()
        dem = [p for t, s, d in parts if t == DEMOTE for p in zip(s, d)]
        pro = [p for t, s, d in parts if t == PROMOTE for p in zip(s, d)]
        return CacheCopies(np.array(dem, dtype=np.int64).reshape(-1, 2), np.array(pro, dtype=np.int64).reshape(-1, 2))

    def lookahead_slots(self, seq_ids: Sequence[Hashable], num_lookahead_slots: int) -> np.ndarray:
        """The batch form of ``slot_mapping(seq, n, n + k)`` for the reserved lookahead slots: int64
        ``(1, B * k)`` (one row per KV cache group, as :meth:`HybridBlockManager.lookahead_slots`), the slots of
        positions ``num_tokens(seq) .. num_tokens(seq) + k - 1`` of each sequence, sequence 0's first: where the
        engine writes the drafts' K/V in the forward of the step that reserved them (``decode_step(...,
        num_lookahead_slots=k)``). Every sequence must be live, on the GPU and distinct (as for decode_step) and
        hold at least ``k`` reserved slots (InvalidArgumentError otherwise). Changes nothing. O(B x k): plain Python
        up to 32 slots, a few numpy calls past that."""
        ids = seq_ids if type(seq_ids) is list else list(seq_ids)
        rows = self._t.rows(ids)
        k = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        return self._lookahead(rows, k, ids)[None]

    def _lookahead(self, rows: np.ndarray, k: int, ids: list) -> np.ndarray:
        """:meth:`lookahead_slots` of validated rows, flat (B * k,) (internal; the hybrid stacks its groups')."""
        t, bs = self._t, self._bs
        if k == 0 or rows.size == 0:
            return _EMPTY_I64
        if rows.size * k <= 32:  # a few slots: plain Python over the row arrays (numpy's fixed costs dominate)
            mv = t.views()
            ntok_mv, nblk_mv, flat, width = mv.ntok, mv.nblk, mv.flat, mv.cols
            out = []
            for i, r in enumerate(rows.tolist()):
                n = ntok_mv[r]
                if nblk_mv[r] * bs - n < k:
                    raise InvalidArgumentError(f"sequence {ids[i]!r} has {nblk_mv[r] * bs - n} reserved slots after "
                                               f"its {n} tokens, fewer than num_lookahead_slots={k}")
                base = r * width
                out += [flat[base + p // bs] * bs + p % bs for p in range(n, n + k)]
            return np.array(out, dtype=np.int64)
        ntok = t.ntok[rows].astype(np.int64)
        room = t.nblk[rows].astype(np.int64) * bs - ntok
        short = np.flatnonzero(room < k)
        if short.size:
            i = int(short[0])
            raise InvalidArgumentError(f"sequence {ids[i]!r} has {int(room[i])} reserved slots after its "
                                       f"{int(ntok[i])} tokens, fewer than num_lookahead_slots={k}")
        pos = ntok[:, None] + np.arange(k, dtype=np.int64)
        blocks = t.table[rows[:, None], pos // bs].astype(np.int64)
        return (blocks * bs + pos % bs).reshape(-1)

    # ------------------------------------------------------------------ retention (priority, session, pins)
    def _set_retention(self, seq_id: Hashable, priority: object, session: Hashable) -> None:
        """``retention.set_retention`` (the contract: :class:`pagedkv.manager.parts.Retention`). O(1)."""
        self._t.any_row(seq_id)  # (a LOADING sequence too: free applies the hint)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if self._cache is None:
            raise InvalidArgumentError("set_retention needs enable_prefix_caching=True")
        hash(session)
        if priority:
            self._steering()
        self._hints[seq_id] = (int(priority), session)

    def _pin_prefix(self, token_ids: Sequence[int], ttl: float | None, namespace: object) -> Pin:
        """``retention.pin_prefix`` (the contract: :class:`pagedkv.manager.parts.Retention`). O(prompt blocks)."""
        if self._cache is None or not self._pin_budget:
            raise InvalidArgumentError("pin_prefix needs enable_prefix_caching=True and pin_budget_blocks > 0")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise InvalidArgumentError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        arr = _as_tokens(token_ids)
        # (one token more: a lookup leaves the last block to compute; a pin holds every full block)
        hits, _ = self._reg.lookup(np.append(arr, arr[:1]), self._cache.root(namespace, intern=False))
        gpu = []
        for b in hits:
            if b < 0:
                break
            gpu.append(b)
        if not gpu:
            return Pin(0, 0, 0, ttl)
        ev = self._steering()
        return ev.pin(np.array(gpu, dtype=np.int64), len(gpu) * self._bs, ttl)

    def _unpin(self, pin_id: int) -> None:
        """``retention.unpin``. O(its blocks)."""
        if not self._steered:
            from ..errors import UnknownPinError

            raise UnknownPinError(f"no pin {pin_id!r} (unpinned already, expired, or never made)")
        self._cache.evictor.unpin(pin_id)

    def _steering(self) -> SteeredEvictor:
        """The prefix cache's evictor as a SteeredEvictor (installed over the current policy evictor once)."""
        cache = self._cache
        if not self._steered:
            policy = self._policy
            cache.evictor = SteeredEvictor(cache.evictor, self._gpu.num_blocks,
                                           lambda n: make_evictor(policy, n, cache), cache.cid, self._pin_budget)
            self._steered = True
        return cache.evictor

    def _inherit(self, parent: Hashable, child: Hashable) -> None:
        """A forked child takes its parent's retention priority (not its session hint: the session policy counts
        one request per hint). O(1)."""
        h = self._hints.get(parent)
        if h is not None and h[0]:
            self._hints[child] = (h[0], None)

    def _retain(self, seq_id: Hashable, row: int) -> None:
        """Tag the sequence's GPU blocks with its retention hint just before free releases them."""
        prio, session = self._hints.pop(seq_id, (0, None))
        t = self._t
        if t.swapped[row] or self._cache is None:
            return
        blocks = t.table[row, t.nrel[row] : t.nblk[row]].astype(np.int64)
        ev = self._cache.evictor
        if self._steered:
            ev.tag(blocks, prio)
        if session is not None:
            ev.hint(blocks, session)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the CPU pool has room for the sequences' blocks (each shared block counted once)."""
        rows = self._t.rows_where(list(seq_ids), swapped=False)
        return self._t.unique_blocks(rows).size <= self._blocks.num_free_cpu

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns (gpu_block, cpu_block) pairs to copy. A block
        shared by several of these sequences moves once; one also held by a sequence left on the GPU is copied
        and stays there for it. Raises OutOfBlocksError (changing nothing) if the CPU pool is too small.
        O(total table length)."""
        return self._swap.swap_out(list(seq_ids))

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0) -> AllocStatus:
        """Whether swapped-out sequences fit back on the GPU (with the watermark and ``num_lookahead_slots``
        extra slots each): NEVER, LATER or OK, as for can_allocate."""
        rows = self._t.rows_where(list(seq_ids), swapped=True)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        uniq = self._t.unique_blocks(rows)
        reuse = self._swap.reuse(uniq, rows)
        extra = np.maximum(-(-(self._t.ntok[rows] + la) // self._bs) - self._t.nblk[rows], 0).sum()
        need = int(uniq.size + extra)
        if need > self._gpu.num_blocks - self._watermark_blocks:
            return AllocStatus.NEVER
        ref = self._gpu.ref
        need -= sum(1 for g in reuse if g >= 0 and ref[g] > 0)
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= self._watermark_blocks else AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back; returns (cpu_block, gpu_block) pairs to copy. With prefix caching a
        full block whose content is still cached on the GPU is reused instead of copied. Raises OutOfBlocksError
        (changing nothing) if the GPU pool is too small. O(total table length)."""
        return self._swap.swap_in(list(seq_ids))

    # ------------------------------------------------------------------ cache maintenance
    def reset_prefix_cache(self) -> int:
        """Forget every cached block: unreferenced ones return to the free ring (LRU first), referenced ones
        stay with their sequences, uncached. Live sequences never cache their blocks afterwards (their KV may
        predate whatever made the reset necessary, e.g. new weights); new sequences cache as usual. Returns how
        many blocks were freed. O(cached blocks + live sequences)."""
        if self._cache is None:
            return 0
        freed = self._cache.clear()
        self._gpu.give(np.asarray(freed, dtype=np.int32))
        if self._tier is not None:
            self._tier.clear()
        self._cpu_id[0] = 0
        self._t.ccid[:] = 0  # break every live chain
        return len(freed)


    # ------------------------------------------------------------------ audit
    def check_invariants(self) -> None:
        """Check every invariant of the manager in O(blocks + total table length); raise AssertionError.

        - each GPU (CPU) block's refcount equals the number of GPU-resident (swapped-out) tables holding it;
        - no block appears twice in one table, released positions hold NULL_BLOCK, tables cover the tokens;
        - free ring, evictor and used blocks partition each pool (free + cached-free + used == total);
        - the free ring holds unreferenced uncached blocks, the evictor unreferenced cached ones, in a
          consistent linked list; the cache map and the per-block entries agree (no block under two keys).
        """
        _invariants.check(self._blocks, self._tier, self._bs, [(self._t, self._window)],
                          self._ext.extra_refs() + self._stores.extra_refs())
        self._ext.check(_invariants.fail)
        self._stores.check(_invariants.fail)
