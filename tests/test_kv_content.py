"""The KV-content model (tests/kv_model.py) at CI size: many small managers, every feature, several calls per
step, the step's copies executed as one ordered plan; every live sequence reads back exactly its own KV after
every step. Longer runs: ``python scripts/soak_kv.py --steps 1000000``."""

from __future__ import annotations

import os
import random

import pytest

import kv_model

SEEDS = int(os.environ.get("PAGEDKV_KV_SEEDS", "80"))
STEPS = int(os.environ.get("PAGEDKV_KV_STEPS", "300"))


@pytest.mark.parametrize("chunk", range(4))
def test_every_sequence_reads_its_own_kv_after_every_step(chunk):
    total = {}
    for seed in range(chunk, SEEDS, 4):
        r = kv_model.run(seed, STEPS)
        assert r.violations == 0, f"seed {seed}: {r.violations} violations, first: {r.messages[:3]}"
        for k, v in r.counts.items():
            total[k] = total.get(k, 0) + v
    # the run exercised what it is meant to (bursts share prefixes, copies of every kind happen, aborts refused)
    for what in ("admits", "decodes", "swap_outs", "swap_ins", "cow", "aborts", "forks", "copies", "hit_tokens",
                 "event_overflows", "refusals_ok", "swap_out_refused_pending", "chunked_admits", "prefill_chunks",
                 "prefill_last_chunks", "recomputes_mid_prefill", "fork_refused_mid_prefill"):
        assert total.get(what, 0) > 0, (what, total)


def test_the_model_catches_the_old_documented_order():
    """Executing the same calls' copies kind after kind (the tier's demotions and promotions, then swap-out,
    swap-in, copy-on-write: the order documented before the copy plan) corrupts KV, and the model sees it."""
    bad = 0
    for seed in range(12):
        cfg = kv_model.Config.draw(random.Random(seed))
        if cfg.tier:
            bad += kv_model.run(seed, 150, order="documented").violations
    assert bad > 0


def test_every_configuration_axis_is_drawn():
    cfgs = [kv_model.Config.draw(random.Random(s)) for s in range(SEEDS)]
    assert any(c.tier for c in cfgs) and any(not c.prefix for c in cfgs)
    assert any(c.window for c in cfgs) and any(c.lookahead for c in cfgs) and any(c.events for c in cfgs)
    assert any(c.chunked for c in cfgs) and any(not c.chunked for c in cfgs)
    assert any(c.window and c.pin_budget for c in cfgs)  # pins with a sliding window
    hyb = [kv_model.Config.draw_hybrid(random.Random(s)) for s in range(HYBRID_SEEDS)]
    assert {c.policy for c in hyb} == {"lru", "slru", "session", "arc"} and any(c.pin_budget for c in hyb)
    assert any(c.retention and c.pin_budget for c in hyb) and any(not c.retention and c.pin_budget for c in hyb)


HYBRID_SEEDS = int(os.environ.get("PAGEDKV_KV_HYBRID_SEEDS", "16"))


@pytest.mark.parametrize("chunk", range(2))
def test_hybrid_every_sequence_reads_its_own_kv_in_every_group(chunk):
    """The same model with a HybridBlockManager (2-4 KV cache groups, full and sliding): every live sequence reads
    back its own KV through every group's table after every step, and every position a sliding window needs is
    held. Chunked admissions (``allocate`` / ``allocate_batch`` with ``num_new_tokens``) and their later
    chunks (multi-token ``decode_step``) are read back in every group too."""
    total = {}
    for seed in range(chunk, HYBRID_SEEDS, 2):
        r = kv_model.run(seed, STEPS, hybrid=True)
        assert r.violations == 0, f"seed {seed}: {r.violations} violations, first: {r.messages[:3]}"
        for k, v in r.counts.items():
            total[k] = total.get(k, 0) + v
    for what in ("admits", "batch_admits", "decodes", "swap_outs", "swap_ins", "cow", "aborts", "forks", "copies",
                 "hit_tokens", "hits_past_window", "refusals_ok", "chunked_admits", "chunked_batch_admits",
                 "prefill_chunks", "prefill_last_chunks", "fork_refused_mid_prefill", "pins", "retention_hints"):
        assert total.get(what, 0) > 0, (what, total)


def test_the_model_catches_a_hybrid_hit_with_a_short_window():
    """A hit rule that keeps one block too few of a sliding window (the coordinator planning with W - block_size)
    leaves positions the window needs without a block, and the model sees it."""
    from pagedkv import SlidingWindowSpec
    bad = 0
    for seed in range(16):
        cfg = kv_model.Config.draw_hybrid(random.Random(seed))
        if not cfg.prefix or min(w or 10**6 for w in cfg.groups) <= cfg.block_size:
            continue
        model = kv_model.KVModel(cfg, seed)
        model.bm._alloc.specs = tuple(s if s.window is None else SlidingWindowSpec(s.window - cfg.block_size)
                                for s in model.bm._alloc.specs)
        for _ in range(150):
            model.step()
            if model.report.violations:
                break
        bad += model.report.violations
        if bad:
            break
    assert bad > 0


def test_hybrid_swap_in_of_a_block_cached_this_step_marks_every_group():
    """Regression (soak, hybrid seed 1305): a swap-in in one group reused a GPU block cached in the same step, so
    that group alone marked the sequence as handed slots in the step; a later swap_out passed group 0's same-step
    check, swapped group 0 out, then was refused by that group: the sequence was left half swapped. Now every group
    marks it, swap_out refuses before any group changes, and check_invariants compares the groups' snapshots."""
    r = kv_model.run(1305, 60, check_every=1, hybrid=True)
    assert r.violations == 0, r.messages[:3]


def test_hybrid_seed_120001_reads_back_its_kv():
    """Regression (soak, hybrid seed 120001, no CPU tier, chunked prefill): a swap-in reused a GPU block another
    sequence's chunk had cached in the same step (its KV written by that step's forward), and a swap_out of the
    same sequence in that step copied the unwritten block to the CPU. The rows are now marked handed slots this
    step (swap_out refused until the next step) with or without the CPU tier, as they were with it."""
    r = kv_model.run(120001, 150, check_every=1, hybrid=True)
    assert r.violations == 0, r.messages[:3]
