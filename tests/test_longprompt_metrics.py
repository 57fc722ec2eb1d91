"""The metrics of the long-prompt serving workload (pagedkv.server.longprompt), on synthetic timestamps:
stall (the largest gap of a decoding stream overlapping the long prompt's wait), ITL/TPOT percentiles and the
long prompt's TTFT. Pure functions; no server, no torch."""

from __future__ import annotations

import math

import pytest

from pagedkv.server.longprompt import (LongPromptConfig, StreamTrace, aggregate, gaps, percentiles, stall,
                                       summarize_trial, window_gaps)


def trace(times, end=None, finished=False, send=0.0):
    return StreamTrace(send, list(times), end if end is not None else (times[-1] if times else send), finished)


def test_gaps_between_consecutive_times():
    assert gaps([1.0, 1.5, 3.0]) == pytest.approx([0.5, 1.5])
    assert gaps([2.0]) == [] and gaps([]) == []


def test_percentiles_interpolate_between_ranks_in_ms():
    p = percentiles([0.010, 0.020, 0.030, 0.040, 0.050])
    assert p["n"] == 5
    assert p["p50"] == pytest.approx(30.0)
    assert p["p90"] == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert p["p99"] == pytest.approx(49.6)
    assert p["max"] == pytest.approx(50.0)
    empty = percentiles([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("p50", "p90", "p99", "max"))


def test_stall_is_the_largest_gap_overlapping_the_window():
    # stream a: steady 0.1 s tokens, then frozen from 1.0 to 9.0 (a prefill), then steady again
    a = trace([0.1 * i for i in range(11)] + [9.0, 9.1, 9.2])
    # stream b: a 3 s gap before the window (must not count), small gaps inside it
    b = trace([0.0, 3.0, 3.1, 5.0, 5.1])
    assert stall([a, b], start=1.05, end=8.95) == pytest.approx(8.0)
    assert stall([b], start=3.05, end=4.0) == pytest.approx(1.9)  # (3.1, 5.0) overlaps
    assert stall([b], start=5.2, end=6.0) == 0.0  # no gap of b overlaps
    assert sorted(window_gaps([b], 0.5, 3.05)) == pytest.approx([0.1, 3.0])


def test_a_cut_stream_contributes_its_open_gap_but_a_finished_one_does_not():
    cut = trace([0.0, 0.1, 0.2], end=6.0, finished=False)  # cut at 6.0 while frozen since 0.2
    done = trace([0.0, 0.1, 0.2], end=6.0, finished=True)  # ended on its own at 0.2
    assert stall([cut], 1.0, 5.0) == pytest.approx(5.8)
    assert stall([done], 1.0, 5.0) == 0.0


def test_summarize_trial_separates_baseline_window_and_ttft():
    # two streams, 50 ms tokens; the long prompt is sent at 1.0 and its first token comes at 4.0; both streams
    # freeze from 1.0 to 4.02 (one prefill step), then resume
    s1 = trace([0.05 * i for i in range(21)] + [4.02 + 0.05 * i for i in range(10)], end=6.5)
    s2 = trace([0.025 + 0.05 * i for i in range(20)] + [4.03 + 0.05 * i for i in range(10)], end=6.5)
    long = StreamTrace(1.0, [4.0, 4.05], 4.3, True)
    m = summarize_trial([s1, s2], long)
    assert m["long_ttft_ms"] == pytest.approx(3000.0)
    assert m["long_latency_ms"] == pytest.approx(3300.0)
    assert m["stall_ms"] == pytest.approx((4.03 - 0.975) * 1000)  # s2's gap is the larger one
    assert m["itl_baseline_ms"]["max"] == pytest.approx(50.0)  # the baseline never sees the freeze
    assert m["itl_baseline_ms"]["n"] == 20 + 19
    assert m["itl_ms"]["max"] == pytest.approx(m["stall_ms"])
    assert m["itl_during_ms"]["n"] == 2  # one freeze per stream; the gaps ending at the send do not overlap
    assert m["streams_outlived_prefill"] == 2
    assert m["stream_tokens"] == [31, 30]
    assert m["tpot_ms"]["n"] == 2
    assert m["tpot_ms"]["max"] == pytest.approx((4.48 - 0.025) / 29 * 1000)  # s2: 29 gaps, s1 (4.47 / 30) less
    assert m["errors"] == []


def test_a_long_prompt_that_never_answers_has_nan_ttft_and_the_window_runs_to_its_end():
    s = trace([0.0, 0.1, 0.2], end=10.0)
    long = StreamTrace(0.15, [], 10.0, False, "HTTP 500: boom")
    m = summarize_trial([s], long)
    assert math.isnan(m["long_ttft_ms"])
    assert m["stall_ms"] == pytest.approx(9800.0)
    assert m["errors"] == ["HTTP 500: boom"]
    assert m["streams_outlived_prefill"] == 1


def test_aggregate_takes_medians_over_trials_and_pools_gaps():
    cfg = LongPromptConfig()

    def t(stall_ms, ttft_ms, times, send):
        return {"stall_ms": stall_ms, "long_ttft_ms": ttft_ms, "errors": [],
                "trace": {"streams": [{"times": times}], "long": {"send": send}}}

    s = aggregate([t(100.0, 900.0, [0.0, 0.1, 0.2], 0.15), t(300.0, 1100.0, [0.0, 0.1, 0.5], 0.05),
                   t(200.0, float("nan"), [0.0, 0.2], 1.0)], "m", cfg)
    assert s["median_stall_ms"] == pytest.approx(200.0)
    assert s["max_stall_ms"] == pytest.approx(300.0)
    assert s["median_long_ttft_ms"] == pytest.approx(1000.0)  # the NaN trial is left out
    assert s["itl_ms"]["n"] == 5 and s["itl_ms"]["max"] == pytest.approx(400.0)
    assert s["itl_baseline_ms"]["n"] == 2  # 0.1 of trial 1 (ends before 0.15) and 0.2 of trial 3
    assert s["tpot_ms"]["n"] == 3
