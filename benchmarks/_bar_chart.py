"""What the bar-chart scripts of the tiers share (tier_replay_chart.py, cluster_shared_chart.py,
tier_figures_chart.py): token counts written short, percentages, stacked bars with reference ticks, the trace's
ceiling, the figure saved, and the ``main`` that reads result files, prints a Markdown table and writes a PNG.

Not a benchmark itself; the scripts import it from their own folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Sequence


def tok(n: int) -> str:
    """A token count written short: 300k, 3.3M."""
    for unit, div in (("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal ('-' for None)."""
    return "-" if x is None else f"{100 * x:.1f}%"


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def stacked_bars(ax, stacks: Sequence[tuple[str, Sequence[float], str]], *, ticks=None, tick_label: str = "",
                 tick_size: int = 900, ceiling: float | None = None, totals: Sequence[float] | None = None,
                 total_inside: bool = False) -> None:
    """Bars stacked from ``stacks`` (label, values in percent, colour; an all-zero stack is left out), with
    optional reference ``ticks`` (a value in percent or None per bar), a dashed ``ceiling`` line (percent) and each
    bar's ``totals`` written on it (inside, white, when ``total_inside``; else above)."""
    n = len(stacks[0][1])
    x = list(range(n))
    bottom = [0.0] * n
    for label, vals, color in stacks:
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if ticks is not None:
        tx = [i for i, t in enumerate(ticks) if t is not None]
        if tx:
            ax.scatter(tx, [ticks[i] for i in tx], marker="_", s=tick_size, color="black", zorder=3, label=tick_label)
    if ceiling is not None:
        ax.axhline(ceiling, ls="--", color="grey", lw=1, label=f"ceiling (infinite cache) {ceiling:.1f}%")
    for i, t in enumerate(totals or []):
        if total_inside:
            ax.text(i, t - 0.6, f"{t:.1f}%", ha="center", va="top", fontsize=9, color="white", fontweight="bold")
        else:
            ax.text(i, t + 0.4, f"{t:.1f}%", ha="center", va="bottom", fontsize=8)


def save(fig, out: Path) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def chart_main(doc: str, rows_of: Callable[[list[dict]], list[dict]], table: Callable[[list[dict]], str],
               plot: Callable[[list[dict], Path], Path], default_out: str, json_help: str, argv=None) -> int:
    """The scripts' ``main``: read the JSON files given, print ``table(rows)``, write ``plot(rows, out)``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("json", nargs="+", help=json_help)
    ap.add_argument("--out", default=default_out, help="the chart (PNG)")
    args = ap.parse_args(argv)
    rows = rows_of([json.loads(Path(f).read_text()) for f in args.json])
    print(table(rows))
    print(f"chart: {plot(rows, Path(args.out))}")
    return 0
