"""The engine's storage tiers: a disk directory and a shared store (Redis or a shared directory) under the prefix
cache, wired into :class:`pagedkv.engine.LLM` (issue 24 items 2-3; docs/tiers.md#the-engine).

One object per engine, used by the step loop only::

    add a request    on_add: the GPU/CPU hit (lookup_prefix) -> TierConnector.request_load of the blocks past it;
                     the request is added with wait_for_kv=True (the scheduler's loading set)
    every step       poll: finished loads -> Scheduler.kv_ready(rid, start, tokens); payloads kept until admission
    the step's plan  write_loads (after the plan's copies, before the forward): a prefill with
                     num_external_tokens gets its loaded blocks written into its blocks
                     store_computed (after the forward): the full prompt blocks the step computed are copied out
                     (the snapshot) and handed to the connector, which writes them to every tier (write-through)

Nothing here waits on I/O: the connector's threads do the lookups, reads and writes; the step loop copies bytes
between host buffers and the KV cache only. A load that fails (a tier down, a value corrupted) hands over its
good leading blocks and the request computes the rest; one that never answers in ``load_timeout_s`` is given up
(the request computes everything; the load's result is dropped when it comes).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlparse

from ..blocks.prefix_cache import block_hashes
from ..errors import InvalidArgumentError
from ..tiers import BlockStore, DiskBackend, RedisBackend, SharedDirBackend, check_digests
from ..tiers.connector import MEDIUM_DISK, MEDIUM_SHARED, TierConnector
from .kv_io import model_fingerprint, payload_bytes, read_blocks, write_external

__all__ = ["EngineTiers", "open_shared_backend"]

log = logging.getLogger("pagedkv.tiers")


def open_shared_backend(url: str) -> Any:
    """The shared tier's backend for ``url``: ``redis://host:port[/db]`` (or ``rediss://``, ``unix://``) ->
    :class:`~pagedkv.tiers.RedisBackend`; ``file:///dir`` -> :class:`~pagedkv.tiers.SharedDirBackend`.
    Anything else: :class:`pagedkv.InvalidArgumentError`."""
    if not isinstance(url, str) or not url:
        raise InvalidArgumentError(f"kv_shared must be a redis:// or file:// URL, got {url!r}")
    u = urlparse(url)
    if u.scheme in ("redis", "rediss", "unix"):
        return RedisBackend(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path:
            raise InvalidArgumentError(f"kv_shared: a file URL is file:///absolute/dir, got {url!r}")
        return SharedDirBackend(u.path)
    raise InvalidArgumentError(f"kv_shared must be a redis://, rediss://, unix:// or file:/// URL, got {url!r}")


class EngineTiers:
    """The storage tiers of one engine (see the module docstring).

    Args:
        model: the engine's model (the fingerprint's weights digest comes from it).
        kv_cache: the engine's KV cache (the payload layout and dtype come from it).
        block_size: the block manager's.
        disk_dir: the disk tier's directory (this process alone uses it).
        disk_gib: the disk tier's bound in GiB.
        shared: the shared tier's URL (:func:`open_shared_backend`).
        max_load_ms_per_block: the crossover (:class:`~pagedkv.tiers.TierConnector`); None: always load.
        write_through: store every full prompt block the engine computes (False: load only).
        io_threads: the connector's I/O threads.
        load_timeout_s: a load not finished after this long is given up (the request computes its prompt).
        record_events: keep the tiers' KV events (medium DISK / SHARED) for :meth:`take_events`.
        fingerprint: the blocks' :class:`~pagedkv.tiers.ModelFingerprint` (None: from ``model`` and the cache).
    """

    def __init__(self, model: Any, kv_cache: Any, block_size: int, *, disk_dir: Any = None,
                 disk_gib: float | None = None, shared: str | None = None,
                 max_load_ms_per_block: float | None, write_through: bool = True, io_threads: int = 2,
                 load_timeout_s: float = 30.0, record_events: bool = True, fingerprint: Any = None) -> None:
        fp = fingerprint if fingerprint is not None else model_fingerprint(model, kv_cache)
        nbytes = payload_bytes(kv_cache)
        tiers = []
        try:
            if disk_dir is not None:
                if disk_gib is None or isinstance(disk_gib, bool) or not isinstance(disk_gib, (int, float)) \
                        or not 0 < disk_gib < float("inf"):
                    raise InvalidArgumentError(f"kv_disk_gib must be a number of GiB > 0 with kv_disk_dir, "
                                               f"got {disk_gib!r}")
                cap = int(disk_gib * 2**30)
                if cap < nbytes:
                    raise InvalidArgumentError(f"kv_disk_gib={disk_gib} holds no block of {nbytes} bytes")
                tiers.append((MEDIUM_DISK, BlockStore(DiskBackend(disk_dir, cap), fp, nbytes)))
            if shared is not None:
                tiers.append((MEDIUM_SHARED, BlockStore(open_shared_backend(shared), fp, nbytes)))
        except BaseException:
            for _, st in tiers:
                st.close()
            raise
        self.fingerprint = fp
        self.block_size = int(block_size)
        self.connector = TierConnector(tiers, block_size, io_threads=io_threads,
                                       max_load_ms_per_block=max_load_ms_per_block, write_through=write_through,
                                       record_events=record_events)
        self.load_timeout_s = float(load_timeout_s)
        # request id -> (start block, payloads) of its LoadDone, from kv_ready until its first prefill
        self._loaded: dict = {}
        self._started: dict = {}  # request id -> when its load was asked (the timeout)
        self.stats = {"loads": 0, "loads_failed": 0, "loads_timed_out": 0, "loaded_blocks": 0,
                      "written_blocks": 0, "stored_blocks": 0}

    # --------------------------------------------------------------------------------------- requests

    def on_add(self, request_id: Any, token_ids: Any, namespace: Any, block_manager: Any) -> bool:
        """Start the tier lookup of a new request; True when it must wait for it (``wait_for_kv``)."""
        kw = {} if namespace is None else {"namespace": namespace}
        hit = block_manager.lookup_prefix(token_ids, **kw).num_cached_blocks
        if not self.connector.request_load(request_id, token_ids, namespace, int(hit)):
            return False
        self._started[request_id] = time.monotonic()
        return True

    def poll(self, scheduler: Any) -> int:
        """Hand finished loads to the scheduler (``kv_ready``), give up loads past their timeout, and drop the
        payloads of requests that are gone. Returns how many requests became ready. O(finished + held)."""
        n = 0
        bs = self.block_size
        for r in self.connector.poll():
            self._started.pop(r.request_id, None)
            self.stats["loads"] += 1
            if not r.ok:
                self.stats["loads_failed"] += 1
            k = len(r.payloads)
            if scheduler.kv_ready(r.request_id, r.start_block * bs if k else 0, k * bs):
                n += 1
                if k:
                    self._loaded[r.request_id] = (r.start_block, r.payloads)
                    self.stats["loaded_blocks"] += k
        if self._started:
            now = time.monotonic()
            late = [rid for rid, t in self._started.items() if now - t > self.load_timeout_s]
            for rid in late:
                del self._started[rid]
                self.connector.cancel(rid)
                self.stats["loads_timed_out"] += 1
                log.warning("pagedkv tiers: the load of request %r took over %.1f s: computing its prompt",
                            rid, self.load_timeout_s)
                if scheduler.kv_ready(rid, 0, 0):
                    n += 1
        if self._loaded:
            for rid in [rid for rid in self._loaded if not scheduler.has_request(rid)]:
                del self._loaded[rid]  # (aborted before its admission)
        return n

    def forget(self, request_id: Any) -> None:
        """A request was aborted: drop its load (in flight or held). O(1)."""
        self.connector.cancel(request_id)
        self._started.pop(request_id, None)
        self._loaded.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        """Nothing else to run: block until a load finishes or ``timeout`` (never past the next load timeout)."""
        if self._started:
            left = min(self._started.values()) + self.load_timeout_s - time.monotonic()
            timeout = max(0.0, min(timeout, left))
        self.connector.wait(timeout)

    # ----------------------------------------------------------------------------------------- a step

    def write_loads(self, plan: Any, kv_cache: Any) -> None:
        """Write the loaded blocks of the plan's prefills that use external KV into their blocks (before the
        forward). A request's held payloads are dropped at its first prefill, used or not."""
        if self._loaded:
            self.stats["written_blocks"] += write_external(plan, kv_cache, self._loaded, self.block_size)

    def store_computed(self, plan: Any, kv_cache: Any, by_id: dict) -> None:
        """After the forward: copy out the full prompt blocks each prefill of the plan computed and hand them to
        the connector (written to every tier off the step loop). O(computed blocks x block bytes)."""
        c = self.connector
        if not c.write_through:
            return
        bs = self.block_size
        for pw in plan.prefills:
            req = by_id.get(pw.request_id)
            if req is None or pw.positions.size == 0:
                continue
            prompt = req.prompt_token_ids
            start = int(pw.positions[0])
            j0 = start // bs
            j1 = min(pw.seq_len, len(prompt)) // bs  # (a recomputed sample's generated tokens are not stored)
            if j1 <= j0:
                continue
            table = pw.block_table
            ids = table[j0:j1].tolist()
            keys = block_hashes(prompt[: j1 * bs], bs, req.namespace)
            checks = check_digests(prompt[: j1 * bs], bs, req.namespace)  # (the loads compare them)
            payloads = read_blocks(kv_cache, ids)
            c.store(keys[j0:j1], payloads, req.namespace, prompt[j0 * bs: j1 * bs],
                    keys[j0 - 1] if j0 > 0 else None, checks[j0:j1])
            self.stats["stored_blocks"] += j1 - j0

    # ----------------------------------------------------------------------------------------- state

    def snapshot(self) -> dict:
        """Counters for metrics: per tier (``TierCounters`` plus its ``BlockStore.stats``), the load-latency
        histogram, and the engine's own counts."""
        c = self.connector
        return {"tiers": c.counters(), "store_stats": tuple(s.stats for s in c.stores()),
                "latency": (c.latency.buckets,) + c.latency.snapshot(), "engine": dict(self.stats)}

    def take_events(self) -> list:
        return self.connector.take_events()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the stores in flight (at most ``timeout`` s) and close the tiers (the disk directory's lock is
        released: another engine may open it)."""
        self.connector.close(timeout)
