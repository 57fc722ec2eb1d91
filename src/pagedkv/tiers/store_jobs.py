"""The store half of :class:`~pagedkv.tiers.connector.TierConnector` (a mixin it inherits): blocks written to
every tier on the I/O threads, their completions (:meth:`StoreJobs.poll_stores`), their KV events, and the
held-blocks watcher the prefill side of a split uses (torch-free). It uses the connector's pool, lock, tiers and
event list; see :mod:`pagedkv.tiers.connector` for the whole picture."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from ..errors import InvalidArgumentError
from ..events import BlockRemoved, BlockStored
from .backend import PutStatus
from .key import check_digests
from .transfer_types import _Tier

__all__ = ["StoreJobs"]

log = logging.getLogger("pagedkv.tiers")


class StoreJobs:
    """Stores and their completions; mixed into :class:`~pagedkv.tiers.connector.TierConnector`."""

    # ----------------------------------------------------------------------------------------- stores

    def store(self, chain_keys: Sequence[int], payloads: Sequence, namespace: object,
              token_ids: Sequence[int] | None = None, parent_key: int | None = None,
              checks: Sequence[int] | None = None, *, store_id: Any = None, chained: bool = True,
              parents: Sequence | None = None, groups: Sequence[int] | None = None) -> bool:
        """Write these blocks (their chained keys, one payload each, owned by the connector from now on) to every
        tier, on an I/O thread; a tier that already holds a block keeps it. ``token_ids`` (the blocks' tokens)
        go into the KV events. ``chained``: the blocks are a chain in order (``parent_key`` the first one's
        parent), published as such; False: blocks of any chains (a store plan): with ``parents`` (each block's
        parent chain key, None for a namespace's first block) and ``token_ids`` (the blocks' tokens, block after
        block) the blocks a tier newly stored are published as chains, one ``BlockStored`` per run of a parent
        followed by its child, with its parent key and tokens, parents first (as vLLM's ``BlockStored``);
        without ``parents``, as one ``BlockStored`` without parent or tokens. ``store_id``: when the job ends, ``(store_id, success)`` comes out of
        :meth:`poll_stores` (success: every block is held by at least one tier, stored now or before).
        ``checks``: the blocks' check digests (:func:`~pagedkv.tiers.check_digests` of the whole prompt, sliced
        like the keys); None: computed from ``token_ids`` when the blocks start the chain (``parent_key`` None,
        ``chained``), else the blocks are not stored (a load would refuse a value without its check digest; one
        warning, counted in ``store_errors``; a ``store_id`` then completes as failed).
        ``groups`` (KV cache groups, with ``chained=False``): each block's group, whose store (fingerprint) it
        goes to; None: group 0.
        Returns False when nothing was submitted (write-through off, closed, no block). O(1) here."""
        if self._closed or not self.write_through or not len(chain_keys):
            return False
        if groups is not None:
            groups = [int(g) for g in groups]
            if chained or len(groups) != len(chain_keys) or any(not 0 <= g < self.num_groups for g in groups):
                raise InvalidArgumentError(f"groups must name one KV cache group in [0, {self.num_groups}) per "
                                           "block, with chained=False")
        if len(chain_keys) != len(payloads):
            raise InvalidArgumentError(f"{len(chain_keys)} chain keys but {len(payloads)} payloads")
        if checks is None and chained and parent_key is None and token_ids is not None \
                and len(token_ids) >= len(chain_keys) * self.block_size:
            checks = check_digests(token_ids, self.block_size, namespace)[: len(chain_keys)]
        if checks is None or len(checks) != len(chain_keys):
            if not self._warned_unchecked:
                self._warned_unchecked = True
                log.warning("pagedkv tiers: blocks handed to store() without their check digests are not stored "
                            "(pass checks=check_digests(prompt, block_size, namespace)[j0:j1])")
            with self._lock:
                for t in self._tiers:
                    t.c["store_errors"] += len(chain_keys)
            return False
        with self._lock:
            self._stores_in_flight += 1
        if parents is not None and len(parents) != len(chain_keys):
            raise InvalidArgumentError(f"{len(chain_keys)} chain keys but {len(parents)} parent keys")
        self._pool.submit(self._store_job, list(chain_keys), list(payloads), namespace,
                          None if token_ids is None else list(token_ids), parent_key, store_id, chained,
                          [int(c) for c in checks], None if parents is None else list(parents), groups)
        return True

    def poll_stores(self) -> list:
        """``(store_id, success)`` of the stores submitted with a ``store_id`` that finished since the last call.
        Never blocks."""
        with self._lock:
            out, self._stores_done = self._stores_done, []
        return out

    def _store_job(self, keys: list, payloads: list, namespace: object, toks: list | None,
                   parent: int | None, store_id: Any = None, chained: bool = True, checks: list | None = None,
                   parents: list | None = None, groups: list | None = None) -> None:
        held = [False] * len(keys)
        if self.chain_names:
            namespace = None
        # each block's parent chain key (the tiers evict a chain's tail first): the block before it in a chain,
        # the plan's parents otherwise (None: a root, or not known)
        pk = ([keys[i - 1] if i else parent for i in range(len(keys))] if chained else
              parents if parents is not None else [None] * len(keys))
        by_group: dict = {}  # group -> its blocks' indices (each group's blocks go to its own store)
        for i, g in enumerate(groups if groups is not None else [0] * len(keys)):
            by_group.setdefault(g, []).append(i)
        try:
            for t in self._tiers:
                try:
                    m = self.max_blocks_per_call
                    statuses = [None] * len(keys)
                    for g, idx in by_group.items():
                        for a in range(0, len(idx), m):  # bounded calls (a store's timeouts)
                            sub = idx[a:a + m]
                            got = t.groups[g].put_many([keys[i] for i in sub], [payloads[i] for i in sub],
                                                       namespace, [checks[i] for i in sub],
                                                       [pk[i] for i in sub])
                            for i, st in zip(sub, got):
                                statuses[i] = st
                except Exception as e:  # noqa: BLE001 (bad payload size: a bug; counted, never raised here)
                    log.warning("pagedkv tier %s: store failed: %s: %s", t.medium, type(e).__name__, e)
                    self._count(t, store_errors=len(keys))
                    continue
                for i, st in enumerate(statuses):
                    if st is PutStatus.STORED or st is PutStatus.PRESENT:
                        held[i] = True
                self._notify_held(t, [keys[i] for i, s in enumerate(statuses)
                                      if s is PutStatus.STORED or s is PutStatus.PRESENT])
                new = [i for i, s in enumerate(statuses) if s is PutStatus.STORED]
                self._count(t, stored_blocks=len(new),
                            stored_bytes=sum(memoryview(payloads[i]).nbytes for i in new),
                            store_full=sum(1 for s in statuses if s is PutStatus.FULL),
                            store_errors=sum(1 for s in statuses if s in (PutStatus.ERROR, PutStatus.TOO_LARGE)))
                if new and self.record_events and not chained:
                    bs = self.block_size
                    for g, idx in by_group.items():  # (one event per group and chain; group_idx with groups)
                        mine = [i for i in idx if statuses[i] is PutStatus.STORED]
                        if not mine:
                            continue
                        gi = None if groups is None else g
                        if parents is None:
                            evs = [BlockStored(block_hashes=[keys[i] for i in mine], parent_block_hash=None,
                                               token_ids=[], block_size=bs, medium=t.medium, namespace=None,
                                               group_idx=gi)]
                        else:
                            evs = [BlockStored(block_hashes=[keys[i] for i in run],
                                               parent_block_hash=parents[run[0]],
                                               token_ids=[] if toks is None else
                                               [x for i in run for x in toks[i * bs:(i + 1) * bs]],
                                               block_size=bs, medium=t.medium, namespace=None, group_idx=gi)
                                   for run in _chains(keys, parents, mine)]
                        with self._lock:
                            self._events.extend(evs)
                elif new and self.record_events:
                    bs = self.block_size
                    for run in _runs(new):  # one event per run of consecutive blocks (a chain)
                        i0 = run[0]
                        ev = BlockStored(
                            block_hashes=[keys[i] for i in run],
                            parent_block_hash=(keys[i0 - 1] if i0 > 0 else parent),
                            token_ids=[] if toks is None else toks[i0 * bs:(run[-1] + 1) * bs],
                            block_size=bs, medium=t.medium, namespace=namespace)
                        with self._lock:
                            self._events.append(ev)
            self._emit_removed()
        finally:
            with self._lock:
                if store_id is not None:
                    self._stores_done.append((store_id, all(held)))
                self._stores_in_flight -= 1
                self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted store finished (tests, shutdown); True if they all did in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._stores_in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def watch_held(self, medium: str, callback: Any) -> None:
        """Call ``callback(chain_keys)`` (a list) on an I/O thread whenever the tier ``medium`` is known to hold
        blocks: a store of them finished there (stored now, or held already) or a read of them came back checked.
        One watcher per connector (a later call replaces it; ``callback`` None removes it). The callback must be
        quick and thread-safe (it runs on the I/O threads, outside the connector's lock); an exception it raises is
        logged and dropped. The prefill side of a prefill/decode split answers through the shared store only once
        the prompt's held blocks are there (docs/pd-split.md#through-the-shared-store). O(1)."""
        if callback is not None and medium not in self.media:
            raise InvalidArgumentError(f"no tier {medium!r} here (tiers: {', '.join(self.media)})")
        self._held_watch = None if callback is None else (medium, callback)

    @property
    def num_stores_in_flight(self) -> int:
        """Stores submitted and not finished (their watcher calls, :meth:`watch_held`, come before they finish).
        Thread-safe. O(1)."""
        with self._lock:
            return self._stores_in_flight

    @property
    def stores_unsettled(self) -> bool:
        """Stores in flight, or finished and not yet taken by :meth:`poll_stores` (an idle engine polls until
        none is left, so that its counters and pinned blocks are settled without a next request). Thread-safe.
        O(1)."""
        with self._lock:
            return bool(self._stores_in_flight or self._stores_done)

    def _notify_held(self, t: _Tier, keys: list) -> None:
        w = getattr(self, "_held_watch", None)
        if w is None or not keys or w[0] != t.medium:
            return
        try:
            w[1](keys)
        except Exception as e:  # noqa: BLE001 - a watcher's bug never fails a store or a read
            log.warning("pagedkv tiers: the held-blocks watcher failed: %s: %s", type(e).__name__, e)

    def _emit_removed(self) -> None:
        """BlockRemoved (the tier's medium) for the blocks each tier that tracks them evicted or dropped."""
        if not self.record_events:
            return
        for t in self._tiers:
            for g, st in enumerate(t.groups):
                take = getattr(st, "take_removed", None)
                gone = take() if take is not None else None
                if gone:
                    ev = BlockRemoved(list(gone), t.medium) if len(t.groups) == 1 else \
                        BlockRemoved(list(gone), t.medium, g)
                    with self._lock:
                        self._events.append(ev)

def _runs(idx: list[int]) -> list[list[int]]:
    """Sorted indices split into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _chains(keys: list, parents: list, idx: list[int]) -> list[list[int]]:
    """The blocks ``idx`` (indices into ``keys`` / ``parents``) as chains: runs in which each block's parent is the
    block before it, a run's first block's parent not in the run (another run's block, or outside ``idx``), every
    run after the run holding its parent (parents first). O(len(idx))."""
    pos = {keys[i]: i for i in idx}
    kids: dict = {}
    todo = []
    for i in idx:
        j = pos.get(parents[i], -1) if parents[i] is not None else -1
        if j >= 0 and j != i:
            kids.setdefault(j, []).append(i)
        else:
            todo.append(i)
    runs = []
    k = 0
    while k < len(todo):
        run = [todo[k]]
        k += 1
        while True:
            ks = kids.get(run[-1])
            if not ks:
                break
            run.append(ks[0])
            todo.extend(ks[1:])
        runs.append(run)
    return runs
