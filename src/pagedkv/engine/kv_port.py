"""The engine's side of a prefill/decode split: :class:`EngineKVPort`, the ``KVPort`` of
:mod:`pagedkv.server.kv_handoff` over an :class:`~pagedkv.engine.LLM` (docs/pd-split.md).

Built on the block manager's external KV (docs/external-kv.md: ``hold``, ``release_hold``, ``expire_holds``;
``allocate(num_external_tokens=)`` through the scheduler's waiting-for-KV state) and the engine's block payloads
(:mod:`.kv_io`: ``read_blocks`` / ``write_blocks``, ``model_fingerprint``). It plugs into the step loop where the
storage tiers do (``llm.kv_tiers``: the tiers' calls are passed on to the engine's own tiers, if any), so the
engine's code is unchanged:

- **prefill side**: a request marked by :meth:`EngineKVPort.hold_on_finish` is held in the step whose forward
  computes its prompt's last chunk (after the forward, before the step's update frees the finished request):
  ``block_manager.hold(seq, lease)``; :meth:`take_hold` hands the hold over, cut to the prompt's whole blocks
  before its last token. Blocks are read (:meth:`read_blocks`) and holds released or expired under the engine's
  step lock, so a hold can never be released (and its blocks reused) while its blocks are being copied out.
- **decode side**: :meth:`attach_external` stages the payloads read from the prefill replica; when the request is
  added it waits for KV (``wait_for_kv``) and is ready at the next step (``kv_ready`` of tokens ``[0, n * bs)``);
  the step that admits it writes the payloads into its external blocks before the forward, and computes the rest.

**KV cache groups** (Gemma 3 on a ``HybridBlockManager``): the hold covers every group, and what is handed over
is, per group, the blocks a load of the prompt's ``n`` whole blocks before its last token needs
(:func:`.kv_io.group_block_ranges`: every block of a full-attention group, only the blocks a sliding group's
window still sees at position ``n x block_size``), position by position (:func:`.kv_io.group_transfer_order`).
The hold's ``block_ids`` stay group 0's ``n`` blocks (``remote_block_ids``, vLLM's shape: ``remote_num_tokens``
is their tokens); ``wire_block_ids`` are the blocks served, in that order, each named by its group's chained key
and fingerprint (:meth:`block_names`). The decode side keeps the longest usable prefix of what arrived
(:func:`.kv_io.usable_blocks`), allocates it as external tokens with ``external_window_only`` (the scheduler:
a sliding group reserves only its window's blocks), and writes every group's blocks
(:func:`.kv_io.write_external_groups`). A prefill replica whose sliding window released a block the transfer
needs (a chunk boundary on the prompt's last token) hands nothing over (the decode replica computes the prompt).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

from ..errors import PagedKVError
from .kv_io import (group_hold_block_ids, group_transfer_order, model_fingerprint, payload_bytes, read_blocks,
                    usable_blocks, write_external, write_external_groups)

__all__ = ["EngineKVPort"]

#: the most chain keys remembered as held by the shared tier (the prefill side's store path; oldest dropped)
_MAX_SHARED_KEYS = 1 << 18


class _Held(NamedTuple):
    hold_id: int
    block_ids: tuple  # group 0's blocks of the prompt's n whole blocks before its last token
    num_tokens: int
    expires_at: float
    wire_block_ids: tuple | None = None  # KV cache groups: the blocks served, in group_transfer_order


class EngineKVPort:
    """See the module docstring. ``lock``: the engine's step lock (``AsyncEngine._lock``), held by whoever
    steps the engine; the port takes it to read held blocks and to release or expire holds."""

    def __init__(self, llm: Any, lock: Any = None) -> None:
        bm = llm.block_manager
        if not hasattr(bm, "hold"):
            raise ValueError("a prefill/decode split needs a block manager with holds and external KV")
        groups = getattr(llm, "kv_cache_groups", None)
        #: per KV cache group its sliding window (None: full attention); None without KV cache groups
        self.windows = tuple(g.window for g in groups) if groups is not None else None
        self._fps: list = []  # (KV cache groups) each group's fingerprint, on first use
        self._llm = llm
        self._bm = bm
        self._kv = llm.kv_cache
        self._fingerprint = None  # (computed on first use: it reads the weights file once)
        self.block_size = int(bm.block_size)
        self.payload_bytes = payload_bytes(llm.kv_cache)
        self._lock = lock if lock is not None else threading.Lock()
        self._marked: dict = {}  # request id -> lease (prefill side, until its prompt is computed)
        self._held: dict = {}  # request id -> _Held, until take_hold
        self._staged: dict = {}  # request id -> payloads (decode side, until the request is added)
        self._adding: dict = {}  # request id -> payloads (added, waiting for kv_ready)
        self._ready: dict = {}  # request id -> (0, payloads) (until its first prefill)
        self._inner = llm.kv_tiers  # the engine's own storage tiers (None without)
        self.stats = {"held": 0, "blocks_read": 0, "loaded": 0, "written_blocks": 0, "held_incomplete": 0}
        llm.kv_tiers = self
        self._in_shared: dict = {}  # chain keys the shared tier is known to hold (oldest first, bounded)
        self._shared_lock = threading.Lock()
        self._watch_shared()

    @property
    def inner(self) -> Any:
        """The engine's own storage tiers (:class:`pagedkv.engine.kv_tiers.EngineTiers`) this port passes the tiers'
        calls on to, or None without tiers."""
        return self._inner

    # ------------------------------------------------------------------------------------ KVPort (server side)
    @property
    def fingerprint(self) -> Any:
        """The :class:`pagedkv.tiers.ModelFingerprint` of this engine's KV blocks (weights, dtype, block size,
        layout)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self._llm.model, self._kv)
        return self._fingerprint

    def block_names(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list[str]:
        """The store names of the values a transfer of the prompt's first ``num_blocks`` blocks carries, in wire
        order: without KV cache groups block ``i``'s (as ``KVHandoff.names``); with them one per
        :func:`.kv_io.group_transfer_order` pair ``(g, j)``: group ``g``'s fingerprint, the namespace and block
        ``j``'s chained key in group ``g`` (``pagedkv.block_hashes(..., group=g)``). O(num_blocks x block_size x
        groups)."""
        from ..blocks.prefix_cache import block_hashes
        from ..tiers import store_names

        bs = self.block_size
        toks = list(token_ids[: num_blocks * bs])
        if self.windows is None:
            return store_names(self.fingerprint, list(block_hashes(toks, bs, namespace)), namespace)
        if not self._fps:
            self._fps = [model_fingerprint(self._llm.model, self._kv, g) for g in range(len(self.windows))]
        order = group_transfer_order(num_blocks, bs, self.windows)
        per = {}
        for g in sorted({g for g, _ in order}):
            keys = block_hashes(toks, bs, namespace, g)
            per[g] = store_names(self._fps[g], list(keys), namespace)
        return [per[g][j] for g, j in order]

    def hold_on_finish(self, request: Any, lease_s: float) -> None:
        self._marked[request.request_id] = float(lease_s)

    def take_hold(self, request_id: Any) -> _Held | None:
        self._marked.pop(request_id, None)
        return self._held.pop(request_id, None)

    def read_blocks(self, hold_id: Any, block_ids: Sequence[int]) -> list:
        with self._lock:
            if not any(h.hold_id == hold_id for h in self._bm.holds):
                raise LookupError(f"hold {hold_id} is gone")
            out = read_blocks(self._kv, list(block_ids))
        self.stats["blocks_read"] += len(out)
        return out

    def release_hold(self, hold_id: Any) -> None:
        with self._lock:
            self._bm.release_hold(hold_id)  # (UnknownHoldError is a LookupError)

    def expire_holds(self) -> list:
        with self._lock:
            return list(self._bm.expire_holds())

    def attach_external(self, request: Any, payloads: Sequence, num_blocks: int | None = None) -> None:
        """Stage the payloads read for a request (its prompt's leading blocks). With KV cache groups they are a
        leading part of :func:`.kv_io.group_transfer_order` of ``num_blocks`` blocks (default: the prompt's
        whole blocks before its last token); only the longest usable prefix is kept (:func:`.kv_io.usable_blocks`:
        a sliding group's window blocks must have arrived)."""
        payloads = list(payloads)
        if self.windows is not None and payloads:
            bs = self.block_size
            n = (len(request.prompt_token_ids) - 1) // bs if num_blocks is None else int(num_blocks)
            order = group_transfer_order(n, bs, self.windows)
            m = usable_blocks(n, bs, self.windows, len(payloads))
            need = set(group_transfer_order(m, bs, self.windows)) if m else set()
            # (a load of m blocks needs, per group, a subset of what a load of n blocks carries)
            got = {gj: p for gj, p in zip(order, payloads)}
            payloads = [m, {gj: got[gj] for gj in need}] if m else []
        if payloads:
            self._staged[request.request_id] = payloads

    def drop_staged(self, request_id: Any) -> None:
        self._staged.pop(request_id, None)

    # ------------------------------------------------------------------------------------ the step loop's calls
    def on_add(self, request_id: Any, token_ids: Any, namespace: Any, block_manager: Any) -> bool:
        payloads = self._staged.pop(request_id, None)
        if payloads:
            self._adding[request_id] = payloads
            return True
        return self._inner.on_add(request_id, token_ids, namespace, block_manager) if self._inner else False

    def poll(self, scheduler: Any) -> int:
        n = 0
        if self._adding:
            adding, self._adding = self._adding, {}
            for rid, payloads in adding.items():
                if self.windows is not None:  # ([m, {(group, block): payload}]: m blocks usable)
                    nblocks, payloads = payloads
                else:
                    nblocks = len(payloads)
                try:
                    ok = scheduler.kv_ready(rid, 0, nblocks * self.block_size)
                except PagedKVError:  # (a range the server's checks exclude) the prompt is computed
                    ok = scheduler.kv_ready(rid, 0, 0)
                    payloads = None
                if ok:
                    n += 1
                    if payloads:
                        self._ready[rid] = (0, payloads)  # (the prompt's blocks from block 0)
                        self.stats["loaded"] += 1
        if self._ready:
            for rid in [rid for rid in self._ready if not scheduler.has_request(rid)]:
                del self._ready[rid]  # (aborted before its admission)
        return n + (self._inner.poll(scheduler) if self._inner else 0)

    def forget(self, request_id: Any) -> None:
        for d in (self._staged, self._adding, self._ready, self._marked, self._held):
            d.pop(request_id, None)
        if self._inner:
            self._inner.forget(request_id)

    def wait(self, timeout: float) -> None:
        if self._inner and not self._adding:
            self._inner.wait(timeout)

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        if self._ready:
            if self.windows is not None:
                ready = {rid: e[1] for rid, e in self._ready.items()
                         if any(pw.request_id == rid for pw in plan.prefills)}
                for rid in ready:
                    del self._ready[rid]
                self.stats["written_blocks"] += write_external_groups(plan, kv_cache, ready, self.block_size)
            else:
                self.stats["written_blocks"] += write_external(plan, kv_cache, self._ready, self.block_size)
        if self._inner:
            self._inner.write_loads(plan, kv_cache)

    def store_computed(self, plan: Any, kv_cache: Any, by_id: dict) -> None:
        if self._marked:
            bs = self.block_size
            for pw in plan.prefills:
                lease = self._marked.get(pw.request_id)
                if lease is None or not pw.num_samples:  # (not the prompt's last chunk yet)
                    continue
                del self._marked[pw.request_id]
                req = by_id.get(pw.request_id)
                n = (len(req.prompt_token_ids) - 1) // bs if req is not None else 0
                if n <= 0:
                    self._held[pw.request_id] = None
                    continue
                h = self._bm.hold(pw.seq_id, lease)
                wire = None
                if self.windows is not None:  # every group's blocks a load of n blocks needs, in wire order
                    tables = [self._bm.block_table(pw.seq_id, g) for g in range(len(self.windows))]
                    wire = group_hold_block_ids(tables, n, bs, self.windows)
                    if wire is None:  # (a sliding window released a needed block: nothing to hand over)
                        self._bm.release_hold(h.hold_id)
                        self._held[pw.request_id] = None
                        self.stats["held_incomplete"] += 1
                        continue
                    wire = tuple(wire)
                self._held[pw.request_id] = _Held(h.hold_id, tuple(h.block_ids[:n]), n * bs, h.expires_at, wire)
                self.stats["held"] += 1
        if self._inner:
            self._inner.store_computed(plan, kv_cache, by_id)

    def take_events(self) -> list:
        return self._inner.take_events() if self._inner else []

    def snapshot(self) -> Any:
        return self._inner.snapshot() if self._inner else None

    def close(self, timeout: float = 30.0) -> None:
        if self._inner:
            self._inner.close(timeout)

    # ------------------------------------------------------------------------------ through the shared store
    # (docs/pd-split.md#through-the-shared-store: a prefill replica answers through the shared tier once its
    # prompt's held blocks are there; a decode replica with the same tier loads them through its own tiers)

    def block_checks(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list[int]:
        """The check digests (:func:`pagedkv.tiers.check_digests`) of the values a transfer of the prompt's first
        ``num_blocks`` blocks carries, in wire order (as :meth:`block_names`: with KV cache groups one per
        :func:`.kv_io.group_transfer_order` pair ``(g, j)``, group ``g``'s digest of block ``j``).
        O(num_blocks x block_size x groups)."""
        from ..tiers import check_digests

        bs = self.block_size
        toks = list(token_ids[: num_blocks * bs])
        if self.windows is None:
            return check_digests(toks, bs, namespace)
        order = group_transfer_order(num_blocks, bs, self.windows)
        per = {g: check_digests(toks, bs, namespace, g) for g in sorted({g for g, _ in order})}
        return [per[g][j] for g, j in order]

    def _shared_tier(self) -> Any:
        """The engine's shared tier (a :class:`pagedkv.tiers.BlockStore`) when the store path can use it, else
        None: no storage tiers, none shared, or KV cache groups (their values are per group: the HTTP path)."""
        conn = getattr(self._inner, "connector", None)
        if self.windows is not None or conn is None:
            return None
        from ..tiers.connector import MEDIUM_SHARED

        for medium, store in zip(conn.media, conn.stores()):
            if medium == MEDIUM_SHARED:
                return store
        return None

    def _watch_shared(self) -> None:
        if self._shared_tier() is not None:
            from ..tiers.connector import MEDIUM_SHARED

            self._inner.connector.watch_held(MEDIUM_SHARED, self._mark_shared)

    def _mark_shared(self, keys: list) -> None:
        """(the connector's I/O threads) the shared tier holds these chain keys. O(len(keys))."""
        with self._shared_lock:
            d = self._in_shared
            for k in keys:
                d.pop(k, None)  # (refreshed: the oldest known are dropped first)
                d[k] = None
            while len(d) > _MAX_SHARED_KEYS:
                del d[next(iter(d))]

    @property
    def shared_store(self) -> str | None:
        """The name of the shared tier this engine reads and writes through (``kvs-`` and 16 hex digits of the
        store's location without credentials: a directory's real path, a Redis server, db and key prefix), or
        None when a handover cannot go through it (no shared tier, or KV cache groups). Two replicas with the
        same name share the store."""
        store = self._shared_tier()
        loc = getattr(getattr(store, "backend", None), "location", None)
        if loc is None:
            return None
        import xxhash

        return "kvs-" + xxhash.xxh3_64_hexdigest(loc.encode())

    @property
    def stores_through(self) -> bool:
        """Whether every computed block is written to the tiers (the store policy ``write_through``): the prefill
        side of the store path waits for its prompt's blocks only then."""
        return self._shared_tier() is not None and getattr(self._inner, "store_policy", None) == "write_through"

    def store_keys(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list[int]:
        """The chain keys (the tiers' block keys) of the prompt's first ``num_blocks`` blocks. O(num_blocks x
        block_size)."""
        from ..blocks.prefix_cache import block_hashes

        bs = self.block_size
        return list(block_hashes(list(token_ids[: num_blocks * bs]), bs, namespace))

    def in_shared_store(self, keys: Sequence[int]) -> bool:
        """Whether the shared tier is known to hold every one of these chain keys (a store of them finished, or a
        read of them came back checked, since this engine started; at most the last 2**18 keys are remembered).
        Thread-safe, never blocks on I/O. O(len(keys))."""
        with self._shared_lock:
            d = self._in_shared
            return all(k in d for k in keys)

    def stores_pending(self) -> bool:
        """Whether the engine's tiers have stores in flight (a write-through that may still put blocks in the
        shared tier). Thread-safe, O(1)."""
        conn = getattr(self._inner, "connector", None)
        return conn is not None and conn.num_stores_in_flight > 0

    def probe_shared(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` the shared tier holds now (one existence query; 0 without a shared
        tier or when it cannot answer). Blocking: call it in a worker thread. O(len(keys)) plus the I/O."""
        store = self._shared_tier()
        return store.prefix_length(list(keys), None) if store is not None else 0
