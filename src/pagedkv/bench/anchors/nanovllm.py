"""Anchor: nano-vllm's ``nanovllm.engine.block_manager.BlockManager`` (PyPI package ``nano-vllm-fork``).

Loading.  ``nanovllm/__init__.py`` imports the LLM class and with it torch, transformers and the model
code; the block manager needs only ``nanovllm.engine.sequence`` and ``nanovllm.sampling_params``
(plain dataclasses), numpy and xxhash.  This module registers ``nanovllm`` and ``nanovllm.engine`` as
bare packages (``__init__`` skipped) so the two engine modules load unchanged without torch.

nano-vllm's ``Config`` insists on a KV block size that is a multiple of 256; its ``BlockManager``
itself works with any size, and the adapter uses it directly with the benchmark's block size.
``Sequence.block_size`` is a class attribute that nano-vllm's engine sets globally; the adapter uses a
subclass per block size instead.

Per decode step, the block-manager calls of nano-vllm's ``Scheduler.schedule()`` decode branch,
exactly what :meth:`NanoVllmAnchor.decode_step` times: per sequence [``can_append(seq)`` only with
``check_in_step``; the benchmark calls the adapter's batched ``can_append_slots`` itself] then
``may_append(seq)``, and the model runner reading ``seq.block_table`` (``prepare_block_tables``; the
adapter collects the live lists and does not pad them).

Engine-side work done untimed in :meth:`NanoVllmAnchor.prepare_step`: ``Sequence.append_token`` (as
``Scheduler.postprocess``).

What it lacks: prefix caching cannot be turned off (every full block is hashed and registered); in
this fork a block's cache entry is dropped as soon as its last user frees it, so prefixes are shared
only between sequences alive at the same time; no fork, swap, lookahead, sliding window, watermark or
eviction order.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from ._base import AllocStatus, AnchorAdapter, AnchorOutOfBlocks, AnchorStep, token_rows
from ._shim import bare_package, package_dir

__all__ = ["NanoVllmAnchor", "NANOVLLM_VERSION"]


def _load() -> tuple[Any, Any, Any]:
    root = package_dir("nanovllm")
    if root is None:
        raise ImportError("nanovllm (PyPI package nano-vllm-fork) is not installed")
    bare_package("nanovllm", root)
    bare_package("nanovllm.engine", root)
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence, SequenceStatus

    return BlockManager, Sequence, SequenceStatus


BlockManager, Sequence, SequenceStatus = _load()

try:
    from importlib.metadata import version as _dist_version

    NANOVLLM_VERSION = _dist_version("nano-vllm-fork")
except Exception:  # pragma: no cover
    NANOVLLM_VERSION = "unknown"

_SEQ_CLASSES: dict[int, type] = {}


def _sequence_class(block_size: int) -> type:
    cls = _SEQ_CLASSES.get(block_size)
    if cls is None:
        cls = type(f"Sequence{block_size}", (Sequence,), {"block_size": block_size, "__module__": __name__})
        _SEQ_CLASSES[block_size] = cls
    return cls


class NanoVllmAnchor(AnchorAdapter):
    """nano-vllm BlockManager behind the pagedkv BlockManager subset (see the module docstring)."""

    name = f"nano-vllm {NANOVLLM_VERSION}"
    supports = frozenset({"prefix_caching"})
    missing = (
        "prefix caching cannot be disabled and only spans sequences alive together; no fork, swap, "
        "lookahead, sliding window, watermark or eviction order; one token per sequence per step"
    )

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
        if num_cpu_blocks:
            raise NotImplementedError("nano-vllm has no CPU swap space")
        if sliding_window is not None:
            raise NotImplementedError("nano-vllm has no sliding-window attention")
        # enable_prefix_caching is accepted either way: nano-vllm always caches.  watermark is ignored:
        # nano-vllm admits a prompt whenever its blocks fit.
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.bm = BlockManager(num_gpu_blocks, block_size)
        self._Seq = _sequence_class(block_size)
        self._seqs: dict[int, Any] = {}
        self._key: Any = None
        self._batch: list[Any] = []
        self._prepared = False
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._allocations = 0

    def _no_lookahead(self, k: int) -> None:
        if k:
            raise self._lacks("lookahead")

    # -- admission ------------------------------------------------------------------------------------
    def can_allocate(self, token_ids: Seq[int], num_lookahead_slots: int = 0, *, namespace: object = None) -> AllocStatus:
        """nano-vllm's rule (``len(free_block_ids) >= seq.num_blocks``) plus NEVER for oversize prompts."""
        self._no_namespace(namespace)
        self._no_lookahead(num_lookahead_slots)
        need = -(-len(token_ids) // self.block_size)
        if need > self.num_gpu_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if len(self.bm.free_block_ids) >= need else AllocStatus.LATER

    def allocate(self, seq_id: int, token_ids: Seq[int], *, namespace: object = None) -> int:
        self._no_namespace(namespace)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already allocated")
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids]
        seq = self._Seq(tokens)
        if not self.bm.can_allocate(seq):
            raise AnchorOutOfBlocks(f"{self.name}: no room for a {len(tokens)}-token prompt")
        self.bm.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self._seqs[seq_id] = seq
        self._prompt_tokens += len(tokens)
        self._hit_tokens += seq.num_cached_tokens
        self._allocations += 1
        return seq.num_cached_tokens

    # -- decode ---------------------------------------------------------------------------------------
    def can_append_slots(self, seq_ids: Seq[int], num_lookahead_slots: int = 0, *, num_new_tokens: int = 1) -> bool:
        """Batched form of nano-vllm's ``can_append``; before ``prepare_step`` one new token is assumed."""
        self._no_lookahead(num_lookahead_slots)
        if num_new_tokens != 1:
            raise self._lacks("more than one token per sequence per step")
        bs = self.block_size
        boundary = 1 if self._prepared else 0  # nano-vllm: a new block when len(seq) % bs == 1
        need = 0
        for sid in seq_ids:
            if len(self._seqs[sid]) % bs == boundary:
                need += 1
        return need <= len(self.bm.free_block_ids)

    def prepare_step(self, seq_ids: Seq[int], token_ids: Any) -> None:
        """Untimed: ``Sequence.append_token`` for each sequence (nano-vllm's ``Scheduler.postprocess``)."""
        rows = token_rows(token_ids)
        if len(rows) != len(seq_ids):
            raise ValueError("seq_ids and token_ids differ in length")
        batch = []
        for sid, row in zip(seq_ids, rows):
            if len(row) != 1:
                raise self._lacks("more than one token per sequence per step")
            seq = self._seqs[sid]
            seq.append_token(row[0])
            batch.append(seq)
        self._batch = batch
        self._key = seq_ids
        self._prepared = True

    def decode_step(self, seq_ids: Seq[int], token_ids: Any = None, num_lookahead_slots: int = 0, *,
                    num_new_tokens: Any = None) -> AnchorStep:
        """Timed: nano-vllm's scheduler block-manager calls for one decode step of the batch."""
        self._no_lookahead(num_lookahead_slots)
        seqs = self._batch if seq_ids is self._key else [self._seqs[s] for s in seq_ids]
        bm = self.bm
        may_append = bm.may_append
        tables: list[Any] = []
        if self.check_in_step:
            can_append = bm.can_append
            for seq in seqs:
                if not can_append(seq):
                    self._prepared = False
                    raise AnchorOutOfBlocks(f"{self.name}: no room to append")
                may_append(seq)
                tables.append(seq.block_table)
        else:
            for seq in seqs:
                may_append(seq)
                tables.append(seq.block_table)
        self._prepared = False
        return AnchorStep(tables, [])

    def free(self, seq_id: int, *, cache: bool = True) -> None:
        seq = self._seqs.pop(seq_id)
        seq.status = SequenceStatus.FINISHED
        self.bm.deallocate(seq)

    # -- introspection ----------------------------------------------------------------------------------
    @property
    def num_free_gpu_blocks(self) -> int:
        return len(self.bm.free_block_ids)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].block_table)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seqs[seq_id])

