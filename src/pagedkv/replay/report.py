"""Replay results: the JSON document, a text table and the hit-rate chart (the Mooncake paper's Fig. 9).

JSON document (one run, one implementation)::

    {"trace": name, "requests": n, "prompt_tokens": t, "ceiling": hit rate at infinite capacity,
     "impl": "pagedkv", "mode": "sequence", "block_size": 16, "bound_block_size": 16 or null,
     "points": [{"capacity_tokens", "cpu_capacity_tokens", "hit_rate", "gpu_hit_rate", "cpu_hit_rate", "bound",
                 "seconds", "evictions", "demotions", "promotions", "requests", "skipped", ...}],
     "command": ..., "versions": {...}}

``python -m pagedkv.replay.report A.json [B.json ...] [--plot DIR]`` prints several runs side by side (e.g.
pagedkv and each anchor, each run in its own virtualenv) and draws them on one chart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["build_doc", "format_table", "format_side_by_side", "plot", "main"]


def build_doc(trace_name: str, requests: int, prompt_tokens: int, ceiling: float | None, points: list,
              *, impl: str, mode: str, block_size: int, bound_block_size: int | None, **meta) -> dict:
    """The JSON document of one run (``points``: :class:`PointResult` objects)."""
    return {"trace": trace_name, "requests": requests, "prompt_tokens": prompt_tokens, "ceiling": ceiling,
            "impl": impl, "mode": mode, "block_size": block_size, "bound_block_size": bound_block_size,
            "points": [p.to_json() for p in points], **meta}


def _tokens(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div and n % (div // 10) == 0:
            return f"{n / div:g}{unit}"
    return f"{n:,}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _n(x) -> str:
    return "-" if x is None else f"{x:,}"


def _table(header: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_table(doc: dict) -> str:
    """One run as text: a header line (trace, requests, ceiling) and one row per capacity point."""
    head = (f"{doc['trace']}: {doc['requests']:,} requests, {doc['prompt_tokens']:,} prompt tokens, "
            f"{doc['impl']}, {doc['mode']} mode, blocks of {doc['block_size']}; ceiling {_pct(doc['ceiling'])}")
    rows = []
    for p in doc["points"]:
        rows.append([_tokens(p["capacity_tokens"]), _tokens(p["cpu_capacity_tokens"]) if p["cpu_capacity_tokens"]
                     else "-", _pct(p["hit_rate"]), _pct(p["gpu_hit_rate"]),
                     _pct(p["cpu_hit_rate"]) if p["cpu_hit_tokens"] is not None else "-", _pct(p["bound"]),
                     _n(p["evictions"]), _n(p["demotions"]), _n(p["promotions"]), _n(p["skipped"]),
                     f"{p['seconds']:.2f}"])
    header = ["capacity", "cpu", "hit rate", "gpu", "cpu", "bound", "evictions", "demoted", "promoted", "skipped",
              "seconds"]
    if any(p.get("disk_hit_tokens") is not None or p.get("shared_hit_tokens") is not None for p in doc["points"]):
        # the tiers below the CPU tier (pagedkv.replay.tiered): their capacities and hit rates after the CPU's
        header[5:5] = ["disk", "shared", "disk hit", "shared hit"]
        for r, p in zip(rows, doc["points"]):
            r[5:5] = [_tokens(p[k]) if p.get(k) else "-" for k in ("disk_capacity_tokens", "shared_capacity_tokens")]
            r[7:7] = [_pct(p.get(k)) if p.get(k.replace("rate", "tokens")) is not None else "-"
                      for k in ("disk_hit_rate", "shared_hit_rate")]
    table = _table(header, rows)
    extra = [f"  {_tokens(p['capacity_tokens'])}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                              for k, v in p["extra"].items() if k != "model")
             for p in doc["points"] if p.get("extra")]
    return "\n".join([head, table] + ([f"{doc['mode']} mode:"] + extra if extra else []))


def format_side_by_side(docs: list[dict]) -> str:
    """Several runs of one trace (one per implementation): hit rate and seconds per capacity."""
    caps = sorted({p["capacity_tokens"] for d in docs for p in d["points"]})
    by = [{p["capacity_tokens"]: p for p in d["points"]} for d in docs]
    header = ["capacity"] + [h for d in docs for h in (f"{d['impl']} hit", f"{d['impl']} s")] + ["bound"]
    rows = []
    for c in caps:
        row = [_tokens(c)]
        bound = None
        for m in by:
            p = m.get(c)
            row += [_pct(p["hit_rate"]), f"{p['seconds']:.1f}"] if p else ["-", "-"]
            bound = bound if bound is not None else (p or {}).get("bound")
        rows.append(row + [_pct(bound)])
    ceil = next((d["ceiling"] for d in docs if d.get("ceiling") is not None), None)
    return f"{docs[0]['trace']}: ceiling {_pct(ceil)}\n" + _table(header, rows)


def plot(docs: list[dict], outdir: str | Path, name: str | None = None) -> Path:
    """Hit rate against capacity (log scale) for each run, with the ceiling and Belady's bound. Returns the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    bound_pts: dict[int, float] = {}
    # one series per run, except that runs with a CPU tier are merged per (impl, mode, GPU capacity) and drawn
    # against the total capacity (GPU + CPU tokens)
    series: dict[tuple, list] = {}
    for d in docs:
        for p in d["points"]:
            tier = p.get("cpu_capacity_tokens") or 0
            key = (d["impl"], d["mode"], p["capacity_tokens"] if tier else None)
            series.setdefault(key, []).append(p)
    for i, ((impl, mode, gpu), pts) in enumerate(series.items()):
        pts = sorted(pts, key=lambda p: p["capacity_tokens"] + (p.get("cpu_capacity_tokens") or 0))
        label = impl if mode == "sequence" else f"{impl} ({mode})"
        if gpu is not None:
            label += f", {_tokens(gpu)} GPU + CPU tier"
        # later runs drawn thinner on top, so identical curves (pagedkv and vLLM V1) both stay visible
        ax.plot([p["capacity_tokens"] + (p.get("cpu_capacity_tokens") or 0) for p in pts],
                [100 * p["hit_rate"] for p in pts], marker="o",
                linestyle=("-", "--", ":", "-.")[i % 4], markersize=max(9 - 3 * i, 3), linewidth=max(3 - i, 1),
                color=f"C{i}", label=label)
        for p in pts:
            if p.get("bound") is not None:
                bound_pts.setdefault(p["capacity_tokens"], p["bound"])
    if bound_pts:
        xs = sorted(bound_pts)
        bb = next((d.get("bound_block_size") for d in docs if d.get("bound_block_size")), None)
        ax.plot(xs, [100 * bound_pts[x] for x in xs], "s--", color="C7",
                label=f"Belady (offline optimum{f', blocks of {bb}' if bb else ''})")
    ceil = next((d["ceiling"] for d in docs if d.get("ceiling") is not None), None)
    if ceil is not None:
        ax.axhline(100 * ceil, color="k", linestyle=":", label=f"ceiling (infinite cache) {100 * ceil:.1f}%")
    ax.set_xscale("log")
    ax.set_xlabel("prefix cache capacity (tokens; with a CPU tier: GPU + CPU)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{docs[0]['trace']}: {docs[0]['requests']:,} requests, {docs[0]['mode']} mode", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    stem = name or f"replay-{Path(docs[0]['trace']).stem}"
    path = outdir / f"{stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from .._help import HelpFormatter, plain

    ap = argparse.ArgumentParser(prog="python -m pagedkv.replay.report", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON files written by `pagedkv replay --json`")
    ap.add_argument("--plot", metavar="DIR", help="write the chart of all runs into DIR")
    args = ap.parse_args(argv)
    try:
        docs = [json.loads(Path(p).read_text()) for p in args.results]
    except (OSError, ValueError) as e:
        print(f"pagedkv replay report: error: {e}", file=sys.stderr)
        return 2
    for d in docs:
        print(format_table(d), end="\n\n")
    if len(docs) > 1:
        print(format_side_by_side(docs))
    if args.plot:
        print(f"chart: {plot(docs, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
