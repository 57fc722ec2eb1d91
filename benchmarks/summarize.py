"""Summarise benchmark JSON files (from `python -m pagedkv.bench`) as a markdown table of same-run ratios.

    python benchmarks/summarize.py benchmarks/results/bench-*.json

For each file, every anchor is compared with the pagedkv run of the same file (the same process, machine state
and workload), on the median block-manager microseconds per decode step at the run's largest batch and on the
total block-manager seconds of the whole replay.
"""

from __future__ import annotations

import json
import sys


def rows(paths):
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        by = {}
        for r in d["results"]:
            if r.get("status") == "ok" and r["workload"] != "scale":
                by.setdefault(r["workload"], {})[r["impl"]] = r["metrics"]
        for wl, impls in by.items():
            base = impls.get("pagedkv")
            for name, m in impls.items():
                if name == "pagedkv" or base is None:
                    continue
                yield wl, name, base, m


def main(paths):
    print("| workload | anchor | batch | pagedkv us/step | anchor us/step | speed-up | pagedkv bm s | anchor bm s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wl, name, p, a in sorted(rows(paths), key=lambda t: (t[1], t[0])):
        ps, as_ = p["median_us_per_step_at_max_batch"]["median"], a["median_us_per_step_at_max_batch"]["median"]
        pt, at = p["total_bm_s"]["median"], a["total_bm_s"]["median"]
        print(f"| {wl} | {name} | {p['max_batch']} | {ps:.1f} | {as_:.1f} | {as_ / ps:.1f}x | {pt:.3f} | {at:.3f} | "
              f"{at / pt:.1f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
