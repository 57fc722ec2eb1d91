"""Chart of the storage tiers' serving figures: hit rate and TTFT by tier configuration (issue 24, item 6).

Usage::

    python benchmarks/tier_figures_chart.py --router R1/summary.json [R2/summary.json ...] \\
        --serving benchmarks/results/tier_serving_smollm2.json benchmarks/results/tier_serving_gemma3.json \\
        --out benchmarks/results/tier_figures.png

Three panels: (1) the router live run (``tier_router.py``): prompt tokens served from cache per route and
configuration, stacked by tier (the replicas' own pools, the shared tier), the median over the runs given; (2) its
TTFT p50 and p90 (medians over the runs); (3) the single-prompt serving figures (``tier_serving.py``): TTFT as a
fraction of recomputing, per tier and model, with the issue's goal (0.3x) as a dashed line. Prints the Markdown
table of docs/tiers.md for the router run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bar_chart import pct, pyplot, save, stacked_bars  # noqa: E402

LABEL = {"none": "no shared tier", "shared": "shared tier\n(Redis)"}


def router_rows(docs: list[dict]) -> list[dict]:
    """One row per (route, configuration), medians over every run of every summary given."""
    by: dict[tuple, list[dict]] = {}
    for d in docs:
        for r in d["runs"]:
            by.setdefault((d["setup"]["route"], r["config"]), []).append(r)
    out = []
    for (route, c), rs in sorted(by.items(), key=lambda kv: (kv[0][0] != "prefix", kv[0][0], kv[0][1])):
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("hit_rate", "shared_rate", "ttft_p50_ms", "ttft_p90_ms", "prompt_tokens", "completed", "failed")}
        med["own_rate"] = statistics.median((r["own_pool_tokens"] / r["prompt_tokens"]) for r in rs)
        out.append({"route": route, "config": c, "runs": len(rs), **med,
                    "each": [(r["hit_rate"], r["ttft_p50_ms"], r["ttft_p90_ms"]) for r in rs]})
    return out


def _label(r: dict) -> str:
    return f"{r['route']}\n{LABEL[r['config']]}"


def table(rows: list[dict]) -> str:
    out = ["| route | configuration | runs (from cache, TTFT p50, p90 each) | prompt tokens | from cache | "
           "own pools (GPU) | shared tier | TTFT p50 ms | TTFT p90 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = "; ".join(f"{100 * h:.1f}%, {p50:.0f}, {p90:.0f}" for h, p50, p90 in r["each"])
        out.append(f"| {r['route']} | {LABEL[r['config']].replace(chr(10), ' ')} | {r['runs']} ({each}) | "
                   f"{r['prompt_tokens']:,.0f} | **{pct(r['hit_rate'])}** | {pct(r['own_rate'])} | "
                   f"{pct(r['shared_rate'])} | **{r['ttft_p50_ms']:.0f}** | **{r['ttft_p90_ms']:.0f}** |")
    return "\n".join(out)


def plot(rows: list[dict], serving: list[dict], out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1.2, 1.2, 1.5]})
    stacked_bars(a1, [("the replicas' own pools", [100 * r["own_rate"] for r in rows], "#4c72b0"),
                      ("loaded from the shared tier", [100 * r["shared_rate"] for r in rows], "#8172b3")],
                 totals=[100 * r["hit_rate"] for r in rows])
    a1.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=7)
    a1.set_ylabel("prompt tokens served from cache (%)")
    a1.set_ylim(0, max(10.0, 1.25 * max(100 * r["hit_rate"] for r in rows)))
    a1.set_title("router, 2 replicas: hit rate", fontsize=9)
    a1.legend(fontsize=7, loc="upper right")
    x = range(len(rows))
    w = 0.38
    a2.bar([i - w / 2 for i in x], [r["ttft_p50_ms"] for r in rows], w, color="#55a868", label="p50")
    a2.bar([i + w / 2 for i in x], [r["ttft_p90_ms"] for r in rows], w, color="#dd8452", label="p90")
    for i, r in enumerate(rows):
        a2.text(i - w / 2, r["ttft_p50_ms"], f"{r['ttft_p50_ms']:.0f}", ha="center", va="bottom", fontsize=7)
        a2.text(i + w / 2, r["ttft_p90_ms"], f"{r['ttft_p90_ms']:.0f}", ha="center", va="bottom", fontsize=7)
    a2.set_xticks(list(x), [_label(r) for r in rows], fontsize=7)
    a2.set_ylabel("TTFT (ms)")
    a2.set_title("router, 2 replicas: TTFT", fontsize=9)
    a2.legend(fontsize=7)
    names, vals, colors = [], [], []
    for s in serving:
        m = s["median"]
        model = {"smollm2-135m": "SmolLM2", "gemma-3-270m": "Gemma 3"}.get(s["model"], s["model"])
        names += [f"{model}\nrecompute", f"{model}\nrestart,\nfrom disk", f"{model}\nreplica B,\nfrom Redis"]
        vals += [1.0, m["disk_ratio"], m["shared_ratio"]]
        colors += ["#999999", "#dd8452", "#8172b3"]
    a3.bar(range(len(vals)), vals, color=colors)
    for i, v in enumerate(vals):
        a3.text(i, v + 0.01, f"{v:.2f}x", ha="center", va="bottom", fontsize=7)
    a3.axhline(0.3, ls="--", color="grey", lw=1, label="goal: 0.3x recompute")
    a3.set_xticks(range(len(vals)), names, fontsize=7)
    a3.set_ylabel("TTFT / recompute TTFT")
    a3.set_title("a 2,048-token prompt: TTFT by tier (medians of 2)", fontsize=9)
    a3.legend(fontsize=7)
    return save(fig, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", nargs="+", required=True, help="tier_router.py summary.json files (runs pooled)")
    ap.add_argument("--serving", nargs="*", default=[], help="tier_serving.py --json files, one per model")
    ap.add_argument("--out", default="benchmarks/results/tier_figures.png")
    a = ap.parse_args(argv)
    rows = router_rows([json.loads(Path(f).read_text()) for f in a.router])
    print(table(rows))
    print(f"chart: {plot(rows, [json.loads(Path(f).read_text()) for f in a.serving], Path(a.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
