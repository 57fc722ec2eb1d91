"""The decode side of :class:`~pagedkv.server.kv_handoff.KVHandoff` (a mixin it inherits): reading a prefill
replica's hold over HTTP (staged, or into the blocks the engine reserved), the shared-store shortcut and the hold's
release; see :mod:`pagedkv.server.kv_handoff` for the whole picture."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .kv_staging import StagedPayload
from .kv_transfer import KVTransferParams

__all__ = ["KVReader", "FetchResult"]

log = logging.getLogger("pagedkv.server")


@dataclass(frozen=True)
class FetchResult:
    """What a decode replica read: the good leading blocks' ``payloads`` and, when fewer than asked, why (its
    repr counts the payloads: asyncio's debug mode formats a finished task's result)."""

    payloads: list = field(repr=False)
    asked: int
    error: str | None = None
    received: int | None = None  #: a fetch into reserved blocks (a sink): the good leading values handed over

    @property
    def num_received(self) -> int:
        """The good leading values: ``len(payloads)``, or those handed to the sink."""
        return len(self.payloads) if self.received is None else self.received

    @property
    def complete(self) -> bool:
        return self.error is None and self.num_received == self.asked

    def __repr__(self) -> str:
        return f"FetchResult({self.num_received} of {self.asked} blocks, error={self.error!r})"


class KVReader:
    """Decode-side reads of :class:`~pagedkv.server.kv_handoff.KVHandoff` (its fields: ``port``, ``stats``,
    ``staging``, ``fetch_seconds``, ``fetch_timeout``, ``allow_hosts``, ``peer_api_key``)."""

    def check_peer(self, kvt: KVTransferParams) -> None:
        from .validation import APIError

        if kvt.remote_host not in self.allow_hosts:
            raise APIError(400, f"this replica does not read KV from {kvt.remote_host!r} (allowed: "
                           f"{', '.join(sorted(self.allow_hosts))}; --kv-peer adds hosts)", "invalid_request_error",
                           "kv_peer_not_allowed", "kv_transfer_params.remote_host")

    def _http(self):
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.fetch_timeout, connect=min(
                5.0, self.fetch_timeout)))
        return self._client

    def _headers(self) -> dict:
        return {"authorization": f"Bearer {self.peer_api_key}"} if self.peer_api_key else {}

    async def fetch(self, kvt: KVTransferParams, token_ids: Sequence[int], namespace: Any,
                    sink: Any = None, gone: Callable[[], bool] | None = None) -> FetchResult:
        """Read the blocks ``kvt`` names from the prefill replica (bounded by ``fetch_timeout`` as a whole, and by
        the staging budget: only the leading blocks that fit it are read); never raises for the peer's faults:
        the result says how many leading blocks are good and why not all. The payloads are
        :class:`StagedPayload`: their room in the budget comes back when the last reference to each goes.

        ``sink`` (the engine's :class:`pagedkv.engine.kv_port.ExternalFetch` of the request, queued already): the
        blocks go into the request's reserved cache blocks as they arrive instead (see :meth:`_fetch_into`);
        the result's ``payloads`` is then empty and ``received`` counts what the sink took. ``gone``: see
        :meth:`fetch_into`."""
        n = len(kvt.remote_block_ids)
        self.stats["fetches"] += 1
        if n == 0:
            if sink is not None:
                sink.end(0, None)
            return FetchResult([], 0)
        names = self.names(token_ids, namespace, n)  # (KV cache groups: several values per prompt block)
        checks = self.checks(token_ids, namespace, n)  # (the wire's check digests, from this replica's tokens)
        if sink is not None:
            return await self._fetch_into(kvt, names, checks, sink, gone)
        import httpx

        from ..tiers.codec import Decoded
        from .kv_wire import BundleReader

        nv = len(names)
        pb = self.port.payload_bytes
        k = self.staging.reserve(nv, pb)
        over = nv - k
        self.stats["blocks_over_budget"] += over
        budget = self.staging
        reader = BundleReader(self.port.fingerprint.digest, names[:k], pb,
                              keep=lambda mv: StagedPayload.staged(mv, budget), prefix_only=over > 0,
                              checks=checks[:k])
        url = f"{kvt.base_url}/v1/kv/holds/{kvt.remote_request_id}"
        error = None
        t0 = time.perf_counter()
        try:
            if k:
                async with asyncio.timeout(self.fetch_timeout):
                    # (only the blocks that fit are asked for: what is in flight is never more than reserved)
                    params = {"engine": kvt.remote_engine_id, **({"blocks": str(k)} if over else {})}
                    async with self._http().stream("GET", url, params=params, headers=self._headers()) as resp:
                        if resp.status_code != 200:
                            await resp.aread()
                            error = f"the prefill replica answered {resp.status_code}"
                        else:
                            async for chunk in resp.aiter_bytes():
                                if not reader.feed(chunk):
                                    break
                            reader.finish()
        except (httpx.HTTPError, TimeoutError, OSError) as e:
            error = f"reading the blocks failed: {type(e).__name__}"
        finally:
            budget.release((k - len(reader.payloads)) * pb)  # the room of the blocks that did not arrive
        if k:
            self.fetch_seconds.observe(time.perf_counter() - t0)
        if error is None:
            error = reader.error
        if reader.refused is Decoded.CHECK:
            self.stats["check_refused"] += 1
        if error is None and over:
            error = (f"the staging buffer (--kv-fetch-buffer-mib, {budget.limit} bytes, {budget.used} in use) took "
                     f"{k} of {nv} values")
        res = FetchResult(reader.payloads, nv, error)  # (KV cache groups: values, not prompt blocks)
        self.stats["blocks_fetched"] += len(res.payloads)
        self.stats["bytes_fetched"] += reader.bytes_read
        if not res.complete:
            self.stats["fetches_failed" if not res.payloads else "fetches_partial"] += 1
            log.warning("KV from %s (hold %s): %d of %d blocks (%s); the engine computes the rest of the prompt",
                        kvt.base_url, kvt.remote_request_id, len(res.payloads), n, error)
        return res

    async def through_store(self, kvt: KVTransferParams, token_ids: Sequence[int], namespace: Any) -> bool:
        """The decode side's routing decision: True when the blocks ``kvt`` announces are all in the shared store
        this replica's engine reads (``kvt.remote_kv_store`` names it, and one existence query, in a worker thread
        bounded by ``fetch_timeout``, finds every block): the request is then queued plain and its engine loads
        them through its own tiers (the tier lookup: reserved blocks, no HTTP read, no staging). False (the caller
        reads the hold over HTTP as before): no store named, another store, or fewer blocks there than announced
        (``store_misses``). A block lost between this query and the engine's read is computed. O(blocks)."""
        store = kvt.remote_kv_store
        if store is None or store != self.shared_store or not kvt.remote_block_ids:
            return False
        keys = self.port.store_keys(token_ids, namespace, len(kvt.remote_block_ids))
        n = len(keys)  # (KV cache groups: every group's blocks the load needs, a sliding group's window only)
        try:
            async with asyncio.timeout(self.fetch_timeout):
                have = await asyncio.to_thread(self.port.probe_shared, keys)
        except (TimeoutError, OSError) as e:
            have, why = 0, type(e).__name__
        else:
            why = f"{have} of {n} blocks there"
        if have >= n:
            self.stats["store_loads"] += 1
            return True
        self.stats["store_misses"] += 1
        log.warning("the shared store %s (hold %s): %s; reading the hold from %s", store, kvt.remote_request_id,
                    why, kvt.base_url)
        return False

    async def _fetch_into(self, kvt: KVTransferParams, names: list, checks: list, sink: Any,
                          gone: Any = None) -> FetchResult:
        """The decode side's read into reserved blocks (docs/pd-split.md#the-decode-side-kv-written-into-reserved-blocks). First waits until the
        engine reserved the request's blocks (``sink.reserved()``: the number of leading values it takes; 0 when
        it needs none: the request ended, or its prefix is cached whole): the read never starts for a request
        still queued, so a request whose blocks do not fit waits like any other and nothing is read ahead of it.
        Then streams the body through a :class:`~.kv_wire.BundleReader`, handing each checked value to the
        engine (``sink.put``: the step loop writes it into its reserved block and drops it) and waiting, before
        each HTTP chunk, until the staging budget has room for one more value: the bytes read and not yet written
        stay under ``--kv-fetch-buffer-mib`` plus what one chunk completes. Stops early when the sink is
        cancelled (the request aborted: the engine writes nothing more). Always ends with ``sink.end(good,
        error)`` (the engine computes the rest); never raises for the peer's faults. The read is bounded by
        ``fetch_timeout`` from the reservation on."""
        import httpx

        from ..tiers.codec import Decoded
        from .kv_wire import BundleReader

        nv = len(names)
        pb = self.port.payload_bytes
        budget = self.staging
        error = None
        reader = None
        t0 = None
        try:
            want = min(nv, int(await sink.reserved(gone)))
            if want <= 0:  # (the request ended before its blocks were reserved, or needs none)
                return FetchResult([], 0, None, 0)
            if budget.limit < pb:  # not one value fits: nothing is read, the prompt is computed
                self.stats["blocks_over_budget"] += want
                self.stats["fetches_failed"] += 1
                error = f"the staging buffer (--kv-fetch-buffer-mib, {budget.limit} bytes) holds no block"
                return FetchResult([], want, error, 0)

            def keep(mv: memoryview) -> None:
                budget.add(pb)
                sink.put(StagedPayload.staged(mv, budget))

            reader = BundleReader(self.port.fingerprint.digest, names[:want], pb, keep=keep,
                                  prefix_only=want < nv, checks=checks[:want])
            url = f"{kvt.base_url}/v1/kv/holds/{kvt.remote_request_id}"
            params = {"engine": kvt.remote_engine_id, **({"blocks": str(want)} if want < nv else {})}
            t0 = time.perf_counter()
            async with asyncio.timeout(self.fetch_timeout):
                async with self._http().stream("GET", url, params=params, headers=self._headers()) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        error = f"the prefill replica answered {resp.status_code}"
                    else:
                        async for chunk in resp.aiter_bytes():
                            if sink.cancelled:
                                error = "the request ended during the read"
                                break
                            await budget.room(pb)
                            if not reader.feed(chunk):
                                break
                        else:
                            reader.finish()
        except (httpx.HTTPError, TimeoutError, OSError) as e:
            error = f"reading the blocks failed: {type(e).__name__}"
        finally:
            good = len(reader.payloads) if reader is not None else 0
            if error is None and reader is not None:
                error = reader.error
            if reader is not None and reader.refused is Decoded.CHECK:
                self.stats["check_refused"] += 1
            sink.end(good, error)
        if t0 is not None:
            self.fetch_seconds.observe(time.perf_counter() - t0)
        res = FetchResult([], want, error, good)
        self.stats["blocks_fetched"] += good
        self.stats["bytes_fetched"] += reader.bytes_read if reader is not None else 0
        if not res.complete:
            self.stats["fetches_failed" if not good else "fetches_partial"] += 1
            log.warning("KV from %s (hold %s): %d of %d values (%s); the engine computes the rest of the prompt",
                        kvt.base_url, kvt.remote_request_id, good, want, error)
        return res

    async def fetch_into(self, kvt: KVTransferParams, token_ids: Sequence[int], namespace: Any,
                         sink: Any, gone: Callable[[], bool] | None = None) -> FetchResult:
        """:meth:`fetch` into the request's reserved blocks (``sink``), then the hold's release (``DELETE``);
        run it in the background once the request is queued. ``gone``: checked while the request waits for its
        blocks (twice a second); True once its stream ended (the engine failed or dropped it): the read is not
        made. Never raises but for cancellation."""
        try:
            return await self.fetch(kvt, token_ids, namespace, sink, gone)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the request waiting forever
            log.exception("reading KV from %s failed", kvt.base_url)
            sink.end(0, f"{type(e).__name__}: {e}")
            return FetchResult([], 0, repr(e), 0)
        finally:
            await self.release_remote(kvt)

    async def release_remote(self, kvt: KVTransferParams) -> bool:
        """Tell the prefill replica that its hold is no longer needed (bounded; a failure is counted and logged:
        the hold's lease ends it)."""
        import httpx

        url = f"{kvt.base_url}/v1/kv/holds/{kvt.remote_request_id}"
        try:
            async with asyncio.timeout(self.fetch_timeout):
                r = await self._http().delete(url, headers=self._headers())
            if r.status_code in (204, 404):
                return r.status_code == 204
            why = f"answered {r.status_code}"
        except (httpx.HTTPError, TimeoutError, OSError) as e:
            why = type(e).__name__
        self.stats["releases_failed"] += 1
        log.warning("releasing hold %s on %s failed (%s): its lease will end it", kvt.remote_request_id,
                    kvt.base_url, why)
        return False
