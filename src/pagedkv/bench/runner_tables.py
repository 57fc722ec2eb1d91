"""The engine-facing arrays of a decode step, built from an anchor's block-manager output as its model runner does.

pagedkv's ``decode_step`` returns, besides doing the bookkeeping, the three arrays the attention kernel reads:
the slot of each new token, the block tables padded into one matrix, and the sequence lengths. The anchors'
block managers stop earlier: their engines build those arrays in the model runner, from the block tables the
scheduler hands over. To compare like with like, the sweep (:mod:`pagedkv.bench.sweep`) times an anchor's step
as its adapter's ``decode_step`` (the scheduler's block-manager calls) plus one of the builders below, which
produce the same three numpy arrays pagedkv returns (``slot_mapping`` int64, ``block_tables`` int32 padded with
-1, ``seq_lens`` int32), the way each engine builds them on the CPU (the transfer to the device is left out):

``ListTables`` (nano-vllm, vLLM v2)
    The scheduler hands over each sequence's full block-id list. The runner loops over the batch in Python: the
    new token's slot is ``table[pos // block_size] * block_size + pos % block_size`` with ``pos = len - 1``,
    each table is padded to the longest one with -1, and the lists become arrays (nano-vllm's
    ``prepare_decode`` / ``prepare_block_tables``, vLLM 0.6.3's ``_prepare_decode`` with ``make_tensor_with_pad``).
``PersistentTables`` (vLLM V1)
    V1's workers keep a persistent block-table matrix per request and receive only the block ids allocated in
    the step. The runner appends them to the request's row, then computes the slots vectorised from the matrix
    (``slot = table[row, pos // block_size] * block_size + pos % block_size``) and hands the matrix's rows to
    the kernel (V1's ``BlockTable`` / ``_prepare_inputs``, numpy on the CPU).

``GroupTables`` (vLLM V1 with KV cache groups)
    One ``PersistentTables`` per group (V1's ``MultiGroupBlockTable``): each group's new block ids go to its
    own matrix, and the slots are computed per group, giving the ``(G, B)`` slot mapping and the tuple of G
    tables a hybrid step of :class:`pagedkv.HybridBlockManager` returns.

``V1BlockRows`` (vLLM V1 as it ships, what the side-by-side benchmarks charge V1 with)
    What V1's runner does on the CPU per decode step: for each request that got new blocks, append the ids to
    its row of the CPU block-table matrix, per group (``BlockTable.append_row``: a counter and a slice
    assignment). Nothing else: V1 computes the slot mapping on the GPU (a Triton kernel,
    ``vllm/v1/worker/block_table.py``, ``compute_slot_mapping``) from the matrix copied there, and hands the
    kernel the matrix's rows, so no slot mapping, padded table or length array is built on the CPU.

These are this project's own restatements of what those runners compute, not their code.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["GroupTables", "ListTables", "PersistentTables", "V1BlockRows"]


class ListTables:
    """Slot mapping, padded block tables and lengths from full per-sequence block-id lists (a Python loop)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build(self, tables: Sequence[Sequence[int]], lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        bs = self.block_size
        slots = []
        width = 0
        for t, n in zip(tables, lens):
            p = n - 1
            slots.append(t[p // bs] * bs + p % bs)
            if len(t) > width:
                width = len(t)
        padded = [list(t) + [-1] * (width - len(t)) for t in tables]
        return (np.array(slots, dtype=np.int64), np.array(padded, dtype=np.int32).reshape(len(padded), width),
                np.array(lens, dtype=np.int32))


class PersistentTables:
    """A persistent block-table matrix fed with per-step deltas (new block ids per request, or None)."""

    def __init__(self, block_size: int, num_rows: int, width: int = 16) -> None:
        self.block_size = block_size
        self.table = np.full((num_rows, width), -1, dtype=np.int32)
        self.nblk = np.zeros(num_rows, dtype=np.int64)

    def add_row(self, row: int, block_ids: Sequence[int]) -> None:
        """Untimed set-up: the blocks a request got at admission."""
        self._append(row, block_ids)

    def _append(self, row: int, ids: Sequence[int]) -> None:
        n = int(self.nblk[row])
        end = n + len(ids)
        if end > self.table.shape[1]:
            t = np.full((self.table.shape[0], max(end, 2 * self.table.shape[1])), -1, dtype=np.int32)
            t[:, : self.table.shape[1]] = self.table
            self.table = t
        self.table[row, n:end] = ids
        self.nblk[row] = end

    def build(self, rows: np.ndarray, deltas: Sequence[Any], lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``deltas[i]``: V1's ``get_block_ids(allow_none=True)`` for row ``rows[i]`` (a tuple of one id list per
        KV-cache group, or None when the request got no block)."""
        for row, d in zip(rows.tolist(), deltas):
            if d is not None and d[0]:
                self._append(row, d[0])
        bs = self.block_size
        seq_lens = np.array(lens, dtype=np.int32)
        pos = seq_lens.astype(np.int64) - 1
        slots = self.table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        width = int(self.nblk[rows].max()) if rows.size else 0
        return slots, self.table[rows, :width], seq_lens


class GroupTables:
    """One :class:`PersistentTables` per KV cache group, fed with V1's per-group deltas."""

    def __init__(self, block_size: int, num_rows: int, num_groups: int, width: int = 16) -> None:
        self.block_size = block_size
        self.groups = [PersistentTables(block_size, num_rows, width) for _ in range(num_groups)]

    def add_row(self, row: int, tables: Sequence[Sequence[int]]) -> None:
        """Untimed set-up: each group's blocks at admission (``tables[g]``)."""
        for t, ids in zip(self.groups, tables):
            t.add_row(row, ids)

    def build(self, rows: np.ndarray, deltas: Sequence[Any], lens: Sequence[int]) -> tuple[np.ndarray, tuple, np.ndarray]:
        """``deltas[i]``: V1's ``get_block_ids(allow_none=True)`` for row ``rows[i]`` (a tuple of one id list
        per group, or None). Returns the ``(G, B)`` slot mapping, the G tables and the lengths."""
        for row, d in zip(rows.tolist(), deltas):
            if d is not None:
                for t, ids in zip(self.groups, d):
                    if ids:
                        t._append(row, ids)
        bs = self.block_size
        seq_lens = np.array(lens, dtype=np.int32)
        pos = seq_lens.astype(np.int64) - 1
        blk, off = pos // bs, pos % bs
        slots = np.empty((len(self.groups), rows.size), dtype=np.int64)
        tables = []
        for g, t in enumerate(self.groups):
            slots[g] = t.table[rows, blk].astype(np.int64) * bs + off
            width = int(t.nblk[rows].max()) if rows.size else 0
            tables.append(t.table[rows, :width])
        return slots, tuple(tables), seq_lens


class V1BlockRows:
    """V1's CPU block-table rows fed with per-step deltas; :meth:`append` is all V1's runner does per step on
    the CPU for the KV cache (no slot mapping: V1 computes it on the GPU). One int32 matrix and a row counter
    per group; O(1) per request plus O(new ids)."""

    def __init__(self, num_rows: int, num_groups: int, width: int = 16) -> None:
        self.tables = [np.zeros((num_rows, width), dtype=np.int32) for _ in range(num_groups)]
        self.num_blocks = [np.zeros(num_rows, dtype=np.int32) for _ in range(num_groups)]

    def add_row(self, row: int, tables: Sequence[Sequence[int]]) -> None:
        """Untimed set-up: each group's blocks at admission (``tables[g]``)."""
        for g, ids in enumerate(tables):
            self.num_blocks[g][row] = 0
            self._put(g, row, ids)

    def _put(self, g: int, row: int, ids: Sequence[int]) -> None:
        n = int(self.num_blocks[g][row])
        end = n + len(ids)
        t = self.tables[g]
        if end > t.shape[1]:  # V1 sizes the matrix for max_model_len up front; here it grows (untimed in practice)
            wide = np.zeros((t.shape[0], max(end, 2 * t.shape[1])), dtype=np.int32)
            wide[:, : t.shape[1]] = t
            self.tables[g] = t = wide
        self.num_blocks[g][row] = end
        t[row, n:end] = ids

    def append(self, deltas: Sequence[Any]) -> None:
        """``deltas[i]``: V1's ``get_block_ids(allow_none=True)`` for row i (one id list per group, or None)."""
        for row, d in enumerate(deltas):
            if d is not None:
                for g, ids in enumerate(d):
                    if ids:
                        self._put(g, row, ids)

    def row(self, row: int, group: int = 0) -> list[int]:
        return self.tables[group][row, : int(self.num_blocks[group][row])].tolist()
