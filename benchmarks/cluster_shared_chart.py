"""Chart and table of cluster replays with and without a shared tier (``pagedkv replay --replicas N [--shared-capacity
T] --json``).

Usage::

    python benchmarks/cluster_shared_chart.py A.json B.json ... --out benchmarks/results/cluster/shared.png

One row and one bar per (file, capacity, route) point, in the order given, stacked by where the prompt tokens
came from: the replica's own pool (GPU) or the shared tier (loads). The pooled reference of each file (one manager
of N x the capacity) is a tick on the bars of that file; the trace's ceiling a dashed line. Prints the Markdown
table of docs/tiers.md (hit rate, GPU and shared parts, load imbalance, the range of the replicas' hit rates, the
index's prediction, replay seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bar_chart import chart_main, pct, pyplot, save, stacked_bars, tok  # noqa: E402


def rows_of(docs: list[dict]) -> list[dict]:
    rows = []
    for d in docs:
        shared = d.get("shared_capacity_tokens") or 0
        pooled = {p["capacity_tokens"]: p["hit_rate"] for p in d.get("pooled", [])}
        for p in d["points"]:
            per = [x["hit_rate"] for x in p["per_replica"]]
            rows.append({
                "replicas": d["replicas"], "capacity": p["capacity_tokens"], "shared": shared, "route": p["route"],
                "hit": p["hit_rate"], "gpu": p["hit_rate"] - (p.get("shared_hit_rate") or 0.0),
                "loaded": p.get("shared_hit_rate") or 0.0, "imbalance": p["load_imbalance"],
                "per": (min(per), max(per)), "predicted": p["predicted_hit_tokens"] / p["prompt_tokens"],
                "pooled": pooled.get(d["replicas"] * p["capacity_tokens"]), "ceiling": d.get("ceiling"),
                "seconds": p["seconds"], "weights": p.get("weights")})
    return rows


def label(r: dict) -> str:
    s = f"{r['replicas']} x {tok(r['capacity'])}"
    return s + (f" + shared {tok(r['shared'])}" if r["shared"] else "")


def table(rows: list[dict]) -> str:
    out = ["| replicas x pool (tokens) | shared tier | route | hit rate | own pool (GPU) | loaded from shared | "
           "imbalance | replicas' hit rates | predicted by the index | pooled (one manager) | replay s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['replicas']} x {tok(r['capacity'])} | {tok(r['shared']) if r['shared'] else 'none'} | "
                   f"{r['route']} | {pct(r['hit'])} | {pct(r['gpu'])} | {pct(r['loaded']) if r['shared'] else ''} | "
                   f"{r['imbalance']:.2f} | {pct(r['per'][0])}..{pct(r['per'][1])} | "
                   f"{pct(r['predicted']) if r['route'] == 'prefix' else '-'} | {pct(r['pooled'])} | "
                   f"{r['seconds']:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(rows) + 2.5), 4.6))
    ceil = next((r["ceiling"] for r in rows if r["ceiling"] is not None), None)
    stacked_bars(ax, [("served from the replica's own pool", [100 * r["gpu"] for r in rows], "#4c72b0"),
                      ("loaded from the shared tier", [100 * r["loaded"] for r in rows], "#8172b3")],
                 ticks=[None if r["pooled"] is None else 100 * r["pooled"] for r in rows], tick_size=500,
                 tick_label="pooled: one manager of N x the pool", ceiling=None if ceil is None else 100 * ceil,
                 totals=[100 * r["hit"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{label(r)}\n{r['route']}".replace(" + shared", "\n+ shared") for r in rows],
                  fontsize=7)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Mooncake conversation trace over N replicas:\nprefix routing vs round robin, with and without a "
                 "shared tier", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(40.0, 100 * (ceil or 0) + 6))
    return save(fig, out)


def main(argv=None) -> int:
    return chart_main(__doc__, rows_of, table, plot, "benchmarks/results/cluster/shared.png",
                      "results of pagedkv replay --replicas N --json, in the order of the bars", argv)


if __name__ == "__main__":
    sys.exit(main())
