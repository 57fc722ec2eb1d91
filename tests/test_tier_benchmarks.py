"""Smoke tests of the storage tiers' benchmark scripts and their shared modules (benchmarks/_tier_common.py,
benchmarks/_bar_chart.py): the chart scripts print the tables docs/tiers.md shows from the results stored in the
repository and write their PNGs; the serving, router and check-cost scripts reprint their stored results; the
crossover's backend measurement runs at a tiny size; the throwaway Redis starts and stops. Seconds, no model."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RES = BENCH / "results"
sys.path.insert(0, str(BENCH))


def _script(name: str):
    return importlib.import_module(name)


def _doc_table(marker: str) -> str:
    text = (ROOT / "docs" / "tiers.md").read_text()
    return text[text.index(f"<!-- {marker} -->"):text.index(f"<!-- /{marker} -->")]


def test_tier_replay_chart_prints_the_docs_table(tmp_path, capsys):
    files = [RES / f"replay_tiers_{n}.json" for n in ("gpu_cpu", "one_pool_3.3M", "gpu_cpu_disk", "gpu_cpu_shared",
                                                       "one_pool")]
    out = tmp_path / "replay.png"
    assert _script("tier_replay_chart").main([str(f) for f in files] + ["--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert out.stat().st_size > 10_000
    rows = [line for line in table if line.startswith("| GPU 300k + CPU 3M + disk 30M ")]
    assert rows and "36.6%" in rows[0] and "21.7%" in rows[0]
    docs = _doc_table("tiered-replay")
    for line in table[2:-1]:  # each configuration's label and hit rate are the docs' (hand-edited cells aside)
        label, _total, hit = (c.strip() for c in line.split("|")[1:4])
        assert label in docs and f"| {hit} |" in docs.replace("**", ""), line


def test_cluster_shared_chart_prints_the_docs_table(tmp_path, capsys):
    c = RES / "cluster"
    files = [c / f"shared-{n}.json" for n in ("2x1M", "2x1M-shared10M", "4x1M", "4x1M-shared10M")]
    out = tmp_path / "cluster.png"
    assert _script("cluster_shared_chart").main([str(f) for f in files] + ["--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert out.stat().st_size > 10_000
    docs = _doc_table("cluster-shared")
    assert all(line in docs for line in table[:-1]), "the chart's table is the one docs/tiers.md shows"


def test_tier_figures_chart_prints_the_docs_table(tmp_path, capsys):
    r = RES / "router_tiers"
    # the chart's four runs (round-robin-decode-1, a later single run of one configuration, is not charted)
    summaries = [str(r / d / "summary.json") for d in ("prefix-1", "prefix-2", "round-robin-1", "round-robin-2")]
    assert all(Path(s).is_file() for s in summaries)
    out = tmp_path / "figures.png"
    serving = [str(RES / "tier_serving_smollm2.json"), str(RES / "tier_serving_gemma3.json")]
    assert _script("tier_figures_chart").main(["--router", *summaries, "--serving", *serving, "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert out.stat().st_size > 10_000
    docs = _doc_table("router-live")
    assert all(line in docs for line in table[:-1]), "the chart's table is the one docs/tiers.md shows"
    rows = _script("tier_figures_chart").router_rows([json.loads(Path(s).read_text()) for s in summaries])
    by = {(x["route"], x["config"]): x for x in rows}
    assert by[("round-robin", "shared")]["shared_rate"] > 0.1 and by[("round-robin", "none")]["shared_rate"] == 0


@pytest.mark.parametrize("script,args,expect", [
    ("tier_serving", ["--show", str(RES / "tier_serving_gemma3.json")], "kv_cache_groups=False"),
    ("tier_serving", ["--show", str(RES / "tier_serving_smollm2.json")], "same greedy text everywhere: True"),
    ("tier_crossover", ["--show", str(RES / "tier_crossover.json")], "loading wins above"),
    ("tier_router", ["--show", str(RES / "router_tiers" / "round-robin-1" / "summary.json")], "shared tier (Redis)"),
])
def test_the_scripts_reprint_their_results(script, args, expect, capsys):
    assert _script(script).main(args) == 0
    assert expect in capsys.readouterr().out


def test_the_crossover_measures_backends_at_a_tiny_size(tmp_path):
    from pagedkv.tiers import ModelFingerprint

    fp = ModelFingerprint("smoke", "float32", 4, "L1,2,B4,H1,D2")
    with _script("_tier_common").RedisServer(str(tmp_path)) as rs:
        got = _script("tier_crossover").measure_backends(64, 4, 1, fp, str(tmp_path), rs.url)
    assert {"disk", "shared_dir", "memory (decode + copy only)"} <= set(got)
    assert all(v > 0 for row in got.values() for v in row.values())
    assert ("redis" in got) == (rs.url is not None) and rs.proc is None  # stopped on exit


def test_bar_chart_helpers():
    bc = _script("_bar_chart")
    assert [bc.tok(n) for n in (999, 300_000, 3_300_000)] == ["999", "300k", "3.3M"]
    assert bc.pct(None) == "-" and bc.pct(0.3664) == "36.6%"
    assert np.isclose(_script("_tier_common").medians([{"a": 1}, {"a": 3}], ["a"])["a"], 2.0)
