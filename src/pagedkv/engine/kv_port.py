"""The engine's side of a prefill/decode split: :class:`EngineKVPort`, the ``KVPort`` of
:mod:`pagedkv.server.kv_handoff` over an :class:`~pagedkv.engine.LLM` (docs/pd-split.md).

Built on the block manager's external KV (docs/external-kv.md: ``hold``, ``release_hold``, ``expire_holds``;
``allocate(num_external_tokens=)`` through the scheduler's waiting-for-KV state) and the engine's block payloads
(:mod:`.kv_io`: ``read_blocks`` / ``write_blocks``, ``model_fingerprint``). It is a
:class:`~pagedkv.engine.connector.KVConnector`: it plugs itself into the engine's step loop
(``EngineCore.add_kv_connector``, asked before the storage tiers) once it is given its first request (a hold to
take, a transfer to expect or payloads to stage), so an engine that never hands KV over runs none of it:

- **prefill side**: a request marked by :meth:`EngineKVPort.hold_on_finish` is held in the step whose forward
  computes its prompt's last chunk (after the forward, before the step's update frees the finished request):
  ``block_manager.external.hold(seq, lease)``; :meth:`take_hold` hands the hold over, cut to the prompt's whole blocks
  before its last token. Blocks are read (:meth:`read_blocks`) and holds released or expired under the engine's
  step lock, so a hold can never be released (and its blocks reused) while its blocks are being copied out.
- **decode side, into reserved blocks** (what ``pagedkv serve`` uses): :meth:`expect_external` marks the request
  and returns the :class:`ExternalFetch` the server's read drives. Added, the request waits for KV; at the next
  step the scheduler is told its first ``n`` blocks are coming (``kv_ready(0, n * bs, reserve=True)``; with KV
  cache groups ``window_only``); the step that admits it allocates them as external tokens (reserved, counted by
  the manager, the sequence LOADING, the request FETCHING and out of every batch: the others keep stepping) and,
  after its copy plan, lets the read start (:meth:`start_loads`). Every later step's :meth:`poll` writes the
  payloads that arrived into the reserved blocks (a prefix already cached here is skipped) and, once the read
  ended, reports what arrived good (``kv_loaded``: all, or the good leading blocks; the rest computed). A request
  aborted meanwhile is never written again: its read is cancelled, its blocks parked by the manager until the read
  ends. A request admitted without a load (its whole prefix cached here) cancels its read.
- **decode side, staged** (:meth:`attach_external`, kept for callers that read first): the payloads read from
  the prefill replica are staged; when the request is added it waits for KV (``wait_for_kv``) and is ready at
  the next step (``kv_ready`` of tokens ``[0, n * bs)``); the step that admits it writes the payloads into its
  external blocks before the forward, and computes the rest.

**KV cache groups** (Gemma 3 on a ``HybridBlockManager``): the hold covers every group, and what is handed over
is, per group, the blocks a load of the prompt's ``n`` whole blocks before its last token needs
(:func:`.kv_io.group_block_ranges`: every block of a full-attention group, only the blocks a sliding group's
window still sees at position ``n x block_size``), position by position (:func:`.kv_io.group_transfer_order`).
The hold's ``block_ids`` stay group 0's ``n`` blocks (``remote_block_ids``, vLLM's shape: ``remote_num_tokens``
is their tokens); ``wire_block_ids`` are the blocks served, in that order, each named by its group's chained key
and fingerprint (:meth:`block_names`). The decode side keeps the longest usable prefix of what arrived
(:func:`.kv_io.usable_blocks`), allocates it as external tokens with ``external_window_only`` (the scheduler:
a sliding group reserves only its window's blocks), and writes every group's blocks
(:func:`.kv_io.write_external_groups`; into reserved blocks, each value into its group's block as it arrives).
Reserved window-only blocks that the manager cut cannot be used in part: a read that ends short has the request
computed whole (the scheduler frees them); a load the windows see whole keeps its usable leading positions. A
prefill replica whose sliding window released a block the transfer needs (a chunk boundary on the prompt's last token) hands nothing over (the decode replica computes the prompt).
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Sequence

from ..errors import PagedKVError
from .connector import KVConnector
from .kv_fetch import ExternalFetch
from .kv_io import (group_hold_block_ids, group_transfer_order, model_fingerprint, payload_bytes, read_blocks,
                    usable_blocks, write_blocks, write_external, write_external_groups)

__all__ = ["EngineKVPort", "ExternalFetch"]

#: an idle engine woken by a read's value waits up to this long (seconds) for more before it steps
_LINGER_S = 0.002
#: ... or until this many values wait
_LINGER_VALUES = 8

#: the most chain keys remembered as held by the shared tier (the prefill side's store path; oldest dropped)
_MAX_SHARED_KEYS = 1 << 18


class _Held(NamedTuple):
    hold_id: int
    block_ids: tuple  # group 0's blocks of the prompt's n whole blocks before its last token
    num_tokens: int
    expires_at: float
    wire_block_ids: tuple | None = None  # KV cache groups: the blocks served, in group_transfer_order


class EngineKVPort(KVConnector):
    """See the module docstring. ``lock``: the engine's step lock (``AsyncEngine._lock``), held by whoever
    steps the engine; the port takes it to read held blocks and to release or expire holds."""

    def __init__(self, llm: Any, lock: Any = None) -> None:
        llm = getattr(llm, "core", llm)  # (an LLM: its engine core, whose step loop the port joins)
        bm = llm.block_manager
        if not hasattr(getattr(bm, "external", None), "hold"):
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
        # decode side, into reserved blocks (expect_external): request id -> ExternalFetch, by stage
        self._expect: dict = {}  # marked, not yet added
        self._asking: dict = {}  # added (waiting for KV), kv_ready(reserve=True) at the next poll
        self._queued: dict = {}  # in the waiting queue: its blocks not reserved yet
        # request id -> (ExternalFetch, ExternalLoad, wire order with KV cache groups): blocks reserved, KV arriving
        self._fetching: dict = {}
        self._wake = threading.Event()  # set when a read hands over a payload or ends (wait() returns)
        self._inner = llm.kv_tiers  # the engine's own storage tiers (None without): the shared-store path's
        self.stats = {"held": 0, "blocks_read": 0, "loaded": 0, "written_blocks": 0, "held_incomplete": 0,
                      "fetches_reserved": 0, "fetches_aborted": 0, "fetches_partial": 0}
        self._engaged = False  # plugged into the engine's step loop (on the first request given)
        self._in_shared: dict = {}  # chain keys the shared tier is known to hold (oldest first, bounded)
        self._shared_lock = threading.Lock()
        self._watch_shared()

    @property
    def inner(self) -> Any:
        """The engine's own storage tiers (:class:`pagedkv.engine.kv_tiers.EngineTiers`; the shared-store path
        reads and probes their shared tier), or None without tiers."""
        return self._inner

    def _engage(self) -> None:
        """Plug the port into the engine's step loop, before the tiers (once; the first request it is given)."""
        if not self._engaged:
            add = getattr(self._llm, "add_kv_connector", None)  # (a test's stand-in engine drives the port itself)
            if add is not None:
                add(self, first=True)
            self._engaged = True

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
        self._engage()
        self._marked[request.request_id] = float(lease_s)

    def take_hold(self, request_id: Any) -> _Held | None:
        self._marked.pop(request_id, None)
        return self._held.pop(request_id, None)

    def read_blocks(self, hold_id: Any, block_ids: Sequence[int]) -> list:
        with self._lock:
            if not any(h.hold_id == hold_id for h in self._bm.external.holds):
                raise LookupError(f"hold {hold_id} is gone")
            out = read_blocks(self._kv, list(block_ids))
        self.stats["blocks_read"] += len(out)
        return out

    def release_hold(self, hold_id: Any) -> None:
        with self._lock:
            self._bm.external.release_hold(hold_id)  # (UnknownHoldError is a LookupError)

    def expire_holds(self) -> list:
        with self._lock:
            return list(self._bm.external.expire_holds())

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
            self._engage()
            self._staged[request.request_id] = payloads

    def expect_external(self, request: Any, num_blocks: int) -> ExternalFetch:
        """Mark a prepared, not yet submitted request: its prompt's first ``num_blocks`` blocks arrive from a
        prefill replica into blocks reserved for them. When added it waits for KV; at the next step the scheduler
        is told they are coming (``kv_ready(0, num_blocks x block_size, reserve=True)``; with KV cache groups
        ``window_only``); the step that admits it (its blocks counted and reserved like any allocation: it waits
        in the queue when they do not fit) lets the read start (:meth:`ExternalFetch.reserved`), and every later
        step writes what arrived into the reserved blocks, under the engine's lock, after the copy plan of the
        step that reserved them; once the read ends the scheduler is told what arrived good (``kv_loaded``) and
        the rest of the prompt is computed. Returns the :class:`ExternalFetch` the server's read drives. Called on
        the event loop; O(1) (KV cache groups: O(transfer order))."""
        n = int(num_blocks)
        nv = n if self.windows is None else len(group_transfer_order(n, self.block_size, self.windows))
        t = ExternalFetch(request.request_id, n, nv, self._wake)
        self._engage()
        self._expect[request.request_id] = t
        return t

    def drop_staged(self, request_id: Any) -> None:
        self._staged.pop(request_id, None)
        t = self._expect.pop(request_id, None)
        if t is not None:
            t.cancel()

    # ------------------------------------------------------------------------------------ the step loop's calls
    def on_add(self, request_id: Any, token_ids: Any, namespace: Any, block_manager: Any) -> bool:
        t = self._expect.pop(request_id, None)
        if t is not None and not t.cancelled:
            self._asking[request_id] = t
            return True
        payloads = self._staged.pop(request_id, None)
        if payloads:
            self._adding[request_id] = payloads
            return True
        return False

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
        if self._asking:
            asking, self._asking = self._asking, {}
            for rid, t in asking.items():
                try:
                    ok = scheduler.kv_ready(rid, 0, t.num_blocks * self.block_size, reserve=True,
                                            window_only=self.windows is not None)
                except PagedKVError:  # (a range the server's checks exclude) the prompt is computed
                    ok = scheduler.kv_ready(rid, 0, 0)
                    t.cancel()
                    n += bool(ok)
                    continue
                if ok:
                    n += 1
                    self._queued[rid] = t
                else:
                    t.cancel()  # (aborted before)
        if self._queued:
            for rid in [rid for rid in self._queued if not scheduler.has_request(rid)]:
                self._queued.pop(rid).cancel()  # (aborted in the queue: nothing was reserved)
        if self._fetching:
            self._write_arrived(scheduler)
        return n

    def _write_arrived(self, scheduler: Any) -> None:
        """Between two steps (the lock held): the payloads that arrived written into their reserved blocks, and
        each read that ended reported (``kv_loaded``: all, or the good leading part; an aborted request's parked
        blocks freed). A request no longer FETCHING (aborted) has its read cancelled and nothing written: its
        blocks may be reused. O(arrived payloads x block bytes + reads in flight)."""
        bs = self.block_size
        for rid, entry in list(self._fetching.items()):
            t, load, order = entry
            live = scheduler.is_fetching(rid)
            if not live and not t.cancelled:
                t.cancel()
                self.stats["fetches_aborted"] += 1
            ended = t.ended  # (read first: every put came before the end)
            got = t.take()
            if got and live:
                i0 = t.taken
                sb = load.start_token // bs
                ids, pays = [], []
                if self.windows is None:
                    for i, p in enumerate(got, i0):
                        if sb <= i < sb + len(load.block_ids):
                            ids.append(load.block_ids[i - sb])
                            pays.append(p)
                else:
                    for (g, j), p in zip(order[i0: i0 + len(got)], got):
                        if j >= sb:
                            b = load.group_block_ids[g][j - sb]
                            if b >= 0:  # (a cut sliding group's position before its window: nothing to write)
                                ids.append(b)
                                pays.append(p)
                if ids:
                    write_blocks(self._kv, ids, pays)
                    self.stats["written_blocks"] += len(ids)
            t.taken += len(got)
            del got  # (their room in the staging budget comes back)
            if ended is None:
                continue
            del self._fetching[rid]
            if not live:
                scheduler.kv_loaded(rid)  # (aborted: its parked blocks are freed)
                continue
            good = min(ended[0], t.taken)
            sb = load.start_token // bs
            if good >= t.num_values:
                scheduler.kv_loaded(rid)
                self.stats["loaded"] += 1
                continue
            m = good if self.windows is None else usable_blocks(t.num_blocks, bs, self.windows, good)
            k = max(0, min(m, t.num_blocks) - sb)
            self.stats["fetches_partial"] += 1
            if k * bs >= load.num_tokens:
                scheduler.kv_loaded(rid)
            else:
                scheduler.kv_loaded(rid, k * bs)  # (the rest computed; a window-only load: computed whole)

    def start_loads(self, kv_loads: Any) -> list:
        """After the copy plan of the step that admitted them: the reads of the requests whose blocks this step
        reserved may start (their KV is written from the next step on); returns the other loads (the storage
        tiers'). O(loads)."""
        others = []
        for kl in kv_loads:
            t = self._queued.pop(kl.request_id, None)
            if t is None:
                others.append(kl)
                continue
            order = None if self.windows is None else \
                group_transfer_order(t.num_blocks, self.block_size, self.windows)  # (wire value -> group, block)
            self._fetching[kl.request_id] = (t, kl.load, order)
            self.stats["fetches_reserved"] += 1
            t.decide(t.num_values)
        return others

    def forget(self, request_id: Any) -> None:
        for d in (self._staged, self._adding, self._ready, self._marked, self._held):
            d.pop(request_id, None)
        for d in (self._expect, self._asking, self._queued):
            t = d.pop(request_id, None)
            if t is not None:
                t.cancel()

    def wait(self, timeout: float) -> bool:
        """Nothing else to run (the engine's loop): block until a read hands over a value or ends, or
        ``timeout``. A read hands its values over as its HTTP chunks complete them: once woken, it lingers up to
        ``_LINGER_S`` for more (until ``_LINGER_VALUES`` wait, or a read ended), so that one step writes a few
        values rather than one step each. True when it had reads in flight or staged payloads to hand over
        (the next step has work: no other connector need wait), False at once otherwise."""
        if self._fetching or self._asking:  # a read hands over a payload or ends: wake at once
            self._wake.wait(timeout)
            self._wake.clear()
            if self._fetching:
                end = time.monotonic() + _LINGER_S
                while True:
                    tickets = [e[0] for e in self._fetching.values()]
                    if any(t.ended is not None or t.cancelled for t in tickets) or \
                            sum(len(t._queue) for t in tickets) >= _LINGER_VALUES:
                        break
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                    self._wake.clear()
            return True
        return bool(self._adding)

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        if self._queued:  # admitted without a load (its prefix cached here whole): its read is not needed
            for pw in plan.prefills:
                t = self._queued.pop(pw.request_id, None)
                if t is not None:
                    t.cancel()
        if self._ready:
            if self.windows is not None:
                ready = {rid: e[1] for rid, e in self._ready.items()
                         if any(pw.request_id == rid for pw in plan.prefills)}
                for rid in ready:
                    del self._ready[rid]
                self.stats["written_blocks"] += write_external_groups(plan, kv_cache, ready, self.block_size)
            else:
                self.stats["written_blocks"] += write_external(plan, kv_cache, self._ready, self.block_size)

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
                h = self._bm.external.hold(pw.seq_id, lease)
                wire = None
                if self.windows is not None:  # every group's blocks a load of n blocks needs, in wire order
                    tables = [self._bm.block_table(pw.seq_id, g) for g in range(len(self.windows))]
                    wire = group_hold_block_ids(tables, n, bs, self.windows)
                    if wire is None:  # (a sliding window released a needed block: nothing to hand over)
                        self._bm.external.release_hold(h.hold_id)
                        self._held[pw.request_id] = None
                        self.stats["held_incomplete"] += 1
                        continue
                    wire = tuple(wire)
                self._held[pw.request_id] = _Held(h.hold_id, tuple(h.block_ids[:n]), n * bs, h.expires_at, wire)
                self.stats["held"] += 1

    # ------------------------------------------------------------------------------ through the shared store
    # (docs/pd-split.md#through-the-shared-store: a prefill replica answers through the shared tier once its
    # prompt's held blocks are there; a decode replica with the same tier loads them through its own tiers; with
    # KV cache groups every group's blocks a load needs, as (group, chain key) pairs, each in its group's store)

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
        """The engine's shared tier (a :class:`pagedkv.tiers.BlockStore`; with KV cache groups group 0's) when the
        store path can use it, else None: no storage tiers, or none shared."""
        stores = self._shared_stores()
        return stores[0] if stores else None

    def _shared_stores(self) -> tuple:
        """The shared tier's ``BlockStore`` of each KV cache group (one without groups; all on one backend), or
        () when there is no shared tier."""
        conn = getattr(self._inner, "connector", None)
        if conn is None:
            return ()
        from ..tiers.connector import MEDIUM_SHARED

        for medium, stores in zip(conn.media, conn.group_stores()):
            if medium == MEDIUM_SHARED:
                return tuple(stores)
        return ()

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
        None when a handover cannot go through it (no shared tier). Two replicas with the same name share the
        store (with KV cache groups each group's blocks are there under its group's fingerprint)."""
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

    def store_keys(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list:
        """The tiers' keys of the blocks a handover of the prompt's first ``num_blocks`` blocks through the shared
        store needs, in wire order: without KV cache groups their chain keys; with them one ``(group, chain
        key)`` pair per :func:`.kv_io.group_transfer_order` pair ``(g, j)`` (every block of a full-attention
        group, only the blocks a sliding group's window sees at position ``num_blocks x block_size``; group
        ``g``'s key of block ``j``, ``pagedkv.block_hashes(..., group=g)``). O(num_blocks x block_size x
        groups)."""
        from ..blocks.prefix_cache import block_hashes

        bs = self.block_size
        toks = list(token_ids[: num_blocks * bs])
        if self.windows is None:
            return list(block_hashes(toks, bs, namespace))
        order = group_transfer_order(num_blocks, bs, self.windows)
        per = {g: block_hashes(toks, bs, namespace, g) for g in sorted({g for g, _ in order})}
        return [(g, int(per[g][j])) for g, j in order]

    def in_shared_store(self, keys: Sequence) -> bool:
        """Whether the shared tier is known to hold every one of these keys (:meth:`store_keys`' chain keys, or
        ``(group, chain key)`` pairs with KV cache groups: a group's chain starts from a root of its own, so its
        keys are its own) (a store of them finished, or a read of them came back checked, since this engine
        started; at most the last 2**18 keys are remembered). Thread-safe, never blocks on I/O. O(len(keys))."""
        with self._shared_lock:
            d = self._in_shared
            if self.windows is None:
                return all(k in d for k in keys)
            return all(k in d for _, k in keys)

    def stores_pending(self) -> bool:
        """Whether the engine's tiers have stores in flight (a write-through that may still put blocks in the
        shared tier). Thread-safe, O(1)."""
        conn = getattr(self._inner, "connector", None)
        return conn is not None and conn.num_stores_in_flight > 0

    def probe_shared(self, keys: Sequence) -> int:
        """How many leading entries of ``keys`` (:meth:`store_keys`) the shared tier holds now (one existence
        query; with KV cache groups one per group, each ``(group, chain key)`` asked of its group's store); 0
        without a shared tier or when it cannot answer. Blocking: call it in a worker thread. O(len(keys)) plus
        the I/O."""
        stores = self._shared_stores()
        if not stores:
            return 0
        if self.windows is None:
            return stores[0].prefix_length(list(keys), None)
        by_group: dict = {}  # group -> indices of its keys
        for i, (g, _) in enumerate(keys):
            by_group.setdefault(g, []).append(i)
        held = [False] * len(keys)
        for g, idx in by_group.items():
            for i, h in zip(idx, stores[g].contains_many([keys[i][1] for i in idx], None)):
                held[i] = h
        n = 0
        while n < len(held) and held[n]:
            n += 1
        return n
