"""``pagedkv replay TRACE.jsonl`` (also ``python -m pagedkv.replay``): replay a production request trace through
the prefix cache and report hit rates per capacity, the trace's ceiling and, with ``--bound``, Belady's optimum.

Core only (numpy, xxhash; tqdm and matplotlib when asked for): never imports torch. ``--impl vllm_v1`` (or
``nanovllm``) replays through an anchor's adapter instead; run it under that anchor's virtualenv and merge the JSON
files with ``python -m pagedkv.replay.report A.json B.json --plot DIR``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .._help import HelpFormatter, plain
from ..errors import PagedKVError
from ..retention.eviction import EVICTION_POLICIES
from .command import DEFAULT_CAPACITIES, progress_bar
from .point import all_or_nothing

__all__ = ["main", "parse_tokens"]

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """``"300000"``, ``"300k"``, ``"1M"``, ``"2.5m"`` -> tokens (an int >= 0)."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    mult = _SUFFIX.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        v = float(t) * mult if "." in t or "e" in t else int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 300000, 300k, 1M)") from None
    if isinstance(v, float) and abs(v - round(v)) < 1e-6:  # "33.3M": 33.3 * 10**6 is 33299999.999999996
        v = round(v)
    if v < 0 or v != int(v):
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}")
    return int(v)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedkv replay", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("trace", help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
                                  "hash_ids of 512-token blocks)")
    ap.add_argument("--capacity", type=parse_tokens, action="append", metavar="TOKENS",
                    help="GPU prefix-cache capacity in tokens (repeat for several points; suffixes k, M; "
                         "default 300k 1M 3M 10M)")
    ap.add_argument("--cpu-capacity", type=parse_tokens, default=0, metavar="TOKENS",
                    help="CPU tier of the prefix cache, in tokens; 0: none (needs a BlockManager with "
                         "cpu_prefix_cache)")
    ap.add_argument("--disk-capacity", type=parse_tokens, default=0, metavar="TOKENS",
                    help="a disk tier below the CPU tier, in tokens: takes the blocks the tier above evicts "
                         "(pagedkv.replay.tiered; sequence mode); 0: none")
    ap.add_argument("--shared-capacity", type=parse_tokens, default=0, metavar="TOKENS",
                    help="a shared tier below the disk tier, in tokens, written through; 0: none (with "
                         "--replicas: one store every replica reads and writes, pagedkv.replay.cluster)")
    ap.add_argument("--tier-order", choices=("chain", "lru", "lru-engine"), default="chain",
                    help="eviction order of the --disk-capacity / --shared-capacity tiers: chain (the disk tier's: "
                         "blocks whose parent left first, then a chain's tail before its head, LRU among them), "
                         "lru (plain LRU fed children first, as this replay did before issue 34) or lru-engine "
                         "(plain LRU fed parents first, as the engine writes: the disk tier before issue 34) "
                         "(default chain)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a divisor of 512)")
    ap.add_argument("--mode", choices=("sequence", "timed"), default="sequence",
                    help="sequence: allocate then free each request in order (the paper's Fig. 9); "
                         "timed: requests arrive at their timestamps and run concurrently")
    ap.add_argument("--bound", action="store_true", help="also compute Belady's offline optimum at each capacity")
    ap.add_argument("--bound-block", type=int, default=None, metavar="TOKENS",
                    help="block size of the bound (default: --block-size; 512 is far cheaper)")
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    ap.add_argument("--impl", default="pagedkv",
                    help="pagedkv or an anchor (vllm_v1, vllm_v2, nanovllm) run in its virtualenv")
    ap.add_argument("--groups", metavar="PRESET", default=None,
                    help="KV cache groups (a hybrid model): compare, at equal KV bytes, one table for all layers "
                         "with HybridBlockManager for preset gemma3 (1 full + 5 sliding W=512 groups) or gpt-oss "
                         "(1 full + 1 sliding W=128); sequence mode (pagedkv.replay.groups)")
    ap.add_argument("--compare-lru", action="store_true",
                    help="with --groups: also replay the groups without window retention (plain LRU, or the "
                         "--eviction-policy alone)")
    ap.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="lru",
                    help="the prefix cache's eviction policy (pagedkv.retention.eviction; sequence mode, also with "
                         "--groups): lru, slru (frequency-aware), session or density (each request hints its "
                         "conversation, derived from the prompts seen before it: pagedkv.replay.sessions), arc "
                         "(adaptive replacement)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    ap.add_argument("--plot", metavar="DIR", help="draw hit rate against capacity into DIR (matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = ap.add_argument_group("cluster (several replicas behind a router, sequence mode; pagedkv.replay.cluster)")
    c.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="replay over N replicas, each a manager of --capacity tokens, plus the pooled reference")
    c.add_argument("--route", action="append", choices=("round-robin", "least-loaded", "prefix", "prefix-approx"),
                   help="routing policy (repeat for several; default: all four)")
    c.add_argument("--balance-slack", type=float, default=0.2,
                   help="prefix routes skip a replica whose load would exceed (1 + slack) x the mean (0.2)")
    c.add_argument("--shared-weight", type=float, default=None, metavar="W",
                   help="prefix route: weight of a block in the shared tier (a GPU block weighs 1; default: "
                        "pagedkv.cluster.policy.TIER_WEIGHTS)")
    t = ap.add_argument_group("timed mode (service model, see pagedkv.replay.timed)")
    t.add_argument("--prefill-tps", type=float, default=50_000.0, help="uncached prompt tokens per second (50000)")
    t.add_argument("--decode-step-ms", type=float, default=30.0, help="ms per decode step of the batch (30)")
    t.add_argument("--max-running", type=int, default=64, help="most requests running at once (64)")
    t.add_argument("--watermark", type=float, default=0.01, help="fraction of blocks admission keeps free (0.01)")
    return ap


