"""The named parts of :class:`pagedkv.BlockManager`'s surface: what is not a per-step call or view.

The manager keeps the per-step calls and read-only views (at most 30 public names, the same on one KV cache
group and many); the rest is reached through four attributes, each a small object over the manager's parts:

- ``bm.config``: :class:`ManagerConfig`, the construction settings (frozen);
- ``bm.external``: :class:`ExternalKV`, external KV (docs/external-kv.md): loads, holds and store plans;
- ``bm.retention``: :class:`Retention`, how released blocks are kept (docs/guide/prefix-caching.md): priorities, sessions,
  pins and the eviction policy;
- ``bm.events``: :class:`Events`, the prefix cache's KV events (:mod:`pagedkv.events`).

Counters that are not per step (``num_cached_blocks``, ``num_free_cpu_blocks``, ``gpu_usage``, ...) are fields of
``bm.stats`` (:class:`pagedkv.Stats`). The names these replaced still answer, deprecated (:data:`DEPRECATED`: a
``DeprecationWarning`` naming the new spelling; ``scripts/migrate_surface.py`` rewrites call sites): read-only
properties of :class:`Surface` that ``dir()`` leaves out. Extra entries in a class's dict cost no lookup of
another name; a ``__getattr__`` fallback would (CPython does not specialise attribute access on such a class).

None of this is on the per-step path: each part's call is one call into the part that does the work.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from ..events import KVCacheEvent
from ..kv_groups import FullAttentionSpec, SlidingWindowSpec
from ..retention.eviction import policy_class
from .._checks import check_int as _check_int
from ..errors import InvalidArgumentError, SequenceStateError
from ..retention.steering import Pin, SteeredEvictor
from ._external import ExternalLoad, Hold
from ._stores import STORE_POLICIES, StorePlan

__all__ = ["DEPRECATED", "Events", "ExternalKV", "ManagerConfig", "Retention", "Surface", "check_groups", "policy_name"]


@dataclass(frozen=True)
class ManagerConfig:
    """The settings a manager was built with (``bm.config``), read-only; see :class:`pagedkv.BlockManager` for
    each. ``kv_cache_groups`` is the one-group tuple (``(FullAttentionSpec(),)``, or ``(SlidingWindowSpec(W),)``
    with ``sliding_window=W``) on a one-group manager; ``eviction_policy`` is the policy's name;
    ``watermark_blocks`` the blocks admission keeps free (``int(watermark * num_gpu_blocks)``);
    ``grouped_results`` whether the results' plain names are per group (``slot_mapping`` (G, T), G block tables),
    as they are with several groups."""

    num_gpu_blocks: int
    block_size: int
    num_cpu_blocks: int
    kv_cache_groups: tuple
    sliding_window: int | None
    enable_prefix_caching: bool
    watermark: float
    watermark_blocks: int
    enable_kv_events: bool
    max_kv_events: int
    cpu_prefix_cache: bool
    block_table_width: int | None
    eviction_policy: str
    pin_budget_blocks: int
    store_policy: str
    store_min_hits: int
    window_retention: bool
    retention_interval: int | None
    grouped_results: bool

    @property
    def num_groups(self) -> int:
        """``len(kv_cache_groups)``."""
        return len(self.kv_cache_groups)


class ExternalKV:
    """External KV (docs/external-kv.md), ``bm.external``: the E tokens after a hit arrive from outside into
    reserved blocks (``allocate(..., num_external_tokens=E)``), blocks kept for a reader outside under a lease
    (holds), and the blocks to write to the storage tiers (store plans). With several KV cache groups every call
    covers every group."""

    __slots__ = ("_ext", "_stores")

    def __init__(self, ext: object, stores: object) -> None:
        self._ext, self._stores = ext, stores  # (the manager's External and Stores parts)

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
        and held prompt blocks are registered (in every group) as ``allocate`` would have registered them,
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
        never evicted, reused or written (a write copies on write); full ones stay findable. With several KV
        cache groups, the blocks each group's table holds for those tokens (a sliding group: only those its
        window still holds, NULL_BLOCK positions left out); ``Hold.block_ids`` are group 0's,
        ``Hold.group_block_ids`` every group's. Raises SequenceStateError (LOADING, swapped out),
        InvalidArgumentError (lease), UnknownSequenceError. O(table length x groups)."""
        return self._ext.hold(seq_id, lease_s, now)

    def release_hold(self, hold_id: int) -> None:
        """Release a hold's blocks (tail first, as ``free``). UnknownHoldError for an unknown, released or
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

    def take_store_plan(self) -> StorePlan | None:
        """The blocks to write to the storage tiers since the last call, by the store policy
        (``config.store_policy``; None when there are none, always with ``"none"``), each pinned (a reference)
        until :meth:`complete_store`: a store never reads a block that was evicted and reused. A content stored
        successfully is not planned again. write_through plans the blocks registered before the last
        ``take_copy_plan`` (their KV is written by that step's forward): execute a plan's stores after that
        forward. With several KV cache groups, blocks of every group (a key names its group: each group's chain
        starts from a root of its own); a sliding group's registered blocks are the ones it still held.
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


class Retention:
    """How released blocks are kept (docs/guide/prefix-caching.md), ``bm.retention``: a sequence's priority and session hint
    (:meth:`set_retention`), pins of cached prefixes within ``config.pin_budget_blocks`` (:meth:`pin_prefix`,
    :meth:`unpin`, :attr:`pins`), and the eviction policy's name. With several KV cache groups every call covers
    every group's blocks."""

    __slots__ = ("_set", "_pin", "_unpin", "_cache", "_policy")

    def __init__(self, set_retention: object, pin_prefix: object, unpin: object, cache: object,
                 policy: str) -> None:
        # (the manager's own implementations, its prefix cache or None, and the eviction policy's name)
        self._set, self._pin, self._unpin, self._cache, self._policy = set_retention, pin_prefix, unpin, cache, policy

    def set_retention(self, seq_id: Hashable, *, priority: int = 0, session: Hashable = None) -> None:
        """How the sequence's blocks are kept once ``free`` releases them. ``priority`` (vLLM's request
        field: a lower value is a higher priority, default 0): unreferenced blocks of a larger value are evicted
        before any block of a smaller one (:mod:`pagedkv.retention.steering`; with several groups and window
        retention, also a sliding group's blocks its window releases while the sequence runs). ``session`` (a
        conversation id, any hashable): a hint for the ``"session"`` eviction policy, which keeps the blocks of
        a conversation longer the more requests it has had, and for ``"density"``, which learns how likely a
        conversation is to come back; other policies ignore it. Set it any time before the free; the last call
        wins. A ``fork`` child takes its parent's priority (the session hint stays the parent's). Raises
        UnknownSequenceError or InvalidArgumentError (needs prefix caching), changing nothing. O(1); the first
        non-default priority switches on the priority classes (:class:`SteeredEvictor`)."""
        self._set(seq_id, priority, session)

    def pin_prefix(self, token_ids: Sequence[int], *, ttl: float | None = None, namespace: object = None) -> Pin:
        """Pin the cached GPU blocks of this prefix (a system prompt, a tool list: allocate it first): they are
        never evicted while pinned. Pins up to the first full block not cached on the GPU; ``Pin.num_tokens``
        says how many tokens that is (0, with ``pin_id`` 0: nothing cached, and nothing pinned). ``ttl``
        (seconds, None: until :meth:`unpin`) is refreshed each time a hit takes the pin's last block back or it
        is released. The distinct pinned blocks of all pins stay within ``config.pin_budget_blocks``: past it
        PinBudgetError, nothing pinned. With a sliding window a pin holds every full block of the prefix (a hit
        walks the chain from the first block). With several KV cache groups: the blocks a hit at the prefix's
        length L needs in every group (a full-attention group's ``[0, L)``, a sliding group's last window before
        L), L the longest such hit with every needed block on the GPU; ``Pin.num_blocks`` counts every group's.
        Raises InvalidArgumentError (no prefix caching, no budget, bad ttl), InvalidTokensError.
        O(prompt blocks x groups)."""
        return self._pin(token_ids, ttl, namespace)

    def unpin(self, pin_id: int) -> None:
        """Drop a pin (UnknownPinError if there is none by that id); its blocks that no other pin holds become
        evictable, idle ones at the most recent end of their class. O(its blocks)."""
        self._unpin(pin_id)

    @property
    def pins(self) -> tuple[Pin, ...]:
        """The live pins (expired ones dropped first)."""
        ev = self._evictor()
        return ev.pin_list() if isinstance(ev, SteeredEvictor) else ()

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct GPU blocks held by pins, every group's (what the pin budget counts)."""
        ev = self._evictor()
        return ev.num_pinned if isinstance(ev, SteeredEvictor) else 0

    @property
    def eviction_policy(self) -> str:
        """The eviction policy's name (:mod:`pagedkv.retention.eviction`), as ``config.eviction_policy``."""
        return self._policy

    def _evictor(self) -> object:
        return self._cache.evictor if self._cache is not None else None


class Events:
    """The prefix cache's KV events (:mod:`pagedkv.events`), ``bm.events``; recorded with
    ``enable_kv_events=True`` (and prefix caching)."""

    __slots__ = ("_cache",)

    def __init__(self, cache: object, enabled: bool) -> None:
        self._cache = cache if enabled else None  # (the prefix cache when events are recorded)

    def take(self) -> list[KVCacheEvent]:
        """The KV events since the last call, in order, and clear them (with several KV cache groups every
        group's, each carrying its group). Empty when events are off (or prefix caching is). After an overflow
        (more than ``max_kv_events`` untaken events) the list is a full resynchronisation: ``AllBlocksCleared``
        then one ``BlockStored`` per cached block, parents first. O(events), or O(cached blocks) after an
        overflow."""
        return self._cache.take_events() if self._cache is not None else []

    @property
    def overflows(self) -> int:
        """How many times the event buffer overflowed (each answered by a resynchronisation)."""
        return self._cache.event_overflows if self._cache is not None else 0

    @property
    def enabled(self) -> bool:
        """Whether events are recorded (``config.enable_kv_events`` and prefix caching)."""
        return self._cache is not None


#: old name -> its new spelling (a dotted path from the manager), what the old name's property answers with a
#: DeprecationWarning, and the table of ``scripts/migrate_surface.py``. ``atomic_append`` (always True: decode_step
#: is all or nothing) and ``take_copies`` (use ``take_copy_plan``) have none (None).
DEPRECATED: dict = {}
for _part, _names in (
        ("config", ("num_gpu_blocks", "num_cpu_blocks", "kv_cache_groups", "num_groups", "sliding_window",
                    "enable_prefix_caching", "watermark_blocks", "enable_kv_events", "cpu_prefix_cache",
                    "eviction_policy", "pin_budget_blocks", "store_policy", "grouped_results")),
        ("external", ("external_blocks", "finish_external", "loading_seq_ids", "is_loading", "parked_seq_ids",
                      "hold", "release_hold", "renew_hold", "expire_holds", "holds", "take_store_plan",
                      "complete_store", "pending_stores")),
        ("retention", ("set_retention", "pin_prefix", "unpin", "pins", "num_pinned_blocks")),
        ("stats", ("num_cached_blocks", "num_cpu_cached_blocks", "num_free_cpu_blocks", "gpu_usage"))):
    for _n in _names:
        DEPRECATED[_n] = f"{_part}.{_n}"
DEPRECATED.update(take_events="events.take", kv_event_overflows="events.overflows", atomic_append=None,
                  take_copies=None)
del _part, _names, _n


class _SurfaceType(type):
    """The manager classes' type: ``dir(BlockManager)`` leaves the old names out (they stay, deprecated)."""

    def __dir__(cls) -> list[str]:
        return [n for n in type.__dir__(cls) if n not in DEPRECATED]


class Surface(metaclass=_SurfaceType):
    """What every manager class shares beyond its per-step calls (stateless: no ``__init__``, empty slots): the
    named parts' attributes, the deprecated old names (read-only properties that warn, left out of ``dir()``;
    :data:`DEPRECATED`), and ``free``'s external-KV parts. What a manager must
    set: ``_parts`` (its ManagerConfig, ExternalKV and Events), ``_ext``, ``_cache``, and the
    retention calls ``_set_retention``, ``_pin_prefix``, ``_unpin``. No part holds the manager (no reference
    cycle: a manager is freed as soon as it is dropped)."""

    __slots__ = ()

    @property
    def external(self) -> ExternalKV:
        """External KV: loads, holds, store plans (:class:`~pagedkv.manager.parts.ExternalKV`)."""
        return self._parts[1]

    @property
    def retention(self) -> Retention:
        """Priorities, sessions, pins (:class:`~pagedkv.manager.parts.Retention`; a new view on each read: it
        holds the manager's own calls, and a manager holding it would be a reference cycle, freed only by the
        garbage collector)."""
        return Retention(self._set_retention, self._pin_prefix, self._unpin, self._cache,
                         self._parts[0].eviction_policy)

    @property
    def events(self) -> Events:
        """The prefix cache's KV events (:class:`~pagedkv.manager.parts.Events`)."""
        return self._parts[2]

    def __dir__(self) -> list[str]:
        return [n for n in object.__dir__(self) if n not in DEPRECATED]  # (the old names are not listed)

    def _hold_and_free(self, seq_id: Hashable, hold_for: float, now: float | None, cache: bool) -> Hold:
        """``free(seq_id, hold_for=)``: a hold, then ``free``, all or nothing (the hold undone if the free
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


def settings(num_gpu_blocks: object, block_size: object, num_cpu_blocks: object, enable_prefix_caching: object,
             sliding_window: object, watermark: object, enable_kv_events: object, max_kv_events: object,
             cpu_prefix_cache: object, block_table_width: object, eviction_policy: object, pin_budget_blocks: object,
             store_policy: object, store_min_hits: object, kv_cache_groups: object, window_retention: object,
             retention_interval: object) -> ManagerConfig:
    """A one-group manager's settings, checked (InvalidArgumentError naming the first bad one), as its
    :class:`ManagerConfig`. O(1)."""
    if kv_cache_groups is not None:  # (one group here; several: the grouped manager, see BlockManager.__new__)
        (spec,) = check_groups(kv_cache_groups, one=True)
        if spec.window is not None:
            if sliding_window is not None and sliding_window != spec.window:
                raise InvalidArgumentError(f"sliding_window={sliding_window!r} and kv_cache_groups="
                                           f"[SlidingWindowSpec({spec.window})] disagree; give one of them")
            sliding_window = spec.window
    num_gpu_blocks = _check_int("num_gpu_blocks", num_gpu_blocks, 1)
    if store_policy not in STORE_POLICIES:
        raise InvalidArgumentError(f"store_policy must be one of {STORE_POLICIES}, got {store_policy!r}")
    store_min_hits = _check_int("store_min_hits", store_min_hits, 1)
    if store_policy != "none" and not enable_prefix_caching:
        raise InvalidArgumentError("store_policy needs enable_prefix_caching=True")
    pin_budget_blocks = _check_int("pin_budget_blocks", pin_budget_blocks, 0)
    policy_class(eviction_policy)  # (raises InvalidArgumentError naming the policies)
    if (eviction_policy != "lru" or pin_budget_blocks) and not enable_prefix_caching:
        raise InvalidArgumentError("eviction_policy and pin_budget_blocks need enable_prefix_caching=True")
    block_size = _check_int("block_size", block_size, 1)
    num_cpu_blocks = _check_int("num_cpu_blocks", num_cpu_blocks, 0)
    max_kv_events = _check_int("max_kv_events", max_kv_events, 1)
    if sliding_window is not None:
        sliding_window = _check_int("sliding_window", sliding_window, 1)
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise InvalidArgumentError(f"watermark must be a number in [0, 1), got {watermark!r}")
    if block_table_width is not None:
        block_table_width = _check_int("block_table_width", block_table_width, 1)
    if cpu_prefix_cache and not (enable_prefix_caching and num_cpu_blocks > 0):
        raise InvalidArgumentError("cpu_prefix_cache needs enable_prefix_caching=True and num_cpu_blocks > 0")
    return ManagerConfig(
        num_gpu_blocks, block_size, num_cpu_blocks,
        (FullAttentionSpec(),) if sliding_window is None else (SlidingWindowSpec(sliding_window),),
        sliding_window, bool(enable_prefix_caching), watermark, int(watermark * num_gpu_blocks),
        bool(enable_kv_events), max_kv_events, bool(cpu_prefix_cache), block_table_width,
        policy_name(eviction_policy), pin_budget_blocks, store_policy, store_min_hits, bool(window_retention),
        retention_interval, False)


def init_signature(cls: type) -> inspect.Signature:
    """``cls``'s signature as its ``__init__`` reads (without ``self``): what ``inspect.signature(cls)`` should
    answer, not ``BlockManager.__new__``'s ``*args, **kwargs``. O(parameters)."""
    sig = inspect.signature(cls.__init__)
    return sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=inspect.Signature.empty)


