"""The per-sequence tables of one block manager (one KV cache group): :class:`SeqTables`.

One row per live sequence in a few flat numpy arrays and the block-table matrix::

    row_of   {seq_id: row}            seq_of[row], ns_of[row]: the sequence and its namespace
    ntok     tokens appended           ntok0  tokens at the last take_copy_plan (-1: allocated since)
    nblk     table length              nrel   leading positions released by the sliding window
    nreg     leading blocks offered to the prefix cache; pend: blocks pend..nreg-1 cached by the row's last call
    ccid     chain: content id of block nreg-1 (a root's before block 0; 0: broken); ckey: its key
    swapped  the row's blocks are CPU block ids
    table    int32 (rows, width), NULL_BLOCK padded; table[row, :nblk[row]] is the sequence's block table

Rows are recycled through a free list; the arrays double when full (so a part reads them through this object,
``tables.ntok``, never keeps an array across calls) and the table widens on demand. ``views()`` are memoryviews
of the same arrays for the plain-Python paths (:mod:`pagedkv.manager._small`), rebuilt after a reallocation. Every
other part of the manager reads and writes rows through this object; it depends on nothing but numpy.
"""

from __future__ import annotations

from typing import Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from .._checks import check_int as _check_int
from ..errors import DuplicateSequenceError, InvalidArgumentError, SequenceStateError, UnknownSequenceError
from ..types import NULL_BLOCK

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I64.flags.writeable = False  # (shared: empty results and the empty batch's rows)

_ARRAYS = ("ntok", "ntok0", "nblk", "nrel", "nreg", "pend", "swapped", "ccid", "ckey")


class SmallMemo(NamedTuple):
    """The plain-Python paths' batch memo (:meth:`SeqTables.small_rows`), made when the batch changes."""

    ids: list  #: the very list object that is ``memo_ids``
    rows: list  #: its validated rows


class RowViews:
    """Memoryviews of one manager's row arrays (:meth:`SeqTables.views`) for the plain-Python paths, read by name
    (``v.table``). A slotted object, not a tuple: an attribute read costs what a tuple's unpacking did (a
    NamedTuple's unpacking takes the generic path, 3x slower), and no caller depends on the order."""

    __slots__ = ("ntok", "nblk", "table", "swapped", "ref", "nreg", "pend", "nrel", "ccid", "ckey", "flat", "cols")

    def __init__(self, t: "SeqTables") -> None:
        self.ntok = memoryview(t.ntok)  # tokens appended, per row
        self.nblk = memoryview(t.nblk)  # table length
        self.table = memoryview(t.table)  # the block-table matrix (rows, width), int32
        self.swapped = memoryview(t.swapped)  # the row's blocks are CPU block ids
        self.ref = t.ref_mv  # the GPU pool's refcounts (BlockPool.ref_mv)
        self.nreg = memoryview(t.nreg)  # leading blocks offered to the prefix cache
        self.pend = memoryview(t.pend)  # blocks pend..nreg-1 cached by the row's last call
        self.nrel = memoryview(t.nrel)  # leading blocks released by the sliding window
        self.ccid = memoryview(t.ccid)  # chain: content id of block nreg-1
        self.ckey = memoryview(t.ckey)  # chain: its key
        self.flat = memoryview(t.table.reshape(-1))  # the table, flat (rows * width)
        self.cols: int = t.table.shape[1]  # the table's width


