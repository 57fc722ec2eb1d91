"""BlockManager: sequences -> block tables over a GPU pool (and a CPU pool for swapping).

Token and block regions of one sequence (block_size 4, sliding window off)::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . . | . . . .
    table       [  17   |    3    |   42    |   8    ]
                 full     full      partial   lookahead-only block
                 ^ cached once written   ^ num_tokens = 10   ^ reserved slots (num_lookahead_slots = 5)

With a sliding window of W tokens the leading blocks that no query can see any more are released and their
table positions hold ``NULL_BLOCK`` (-1)::

    table       [  -1   |   -1    |   42    |   8    |  11  ]
                 released by the window      still visible

Per-sequence state is kept in rows of a few numpy arrays (one row per live sequence), so the batched step is a
handful of vectorised operations whatever the batch size. Per-block state lives in :mod:`pagedkv.pool` and
:mod:`pagedkv.prefix_cache`.
"""

from __future__ import annotations

import enum
from itertools import chain
from typing import Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from .errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidTokensError,
    OutOfBlocksError,
    PromptTooLongError,
    SequenceStateError,
    UnknownSequenceError,
)
from .pool import BlockPool
from .prefix_cache import PrefixCache, _encode_namespace

__all__ = ["AllocStatus", "BlockManager", "NULL_BLOCK", "StepResult", "Stats"]

NULL_BLOCK = -1
"""Pads batch block tables and marks table positions released by the sliding window."""

_TOKEN_MAX = 2**31 - 1
_U64 = 2**64 - 1  # keys are stored as int64 bit patterns on the CPU side
_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_NO_COW = np.zeros((0, 2), dtype=np.int64)
_NO_COW.flags.writeable = False


class AllocStatus(enum.Enum):
    """Answer of :meth:`BlockManager.can_allocate` and :meth:`BlockManager.can_swap_in`."""

    OK = "ok"  #: fits now
    LATER = "later"  #: does not fit now, may after other sequences free blocks
    NEVER = "never"  #: can never fit (more blocks than the pool minus the watermark)


class StepResult(NamedTuple):
    """What the engine needs for one batched append (see :meth:`BlockManager.decode_step`)."""

    slot_mapping: np.ndarray  #: int64 (total new tokens,): physical slot of each new token, batch order
    block_tables: np.ndarray  #: int32 (B, max_blocks): block tables padded with NULL_BLOCK
    seq_lens: np.ndarray  #: int32 (B,): tokens of each sequence after the append
    cow: np.ndarray  #: int64 (m, 2): copy-on-write pairs (src, dst) to copy before writing the new KV


