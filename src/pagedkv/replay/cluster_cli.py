"""``pagedkv replay TRACE --replicas N [--route R ...] [--balance-slack S] [--shared-capacity T]``: the cluster
replay's command part
(called from :mod:`pagedkv.replay.__main__`; the replay itself is :mod:`pagedkv.replay.cluster`): run, JSON document, table, chart.

JSON document: the single-manager replay's (``trace``, ``requests``, ``prompt_tokens``, ``ceiling``, ``impl``,
``mode``, ``block_size``, ``command``, ``versions``, ``machine``) plus ``replicas`` and ``cluster: true``; each
entry of ``points`` is one (capacity, route) pair with the :class:`~pagedkv.replay.cluster.ClusterPoint` fields (``replicas``,
``route``, ``load_imbalance``, ``per_replica``, ``predicted_hit_tokens``, ``pooled_hit_rate``, ...), and
``pooled`` holds the reference points (one manager of ``replicas x capacity``). With ``--shared-capacity`` the
document has ``shared_capacity_tokens`` and each point ``shared_hit_tokens``, ``shared_hit_rate`` and, per
replica, ``gpu_hit_tokens`` / ``shared_hit_tokens``; the pooled reference is then one manager of ``replicas x
capacity`` with nothing below it.
"""

from __future__ import annotations

import platform
import shlex
import sys
from pathlib import Path

from ..cluster.policy import ROUTES
from .command import DEFAULT_CAPACITIES, progress_bar

__all__ = ["run_cluster", "format_table", "plot"]


def run_cluster(args, error_cls) -> dict:
    from .bound import ceiling, node_trace
    from .cluster import replay_cluster, replay_pooled
    from .trace import TRACE_BLOCK, load_trace

    n_rep = args.replicas if args.replicas is not None else 1
    if n_rep < 1:
        raise error_cls(f"--replicas must be >= 1, got {n_rep}")
    if args.mode != "sequence":
        raise error_cls("--replicas replays in sequence mode only")
    shared_cap = getattr(args, "shared_capacity", 0) or 0
    sw = getattr(args, "shared_weight", None)
    if sw is not None and not 0 <= sw <= 1:
        raise error_cls(f"--shared-weight must lie in [0, 1], got {sw}")
    if shared_cap and shared_cap < bs_of(args):
        raise error_cls(f"--shared-capacity {shared_cap} is less than one block")
    if args.impl != "pagedkv" or args.cpu_capacity or args.bound:
        raise error_cls("--replicas does not combine with --impl, --cpu-capacity or --bound")
    if args.balance_slack < 0:
        raise error_cls(f"--balance-slack must be >= 0, got {args.balance_slack}")
    bs = args.block_size
    if bs < 1 or TRACE_BLOCK % bs:
        raise error_cls(f"--block-size must divide {TRACE_BLOCK}, got {bs}")
    if args.limit is not None and args.limit < 1:
        raise error_cls(f"--limit must be >= 1, got {args.limit}")
    caps = args.capacity or list(DEFAULT_CAPACITIES)
    for c in caps:
        if c < bs:
            raise error_cls(f"--capacity {c} is less than one block of {bs} tokens")
    routes = list(dict.fromkeys(args.route or ROUTES))
    trace = load_trace(args.trace, args.limit)
    ceil = ceiling(node_trace(trace, bs)) / trace.prompt_tokens
    n = len(trace)
    bar = progress_bar(n * len(caps) * (len(routes) + 1), args.no_progress)
    tick = bar.update if bar is not None else None
    say = bar.write if bar is not None else print
    say(f"{trace.name}: {n:,} requests, {trace.prompt_tokens:,} prompt tokens; ceiling {100 * ceil:.1f}%; "
        f"{n_rep} replicas")
    points, pooled = [], []
    try:
        for c in caps:
            if bar is not None:
                bar.set_description(f"pooled {n_rep} x {c:,}")
            ref = replay_pooled(trace, c, n_rep, block_size=bs, progress=tick)
            pooled.append(ref.to_json())
            say(f"  {n_rep} x {c:,} tokens pooled: hit rate {100 * ref.hit_rate:.1f}%, {ref.seconds:.1f} s")
            for route in routes:
                if bar is not None:
                    bar.set_description(f"{route} {n_rep} x {c:,}")
                p = replay_cluster(trace, c, n_rep, route, block_size=bs, balance_slack=args.balance_slack,
                                   progress=tick, shared_capacity_tokens=shared_cap,
                                   weights=None if sw is None else {"SHARED": sw})
                p.pooled_hit_rate = ref.hit_rate
                points.append(p.to_json())
                split = (f" (GPU {100 * p.gpu_hit_rate:.1f}%, shared {100 * p.shared_hit_rate:.1f}%)"
                         if shared_cap else "")
                say(f"  {n_rep} x {c:,} tokens {route}: hit rate {100 * p.hit_rate:.1f}%{split}, "
                    f"imbalance {p.load_imbalance:.2f}, {p.seconds:.1f} s")
    finally:
        if bar is not None:
            bar.close()
    import numpy

    import pagedkv

    return {"trace": trace.name, "requests": n, "prompt_tokens": trace.prompt_tokens, "ceiling": ceil,
            "impl": "pagedkv", "mode": "sequence", "block_size": bs, "bound_block_size": None, "cluster": True,
            "replicas": n_rep, "shared_capacity_tokens": shared_cap, "points": points, "pooled": pooled,
            "command": "pagedkv replay " + " ".join(shlex.quote(a) for a in args.argv),
            "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                         "pagedkv": pagedkv.__version__, "impl": "pagedkv"},
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}}