class SeqTables:
    """seq_id -> row, the row arrays and the block-table matrix of one manager (see the module docstring).

    Attributes are the part's documented state (read and written by the other parts of the manager):
    ``row_of``, ``seq_of``, ``ns_of``, ``free_rows``, ``loading`` and ``parked`` (external KV), ``partial`` (seq_id -> prompt length of a sequence
    allocated a chunk of its prompt), the row arrays, ``table``, the batch memo (``memo_ids`` / ``memo_rows`` /
    ``memo_small``), ``mvs`` (memoryviews or None) and the step snapshot (``stepping``, ``ntok0``)."""

    def __init__(self, ref_mv: memoryview, width: int = 4) -> None:
        self.ref_mv = ref_mv  # the GPU pool's refcounts (a view of BlockPool.ref), for views()
        self.stepping = False  # take_copy_plan has been called: steps are known, the same-step checks are on
        self.snap = None  # (ntok0 view, ntok view, the ntok array they view) for end_step's snapshot
        self.row_of: dict[Hashable, int] = {}
        self.seq_of: list[Hashable | None] = []
        self.ns_of: list[object] = []  # namespace of each row (for KV events)
        self.free_rows: list[int] = []
        self.ntok = np.zeros(0, dtype=np.int64)  # tokens appended
        self.ntok0 = np.zeros(0, dtype=np.int64)  # tokens at the last take_copy_plan (-1: allocated since)
        self.nblk = np.zeros(0, dtype=np.int64)  # table length (incl. released and lookahead-only blocks)
        self.nrel = np.zeros(0, dtype=np.int64)  # leading blocks released by the sliding window
        self.nreg = np.zeros(0, dtype=np.int64)  # leading blocks already offered to the prefix cache
        self.pend = np.zeros(0, dtype=np.int64)  # blocks pend..nreg-1 were cached by the row's last call
        self.ccid = np.zeros(0, dtype=np.int64)  # chain: cid of block nreg-1 (a root's before block 0), 0: broken
        self.ckey = np.zeros(0, dtype=np.uint64)  # chain: key of that content
        self.swapped = np.zeros(0, dtype=bool)
        self.partial: dict = {}  # seq_id -> prompt length, for sequences allocated a chunk of their prompt
        # external KV (manager/_external.py): LOADING sequences (seq_id -> row) are out of row_of, so that every
        # per-step path refuses them at no cost; PARKED ids (aborted while loading: seq_id -> the blocks a
        # transfer may still write) cannot be allocated again until finish_external reports them
        self.loading: dict = {}
        self.parked: dict = {}
        self.table = np.full((0, width), NULL_BLOCK, dtype=np.int32)
        # one-entry memo of the last batch: seq_ids list -> validated rows (memo_small: the same list, rows list)
        self.memo_ids: list | None = None
        self.memo_rows = _EMPTY_I64
        self.memo_small: SmallMemo | None = None
        self.mvs: RowViews | None = None

    def row(self, seq_id: Hashable) -> int:
        try:
            return self.row_of[seq_id]
        except KeyError:
            if self.loading and seq_id in self.loading:
                raise SequenceStateError(f"sequence {seq_id!r} is loading external KV; finish_external it (or "
                                         "free it) first") from None
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None

    def check_new_id(self, seq_id: Hashable) -> None:
        try:
            exists = seq_id in self.row_of
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None
        if exists:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        if (self.loading or self.parked) and (seq_id in self.loading or seq_id in self.parked):
            raise DuplicateSequenceError(f"sequence {seq_id!r} is loading external KV, or was aborted while loading "
                                         "and finish_external has not reported it yet")

    def check_new_ids(self, seq_ids: list) -> None:
        """:meth:`check_new_id` of every id of a batch, and DuplicateSequenceError for an id it gives twice. O(B)."""
        seen: set = set()
        for s in seq_ids:
            self.check_new_id(s)
            if s in seen:
                raise DuplicateSequenceError(f"sequence {s!r} appears twice in one batch")
            seen.add(s)

    def any_row(self, seq_id: Hashable) -> int:
        """The row of a live sequence, LOADING ones included (the read-only queries); UnknownSequenceError."""
        try:
            return self.row_of[seq_id]
        except (KeyError, TypeError):
            if self.loading:
                try:
                    return self.loading[seq_id]
                except (KeyError, TypeError):
                    pass
            return self.row(seq_id)

    def rows(self, seq_ids: Sequence[Hashable]) -> np.ndarray:
        """Validated rows of a batch of live, GPU-resident, distinct sequences (int64). The last batch is
        memoised: an engine that decodes the same running set step after step pays one list compare."""
        if type(seq_ids) is not list:
            seq_ids = list(seq_ids)
        if seq_ids == self.memo_ids:
            return self.memo_rows
        n = len(seq_ids)
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, seq_ids), dtype=np.int64, count=n) if n else _EMPTY_I64
        except (KeyError, TypeError):
            for s in seq_ids:
                self.row(s)
            raise  # pragma: no cover - row raised
        if n > 1 and not np.diff(np.sort(rows)).all():  # a repeated row (np.unique would be slower)
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise DuplicateSequenceError(f"sequence {dup!r} appears twice in one batch")
        if n and self.swapped[rows].any():
            s = seq_ids[int(np.flatnonzero(self.swapped[rows])[0])]
            raise SequenceStateError(f"sequence {s!r} is swapped out; swap it in before appending")
        rows.flags.writeable = False  # (handed out as StepDelta.table_rows)
        self.memo_ids, self.memo_rows = seq_ids.copy(), rows
        return rows

    def small_rows(self, seq_ids: list) -> list | None:
        """The rows of a batch of live, distinct, GPU-resident sequences, memoised (None: not so). The memo is
        :meth:`rows`'s: ``memo_small`` holds the very list object that is ``memo_ids``, so whatever drops or
        replaces that memo (a new or freed row, a swap) drops this one too."""
        row_of = self.row_of
        try:
            rows = [row_of[s] for s in seq_ids]
        except (KeyError, TypeError):
            return None
        if len(set(rows)) != len(rows):
            return None
        swapped = self.views().swapped
        for r in rows:
            if swapped[r]:
                return None
        ids = seq_ids.copy()
        memo_rows = np.array(rows, dtype=np.int64)
        memo_rows.flags.writeable = False  # (handed out as StepDelta.table_rows)
        self.memo_ids, self.memo_rows = ids, memo_rows
        self.memo_small = SmallMemo(ids, rows)
        return rows

    def rows_where(self, seq_ids: list, swapped: bool) -> np.ndarray:
        rows = np.array([self.row(s) for s in seq_ids], dtype=np.int64)
        if np.unique(rows).size != rows.size:
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise DuplicateSequenceError(f"sequence {dup!r} appears twice in one swap group")
        bad = np.flatnonzero(self.swapped[rows] != swapped)
        if bad.size:
            s = seq_ids[int(bad[0])]
            raise SequenceStateError(f"sequence {s!r} is {'not ' if swapped else 'already '}swapped out")
        return rows

    def views(self) -> RowViews:
        """Memoryviews of the row arrays (and of the GPU refcounts): :class:`RowViews`. Rebuilt after the row
        arrays or the table are reallocated (``mvs`` is reset to None then)."""
        mvs = self.mvs
        if mvs is None:
            mvs = self.mvs = RowViews(self)
        return mvs

    def new_row(self, seq_id: Hashable) -> int:
        if not self.free_rows:
            self.grow()
        row = self.free_rows.pop()
        self.row_of[seq_id] = row
        self.seq_of[row] = seq_id
        self.ns_of[row] = None
        self.memo_ids = None
        return row

    def drop_row(self, seq_id: Hashable, row: int) -> None:
        v = self.views()
        table, swapped, nrel, ccid = v.table, v.swapped, v.nrel, v.ccid
        nb = v.nblk[row]
        if nb <= 4:
            for c in range(nb):
                table[row, c] = NULL_BLOCK
        else:
            self.table[row, :nb] = NULL_BLOCK
        # allocate sets ntok, nblk, nreg, pend and the chain; fork copies every field: only these must be reset
        nrel[row] = ccid[row] = 0
        swapped[row] = False
        del self.row_of[seq_id]
        self.seq_of[row] = self.ns_of[row] = None
        self.free_rows.append(row)
        self.memo_ids = None

    def grow(self) -> None:
        old = len(self.seq_of)
        new = max(8, 2 * old)
        for name in _ARRAYS:
            a = getattr(self, name)
            b = np.zeros(new, dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        t = np.full((new, self.table.shape[1]), NULL_BLOCK, dtype=np.int32)
        t[:old] = self.table
        self.table = t
        self.mvs = None  # the plain-Python paths' memoryviews point at the old arrays
        self.seq_of.extend([None] * (new - old))
        self.ns_of.extend([None] * (new - old))
        self.free_rows.extend(range(new - 1, old - 1, -1))

    def ensure_cols(self, n: int) -> None:
        cols = self.table.shape[1]
        if n > cols:
            t = np.full((self.table.shape[0], max(n, 2 * cols)), NULL_BLOCK, dtype=np.int32)
            t[:, :cols] = self.table
            self.table = t
            self.mvs = None

    def unique_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Distinct non-null blocks of the rows, in order of first appearance (int64)."""
        parts = [self.table[r, self.nrel[r] : self.nblk[r]] for r in rows.tolist()]
        allb = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        allb = allb[allb >= 0]
        _, first = np.unique(allb, return_index=True)
        return allb[np.sort(first)].astype(np.int64)

    def end_step(self) -> None:
        """The rows' side of ending a step: snapshot the token counts, switch the same-step checks on."""
        dst, src, arr = self.snap or (None, None, None)
        if arr is not self.ntok:  # (the row arrays were reallocated)
            dst, src, arr = self.snap = (memoryview(self.ntok0), memoryview(self.ntok), self.ntok)
        dst[:] = src  # the token counts at the step's end (a C-level copy)
        self.stepping = True


_ZERO = 0  # (CPython keeps one object for every int 0: ``group is _ZERO`` is the one-group fast test)


class Views:
    """BlockManager's read-only views of its sequences (a base class of the facade), over its ``_t``
    (SeqTables) and ``_bs``; ``_check_group`` refuses a group other than 0."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._t.row_of) + len(self._t.loading)

    def __contains__(self, seq_id: object) -> bool:
        try:
            return seq_id in self._t.row_of or seq_id in self._t.loading
        except TypeError:
            return False

    @property
    def seq_ids(self) -> tuple:
        """Live sequence ids (LOADING ones included): in allocation order, except that a sequence whose load
        finished comes after the others."""
        return tuple(self._t.row_of) + tuple(self._t.loading)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens appended to the sequence (prompt plus every appended token; a LOADING one's held prompt)."""
        return int(self._t.ntok[self._t.any_row(seq_id)])

    def is_swapped(self, seq_id: Hashable) -> bool:
        return bool(self._t.swapped[self._t.any_row(seq_id)])

    def block_table(self, seq_id: Hashable, group: int = 0) -> np.ndarray:
        """The sequence's block table: a read-only int32 copy, one entry per block of
        ``ceil((num_tokens + reserved lookahead) / block_size)``, NULL_BLOCK where the sliding window released the
        block. While the sequence is swapped out the ids are CPU block ids. ``group`` must be 0 (the one KV cache
        group; the argument is :meth:`HybridBlockManager.block_table`'s). O(table length)."""
        row = self._t.any_row(seq_id)
        if group is not _ZERO:  # (the common case in one identity test; anything else is checked)
            self._check_group(group)
        t = self._t.table[row, : self._t.nblk[row]].copy()
        t.flags.writeable = False
        return t

    def table_rows(self, seq_ids: Iterable[Hashable]) -> np.ndarray:
        """The table row of each sequence (read-only int64 (B,)): the row of :class:`StepDelta`'s
        ``table_rows`` and ``table_updates``, for an engine that keeps its own block tables (one row per
        sequence). A sequence keeps its row from ``allocate`` / ``fork`` to ``free``, swapped out or not; a
        freed row is given to a later sequence. Rows are small ints (below the most sequences live at once,
        rounded up to a power of two, at least 8). Swapped-out sequences are allowed. O(B)."""
        rows = np.array([self._t.any_row(s) for s in seq_ids], dtype=np.int64)
        rows.flags.writeable = False
        return rows

    def slot_mapping(self, seq_id: Hashable, start: int, end: int, group: int = 0) -> np.ndarray:
        """Physical slots (``block * block_size + offset``) of token positions ``[start, end)`` (int64).

        Positions up to the reserved lookahead slots are allowed. Raises SequenceStateError for a swapped-out
        sequence or for positions released by the sliding window. ``group`` must be 0 (as for
        :meth:`block_table`). O(end - start)."""
        row = self._t.any_row(seq_id)
        if group is not _ZERO:  # (the common case in one identity test; anything else is checked)
            self._check_group(group)
        start = _check_int("start", start, 0)
        end = _check_int("end", end, start)
        cap = int(self._t.nblk[row]) * self._bs
        if end > cap:
            raise InvalidArgumentError(f"slot range [{start}, {end}) exceeds the {cap} slots of sequence {seq_id!r}")
        if self._t.swapped[row]:
            raise SequenceStateError(f"sequence {seq_id!r} is swapped out; it has no GPU slots")
        pos = np.arange(start, end, dtype=np.int64)
        blocks = self._t.table[row, pos // self._bs].astype(np.int64)
        if blocks.size and blocks.min() < 0:
            raise SequenceStateError(f"positions [{start}, {end}) of {seq_id!r} include blocks released by the window")
        return blocks * self._bs + pos % self._bs
