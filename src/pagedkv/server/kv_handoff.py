"""The server side of a prefill/decode split: holds served to decode replicas, and KV fetched from prefill ones.

One :class:`KVHandoff` per replica (``pagedkv serve --kv-role``), over a :class:`KVPort`: what the replica's
engine offers (the block manager's holds with a lease on the prefill side, KV arriving from outside on the decode
side: docs/external-kv.md; the bytes of a block: the engine's extract/insert functions). The server never touches
the block manager or the KV tensors itself; everything engine-side goes through the port.

**Prefill side.** A request with ``do_remote_decode`` is marked (:meth:`KVPort.hold_on_finish`) before it is
queued; when it finishes, the engine keeps its prompt's whole blocks before the last prompt token held with a
lease (``--kv-lease``, default 480 s, vLLM's) and :meth:`KVHandoff.answer` registers the hold under a fresh
unguessable id (128 random bits: the id is the capability to read a tenant's KV) and returns the
``kv_transfer_params`` naming it. Routes (:func:`.routes.kv.add_kv_routes`; behind the API key like ``/v1``):

- ``GET /v1/kv/holds/{id}?engine=ENGINE_ID[&blocks=K]``: the hold's blocks (its first K) as one body of checked values
  (:mod:`.kv_wire`), streamed a few blocks at a time; 404 ``unknown_hold`` when the id is unknown, released or
  past its lease, or the engine id is another (a replica restarted since);
- ``DELETE /v1/kv/holds/{id}``: release the hold (the decode replica has read it, or refused the request): 204;
  404 ``unknown_hold`` when unknown.

Leases are swept every ``sweep_s`` seconds (:meth:`KVHandoff.sweep`: the port's ``expire_holds`` and the
registry's own deadlines), from the first request that takes a hold on. A request whose client left before its answer releases its hold at once.

**Decode side.** A request with ``do_remote_prefill`` is checked (:func:`.kv_transfer.check_request`; the
prefill replica must be a host of ``allow_hosts``: loopback by default, ``--kv-peer`` adds others; 400
``kv_peer_not_allowed`` otherwise). With an engine port that offers reserved blocks (``expect_external``: the
real engine's, :class:`pagedkv.engine.kv_port.EngineKVPort`) the request is **queued at once**, waiting for its
KV: the scheduler reserves blocks for the ``remote_num_tokens`` at admission (``kv_ready(..., reserve=True)``, the
storage tiers' path; a request whose blocks do not fit waits in the queue like any other), and only then does
:meth:`KVHandoff.fetch_into` read the body, handing each checked block to the engine, whose step loop writes it
into its reserved block (under the engine's lock, after the copy plan of the step that reserved them) and drops
it; when the read ends the engine is told what arrived good (``kv_loaded``) and computes the rest. A port without
it (the tests' fakes) gets the blocks read before the request is queued and staged with it
(``attach_external``). The names the decode replica expects are computed from its own tokens of the prompt
(:func:`pagedkv.tiers.store_names`), so only blocks of this model, tenant and prompt are accepted. A fetch that
fails (the prefill replica gone, the hold expired, a read timeout, a body cut short or refused) keeps the good
leading blocks and the engine computes the rest of the prompt: never a silent truncation, never an error for the
client. The hold is then released (``DELETE``; a failed release is logged, the lease ends it).

**Check digests on the wire.** Every value served carries its block's check digest
(:func:`pagedkv.tiers.check_digests`, computed when the request is marked); the decode side computes the ones it
expects from its own tokens and refuses a value with another one, or none (``check_refused``), keeping the good
leading blocks as for a bad checksum.

**Through the shared store** (docs/pd-split.md#through-the-shared-store). When the engine writes every computed
block through to a shared tier (its port's ``stores_through`` and ``shared_store``), :meth:`KVHandoff.answer_async`
waits, on the event loop and at most ``store_wait_s`` (``--kv-store-wait``), until the port knows the held
blocks are in that store, then names it in ``remote_kv_store`` (else answers without it: HTTP). The hold is kept
as the fallback. A decode replica whose own shared tier has that name asks it whether it holds every announced
block (:meth:`KVHandoff.through_store`, one existence query): if so the request is queued plain and the engine
loads the blocks through its tiers (reserved blocks, no HTTP read, no staging), and the hold is released; if not,
the hold is read over HTTP as below.

**Bounded memory on the decode side.** A :class:`StagingBudget` (``fetch_buffer_bytes``, ``--kv-fetch-buffer-mib``)
bounds the bytes of fetched payloads alive at once on the replica. Into reserved blocks, that is the blocks read
and not yet written: before each HTTP chunk the read waits until one more block fits (so it holds at most the
budget plus what one chunk completes; the step loop writes what arrived at every step, so in practice a few
blocks), and a budget smaller than one block reads nothing (the prompt is computed, counted in
``blocks_over_budget``). Staged (a port without reserved blocks), a fetch reserves room for its blocks before it
reads (what is left of the budget then: never waiting), reads only the leading blocks that fit (the rest of the
prompt is computed, counted in ``blocks_over_budget``). Either way each payload gives its room back when the
engine drops it (written into its block, or its request aborted): a :class:`StagedPayload` is a ``bytes`` whose
finalizer releases it, so no engine code is involved and no path can leak the count.

Counters: :attr:`KVHandoff.stats`; the fetch times in :attr:`KVHandoff.fetch_seconds`
(:class:`LatencyHistogram`); both exported at ``/metrics`` (:mod:`.metrics`, ``pagedkv:kv_handoff_*``).

Modules: this one holds the registry and the prefill side; the decode side's reads are :mod:`.kv_reader`
(:class:`~.kv_reader.KVReader`, which :class:`KVHandoff` inherits), the staging budget :mod:`.kv_staging`, the
wire format :mod:`.kv_wire`, the request's parameters :mod:`.kv_transfer`. A plain request (no
``kv_transfer_params``) calls none of them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from .kv_reader import FetchResult, KVReader
from .kv_staging import LatencyHistogram, StagedPayload, StagingBudget
from .kv_transfer import answer_params, max_prefill_tokens

__all__ = ["KVPort", "KVHandoff", "FetchResult", "LOOPBACK_HOSTS", "DEFAULT_LEASE_S", "DEFAULT_FETCH_BUFFER_BYTES",
           "StagingBudget", "StagedPayload", "LatencyHistogram"]

log = logging.getLogger("pagedkv.server")

DEFAULT_LEASE_S = 480.0  # vLLM's default (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
_READ_BATCH = 8  # blocks read from the engine per worker-thread hop while serving a hold
DEFAULT_FETCH_BUFFER_BYTES = 1 << 30  # --kv-fetch-buffer-mib 1024
DEFAULT_STORE_WAIT_S = 5.0  # --kv-store-wait: the most an answer waits for its blocks in the shared store


class KVPort(Protocol):
    """What an engine offers a :class:`KVHandoff` (implemented by the engine; tests use a fake).

    ``fingerprint``: the :class:`pagedkv.tiers.ModelFingerprint` of its KV (weights, dtype, block size, layout);
    ``block_size``; ``payload_bytes``: the bytes of one block's KV (every layer, K and V).
    ``hold_on_finish``, ``take_hold`` and ``attach_external`` are called on the event loop and must not block
    (a dict lookup or an attribute set); ``read_blocks``, ``release_hold`` and ``expire_holds`` are called in
    worker threads and the port makes them safe against the engine's steps (held blocks are never written, so
    reading them while a step runs is safe).

    Optional, for a port whose blocks are several values each (KV cache groups): ``block_names(token_ids,
    namespace, num_blocks)``, the names of the values a transfer of that many prompt blocks carries, in order
    (used instead of :meth:`KVHandoff.names`), and a hold with ``wire_block_ids``, the blocks served in that
    order (``block_ids`` stay the prompt's blocks: ``remote_block_ids``)."""

    fingerprint: Any
    block_size: int
    payload_bytes: int

    def hold_on_finish(self, request: Any, lease_s: float) -> None:
        """Mark a prepared, not yet submitted request: when it finishes, hold its prompt's whole blocks before
        the last prompt token for ``lease_s`` seconds instead of freeing them."""

    def take_hold(self, request_id: Any) -> Any | None:
        """The hold taken when request ``request_id`` finished (``hold_id``, ``block_ids``, ``num_tokens``,
        ``expires_at``), once; None when there is none (nothing to hand over, or the request failed)."""

    def read_blocks(self, hold_id: Any, block_ids: Sequence[int]) -> Iterable:
        """The KV payload (bytes-like, ``payload_bytes`` each) of held blocks, in order. Raises LookupError when
        the hold is gone (released or expired)."""

    def release_hold(self, hold_id: Any) -> None:
        """Release a hold (its blocks return to the cache); LookupError when unknown."""

    def expire_holds(self) -> list:
        """Release every hold past its lease; their ids."""

    def attach_external(self, request: Any, payloads: Sequence, num_blocks: int | None = None) -> None:
        """Mark a prepared, not yet submitted request: its prompt's first ``len(payloads)`` blocks come with this
        KV (the engine allocates them as external tokens and writes these bytes before computing the rest).
        ``num_blocks``: the prompt blocks the transfer was for (``len(remote_block_ids)``); a port with KV cache
        groups, whose payloads are several per block (its ``block_names``), reads them by it."""

    def drop_staged(self, request_id: Any) -> None:
        """Drop what :meth:`attach_external` (or ``expect_external``) staged for a request that will not run (its
        submission was refused)."""

    # optional: def expect_external(self, request, num_blocks) -> sink. Mark a prepared, not yet submitted
    # request whose prompt's first num_blocks blocks arrive into blocks reserved for them at its admission; the
    # sink (pagedkv.engine.kv_port.ExternalFetch) is what KVHandoff.fetch_into drives: reserved(), put(), end().
    # A port with it gets the reserved-block path (the module docstring), one without the staged one.


@dataclass
class _Held:
    port_id: Any
    block_ids: tuple
    names: list
    num_tokens: int
    expires_at: float  # time.monotonic() deadline (the port's own lease ends it too)
    checks: list | None = None  # each served value's check digest (the wire carries it)
    keys: list | None = None  # the prompt blocks' chain keys (the store path waits for them in the shared tier)


@dataclass
class KVHandoff(KVReader):
    """See the module docstring. ``port`` None: this replica cannot hand KV over (requests with
    ``kv_transfer_params`` get 400 ``kv_transfer_unavailable``; ``--kv-role prefill|decode`` refuses to start).

    ``host`` / ``port_number``: where decode replicas reach this one (its HTTP address). ``clock``: seconds,
    monotonic (injectable: tests never sleep). ``fetch_buffer_bytes``: the decode side's staging budget (the
    module docstring)."""

    role: str = "both"
    port: Any = None
    engine_id: str = field(default_factory=lambda: secrets.token_hex(8))
    host: str = "127.0.0.1"
    port_number: int = 0
    lease_s: float = DEFAULT_LEASE_S
    allow_hosts: frozenset = LOOPBACK_HOSTS
    fetch_timeout: float = 30.0
    peer_api_key: str | None = None
    clock: Callable[[], float] = time.monotonic
    fetch_buffer_bytes: int = DEFAULT_FETCH_BUFFER_BYTES
    #: prefill side: the most seconds an answer waits for its prompt's held blocks to be in the shared store
    #: (``--kv-store-wait``; 0: never through the store)
    store_wait_s: float = DEFAULT_STORE_WAIT_S
    #: prefill side: holds (taken), holds_released (by a decode replica, before the lease ended), holds_expired
    #: (the lease ended), holds_dropped (the request ended unanswered), holds_served, blocks_served, bytes_served,
    #: store_answers (answered with the blocks in the shared store), store_waits_timed_out (answered without:
    #: the blocks were not all stored within ``store_wait_s``), store_wait_seconds (the answers' waits, summed: a
    #: float);
    #: decode side: fetches (started), fetches_partial, fetches_failed (no block), blocks_fetched, bytes_fetched
    #: (wire bytes), blocks_over_budget (not read: the staging budget was full, or holds no block), releases_failed,
    #: check_refused (a fetch stopped at a value whose check digest was not the prompt's), store_loads (requests
    #: sent to the engine to load through its shared tier), store_misses (the shared store held fewer blocks than
    #: announced: read from the hold instead)
    stats: dict = field(default_factory=lambda: dict.fromkeys((
        "holds", "holds_released", "holds_expired", "holds_dropped", "holds_served", "blocks_served",
        "bytes_served", "fetches", "fetches_partial", "fetches_failed", "blocks_fetched", "bytes_fetched",
        "blocks_over_budget", "releases_failed", "check_refused", "store_answers", "store_waits_timed_out",
        "store_loads", "store_misses", "store_wait_seconds"), 0))

    def __post_init__(self) -> None:
        from .kv_transfer import KV_ROLES

        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.role != "both" and self.port is None:
            raise ValueError(f"--kv-role {self.role} needs an engine that hands KV blocks over (held blocks with a "
                             "lease, external KV, block bytes); this engine has none")
        if not self.lease_s > 0:
            raise ValueError(f"--kv-lease must be > 0 seconds, got {self.lease_s}")
        if not 0 <= self.store_wait_s < float("inf"):
            raise ValueError(f"--kv-store-wait must be >= 0 seconds, got {self.store_wait_s}")
        self._holds: dict[str, _Held] = {}
        self._pending: dict[Any, list] = {}  # request id -> the names of its blocks, until answered
        self._client = None
        self._sweep_task = None
        self.staging = StagingBudget(self.fetch_buffer_bytes)
        self.fetch_seconds = LatencyHistogram()

    def ensure_sweeper(self, every_s: float = 5.0) -> None:
        """Start :meth:`sweeper` on the running event loop unless it runs (call it from the serving loop)."""
        if self.port is not None and (self._sweep_task is None or self._sweep_task.done()):
            self._sweep_task = asyncio.ensure_future(self.sweeper(every_s))

    @property
    def available(self) -> bool:
        return self.port is not None

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        """Blocks of the live holds (prefill side). O(holds)."""
        return sum(len(h.block_ids) for h in self._holds.values())

    # ------------------------------------------------------------------------------------------ names
    def names(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list[str]:
        """The store names of the prompt's first ``num_blocks`` blocks (model fingerprint, namespace, chained
        content keys). O(num_blocks * block_size)."""
        names = getattr(self.port, "block_names", None)
        if names is not None:  # (the port names its values: KV cache groups carry several per block)
            return names(token_ids, namespace, num_blocks)
        from ..blocks.prefix_cache import block_hashes
        from ..tiers import store_names

        bs = self.port.block_size
        keys = block_hashes(list(token_ids[: num_blocks * bs]), bs, namespace)
        return store_names(self.port.fingerprint, list(keys), namespace)

    def checks(self, token_ids: Sequence[int], namespace: Any, num_blocks: int) -> list[int]:
        """The check digests of the values :meth:`names` names, in the same order (the port's ``block_checks``
        when it has one: KV cache groups; else :func:`pagedkv.tiers.check_digests` of the prompt's first
        ``num_blocks`` blocks). O(num_blocks * block_size)."""
        checks = getattr(self.port, "block_checks", None)
        if checks is not None:
            return checks(token_ids, namespace, num_blocks)
        from ..tiers import check_digests

        bs = self.port.block_size
        return check_digests(list(token_ids[: num_blocks * bs]), bs, namespace)

    @property
    def shared_store(self) -> str | None:
        """The name of the shared store the engine reads and writes through (its port's ``shared_store``), or
        None: handovers go over HTTP only."""
        return getattr(self.port, "shared_store", None) if self.port is not None else None

    # ------------------------------------------------------------------------------------------ prefill side
    def expect_hold(self, request: Any, token_ids: Sequence[int], namespace: Any) -> None:
        """Before submitting a ``do_remote_decode`` request: mark it, and remember its blocks' names."""
        n = max_prefill_tokens(len(token_ids), self.port.block_size) // self.port.block_size
        self.port.hold_on_finish(request, self.lease_s)
        keys = None
        if self.store_wait_s > 0 and getattr(self.port, "stores_through", False):  # (the store path may answer)
            keys = self.port.store_keys(token_ids, namespace, n)
        self._pending[request.request_id] = (self.names(token_ids, namespace, n),
                                             self.checks(token_ids, namespace, n), keys)

    def answer(self, request_id: Any) -> dict | None:
        """After the request finished: its hold registered, and the ``kv_transfer_params`` of the answer (None
        when there is nothing to hand over). Call :meth:`forget` in any case afterwards."""
        names, checks, keys = self._pending.pop(request_id, None) or (None, None, None)
        hold = self.port.take_hold(request_id)
        if hold is None or not hold.block_ids:
            if hold is not None:
                self._release_port(hold.hold_id)
            return None
        served = getattr(hold, "wire_block_ids", None) or hold.block_ids  # (KV cache groups: every group's)
        if names is None or len(names) < len(served):
            self._release_port(hold.hold_id)
            raise RuntimeError(f"the engine held {len(served)} blocks for request {request_id!r}, more "
                               "than its prompt's whole blocks")
        wire = secrets.token_hex(16)
        self._holds[wire] = _Held(hold.hold_id, tuple(int(b) for b in served),
                                  names[: len(served)], int(hold.num_tokens), self.clock() + self.lease_s,
                                  checks[: len(served)], None if keys is None else keys[: len(served)])
        self.stats["holds"] += 1
        return answer_params(hold_id=wire, block_ids=hold.block_ids, num_tokens=hold.num_tokens,
                             engine_id=self.engine_id, host=self.host, port=self.port_number)

    async def answer_async(self, request_id: Any, poll_s: float = 0.005) -> dict | None:
        """:meth:`answer`, through the shared store where it can be: when the engine writes every computed block
        through to a shared tier (its port's ``stores_through``), the answer waits (on the event loop, never in a
        step) until the port knows the hold's blocks are in that store (``in_shared_store``: their write-through,
        or a checked read of them, finished), then names the store in ``remote_kv_store``. Blocks the port does
        not know of (written before it started, or not written by this engine: loaded from its disk tier) are
        asked of the store itself (``probe_shared``, in a worker thread) once no store of the engine is in flight
        (``stores_pending``) or every half second; when nothing is in flight and the store lacks them, or after
        ``store_wait_s`` seconds, it answers without the field (``store_waits_timed_out``): the decode replica
        reads the hold over HTTP. The hold is kept either way: it is the decode replica's fallback when the store
        no longer has every block (docs/pd-split.md). O(blocks) per poll, polls ``poll_s`` apart (growing to
        50 ms)."""
        params = self.answer(request_id)
        if params is None:
            return None
        h = self._holds.get(params["remote_request_id"])
        store = self.shared_store
        if h is None or not h.keys or store is None or not self.store_wait_s > 0:
            return params
        port = self.port
        now = t0 = time.monotonic()
        deadline, next_probe = now + self.store_wait_s, now + 0.5
        why = f"not within {self.store_wait_s:.1f} s (--kv-store-wait)"
        while not port.in_shared_store(h.keys):
            now = time.monotonic()
            idle = not port.stores_pending()  # (nothing in flight can still put them there)
            if idle or now >= next_probe:
                next_probe = now + 0.5
                try:
                    async with asyncio.timeout(max(0.1, deadline - now)):
                        have = await asyncio.to_thread(port.probe_shared, h.keys)
                except (TimeoutError, OSError):
                    have = 0
                if have >= len(h.keys):
                    break
                if idle:
                    why = f"{have} of {len(h.keys)} there, no store in flight"
                    now = deadline
            if now >= deadline:
                self.stats["store_wait_seconds"] += time.monotonic() - t0
                self.stats["store_waits_timed_out"] += 1
                log.warning("the shared store does not hold the %d blocks of hold %s (%s): the decode replica reads "
                            "them over HTTP", len(h.keys), params["remote_request_id"], why)
                return params
            await asyncio.sleep(poll_s)
            poll_s = min(2 * poll_s, 0.05)
        self.stats["store_wait_seconds"] += time.monotonic() - t0
        self.stats["store_answers"] += 1
        return {**params, "remote_kv_store": store}

    def forget(self, request_id: Any) -> None:
        """The request ended without :meth:`answer` (its client left, it failed): release any hold it took."""
        if self._pending.pop(request_id, None) is not None:
            hold = self.port.take_hold(request_id)
            if hold is not None:
                self._release_port(hold.hold_id)
                self.stats["holds_dropped"] += 1

    def _release_port(self, port_id: Any) -> bool:
        try:
            self.port.release_hold(port_id)
            return True
        except LookupError:
            return False

    def lookup(self, wire_id: str, engine_id: str | None) -> _Held | None:
        """The live hold of a wire id (None when unknown, past its lease, or asked of another engine id). A hold
        found past its lease leaves the registry (release it in the port with :meth:`release_port`)."""
        h = self._holds.get(wire_id)
        if h is None or (engine_id is not None and engine_id != self.engine_id):
            return None
        if self.clock() >= h.expires_at:
            return None
        return h

    def pop(self, wire_id: str) -> _Held | None:
        """Take a hold out of the registry (the caller releases it in the port); None when unknown."""
        return self._holds.pop(wire_id, None)

    def release_port(self, port_id: Any) -> bool:
        """Release a hold in the port (blocking: call it in a worker thread); False when the port no longer
        knows it."""
        return self._release_port(port_id)

    async def release(self, wire_id: str) -> bool:
        """Release a hold by its wire id (the registry on the event loop, the port in a worker thread); False
        when unknown."""
        h = self.pop(wire_id)
        if h is None:
            return False
        await asyncio.to_thread(self._release_port, h.port_id)
        self.stats["holds_released"] += 1
        return True

    async def sweep(self) -> list[str]:
        """Release the holds past their lease (the port's, and the registry's deadlines); their wire ids.
        O(holds); the port's calls in a worker thread, the registry on the event loop."""
        gone = set(await asyncio.to_thread(self.port.expire_holds)) if self.port is not None else set()
        now = self.clock()
        out, late = [], []
        for wire, h in list(self._holds.items()):
            if h.port_id in gone or now >= h.expires_at:
                del self._holds[wire]
                self.stats["holds_expired"] += 1
                out.append(wire)
                if h.port_id not in gone:
                    late.append(h.port_id)
        for port_id in late:
            await asyncio.to_thread(self._release_port, port_id)
        return out

    async def serve_blocks(self, h: _Held, count: int | None = None):
        """The body of a GET: the values of the hold's first ``count`` blocks (all by default), a few blocks per
        worker-thread hop. A hold released or expired mid-body ends the body early (the reader sees it cut
        short)."""
        from .kv_wire import encode_blocks

        fp = self.port.fingerprint.digest
        n = len(h.block_ids) if count is None else min(count, len(h.block_ids))
        for i in range(0, n, _READ_BATCH):
            ids = h.block_ids[i: min(i + _READ_BATCH, n)]
            try:
                payloads = await asyncio.to_thread(lambda ids=ids: list(self.port.read_blocks(h.port_id, ids)))
            except LookupError:
                return
            for value in encode_blocks(fp, h.names[i: i + _READ_BATCH], payloads,
                                       None if h.checks is None else h.checks[i: i + _READ_BATCH]):
                self.stats["blocks_served"] += 1
                self.stats["bytes_served"] += len(value)
                yield value

    async def sweeper(self, every_s: float = 5.0) -> None:
        """Run :meth:`sweep` every ``every_s`` seconds until cancelled (errors logged, never fatal)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - the sweeper goes on
                log.exception("sweeping KV holds failed")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
