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

import argparse
import json
import sys
from pathlib import Path


def _tok(n: int) -> str:
    for unit, div in (("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


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
    s = f"{r['replicas']} x {_tok(r['capacity'])}"
    return s + (f" + shared {_tok(r['shared'])}" if r["shared"] else "")


def table(rows: list[dict]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    out = ["| replicas x pool (tokens) | shared tier | route | hit rate | own pool (GPU) | loaded from shared | "
           "imbalance | replicas' hit rates | predicted by the index | pooled (one manager) | replay s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['replicas']} x {_tok(r['capacity'])} | {_tok(r['shared']) if r['shared'] else 'none'} | "
                   f"{r['route']} | {pct(r['hit'])} | {pct(r['gpu'])} | {pct(r['loaded']) if r['shared'] else ''} | "
                   f"{r['imbalance']:.2f} | {pct(r['per'][0])}..{pct(r['per'][1])} | "
                   f"{pct(r['predicted']) if r['route'] == 'prefix' else '-'} | {pct(r['pooled'])} | "
                   f"{r['seconds']:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(rows) + 2.5), 4.6))
    x = list(range(len(rows)))
    gpu = [100 * r["gpu"] for r in rows]
    loaded = [100 * r["loaded"] for r in rows]
    ax.bar(x, gpu, color="#4c72b0", label="served from the replica's own pool")
    ax.bar(x, loaded, bottom=gpu, color="#8172b3", label="loaded from the shared tier")
    px = [i for i, r in enumerate(rows) if r["pooled"] is not None]
    if px:
        ax.scatter(px, [100 * rows[i]["pooled"] for i in px], marker="_", s=500, color="black", zorder=3,
                   label="pooled: one manager of N x the pool")
    ceil = next((r["ceiling"] for r in rows if r["ceiling"] is not None), None)
    if ceil is not None:
        ax.axhline(100 * ceil, ls="--", color="grey", lw=1, label=f"ceiling (infinite cache) {100 * ceil:.1f}%")
    for i, r in enumerate(rows):
        ax.text(i, 100 * r["hit"] + 0.4, f"{100 * r['hit']:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{label(r)}\n{r['route']}".replace(" + shared", "\n+ shared") for r in rows], fontsize=7)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Mooncake conversation trace over N replicas:\nprefix routing vs round robin, with and without a "
                 "shared tier", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(40.0, 100 * (ceil or 0) + 6))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="results of pagedkv replay --replicas N --json, in the order of the bars")
    ap.add_argument("--out", default="benchmarks/results/cluster/shared.png", help="the chart (PNG)")
    args = ap.parse_args(argv)
    rows = rows_of([json.loads(Path(f).read_text()) for f in args.json])
    print(table(rows))
    print(f"chart: {plot(rows, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
