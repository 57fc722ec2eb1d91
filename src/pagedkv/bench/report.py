"""Text tables, pagedkv/anchor ratios and PNG charts of benchmark results.

``python -m pagedkv.bench.report RESULTS.json [--plot DIR]`` re-renders a saved result file.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Sequence

__all__ = ["format_table", "format_ratios", "ratios", "plot", "main"]


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        if abs(x) >= 1e5:
            return f"{x:.3g}"
        return f"{x:.{digits}f}"
    return str(x)


def _mmm(d: dict, digits: int = 1) -> str:
    return f"{_f(d['median'], digits)} [{_f(d['min'], digits)}-{_f(d['max'], digits)}]"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def format_table(doc: dict) -> str:
    """The results as text: one table for the replay workloads, one for the scale workload, then skips/errors."""
    replay, scale, other = [], [], []
    for r in doc["results"]:
        if r.get("status") != "ok":
            other.append(f"  {r['workload']:<22} {r['impl']:<10} {r.get('status')}: {r.get('reason')}")
            continue
        m = r["metrics"]
        if "pools" in m:
            for p in m["pools"]:
                scale.append([r["impl"], f"{p['num_blocks']:,}", "on" if p["prefix_caching"] else "off",
                              _mmm(p["construct_ms"], 2), _f(p["bytes"] / 2**20, 2), _f(p["bytes_per_block"], 1),
                              _f(p["bytes_per_block_full"], 1) if "bytes_per_block_full" in p else "-"])
            continue
        extra = ""
        if "max_blocks_per_seq" in m:
            extra = f"{m['max_blocks_per_seq']:.0f}/{m['blocks_per_seq_without_window']} blk/seq"
        replay.append([
            r["workload"], r["impl"], str(m["max_batch"]), _mmm(m["median_us_per_step"]),
            _f(m["p99_us_per_step"]["median"]), _f(m["median_us_per_step_at_max_batch"]["median"]),
            _f(m["us_per_seq_step"]["median"], 3), _mmm(m["total_bm_s"], 3), f"{100 * m['hit_rate']:.1f}%",
            str(m["preemptions"]), str(m["copy_on_writes"]), f"{m['swap_outs']}/{m['swap_ins']}", extra,
        ])
    parts = []
    if replay:
        parts.append(_table(
            ["workload", "impl", "batch", "us/step med [min-max]", "p99", "us/step@batch", "us/seq/step",
             "bm s med [min-max]", "hit", "preempt", "cow", "swap o/i", "window"], replay))
    if scale:
        parts.append(_table(["impl", "blocks", "cache", "construct ms med [min-max]", "MiB", "bytes/block",
                                    "bytes/block, cache 90% full"], scale))
    if other:
        parts.append("not run:\n" + "\n".join(other))
    return "\n\n".join(parts)


def ratios(doc: dict) -> list[dict]:
    """pagedkv / anchor per workload: median us per decode step and total block-manager seconds (or
    construction time for the scale workload). Below 1 means pagedkv is faster."""
    by: dict[tuple[str, str], dict] = {(r["workload"], r["impl"]): r for r in doc["results"] if r.get("status") == "ok"}
    out = []
    for (wl, impl), r in by.items():
        if impl == "pagedkv" or (wl, "pagedkv") not in by:
            continue
        p, a = by[(wl, "pagedkv")]["metrics"], r["metrics"]
        if "pools" in a:
            for pp, ap in zip(p["pools"], a["pools"]):
                if (pp["num_blocks"], pp["prefix_caching"]) == (ap["num_blocks"], ap["prefix_caching"]):
                    out.append({"workload": f"{wl} {pp['num_blocks']:,}{' cache' if pp['prefix_caching'] else ''}",
                                "anchor": impl,
                                "step": pp["construct_ms"]["median"] / ap["construct_ms"]["median"],
                                "total": pp["bytes"] / ap["bytes"] if ap["bytes"] else float("nan")})
            continue
        out.append({"workload": wl, "anchor": impl,
                    "step": p["median_us_per_step"]["median"] / a["median_us_per_step"]["median"],
                    "total": p["total_bm_s"]["median"] / a["total_bm_s"]["median"]})
    return out


def format_ratios(doc: dict) -> str:
    rs = ratios(doc)
    if not rs:
        return ""
    rows = []
    for r in rs:
        rows.append([r["workload"], f"pagedkv/{r['anchor']}", f"{r['step']:.3f}x", f"{r['total']:.3f}x",
                     f"{1 / r['step']:.1f}x faster" if r["step"] < 1 else f"{r['step']:.1f}x slower"])
    return _table(["workload", "ratio", "us/step (scale: construct)", "bm total (scale: bytes)", ""], rows)


def plot(doc: dict, outdir: str | Path) -> list[Path]:
    """Write PNG charts into ``outdir``: step cost vs batch size, block usage over time, prefix-cache hit rate,
    and construction cost of the scale workload. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in doc["results"] if r.get("status") == "ok" and "series" in r.get("metrics", {})]
    workloads = list(dict.fromkeys(r["workload"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in doc["results"]))
    colors = {name: f"C{i}" for i, name in enumerate(impls)}
    written: list[Path] = []

    def grid(n: int):
        cols = min(3, max(1, n))
        rows = -(-n // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        return fig, axes.flat

    if workloads:
        fig, axes = grid(len(workloads))
        for ax, wl in zip(axes, workloads):
            for r in ok:
                if r["workload"] != wl:
                    continue
                cb = r["metrics"]["series"]["cost_by_batch"]
                if cb:
                    ax.plot([c[0] for c in cb], [c[1] for c in cb], ".", ms=3, label=r["impl"], color=colors[r["impl"]])
            ax.set_title(wl)
            ax.set_xlabel("decode batch size")
            ax.set_ylabel("block-manager us / step")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Block-manager cost per step vs batch size\n(median per batch size)" if len(workloads) == 1 else
                     "Per-step block-manager cost vs batch size (median per batch size)")
        fig.tight_layout()
        p = outdir / "step_cost_vs_batch.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

        fig, axes = grid(len(workloads))
        for ax, wl in zip(axes, workloads):
            for r in ok:
                if r["workload"] != wl:
                    continue
                s = r["metrics"]["series"]
                ax.plot(s["usage_step"], s["usage_blocks"], lw=1, label=r["impl"], color=colors[r["impl"]])
                ax.axhline(s["num_gpu_blocks"], color="gray", lw=0.8, ls="--")
            ax.set_title(wl)
            ax.set_xlabel("step")
            ax.set_ylabel("GPU blocks in use")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Block usage over time (dashed: pool size)")
        fig.tight_layout()
        p = outdir / "block_usage.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

        pc = [wl for wl in workloads if any(r["workload"] == wl and r["metrics"]["cached_tokens"] for r in ok)] or \
            [wl for wl in workloads if wl.startswith("prefix")]
        if pc:
            fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(pc) * max(1, len(impls)) / 2, 3.8))
            width = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                vals = []
                for wl in pc:
                    r = next((r for r in ok if r["workload"] == wl and r["impl"] == impl), None)
                    vals.append(100 * r["metrics"]["hit_rate"] if r else 0.0)
                ax.bar([i + j * width for i in range(len(pc))], vals, width, label=impl, color=colors[impl])
            ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(pc))], pc)
            ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
            ax.set_ylim(0, 100)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            fig.tight_layout()
            p = outdir / "hit_rate.png"
            fig.savefig(p, dpi=110)
            plt.close(fig)
            written.append(p)

    scale = [r for r in doc["results"] if r.get("status") == "ok" and "pools" in r.get("metrics", {})]
    if scale:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in scale:
            for caching, ls in ((False, "-"), (True, "--")):
                pools = [p for p in r["metrics"]["pools"] if p["prefix_caching"] == caching]
                if not pools:
                    continue
                lab = f"{r['impl']}{' (cache)' if caching else ''}"
                x = [p["num_blocks"] for p in pools]
                a1.plot(x, [p["construct_ms"]["median"] for p in pools], "o" + ls, label=lab, color=colors[r["impl"]])
                a2.plot(x, [p["bytes_per_block"] for p in pools], "o" + ls, label=lab, color=colors[r["impl"]])
        for ax, yl in ((a1, "construction ms"), (a2, "bookkeeping bytes / block")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("pool size (blocks)")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = outdir / "scale.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    from .._help import HelpFormatter, plain

    ap = argparse.ArgumentParser(prog="python -m pagedkv.bench.report", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("results", help="a JSON file written by `python -m pagedkv.bench`")
    ap.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.results).read_text())
    print(format_table(doc))
    r = format_ratios(doc)
    if r:
        print()
        print(r)
    if args.plot:
        for p in plot(doc, args.plot):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


def save_result(doc: dict, out: str, kind: str, impls, quick: bool = False) -> Path:
    """Write a benchmark's JSON document as ``OUT/KIND-YYYYmmdd-HHMMSS-IMPL-IMPL[-quick].json``; returns the path."""
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = outdir / f"{kind}-{stamp}-{'-'.join(sorted(set(impls)))}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