class Stats(NamedTuple):
    """Counters since construction (a snapshot; ``BlockManager.stats`` builds a new one on each read)."""

    prefix_query_tokens: int  #: prompt tokens looked up in the prefix cache by allocate()
    prefix_hit_tokens: int  #: of which were already cached
    prefix_query_blocks: int
    prefix_hit_blocks: int
    evictions: int  #: cached blocks evicted to make room
    cow_copies: int  #: copy-on-write pairs handed out
    swapped_out_blocks: int
    swapped_in_blocks: int  #: blocks brought back (copies plus cache reuses)

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache (0.0 when nothing was queried)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _as_tokens(token_ids: object, what: str = "token_ids") -> np.ndarray:
    """Validate a 1-D sequence of token ids and return it as int32."""
    arr = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidTokensError(f"{what} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidTokensError(f"{what} is empty")
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _TOKEN_MAX:
        raise InvalidTokensError(f"{what} must lie in [0, 2**31), got min {arr.min()} max {arr.max()}")
    return arr.astype(np.int32, copy=False)


class BlockManager:
    """Paged KV-cache block manager (see module docstring).

    Args:
        num_gpu_blocks: blocks in the GPU pool (>= 1). Block ids are ``range(num_gpu_blocks)``.
        block_size: tokens per block (>= 1).
        num_cpu_blocks: blocks in the CPU pool used by swap_out/swap_in (>= 0).
        enable_prefix_caching: find full blocks again by content and share them between sequences.
        sliding_window: attention window in tokens (a query at position p sees (p - W, p]); blocks entirely
            before every future query's window are released. None disables it.
        watermark: fraction of GPU blocks that admission (can_allocate / can_swap_in) keeps free for running
            sequences, in [0, 1).

    Sequences are keyed by any hashable ``seq_id`` chosen by the caller. Every method either completes or raises
    a :mod:`pagedkv.errors` exception and leaves the manager exactly as it was.
    """

    atomic_append = True
    """decode_step / append_slots are all-or-nothing for the whole batch: a scheduler may call them without asking
    can_append_slots first and preempt when they raise OutOfBlocksError."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        watermark: float = 0.01,
    ) -> None:
        num_gpu_blocks = _check_int("num_gpu_blocks", num_gpu_blocks, 1)
        block_size = _check_int("block_size", block_size, 1)
        num_cpu_blocks = _check_int("num_cpu_blocks", num_cpu_blocks, 0)
        if sliding_window is not None:
            sliding_window = _check_int("sliding_window", sliding_window, 1)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise InvalidArgumentError(f"watermark must be a number in [0, 1), got {watermark!r}")
        self._bs = block_size
        self._gpu = BlockPool(num_gpu_blocks)
        self._cpu = BlockPool(num_cpu_blocks)
        self._cache = PrefixCache(num_gpu_blocks, block_size) if enable_prefix_caching else None
        # with prefix caching a swapped-out block keeps its tokens and cache identity (0: none) on the CPU side
        self._cpu_tok = np.zeros((num_cpu_blocks, block_size), np.int32) if enable_prefix_caching else None
        self._cpu_id = np.zeros((3, num_cpu_blocks), np.int64) if enable_prefix_caching else None  # cid, key, pcid
        self._window = sliding_window
        self._watermark_blocks = int(watermark * num_gpu_blocks)
        # sequences: seq_id -> row of the per-sequence arrays
        self._row_of: dict[Hashable, int] = {}
        self._seq_of: list[Hashable | None] = []
        self._free_rows: list[int] = []
        self._ntok = np.zeros(0, dtype=np.int64)  # tokens appended
        self._nblk = np.zeros(0, dtype=np.int64)  # table length (incl. released and lookahead-only blocks)
        self._nrel = np.zeros(0, dtype=np.int64)  # leading blocks released by the sliding window
        self._nreg = np.zeros(0, dtype=np.int64)  # leading blocks already offered to the prefix cache
        self._ccid = np.zeros(0, dtype=np.int64)  # chain: cid of block nreg-1 (a root's before block 0), 0: broken
        self._ckey = np.zeros(0, dtype=np.uint64)  # chain: key of that content
        self._swapped = np.zeros(0, dtype=bool)
        self._table = np.full((0, 4), NULL_BLOCK, dtype=np.int32)
        # one-entry memo of the last batch: seq_ids list -> validated rows
        self._memo_ids: list | None = None
        self._memo_rows = _EMPTY_I64
        self._cow_copies = self._swapped_out = self._swapped_in = 0
        self._query_tokens = self._hit_tokens = self._query_blocks = self._hit_blocks = 0

    # ------------------------------------------------------------------ read-only state
    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_gpu_blocks(self) -> int:
        return self._gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def sliding_window(self) -> int | None:
        return self._window

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission keeps free."""
        return self._watermark_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Plain free GPU blocks plus unreferenced cached ones (which are evicted on demand)."""
        return self._gpu._nfree + (len(self._cache.evictor) if self._cache is not None else 0)

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu._nfree

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks whose content is in the prefix cache (referenced or not)."""
        return len(self._cache) if self._cache is not None else 0

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks held by sequences."""
        return 1.0 - self.num_free_gpu_blocks / self._gpu.num_blocks

    @property
    def stats(self) -> Stats:
        return Stats(
            self._query_tokens,
            self._hit_tokens,
            self._query_blocks,
            self._hit_blocks,
            self._cache.evictions if self._cache is not None else 0,
            self._cow_copies,
            self._swapped_out,
            self._swapped_in,
        )

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: object) -> bool:
        try:
            return seq_id in self._row_of
        except TypeError:
            return False

    @property
    def seq_ids(self) -> tuple:
        """Live sequence ids, in allocation order."""
        return tuple(self._row_of)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens appended to the sequence (prompt plus every appended token)."""
        return int(self._ntok[self._row(seq_id)])

    def is_swapped(self, seq_id: Hashable) -> bool:
        return bool(self._swapped[self._row(seq_id)])

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """The sequence's block table: a read-only int32 copy, one entry per block of
        ``ceil((num_tokens + reserved lookahead) / block_size)``, NULL_BLOCK where the sliding window released the
        block. While the sequence is swapped out the ids are CPU block ids. O(table length)."""
        row = self._row(seq_id)
        t = self._table[row, : self._nblk[row]].copy()
        t.flags.writeable = False
        return t

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
        """Physical slots (``block * block_size + offset``) of token positions ``[start, end)`` (int64).

        Positions up to the reserved lookahead slots are allowed. Raises SequenceStateError for a swapped-out
        sequence or for positions released by the sliding window. O(end - start)."""
        row = self._row(seq_id)
        start = _check_int("start", start, 0)
        end = _check_int("end", end, start)
        cap = int(self._nblk[row]) * self._bs
        if end > cap:
            raise InvalidArgumentError(f"slot range [{start}, {end}) exceeds the {cap} slots of sequence {seq_id!r}")
        if self._swapped[row]:
            raise SequenceStateError(f"sequence {seq_id!r} is swapped out; it has no GPU slots")
        pos = np.arange(start, end, dtype=np.int64)
        blocks = self._table[row, pos // self._bs].astype(np.int64)
        if blocks.size and blocks.min() < 0:
            raise SequenceStateError(f"positions [{start}, {end}) of {seq_id!r} include blocks released by the window")
        return blocks * self._bs + pos % self._bs

    # ------------------------------------------------------------------ admission and allocation
    def can_allocate(self, token_ids: Sequence[int], num_lookahead_slots: int = 0, *, namespace: object = None) -> AllocStatus:
        """Whether a new prompt fits: NEVER if its blocks (plus lookahead) exceed the pool minus the watermark,
        LATER if they do not fit now, else OK. With prefix caching, full blocks it would share with live
        sequences are not counted. O(prompt blocks)."""
        arr = _as_tokens(token_ids)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        needed = -(-(arr.size + la) // self._bs)
        if needed > self._gpu.num_blocks - self._watermark_blocks:
            return AllocStatus.NEVER
        if self._cache is None:
            _encode_namespace(namespace)  # validate it all the same
        else:
            hits, _ = self._lookup(arr, self._cache.root(namespace, intern=False))
            ref = self._gpu._ref
            needed -= sum(1 for b in hits if ref[b] > 0)
        if self.num_free_gpu_blocks - needed >= self._watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, namespace: object = None) -> int:
        """Create the block table of a new sequence holding the prompt ``token_ids``.

        Returns the number of leading prompt tokens whose KV is already cached (a multiple of block_size, less
        than ``len(token_ids)``; 0 without prefix caching): the engine computes positions from there on.
        ``namespace`` (None, str, bytes or int) isolates prefix-cache sharing, e.g. per tenant or LoRA adapter.

        Blocks come from the free ring first (oldest free first), then by evicting the least recently used
        cached block. Raises PromptTooLongError if the prompt can never fit, OutOfBlocksError if it does not fit
        now (admission control with the watermark is :meth:`can_allocate`'s job). O(prompt blocks).
        """
        self._check_new_id(seq_id)
        arr = _as_tokens(token_ids)
        # a new namespace's root is interned only once the allocation succeeds
        if self._cache is None:
            _encode_namespace(namespace)  # validate it all the same
            root = None
        else:
            root = self._cache.root(namespace, intern=False)
        n, bs = arr.size, self._bs
        nblocks = -(-n // bs)
        if nblocks > self._gpu.num_blocks - self._watermark_blocks:
            raise PromptTooLongError(
                f"prompt of {n} tokens needs {nblocks} blocks; the pool has {self._gpu.num_blocks} "
                f"with {self._watermark_blocks} kept free"
            )
        hits: list[int] = []
        chain = (0, 0)
        if root is not None:
            hits, chain = self._lookup(arr, root)
        ref = self._gpu._ref
        reused_free = sum(1 for b in hits if ref[b] == 0)
        if nblocks - len(hits) + reused_free > self.num_free_gpu_blocks:
            raise OutOfBlocksError(
                f"prompt of {n} tokens needs {nblocks - len(hits)} new blocks; {self.num_free_gpu_blocks} are free"
            )
        # mutation starts here; nothing below can fail
        if hits:
            evictor = self._cache.evictor
            for b in hits:
                if ref[b] == 0:
                    evictor.discard(b)
                ref[b] += 1
        new = self._take(nblocks - len(hits))
        row = self._new_row(seq_id)
        self._ensure_cols(nblocks)
        t = self._table[row]
        t[: len(hits)] = hits
        t[len(hits) : nblocks] = new
        self._ntok[row] = n
        self._nblk[row] = nblocks
        self._nreg[row] = len(hits)
        if self._cache is not None:
            self._cache.intern(namespace)
            h = len(hits) * bs  # the hit blocks already hold the tokens before h
            k = (n - h) // bs
            tok = self._cache.tok
            tok[new[:k]] = arr[h : h + k * bs].reshape(k, bs)
            if h + k * bs < n:
                tok[new[k], : n - h - k * bs] = arr[h + k * bs :]
            self._ccid[row], self._ckey[row] = chain
            self._query_tokens += n
            self._hit_tokens += len(hits) * bs
            self._query_blocks += (n - 1) // bs
            self._hit_blocks += len(hits)
        return len(hits) * bs

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """Create ``child_seq_id`` sharing every block of the parent (refcounts + 1); a later write into a shared
        block gets a copy-on-write pair. Works for swapped-out parents too (the child is swapped out as well).
        O(table length)."""
        prow = self._row(parent_seq_id)
        self._check_new_id(child_seq_id)
        crow = self._new_row(child_seq_id)
        nb = int(self._nblk[prow])
        for arr in (self._ntok, self._nblk, self._nrel, self._nreg, self._swapped, self._ccid, self._ckey):
            arr[crow] = arr[prow]
        self._table[crow, :nb] = self._table[prow, :nb]
        blocks = self._table[prow, int(self._nrel[prow]) : nb]
        pool = self._cpu if self._swapped[prow] else self._gpu
        pool._ref[blocks] += 1

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release every block of the sequence and forget it. With prefix caching its full blocks stay cached
        until evicted; they are released tail first, so under memory pressure a long prefix loses its tail
        before its head. ``cache=False`` skips caching the blocks not cached yet (for a request aborted before
        the engine wrote the KV of its last slots). Freeing an unknown or already freed id raises
        UnknownSequenceError. O(table length)."""
        row = self._row(seq_id)
        nb, nrel = int(self._nblk[row]), int(self._nrel[row])
        blocks = self._table[row, nrel:nb][::-1].copy()
        if self._swapped[row]:
            self._release_cpu(blocks)
        else:
            if cache and self._cache is not None:
                self._register(row)
            self._release_gpu(blocks)
        self._drop_row(seq_id, row)

    # ------------------------------------------------------------------ appending (the per-step path)
    def can_append_slots(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0, *, num_new_tokens: int = 1) -> bool:
        """Whether appending ``num_new_tokens`` to each sequence (plus lookahead) fits in the free GPU blocks,
        counting new blocks, copy-on-write copies and blocks the sliding window releases. O(batch)."""
        rows = self._rows(list(seq_ids))
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        k = _check_int("num_new_tokens", num_new_tokens, 1)
        if rows.size == 0:
            return True
        plan = self._plan(rows, np.full(rows.size, k, dtype=np.int64), la)
        return plan[0] <= plan[1]

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int], num_lookahead_slots: int = 0) -> list[tuple[int, int]]:
        """Append ``token_ids`` (whose KV the engine is about to write) to one sequence and reserve
        ``num_lookahead_slots`` empty slots after them. Returns the copy-on-write pairs (src, dst) to copy before
        writing. A convenience over :meth:`decode_step`; raises OutOfBlocksError (changing nothing) when full."""
        rows = self._rows([seq_id])
        arr = _as_tokens(token_ids)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        res = self._append(rows, np.array([arr.size], dtype=np.int64), arr, la, tables=False)
        return [(int(s), int(d)) for s, d in res.cow]

    def decode_step(self, seq_ids: Sequence[Hashable], token_ids: object, num_lookahead_slots: int = 0, *,
                    num_new_tokens: object = None) -> StepResult:
        """The batched hot path: append new tokens to every sequence of a batch in one call.

        ``token_ids``: shape ``(B,)`` (one token per sequence), ``(B, k)``, or a ragged list of B token lists
        (speculative decoding with a different number of accepted tokens per sequence). A ragged batch can also
        come flat, as an engine's sampler produces it: ``token_ids`` 1-D with sequence 0's tokens first and
        ``num_new_tokens`` (B,) the count of each sequence (>= 1); this skips converting Python lists. Reserves
        ``num_lookahead_slots`` empty slots after each sequence's tokens. Returns :class:`StepResult`:

        - ``slot_mapping`` int64 (total new tokens,): slot of each new token, sequence 0's tokens first;
        - ``block_tables`` int32 (B, max table length) padded with NULL_BLOCK;
        - ``seq_lens`` int32 (B,): tokens per sequence after the append;
        - ``cow`` int64 (m, 2): copy-on-write pairs (src, dst), to copy before writing the new KV.

        Blocks for the step come from the free ring (oldest first), then from evicting LRU cached blocks;
        copy-on-write destinations are taken before new blocks. All or nothing: raises OutOfBlocksError and
        changes nothing if the step does not fit (check with :meth:`can_append_slots`). Prefix caching: full
        blocks whose KV the previous step wrote enter the cache here. Sliding window: blocks no query of this
        step can see are released first. O(B) numpy work, plus O(1) C-level work per block that fills (its
        key and map entry) and O(1) Python work per block released by the window or evicted.
        """
        rows = self._rows(seq_ids)
        b = rows.size
        if num_new_tokens is not None:
            arr, counts = self._flat_tokens(token_ids, num_new_tokens, b)
        elif type(token_ids) is np.ndarray and token_ids.ndim == 1 and token_ids.size == b:
            arr, counts = token_ids, None  # the common case: one token each
        else:
            arr, counts = self._batch_tokens(token_ids, b)
        if arr.dtype.kind not in "iu":
            raise InvalidTokensError(f"token_ids must be integers, got dtype {arr.dtype}")
        if arr.size and np.count_nonzero(arr >> 31):  # negative or >= 2**31, in one pass
            raise InvalidTokensError("token_ids must lie in [0, 2**31)")
        la = num_lookahead_slots if type(num_lookahead_slots) is int and num_lookahead_slots >= 0 else \
            _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        if b == 0:
            return StepResult(_EMPTY_I64, np.zeros((0, 0), np.int32), np.zeros(0, np.int32), np.zeros((0, 2), np.int64))
        if counts is None:
            if la == 0:
                res = self._step1(rows, arr)
                if res is not None:
                    return res
            counts = np.ones(b, dtype=np.int64)
        return self._append(rows, counts, arr, la, tables=True)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the CPU pool has room for the sequences' blocks (each shared block counted once)."""
        rows = self._rows_where(list(seq_ids), swapped=False)
        return self._unique_blocks(rows).size <= self._cpu._nfree

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns (gpu_block, cpu_block) pairs to copy. A block
        shared by several of these sequences moves once; one also held by a sequence left on the GPU is copied
        and stays there for it. Raises OutOfBlocksError (changing nothing) if the CPU pool is too small.
        O(total table length)."""
        seq_ids = list(seq_ids)
        rows = self._rows_where(seq_ids, swapped=False)
        uniq = self._unique_blocks(rows)
        if uniq.size > self._cpu._nfree:
            raise OutOfBlocksError(f"swap_out needs {uniq.size} CPU blocks; {self._cpu._nfree} are free")
        if self._cache is not None:
            for row in rows:
                self._register(int(row))
        cpu_ids = self._cpu.take(uniq.size)
        self._cpu._ref[cpu_ids] = 0  # _remap adds one reference per holder
        self._remap(rows, uniq, cpu_ids, self._gpu._ref, self._cpu._ref)
        if self._cache is not None:
            cache = self._cache
            self._cpu_tok[cpu_ids] = cache.tok[uniq]
            ident = self._cpu_id
            ident[0, cpu_ids] = cache.cid[uniq]
            ident[1, cpu_ids] = cache.key[uniq].view(np.int64)
            ident[2, cpu_ids] = cache.pcid[uniq]
        self._swapped[rows] = True
        rev = uniq[::-1]  # tail blocks appear last: release them first
        self._park_gpu(rev[self._gpu._ref[rev] == 0])
        self._swapped_out += uniq.size
        self._memo_ids = None
        return list(zip(uniq.tolist(), cpu_ids.tolist()))

    def can_swap_in(self, seq_ids: Iterable[Hashable], num_lookahead_slots: int = 0) -> AllocStatus:
        """Whether swapped-out sequences fit back on the GPU (with the watermark and ``num_lookahead_slots``
        extra slots each): NEVER, LATER or OK, as for can_allocate."""
        rows = self._rows_where(list(seq_ids), swapped=True)
        la = _check_int("num_lookahead_slots", num_lookahead_slots, 0)
        uniq = self._unique_blocks(rows)
        reuse = self._swap_in_reuse(uniq)
        extra = np.maximum(-(-(self._ntok[rows] + la) // self._bs) - self._nblk[rows], 0).sum()
        need = int(uniq.size + extra)
        if need > self._gpu.num_blocks - self._watermark_blocks:
            return AllocStatus.NEVER
        ref = self._gpu._ref
        need -= sum(1 for g in reuse if g >= 0 and ref[g] > 0)
        return AllocStatus.OK if self.num_free_gpu_blocks - need >= self._watermark_blocks else AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back; returns (cpu_block, gpu_block) pairs to copy. With prefix caching a
        full block whose content is still cached on the GPU is reused instead of copied. Raises OutOfBlocksError
        (changing nothing) if the GPU pool is too small. O(total table length)."""
        seq_ids = list(seq_ids)
        rows = self._rows_where(seq_ids, swapped=True)
        uniq = self._unique_blocks(rows)
        reuse = self._swap_in_reuse(uniq)
        ref = self._gpu._ref
        copy_mask = reuse < 0
        n_copy = int(copy_mask.sum())
        # distinct: two CPU blocks (swapped out separately) may both come back to the same cached GPU block
        from_evictor = {g for g in reuse.tolist() if g >= 0 and ref[g] == 0}
        if n_copy + len(from_evictor) > self.num_free_gpu_blocks:
            raise OutOfBlocksError(
                f"swap_in needs {n_copy + len(from_evictor)} GPU blocks; {self.num_free_gpu_blocks} are free"
            )
        if from_evictor:
            evictor = self._cache.evictor
            for g in from_evictor:
                evictor.discard(g)
        gpu_ids = reuse.copy()
        new = self._take(n_copy)
        ref[new] = 0  # _remap adds one reference per holder
        gpu_ids[copy_mask] = new
        self._remap(rows, uniq, gpu_ids, self._cpu._ref, ref)
        if self._cache is not None:
            cache = self._cache
            c_new, g_new = uniq[copy_mask], gpu_ids[copy_mask]
            cache.tok[g_new] = self._cpu_tok[c_new]
            ident = self._cpu_id
            was_cached = ident[0, c_new] != 0
            for c, g in zip(c_new[was_cached].tolist(), g_new[was_cached].tolist()):
                cache.adopt(g, int(ident[0, c]), int(ident[1, c]) & _U64, int(ident[2, c]))
        self._swapped[rows] = False
        freed = uniq[self._cpu._ref[uniq] == 0]
        if self._cpu_id is not None:
            self._cpu_id[0, freed] = 0
        self._cpu.give(freed)
        self._swapped_in += uniq.size
        self._memo_ids = None
        return [(int(c), int(g)) for c, g in zip(uniq[copy_mask], gpu_ids[copy_mask])]

    # ------------------------------------------------------------------ cache maintenance
    def reset_prefix_cache(self) -> int:
        """Forget every cached block: unreferenced ones return to the free ring (LRU first), referenced ones
        stay with their sequences, uncached. Live sequences never cache their blocks afterwards (their KV may
        predate whatever made the reset necessary, e.g. new weights); new sequences cache as usual. Returns how
        many blocks were freed. O(cached blocks + live sequences)."""
        if self._cache is None:
            return 0
        freed = self._cache.clear()
        self._gpu.give(np.asarray(freed, dtype=np.int32))
        self._cpu_id[0] = 0
        self._ccid[:] = 0  # break every live chain
        return len(freed)

    # ------------------------------------------------------------------ internals: rows
    def _row(self, seq_id: Hashable) -> int:
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None

    def _check_new_id(self, seq_id: Hashable) -> None:
        try:
            exists = seq_id in self._row_of
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None
        if exists:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")

    def _rows(self, seq_ids: Sequence[Hashable]) -> np.ndarray:
        """Validated rows of a batch of live, GPU-resident, distinct sequences (int64). The last batch is
        memoised: an engine that decodes the same running set step after step pays one list compare."""
        if type(seq_ids) is not list:
            seq_ids = list(seq_ids)
        if seq_ids == self._memo_ids:
            return self._memo_rows
        n = len(seq_ids)
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, seq_ids), dtype=np.int64, count=n) if n else _EMPTY_I64
        except (KeyError, TypeError):
            for s in seq_ids:
                self._row(s)
            raise  # pragma: no cover - _row raised
        if n > 1 and not np.diff(np.sort(rows)).all():  # a repeated row (np.unique would be slower)
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise DuplicateSequenceError(f"sequence {dup!r} appears twice in one batch")
        if n and self._swapped[rows].any():
            s = seq_ids[int(np.flatnonzero(self._swapped[rows])[0])]
            raise SequenceStateError(f"sequence {s!r} is swapped out; swap it in before appending")
        self._memo_ids, self._memo_rows = seq_ids.copy(), rows
        return rows

    def _rows_where(self, seq_ids: list, swapped: bool) -> np.ndarray:
        rows = np.array([self._row(s) for s in seq_ids], dtype=np.int64)
        if np.unique(rows).size != rows.size:
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise DuplicateSequenceError(f"sequence {dup!r} appears twice in one swap group")
        bad = np.flatnonzero(self._swapped[rows] != swapped)
        if bad.size:
            s = seq_ids[int(bad[0])]
            raise SequenceStateError(f"sequence {s!r} is {'not ' if swapped else 'already '}swapped out")
        return rows

    def _new_row(self, seq_id: Hashable) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self._seq_of[row] = seq_id
        self._memo_ids = None
        return row

    def _drop_row(self, seq_id: Hashable, row: int) -> None:
        self._table[row, : self._nblk[row]] = NULL_BLOCK
        self._ntok[row] = self._nblk[row] = self._nrel[row] = self._nreg[row] = 0
        self._swapped[row] = False
        self._ccid[row] = self._ckey[row] = 0
        del self._row_of[seq_id]
        self._seq_of[row] = None
        self._free_rows.append(row)
        self._memo_ids = None

    def _grow_rows(self) -> None:
        old = len(self._seq_of)
        new = max(8, 2 * old)
        for name in ("_ntok", "_nblk", "_nrel", "_nreg", "_swapped", "_ccid", "_ckey"):
            a = getattr(self, name)
            b = np.zeros(new, dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        t = np.full((new, self._table.shape[1]), NULL_BLOCK, dtype=np.int32)
        t[:old] = self._table
        self._table = t
        self._seq_of.extend([None] * (new - old))
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _ensure_cols(self, n: int) -> None:
        cols = self._table.shape[1]
        if n > cols:
            t = np.full((self._table.shape[0], max(n, 2 * cols)), NULL_BLOCK, dtype=np.int32)
            t[:, :cols] = self._table
            self._table = t

    @staticmethod
    def _flat_tokens(token_ids: object, num_new_tokens: object, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Validate a flat batch (tokens, counts); counts None when every sequence gets exactly one token."""
        counts = np.asarray(num_new_tokens)
        if counts.ndim != 1 or counts.size != b or (b and counts.dtype.kind not in "iu"):
            raise InvalidTokensError(f"num_new_tokens must be {b} integers, got {counts.dtype} of shape {counts.shape}")
        if b and counts.min() < 1:
            raise InvalidTokensError("every sequence of the batch needs at least one new token")
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise InvalidTokensError(f"with num_new_tokens, token_ids must be 1-D, got shape {arr.shape}")
        if arr.size != counts.sum():
            raise InvalidTokensError(f"got {arr.size} tokens for num_new_tokens summing to {counts.sum()}")
        return arr, (None if arr.size == b else counts.astype(np.int64, copy=False))

    @staticmethod
    def _batch_tokens(token_ids: object, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Flatten a batch's new tokens; returns (flat tokens, per-sequence counts or None for one each)."""
        if isinstance(token_ids, np.ndarray) or not isinstance(token_ids, (list, tuple)) or not token_ids or \
                not isinstance(token_ids[0], (list, tuple, np.ndarray)):
            arr = np.asarray(token_ids)
            if arr.ndim == 1 and arr.size == b:
                return arr, None
            if arr.ndim == 2 and arr.shape[0] == b and arr.shape[1] >= 1:
                return arr.reshape(-1), np.full(b, arr.shape[1], dtype=np.int64)
            raise InvalidTokensError(f"token_ids must have shape ({b},) or ({b}, k), got {arr.shape}")
        if len(token_ids) != b:
            raise InvalidTokensError(f"token_ids has {len(token_ids)} lists for a batch of {b}")
        try:  # one pass of C-level iteration, not one numpy call per sequence
            counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=b)
            flat = np.asarray(list(chain.from_iterable(token_ids)))
        except (TypeError, ValueError):
            flat = None
        if flat is None or flat.ndim != 1:
            raise InvalidTokensError("token_ids: a ragged batch needs one 1-D token list per sequence")
        if counts.min() < 1:
            raise InvalidTokensError("every sequence of the batch needs at least one new token")
        return flat, counts

    # ------------------------------------------------------------------ internals: the append
    def _plan(self, rows: np.ndarray, counts: np.ndarray, la: int) -> tuple:
        """Blocks an append needs and can get, without changing anything.

        Returns (blocks_needed, blocks_available, need, cow, release), where ``need`` is each row's table length
        afterwards, ``cow`` is (rows, cols, src) of shared blocks that will be written, and ``release`` is
        (rows, first, stop) of table ranges the sliding window releases (or None)."""
        bs = self._bs
        ntok = self._ntok[rows]
        end = ntok + counts
        nb = self._nblk[rows]
        need = np.maximum((end + la + bs - 1) // bs, nb)
        n_new = int(need.sum() - nb.sum())
        ref = self._gpu._ref
        available = self.num_free_gpu_blocks
        release = self._window_release(rows, ntok)
        rel = None  # (blocks, counts): references the window drops in this step, before anything is written
        if release is not None:
            blk = np.concatenate([self._table[r, a:z] for r, a, z in zip(*release)])
            rel = np.unique(blk[blk >= 0], return_counts=True)
            # a block is freed when every holder releases it in this step (forks advancing in lockstep)
            available += int((ref[rel[0]] == rel[1]).sum())
        # copy-on-write: existing blocks that receive one of the new tokens and are still shared once the window
        # has released what it releases
        first = ntok // bs
        last = np.minimum((end - 1) // bs, nb - 1)
        span = int((last - first).max()) if last.size else -1
        cow = None
        if span == 0 and last.size:  # one written block per row (the common case)
            hit = first <= last
            src = self._table[rows, np.minimum(first, nb - 1)]
            shared = hit & (self._holders(src, rel) > 1)
            if shared.any():
                cow = (rows[shared], first[shared], src[shared].astype(np.int64))
        elif span > 0:
            bi, cs, ss = [], [], []
            for d in range(span + 1):
                col = first + d
                ok = np.flatnonzero(col <= last)
                src = self._table[rows[ok], col[ok]]
                shared = self._holders(src, rel) > 1
                bi.append(ok[shared]); cs.append(col[ok][shared]); ss.append(src[shared].astype(np.int64))
            bi, cs, ss = np.concatenate(bi), np.concatenate(cs), np.concatenate(ss)
            if bi.size:
                order = np.lexsort((cs, bi))  # batch order, then column: the order the writes happen in
                cow = (rows[bi[order]], cs[order], ss[order])
        if cow is not None:
            cow = self._last_writer_keeps(cow, rel)
        n_cow = 0 if cow is None else cow[0].size
        return n_new + n_cow, available, need, cow, release

    def _holders(self, blocks: np.ndarray, rel: tuple | None) -> np.ndarray:
        """Refcounts of ``blocks`` less the references the window releases in this step (``rel``)."""
        held = self._gpu._ref[blocks]
        if rel is None or blocks.size == 0:
            return held
        rb, rc = rel
        i = np.minimum(np.searchsorted(rb, blocks), rb.size - 1)
        return held - np.where(rb[i] == blocks, rc[i], 0)

    def _last_writer_keeps(self, cow: tuple, rel: tuple | None) -> tuple | None:
        """Sequential semantics inside one batch: when every (remaining) holder of a shared block writes it in
        this step, the earlier writers copy and the last one (in batch order) keeps the original. ``cow`` is in
        write order."""
        c_rows, c_cols, c_src = cow
        uniq, inv, cnt = np.unique(c_src, return_inverse=True, return_counts=True)
        full = cnt == self._holders(uniq, rel)  # every holder writes it
        if not full.any():
            return cow
        last = np.zeros(uniq.size, dtype=np.int64)
        np.maximum.at(last, inv, np.arange(c_src.size))  # the last writer of each block
        keep = np.ones(c_src.size, dtype=bool)
        keep[last[full]] = False
        if not keep.any():
            return None
        return c_rows[keep], c_cols[keep], c_src[keep]

    def _step1(self, rows: np.ndarray, tokens: np.ndarray) -> StepResult | None:
        """Fast path of decode_step for one token per sequence and no lookahead: about a dozen numpy
        operations. Returns None (having changed nothing) when the step needs copy-on-write or more blocks than
        are free; the general path then handles or reports it."""
        bs = self._bs
        ntok = self._ntok[rows]
        j, off = np.divmod(ntok, bs)  # the new token goes to table position j, offset off
        nb = self._nblk[rows]
        grow = j >= nb  # a new block is needed
        written = self._table[rows, j - grow]  # j <= nb: a growing row's last block stands in (it is replaced)
        ref_w = self._gpu._ref[written]
        if ref_w.max() > 1 and (ref_w[~grow] > 1).any():
            return None  # a shared block would be written: copy-on-write
        n_grow = int(np.count_nonzero(grow))
        release = self._window_release(rows, ntok)
        if n_grow > self.num_free_gpu_blocks:
            return None  # (the general path also counts the blocks the window releases)
        # ---- mutation: nothing below can fail
        if self._cache is not None:
            nreg = self._nreg[rows]
            reg = nreg < j
            if np.count_nonzero(reg):
                self._register_rows(rows[reg], nreg[reg], j[reg])
        if release is not None:
            self._release_window(release)
        width = int(nb.max())
        if n_grow:
            ids = self._take(n_grow)
            g_rows, g_j = rows[grow], j[grow]
            width = max(width, int(g_j.max()) + 1)
            self._ensure_cols(width)
            self._table[g_rows, g_j] = ids
            self._nblk[g_rows] = g_j + 1
            written[grow] = ids
        end = ntok + 1
        self._ntok[rows] = end
        slots = written * np.int64(bs) + off  # int64
        if self._cache is not None:
            self._cache.tok.reshape(-1)[slots] = tokens
        return StepResult(slots, self._table[rows, :width], end.astype(np.int32), _NO_COW)

    def _append(self, rows: np.ndarray, counts: np.ndarray, flat: np.ndarray, la: int, tables: bool) -> StepResult:
        if flat.size != counts.sum():
            raise InvalidTokensError(f"got {flat.size} tokens for counts summing to {counts.sum()}")
        needed, available, need, cow, release = self._plan(rows, counts, la)
        if needed > available:
            raise OutOfBlocksError(f"the step needs {needed} new blocks; {available} are free")
        # ---- mutation: nothing below can fail
        bs = self._bs
        ntok = self._ntok[rows]
        if self._cache is not None:
            full, nreg = ntok // bs, self._nreg[rows]
            reg = full > nreg
            if reg.any():
                self._register_rows(rows[reg], nreg[reg], full[reg])
        if release is not None:
            self._release_window(release)
        if cow is not None:
            c_rows, c_cols, c_src = cow
            dst = self._take(c_rows.size)
            self._table[c_rows, c_cols] = dst
            if self._cache is not None:
                self._cache.tok[dst] = self._cache.tok[c_src]
            np.subtract.at(self._gpu._ref, c_src, 1)  # a source may be copied by several writers
            cow_pairs = np.stack((c_src, dst.astype(np.int64)), axis=1)
            self._cow_copies += c_rows.size
        else:
            cow_pairs = np.zeros((0, 2), dtype=np.int64)
        nb = self._nblk[rows]
        grow = need - nb
        n_grow = int(grow.sum())
        if n_grow:
            self._ensure_cols(int(need.max()))
            ids = self._take(n_grow)
            if (grow <= 1).all():  # at most one new block per row (n_grow == grow.size is not enough: [2, 0])
                g = grow > 0
                self._table[rows[g], nb[g]] = ids
            else:
                g_rows = np.repeat(rows, grow)
                starts = np.repeat(nb - (np.cumsum(grow) - grow), grow)
                self._table[g_rows, starts + np.arange(n_grow)] = ids
            self._nblk[rows] = need
        end = ntok + counts
        if counts.size == flat.size:  # one token per sequence
            tok_rows, pos = rows, ntok
        else:
            tok_rows = np.repeat(rows, counts)
            pos = np.repeat(ntok - (np.cumsum(counts) - counts), counts) + np.arange(flat.size)
        self._ntok[rows] = end
        blk, off = np.divmod(pos, bs)
        slots = self._table[tok_rows, blk] * np.int64(bs) + off
        if self._cache is not None:
            self._cache.tok.reshape(-1)[slots] = flat
        if not tables:
            return StepResult(slots, None, None, cow_pairs)
        width = int(need.max())
        return StepResult(slots, self._table[rows, :width], end.astype(np.int32), cow_pairs)

    def _take(self, n: int) -> np.ndarray:
        """``n`` GPU blocks with refcount 1: from the free ring first, then by evicting LRU cached blocks."""
        pool = self._gpu
        k = min(n, pool._nfree)
        ids = pool.take(k)
        if k < n:
            cache = self._cache
            extra = np.fromiter((cache.evict() for _ in range(n - k)), dtype=np.int32, count=n - k)
            pool._ref[extra] = 1
            ids = np.concatenate((ids, extra))
        return ids

    def _release_gpu(self, blocks: np.ndarray) -> None:
        """Drop one reference to each of ``blocks`` (distinct, in release order); blocks reaching zero go to the
        evictor if cached, else to the tail of the free ring."""
        if blocks.size == 0:
            return
        ref = self._gpu._ref
        ref[blocks] -= 1
        self._park_gpu(blocks[ref[blocks] == 0])

    def _park_gpu(self, zero: np.ndarray) -> None:
        """Put unreferenced blocks (in release order) where they belong: cached ones at the MRU end of the
        evictor, the others at the tail of the free ring."""
        if self._cache is None:
            self._gpu.give(zero)
            return
        cached = self._cache.cid[zero] != 0
        for b in zero[cached].tolist():
            self._cache.evictor.push(b)
        self._gpu.give(zero[~cached])

    def _release_cpu(self, blocks: np.ndarray) -> None:
        if blocks.size == 0:
            return
        ref = self._cpu._ref
        ref[blocks] -= 1
        zero = blocks[ref[blocks] == 0]
        if self._cpu_id is not None:
            self._cpu_id[0, zero] = 0
        self._cpu.give(zero)

    def _register(self, row: int) -> None:
        """Offer the row's full, written blocks to the prefix cache (blocks ``nreg .. ntok // bs - 1``), one
        after the other (each key chains from the previous one)."""
        full = int(self._ntok[row]) // self._bs
        j = int(self._nreg[row])
        if full <= j:
            return
        pcid, pkey = int(self._ccid[row]), int(self._ckey[row])
        register = self._cache.register
        for b in self._table[row, j:full].tolist():
            if pcid == 0:
                break
            if b < 0:  # released by the window before it could be cached
                pcid = pkey = 0
                break
            pcid, pkey = register(b, pcid, pkey)
        self._ccid[row], self._ckey[row] = pcid, pkey
        self._nreg[row] = full

    def _window_release(self, rows: np.ndarray, ntok: np.ndarray) -> tuple | None:
        """Table ranges the sliding window lets go before appending at positions ``ntok``: (rows, first, stop)
        of the rows whose leading blocks no query of the step can see any more, or None."""
        if self._window is None:
            return None
        target = np.maximum(ntok - self._window + 1, 0) // self._bs
        nrel = self._nrel[rows]
        rel = target > nrel
        return (rows[rel], nrel[rel], target[rel]) if rel.any() else None

    def _release_window(self, release: tuple) -> None:
        """Release table ranges ``[a, z)`` of rows (tail first) and mark them NULL_BLOCK."""
        for r, a, z in zip(*release):
            blk = self._table[r, a:z]
            self._release_gpu(blk[blk >= 0][::-1].copy())
            self._table[r, a:z] = NULL_BLOCK
            self._nrel[r] = z

    def _register_rows(self, rows: np.ndarray, j: np.ndarray, full: np.ndarray) -> None:
        """:meth:`_register` for a batch of rows whose ``_nreg`` is ``j`` and whose full blocks number ``full``
        (``full > j``): one :meth:`PrefixCache.register_chains` call, or row by row when that declines."""
        if rows.size <= 3:  # below this the batch call's fixed cost (~6 us) exceeds block-by-block (~1.5 us each)
            for row in rows.tolist():
                self._register(row)
            return
        counts = full - j
        if np.count_nonzero(counts - 1):  # some row has several new full blocks (a prompt, a k-token append)
            cr = np.repeat(rows, counts)
            cols = np.repeat(j - np.cumsum(counts) + counts, counts) + np.arange(cr.size)
            blocks = self._table[cr, cols]
        else:
            blocks = self._table[rows, j]
        got = self._cache.register_chains(blocks, counts, self._ccid[rows], self._ckey[rows])
        if got is None:
            for row in rows.tolist():
                self._register(row)
            return
        self._ccid[rows], self._ckey[rows] = got
        self._nreg[rows] = full

    # ------------------------------------------------------------------ internals: swapping
    def _unique_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Distinct non-null blocks of the rows, in order of first appearance (int64)."""
        parts = [self._table[r, self._nrel[r] : self._nblk[r]] for r in rows.tolist()]
        allb = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        allb = allb[allb >= 0]
        _, first = np.unique(allb, return_index=True)
        return allb[np.sort(first)].astype(np.int64)

    def _remap(self, rows: np.ndarray, src: np.ndarray, dst: np.ndarray, src_ref: np.ndarray, dst_ref: np.ndarray) -> None:
        """Rewrite the rows' tables from ``src`` ids to ``dst`` ids; move one reference per holder."""
        order = np.argsort(src)
        s_sorted, d_sorted = src[order], dst[order]
        for r in rows.tolist():
            a, z = int(self._nrel[r]), int(self._nblk[r])
            t = self._table[r, a:z]
            live = t >= 0
            old = t[live].astype(np.int64)
            new = d_sorted[np.searchsorted(s_sorted, old)]
            t[live] = new
            src_ref[old] -= 1
            dst_ref[new] += 1

    def _swap_in_reuse(self, cpu_blocks: np.ndarray) -> np.ndarray:
        """For each CPU block: the GPU block still caching the same content (reuse instead of copy), or -1."""
        reuse = np.full(cpu_blocks.size, -1, dtype=np.int64)
        if self._cache is None:
            return reuse
        ident = self._cpu_id
        for i, c in enumerate(cpu_blocks.tolist()):
            if ident[0, c]:
                reuse[i] = self._cache.lookup(int(ident[0, c]), int(ident[1, c]) & _U64)
        return reuse

    # ------------------------------------------------------------------ internals: lookup
    def _lookup(self, arr: np.ndarray, root: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
        """Cached blocks matching the prompt's leading full blocks (at most (len - 1) // block_size, so at least
        one token is left to compute), and the (cid, key) of the last hit (the root's if none). O(hit blocks)."""
        bs = self._bs
        data = arr.tobytes()
        step = 4 * bs
        cache = self._cache
        find, cid = cache.find, cache.cid
        hits: list[int] = []
        pcid, pkey = root
        for j in range((arr.size - 1) // bs):
            b, key = find(pcid, pkey, data[j * step : (j + 1) * step])
            if b < 0:
                break
            hits.append(b)
            pcid, pkey = int(cid[b]), key
        return hits, (pcid, pkey)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Check every invariant of the manager in O(blocks + total table length); raise AssertionError.

        - each GPU (CPU) block's refcount equals the number of GPU-resident (swapped-out) tables holding it;
        - no block appears twice in one table, released positions hold NULL_BLOCK, tables cover the tokens;
        - free ring, evictor and used blocks partition each pool (free + cached-free + used == total);
        - the free ring holds unreferenced uncached blocks, the evictor unreferenced cached ones, in a
          consistent linked list; the cache map and the per-block entries agree (no block under two keys).
        """

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        bs = self._bs
        counts = {False: np.zeros(self._gpu.num_blocks, np.int64), True: np.zeros(self._cpu.num_blocks, np.int64)}
        if len(self._row_of) + len(self._free_rows) != len(self._seq_of):
            fail("rows: live + free != capacity")
        for seq_id, row in self._row_of.items():
            if self._seq_of[row] != seq_id:
                fail(f"row {row} maps back to {self._seq_of[row]!r}, not {seq_id!r}")
            n, nb, nrel = int(self._ntok[row]), int(self._nblk[row]), int(self._nrel[row])
            t = self._table[row]
            if nb * bs < n or n < 1:
                fail(f"{seq_id!r}: {nb} blocks cannot hold {n} tokens")
            if (t[:nrel] != NULL_BLOCK).any() or (t[nb:] != NULL_BLOCK).any():
                fail(f"{seq_id!r}: released or unused table positions hold blocks")
            live = t[nrel:nb]
            if (live < 0).any():
                fail(f"{seq_id!r}: a held position has no block")
            if np.unique(live).size != live.size:
                fail(f"{seq_id!r}: a block appears twice in one table")
            swapped = bool(self._swapped[row])
            size = self._cpu.num_blocks if swapped else self._gpu.num_blocks
            if live.size and live.max() >= size:
                fail(f"{seq_id!r}: block id out of range")
            np.add.at(counts[swapped], live, 1)
            if self._window is not None and nrel > max(n - self._window, 0) // bs:
                fail(f"{seq_id!r}: released blocks the window still sees")
            if self._cache is not None and int(self._nreg[row]) > n // bs:
                fail(f"{seq_id!r}: more blocks offered to the cache than are full")
        for rows_free in self._free_rows:
            if self._seq_of[rows_free] is not None or (self._table[rows_free] != NULL_BLOCK).any():
                fail(f"free row {rows_free} is not clean")
        for swapped, pool, name in ((False, self._gpu, "GPU"), (True, self._cpu, "CPU")):
            if not np.array_equal(counts[swapped], pool._ref):
                bad = int(np.flatnonzero(counts[swapped] != pool._ref)[0])
                fail(f"{name} block {bad}: refcount {pool._ref[bad]} but {counts[swapped][bad]} holders")
            free = pool.free_ids()
            if np.unique(free).size != free.size:
                fail(f"{name} free ring holds a block twice")
            if (pool._ref[free] != 0).any():
                fail(f"{name} free ring holds a referenced block")
            used = int((pool._ref > 0).sum())
            cached_free = len(self._cache.evictor) if (self._cache is not None and not swapped) else 0
            if free.size + cached_free + used != pool.num_blocks:
                fail(f"{name}: free {free.size} + cached {cached_free} + used {used} != {pool.num_blocks}")
        if self._cache is not None:
            self._check_cache_invariants(fail)

    def _check_cache_invariants(self, fail) -> None:
        cache, ref = self._cache, self._gpu._ref
        cid = cache.cid
        ev = list(cache.evictor)
        if len(ev) != len(cache.evictor) or len(set(ev)) != len(ev):
            fail("evictor list is inconsistent")
        ev_arr = np.asarray(ev, dtype=np.int64)
        if (ref[ev_arr] != 0).any() or (cid[ev_arr] == 0).any():
            fail("the evictor holds a block that is referenced or uncached")
        free = self._gpu.free_ids()
        if np.intersect1d(free, ev_arr).size:
            fail("a block is both free and evictable")
        if (cid[free] != 0).any():
            fail("a free block is still cached")
        cached = np.flatnonzero(cid)
        if cached.size != len(cache._map):
            fail(f"{cached.size} blocks are cached but the map has {len(cache._map)} keys")
        if np.unique(cid[cached]).size != cached.size or (cid[cached] < 0).any() or cid.max(initial=0) > cache._serial:
            fail("content ids are not unique positive serials")
        for b, k in zip(cached.tolist(), cache.key[cached].tolist()):
            if cache._map.get(k) != b:
                fail(f"cached block {b} is not where the map points for its key")
        # every cached block's key is the chained hash of its stored tokens (catches writes into cached blocks)
        parent_key = dict(cache._roots.values())
        parent_key.update(zip(cid[cached].tolist(), cache.key[cached].tolist()))
        for b, p, k in zip(cached.tolist(), cache.pcid[cached].tolist(), cache.key[cached].tolist()):
            if p in parent_key and cache.find(p, parent_key[p], cache.tok[b].tobytes()) != (b, k):
                fail(f"cached block {b}: its key is not the hash of its tokens after its parent")
        for row in self._row_of.values():
            c = int(self._ccid[row])
            if c and c in parent_key and parent_key[c] != int(self._ckey[row]):
                fail(f"row {row}: its chain key is not the key of its chain's content")
        cpu_cached = np.flatnonzero(self._cpu_id[0])
        if (self._cpu._ref[cpu_cached] == 0).any():
            fail("a free CPU block carries a cache identity")
