"""External KV, the block manager's side (:class:`External`, a part of the manager; docs/external-kv.md): loads
and holds (the store plans are :mod:`pagedkv.manager._stores`).

No I/O here: the part decides which blocks receive KV that arrives from outside and keeps blocks a reader
outside still uses. The states beside a sequence's usual life::

    LOADING   allocate(..., num_external_tokens=E): the row is moved out of ``row_of`` into ``t.loading`` (every
              per-step path then refuses it at no cost to the others); blocks past the hit are not registered
    PARKED    free() while LOADING: the blocks a transfer may still write keep their reference (``t.parked``)
              until finish_external reports the sequence
    HELD      hold() / free(hold_for=): one more reference on the sequence's blocks until release / expiry

Every parked or held block holds exactly one reference per such use (``extra_refs`` feeds the refcount audit of
``check_invariants``).
"""

from __future__ import annotations

import time
from typing import Hashable, NamedTuple

import numpy as np

from .._checks import as_tokens as _as_tokens
from ..errors import (InvalidArgumentError, OutOfBlocksError, SequenceStateError,
                      UnknownHoldError, UnknownSequenceError)
from ..blocks.prefix_cache import block_hashes
from ._alloc import AllocPlan

class ExternalLoad(NamedTuple):
    """The blocks that receive a LOADING sequence's external KV: ``block_ids[i]`` takes the KV of tokens
    ``[start_token + i * block_size, start_token + (i + 1) * block_size)``, whose chained content key (the prefix
    cache's, :func:`pagedkv.block_hashes`) is ``keys[i]``. ``group_block_ids``: the same per KV cache group (one
    tuple per group; a BlockManager has one) and ``group_keys``. ``cut``: a sliding group reserved only the blocks
    its window sees at the load's end (``external_window_only``): its other positions hold NULL_BLOCK (nothing to
    write there), and the load ends whole (``finish_external(done=)``) or aborted, never as a partial failure."""

    seq_id: Hashable
    start_token: int
    num_tokens: int
    block_ids: tuple
    keys: tuple
    namespace: object
    group_block_ids: tuple
    group_keys: tuple  # the keys per group (``pagedkv.block_hashes(..., group=g)``: each group's chain)
    cut: bool = False


class Hold(NamedTuple):
    """Blocks kept for a reader outside (:meth:`BlockManager.hold`): ``block_ids`` cover the sequence's first
    ``num_tokens`` tokens (block ``i`` holds tokens ``[i * bs, (i + 1) * bs)``; a sliding window's released
    blocks left out); ``expires_at`` on the clock ``hold`` was given (``time.monotonic()`` by default)."""

    hold_id: int
    seq_id: Hashable
    block_ids: tuple
    num_tokens: int
    expires_at: float
    group_block_ids: tuple


class _Load(NamedTuple):
    arr: np.ndarray  # the whole prompt (int32)
    n: int  # tokens the sequence holds
    nhit: int  # hit blocks (the external range starts after them)
    next: int  # external blocks
    namespace: object
    cut: bool = False  # a sliding group holds only its window's blocks (HybridBlockManager, external_window_only)


def _check_lease(lease_s: object) -> float:
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float, np.integer, np.floating)) or \
            not 0 < lease_s < float("inf"):
        raise InvalidArgumentError(f"lease_s must be a positive finite number of seconds, got {lease_s!r}")
    return float(lease_s)


def _now(now: object) -> float:
    if now is None:
        return time.monotonic()
    if isinstance(now, bool) or not isinstance(now, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"now must be a number of seconds or None, got {now!r}")
    return float(now)