def bs_of(args) -> int:
    return args.block_size


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(doc: dict) -> str:
    """The cluster run as text: one row per (capacity, route), then the pooled reference."""
    from .report import _table, _tokens

    sc = doc.get("shared_capacity_tokens") or 0
    head = (f"{doc['trace']}: {doc['requests']:,} requests, {doc['prompt_tokens']:,} prompt tokens, "
            f"{doc['replicas']} replicas" + (f" + a shared tier of {_tokens(sc)} tokens" if sc else "") +
            f", sequence mode, blocks of {doc['block_size']}; ceiling {_pct(doc['ceiling'])}")
    rows = []
    for p in doc["points"]:
        per = [x["hit_rate"] for x in p["per_replica"]]
        split = [_pct(p.get("gpu_hit_rate")), _pct(p.get("shared_hit_rate"))] if sc else []
        rows.append([_tokens(p["capacity_tokens"]), p["route"],
                     "-" if p["balance_slack"] is None else f"{p['balance_slack']:g}", _pct(p["hit_rate"]), *split,
                     f"{p['load_imbalance']:.2f}", f"{_pct(min(per))}..{_pct(max(per))}",
                     _pct(p["predicted_hit_tokens"] / p["prompt_tokens"] if p["prompt_tokens"] else 0),
                     _pct(p["pooled_hit_rate"]), str(p["skipped"]), f"{p['seconds']:.1f}"])
    for p in doc.get("pooled", []):
        rows.append([_tokens(p["capacity_tokens"]), "pooled (1 manager)", "-", _pct(p["hit_rate"]),
                     *(["-", "-"] if sc else []), "-", "-", "-", "-", str(p["skipped"]), f"{p['seconds']:.1f}"])
    return head + "\n" + _table(["per replica", "route", "slack", "hit rate", *(["GPU", "shared"] if sc else []),
                                 "imbalance", "replicas' hit rates", "predicted", "pooled", "skipped", "seconds"],
                                rows)


def plot(docs: list[dict], outdir, name: str | None = None) -> Path:
    """Bars: hit rate of each route (load imbalance written on top) beside the pooled cache, per capacity;
    the ceiling as a line. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = docs[0]
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    caps = sorted({p["capacity_tokens"] for p in doc["points"]})
    routes = list(dict.fromkeys(p["route"] for p in doc["points"]))
    series = routes + ["pooled"]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(caps) * len(series) / 2), 4.8))
    from .report import _tokens

    for j, s in enumerate(series):
        xs, ys, labels = [], [], []
        for i, c in enumerate(caps):
            if s == "pooled":
                p = next((q for q in doc["pooled"] if q["capacity_tokens"] == doc["replicas"] * c), None)
                lab = "1 cache"
            else:
                p = next((q for q in doc["points"] if q["capacity_tokens"] == c and q["route"] == s), None)
                lab = f"x{p['load_imbalance']:.2f}" if p else ""
            if p is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(100 * p["hit_rate"])
            labels.append(lab)
        bars = ax.bar(xs, ys, width * 0.95, label=s if s != "pooled" else f"pooled ({doc['replicas']} x capacity, one "
                                                                           f"manager)", color=f"C{j}")
        for b, lab, y in zip(bars, labels, ys):
            ax.text(b.get_x() + b.get_width() / 2, y - 0.5, f"{y:.1f}%\n{lab}", ha="center", va="top", fontsize=7,
                    color="white" if y > 4 else "black")
    if doc.get("ceiling") is not None:
        ax.axhline(100 * doc["ceiling"], color="k", linestyle=":", label=f"ceiling {100 * doc['ceiling']:.1f}%")
    ax.set_xticks(range(len(caps)))
    ax.set_xticklabels([f"{doc['replicas']} x {_tokens(c)}" for c in caps])
    ax.set_xlabel("replicas x prefix-cache capacity (tokens)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100 * max(doc.get("ceiling") or 0, 0.01) * 1.25)
    ax.set_title(f"{doc['trace']}: {doc['requests']:,} requests, {doc['replicas']} replicas "
                 f"(label: load imbalance max/mean)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = outdir / f"{name or 'cluster-' + Path(doc['trace']).stem}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: pagedkv replay TRACE --replicas N")
