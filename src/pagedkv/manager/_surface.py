"""The public surface :class:`pagedkv.BlockManager` and :class:`pagedkv.HybridBlockManager` share, written once.

Two mixins, each a set of read-only properties and thin calls into a part, with the contract in one docstring:

- :class:`PoolState`: the pools, the prefix cache and its KV events, the retention settings (read-only state);
- :class:`ExternalKV`: the external-KV contract (docs/external-kv.md): loads, holds and store plans.

What a facade must set for them (``_wire`` does; the hybrid's are the shared parts of its group managers): ``_bs``,
``_gpu`` / ``_cpu`` (the BlockPools), ``_blocks`` (Blocks), ``_cache`` (PrefixCache or None), ``_tier`` (CpuTier or
None), ``_kv_events``, ``_watermark_blocks``, ``_policy``, ``_pin_budget``; ``_ext`` (External, whose ``t`` is the
facade's sequence tables: group 0's on the hybrid), ``_stores`` (Stores) and ``_store`` (policy, min hits).

No per-call cost: an attribute found on a base class is found through the type's method cache, as one on the
class itself; none of these is on the per-step path.
"""

from __future__ import annotations

from typing import Hashable, Iterable

from ..events import KVCacheEvent
from ..retention.eviction import policy_class
from ..retention.steering import Pin, SteeredEvictor
from ..errors import InvalidArgumentError, SequenceStateError
from ._external import ExternalLoad, Hold
from ._stores import StorePlan


class PoolState:
    """Read-only state of the pools, the prefix cache, its KV events and the retention settings."""

    __slots__ = ()

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._bs

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks in the GPU pool (one pool for every KV cache group)."""
        return self._gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks in the CPU pool."""
        return self._cpu.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def cpu_prefix_cache(self) -> bool:
        """Whether the prefix cache has a CPU tier (:mod:`pagedkv.tiers.cpu`)."""
        return self._tier is not None

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission keeps free."""
        return self._watermark_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Plain free GPU blocks plus unreferenced cached ones (which are evicted on demand), every group's."""
        return self._blocks.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        """Plain free CPU blocks plus the CPU tier's evictable cached ones (swap evicts them on demand)."""
        return self._blocks.num_free_cpu

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks whose content is in the prefix cache (referenced or not), every group's."""
        return len(self._cache) if self._cache is not None else 0

    @property
    def num_cpu_cached_blocks(self) -> int:
        """CPU blocks whose content is in the CPU tier of the prefix cache."""
        return len(self._tier) if self._tier is not None else 0

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks held by sequences."""
        return 1.0 - self._blocks.num_free / self._gpu.num_blocks

    @property
    def enable_kv_events(self) -> bool:
        return self._kv_events

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, in order, and clear them (:mod:`pagedkv.events`; on a
        HybridBlockManager every group's, each carrying its group). Empty when events are off (or prefix caching
        is). After an overflow (more than ``max_kv_events`` untaken events) the list is a full
        resynchronisation: ``AllBlocksCleared`` then one ``BlockStored`` per cached block, parents first.
        O(events), or O(cached blocks) after an overflow."""
        return self._cache.take_events() if self._cache is not None and self._kv_events else []

    @property
    def kv_event_overflows(self) -> int:
        """How many times the event buffer overflowed (each answered by a resynchronisation)."""
        return self._cache.event_overflows if self._cache is not None and self._kv_events else 0

    @property
    def eviction_policy(self) -> str:
        """The eviction policy's name (:mod:`pagedkv.retention.eviction`; a policy class's ``name``, else its class
        name)."""
        p = self._policy
        if isinstance(p, str):
            return p
        cls = policy_class(p)
        return cls.name or cls.__name__

    @property
    def pin_budget_blocks(self) -> int:
        """The most distinct GPU blocks (every group's together) pins may hold."""
        return self._pin_budget

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct GPU blocks held by pins, every group's (what the pin budget counts)."""
        ev = self._cache.evictor if self._cache is not None else None
        return ev.num_pinned if isinstance(ev, SteeredEvictor) else 0

    @property
    def pins(self) -> tuple[Pin, ...]:
        """The live pins (expired ones dropped first)."""
        ev = self._cache.evictor if self._cache is not None else None
        return ev.pin_list() if isinstance(ev, SteeredEvictor) else ()


