"""Chunked prefill in the scheduler, end to end on the toy transformer of tests/toy_engine.py (numpy, float64):
every plan is executed as an engine would (the step's copies in order, then one paged forward over its prefill
chunks and decodes), and the greedy outputs must equal those of an unchunked run with a pool large enough for no
preemption. Budgets split prompts mid-block and at block boundaries; identical and prefix-sharing prompts hit the
blocks earlier chunks filled; small pools preempt (recompute and swap) sequences in the middle of their prefill.
The token budget and the order (decodes first, then partly prefilled prompts, then admissions) are checked on
every plan."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.scheduler import Scheduler
from toy_engine import KVStore, ToyModel, run_copies

BS = 4
MODEL = ToyModel(seed=3, V=16)


def _requests(seed: int) -> list:
    """(prompt, n, max_tokens): long and short prompts, identical ones and shared prefixes."""
    rng = random.Random(seed)
    stem = [rng.randrange(16) for _ in range(23)]
    reqs = [
        (stem, 1, 6),
        ([rng.randrange(16) for _ in range(5)], 1, 9),
        (stem, 1, 5),  # identical: hits the blocks the first one's chunks fill
        (stem[:13] + [rng.randrange(16) for _ in range(9)], 2, 4),  # a shared prefix, two samples
        ([rng.randrange(16) for _ in range(31)], 1, 3),
        ([rng.randrange(16) for _ in range(2)], 1, 7),
        (stem[:8], 1, 4),  # ends exactly on a block boundary
    ]
    return reqs


def _stores(bm: BlockManager) -> tuple:
    return KVStore(MODEL, bm.config.num_gpu_blocks, BS), KVStore(MODEL, max(bm.config.num_cpu_blocks, 1), BS)


def _run(sched: Scheduler, bm: BlockManager, reqs: list, stores: tuple, *, check=None, base: int = 0) -> dict:
    """Run ``reqs`` to the end; every logit the paged forward computes is compared with the model's
    reference over the same context (no paging): wrong KV anywhere shows up there."""
    gpu, cpu = stores
    for i, (p, n, m) in enumerate(reqs):
        sched.add_request(base + i, p, n=n, max_tokens=m, ignore_eos=True)
    out = {}
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000, "no progress"
        partial_before = {s.group.request_id for s in sched._seqs.values() if s.prefill is not None}
        plan = sched.schedule()
        if check is not None:
            check(plan, partial_before)
        run_copies(gpu, cpu, plan.copies)
        segs = [(pw.token_ids, pw.positions, pw.slot_mapping, pw.block_table) for pw in plan.prefills]
        d = plan.decode
        if d is not None:
            ends = np.concatenate(([0], np.cumsum(d.query_lens)))
            for i in range(len(d.seq_ids)):
                a, z = ends[i], ends[i + 1]
                segs.append((d.input_tokens[a:z], d.positions[a:z], d.result.slot_mapping[a:z],
                             d.result.block_tables[i]))
        sampled = []
        if segs:
            logits = MODEL.paged_forward(gpu, segs)
            for (toks, pos, _, _), lg, sid in zip(segs, logits, [pw.seq_id for pw in plan.prefills] + (
                    [] if d is None else d.seq_ids.tolist())):
                view = sched.sequence(sid)
                ctx = list(reqs[view.request_id - base][0]) + list(view.output)
                ctx = ctx[: int(pos[-1]) + 1]
                assert ctx[int(pos[0]):] == [int(t) for t in toks]
                np.testing.assert_allclose(lg, MODEL.reference(ctx)[pos], rtol=1e-9, atol=1e-9)
            for j, pw in enumerate(plan.prefills):
                if pw.num_samples == 0:
                    sampled.append(None)  # a chunk that does not end its prompt: nothing to sample
                    continue
                order = np.argsort(-logits[j][-1], kind="stable")
                sampled.append(int(order[0]) if pw.num_samples == 1 else [int(t) for t in order[: pw.num_samples]])
            for lg in logits[len(plan.prefills):]:
                sampled.append(int(np.argmax(lg[-1])))
        for r in sched.update(plan, sampled):
            out[r.request_id - base] = r.outputs
        bm.check_invariants()
    return out


def _reference(reqs: list) -> dict:
    """Greedy outputs without paging (the i-th sample starts from the i-th most likely first token)."""
    out = {}
    for i, (p, n, m) in enumerate(reqs):
        first = np.argsort(-MODEL.reference(p)[-1], kind="stable")[:n]
        samples = []
        for t0 in first:
            toks = list(p) + [int(t0)]
            while len(toks) - len(p) < m:
                toks.append(int(np.argmax(MODEL.reference(toks)[-1])))
            samples.append(tuple(toks[len(p):]))
        out[i] = tuple(samples)
    return out


REQS = _requests(0)
REF = _reference(REQS)


def _checker(budget: int, threshold: int, seen: dict):
    def check(plan, partial_before):
        nd = 0 if plan.decode is None else int(plan.decode.query_lens.sum())
        npf = sum(len(pw.token_ids) for pw in plan.prefills)
        assert nd + npf <= max(budget, nd), "the step exceeds its token budget"
        for pw in plan.prefills:
            if threshold:
                assert len(pw.token_ids) <= threshold
            assert pw.seq_len == pw.positions[-1] + 1 and len(pw.slot_mapping) == len(pw.token_ids)
            seen["chunks"] += 1
            seen["mid_block"] += pw.seq_len % BS != 0 and pw.num_samples == 0
            seen["at_boundary"] += pw.seq_len % BS == 0 and pw.num_samples == 0
            seen["hits"] += pw.num_cached_tokens > 0 and pw.positions[0] == pw.num_cached_tokens
        for p in plan.preempted:
            seen["preempted_mid_prefill"] += p.request_id in partial_before
            seen[p.mode] += 1
    return check


@pytest.mark.parametrize("budget,threshold,blocks,mode", [
    (5, 0, 200, "recompute"),  # chunks end mid-block
    (8, 0, 200, "recompute"),  # chunks end on block boundaries
    (12, 4, 200, "recompute"),  # several prompts progress together, 4 tokens each
    (9, 0, 14, "recompute"),  # a small pool: preemption in the middle of prefills
    (9, 3, 14, "swap"),
])
def test_chunked_greedy_equals_the_reference(budget, threshold, blocks, mode):
    seen = {k: 0 for k in ("chunks", "mid_block", "at_boundary", "hits", "preempted_mid_prefill", "swap",
                           "recompute")}
    bm = BlockManager(blocks, BS, num_cpu_blocks=40, enable_prefix_caching=True, watermark=0.0)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget, preemption_mode=mode,
                      enable_chunked_prefill=True, long_prefill_token_threshold=threshold)
    stores = _stores(bm)
    got = _run(sched, bm, REQS, stores, check=_checker(budget, threshold, seen))
    assert got == REF
    # a rerun of the same prompts: prefix hits on the blocks the chunks left in the cache
    got = _run(sched, bm, REQS, stores, check=_checker(budget, threshold, seen), base=100)
    assert got == REF
    assert sched.stats.prefill_chunks > sched.stats.prefills  # prompts were split
    assert seen["hits"] > 0
    if blocks < 100:
        assert seen["preempted_mid_prefill"] > 0, seen
        assert seen[mode] > 0, seen
    elif budget % BS:
        assert seen["mid_block"] > 0
    else:
        assert seen["at_boundary"] > 0


def test_unchunked_run_is_the_reference_too():
    bm = BlockManager(200, BS, enable_prefix_caching=True, watermark=0.0)
    assert _run(Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=64), bm, REQS, _stores(bm)) == REF


def test_decodes_keep_running_while_a_long_prompt_is_prefilled():
    """Decodes first: a running request decodes in every step while a long prompt arrives and is chunked."""
    bm = BlockManager(100, BS, enable_prefix_caching=True, watermark=0.0)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, enable_chunked_prefill=True)
    sched.add_request("short", [1, 2, 3], max_tokens=12, ignore_eos=True)
    steps = []
    for step in range(12):
        if step == 2:
            sched.add_request("long", list(range(16)) * 2, max_tokens=2, ignore_eos=True)
        plan = sched.schedule()
        steps.append(([pw.request_id for pw in plan.prefills], plan.num_decode_seqs))
        sampled = [None if pw.num_samples == 0 else 1 for pw in plan.prefills] + [2] * plan.num_decode_seqs
        sched.update(plan, sampled)
    # step 0 prefills "short"; from step 1 on it decodes every step, and "long" takes 5 tokens a step beside it
    # ("long" samples its first token from its last chunk, in step 8, and decodes beside "short" in step 9)
    assert steps == [(["short"], 0), ([], 1)] + [(["long"], 1)] * 7 + [([], 2), ([], 1), ([], 1)]
    assert sched.stats.prefill_chunks == 1 + 7  # 32 tokens at 5 a step


def test_chunked_prefill_needs_a_threshold_of_at_least_zero():
    with pytest.raises(ValueError):
        Scheduler(BlockManager(8, 4), enable_chunked_prefill=True, long_prefill_token_threshold=-1)
