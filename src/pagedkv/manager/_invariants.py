"""The O(n) audit of every invariant of a block manager (tests call it after every step): :func:`check`.

It reads every part (documented attributes only, plus the leaf structures' own state: refcounts, free ring,
evictor, cache map, CPU tier); it changes nothing and nothing depends on it.
"""

from __future__ import annotations

import numpy as np

from ..blocks.prefix_cache import block_key
from ..types import NULL_BLOCK


def fail(msg: str) -> None:
    """Raise the audit's AssertionError (shared with the parts that check their own state)."""
    raise AssertionError(msg)


def check(blocks, tier, bs: int, groups, extra=()) -> None:
    """Check every invariant of the managers sharing ``blocks`` (:class:`~pagedkv.blocks._blocks.Blocks`: the pools,
    the prefix cache, the CPU blocks' identities) and ``tier``; ``groups``: ``(tables, window)`` of each manager
    (one, or one per KV cache group), whose references are counted together; ``extra``: arrays of GPU blocks
    holding one reference each besides the tables (external KV: parked loads, holds, store pins). Raises
    AssertionError. O(blocks + total table length).

    - each GPU (CPU) block's refcount equals the number of GPU-resident (swapped-out) tables holding it;
    - no block appears twice in one table, released positions hold NULL_BLOCK, tables cover the tokens;
    - free ring, evictor and used blocks partition each pool (free + cached-free + used == total);
    - the free ring holds unreferenced uncached blocks, the evictor unreferenced cached ones, in a
      consistent linked list; the cache map and the per-block entries agree (no block under two keys).
    """

    gpu, cpu, cache = blocks.gpu, blocks.cpu, blocks.cache
    counts = {False: np.zeros(gpu.num_blocks, np.int64), True: np.zeros(cpu.num_blocks, np.int64)}
    for t, window in groups:
        _check_rows(t, window, bs, gpu, cpu, cache, counts, fail)
    for blocks_held in extra:
        np.add.at(counts[False], np.asarray(blocks_held, dtype=np.int64), 1)
    for swapped, pool, name in ((False, gpu, "GPU"), (True, cpu, "CPU")):
        if not np.array_equal(counts[swapped], pool.ref):
            bad = int(np.flatnonzero(counts[swapped] != pool.ref)[0])
            fail(f"{name} block {bad}: refcount {pool.ref[bad]} but {counts[swapped][bad]} holders")
        free = pool.free_ids()
        if np.unique(free).size != free.size:
            fail(f"{name} free ring holds a block twice")
        if (pool.ref[free] != 0).any():
            fail(f"{name} free ring holds a referenced block")
        used = int((pool.ref > 0).sum())
        if swapped:  # the CPU tier's blocks (cached or pinned) are neither free nor referenced
            cached_free = 0 if tier is None else len(tier.held())
        else:
            cached_free = len(cache.evictor) + getattr(cache.evictor, "num_parked", 0) if cache is not None else 0
        if free.size + cached_free + used != pool.num_blocks:
            fail(f"{name}: free {free.size} + cached {cached_free} + used {used} != {pool.num_blocks}")
    if cache is not None:
        _check_cache(blocks, tier, [t for t, _ in groups], fail)


