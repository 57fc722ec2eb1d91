"""The hybrid side by side (``pagedkv bench hybrid``): the V1-side table builder and the result document.
No timing is asserted."""

from __future__ import annotations

import numpy as np

from pagedkv.bench import hybrid
from pagedkv.bench.runner_tables import GroupTables


def test_group_tables_append_deltas_per_group_and_map_slots_per_group():
    """Two groups, two rows: admission tables, then per-step deltas (None, empty lists, new ids per group); the
    slot of each row's last token is read from its own group's table."""
    t = GroupTables(4, 2, 2, width=1)  # width 1: the matrices must grow
    t.add_row(0, [[10, 11], [20, 21]])
    t.add_row(1, [[30], [40]])
    rows = np.array([0, 1])
    slots, tables, lens = t.build(rows, [None, ([31], [41])], [8, 5])
    assert lens.tolist() == [8, 5]
    # row 0: token 7 -> block 1, offset 3 (no delta); row 1: token 4 -> block 1 (new: 31 and 41)
    assert slots.tolist() == [[11 * 4 + 3, 31 * 4], [21 * 4 + 3, 41 * 4]]
    assert tables[0].tolist() == [[10, 11], [30, 31]] and tables[1].tolist() == [[20, 21], [40, 41]]
    slots, tables, _ = t.build(rows, [([12], [22]), ([], [])], [9, 6])  # an empty list: nothing new there
    assert slots.tolist() == [[12 * 4, 31 * 4 + 1], [22 * 4, 41 * 4 + 1]]
    assert tables[1].tolist() == [[20, 21, 22], [40, 41, -1]]


def test_gemma3_groups_and_pool_sizing():
    groups = hybrid.gemma3_groups()
    assert [getattr(g, "window", None) for g in groups] == [None, 512, 512, 512, 512, 512]
    # one full table of the longest context (+ steps + 1), five windows of 32 + 2 blocks, one prompt in flight
    n = hybrid._pool_blocks(10, 4096, 63, hybrid.GEMMA3_WINDOWS)
    assert n == 10 * (260 + 5 * 34) + 6 * 256 + 16


def test_format_table_of_a_document():
    doc = {"config": {"prefix_caching": [True]}, "skipped": {},
           "decode": [{"impl": "pagedkv", "prefix_caching": True, "batch": 4,
                       "us_per_step": {"min": 1.0, "median": 2.0, "max": 3.0}},
                      {"impl": "vllm_v1", "prefix_caching": True, "batch": 4,
                       "us_per_step": {"min": 4.0, "median": 5.0, "max": 6.0}}],
           "decode_ratios": [{"anchor": "vllm_v1", "prefix_caching": True, "batch": 4,
                              "ratio": {"min": 0.3, "median": 0.4, "max": 0.5},
                              "ratio_vs_bm_only": {"min": 0.5, "median": 0.6, "max": 0.7}}],
           "prefix": [], "prefix_ratios": []}
    text = hybrid.format_table(doc)
    assert "| 4 | 2.0 [1.0-3.0] | 5.0 [4.0-6.0] | 0.4 [0.3-0.5] (0.6) |" in text


def test_prefix_table_gives_v1_calls_alone_and_with_hashing_apart():
    doc = {"config": {"prefix_caching": []}, "skipped": {}, "decode": [], "decode_ratios": [],
           "prefix": [{"impl": "pagedkv", "prompt_tokens": 1280, "us_per_allocate": {"min": 1, "median": 200.0, "max": 3},
                       "hit_tokens_median": 1024},
                      {"impl": "vllm_v1", "prompt_tokens": 1280, "us_per_allocate": {"min": 1, "median": 300.0, "max": 3},
                       "us_with_hash": {"min": 1, "median": 450.0, "max": 3}, "hit_tokens_median": 1024}],
           "prefix_ratios": [{"anchor": "vllm_v1", "prompt_tokens": 1280, "same_hits": True,
                              "ratio": {"min": 0.6, "median": 0.667, "max": 0.7},
                              "ratio_vs_with_hash": {"min": 0.4, "median": 0.444, "max": 0.5}}]}
    text = hybrid.format_table(doc)
    assert "| ratio vs calls alone | ratio vs calls + hashing |" in text
    assert "| 1280 | 200.0 | 1024 | 300.0 | 450.0 | 1024 | 0.667 [0.6-0.7] | 0.444 [0.4-0.5] |" in text


def test_the_pagedkv_side_runs_end_to_end(capsys):
    """A tiny run of ``pagedkv bench hybrid`` with pagedkv alone (vLLM V1 needs its virtualenv): every batch size
    and prompt length gets a figure and the hit covers the first turn's full blocks."""
    from pagedkv.bench.__main__ import main as bench_main

    doc = hybrid.run_hybrid(["pagedkv"], batch_sizes=(1, 3), lengths=(64,), steps=4,
                            repeats=1, skip=1, requests=2, context=(40, 90))
    assert {(r["batch"], r["prefix_caching"]) for r in doc["decode"]} == {(1, True), (3, True), (1, False), (3, False)}
    assert doc["prefix"][0]["hit_tokens"] == [64, 64] and doc["prefix"][0]["prompt_tokens"] == 64 + hybrid.TURN
    assert bench_main(["hybrid", "--quick", "--no-save", "--batch", "2", "--lengths", "48", "--steps", "3",
                       "--requests", "2", "--impl", "pagedkv", "vllm_v1"]) == 0
    out = capsys.readouterr()
    assert "| 2 |" in out.out and "| 304 |" in out.out
