"""Per-sequence rows of the block manager: seq_id -> row, the row arrays, batch validation of seq ids.

One row per live sequence in a few numpy arrays (``_ntok``, ``_nblk``, ``_nrel``, ``_nreg``, ``_pend``, ``_ccid``,
``_ckey``, ``_swapped``) and the block-table matrix ``_table[row, :]`` (int32, NULL_BLOCK padded). Rows are
recycled through a free list; the arrays double when full.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from .errors import DuplicateSequenceError, InvalidArgumentError, SequenceStateError, UnknownSequenceError
from .types import NULL_BLOCK

_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_I64.flags.writeable = False  # (shared: empty results and the empty batch's rows)


class _Rows:
    """Mixin of :class:`pagedkv.BlockManager`: the sequence -> row bookkeeping."""

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
        rows.flags.writeable = False  # (handed out as StepDelta.table_rows)
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
        self._ns_of[row] = None
        self._memo_ids = None
        return row

    def _drop_row(self, seq_id: Hashable, row: int) -> None:
        ntok, nblk, table, swapped, _, nreg, pend, nrel, ccid, ckey = self._views()[:10]
        nb = nblk[row]
        if nb <= 4:
            for c in range(nb):
                table[row, c] = NULL_BLOCK
        else:
            self._table[row, :nb] = NULL_BLOCK
        # allocate sets ntok, nblk, nreg, pend and the chain; fork copies every field: only these must be reset
        nrel[row] = ccid[row] = 0
        swapped[row] = False
        del self._row_of[seq_id]
        self._seq_of[row] = self._ns_of[row] = None
        self._free_rows.append(row)
        self._memo_ids = None

    def _grow_rows(self) -> None:
        old = len(self._seq_of)
        new = max(8, 2 * old)
        for name in ("_ntok", "_ntok0", "_nblk", "_nrel", "_nreg", "_pend", "_swapped", "_ccid", "_ckey"):
            a = getattr(self, name)
            b = np.zeros(new, dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        t = np.full((new, self._table.shape[1]), NULL_BLOCK, dtype=np.int32)
        t[:old] = self._table
        self._table = t
        self._mvs = None  # the plain-Python paths' memoryviews point at the old arrays
        self._seq_of.extend([None] * (new - old))
        self._ns_of.extend([None] * (new - old))
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _ensure_cols(self, n: int) -> None:
        cols = self._table.shape[1]
        if n > cols:
            t = np.full((self._table.shape[0], max(n, 2 * cols)), NULL_BLOCK, dtype=np.int32)
            t[:, :cols] = self._table
            self._table = t
            self._mvs = None

