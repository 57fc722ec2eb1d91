"""The variants of the decode-step ablation (:mod:`pagedkv.bench.ablation`) by name: pagedkv's own
:class:`~pagedkv.BlockManager` (``pagedkv``), the same with the engine-facing output gathered through the public
read-only API (``pagedkv-accessors``), and the pure-Python loops of :mod:`.ablation_pyloop`. Every variant has
``allocate``, ``fork``, ``free``, ``step(seq_ids, token_ids, tables)``, ``free_ids`` and ``refcounts``.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from pagedkv import NULL_BLOCK, BlockManager
from pagedkv.errors import InvalidTokensError

from .ablation_pyloop import PyAccessors, PyDict, PyList, PyObjects

__all__ = ["VARIANTS", "MODES", "APPEND_SKIP", "PagedKV", "PagedKVAccessors"]

MODES = ("step", "append")
APPEND_SKIP = frozenset({"pagedkv-accessors"})  # identical to pagedkv in append mode


class PagedKV:
    """The real BlockManager (baseline)."""

    name = "pagedkv"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.bm = BlockManager(num_blocks, block_size, watermark=0.0)
        self.block_size = block_size

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self.bm.allocate(seq_id, token_ids)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        self.bm.fork(parent, child)

    def free(self, seq_id: Hashable) -> None:
        self.bm.free(seq_id)

    def step(self, seq_ids: list, token_ids: np.ndarray, tables: bool = True):
        bm = self.bm
        if tables:
            return bm.decode_step(seq_ids, token_ids)
        # the bookkeeping alone: what decode_step does minus the batch tables (append_slots' path)
        rows = bm._t.rows(seq_ids)
        if len(token_ids) != rows.size:
            raise InvalidTokensError(f"got {len(token_ids)} tokens for a batch of {rows.size}")
        return bm._step.append(rows, np.ones(rows.size, dtype=np.int64), token_ids, 0, tables=False)

    def free_ids(self) -> list[int]:
        return self.bm._gpu.free_ids().tolist()

    def refcounts(self) -> list[int]:
        return self.bm._gpu.ref.tolist()


class _PublicReadsManager(BlockManager):
    """BlockManager whose decode_step builds the engine-facing output through the public read-only API."""

    def decode_step(self, seq_ids, token_ids, num_lookahead_slots=0):
        rows = self._t.rows(seq_ids)
        b = rows.size
        if len(token_ids) != b:
            raise InvalidTokensError(f"got {len(token_ids)} tokens for a batch of {b}")
        res = self._step.append(rows, np.ones(b, dtype=np.int64), token_ids, num_lookahead_slots, tables=False)
        tabs = [self.block_table(s) for s in seq_ids]  # public: read-only copy per sequence
        lens = np.fromiter((self.num_tokens(s) for s in seq_ids), dtype=np.int32, count=b)
        out = np.full((b, max(t.size for t in tabs)), NULL_BLOCK, dtype=np.int32)
        for i, t in enumerate(tabs):
            out[i, : t.size] = t
        return res._replace(block_tables=out, seq_lens=lens)


class PagedKVAccessors(PagedKV):
    """pagedkv's step with the batch tables and lengths gathered via ``block_table(seq_id)`` /
    ``num_tokens(seq_id)`` per sequence instead of one fancy index (see the module docstring)."""

    name = "pagedkv-accessors"

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.bm = _PublicReadsManager(num_blocks, block_size, watermark=0.0)
        self.block_size = block_size



VARIANTS: dict[str, type] = {
    "pagedkv": PagedKV,
    "pagedkv-accessors": PagedKVAccessors,
    "py-list": PyList,
    "py-dict": PyDict,
    "py-objects": PyObjects,
    "py-accessors": PyAccessors,
}
"""Variant name -> class, baseline first."""
