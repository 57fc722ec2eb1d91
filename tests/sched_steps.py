"""Shared set-up of the scheduler tests on the external-KV contract (test_scheduler_kv_wait.py,
test_scheduler_kv_reserve.py): a Scheduler over a prefix-caching BlockManager with blocks of ``BS`` tokens, and
one engine step without a model (every sampled token 7), the manager's invariants checked after it."""

from __future__ import annotations

from pagedkv import BlockManager
from pagedkv.scheduler import Scheduler

BS = 4


def make(chunked: bool = True, budget: int = 64, blocks: int = 64) -> Scheduler:
    """A Scheduler of up to 8 sequences and ``budget`` tokens a step (chunked prefill or not, incremental tables)
    over a BlockManager of ``blocks`` blocks of ``BS`` tokens with prefix caching."""
    bm = BlockManager(blocks, BS, enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                     incremental_tables=True)


def sampled(plan) -> list:
    """Token 7 for every sequence that samples in the plan (each prefill's, then the decode batch's)."""
    return [7] * len(plan.prefills) + ([7] * len(plan.decode.seq_ids) if plan.decode is not None else [])


def step(s: Scheduler):
    """schedule(), update() with :func:`sampled`, then ``check_invariants()``; returns (plan, finished)."""
    plan = s.schedule()
    done = s.update(plan, sampled(plan))
    s.bm.check_invariants()
    return plan, done