class External:
    """Loads and holds of one manager over its parts: the tables ``t``
    (:class:`~pagedkv.manager._rows.SeqTables`: ``loading``, ``parked``), ``blocks``
    (:class:`~pagedkv.blocks._blocks.Blocks`), the registry ``reg``, the allocator ``alloc`` and the prefix cache.
    Its own state: the LOADING sequences' records and the holds. A HybridBlockManager builds one over group 0's
    parts with ``tables`` and ``regs`` (every group's); its group managers' own parts are never used for
    those."""

    def __init__(self, t, blocks, reg, alloc, cache, bs: int, tables: list | None = None,
                 regs: list | None = None) -> None:
        self.t, self.blocks, self.reg, self.alloc, self.cache, self.bs = t, blocks, reg, alloc, cache, bs
        # every KV cache group's tables (a HybridBlockManager's holds cover every group; rows are the same)
        self.tables = tables if tables is not None else [t]
        self.regs = regs if regs is not None else [reg]
        self.gpu = blocks.gpu
        self.loads: dict = {}  # seq_id -> _Load of each LOADING sequence
        self.holds: dict = {}  # hold_id -> Hold
        self.parked_tokens: dict = {}  # seq_id -> external tokens of a load aborted while LOADING (t.parked's)
        self.next_hold = 1

    # ------------------------------------------------------------------ loads
    def check_external(self, e: object) -> int:
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 0 or e % self.bs:
            raise InvalidArgumentError(
                f"num_external_tokens must be an int >= 0 and a multiple of block_size {self.bs}, got {e!r}")
        return int(e)

    def check_lookup(self, e: object, window: int | None) -> int:
        """``num_external_tokens`` of lookup_prefix / can_allocate, checked as allocate checks it."""
        if type(e) is int and e == 0:
            return 0
        e = self.check_external(e)
        if e and window is not None:
            raise InvalidArgumentError("num_external_tokens is not available with a sliding window")
        return e

    def kept(self, n: int, h: int, e: int) -> int:
        """E': the external tokens allocate keeps after a hit of ``h`` tokens in a prompt of ``n`` (see
        :meth:`plan`)."""
        return max(0, min(e, (n - 1) // self.bs * self.bs - h)) if e else 0

    def plan(self, token_ids, la: int, namespace, k: int | None, e: int) -> tuple:
        """The allocation of a prompt with ``e`` external tokens after its hit, without changing anything:
        ``(plan, e')`` with ``plan`` as :meth:`Allocator.plan`'s (``n``, ``nblocks`` and ``need`` of the tokens
        held) and ``e'`` the external tokens kept (whole blocks, ending at or before the last block boundary
        below the prompt's end). Raises what allocate raises. O(prompt blocks)."""
        arr = _as_tokens(token_ids)
        arr, n, nblocks, hits, cpu_hits, chain, need = self.alloc.plan(arr, la, namespace, checked=True)
        if arr is None:  # (no prefix caching: the plan keeps only the count)
            arr = _as_tokens(token_ids)
        h = (len(hits) + (len(cpu_hits) if cpu_hits else 0)) * self.bs
        last = (arr.size - 1) // self.bs * self.bs  # the last block boundary below the end
        ext = max(0, min(e, last - h))
        if k is not None and h + ext + k < n:  # chunked prefill: the hit, the external tokens, one chunk
            n2 = h + ext + k
            nb2 = -(-(n2 + la) // self.bs)
            need -= nblocks - nb2
            n, nblocks = n2, nb2
        return (arr, n, nblocks, hits, cpu_hits, chain, need), ext

    def allocate(self, seq_id: Hashable, token_ids, la: int, namespace, k: int | None, e: int) -> int:
        """``allocate(..., num_external_tokens=e)`` (the facade checked the arguments). O(prompt blocks)."""
        t = self.t
        t.check_new_id(seq_id)
        (arr, n, nblocks, hits, cpu_hits, chain, need), ext = self.plan(token_ids, la, namespace, k, e)
        if need > self.blocks.num_free:
            raise OutOfBlocksError(f"prompt of {n} tokens needs {need} new blocks; {self.blocks.num_free} are free")
        nhit = len(hits) + (len(cpu_hits) if cpu_hits else 0)
        row = self.alloc.commit(seq_id, namespace, arr, n, nblocks, hits, cpu_hits, chain, referenced=False,
                                defer=ext > 0)
        if n < arr.size:
            t.partial[seq_id] = arr.size
        if ext:
            self.enter_loading(seq_id, row, _Load(arr, n, nhit, ext // self.bs, namespace))
        return nhit * self.bs + ext

    def start_load(self, seq_id: Hashable, arr: np.ndarray, nhit: int, ext: int, namespace,
                   cut: bool = False) -> None:
        """A sequence just allocated (every group) with ``ext`` external tokens after its ``nhit`` hit blocks,
        registration deferred: it becomes LOADING. ``cut``: a sliding group holds only the blocks its window
        sees at the load's end (NULL_BLOCK before them; such a load ends whole or aborted). O(groups)."""
        row = self.t.row_of[seq_id]
        self.enter_loading(seq_id, row, _Load(arr, int(self.t.ntok[row]), nhit, ext // self.bs, namespace, cut))

    def enter_loading(self, seq_id: Hashable, row: int, rec: _Load) -> None:
        for t in self.tables:  # (every group's row of the sequence: the same row)
            del t.row_of[seq_id]
            t.loading[seq_id] = row
            t.memo_ids = None
        self.loads[seq_id] = rec

    def allocate_batch(self, seq_ids: list, prompts: list, la: int, namespaces: list, chunks, exts: list,
                       walk) -> object:
        """``allocate_batch(..., num_external_tokens=exts)``: checked and counted as a whole first (every plan;
        the batch's new blocks at most the free ones), every planned GPU hit held (so that no prompt of the batch
        evicts a later one's hit: each prompt's need is then an upper bound once earlier prompts are committed),
        then consecutive allocations, so it is all or nothing. ``walk(arrs, ntoks, rows, nhit)`` builds the
        PrefillBatch. O(total prompt blocks)."""
        t = self.t
        t.check_new_ids(seq_ids)
        if chunks is None:
            chunks = [None] * len(seq_ids)
        plans = [AllocPlan._make(self.plan(p, la, ns, c, e)[0])
                 for p, ns, c, e in zip(prompts, namespaces, chunks, exts)]
        need = sum(p.need for p in plans)
        if need > self.blocks.num_free:
            raise OutOfBlocksError(
                f"the batch of {len(plans)} prompts needs up to {need} new blocks; {self.blocks.num_free} are free")
        held = np.array(sorted({b for p in plans for b in p.hits if b >= 0}), dtype=np.int64)
        if held.size:
            ref = self.gpu.ref
            self.cache.evictor.discard_many(held[ref[held] == 0])
            ref[held] += 1
        rows, ntoks, nhit = [], [], []
        try:
            for s, p, ns, c, e in zip(seq_ids, prompts, namespaces, chunks, exts):
                cached = self.allocate(s, p, la, ns, c, e)
                row = t.loading[s] if s in t.loading else t.row_of[s]
                rows.append(row)
                ntoks.append(int(t.ntok[row]))
                nhit.append(cached // self.bs)
        finally:
            if held.size:
                self.blocks.release(held)
        return walk([_as_tokens(p) for p in prompts], ntoks, rows, nhit)

    def external_blocks(self, seq_id: Hashable) -> ExternalLoad | None:
        """The LOADING sequence's external range (None when it is not LOADING); a sliding group's positions its
        window no longer sees at the load's end are NULL_BLOCK when the load was cut (``external_window_only``).
        O(prompt blocks) (its keys)."""
        t = self.t
        rec = self.loads.get(seq_id) if t.loading else None
        if rec is None:
            t.any_row(seq_id)  # UnknownSequenceError for an unknown id
            return None
        row = t.loading[seq_id]
        bs = self.bs
        ids = tuple(tuple(tg.table[row, rec.nhit : rec.nhit + rec.next].tolist()) for tg in self.tables)
        keys = tuple(tuple(block_hashes(rec.arr[: (rec.nhit + rec.next) * bs], bs, rec.namespace, g)[rec.nhit :])
                     for g in range(len(self.tables)))
        return ExternalLoad(seq_id, rec.nhit * bs, rec.next * bs, ids[0], keys[0], rec.namespace, ids, keys,
                            bool(rec.cut))

    def finish(self, done, failed) -> dict:
        """``finish_external``: validate every report, then end each load (see docs/external-kv.md).
        O(reported blocks)."""
        t, bs = self.t, self.bs
        if isinstance(done, (str, bytes)) or not hasattr(done, "__iter__"):
            raise InvalidArgumentError(f"done must be an iterable of sequence ids, got {done!r}")
        if failed is None:
            failed = {}
        if not isinstance(failed, dict):
            raise InvalidArgumentError(f"failed must be a dict {{seq_id: tokens loaded}}, got {failed!r}")
        items = [(s, None) for s in done] + list(failed.items())
        seen: set = set()
        for s, ok in items:
            try:
                if s in seen:
                    raise InvalidArgumentError(f"sequence {s!r} is reported twice in one finish_external")
            except TypeError:
                raise InvalidArgumentError(f"seq_id must be hashable, got {type(s).__name__}") from None
            seen.add(s)
            if s in t.loading:
                rec = self.loads[s]
                e = rec.next * bs
                if rec.cut and ok is not None:
                    raise InvalidArgumentError(
                        f"failed[{s!r}]: this load holds only the window blocks of its sliding groups (allocate(..., "
                        "external_window_only=True)); the KV they need before them exists nowhere here, so it "
                        "completes whole (done) or is aborted (free, then reported)")
            elif s in t.parked:
                e = self.parked_tokens[s]
            elif s in t.row_of:
                raise SequenceStateError(f"sequence {s!r} is not loading external KV (reported twice, or it never "
                                         "was)")
            else:
                raise UnknownSequenceError(f"unknown sequence {s!r}: not loading, not aborted while loading")
            if ok is not None and (isinstance(ok, bool) or not isinstance(ok, (int, np.integer)) or
                                   not 0 <= ok < e or ok % bs):
                raise InvalidArgumentError(f"failed[{s!r}] must be a multiple of block_size {bs} in [0, {e}) "
                                           f"(tokens loaded intact), got {ok!r}")
        # ---- mutation: nothing below can fail
        out = {}
        for s, ok in items:
            if s in t.parked:
                self.blocks.release(t.parked.pop(s))
                del self.parked_tokens[s]
                continue
            rec = self.loads.pop(s)
            got = rec.next if ok is None else int(ok) // bs
            for tg, reg in zip(self.tables, self.regs):
                row = tg.loading.pop(s)
                tg.row_of[s] = row
                tg.memo_ids = None
                if self.cache is not None and tg.ccid[row] != 0:
                    new = tg.table[row, rec.nhit : tg.nblk[row]].copy()
                    reg.fill_prompt(row, rec.arr[: rec.n], new, rec.nhit)
                tg.pend[row] = min(rec.nhit + got, int(tg.nreg[row]))  # (only the computed blocks are pending)
                tg.ntok0[row] = -1  # handed slots in this step, as after allocate: prefill the rest now
            out[s] = (rec.nhit + got) * bs
        return out

    def abort(self, seq_id: Hashable) -> None:
        """``free(seq_id)`` of a LOADING sequence: every block but the external range's released (none is
        registered), those parked until finish_external reports the sequence. O(table length)."""
        rec = self.loads.pop(seq_id)
        a, z = rec.nhit, rec.nhit + rec.next
        exts = []
        for t in self.tables:
            row = t.loading.pop(seq_id)
            trow = t.table[row]
            x = trow[a:z].astype(np.int64)
            exts.append(x[x >= 0])  # (a cut sliding group's NULL_BLOCK positions hold nothing)
            rest = np.concatenate([trow[t.nrel[row] : a], trow[z : t.nblk[row]]])[::-1].astype(np.int64)
            rest = rest[rest >= 0]  # (a sliding group's released positions)
            t.row_of[seq_id] = row
            t.partial.pop(seq_id, None)
            t.drop_row(seq_id, row)
            self.blocks.release(rest)
        self.t.parked[seq_id] = np.concatenate(exts) if len(exts) > 1 else exts[0]  # (group 0's tables: all)
        self.parked_tokens[seq_id] = rec.next * self.bs

    # ------------------------------------------------------------------ holds
    def hold(self, seq_id: Hashable, lease_s: object, now: object) -> Hold:
        """One more reference on each block covering the sequence's tokens, until release or expiry.
        O(table length)."""
        t = self.t
        row = t.row(seq_id)  # (SequenceStateError while LOADING)
        lease = _check_lease(lease_s)
        at = _now(now)
        if t.swapped[row]:
            raise SequenceStateError(f"sequence {seq_id!r} is swapped out; swap it in before holding its blocks")
        n = int(t.ntok[row])
        per = []
        for tg in self.tables:  # (a sliding group: only the blocks its window still holds)
            b = tg.table[row, tg.nrel[row] : -(-n // self.bs)].astype(np.int64)
            per.append(b[b >= 0])
        b = np.concatenate(per) if len(per) > 1 else per[0]
        self.gpu.ref[b] += 1  # (held by the sequence: referenced, so in neither the free ring nor the evictor)
        hid = self.next_hold
        self.next_hold += 1
        groups = tuple(tuple(x.tolist()) for x in per)
        h = self.holds[hid] = Hold(hid, seq_id, groups[0], n, at + lease, groups)
        return h

    def held(self, seq_id: Hashable) -> list:
        """The ids of the live holds of a sequence. O(holds)."""
        return [hid for hid, h in self.holds.items() if h.seq_id == seq_id]

    def get_hold(self, hold_id: object) -> Hold:
        try:
            return self.holds[hold_id]
        except (KeyError, TypeError):
            raise UnknownHoldError(f"no hold {hold_id!r} (released already, expired, or never made)") from None

    def release_hold(self, hold_id: object) -> None:
        h = self.get_hold(hold_id)
        del self.holds[hold_id]
        for ids in h.group_block_ids:
            self.blocks.release(np.array(ids[::-1], dtype=np.int64))  # (tail first, as free)

    def undo_hold(self, hold_id: int) -> None:
        """Drop the hold just made (a free that failed after it): exactly as before the hold."""
        self.release_hold(hold_id)
        self.next_hold -= 1

    def renew_hold(self, hold_id: object, lease_s: object, now: object) -> Hold:
        h = self.get_hold(hold_id)
        lease = _check_lease(lease_s)
        h = self.holds[hold_id] = h._replace(expires_at=_now(now) + lease)
        return h

    def expire_holds(self, now: object) -> list:
        at = _now(now)
        gone = [hid for hid, h in self.holds.items() if h.expires_at <= at]
        for hid in gone:
            self.release_hold(hid)
        return gone

    # ------------------------------------------------------------------ audit
    def extra_refs(self) -> list:
        """The blocks holding a reference besides the tables: parked loads, holds."""
        out = list(self.t.parked.values())
        out += [np.array(ids, dtype=np.int64) for h in self.holds.values() for ids in h.group_block_ids]
        return out

    def check(self, fail) -> None:
        """This part's invariants (the refcounts are checked with the tables'). O(its blocks + loading rows)."""
        t, cache = self.t, self.cache
        if set(self.loads) != set(t.loading):
            fail("the LOADING records and the loading rows differ")
        for tg in self.tables:
            if tg.loading != t.loading:
                fail("the groups' LOADING sequences differ")
            for s, row in tg.loading.items():
                rec = self.loads[s]
                if int(tg.nreg[row]) > rec.nhit:
                    fail(f"{s!r}: a LOADING sequence registered blocks past its hit")
                if rec.nhit + rec.next > int(tg.nblk[row]) or (rec.nhit + rec.next) * self.bs >= rec.arr.size:
                    fail(f"{s!r}: its external range is not inside its prompt")
                ext = tg.table[row, max(rec.nhit, int(tg.nrel[row])) : rec.nhit + rec.next]
                if int(tg.nrel[row]) > rec.nhit and (not rec.cut or tg.ccid[row] != 0):
                    fail(f"{s!r}: a group released external positions of a load that was not cut")
                if (ext < 0).any():
                    fail(f"{s!r}: a block of its external range is missing")
                if cache is not None and (cache.cid[ext] != 0).any():
                    fail(f"{s!r}: a block still loading is findable in the prefix cache")
                if (self.gpu.ref[ext] != 1).any():
                    fail(f"{s!r}: a block still loading is shared")
        for s, b in t.parked.items():
            if cache is not None and (cache.cid[b] != 0).any():
                fail(f"parked {s!r}: a block a transfer may still write is findable")
        for hid, h in self.holds.items():
            if h.hold_id != hid or hid >= self.next_hold:
                fail(f"hold {hid}: inconsistent id")
