"""Chart and table of tiered replays (``pagedkv replay ... --disk-capacity ... --shared-capacity ... --json``).

Usage::

    python benchmarks/tier_replay_chart.py A.json B.json ... --out benchmarks/results/replay_tiers.png

One bar per capacity point of every file, stacked by the tier that served the prompt tokens (GPU, CPU, disk,
shared), with Belady's bound of the configuration (a tick; one pool of the tiers' total, as ``pagedkv replay
--bound`` computes it) and the trace's ceiling (a dashed line). Prints the Markdown table of docs/tiers.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bar_chart import chart_main, pct, pyplot, save, stacked_bars, tok  # noqa: E402


def configs(docs: list[dict]) -> list[dict]:
    """One row per capacity point: its label, total capacity, per-tier hit rates, bound, ceiling, seconds."""
    rows = []
    for d in docs:
        for p in d["points"]:
            tiers = [("GPU", p["capacity_tokens"]), ("CPU", p.get("cpu_capacity_tokens") or 0),
                     ("disk", p.get("disk_capacity_tokens") or 0), ("shared", p.get("shared_capacity_tokens") or 0)]
            present = [(t, c) for t, c in tiers if c]
            label = " + ".join(f"{t} {tok(c)}" for t, c in present)
            if len(present) == 1:
                label = f"one pool {tok(p['capacity_tokens'])}"
            rows.append({"label": label, "total": sum(c for _, c in tiers),
                         "gpu": p["gpu_hit_rate"], "cpu": p.get("cpu_hit_rate") or 0.0,
                         "disk": p.get("disk_hit_rate") or 0.0, "shared": p.get("shared_hit_rate") or 0.0,
                         "hit": p["hit_rate"], "bound": p.get("bound"), "ceiling": d.get("ceiling"),
                         "seconds": p["seconds"], "command": d.get("command", "")})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| configuration (tokens) | total | hit rate | GPU | CPU | disk | shared | Belady bound (one pool of the "
           "total) | replay s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {tok(r['total'])} | {pct(r['hit'])} | {pct(r['gpu'])} | {pct(r['cpu'])} | "
                   f"{pct(r['disk'])} | {pct(r['shared'])} | {pct(r['bound'])} | {r['seconds']:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    ceil = next((r["ceiling"] for r in rows if r["ceiling"] is not None), None)
    stacked_bars(ax, [(f"served from {name}", [100 * r[tier] for r in rows], color) for tier, name, color in
                      (("gpu", "GPU", "#4c72b0"), ("cpu", "CPU", "#55a868"), ("disk", "disk", "#dd8452"),
                       ("shared", "shared", "#8172b3"))],
                 ticks=[None if r["bound"] is None else 100 * r["bound"] for r in rows],
                 tick_label="Belady bound (one pool of the total)", ceiling=None if ceil is None else 100 * ceil,
                 totals=[100 * r["hit"] for r in rows], total_inside=True)
    for i, r in enumerate(rows):
        if r["bound"] is not None:
            ax.text(i + 0.3, 100 * r["bound"] + 0.4, f"bound {100 * r['bound']:.1f}%", ha="left", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(rows)), [r["label"].replace(" + ", "\n+ ") for r in rows], fontsize=8)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Mooncake conversation trace: hit rate by tier configuration", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(40.0, 100 * (ceil or 0) + 6))
    return save(fig, out)


def main(argv=None) -> int:
    return chart_main(__doc__, configs, table, plot, "benchmarks/results/replay_tiers.png",
                      "results of pagedkv replay --json, in the order of the bars", argv)


if __name__ == "__main__":
    sys.exit(main())
