"""The scheduler's settings (:class:`Config`): checked once when the :class:`~pagedkv.scheduler.Scheduler` is built,
then read by its parts at every step (a change through the scheduler's attributes applies from the next step on).
"""

from __future__ import annotations

from typing import Any

from ..manager.parts import ManagerConfig


class Config:
    """The scheduler's settings (the public attributes of :class:`~pagedkv.scheduler.Scheduler`, which reads and
    writes them here; the parts read them at every step, so a change applies from the next step on)."""

    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "preemption_mode", "num_lookahead_slots",
                 "precheck_append", "incremental_tables", "enable_chunked_prefill", "long_prefill_token_threshold")

    def __init__(self, block_manager: Any, max_num_seqs: int, max_num_batched_tokens: int, preemption_mode: str,
                 num_lookahead_slots: int, precheck_append: bool | None, incremental_tables: bool,
                 enable_chunked_prefill: bool, long_prefill_token_threshold: int, scheduling_policy: str) -> None:
        """The settings the Scheduler was given, checked (ValueError). ``precheck_append`` None: False when the
        block manager declares ``atomic_append = True``, else True."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {num_lookahead_slots}")
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        if precheck_append is None:
            # pagedkv's BlockManager (its ``config`` a ManagerConfig) appends all or nothing; another manager says so
            precheck_append = not (isinstance(getattr(block_manager, "config", None), ManagerConfig)
                                   or getattr(block_manager, "atomic_append", False))
        if incremental_tables and getattr(block_manager, "table_rows", None) is None:
            raise ValueError("incremental_tables needs a block manager with table_rows (decode_step(..., "
                             "block_tables=False)), such as pagedkv.BlockManager")
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.preemption_mode = preemption_mode
        self.num_lookahead_slots = int(num_lookahead_slots)
        self.precheck_append = bool(precheck_append)
        self.incremental_tables = bool(incremental_tables)
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.long_prefill_token_threshold = int(long_prefill_token_threshold)


def bm_setting(bm: Any, name: str, default: Any) -> Any:
    """A manager setting: ``bm.config.<name>`` on pagedkv's BlockManager (its ``config`` a ManagerConfig), else the
    attribute of that name on another BlockManager-like object (the benchmarks' anchors), else ``default``."""
    cfg = getattr(bm, "config", None)
    return getattr(cfg, name) if isinstance(cfg, ManagerConfig) else getattr(bm, name, default)