def check_groups(groups: object, one: bool = False, sliding_window: object = None) -> tuple:
    """``kv_cache_groups`` as a tuple of specs (InvalidArgumentError otherwise); ``one``: exactly one. With
    ``sliding_window`` (the one-group shorthand) ``groups`` must be None; None: the shorthand's one group.
    O(groups)."""
    if groups is None:
        return (FullAttentionSpec(),) if sliding_window is None else (SlidingWindowSpec(sliding_window),)
    if sliding_window is not None:
        raise InvalidArgumentError("sliding_window is the one-group shorthand; with kv_cache_groups give each "
                                   "group's SlidingWindowSpec")
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise InvalidArgumentError("kv_cache_groups must be a sequence of FullAttentionSpec / SlidingWindowSpec")
    out = tuple(groups)
    if not out:
        raise InvalidArgumentError("kv_cache_groups must hold at least one group")
    for i, s in enumerate(out):
        if not isinstance(s, (FullAttentionSpec, SlidingWindowSpec)):
            raise InvalidArgumentError(
                f"kv_cache_groups[{i}] must be a FullAttentionSpec or SlidingWindowSpec, got {type(s).__name__}")
    if one and len(out) != 1:
        raise InvalidArgumentError(f"this manager class has one KV cache group, got {len(out)}")
    return out