def _manager_cls(impl: str):
    if impl == "pagedkv":
        from ..manager import BlockManager

        return BlockManager, "pagedkv"
    from ..bench.anchors import load_anchor

    cls = load_anchor(impl)
    return cls, getattr(cls, "name", impl)


def run(args: argparse.Namespace) -> dict:
    """Run the replay described by parsed ``args`` and return the JSON document (printing as it goes)."""
    from .bound import belady, ceiling, node_trace
    from .point import PointResult
    from .report import build_doc
    from .sequence import replay_sequence
    from .timed import ServiceModel, replay_timed
    from .trace import TRACE_BLOCK, load_trace

    pol = args.eviction_policy
    _check_combinations(args)
    if args.replicas is not None or args.route:
        from .cluster_cli import run_cluster

        return run_cluster(args, _CliError)
    if args.groups is not None:
        return _run_groups(args)
    bs = args.block_size
    if bs < 1 or TRACE_BLOCK % bs:
        raise _CliError(f"--block-size must divide {TRACE_BLOCK}, got {bs}")
    bb = args.bound_block or bs
    if bb < 1 or TRACE_BLOCK % bb:
        raise _CliError(f"--bound-block must divide {TRACE_BLOCK}, got {bb}")
    if args.limit is not None and args.limit < 1:
        raise _CliError(f"--limit must be >= 1, got {args.limit}")
    caps = args.capacity or list(DEFAULT_CAPACITIES)
    for c in caps:
        if c < bs:
            raise _CliError(f"--capacity {c} is less than one block of {bs} tokens")
    model = ServiceModel(args.prefill_tps, args.decode_step_ms / 1000.0, args.max_running, args.watermark)
    cls, impl = _manager_cls(args.impl)
    if args.mode == "timed" and not all_or_nothing(cls):
        raise _CliError(f"--mode timed needs an all-or-nothing decode_step; {impl} has none (use sequence mode)")
    tiered = bool(args.disk_capacity or args.shared_capacity)
    if tiered and (args.mode != "sequence" or impl != "pagedkv"):
        raise _CliError("--disk-capacity / --shared-capacity replay pagedkv in sequence mode")
    if args.cpu_capacity:  # fail before the long part
        from .point import make_manager

        make_manager(cls, 1, bs, max(args.cpu_capacity // bs, 1))
    if pol != "lru":  # fail before the long part
        from .point import make_manager

        make_manager(cls, 1, bs, eviction_policy=pol)
    trace = load_trace(args.trace, args.limit)
    sessions = None
    if pol in ("session", "density"):
        from .sessions import conversation_ids

        sessions = conversation_ids(trace)
    nt = node_trace(trace, bs)  # the ceiling at the replay's block size
    ceil = ceiling(nt) / trace.prompt_tokens
    if args.bound and bb != bs:
        nt = node_trace(trace, bb)
    n = len(trace)
    bar = progress_bar(n * len(caps) * (2 if args.bound else 1), args.no_progress)
    tick = bar.update if bar is not None else None
    say = bar.write if bar is not None else print
    say(f"{trace.name}: {n:,} requests, {trace.prompt_tokens:,} prompt tokens; ceiling {100 * ceil:.1f}% "
        f"(infinite cache, blocks of {bs})")
    points: list[PointResult] = []
    try:
        for c in caps:
            if bar is not None:
                bar.set_description(f"{impl} {c:,} tokens")
            if tiered:
                from .tiered import replay_tiered

                p = replay_tiered(trace, c, block_size=bs, cpu_capacity_tokens=args.cpu_capacity,
                                  disk_capacity_tokens=args.disk_capacity,
                                  shared_capacity_tokens=args.shared_capacity, manager_cls=cls, impl=impl,
                                  progress=tick, tier_order=args.tier_order)
            elif args.mode == "sequence":
                p = replay_sequence(trace, c, block_size=bs, cpu_capacity_tokens=args.cpu_capacity,
                                    manager_cls=cls, impl=impl, progress=tick, eviction_policy=pol,
                                    sessions=sessions)
            else:
                p = replay_timed(trace, c, block_size=bs, cpu_capacity_tokens=args.cpu_capacity, model=model,
                                 manager_cls=cls, impl=impl, progress=tick)
            if args.bound:
                if bar is not None:
                    bar.set_description(f"Belady {c:,} tokens")
                # tiers: the bound of one pool of their total (no policy over the tiers can hold more blocks)
                total = c + (args.cpu_capacity + args.disk_capacity + args.shared_capacity if tiered else 0)
                hit, _ = belady(nt, total // bb, progress=tick)
                p.bound = hit / trace.prompt_tokens
            points.append(p)
            say(_point_line(p, c, tiered))
    finally:
        if bar is not None:
            bar.close()
    meta = _run_meta(args, impl)
    if pol != "lru":
        impl = f"{impl} {pol}"
    return build_doc(trace.name, n, trace.prompt_tokens, ceil, points, impl=impl, mode=args.mode, block_size=bs,
                     bound_block_size=bb if args.bound else None, eviction_policy=pol, **meta)


def _check_combinations(args: argparse.Namespace) -> None:
    """_CliError for options that do not combine (before anything is loaded)."""
    pol = args.eviction_policy
    if pol != "lru" and (args.mode != "sequence" or args.replicas is not None or args.route
                         or args.disk_capacity or args.shared_capacity):
        raise _CliError("--eviction-policy replays one manager (or its KV cache groups, --groups) in sequence mode "
                        "(no --mode timed, --replicas, --route, --disk-capacity or --shared-capacity)")
    if args.disk_capacity and (args.replicas is not None or args.route or args.groups):
        raise _CliError("--disk-capacity replays one manager (not with --replicas, --route or --groups)")
    if args.shared_capacity and args.groups:
        raise _CliError("--shared-capacity does not combine with --groups")
    if args.shared_weight is not None and args.replicas is None and not args.route:
        raise _CliError("--shared-weight needs --replicas")


def _point_line(p, capacity: int, tiered: bool) -> str:
    """The line printed for one capacity's replay point."""
    return (f"  {capacity:>12,} tokens: hit rate {100 * p.hit_rate:.1f}%"
            + (f" (gpu {100 * p.gpu_hit_rate:.1f}%, cpu {100 * p.cpu_hit_rate:.1f}%, disk "
               f"{100 * p.disk_hit_rate:.1f}%, shared {100 * p.shared_hit_rate:.1f}%)" if tiered else "")
            + (f", bound {100 * p.bound:.1f}%" if p.bound is not None else "")
            + "".join(f", {t} holds {p.extra[t + '_blocks_held']} blocks ({p.extra[t + '_detached_held']} past a "
                      f"block it lacks)" for t in ("disk", "shared") if t + "_detached_held" in p.extra)
            + f", {p.evictions if p.evictions is not None else '-'} evictions, {p.skipped} skipped, "
              f"{p.seconds:.2f} s")


def _run_meta(args: argparse.Namespace, impl: str) -> dict:
    """The command, versions and machine of a replay document."""
    import numpy

    import pagedkv

    return {"command": "pagedkv replay " + " ".join(shlex.quote(a) for a in args.argv),
            "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                         "pagedkv": pagedkv.__version__, "impl": impl},
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}}


class _CliError(Exception):
    pass


def _run_groups(args: argparse.Namespace) -> dict:
    """``--groups``: one table vs KV cache groups at equal bytes, per capacity (see pagedkv.replay.groups)."""
    from .groups import preset_groups, replay_groups
    from .trace import TRACE_BLOCK, load_trace

    bs = args.block_size
    if bs < 1 or TRACE_BLOCK % bs:
        raise _CliError(f"--block-size must divide {TRACE_BLOCK}, got {bs}")
    if args.mode != "sequence" or args.cpu_capacity or args.bound or args.impl != "pagedkv":
        raise _CliError("--groups replays pagedkv in sequence mode, without --cpu-capacity or --bound")
    if args.limit is not None and args.limit < 1:
        raise _CliError(f"--limit must be >= 1, got {args.limit}")
    groups = preset_groups(args.groups)
    caps = args.capacity or list(DEFAULT_CAPACITIES)
    for c in caps:
        if c < bs:
            raise _CliError(f"--capacity {c} is less than one block of {bs} tokens")
    pol = args.eviction_policy
    trace = load_trace(args.trace, args.limit)
    sessions = None
    if pol in ("session", "density"):
        from .sessions import conversation_ids

        sessions = conversation_ids(trace)
    variants = [(None, True), (groups, True)] + ([(groups, False)] if args.compare_lru else [])
    bar = progress_bar(len(trace) * len(caps) * len(variants), args.no_progress)
    tick = bar.update if bar is not None else None
    say = bar.write if bar is not None else print
    say(f"{trace.name}: {len(trace):,} requests, {trace.prompt_tokens:,} prompt tokens; groups {args.groups}: "
        + ", ".join("full" if g.window is None else f"sliding {g.window}" for g in groups))
    rows = []
    try:
        for c in caps:
            for g, ret in variants:
                p = replay_groups(trace, c, g, block_size=bs, retention=ret, progress=tick, eviction_policy=pol,
                                  sessions=sessions)
                rows.append(p.to_json())
                say(f"  {c:>12,} tokens of KV, {p.impl:<18} hit rate {100 * p.hit_rate:5.1f}%, "
                    f"full-attention tokens held {p.extra['tokens_held']:,.0f}, {p.seconds:.1f} s")
    finally:
        if bar is not None:
            bar.close()
    import numpy

    import pagedkv

    return {"kind": "replay-groups", "trace": trace.name, "requests": len(trace),
            "prompt_tokens": int(trace.prompt_tokens), "groups": args.groups,
            "windows": [g.window for g in groups], "block_size": bs, "mode": "sequence", "eviction_policy": pol,
            "points": rows,
            "command": "pagedkv replay " + " ".join(shlex.quote(a) for a in args.argv),
            "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                         "pagedkv": pagedkv.__version__},
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()}}


def format_groups_table(doc: dict) -> str:
    """The --groups result as a Markdown table: per capacity, each manager's hit rate and tokens held."""
    out = [f"{doc['trace']}: KV cache groups {doc['groups']} vs one table for all layers, equal KV bytes "
           f"(capacity = tokens of the one-table pool)", "",
           "| KV capacity (tokens, one table) | manager | hit rate | full-attention tokens held | x one table |",
           "|---|---|---|---|---|"]
    base = {p["capacity_tokens"]: p for p in doc["points"] if p["extra"]["groups"] == 1}
    for p in doc["points"]:
        b = base.get(p["capacity_tokens"])
        held = p["extra"]["tokens_held"]
        x = held / b["extra"]["tokens_held"] if b and b["extra"]["tokens_held"] else float("nan")
        out.append(f"| {p['capacity_tokens']:,} | {p['impl']} | {100 * p['hit_rate']:.1f}% | {held:,.0f} | "
                   f"{x:.2f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv

    from .report import format_table, plot

    if args.replicas is not None or args.route:
        from .cluster_cli import format_table, plot  # noqa: F811
    if args.groups is not None:
        format_table = format_groups_table  # noqa: F811
        if args.plot:
            print("pagedkv replay: error: --plot is not available with --groups", file=sys.stderr)
            return 2

    try:
        doc = run(args)
    except (PagedKVError, _CliError, OSError, ImportError, NotImplementedError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, FileNotFoundError):
            msg = f"no such file: {e.filename}"
        print(f"pagedkv replay: error: {msg}", file=sys.stderr)
        return 2
    print(format_table(doc))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {out}")
    if args.plot:
        print(f"chart: {plot([doc], args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
