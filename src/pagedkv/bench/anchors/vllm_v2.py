"""Anchor: vLLM 0.6.3.post1's block manager v2, ``vllm.core.block_manager.SelfAttnBlockSpaceManager``.

Loading.  ``import vllm`` would import the engine, the OpenAI server and the model registry (and with
them transformers); the block manager needs none of it.  This module registers ``vllm`` and
``vllm.inputs`` as bare packages (their ``__init__`` is skipped, their submodules load unchanged from
the installed wheel) and stubs ``vllm.spec_decode.metrics``, whose only name used by ``vllm.sequence``
(``SpecDecodeWorkerMetrics``) is a type annotation but whose imports reach into the model executor.
Everything else (``vllm.sequence``, ``vllm.utils``, ``vllm.core.*``) is vLLM's own code.

One vLLM ``SequenceGroup`` of one ``Sequence`` per allocated request; ``fork`` adds the child to the
parent's group (as vLLM's parallel sampling / beam search does), so swap works per group.

Per decode step, the block-manager calls vLLM 0.6.3's ``Scheduler`` makes for a running decode batch
(``_schedule_running`` -> ``_append_slots``, then ``schedule()`` building the metadata), which is
exactly what :meth:`VllmV2Anchor.decode_step` times:

1. per sequence group: [``can_append_slots(seq_group, num_lookahead_slots)`` only with
   ``check_in_step``; the benchmark calls the adapter's batched ``can_append_slots`` itself], then
   ``append_slots(seq, num_lookahead_slots)`` for each of its running sequences (CoW pairs collected);
2. ``now = time.time()`` once, then per group, per running sequence ``get_block_table(seq)`` and
   ``access_all_blocks_in_seq(seq, now)``; with prefix caching also
   ``get_common_computed_block_ids(seqs)`` per group;
3. per group ``mark_blocks_as_computed(seq_group, token_chunk_size=1)``.

Engine-side work done untimed in :meth:`VllmV2Anchor.prepare_step`: ``SequenceData``'s computed-token
count is advanced over the tokens the previous forward computed and the new token is appended with
``Sequence.append_token_id`` (vLLM's output processor does both).

Not reproduced: the scheduler's own per-group overhead outside the block manager (budgets, queues,
``SequenceGroupMetadata`` building), and async output processing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as Seq
from typing import Any

from ._base import AllocStatus, AnchorAdapter, AnchorOutOfBlocks, AnchorStep, token_rows
from ._shim import bare_package, package_dir, stub_module

__all__ = ["VllmV2Anchor", "VLLM_VERSION"]


def _load() -> tuple[Any, ...]:
    root = package_dir("vllm")
    if root is None:
        raise ImportError("vllm is not installed")
    if not os.path.exists(os.path.join(root, "core", "block_manager.py")):
        raise ImportError(f"the vllm installed at {root} has no vllm/core/block_manager.py (the v2 anchor needs 0.6.x)")
    bare_package("vllm", root)
    bare_package("vllm.inputs", root)
    stub_module("vllm.spec_decode.metrics", ["SpecDecodeWorkerMetrics"])
    from vllm.core.block_manager import SelfAttnBlockSpaceManager
    from vllm.core.interfaces import AllocStatus as VAllocStatus
    from vllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
    from vllm.utils import Device

    return SelfAttnBlockSpaceManager, VAllocStatus, Logprob, Sequence, SequenceGroup, SequenceStatus, Device


(SelfAttnBlockSpaceManager, _VAllocStatus, Logprob, Sequence, SequenceGroup, SequenceStatus, Device) = _load()

try:
    from importlib.metadata import version as _dist_version

    VLLM_VERSION = _dist_version("vllm")
except Exception:  # pragma: no cover
    VLLM_VERSION = "unknown"

_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED
_STATUS = {s: AllocStatus[s.name] for s in _VAllocStatus}


class VllmV2Anchor(AnchorAdapter):
    """vLLM 0.6.3 block manager v2 behind the pagedkv BlockManager subset (see the module docstring)."""

    name = f"vllm-v2 {VLLM_VERSION}"
    supports = frozenset({"prefix_caching", "fork", "swap", "lookahead", "sliding_window", "eviction_order"})
    missing = (
        "prefix caching together with a sliding window (vLLM 0.6.3 refuses it); append_slots is not "
        "all-or-nothing across a batch (check can_append_slots first); swap works on whole sequence "
        "groups (a request and its forks) and re-sorts block ids per swapped block (quadratic)"
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
        if enable_prefix_caching and sliding_window is not None:
            raise NotImplementedError("vLLM 0.6.3 does not support prefix caching with a sliding window")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.bm = SelfAttnBlockSpaceManager(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            watermark=watermark,
            sliding_window=sliding_window,
            enable_caching=enable_prefix_caching,
        )
        self._seqs: dict[int, Any] = {}  # seq_id -> vllm Sequence
        self._group: dict[int, Any] = {}  # seq_id -> vllm SequenceGroup
        self._plan_key: Any = None
        self._plan: list[tuple[Any, list[Any]]] = []
        self._prompt_tokens = 0
        self._hit_tokens = 0
        self._allocations = 0

    # -- admission ------------------------------------------------------------------------------------
    def _new_group(self, seq_id: int, token_ids: Seq[int]) -> tuple[Any, Any]:
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids]
        seq = Sequence(seq_id, {"prompt_token_ids": tokens}, self.block_size)
        return seq, SequenceGroup(str(seq_id), [seq], arrival_time=time.time())

    def can_allocate(self, token_ids: Seq[int], num_lookahead_slots: int = 0, *, namespace: object = None) -> AllocStatus:
        self._no_namespace(namespace)
        _, group = self._new_group(-1, token_ids)
        return _STATUS[self.bm.can_allocate(group, num_lookahead_slots)]

    def allocate(self, seq_id: int, token_ids: Seq[int], *, namespace: object = None) -> int:
        """Admit a prompt: the block-manager calls of vLLM's prefill step; returns prefix-cache hit tokens."""
        self._no_namespace(namespace)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already allocated")
        seq, group = self._new_group(seq_id, token_ids)
        bm = self.bm
        bm.allocate(group)  # _allocate_and_set_running
        seq.status = _RUNNING
        # schedule() of the prefill step
        bm.get_block_table(seq)
        bm.access_all_blocks_in_seq(seq, time.time())
        hit = 0
        if self.enable_prefix_caching:
            hit = len(bm.get_common_computed_block_ids([seq])) * self.block_size
        bm.mark_blocks_as_computed(group, seq.get_len())
        self._seqs[seq_id] = seq
        self._group[seq_id] = group
        self._prompt_tokens += seq.get_len()
        self._hit_tokens += hit
        self._allocations += 1
        return hit

    # -- decode ---------------------------------------------------------------------------------------
    def can_append_slots(self, seq_ids: Seq[int], num_lookahead_slots: int = 0, *, num_new_tokens: int = 1) -> bool:
        """Whether the whole batch can append ``num_new_tokens`` each (once ``prepare_step`` has run: the
        tokens it appended) plus the lookahead.

        vLLM's own ``can_append_slots`` answers per group; this sums the same worst-case count
        (``BlockTable.get_num_blocks_touched_by_append_slots``) over the batch.
        """
        tables = self.bm.block_tables
        touched = 0
        assumed = [0] * num_new_tokens
        for sid in seq_ids:
            bt = tables[sid]
            unseen = bt.get_unseen_token_ids(self._seqs[sid].get_token_ids()) or assumed
            touched += bt.get_num_blocks_touched_by_append_slots(unseen, num_lookahead_slots)
        return touched <= self.bm.get_num_free_gpu_blocks()

    def _make_plan(self, seq_ids: Seq[int]) -> list[tuple[Any, list[Any]]]:
        by_group: dict[int, tuple[Any, list[Any]]] = {}
        for sid in seq_ids:
            seq = self._seqs[sid]
            if seq.status != _RUNNING:
                raise ValueError(f"sequence {sid} is not running (status {seq.status.name})")
            g = self._group[sid]
            entry = by_group.get(id(g))
            if entry is None:
                by_group[id(g)] = (g, [seq])
            else:
                entry[1].append(seq)
        return list(by_group.values())

    def prepare_step(self, seq_ids: Seq[int], token_ids: Any) -> None:
        """Untimed: what vLLM's engine does between two schedules (see the module docstring)."""
        rows = token_rows(token_ids)
        if len(rows) != len(seq_ids):
            raise ValueError("seq_ids and token_ids differ in length")
        for sid, row in zip(seq_ids, rows):
            seq = self._seqs[sid]
            data = seq.data
            pending = data.get_num_uncomputed_tokens()
            if pending:
                data.update_num_computed_tokens(pending)
            for tok in row:
                seq.append_token_id(tok, {tok: Logprob(0.0)})
        self._plan = self._make_plan(seq_ids)
        self._plan_key = seq_ids

    def decode_step(self, seq_ids: Seq[int], token_ids: Any = None, num_lookahead_slots: int = 0, *,
                    num_new_tokens: Any = None) -> AnchorStep:
        """Timed: the block-manager calls of vLLM 0.6.3's scheduler for one decode step of the batch."""
        plan = self._plan if seq_ids is self._plan_key else self._make_plan(seq_ids)
        bm = self.bm
        cow: list[tuple[int, int]] = []
        check = self.check_in_step
        for group, seqs in plan:
            if check and not bm.can_append_slots(group, num_lookahead_slots):
                raise AnchorOutOfBlocks(f"{self.name}: no room to append for request {group.request_id}")
            for seq in seqs:
                new_cows = bm.append_slots(seq, num_lookahead_slots)
                if new_cows:
                    cow.extend(new_cows)
        now = time.time()
        tables: list[Any] = []
        caching = self.enable_prefix_caching
        for group, seqs in plan:
            for seq in seqs:
                tables.append(bm.get_block_table(seq))
                bm.access_all_blocks_in_seq(seq, now)
            if caching:
                bm.get_common_computed_block_ids(seqs)
        for group, _ in plan:
            bm.mark_blocks_as_computed(group, 1)
        return AnchorStep(tables, cow)

    # -- release, fork, swap ----------------------------------------------------------------------------
    def free(self, seq_id: int, *, cache: bool = True) -> None:
        seq = self._seqs.pop(seq_id)
        group = self._group.pop(seq_id)
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.bm.free(seq)
        if len(group.seqs) > 1:
            group.remove(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """As vLLM's output processor: ``Sequence.fork`` (a deep copy), add it to the group, ``bm.fork``."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already exists")
        parent = self._seqs[parent_id]
        group = self._group[parent_id]
        child = parent.fork(child_id)
        group.add(child)
        self.bm.fork(parent, child)
        self._seqs[child_id] = child
        self._group[child_id] = group

    def _groups(self, seq_ids: Seq[int], status: Any) -> list[Any]:
        groups: dict[int, Any] = {}
        wanted = set(seq_ids)
        for sid in seq_ids:
            g = self._group[sid]
            groups[id(g)] = g
        for g in groups.values():
            members = {s.seq_id for s in g.get_seqs(status=status)}
            if not members <= wanted:
                raise ValueError(
                    f"vLLM swaps whole sequence groups: request {g.request_id} also has {sorted(members - wanted)}"
                )
        return list(groups.values())

    def can_swap_out(self, seq_ids: Seq[int]) -> bool:
        return all(self.bm.can_swap_out(g) for g in self._groups(seq_ids, _RUNNING))

    def swap_out(self, seq_ids: Seq[int]) -> list[tuple[int, int]]:
        """``(gpu_block, cpu_block)`` pairs; the groups' sequences become SWAPPED (as ``Scheduler._swap_out``)."""
        mapping: list[tuple[int, int]] = []
        for g in self._groups(seq_ids, _RUNNING):
            mapping.extend(self.bm.swap_out(g))
            for seq in g.get_seqs(status=_RUNNING):
                seq.status = _SWAPPED
        return mapping

    def can_swap_in(self, seq_ids: Seq[int], num_lookahead_slots: int = 0) -> AllocStatus:
        """Worst status over the groups (each group is checked alone, as vLLM's scheduler does)."""
        worst = AllocStatus.OK
        for g in self._groups(seq_ids, _SWAPPED):
            st = _STATUS[self.bm.can_swap_in(g, num_lookahead_slots)]
            if st is AllocStatus.NEVER:
                return st
            if st is AllocStatus.LATER:
                worst = st
        return worst

    def swap_in(self, seq_ids: Seq[int]) -> list[tuple[int, int]]:
        """``(cpu_block, gpu_block)`` pairs; the groups' sequences become RUNNING (as ``Scheduler._swap_in``)."""
        mapping: list[tuple[int, int]] = []
        for g in self._groups(seq_ids, _SWAPPED):
            mapping.extend(self.bm.swap_in(g))
            for seq in g.get_seqs(status=_SWAPPED):
                seq.status = _RUNNING
        return mapping

    # -- introspection ----------------------------------------------------------------------------------
    @property
    def num_free_gpu_blocks(self) -> int:
        return self.bm.get_num_free_gpu_blocks()

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.bm.get_num_free_cpu_blocks()

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.bm.get_block_table(self._seqs[seq_id]))

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].get_len()

    def is_swapped(self, seq_id: int) -> bool:
        return self._seqs[seq_id].status == _SWAPPED

    @property
    def num_gpu_blocks(self) -> int:
        return self.bm.num_total_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.bm.num_total_cpu_blocks

    @property
    def stats(self) -> dict[str, float]:
        out = dict(AnchorAdapter.stats.fget(self))
        if self.enable_prefix_caching:
            out["vllm_block_hit_rate"] = self.bm.get_prefix_cache_hit_rate(Device.GPU)
        return out
