"""The engine's storage tiers: a disk directory and a shared store (Redis or a shared directory) under the prefix
cache, wired into :class:`pagedkv.engine.LLM` on the block manager's external-KV contract (issue 24 items 2-3;
docs/tiers.md#the-engine, docs/external-kv.md).

One object per engine, a :class:`~pagedkv.engine.connector.KVConnector` the step loop calls (the prompts' and
filled blocks' chain keys kept by :class:`~pagedkv.engine.kv_chains.ChainKeys`)::

    add a request    on_add: the GPU/CPU hit (lookup_prefix) -> TierConnector.request_lookup of the blocks past it
                     (how many the tiers hold; nothing read yet); the request waits in the scheduler's loading set
    every step       poll (before the schedule):
                       lookups done   -> Scheduler.kv_ready(rid, start, n, reserve=True): at admission the
                                         scheduler allocates with num_external_tokens (the blocks reserved,
                                         counted by the manager; the sequence LOADING, out of every batch);
                                         a run whose first block another request's pending load reads waits
                                         for that load to end, then is made ready (it hits those blocks)
                       reads done     -> the payloads written into the reserved blocks (external_blocks), then
                                         Scheduler.kv_loaded (all, or the good leading blocks: the rest computed);
                                         the next schedule calls finish_external and prefills the rest
                       stores done    -> block_manager.external.complete_store(store_id, success)
                       timeouts       -> a lookup: computed; a read: reported with what arrived (nothing)
    the step's plan  start_loads (after the plan's copies): each StepPlan.kv_loads -> request_read of its blocks
                     store_computed (after the forward): take_store_plan (write-through, selective, ...): the
                     pinned blocks copied out (the snapshot) and handed to the connector, which writes them to
                     every tier; the plan completes when the connector reports the write

**KV cache groups** (Gemma 3 on a HybridBlockManager, ``windows=``; docs/tiers.md#kv-cache-groups): each tier holds
one store per group (group ``g``'s fingerprint and check digests, its layers' bytes); on_add hashes every group's
chain keys once (remembered with their group and check digest for the store plans, handed to the lookup;
on_blocks_filled chains every group's decode-filled blocks the same way); the
lookup finds the longest run every group can serve (a sliding group only its window's blocks); the scheduler
reserves window-only (``external_window_only``) and each group's read fills its reserved blocks. A short read of
a load cut to the windows has no usable part: it is reported with nothing arrived and the scheduler computes it.

Nothing here waits on I/O: the connector's threads do the lookups, reads and writes; the step loop copies bytes
between host buffers and the KV cache only. A load's blocks are written only after the copy plan of the step that
reserved them has run (poll comes before the next step's schedule): docs/external-kv.md's rule.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse


from ..errors import InvalidArgumentError
from ..tiers import BlockStore, DiskBackend, RedisBackend, SharedDirBackend
from ..tiers.connector import MEDIUM_DISK, MEDIUM_SHARED, LookupDone, TierConnector
from .connector import KVConnector
from .kv_chains import ChainKeys
from .kv_io import model_fingerprint, payload_bytes, read_blocks, write_blocks

__all__ = ["EngineTiers", "open_shared_backend"]

#: the most chain keys of loaded blocks remembered so that a store plan does not write them back (oldest dropped)
_MAX_LOADED_KEYS = 1 << 16
_ABSENT = object()

log = logging.getLogger("pagedkv.tiers")


def open_shared_backend(url: str) -> Any:
    """The shared tier's backend for ``url``: ``redis://host:port[/db]`` (or ``rediss://``, ``unix://``) ->
    :class:`~pagedkv.tiers.RedisBackend`; ``file:///dir`` -> :class:`~pagedkv.tiers.SharedDirBackend`
    (``?max_gib=G`` on either: bounded to G GiB by the backend itself, ``pagedkv serve --kv-shared-gib``; a
    Redis URL without it is bounded by the server's ``maxmemory``).
    Anything else: :class:`pagedkv.InvalidArgumentError`."""
    if not isinstance(url, str) or not url:
        raise InvalidArgumentError(f"kv_shared must be a redis:// or file:// URL, got {url!r}")
    u = urlparse(url)
    pairs = parse_qsl(u.query, keep_blank_values=True)
    gibs = [v for k, v in pairs if k == "max_gib"]
    cap = None
    if gibs:
        try:
            gib = float(gibs[-1])
        except ValueError:
            gib = -1.0
        if len(gibs) > 1 or not 0 < gib < float("inf"):
            raise InvalidArgumentError(f"kv_shared: max_gib must be one number of GiB > 0, got {url!r}")
        cap = max(1, int(gib * 2**30))
        u = u._replace(query=urlencode([(k, v) for k, v in pairs if k != "max_gib"]))
    if u.scheme in ("redis", "rediss", "unix"):
        return RedisBackend(urlunparse(u), max_bytes=cap)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path or u.query:
            raise InvalidArgumentError(f"kv_shared: a file URL is file:///absolute/dir[?max_gib=GIB], got {url!r}")
        return SharedDirBackend(u.path, max_bytes=cap)
    raise InvalidArgumentError(f"kv_shared must be a redis://, rediss://, unix:// or file:/// URL, got {url!r}")


class EngineTiers(KVConnector):
    """The storage tiers of one engine, a :class:`~pagedkv.engine.connector.KVConnector` (see the module
    docstring).

    Args:
        model: the engine's model (the fingerprint's weights digest comes from it).
        kv_cache: the engine's KV cache (the payload layout and dtype come from it; loads are written into it).
        block_size: the block manager's.
        disk_dir: the disk tier's directory (this process alone uses it).
        disk_gib: the disk tier's bound in GiB.
        shared: the shared tier's URL (:func:`open_shared_backend`).
        max_load_ms_per_block: the crossover (:class:`~pagedkv.tiers.TierConnector`); None: always load.
        block_manager: the engine's block manager: its ``store_policy`` decides what is stored
            (``take_store_plan``; ``"none"``: loads only); None: loads only.
        io_threads: the connector's I/O threads.
        load_timeout_s: a lookup or read not finished after this long is given up (the request computes what
            did not arrive).
        record_events: keep the tiers' KV events (medium DISK / SHARED) for :meth:`take_events`.
        fingerprint: the blocks' :class:`~pagedkv.tiers.ModelFingerprint` (None: from ``model`` and the cache).
        cpu_kv_cache: the engine's CPU KV cache (with a CPU tier under ``store_policy="write_back"`` the store
            plans name CPU blocks: the blocks next to leave the CPU pool).
        windows: KV cache groups (a :class:`pagedkv.HybridBlockManager`): per group its sliding window in tokens,
            None for full attention; each tier then holds one store per group, on one backend, under group
            ``g``'s fingerprint (``fingerprint.for_group(g)``). None: one table (every layer per block).
    """

    def __init__(self, model: Any, kv_cache: Any, block_size: int, *, disk_dir: Any = None,
                 disk_gib: float | None = None, shared: str | None = None,
                 max_load_ms_per_block: float | None, block_manager: Any = None, io_threads: int = 2,
                 load_timeout_s: float = 30.0, record_events: bool = True, fingerprint: Any = None,
                 cpu_kv_cache: Any = None, windows: Any = None) -> None:
        fp = fingerprint if fingerprint is not None else model_fingerprint(model, kv_cache)
        nbytes = payload_bytes(kv_cache)
        #: per KV cache group its sliding window (None: full attention); None without KV cache groups
        self.windows = None if windows is None else tuple(windows)
        fps = [fp] if windows is None else [fp.for_group(g) for g in range(len(self.windows))]
        tiers = []
        try:
            if disk_dir is not None:
                if disk_gib is None or isinstance(disk_gib, bool) or not isinstance(disk_gib, (int, float)) \
                        or not 0 < disk_gib < float("inf"):
                    raise InvalidArgumentError(f"kv_disk_gib must be a number of GiB > 0 with kv_disk_dir, "
                                               f"got {disk_gib!r}")
                cap = int(disk_gib * 2**30)
                if cap < nbytes:
                    raise InvalidArgumentError(
                        f"the disk tier's bound (kv_disk_gib, --kv-disk-gib) {disk_gib:g} GiB holds no KV block of "
                        f"this model ({nbytes} bytes); give at least {nbytes / 2**30:.6f} GiB, e.g. --kv-disk-gib 1")
                disk = DiskBackend(disk_dir, cap)
                tiers.append((MEDIUM_DISK, tuple(BlockStore(disk, f, nbytes, track_removals=record_events)
                                                 for f in fps)))
            if shared is not None:
                be = open_shared_backend(shared)
                tiers.append((MEDIUM_SHARED, tuple(BlockStore(be, f, nbytes) for f in fps)))
        except BaseException:
            for _, st in tiers:
                st[0].close()  # (the backend, once)
            raise
        self.fingerprint = fp
        self.block_size = int(block_size)
        self._kv = kv_cache
        #: the CPU KV cache (write-back over the CPU tier copies its store plans' blocks out of it), or None
        self.cpu_kv_cache = cpu_kv_cache
        self._bm = block_manager
        policy = block_manager.config.store_policy if block_manager is not None else "none"
        #: the block manager's store policy ("none": loads only)
        self.store_policy = policy
        self.connector = TierConnector(tiers, block_size, io_threads=io_threads,
                                       max_load_ms_per_block=max_load_ms_per_block,
                                       write_through=policy != "none", record_events=record_events,
                                       chain_names=True)
        self.load_timeout_s = float(load_timeout_s)
        self._runs: dict = {}  # request id -> (start block, runs) of its lookup, until its admission
        self._reading: dict = {}  # request id -> the ExternalLoad its read fills
        self._lookups: dict = {}  # request id -> when its lookup was asked (the timeout)
        self._reads: dict = {}  # request id -> when its read was asked (the timeout)
        self._given_up: set = set()  # reads past their timeout: their result is dropped when it comes
        # chain keys this engine loaded from the tiers (not written back by a store plan), oldest first, bounded
        self._loaded_keys: dict = {}
        # the chain keys of the prompts added and the blocks steps fill: chain key -> check digest (store plans
        # name blocks by key only; with KV cache groups every group's keys, each group's chain from a root of its
        # own), -> its parent's key (the store plans carry parents only with KV events on), -> its group
        self._chains = ChainKeys(self.block_size, self.windows)
        self._checks, self._parent_keys = self._chains.checks, self._chains.parent_keys
        # duplicate loads: request id -> its prompt's chain keys until its lookup is done; chain key -> the request
        # whose reserved run loads it (until that load ends); that request -> the lookups (LookupDone) that wait
        # for it, whose first block it loads (they are made ready once it ends: they then hit its blocks)
        self._keys_of: dict = {}
        self._loading_keys: dict = {}
        self._loading: dict = {}  # request id -> the chain keys of its pending load's run
        self._waiters: dict = {}
        self._check_group = self._chains.check_group
        #: (KV cache groups) blocks loaded from the tiers into each group
        self.group_loaded_blocks = [0] * (1 if self.windows is None else len(self.windows))
        self.stats = {"loads": 0, "loads_failed": 0, "loads_timed_out": 0, "loaded_blocks": 0,
                      "written_blocks": 0, "stored_blocks": 0, "stores_failed": 0, "loads_aborted": 0,
                      "store_skipped_loaded": 0, "store_skipped_unchecked": 0, "loads_deferred": 0}

    # --------------------------------------------------------------------------------------- requests

    def on_add(self, request_id: Any, token_ids: Any, namespace: Any, block_manager: Any) -> bool:
        """Start the tier lookup of a new request; True when it must wait for it (``wait_for_kv``). The prompt's
        chain keys and check digests (every group's, with KV cache groups) are computed here once: remembered
        for the store plans and handed to the lookup. O(prompt x groups) (a BLAKE2b call per block, ~1 us)."""
        kw = {} if namespace is None else {"namespace": namespace}
        hit = block_manager.lookup_prefix(token_ids, **kw).num_cached_blocks
        keys = self._chains.remember_prompt(request_id, token_ids, namespace)
        if not self.connector.request_lookup(request_id, token_ids, namespace, int(hit), keys=keys,
                                             windows=self.windows):
            return False
        self._keys_of[request_id] = keys
        self._lookups[request_id] = time.monotonic()
        return True

    def poll(self, scheduler: Any) -> int:
        """Between two steps: finished lookups join the waiting queue (``kv_ready(..., reserve=True)``), finished
        reads are written into their reserved blocks and reported (``kv_loaded``), finished stores complete the
        manager's plans, and lookups or reads past their timeout are given up; a lookup whose run another
        request's pending load reads waits for that load to end (:meth:`_ready`). Returns how many requests
        became ready. O(finished + in flight) plus the written blocks' bytes."""
        n = 0
        for r in self.connector.poll():
            if isinstance(r, LookupDone):
                self._lookups.pop(r.request_id, None)
                n += self._ready(r, scheduler)
            else:
                self._read_done(r, scheduler)
        if self._lookups or self._reads:
            self._expire(scheduler)
        if self._loading:
            n += self._release(scheduler)
        if self._keys_of:
            for rid in [rid for rid in self._keys_of if not scheduler.has_request(rid)]:
                del self._keys_of[rid]  # (aborted before its lookup ended)
        if self._bm is not None and self.store_policy != "none":
            for sid, ok in self.connector.poll_stores():
                if not ok:
                    self.stats["stores_failed"] += 1
                self._bm.external.complete_store(sid, ok)
        if self._runs:
            for rid in [rid for rid in self._runs if not scheduler.has_request(rid)]:
                del self._runs[rid]  # (aborted before its admission)
        return n

    def _ready(self, r: Any, scheduler: Any) -> int:
        """A finished lookup: the request joins the waiting queue with the run the tiers hold (reserve), unless
        another request's pending load reads the first block of that run: then it waits for that load to end
        (:meth:`_release`) and is admitted on its blocks instead of loading them twice. O(run)."""
        rid = r.request_id
        keys = self._keys_of.pop(rid, None)
        if not r.num_blocks:
            return int(bool(scheduler.kv_ready(rid, 0, 0)))
        if keys is not None and self.windows is not None:
            keys = keys[0]  # (KV cache groups: group 0's chain names the run)
        run = keys[r.start_block:r.start_block + r.num_blocks] if keys is not None else []
        owner = self._loading_keys.get(run[0]) if run else None
        if owner is not None and owner != rid:
            self._waiters.setdefault(owner, []).append(r)
            self.stats["loads_deferred"] += 1
            return 0
        ok = scheduler.kv_ready(rid, r.start_block * self.block_size, r.num_blocks * self.block_size, reserve=True)
        if ok:
            self._runs[rid] = (r.start_block, _runs_of(r))
            if run:
                self._loading[rid] = run
                for k in run:
                    self._loading_keys.setdefault(k, rid)
        return int(bool(ok))

    def _release(self, scheduler: Any) -> int:
        """The requests whose load ended (its read reported, or it was admitted without one, or it left): their
        keys stop being pending, and the lookups that waited for them are made ready (they find its blocks
        cached now, or load what is still missing). O(pending loads' keys) when one ends, else O(owners)."""
        ended = [o for o in self._loading if o not in self._reading and not scheduler.is_fetching(o)
                 and not scheduler.is_waiting(o)]
        n = 0
        bs = self.block_size
        for o in ended:
            lk = self._loading_keys
            for k in self._loading.pop(o):
                if lk.get(k) == o:
                    del lk[k]
            for r in self._waiters.pop(o, ()):
                if scheduler.has_request(r.request_id):  # (its run as looked up: admission finds the hit again)
                    ok = scheduler.kv_ready(r.request_id, r.start_block * bs, r.num_blocks * bs, reserve=True)
                    if ok:
                        self._runs[r.request_id] = (r.start_block, _runs_of(r))
                    n += int(bool(ok))
        return n

    def _read_done(self, r: Any, scheduler: Any) -> None:
        rid = r.request_id
        self._reads.pop(rid, None)
        load = self._reading.pop(rid, None)
        if rid in self._given_up:  # reported already (nothing arrived in time): its bytes are dropped
            self._given_up.discard(rid)
            return
        self.stats["loads"] += 1
        if not scheduler.is_fetching(rid):  # aborted meanwhile: its parked blocks are freed now
            self.stats["loads_aborted"] += 1
            scheduler.kv_loaded(rid)
            return
        if r.group_payloads is not None:
            self._group_read_done(r, load, scheduler)
            return
        k = min(len(r.payloads), len(load.block_ids))
        if k:
            write_blocks(self._kv, load.block_ids[:k], r.payloads[:k])
            self._remember_loaded(load.keys[:k])
            self.group_loaded_blocks[0] += k
            self.stats["written_blocks"] += k
            self.stats["loaded_blocks"] += k
        if k < len(load.block_ids):
            self.stats["loads_failed"] += 1
        scheduler.kv_loaded(rid, None if k == len(load.block_ids) else k * self.block_size)

    def _group_read_done(self, r: Any, load: Any, scheduler: Any) -> None:
        """A grouped read arrived (each group's good leading payloads of the blocks its reservation holds). Whole:
        every group's blocks written, the load done. Short, when the reservation holds every position (no
        window cut it: a prompt shorter than the windows): the blocks every group got, up to the first missing
        one, written and reported. Short and cut to the windows (``external_window_only``): nothing is usable
        (a load ending at ``m < n`` needs window blocks before the first one read, since a window's first
        block grows by one with each block: ``kv_io.usable_blocks``), so nothing is written and ``kv_loaded(rid,
        0)`` lets the scheduler free the reservation and compute the prompt (``requeued_window_loads``).
        O(blocks x groups) plus the written bytes."""
        bs = self.block_size
        s = load.start_token // bs
        n = s + load.num_tokens // bs
        got = r.group_payloads
        m = n
        if not r.ok:
            self.stats["loads_failed"] += 1
            cut = any(b < 0 for ids in load.group_block_ids for b in ids)
            m = s if cut else s + min(len(p) for p in got)
        ids, payloads, keys = [], [], []
        if m > s:
            for g, (gids, gkeys) in enumerate(zip(load.group_block_ids, load.group_keys)):
                pos = [i for i, b in enumerate(gids) if b >= 0 and s + i < m]
                ids += [gids[i] for i in pos]
                keys += [gkeys[i] for i in pos]
                payloads += got[g][: len(pos)]
                self.group_loaded_blocks[g] += len(pos)
        if ids:
            write_blocks(self._kv, ids, payloads)
            self._remember_loaded(keys)
            self.stats["written_blocks"] += len(ids)
            self.stats["loaded_blocks"] += len(ids)
        scheduler.kv_loaded(r.request_id, None if m == n else (m - s) * bs)

    def _remember_loaded(self, keys: Any) -> None:
        lk = self._loaded_keys
        lk.update(dict.fromkeys(keys))
        while len(lk) > _MAX_LOADED_KEYS:
            del lk[next(iter(lk))]

    def _expire(self, scheduler: Any) -> None:
        now = time.monotonic()
        for rid in [rid for rid, t in self._lookups.items() if now - t > self.load_timeout_s]:
            del self._lookups[rid]
            self.connector.cancel(rid)
            self.stats["loads_timed_out"] += 1
            log.warning("pagedkv tiers: the lookup of request %r took over %.1f s: computing its prompt",
                        rid, self.load_timeout_s)
            scheduler.kv_ready(rid, 0, 0)
        for rid in [rid for rid, t in self._reads.items() if now - t > self.load_timeout_s]:
            del self._reads[rid]
            self._reading.pop(rid, None)
            self._given_up.add(rid)  # (the connector's result, when it comes, is dropped)
            self.stats["loads_timed_out"] += 1
            log.warning("pagedkv tiers: the read of request %r took over %.1f s: computing its blocks",
                        rid, self.load_timeout_s)
            if scheduler.is_fetching(rid):
                scheduler.kv_loaded(rid, 0)  # nothing arrived: every reserved block is computed
            else:
                scheduler.kv_loaded(rid)  # (aborted meanwhile: its parked blocks are freed)

    def start_loads(self, kv_loads: Any) -> list:
        """Start reading the KV of the requests a step admitted with reserved blocks (``StepPlan.kv_loads``),
        each from the tiers its lookup found, from its reserved range's first block on; takes every load (the
        last connector asked). O(loads) here."""
        bs = self.block_size
        for kl in kv_loads:
            if self.windows is not None:
                self._start_group_read(kl)
                continue
            ext = kl.load
            start, runs = self._runs.pop(kl.request_id, (0, ()))
            skip = ext.start_token // bs - start  # (the hit may have grown since the lookup)
            # each block's check digest, remembered when the request was added (a load compares it); a block whose
            # digest is no longer remembered (more than _MAX_CHECK_KEYS keys added since) ends the load there
            cd = self._checks
            checks = [cd.get(k) for k in ext.keys]
            known = checks.index(None) if None in checks else len(checks)
            left = min(len(ext.block_ids), known)
            clipped = []
            for i, m in runs:
                cut = min(skip, m)
                skip -= cut
                m = min(m - cut, left)
                if m > 0:
                    clipped.append((i, m))
                    left -= m
            self._reading[kl.request_id] = ext
            self._reads[kl.request_id] = time.monotonic()
            checks = [0 if c is None else c for c in checks]
            self.connector.request_read(kl.request_id, ext.keys, clipped, None, ext.start_token // bs, checks)
        return []

    def _start_group_read(self, kl: Any) -> None:
        """:meth:`start_loads` of one request with KV cache groups: each group's reserved positions (NULL_BLOCK
        where a sliding group's window no longer sees them) read from the tier its lookup found, with the
        check digests remembered at its add (a block without one, or that no tier holds, ends its group's
        read there). O(blocks x groups)."""
        ext = kl.load
        bs = self.block_size
        s = ext.start_token // bs
        _, gt = self._runs.pop(kl.request_id, (0, None))
        cd = self._checks
        items = []
        for g, ids in enumerate(ext.group_block_ids):
            first, tiers = gt[g] if gt is not None else (0, ())
            mine = []
            for i, b in enumerate(ids):
                if b < 0:
                    continue
                j = s + i
                key = ext.group_keys[g][i]
                c = cd.get(key)
                t = tiers[j - first] if first <= j < first + len(tiers) and c is not None else -1
                mine.append((key, 0 if c is None else c, t))
            items.append(mine)
        self._reading[kl.request_id] = ext
        self._reads[kl.request_id] = time.monotonic()
        self.connector.request_read_groups(kl.request_id, items, s)

    def forget(self, request_id: Any) -> None:
        """A request was added and failed at once: drop its lookup. O(1). (A request aborted later needs
        nothing: its lookup's or read's result is dropped or reported for its parked blocks.)"""
        self.connector.cancel(request_id)
        self._lookups.pop(request_id, None)
        self._runs.pop(request_id, None)
        self._keys_of.pop(request_id, None)

    def wait(self, timeout: float) -> bool:
        """Nothing else to run: block until a lookup or read finishes or ``timeout`` (never past the next
        timeout). True (it waited)."""
        started = list(self._lookups.values()) + list(self._reads.values())
        if started:
            left = min(started) + self.load_timeout_s - time.monotonic()
            timeout = max(0.0, min(timeout, left))
        self.connector.wait(timeout)
        return True

    # ----------------------------------------------------------------------------------------- a step

    def on_blocks_filled(self, plan: Any, scheduler: Any, by_id: dict) -> None:
        """Before the forward: the chain keys and check digests of the blocks the step fills past the prompts'
        (:meth:`pagedkv.engine.kv_chains.ChainKeys.on_blocks_filled`), so that a store plan stores decode-filled
        blocks too. Nothing to do with loads only."""
        if self._bm is None or self.store_policy == "none":
            return
        self._chains.on_blocks_filled(plan, scheduler, by_id)

    def store_computed(self, plan: Any, kv_cache: Any, by_id: dict) -> None:
        """After the forward (the engine calls it after sampling, so that no first token waits for it): the block
        manager's store plan (the blocks its policy picked, pinned until the store completes) copied out of the
        KV cache (the snapshot) and handed to the connector, which writes it to every tier off the step loop.
        Blocks this engine loaded from the tiers are neither copied nor written again (the plan completes as
        stored: they are in the tier they came from; with two tiers, one loaded from the disk is not copied to
        the shared store). O(planned blocks x block bytes)."""
        bm = self._bm
        if bm is None or self.store_policy == "none":
            return
        sp = bm.external.take_store_plan()
        if sp is None:
            return
        ids, keys = sp.block_ids, sp.keys
        parents, toks = getattr(sp, "parent_keys", None), getattr(sp, "token_ids", None)
        if parents is None:  # (KV events off: the parents remembered when the blocks' chains were hashed)
            parents = [self._parent_keys.get(k) for k in keys]
        sel = range(len(keys))  # the plan's entries stored
        lk = self._loaded_keys
        if lk:  # blocks this engine just loaded from the tiers are there already: not copied, not written again
            sel = [i for i in sel if lk.pop(keys[i], _ABSENT) is _ABSENT]
            self.stats["store_skipped_loaded"] += len(keys) - len(sel)
        cd = self._checks
        checks = [cd.get(keys[i]) for i in sel]
        groups = None
        if self.windows is not None:  # (KV cache groups) each key names its group: stored under its fingerprint
            cg = self._check_group
            groups = [cg.get(keys[i]) for i in sel]
            checks = [None if g is None else c for c, g in zip(checks, groups)]
        if None in checks:  # a block whose check digest is not known (no longer remembered): not stored (a load
            # needs it)
            n = len(sel)
            keep = [x for x, c in enumerate(checks) if c is not None]
            sel, checks = [sel[x] for x in keep], [checks[x] for x in keep]
            if groups is not None:
                groups = [groups[x] for x in keep]
            self.stats["store_skipped_unchecked"] += n - len(sel)
        if not sel:
            bm.external.complete_store(sp.store_id, True)
            return
        # (write-back over the CPU tier: the blocks about to leave the CPU pool, copied out of the CPU KV)
        src = self.cpu_kv_cache if getattr(sp, "medium", "GPU") == "CPU" else kv_cache
        payloads = read_blocks(src, [ids[i] for i in sel])
        if self.connector.store([keys[i] for i in sel], payloads, None, store_id=sp.store_id, chained=False,
                                checks=checks, token_ids=None if toks is None else toks[list(sel)].reshape(-1).tolist(),
                                parents=None if parents is None else [parents[i] for i in sel], groups=groups):
            self.stats["stored_blocks"] += len(keys)
        else:  # (closed) the plan ends at once, its blocks unpinned
            bm.external.complete_store(sp.store_id, False)

    # ----------------------------------------------------------------------------------------- state

    def snapshot(self) -> dict:
        """Counters for metrics: per tier (``TierCounters`` plus its ``BlockStore.stats``), the load-latency
        histogram, and the engine's own counts."""
        c = self.connector
        return {"tiers": c.counters(), "store_stats": tuple(_sum_stats(g) for g in c.group_stores()),
                "latency": (c.latency.buckets,) + c.latency.snapshot(), "engine": dict(self.stats),
                "group_loaded_blocks": tuple(self.group_loaded_blocks)}

    def take_events(self) -> list:
        return self.connector.take_events()

    def stores_pending(self) -> bool:
        """Stores in flight or finished and not yet completed by :meth:`poll` (the server's idle loop polls until
        none is left: the tier counters and the blocks pinned for the stores settle without another request).
        Thread-safe. O(1)."""
        return self.store_policy != "none" and self.connector.stores_unsettled

    def close(self, timeout: float = 30.0) -> None:
        """Finish the stores in flight (at most ``timeout`` s) and close the tiers (the disk directory's lock is
        released: another engine may open it). Stores that finish then complete their plans."""
        self.connector.close(timeout)
        if self._bm is not None and self.store_policy != "none":
            for sid, ok in self.connector.poll_stores():
                self._bm.external.complete_store(sid, ok)


def _runs_of(r: Any) -> Any:
    """A lookup's runs as its read takes them: per tier, or per group and tier with KV cache groups."""
    return r.runs if getattr(r, "group_tiers", None) is None else r.group_tiers


def _sum_stats(stores: Any) -> Any:
    """One tier's ``TierStats``: its stores' (one per KV cache group) summed field by field."""
    st = [s.stats for s in stores]
    if len(st) == 1:
        return st[0]
    return type(st[0])(*(sum(x) for x in zip(*st)))
