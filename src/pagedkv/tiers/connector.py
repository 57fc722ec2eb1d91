"""TierConnector: loads and stores of KV blocks in the storage tiers, off the step loop (torch-free).

The engine's side of issue 24 items 2-3. The connector knows block keys and byte payloads, never block ids or
tensors: the engine extracts a block's KV into a payload and writes a payload back (:mod:`pagedkv.engine.kv_io`),
the scheduler keeps a request waiting while its load runs (``Scheduler.add_request(..., wait_for_kv=True)`` and
``Scheduler.kv_ready``). Every tier call runs on a small pool of I/O threads; the step loop only submits jobs and
collects what finished::

    engine thread                               I/O threads
    request_lookup(rid, tokens, ns, hit) -------> keys past the GPU/CPU hit; each tier in order (disk, then
                                                  shared): prefix_length (a tier slower than computing skipped)
    poll() <-- LookupDone(rid, start_block, num_blocks, runs)      (the engine reserves GPU blocks for them)
    request_read(rid, keys, runs, ns) ----------> get_many of each tier's run; payloads kept in memory
    poll() <-- LoadDone(rid, start_block, payloads, ok, failed, by_tier)   (the engine writes them into the
                                                  reserved blocks and reports the load done or failed)
    request_load(rid, tokens, ns, hit) ---------> both in one job (lookup, then read): one LoadDone
    store(keys, payloads, ns, store_id=) -------> put_many on every tier; KV events (medium)
    poll_stores() <-- (store_id, success) of the stores that finished (the engine completes the manager's plan)
    take_events() <-- BlockStored(medium="DISK" | "SHARED") of the blocks each tier newly stored (at start: of
                      the blocks the disk tier found, in batches), BlockRemoved (medium "DISK") of the blocks the
                      disk tier evicted or dropped

**KV cache groups** (a hybrid model: each tier holds one ``BlockStore`` per group on one backend, group ``g``'s
fingerprint; docs/tiers.md#kv-cache-groups)::

    request_lookup(rid, tokens, ns, hit, keys=, windows=) -> LookupDone(..., group_tiers): the longest run every
                                                  group can serve (a sliding group: its window's blocks only),
                                                  the tier of each block
    request_read_groups(rid, items, start) -----> each group's blocks read on its own
    poll() <-- LoadDone(..., group_payloads)      each group's good leading payloads
    store(keys, payloads, ns, groups=) ---------> each block to its group's store (one BlockStored per group)

A load is **done** when every block the tiers said they hold came back checked; **failed** when a block they
said they hold did not (corrupt, cut short, another fingerprint, the store down between the probe and the read):
``payloads`` then holds the good leading blocks only and the request computes the rest. A tier that is down
answers "holds nothing" (its probe fails soft), so requests go on computing.

**Crossover** (issue 24: load only what is faster to load than to compute): a tier's load time per block is
followed as an exponential moving average of its measured reads (seeded with ``initial_load_ms``); while it is
above ``max_load_ms_per_block`` the tier is not read (every ``probe_every``-th lookup still is, so the average
can come back down). The engine passes its prefill time per block as the bound (docs/tiers.md#crossover).

Thread-safety: the public methods are for one thread (the step loop); the I/O threads touch only the job they
run, the result queue and the counters (under a lock).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from ..blocks.prefix_cache import block_hashes
from ..errors import InvalidArgumentError
from ..events import BlockStored
from .key import check_digests
from .store import BlockStore
from .store_jobs import StoreJobs
from .transfer_types import (DEFAULT_MAX_LOAD_MS_PER_BLOCK, LATENCY_BUCKETS_S, MEDIUM_DISK, MEDIUM_SHARED,
                             RESTORED_BATCH, LoadDone, LoadLatencyHistogram, LookupDone, TierCounters, _Tier)

__all__ = ["TierConnector", "LoadDone", "LookupDone", "TierCounters", "LoadLatencyHistogram", "MEDIUM_DISK",
           "RESTORED_BATCH", "MEDIUM_SHARED",
           "group_block_ranges", "DEFAULT_MAX_LOAD_MS_PER_BLOCK", "LATENCY_BUCKETS_S"]

log = logging.getLogger("pagedkv.tiers")


class TierConnector(StoreJobs):
    """Asynchronous loads and stores of KV blocks in storage tiers (see the module docstring).

    Args:
        tiers: ``(medium, BlockStore)`` pairs in lookup order (``("DISK", disk_store), ("SHARED", shared)``).
            Every store must have ``payload_bytes`` set to one block's KV size.
        block_size: tokens per block (the stores' fingerprints' block size).
        io_threads: the I/O pool's threads (>= 1).
        max_load_ms_per_block: the crossover: a tier whose average load time per block is above it is skipped.
            None: never skip.
        initial_load_ms: the average a tier starts from (before its first read).
        probe_every: while a tier is skipped, every ``probe_every``-th lookup still reads it.
        write_through: store every block handed to :meth:`store` (False: stores are dropped, loads only).
        record_events: keep the KV events of the stores for :meth:`take_events` (False: none are kept, so an
            engine that never takes them does not accumulate them).
        chain_names: name blocks in the tiers by their chained key alone (``namespace=None`` in every
            ``BlockStore`` call): the chain key already commits to the namespace (its root's key), and a store
            plan of the block manager names its blocks by chain key without their namespace. False: the
            namespace given with each call goes into the names too.
        max_blocks_per_call: the most blocks one ``get_many`` / ``put_many`` carries (a long prompt's run is read
            and written in several calls, each within a store's socket timeout).
    """

    def __init__(self, tiers: Sequence[tuple[str, BlockStore]], block_size: int, *, io_threads: int = 2,
                 max_load_ms_per_block: float | None = DEFAULT_MAX_LOAD_MS_PER_BLOCK,
                 initial_load_ms: float = 10.0, probe_every: int = 16, write_through: bool = True,
                 record_events: bool = True, max_blocks_per_call: int = 8, chain_names: bool = False) -> None:
        if not tiers:
            raise InvalidArgumentError("a TierConnector needs at least one tier")
        seen = set()
        per_tier = []
        for medium, st in tiers:
            stores = tuple(st) if isinstance(st, (tuple, list)) else (st,)
            for gi, x in enumerate(stores):
                if not isinstance(x, BlockStore):
                    raise InvalidArgumentError(f"tier {medium!r}: a BlockStore is needed, got {type(x).__name__}")
                if x.fingerprint.block_size != block_size:
                    raise InvalidArgumentError(f"tier {medium!r}: its fingerprint's block size "
                                               f"{x.fingerprint.block_size} is not {block_size}")
                if x.fingerprint.kv_cache_group != gi or x.backend is not stores[0].backend:
                    raise InvalidArgumentError(f"tier {medium!r}: store {gi} must be group {gi}'s, on the same "
                                               "backend as group 0's")
            if not stores or (per_tier and len(stores) != len(per_tier[0][1])):
                raise InvalidArgumentError(f"tier {medium!r}: every tier needs one store per KV cache group")
            if medium in seen:
                raise InvalidArgumentError(f"two tiers named {medium!r}")
            seen.add(medium)
            per_tier.append((medium, stores))
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise InvalidArgumentError(f"io_threads must be an int >= 1, got {io_threads!r}")
        if max_load_ms_per_block is not None and not max_load_ms_per_block > 0:
            raise InvalidArgumentError(f"max_load_ms_per_block must be > 0 or None, got {max_load_ms_per_block!r}")
        self.block_size = int(block_size)
        self.max_load_ms_per_block = max_load_ms_per_block
        self.probe_every = max(1, int(probe_every))
        self.write_through = bool(write_through)
        self.record_events = bool(record_events)
        self.chain_names = bool(chain_names)
        if isinstance(max_blocks_per_call, bool) or not isinstance(max_blocks_per_call, int) \
                or max_blocks_per_call < 1:
            raise InvalidArgumentError(f"max_blocks_per_call must be an int >= 1, got {max_blocks_per_call!r}")
        self.max_blocks_per_call = max_blocks_per_call
        self._tiers = [_Tier(m, st, initial_load_ms) for m, st in per_tier]
        #: KV cache groups (each tier holds one BlockStore per group; 1 for a model without groups)
        self.num_groups = len(per_tier[0][1])
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="pagedkv-tier-io")
        self._done: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._events: list = []
        self._pending_loads: set = set()  # request ids whose load runs or waits to be polled
        self._cancelled: set = set()
        self._stores_in_flight = 0
        self._stores_done: list = []  # (store_id, success) of finished stores, for poll_stores
        self._idle = threading.Condition(self._lock)
        self.latency = LoadLatencyHistogram()
        self._closed = False
        self._warned_unchecked = False
        if self.record_events:
            self._publish_restored()

    def _publish_restored(self) -> None:
        """Once, at start: the blocks each tier found when it opened (the disk tier's rebuilt index:
        ``BlockStore.restored_keys``) as ``BlockStored`` of its medium, ``RESTORED_BATCH`` blocks per event
        (oldest first; no parent, no tokens: the tier keeps chain keys only), so that a router learns what a
        restarted replica holds. O(blocks found)."""
        for t in self._tiers:
            for g, st in enumerate(t.groups):  # (KV cache groups: each group's blocks, with its group_idx)
                keys = st.restored_keys()
                gi = None if len(t.groups) == 1 else g
                for a in range(0, len(keys), RESTORED_BATCH):
                    self._events.append(BlockStored(block_hashes=keys[a:a + RESTORED_BATCH], parent_block_hash=None,
                                                    token_ids=[], block_size=self.block_size, medium=t.medium,
                                                    group_idx=gi))

    # ------------------------------------------------------------------------------------------ state

    @property
    def media(self) -> tuple:
        return tuple(t.medium for t in self._tiers)

    @property
    def num_pending_loads(self) -> int:
        return len(self._pending_loads)

    def counters(self) -> tuple[TierCounters, ...]:
        """Each tier's counters (a snapshot)."""
        with self._lock:
            return tuple(TierCounters(t.medium, **t.c, load_ms_per_block=t.ema_ms) for t in self._tiers)

    def stores(self) -> tuple:
        """The ``BlockStore`` of each tier, in lookup order (their own ``stats`` count what the backends did);
        with KV cache groups group 0's (:meth:`group_stores` for every group's)."""
        return tuple(t.store for t in self._tiers)

    def group_stores(self) -> tuple:
        """Per tier, in lookup order, its ``BlockStore`` of each KV cache group (one backend)."""
        return tuple(t.groups for t in self._tiers)

    # ------------------------------------------------------------------------------------------ loads

    def request_load(self, request_id: Any, token_ids: Sequence[int], namespace: object, hit_blocks: int) -> bool:
        """Start looking up and loading the blocks of ``token_ids`` past its first ``hit_blocks`` (the GPU/CPU
        hit) in the tiers; at most ``(len - 1) // block_size`` blocks in all (the last prompt token is always
        computed). Returns False (and starts nothing) when no block is left to ask for; else the result comes
        out of :meth:`poll` once. O(1) here; the job hashes the prompt (O(len)) and does the I/O."""
        if self.num_groups > 1:
            raise InvalidArgumentError("a connector with KV cache groups loads with request_lookup(..., windows=) "
                                       "and request_read_groups")
        return self._start(self._load_job, request_id, token_ids, namespace, hit_blocks)

    def request_lookup(self, request_id: Any, token_ids: Sequence[int], namespace: object,
                       hit_blocks: int, *, keys: Sequence | None = None,
                       windows: Sequence[int | None] | None = None) -> bool:
        """Start asking the tiers how many leading blocks of ``token_ids`` past its first ``hit_blocks`` they
        hold (at most ``(len - 1) // block_size`` blocks in all), without reading them: a :class:`LookupDone`
        comes out of :meth:`poll` once. Returns False (nothing started) when no block is left to ask for.
        ``keys``: the chain keys of the prompt's full blocks, hashed by the caller (None: the job hashes them);
        with KV cache groups one sequence per group (``pagedkv.block_hashes(..., group=g)``).

        ``windows`` (KV cache groups: per group its sliding window in tokens, None for full attention; needs
        ``keys``): the answer is the longest ``n`` such that every group holds, in some tier, every block past
        the hit that a load of the prompt's first ``hit_blocks + n`` blocks needs (``group_block_ranges``: every
        block of a full-attention group, the window's blocks before position ``(hit_blocks + n) x block_size``
        of a sliding one), and ``LookupDone.group_tiers`` says which tier holds each. O(1) here; the job probes
        each tier (O(blocks x groups) probes at most)."""
        if windows is not None:
            if keys is None or len(keys) != len(windows) or len(windows) != self.num_groups:
                raise InvalidArgumentError(f"windows need one key sequence per KV cache group ({self.num_groups})")
            return self._start(self._group_lookup_job, request_id, token_ids, namespace, hit_blocks,
                               (list(keys), tuple(windows)))
        if self.num_groups > 1:
            raise InvalidArgumentError("a connector with KV cache groups needs windows= (and keys=)")
        return self._start(self._lookup_job, request_id, token_ids, namespace, hit_blocks, keys)

    def _start(self, job, request_id: Any, token_ids: Sequence[int], namespace: object, hit_blocks: int,
               extra: Any = None) -> bool:
        """Submit ``job`` for the blocks of ``token_ids`` past ``hit_blocks`` (at most ``(len - 1) // block_size``
        in all); False when none is left to ask for. Raises on a closed connector or a load already in flight."""
        if self._closed:
            raise RuntimeError("the TierConnector is closed")
        n_max = (len(token_ids) - 1) // self.block_size
        if hit_blocks >= n_max:
            return False
        if request_id in self._pending_loads:
            raise InvalidArgumentError(f"request {request_id!r} already has a load in flight")
        self._pending_loads.add(request_id)
        toks = list(token_ids[: n_max * self.block_size])
        if extra is None:
            self._pool.submit(job, request_id, toks, namespace, int(hit_blocks))
        else:
            self._pool.submit(job, request_id, toks, namespace, int(hit_blocks), extra)
        return True

    def request_read(self, request_id: Any, chain_keys: Sequence[int], runs: Sequence[tuple], namespace: object,
                     start_block: int = 0, checks: Sequence[int] | None = None) -> None:
        """Start reading the blocks ``chain_keys`` (in order), ``runs`` saying which tier holds which part
        (``(tier index, blocks)``, as a :class:`LookupDone`'s, summing to at most ``len(chain_keys)``): a
        :class:`LoadDone` (``start_block`` echoed) comes out of :meth:`poll` once, with the good leading
        payloads (a block that does not come back checked ends the run there: ``ok`` False). ``checks``: the
        blocks' check digests (:func:`~pagedkv.tiers.check_digests`, one per key): a value whose digest differs
        (a chain-key collision) or that has none is refused like a corrupt one. O(1) here."""
        if self._closed:
            raise RuntimeError("the TierConnector is closed")
        if self.num_groups > 1:
            raise InvalidArgumentError("a connector with KV cache groups reads with request_read_groups")
        if request_id in self._pending_loads:
            raise InvalidArgumentError(f"request {request_id!r} already has a load in flight")
        runs = tuple((int(i), int(n)) for i, n in runs)
        if any(not 0 <= i < len(self._tiers) or n < 0 for i, n in runs) or \
                sum(n for _, n in runs) > len(chain_keys):
            raise InvalidArgumentError(f"runs {runs!r} do not fit {len(chain_keys)} blocks of "
                                       f"{len(self._tiers)} tiers")
        if checks is not None and len(checks) != len(chain_keys):
            raise InvalidArgumentError(f"{len(chain_keys)} chain keys but {len(checks)} check digests")
        self._pending_loads.add(request_id)
        self._pool.submit(self._read_job, request_id, list(chain_keys), runs, namespace, int(start_block),
                          None if checks is None else list(checks))

    def cancel(self, request_id: Any) -> None:
        """Forget a load (its request was aborted): its result is dropped when it comes. O(1)."""
        if request_id in self._pending_loads:
            self._cancelled.add(request_id)

    def poll(self) -> list:
        """The lookups (:class:`LookupDone`) and loads (:class:`LoadDone`) finished since the last call
        (cancelled ones dropped). Never blocks."""
        out = []
        while True:
            try:
                r = self._done.get_nowait()
            except queue.Empty:
                return out
            self._pending_loads.discard(r.request_id)
            if r.request_id in self._cancelled:
                self._cancelled.discard(r.request_id)
                continue
            out.append(r)

    def wait(self, timeout: float) -> bool:
        """Block until a load finished (something to poll) or ``timeout`` seconds passed; True if one did. For an
        engine with nothing else to run."""
        if not self._done.empty():
            return True
        try:
            r = self._done.get(timeout=timeout)
        except queue.Empty:
            return False
        self._done.put(r)  # (back for poll(): order among finished loads does not matter)
        return True

    def _skip(self, t: _Tier) -> bool:
        """Whether the crossover rule skips this tier's lookup now (counted)."""
        t.n_lookups += 1
        if (self.max_load_ms_per_block is not None and t.ema_ms > self.max_load_ms_per_block
                and t.n_lookups % self.probe_every):
            self._count(t, skipped_slow=1)
            return True
        return False

    def _lookup_job(self, request_id: Any, toks: list, namespace: object, hit_blocks: int,
                    keys: Sequence | None = None) -> None:
        t0 = time.perf_counter()
        runs: list = []
        pos = hit_blocks
        try:
            n_max = len(toks) // self.block_size
            keys = block_hashes(toks, self.block_size, namespace) if keys is None else list(keys[:n_max])
            for i, t in enumerate(self._tiers):
                if pos >= len(keys):
                    break
                if self._skip(t):
                    continue
                self._count(t, lookups=1)
                n = t.store.prefix_length(keys[pos:], None if self.chain_names else namespace)
                if n:
                    runs.append((i, n))
                    pos += n
        except Exception as e:  # noqa: BLE001 - a bug in a tier must not lose the request: it computes
            log.warning("pagedkv tiers: lookup for request %r failed: %s: %s", request_id, type(e).__name__, e)
            runs, pos = [], hit_blocks
        self._done.put(LookupDone(request_id, hit_blocks, pos - hit_blocks, tuple(runs),
                                  time.perf_counter() - t0))

    def _read_job(self, request_id: Any, keys: list, runs: tuple, namespace: object, start_block: int,
                  checks: list | None = None) -> None:
        t0 = time.perf_counter()
        payloads: list = []
        by_tier: list = []
        asked = sum(n for _, n in runs)
        ok = True
        pos = 0
        try:
            for i, n in runs:
                if not n:
                    continue
                good = self._read_into(self._tiers[i], keys[pos:pos + n], namespace,
                                       None if checks is None else checks[pos:pos + n], payloads, by_tier)
                pos += good
                if good < n:  # a block it said it holds did not come back checked: stop the prefix here
                    ok = False
                    break
        except Exception as e:  # noqa: BLE001
            log.warning("pagedkv tiers: read for request %r failed: %s: %s", request_id, type(e).__name__, e)
            ok = False
        self._end_load(request_id, start_block, payloads, ok, asked, by_tier, t0)

    def _read_into(self, t: _Tier, keys: list, namespace: object, checks: list | None, payloads: list,
                   by_tier: list) -> int:
        """One tier's run read (:meth:`_read_run`), its good payloads appended to ``payloads`` and
        ``(medium, good)`` to ``by_tier``; returns the good blocks."""
        good, values = self._read_run(t, keys, namespace, checks)
        payloads.extend(values)
        by_tier.append((t.medium, good))
        return good

    def _end_load(self, request_id: Any, start_block: int, payloads: list, ok: bool, asked: int, by_tier: list,
                  t0: float) -> None:
        """A load's end: the tiers' removals published, its latency observed (when it brought blocks), its
        :class:`LoadDone` queued for :meth:`poll`."""
        self._emit_removed()
        dt = time.perf_counter() - t0
        if payloads:
            self.latency.observe(dt)
        self._done.put(LoadDone(request_id, start_block, tuple(payloads), ok, asked, tuple(by_tier), dt))

    def _read_run(self, t: _Tier, keys: list, namespace: object, checks: list | None,
                  group: int = 0) -> tuple[int, list]:
        """get_many of one tier's run (of KV cache group ``group``) in bounded calls, up to its first block that
        does not come back checked; the moving average and the counters updated. (good blocks, their
        payloads)."""
        t1 = time.perf_counter()
        good, values = 0, []
        ns = None if self.chain_names else namespace
        st = t.groups[group]
        for a in range(0, len(keys), self.max_blocks_per_call):  # bounded calls (a store's timeouts)
            b = a + self.max_blocks_per_call
            got = st.get_many(keys[a:b], ns, None if checks is None else checks[a:b])
            h = got.hit_prefix
            good += h
            values.extend(got.values[:h])
            if h < len(got.statuses):
                break
        dt = time.perf_counter() - t1
        if good:
            self._notify_held(t, keys[:good])
        with self._lock:
            t.ema_ms = 0.8 * t.ema_ms + 0.2 * (1000.0 * dt / max(good, 1))
        self._count(t, hit_blocks=good, hit_bytes=sum(v.nbytes for v in values), failed_blocks=len(keys) - good)
        return good, values

    # ---------------------------------------------------------------------------------- KV cache groups

    def _group_lookup_job(self, request_id: Any, toks: list, namespace: object, hit: int, extra: tuple) -> None:
        """The lookup of a model with KV cache groups (see :meth:`request_lookup`): the full-attention groups'
        leading run from the hit caps ``n``; then while a sliding group misses a block of the window a load of
        ``n`` needs, ``n`` drops to that block (a load ending at or before it does not need it). Each block is
        probed at most once per tier, tiers in order (the first holding it is read)."""
        t0 = time.perf_counter()
        keys, windows = extra
        bs = self.block_size
        n_max = len(toks) // bs
        ns = None if self.chain_names else namespace
        avail = [dict() for _ in windows]  # per group: block -> first tier holding it
        probed = [set() for _ in windows]
        n = hit
        try:
            tiers = [(i, t) for i, t in enumerate(self._tiers) if not self._skip(t)]
            for _, t in tiers:
                self._count(t, lookups=1)

            def probe(g: int, a: int, z: int) -> None:
                todo = [j for j in range(a, z) if j not in probed[g]]
                probed[g].update(todo)
                for i, t in tiers:
                    if not todo:
                        break
                    held = t.groups[g].contains_many([keys[g][j] for j in todo], ns)
                    rest = []
                    for j, h in zip(todo, held):
                        if h:
                            avail[g][j] = i
                        else:
                            rest.append(j)
                    todo = rest

            n = n_max
            for g, w in enumerate(windows):  # full attention: every block past the hit
                if w is None and n > hit:
                    probe(g, hit, n)
                    k = hit
                    while k < n and k in avail[g]:
                        k += 1
                    n = k
            while n > hit:  # sliding windows: the blocks the window at n sees past the hit
                miss = -1
                for g, (a, z) in enumerate(group_block_ranges(n, bs, windows)):
                    if windows[g] is None:
                        continue
                    a = max(a, hit)
                    probe(g, a, z)
                    for j in range(z - 1, a - 1, -1):
                        if j not in avail[g]:
                            miss = max(miss, j)
                            break
                if miss < 0:
                    break
                n = max(hit, miss)
        except Exception as e:  # noqa: BLE001 - a bug in a tier must not lose the request: it computes
            log.warning("pagedkv tiers: lookup for request %r failed: %s: %s", request_id, type(e).__name__, e)
            n = hit
        gt = None
        if n > hit:
            gt = tuple((max(a, hit), tuple(avail[g].get(j, -1) for j in range(max(a, hit), z)))
                       for g, (a, z) in enumerate(group_block_ranges(n, bs, windows)))
        self._done.put(LookupDone(request_id, hit, n - hit, (), time.perf_counter() - t0, gt))

    def request_read_groups(self, request_id: Any, items: Sequence[Sequence[tuple]], start_block: int) -> None:
        """Start reading the blocks of a load with KV cache groups: ``items[g]`` lists group ``g``'s blocks to
        read in block order, each ``(chain key, check digest, tier index)`` (the tier a :class:`LookupDone`'s
        ``group_tiers`` named; -1: none: the group's read ends there). Each group is read on its own, up to its
        first block that does not come back checked: a :class:`LoadDone` (``group_payloads``: each group's
        good leading payloads; ``ok``: every block came back) comes out of :meth:`poll` once. O(1) here."""
        if self._closed:
            raise RuntimeError("the TierConnector is closed")
        if request_id in self._pending_loads:
            raise InvalidArgumentError(f"request {request_id!r} already has a load in flight")
        if len(items) != self.num_groups:
            raise InvalidArgumentError(f"{len(items)} groups of blocks for a connector of {self.num_groups}")
        items = [[(int(k), int(c), int(i)) for k, c, i in it] for it in items]
        if any(not -1 <= i < len(self._tiers) for it in items for _, _, i in it):
            raise InvalidArgumentError(f"a tier index outside [-1, {len(self._tiers)})")
        self._pending_loads.add(request_id)
        self._pool.submit(self._group_read_job, request_id, items, int(start_block))

    def _group_read_job(self, request_id: Any, items: list, start_block: int) -> None:
        t0 = time.perf_counter()
        out: list = []
        got_by_tier = [0] * len(self._tiers)
        asked = sum(len(it) for it in items)
        ok = True
        try:
            for g, it in enumerate(items):
                vals: list = []
                out.append(vals)
                pos = 0
                while pos < len(it):  # one run per tier, in block order
                    i = it[pos][2]
                    end = pos
                    while end < len(it) and it[end][2] == i:
                        end += 1
                    if i < 0:
                        break
                    run = it[pos:end]
                    good, values = self._read_run(self._tiers[i], [k for k, _, _ in run], None,
                                                  [c for _, c, _ in run], g)
                    vals.extend(values)
                    got_by_tier[i] += good
                    pos += good
                    if good < len(run):
                        break
                if pos < len(it):
                    ok = False
        except Exception as e:  # noqa: BLE001
            log.warning("pagedkv tiers: read for request %r failed: %s: %s", request_id, type(e).__name__, e)
            ok = False
        while len(out) < len(items):
            out.append([])
        self._emit_removed()
        dt = time.perf_counter() - t0
        if any(out):
            self.latency.observe(dt)
        by_tier = tuple((t.medium, n) for t, n in zip(self._tiers, got_by_tier))
        self._done.put(LoadDone(request_id, start_block, (), ok, asked, by_tier, dt,
                                tuple(tuple(v) for v in out)))

    def _load_job(self, request_id: Any, toks: list, namespace: object, hit_blocks: int) -> None:
        t0 = time.perf_counter()
        payloads: list = []
        by_tier: list = []
        asked = 0
        ok = True
        ns = None if self.chain_names else namespace
        try:
            keys = block_hashes(toks, self.block_size, namespace)
            checks = check_digests(toks, self.block_size, namespace)  # a collided chain key is never served
            pos = hit_blocks
            for t in self._tiers:
                if pos >= len(keys):
                    break
                if self._skip(t):
                    continue
                self._count(t, lookups=1)
                n = t.store.prefix_length(keys[pos:], ns)
                if n == 0:
                    by_tier.append((t.medium, 0))
                    continue
                asked += n
                good = self._read_into(t, keys[pos:pos + n], namespace, checks[pos:pos + n], payloads, by_tier)
                pos += good
                if good < n:  # a block it said it holds did not come back checked: stop the prefix here
                    ok = False
                    break
        except Exception as e:  # noqa: BLE001 - a bug in a tier must not lose the request: it computes
            log.warning("pagedkv tiers: load for request %r failed: %s: %s", request_id, type(e).__name__, e)
            ok = False
        self._end_load(request_id, hit_blocks, payloads, ok, asked, by_tier, t0)

    def take_events(self) -> list:
        """The tier KV events since the last call (``BlockStored`` with ``medium`` = the tier's), in order."""
        with self._lock:
            ev, self._events = self._events, []
        return ev

    def _count(self, t: _Tier, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                t.c[k] += v

    def close(self, timeout: float = 30.0) -> None:
        """Finish the stores in flight (at most ``timeout`` s), stop the I/O threads and close the stores."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for t in self._tiers:
            try:
                t.store.close()
            except Exception:  # noqa: BLE001
                pass


def group_block_ranges(num_blocks: int, block_size: int, windows: Sequence[int | None]) -> list[tuple[int, int]]:
    """Per KV cache group (``windows[g]``: None for full attention, else the sliding window in tokens), the prompt
    blocks ``[a, num_blocks)`` whose KV a load of the prompt's first ``num_blocks`` blocks needs: ``a = 0`` for
    full attention, ``(P - W + 1) // block_size`` (at least 0) for a window W, with ``P = num_blocks x
    block_size`` (the hybrid manager's hit rule, and ``allocate(..., external_window_only=True)``'s). O(groups)."""
    p = num_blocks * block_size
    return [(0 if w is None else min(num_blocks, max(0, p - w + 1) // block_size), num_blocks) for w in windows]