def policy_name(policy: object) -> str:
    """An ``eviction_policy`` argument's name: the string, or a policy class's ``name`` (else its class name)."""
    if isinstance(policy, str):
        return policy
    cls = policy_class(policy)
    return cls.name or cls.__name__


def _deprecated(name: str, new: str | None) -> property:
    """The old name ``name`` as a read-only property: a DeprecationWarning naming ``new``, then its value. A
    property (not a ``__getattr__`` fallback: a class with ``__getattr__`` loses CPython's specialised attribute
    access on every ``self._x`` of the per-step path, 8-10% of a one-sequence decode_step)."""

    def get(self: Surface) -> object:
        if new is not None:
            value = self
            for part in new.split("."):
                value = getattr(value, part)
            hint = f"use .{new}"
        elif name == "atomic_append":  # (decode_step and append_slots are all or nothing)
            value, hint = True, "decode_step is always all or nothing"
        else:
            value, hint = self._take_copies, "use take_copy_plan()"
        warnings.warn(f"BlockManager.{name} is deprecated: {hint} (scripts/migrate_surface.py rewrites it)",
                      DeprecationWarning, stacklevel=2)
        return value

    return property(get, doc=f"Deprecated: {'``.' + new + '``' if new else name}.")


for _n, _new in DEPRECATED.items():
    setattr(Surface, _n, _deprecated(_n, _new))
del _n, _new