class ExternalKV:
    """External KV (docs/external-kv.md): the E tokens after a hit arrive from outside into reserved blocks
    (``allocate(..., num_external_tokens=E)``), blocks kept for a reader outside under a lease (holds), and the
    blocks to write to the storage tiers (store plans). On a HybridBlockManager every call covers every group."""

    __slots__ = ()

    def external_blocks(self, seq_id: Hashable) -> ExternalLoad | None:
        """The blocks a LOADING sequence's external KV goes into: :class:`ExternalLoad` (``start_token`` = the
        hit allocate found, ``block_ids``, their chained content ``keys``; ``group_block_ids[g]`` and
        ``group_keys[g]`` are group g's, ``block_ids`` / ``keys`` group 0's), or None when the sequence is not
        LOADING. UnknownSequenceError for an unknown id. O(prompt blocks x groups)."""
        return self._ext.external_blocks(seq_id)

    def finish_external(self, done: Iterable[Hashable] = (), failed: dict | None = None) -> dict:
        """Report ended transfers: ``done`` (every external token arrived) and ``failed`` ``{seq: ok}`` (the
        first ``ok`` external tokens arrived intact; a multiple of block_size below E'). The engine guarantees
        that no transfer writes those blocks any more. Each live sequence becomes RUNNING, its arrived blocks
        and held prompt blocks are registered (in every group) as :meth:`allocate` would have registered them,
        and it counts as handed slots in this step: prefill its tokens from the returned count to
        ``num_tokens(seq)`` in this step. A sequence aborted while LOADING (``free``) has its parked blocks freed
        and is left out of the result. Returns ``{seq: tokens computed}``. Everything is checked first
        (UnknownSequenceError, SequenceStateError for a sequence not loading, e.g. reported twice;
        InvalidArgumentError for a bad ``ok`` or an id reported twice in the call); nothing changes then.
        O(reported blocks)."""
        return self._ext.finish(done, failed)

    @property
    def loading_seq_ids(self) -> tuple:
        """The LOADING sequences (external KV still arriving), in allocation order."""
        return tuple(self._ext.t.loading)

    def is_loading(self, seq_id: Hashable) -> bool:
        """Whether the sequence is LOADING (UnknownSequenceError for an unknown id). O(1)."""
        t = self._ext.t
        t.any_row(seq_id)
        return seq_id in t.loading

    @property
    def parked_seq_ids(self) -> tuple:
        """Sequences freed while LOADING whose blocks wait for :meth:`finish_external` to report them."""
        return tuple(self._ext.t.parked)

    def hold(self, seq_id: Hashable, lease_s: float, *, now: float | None = None) -> Hold:
        """Keep the blocks covering the sequence's tokens for a reader outside (a decode replica reading a
        prefill's KV, a store in flight): one more reference each until :meth:`release_hold` or
        :meth:`expire_holds` past ``now + lease_s`` (``now``: ``time.monotonic()`` by default). Held blocks are
        never evicted, reused or written (a write copies on write); full ones stay findable. On a
        HybridBlockManager, the blocks each group's table holds for those tokens (a sliding group: only those its
        window still holds, NULL_BLOCK positions left out); ``Hold.block_ids`` are group 0's,
        ``Hold.group_block_ids`` every group's. Raises SequenceStateError (LOADING, swapped out),
        InvalidArgumentError (lease), UnknownSequenceError. O(table length x groups)."""
        return self._ext.hold(seq_id, lease_s, now)

    def release_hold(self, hold_id: int) -> None:
        """Release a hold's blocks (tail first, as :meth:`free`). UnknownHoldError for an unknown, released or
        expired id, changing nothing. O(its blocks)."""
        self._ext.release_hold(hold_id)

    def renew_hold(self, hold_id: int, lease_s: float, *, now: float | None = None) -> Hold:
        """A new lease for a hold: it expires at ``now + lease_s``; returns the renewed Hold.
        UnknownHoldError, InvalidArgumentError, changing nothing. O(1)."""
        return self._ext.renew_hold(hold_id, lease_s, now)

    def expire_holds(self, now: float | None = None) -> list[int]:
        """Release every hold whose lease ended (``expires_at <= now``); returns their ids. The manager never
        expires a hold by itself. O(holds + released blocks)."""
        return self._ext.expire_holds(now)

    @property
    def holds(self) -> tuple:
        """The live holds, oldest first."""
        return tuple(self._ext.holds.values())

    @property
    def store_policy(self) -> str:
        """The store policy (``"none"``, ``"write_through"``, ``"selective"`` or ``"write_back"``)."""
        return self._store[0]

    def take_store_plan(self) -> StorePlan | None:
        """The blocks to write to the storage tiers since the last call, by the store policy (None when there
        are none, always with ``"none"``), each pinned (a reference) until :meth:`complete_store`: a store never
        reads a block that was evicted and reused. A content stored successfully is not planned again.
        write_through plans the blocks registered before the last :meth:`take_copy_plan` (their KV is written by
        that step's forward): execute a plan's stores after that forward. On a HybridBlockManager, blocks of
        every group (a key names its group: each group's chain starts from a root of its own); a sliding group's
        registered blocks are the ones it still held.
        write_through: O(num_gpu_blocks) vectorised compare plus O(planned blocks); selective: O(planned)."""
        return self._stores.take_store_plan()

    def complete_store(self, store_id: int, success: bool = True) -> None:
        """Unpin a store plan's blocks; ``success`` marks their contents stored. UnknownStoreError for an unknown
        or completed id, changing nothing. O(its blocks)."""
        self._stores.complete_store(store_id, success)

    @property
    def pending_stores(self) -> tuple:
        """Store ids taken and not completed."""
        return tuple(self._stores.plans)

    # ---------------------------------------------------------------- free's external-KV parts (internal)
    def _hold_and_free(self, seq_id: Hashable, hold_for: float, now: float | None, cache: bool) -> Hold:
        """``free(seq_id, hold_for=)``: :meth:`hold`, then ``free``, all or nothing (the hold undone if the free
        raises)."""
        if not cache:
            raise InvalidArgumentError("free(..., hold_for=) holds KV for a reader; with cache=False that KV "
                                       "was never written")
        h = self._ext.hold(seq_id, hold_for, now)
        try:
            self.free(seq_id, cache=cache)
        except BaseException:
            self._ext.undo_hold(h.hold_id)
            raise
        return h

    def _check_unheld(self, seq_id: Hashable) -> None:
        """``free(seq_id, cache=False)`` refuses a sequence a hold covers (SequenceStateError). O(1) without
        holds."""
        if self._ext.holds and self._ext.held(seq_id):
            raise SequenceStateError(
                f"free({seq_id!r}, cache=False): a hold of it covers KV that is then never written; release its "
                "holds first (their reader must drop them)")