def _check_cache(blocks, tier, tables: list, fail) -> None:
    cache, ref, cpu_id = blocks.cache, blocks.gpu.ref, blocks.cpu_id
    cid = cache.cid
    ev = list(cache.evictor)
    if len(ev) != len(cache.evictor) or len(set(ev)) != len(ev):
        fail("evictor list is inconsistent")
    ev_arr = np.asarray(ev, dtype=np.int64)
    if (ref[ev_arr] != 0).any() or (cid[ev_arr] == 0).any():
        fail("the evictor holds a block that is referenced or uncached")
    verify = getattr(cache.evictor, "verify", None)  # the policy's own bookkeeping (pagedkv.blocks.policy)
    if verify is not None:
        verify()
    check_steering = getattr(cache.evictor, "check", None)  # priority classes and pins (pagedkv.retention.steering)
    if check_steering is not None:
        check_steering(ref, fail)
        if np.intersect1d(np.flatnonzero(cache.evictor.parked), ev_arr).size:
            fail("a parked block is also evictable")
    free = blocks.gpu.free_ids()
    if np.intersect1d(free, ev_arr).size:
        fail("a block is both free and evictable")
    if (cid[free] != 0).any():
        fail("a free block is still cached")
    # copies (prefix_cache "Copies"): a recorded copy is held and uncached, of a content id handed out already
    copies = np.flatnonzero(cache.dupc)
    if (ref[copies] == 0).any() or (cid[copies] != 0).any() or (cache.dupc[copies] > cache.serial).any():
        fail("a block recorded as a copy of a cached content is free, or cached itself")
    cached = np.flatnonzero(cid)
    dl = cache.dl  # dict-less blocks (runs): cached, out of the map, each the successor of its parent's block
    if (dl & (cid == 0)).any() or int(np.count_nonzero(dl)) != cache.ndl:
        fail("the dict-less marks are not a count of cached blocks")
    mapped = cached[~dl[cached]]
    if mapped.size != len(cache.map):
        fail(f"{mapped.size} cached blocks belong in the map but it has {len(cache.map)} keys")
    if np.unique(cid[cached]).size != cached.size or (cid[cached] < 0).any() or cid.max(initial=0) > cache.serial:
        fail("content ids are not unique positive serials")
    if np.unique(cache.key[cached]).size != cached.size:
        fail("two cached blocks have the same key")
    for b, k in zip(mapped.tolist(), cache.key[mapped].tolist()):
        if cache.map.get(k) != b:
            fail(f"cached block {b} is not where the map points for its key")
    dlb = np.flatnonzero(dl)
    if dlb.size:
        pred = np.flatnonzero(cache.succ >= 0)
        nxt = cache.succ[pred].astype(np.int64)
        live = (cid[pred] != 0) & (cid[nxt] != 0) & (cache.pcid[nxt] == cid[pred])
        if not np.isin(dlb, nxt[live]).all():
            fail("a dict-less block is not the run successor of the block caching its parent")
    # every cached block's key is the chained hash of its stored tokens (catches writes into cached blocks)
    parent_key = dict(cache.roots.values())
    parent_key.update(zip(cid[cached].tolist(), cache.key[cached].tolist()))
    for b, p, k in zip(cached.tolist(), cache.pcid[cached].tolist(), cache.key[cached].tolist()):
        if p in parent_key and block_key(parent_key[p], cache.tok[b].tobytes()) != k:
            fail(f"cached block {b}: its key is not the hash of its tokens after its parent")
    for t in tables:
        for row in list(t.row_of.values()) + list(t.loading.values()):
            c = int(t.ccid[row])
            if c and c in parent_key and parent_key[c] != int(t.ckey[row]):
                fail(f"row {row}: its chain key is not the key of its chain's content")
    cpu_cached = np.flatnonzero(cpu_id[0])
    tier_blocks = set() if tier is None else set(tier.map.values())
    if any(blocks.cpu.ref[c] == 0 and c not in tier_blocks for c in cpu_cached.tolist()):
        fail("a free CPU block carries a cache identity")
    if tier is not None:
        tier.check(fail)

def _check_rows(t, window, bs: int, gpu, cpu, cache, counts: dict, fail) -> None:
    """One manager's rows and tables; adds each table's references to ``counts`` (GPU, CPU)."""
    if len(t.row_of) + len(t.loading) + len(t.free_rows) != len(t.seq_of):
        fail("rows: live + loading + free != capacity")
    if set(t.row_of) & (set(t.loading) | set(t.parked)) or set(t.loading) & set(t.parked):
        fail("a sequence id is in two of live, loading and parked")
    for seq_id in t.partial:  # (chunked prefill: prompt lengths of live sequences only)
        if seq_id not in t.row_of and seq_id not in t.loading:
            fail(f"{seq_id!r}: a freed sequence is still recorded as partly prefilled")
    for seq_id, row in list(t.row_of.items()) + list(t.loading.items()):
        if t.seq_of[row] != seq_id:
            fail(f"row {row} maps back to {t.seq_of[row]!r}, not {seq_id!r}")
        n, nb, nrel = int(t.ntok[row]), int(t.nblk[row]), int(t.nrel[row])
        trow = t.table[row]
        if nb * bs < n or n < 1:
            fail(f"{seq_id!r}: {nb} blocks cannot hold {n} tokens")
        if (trow[:nrel] != NULL_BLOCK).any() or (trow[nb:] != NULL_BLOCK).any():
            fail(f"{seq_id!r}: released or unused table positions hold blocks")
        live = trow[nrel:nb]
        if (live < 0).any():
            fail(f"{seq_id!r}: a held position has no block")
        if np.unique(live).size != live.size:
            fail(f"{seq_id!r}: a block appears twice in one table")
        swapped = bool(t.swapped[row])
        size = cpu.num_blocks if swapped else gpu.num_blocks
        if live.size and live.max() >= size:
            fail(f"{seq_id!r}: block id out of range")
        np.add.at(counts[swapped], live, 1)
        if window is not None and nrel > max(n - window, 0) // bs:
            fail(f"{seq_id!r}: released blocks the window still sees")
        if cache is not None and int(t.nreg[row]) > n // bs:
            fail(f"{seq_id!r}: more blocks offered to the cache than are full")
    for rows_free in t.free_rows:
        if t.seq_of[rows_free] is not None or (t.table[rows_free] != NULL_BLOCK).any():
            fail(f"free row {rows_free} is not clean")
