"""Smoke tests of the block-manager benchmark suite (quick sizes, a few seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.bench import harness, report, workloads
from pagedkv.bench.__main__ import main
from pagedkv.scheduler import Scheduler


def test_quick_suite_runs_and_writes_results(tmp_path, capsys):
    out = tmp_path / "results"
    plots = tmp_path / "plots"
    rc = main(["--quick", "--repeats", "1", "--warmup", "0", "--no-progress", "--out", str(out), "--plot",
               str(plots), "--impl", "pagedkv", "no-such-anchor"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "seed" in text and "sliding-window" in text and "bytes/block" in text
    (path,) = out.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["command"].split()[1:4] == ["-m", "pagedkv.bench", "--quick"]
    assert doc["machine"]["cpu_count"] >= 1 and doc["versions"]["pagedkv"] and doc["versions"]["numpy"]
    by = {(r["workload"], r["impl"]): r for r in doc["results"]}
    names = list(workloads.build_workloads(True))
    for name in names:
        r = by[(name, "pagedkv")]
        assert r["status"] == "ok", r
        assert by[(name, "no-such-anchor")]["status"] == "skipped"
    m = {name: by[(name, "pagedkv")]["metrics"] for name in names}
    assert m["seed"]["max_batch"] == 64 and m["seed"]["preemptions"] == 0
    assert m["seed"]["median_us_per_step"]["median"] > 0
    assert m["constrained-recompute"]["recompute_preemptions"] > 0
    assert m["constrained-swap"]["swap_outs"] > 0
    assert m["prefix-shared"]["hit_rate"] > 0.5 and m["prefix-none"]["hit_rate"] == 0
    assert m["parallel-n4"]["copy_on_writes"] > 0 and m["parallel-n4"]["forks"] > 0
    assert m["spec-decode"]["decode_steps"] < m["seed"]["decode_steps"]
    sw = m["sliding-window"]
    assert sw["max_blocks_per_seq"] < sw["blocks_per_seq_without_window"] / 2
    pools = m["scale"]["pools"]
    assert {(p["num_blocks"], p["prefix_caching"]) for p in pools} == {(10_000, False), (10_000, True)}
    # 8 B/block of pool state; prefix caching adds key, cid and parent cid (24), the eviction policy's state (an
    # int64 stamp and a segment id per block, and its push-log entries of (block, 64-bit serial): the serials
    # never wrap, 2-3 B/block more than the 32-bit stamps before the policy base class), the run successor and
    # dict-less mark (4 + 1), the content id a held copy copies (8) and the block's token ids (4 * block_size)
    # -- flat arrays, so the figure does not grow as the cache fills
    by_caching = {p["prefix_caching"]: p["bytes_per_block"] for p in pools}
    assert 8 <= by_caching[False] < 9
    assert 59 + 4 * 16 <= by_caching[True] < 64 + 4 * 16  # (+ a few fixed bytes spread over the pool)
    assert {p.name for p in plots.glob("*.png")} >= {"step_cost_vs_batch.png", "block_usage.png", "hit_rate.png",
                                                    "scale.png"}
    # the report re-renders the file
    assert report.main([str(path)]) == 0


def test_same_token_stream_for_every_schedule():
    """The fake model's tokens do not depend on scheduling: a constrained run reproduces the seed run."""
    wl = workloads.build_workloads(True)["seed"]
    outs = {}
    for blocks, mode, cpu in ((wl.num_gpu_blocks, "recompute", 0), (wl.num_gpu_blocks // 4, "recompute", 0),
                              (wl.num_gpu_blocks // 4, "swap", 100)):
        bm = BlockManager(blocks, wl.block_size, num_cpu_blocks=cpu)
        sched = Scheduler(bm, max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
                          preemption_mode=mode)
        prompts = wl.prompts(0)
        for i in range(wl.num_requests):
            sched.add_request(i, prompts[i], max_tokens=wl.output_len, ignore_eos=True)
        model = workloads.FakeModel(0)
        res = {}
        while sched.has_unfinished():
            plan = sched.schedule()
            for o in sched.update(plan, model.sample(plan)):
                res[o.request_id] = o.outputs
        outs[(blocks, mode)] = res
    first, *rest = outs.values()
    # every run produced every request's output in full (equal empty results would prove nothing)
    assert len(first) == wl.num_requests and len(rest) == 2
    assert all(len(o) == 1 and len(o[0]) == wl.output_len for o in first.values())
    assert all(r == first for r in rest)


def test_fake_model_speculation_is_ragged_and_deterministic():
    m = workloads.FakeModel(3, num_lookahead_slots=4)
    ids, pos = np.arange(1000), np.full(1000, 17)
    acc = m.accepted(ids, pos)
    assert acc.min() == 0 and acc.max() == 4
    np.testing.assert_array_equal(m.tokens(ids, pos), workloads.FakeModel(3).tokens(ids, pos))
    assert not np.array_equal(m.tokens(ids, pos), workloads.FakeModel(4).tokens(ids, pos))
    assert m.tokens(ids, pos).min() >= 1


def test_timed_block_manager_times_calls_but_not_prepare_step():
    class Fake:
        def __init__(self):
            self.prepared = 0

        def prepare_step(self, ids, toks):
            self.prepared += 1

        def can_append_slots(self, ids, k=0):
            return True

        @property
        def num_free_gpu_blocks(self):
            return 7

    f = Fake()
    t = harness.TimedBlockManager(f)
    t.prepare_step([1], [2])
    assert t.ns == 0 and t.calls == 0 and f.prepared == 1
    assert t.can_append_slots([1]) is True
    assert t.calls == 1 and t.ns > 0
    assert t.num_free_gpu_blocks == 7
    assert not hasattr(harness.TimedBlockManager(BlockManager(4, 4)), "prepare_step")


def test_unsupported_workload_is_skipped_with_a_reason():
    impl = harness.Impl("toy", BlockManager, frozenset({"prefix_caching"}), "toy lacks fork")
    wl = workloads.build_workloads(True)["parallel-n4"]
    rec = harness.run_workload(wl, impl, repeats=1, warmup=0)
    assert rec["status"] == "skipped" and "fork" in rec["reason"] and "toy lacks fork" in rec["reason"]


def test_no_precheck_gives_the_same_schedule():
    wl = workloads.build_workloads(True)["constrained-recompute"]
    impl = harness.resolve_impl("pagedkv")
    a = harness.run_replay(wl, impl, precheck=True)
    b = harness.run_replay(wl, impl, precheck=False)
    for k in ("steps", "preemptions", "output_tokens", "max_blocks_used"):
        assert a[k] == b[k]


def test_workload_selection():
    names = [w.name for w in workloads.resolve_workloads(["constrained", "seed"], quick=True)]
    assert names == ["constrained-recompute", "constrained-swap", "seed"]
    with pytest.raises(KeyError):
        workloads.resolve_workloads(["nope"])
    full = workloads.build_workloads(False)
    seed = full["seed"]
    assert (seed.num_requests, seed.prompt_len, seed.output_len, seed.block_size) == (1000, 256, 256, 16)
    assert seed.num_gpu_blocks >= 1000 * 32 and full["constrained-recompute"].num_gpu_blocks == seed.num_gpu_blocks // 4
    assert full["prefix-shared"].shared_prefix_len == 200 and full["parallel-n4"].prompt_len == 250
    assert full["spec-decode"].num_lookahead_slots == 4 and full["sliding-window"].sliding_window == 4096
    assert full["scale"].scale_sizes == (100_000, 1_000_000)
