"""The text report of the decode-step ablation (:func:`pagedkv.bench.ablation.run_ablation`'s result)."""

from __future__ import annotations

from .ablation_variants import MODES

__all__ = ["format_table"]

_MODE_TITLES = {
    "step": "step: slot mapping + batch block tables + seq lens + CoW (what the engine needs)",
    "append": "append: bookkeeping only (slot mapping + CoW, no tables)",
}


def format_table(result: dict) -> str:
    """The result of :func:`run_ablation` as a text report."""
    c = result["config"]
    out = [
        f"pagedkv ablation: decode step, batch {c['batch']}, prompt {c['prompt_len']}, {c['steps']} steps, "
        f"block_size {c['block_size']}, pool {c['num_blocks']} blocks",
        f"{c['repeats']} repeats (+{c['warmup']} warmup), variants interleaved; per repeat the median us over the "
        "steps; across repeats min / median / max",
        "fill-step: median over repeats of the median us of the steps where every sequence takes a new block",
        "ratios: ratio of medians [min/max .. max/min]; 'noise' = the two min..max ranges overlap",
    ]
    hdr = f"{'variant':<18} {'min':>9} {'median':>9} {'max':>9} {'fill-step':>10}   {'x pagedkv':<22} {'x py-list':<22}"
    for mode in MODES:
        out += ["", _MODE_TITLES[mode], hdr, "-" * len(hdr)]
        for name, row in result["results"][mode].items():
            cells = []
            for ref in ("pagedkv", "py-list"):
                cmp = row[f"vs_{ref}"]
                if name == ref:
                    cells.append("1")
                else:
                    star = "" if cmp["outside_noise"] else " ~"
                    cells.append(f"{cmp['ratio']:.3g} [{cmp['lo']:.3g}..{cmp['hi']:.3g}]{star}")
            fill = f"{row['fill']['median']:.1f}" if row["fill"] else "-"
            out.append(
                f"{name:<18} {row['min']:>9.1f} {row['median']:>9.1f} {row['max']:>9.1f} "
                f"{fill:>10}   {cells[0]:<22} {cells[1]:<22}"
            )
    out += ["", "verdicts (~ marks ratios inside noise):"]
    for mode in MODES:
        for v in result["verdicts"][mode]:
            out.append(f"  [{mode:<6}] {v['text']} ({v['delta_us']:+.1f} us/step)")
    mem = result["memory"]
    out += [
        "",
        f"bookkeeping per block, fresh pool of {mem['num_blocks']} blocks (tracemalloc); pool = whole manager "
        "(refcounts + free list + block objects); gc = tracked objects per block and extra ms per full gc.collect()",
        f"{'design':<12} {'refcounts B/block':>18} {'pool B/block':>13} {'gc objs/block':>14} {'gc ms':>7}",
    ]
    for row in mem["rows"]:
        out.append(
            f"{row['design']:<12} {row['refcounts_bytes_per_block']:>18.1f} {row['pool_bytes_per_block']:>13.1f} "
            f"{row['gc_tracked_per_block']:>14.2f} {row['gc_ms']:>7.2f}"
        )
    e = result["environment"]
    out += ["", f"python {e['python']}, numpy {e['numpy']}, {e['machine']}, {e['cpus']} cpus; "
            f"{result['elapsed_s']:.0f} s"]
    return "\n".join(out)
