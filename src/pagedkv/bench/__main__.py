"""``python -m pagedkv.bench`` (also ``pagedkv bench``): the block-manager benchmark suite.

Replays offline throughput runs through pagedkv's BlockManager and, with ``--impl``, through anchors (other block
managers behind the same API, see :mod:`pagedkv.bench.anchors`; run under the anchor's virtualenv, e.g.
``.venv-anchor-v2/bin/python -m pagedkv.bench --impl pagedkv vllm_v2``). Only the block-manager calls are timed.
Results go to ``benchmarks/results/*.json`` with the machine, the versions and the exact command.

Sub-benchmarks (each has its own ``--help`` and ``--quick``):

``python -m pagedkv.bench ablation ...``  the hot-path ablation (:mod:`pagedkv.bench.ablation`);
``python -m pagedkv.bench sweep ...``     decode step vs batch size 1..1024, pagedkv against each anchor
                                          (:mod:`pagedkv.bench.sweep`; ``sweep report FILES --plot DIR`` merges);
``python -m pagedkv.bench hybrid ...``    KV cache groups (Gemma-3-like) against vLLM V1's hybrid coordinator:
                                          decode step at batch 1..1000, allocation with hybrid prefix hits
                                          (:mod:`pagedkv.bench.hybrid`);
``python -m pagedkv.bench single ...``    single-sequence calls (allocate, append_slots, fork, free) against a
                                          plain-Python reference and the anchors (:mod:`pagedkv.bench.single`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .._help import HelpFormatter, plain
from .harness import resolve_impl, run_workload
from .meta import machine as _machine, versions as _versions
from .report import format_ratios, format_table, plot
from .workloads import WORKLOAD_GROUPS, build_workloads, resolve_workloads

__all__ = ["main", "run_suite"]


def run_suite(args: argparse.Namespace, command: str) -> dict:
    workloads = resolve_workloads(args.workload, args.quick)
    impls = [resolve_impl(name) for name in args.impl]
    for impl in impls:
        if impl.unavailable:
            print(f"skipping {impl.name}: {impl.unavailable}", file=sys.stderr)
        elif impl.missing:
            print(f"note: {impl.version}: {impl.missing}", file=sys.stderr)
    units = [(wl, impl) for wl in workloads for impl in impls]
    total = sum(0 if impl.unavailable else args.repeats + args.warmup for _, impl in units)
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="run", disable=args.no_progress or None, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        bar = None
    results = []
    try:
        for wl, impl in units:
            if bar is not None:
                bar.set_description(f"{wl.name} / {impl.name}")
            tick = (lambda: bar.update(1)) if bar is not None else None
            rec = run_workload(wl, impl, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                               precheck=args.precheck, progress=tick)
            rec["params"] = wl.params()
            results.append(rec)
            if rec["status"] == "skipped" and not impl.unavailable:
                (bar.write if bar is not None else print)(f"skipped {wl.name} for {impl.name}: {rec['reason']}")
            elif rec["status"] == "error":
                (bar.write if bar is not None else print)(f"ERROR {wl.name} for {impl.name}: {rec['reason']}")
    finally:
        if bar is not None:
            bar.close()
    versions = _versions()
    versions["implementations"] = {i.name: i.version for i in impls if not i.unavailable}
    return {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "argv": list(sys.argv),
        "machine": _machine(),
        "versions": versions,
        "config": {"quick": args.quick, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
                   "precheck_append": args.precheck,
                   "impl": args.impl, "workload": [w.name for w in workloads]},
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ablation"]:
        from .ablation import main as ablation_main

        return ablation_main(argv[1:])
    if argv[:1] == ["sweep"]:
        from .sweep import main as sweep_main

        return sweep_main(argv[1:])
    if argv[:1] == ["hybrid"]:
        from .hybrid import main as hybrid_main

        return hybrid_main(argv[1:])
    if argv[:1] == ["single"]:
        from .single import main as single_main

        return single_main(argv[1:])
    names = [*build_workloads(False), *WORKLOAD_GROUPS]
    ap = argparse.ArgumentParser(prog="pagedkv bench", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run of a few seconds)")
    ap.add_argument("--impl", nargs="+", default=["pagedkv"], metavar="NAME",
                    help="implementations: pagedkv and anchors (vllm_v2, vllm_v1, nanovllm); default pagedkv")
    ap.add_argument("--workload", nargs="+", default=None, metavar="NAME",
                    help=f"workloads or groups (default: all): {', '.join(names)}")
    ap.add_argument("--repeats", type=int, default=None, help="measured runs per workload (default 5, quick 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1, quick 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workloads' prompts and fake model")
    ap.add_argument("--precheck", action="store_true",
                    help="pagedkv too asks can_append_slots before every decode_step (vLLM's call pattern; by "
                         "default the scheduler skips it for pagedkv, whose step is all-or-nothing)")
    ap.add_argument("--plot", metavar="DIR", help="also write PNG charts into DIR")
    ap.add_argument("--out", metavar="DIR", default="benchmarks/results", help="where the JSON goes")
    ap.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    args = ap.parse_args(argv)
    if args.list:
        for wl in build_workloads(args.quick).values():
            req = f"  (needs {', '.join(sorted(wl.requires))})" if wl.requires else ""
            print(f"{wl.name:<22} {wl.title}{req}")
        for g, members in WORKLOAD_GROUPS.items():
            print(f"{g:<22} = {' + '.join(members)}")
        return 0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    try:
        resolve_workloads(args.workload, args.quick)
    except KeyError as exc:
        ap.error(str(exc.args[0]))
    command = shlex.join([Path(sys.executable).name, "-m", "pagedkv.bench", *argv])
    doc = run_suite(args, command)
    print(format_table(doc))
    r = format_ratios(doc)
    if r:
        print()
        print("pagedkv / anchor (below 1: pagedkv is faster)")
        print(r)
    if not args.no_save:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        tag = "-".join(sorted(set(args.impl)))
        path = out / f"bench-{stamp}-{tag}{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {path}")
    if args.plot:
        for p in plot(doc, args.plot):
            print(f"wrote {p}")
    return 1 if any(r["status"] == "error" for r in doc["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
