"""Chart and table of tiered replays (``pagedkv replay ... --disk-capacity ... --shared-capacity ... --json``).

Usage::

    python benchmarks/tier_replay_chart.py A.json B.json ... --out benchmarks/results/replay_tiers.png

One bar per capacity point of every file, stacked by the tier that served the prompt tokens (GPU, CPU, disk,
shared), with Belady's bound of the configuration (a tick; one pool of the tiers' total, as ``pagedkv replay
--bound`` computes it) and the trace's ceiling (a dashed line). Prints the Markdown table of docs/tiers.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _tok(n: int) -> str:
    for unit, div in (("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def configs(docs: list[dict]) -> list[dict]:
    """One row per capacity point: its label, total capacity, per-tier hit rates, bound, ceiling, seconds."""
    rows = []
    for d in docs:
        for p in d["points"]:
            tiers = [("GPU", p["capacity_tokens"]), ("CPU", p.get("cpu_capacity_tokens") or 0),
                     ("disk", p.get("disk_capacity_tokens") or 0), ("shared", p.get("shared_capacity_tokens") or 0)]
            present = [(t, c) for t, c in tiers if c]
            label = " + ".join(f"{t} {_tok(c)}" for t, c in present)
            if len(present) == 1:
                label = f"one pool {_tok(p['capacity_tokens'])}"
            rows.append({"label": label, "total": sum(c for _, c in tiers),
                         "gpu": p["gpu_hit_rate"], "cpu": p.get("cpu_hit_rate") or 0.0,
                         "disk": p.get("disk_hit_rate") or 0.0, "shared": p.get("shared_hit_rate") or 0.0,
                         "hit": p["hit_rate"], "bound": p.get("bound"), "ceiling": d.get("ceiling"),
                         "seconds": p["seconds"], "command": d.get("command", "")})
    return rows


def table(rows: list[dict]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    out = ["| configuration (tokens) | total | hit rate | GPU | CPU | disk | shared | Belady bound (one pool of the "
           "total) | replay s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {_tok(r['total'])} | {pct(r['hit'])} | {pct(r['gpu'])} | {pct(r['cpu'])} | "
                   f"{pct(r['disk'])} | {pct(r['shared'])} | {pct(r['bound'])} | {r['seconds']:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for tier, color in (("gpu", "#4c72b0"), ("cpu", "#55a868"), ("disk", "#dd8452"), ("shared", "#8172b3")):
        vals = [100 * r[tier] for r in rows]
        if any(vals):
            name = tier.upper() if tier in ("gpu", "cpu") else tier
            ax.bar(x, vals, bottom=bottom, color=color, label=f"served from {name}")
            bottom = [b + v for b, v in zip(bottom, vals)]
    bx = [i for i, r in enumerate(rows) if r["bound"] is not None]
    if bx:
        ax.scatter(bx, [100 * rows[i]["bound"] for i in bx], marker="_", s=900, color="black", zorder=3,
                   label="Belady bound (one pool of the total)")
    ceil = next((r["ceiling"] for r in rows if r["ceiling"] is not None), None)
    if ceil is not None:
        ax.axhline(100 * ceil, ls="--", color="grey", lw=1, label=f"ceiling (infinite cache) {100 * ceil:.1f}%")
    for i, r in enumerate(rows):
        ax.text(i, 100 * r["hit"] - 0.6, f"{100 * r['hit']:.1f}%", ha="center", va="top", fontsize=9,
                color="white", fontweight="bold")
        if r["bound"] is not None:
            ax.text(i + 0.3, 100 * r["bound"] + 0.4, f"bound {100 * r['bound']:.1f}%", ha="left", va="bottom",
                    fontsize=7)
    ax.set_xticks(list(x), [r["label"].replace(" + ", "\n+ ") for r in rows], fontsize=8)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Mooncake conversation trace: hit rate by tier configuration", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(40.0, 100 * (ceil or 0) + 6))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="results of pagedkv replay --json, in the order of the bars")
    ap.add_argument("--out", default="benchmarks/results/replay_tiers.png", help="the chart (PNG)")
    args = ap.parse_args(argv)
    rows = configs([json.loads(Path(f).read_text()) for f in args.json])
    print(table(rows))
    print(f"chart: {plot(rows, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
