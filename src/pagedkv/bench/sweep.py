"""Batch-size sweep of the steady decode step: pagedkv against each anchor at batch 1, 2, 4, ..., 1024.

``python -m pagedkv.bench sweep [--impl pagedkv nanovllm] [--quick]`` (also ``pagedkv bench sweep``);
``python -m pagedkv.bench sweep report FILE.json ... [--plot DIR]`` merges the files of several runs (one per
anchor virtualenv) into one table and chart.

What is measured. For each batch size B and prefix caching off and on, fresh managers (pool: every sequence's
final length fits, plus 16 blocks) admit B prompts of 64..256 seeded random tokens (untimed), then run
``--steps`` decode steps of one new token per sequence, the same B sequences every step (the same list object,
as an engine passes its running batch), the implementations alternating step by step. Timing follows
:mod:`pagedkv.bench.fair`: CPU time of the thread, one clock read subtracted per timed part, the garbage
collector frozen once the managers are built, the sampled tokens as a list of Python ints. Each implementation
is charged with what its own engine does on the CPU per step:

- ``pagedkv``: ``decode_step(seq_ids, tokens, block_tables=False)``, what its engine asks for (slot mapping,
  lengths, copy-on-write pairs and the changed table entries); ``pagedkv-tables``: the same call returning the
  padded block tables;
- nano-vllm and vLLM v2, two figures: ``calls``, the block-manager calls their scheduler makes for a decode batch
  (nano-vllm ``may_append`` per sequence; vLLM v2 ``append_slots`` + ``get_block_table`` +
  ``access_all_blocks_in_seq`` (+ ``get_common_computed_block_ids``) + ``mark_blocks_as_computed``), and ``calls``
  + ``tables``, building the slot mapping, padded tables and lengths as their model runner does on the CPU
  (:class:`pagedkv.bench.runner_tables.ListTables`). The engine appending the sampled token to its own sequence
  objects (the adapter's ``prepare_step``) is not timed;
- vLLM V1: ``request`` (``Request.append_output_token_ids``, where V1 hashes a block that has just filled),
  ``calls`` (``allocate_slots`` per request and the per-step ``take_*`` calls) and ``runner`` (the new block ids
  appended to the CPU block-table rows); no slot mapping or padded table, which V1 builds on the GPU.

The ratio pagedkv / anchor is given against everything the anchor is charged with and, in parentheses, against
its block-manager calls alone. The anchors' per-sequence capacity checks (nano-vllm ``can_append``, vLLM v2
``can_append_slots``) are not made: the pool always has room, and pagedkv's step is all-or-nothing without one.
nano-vllm cannot turn prefix caching off: its "off" runs cache all the same. With random prompts no prefix is
shared, so "on" measures the cost of hashing and registering the blocks that fill. The loop is tight (nothing
evicts the managers' arrays from the CPU caches between steps, unlike the replay suite), so these are warm-cache
figures.

Per (implementation, caching, B) and repeat: the median over the steps after the first ``--skip`` ones. Repeats
are sequential (repeat 1 of every B, then repeat 2, ...) after one untimed warm-up run; the table gives the
median across repeats with the min and max. Ratios are taken per repeat, then their median, min and max across
repeats (below 1: pagedkv is faster).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .._help import HelpFormatter, plain
from .harness import Impl, resolve_impl
from .meta import machine as _machine, versions as _versions
from .report import save_result
from .fair import CLOCK, alternate, clock_overhead, engine_gc, net, pagedkv_step, v1_step
from .runner_tables import ListTables, V1BlockRows

__all__ = ["BATCH_SIZES", "run_sweep", "merge", "format_table", "plot", "main"]

BATCH_SIZES = tuple(2**i for i in range(11))  # 1 .. 1024
QUICK_BATCH_SIZES = (1, 2, 4, 8)
BLOCK_SIZE = 16
PROMPT_LEN = (64, 256)
VOCAB = 32_000


def _prompts(b: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng([seed, b])
    lens = rng.integers(PROMPT_LEN[0], PROMPT_LEN[1] + 1, size=b)
    return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in lens]


def _tokens(b: int, steps: int, seed: int) -> list[list[int]]:
    return np.random.default_rng([seed, b, 1]).integers(0, VOCAB, size=(steps, b)).tolist()


def contenders_of(impls: Sequence[Impl]) -> list[str]:
    """The contenders of a run: pagedkv twice (``pagedkv``: ``block_tables=False``, what its engine asks for;
    ``pagedkv-tables``: the padded tables), every anchor once."""
    names = []
    for impl in impls:
        names += ["pagedkv", "pagedkv-tables"] if impl.name == "pagedkv" else [impl.name]
    return names


def make_step(name: str, bm: Any, prompts: list[list[int]], toks: list[list[int]], steps: int,
              clock: Callable[[], int] = CLOCK) -> Callable[[int], dict]:
    """Admit ``prompts`` into ``bm`` (untimed) and return its timed step: call i runs decode step i with the
    tokens ``toks[i]`` and returns its parts (ns by name). What each contender is charged with is in the module
    docstring."""
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
    seq_ids = list(range(len(prompts)))
    if name.startswith("pagedkv"):
        return pagedkv_step(bm.decode_step, seq_ids, toks, name == "pagedkv-tables", clock)
    if name == "vllm_v1":
        rows = V1BlockRows(len(seq_ids), 1, -(-(PROMPT_LEN[1] + steps + 2) // BLOCK_SIZE))
        for s in seq_ids:
            rows.add_row(s, [bm.block_table(s)])
        return v1_step(bm, rows, seq_ids, toks, clock)
    build = ListTables(BLOCK_SIZE).build
    if name == "nanovllm":
        lens = lambda: [len(s) for s in bm._batch]  # noqa: E731 - nano-vllm's runner: len(seq)
    elif name == "vllm_v2":
        seqs = bm._seqs
        lens = lambda: [seqs[s].get_len() for s in seq_ids]  # noqa: E731 - vLLM v2's runner: seq_data.get_len()
    else:  # pragma: no cover - a new anchor needs its runner's lengths here
        raise NotImplementedError(f"the sweep does not know how {name}'s model runner reads sequence lengths")
    prepare, decode = bm.prepare_step, bm.decode_step

    def step(i: int) -> dict:
        prepare(seq_ids, toks[i])
        t0 = clock()
        out = decode(seq_ids, toks[i])
        t1 = clock()
        build(out.block_tables, lens())
        t2 = clock()
        return {"calls": t1 - t0, "tables": t2 - t1}

    return step


def run_one(impls: Sequence[Impl], b: int, caching: bool, steps: int, seed: int, skip: int,
            clock: Callable[[], int] = CLOCK) -> dict[str, dict]:
    """One measured run of every contender, alternating step by step: per contender the medians (us) of the
    charged step (``us``), of the anchor's block-manager calls alone (``bm_us``) and of each part."""
    prompts = _prompts(b, seed)
    toks = _tokens(b, steps, seed)
    per_seq = -(-(PROMPT_LEN[1] + steps + 1) // BLOCK_SIZE)
    by_name = {i.name: i for i in impls}
    managers = {n: by_name["pagedkv" if n.startswith("pagedkv") else n].factory(b * per_seq + 16, BLOCK_SIZE,
                                                                                  enable_prefix_caching=caching)
                for n in contenders_of(impls)}
    with engine_gc():
        stepping = [make_step(n, bm, prompts, toks, steps, clock) for n, bm in managers.items()]
        calls = alternate(stepping, steps)
    overhead = clock_overhead(clock)
    k = min(skip, steps - 1)
    out = {}
    for name, cs in zip(managers, calls):
        kept = [net(c, overhead) for c in cs[k:]]
        parts = {p: float(np.median([c[p] for c in kept])) / 1e3 for p in kept[0]}
        out[name] = {"us": float(np.median([sum(c.values()) for c in kept])) / 1e3, "bm_us": parts["calls"],
                     "parts_us": parts}
    return out


def _mmm(vals: Sequence[float]) -> dict:
    a = np.asarray(vals, dtype=float)
    return {"min": float(a.min()), "median": float(np.median(a)), "max": float(a.max())}


def run_sweep(impl_names: Sequence[str], *, batch_sizes: Sequence[int] = BATCH_SIZES, steps: int = 256,
              repeats: int = 5, skip: int = 8, seed: int = 0, caching: Sequence[bool] = (False, True),
              progress: Callable[[str], None] | None = None, clock: Callable[[], int] = CLOCK) -> dict:
    """Run the sweep; returns the result document (without machine/command, see :func:`main`)."""
    impls, skipped = [], {}
    for name in impl_names:
        impl = resolve_impl(name)
        if impl.unavailable:
            skipped[name] = impl.unavailable
        else:
            impls.append(impl)
    say = progress or (lambda s: None)
    for c in caching:  # warm-up: imports, first-call costs, allocator pools
        run_one(impls, min(16, max(batch_sizes)), c, min(steps, 32), seed, 0, clock)
    runs: dict[tuple[str, bool, int], list[dict]] = {}
    for rep in range(repeats):
        for b in batch_sizes:
            say(f"repeat {rep + 1}/{repeats}, batch {b}")
            for c in caching:
                for name, r in run_one(impls, b, c, steps, seed, skip, clock).items():
                    runs.setdefault((name, c, b), []).append(r)
    results = []
    for (name, c, b), rs in runs.items():
        rec = {"impl": name, "prefix_caching": c, "batch": b, "us_per_step": _mmm([r["us"] for r in rs]),
               "runs_us": [r["us"] for r in rs],
               "parts_us": {p: _mmm([r["parts_us"][p] for r in rs]) for p in rs[0]["parts_us"]}}
        if not name.startswith("pagedkv"):
            rec["bm_us_per_step"] = _mmm([r["bm_us"] for r in rs])
            rec["tables_us_per_step"] = _mmm([r["us"] - r["bm_us"] for r in rs])
        results.append(rec)
    ratios = []
    for (name, c, b), rs in runs.items():
        if name.startswith("pagedkv"):
            continue
        for mine in ("pagedkv", "pagedkv-tables"):
            base = runs.get((mine, c, b))
            if base is None:
                continue
            ratios.append({"impl": mine, "anchor": name, "prefix_caching": c, "batch": b,
                           "ratio": _mmm([p["us"] / a["us"] for p, a in zip(base, rs)]),
                           "ratio_vs_bm_only": _mmm([p["us"] / a["bm_us"] for p, a in zip(base, rs)])})
    return {
        "schema": 2,
        "kind": "sweep",
        "config": {"impl": list(impl_names), "batch_sizes": list(batch_sizes), "steps": steps, "repeats": repeats,
                   "skip_steps": skip, "seed": seed, "block_size": BLOCK_SIZE, "prompt_len": list(PROMPT_LEN),
                   "prefix_caching": list(caching), "clock": getattr(clock, "__name__", str(clock)),
                   "clock_overhead_ns": clock_overhead(clock), "gc": "frozen after the managers are built",
                   "alternation": "call by call"},
        "versions_impl": {i.name: i.version for i in impls},
        "skipped": skipped,
        "results": results,
        "ratios": ratios,
    }


# ---------------------------------------------------------------------------------------------- merge and report
def merge(docs: Sequence[dict]) -> dict:
    """Several sweep files as one: per (impl, caching, batch) the records of every file (pagedkv appears once per
    file), and every file's same-process ratios."""
    by: dict[tuple[str, bool, int], list[dict]] = {}
    ratios = []
    for d in docs:
        for r in d["results"]:
            by.setdefault((r["impl"], r["prefix_caching"], r["batch"]), []).append(r)
        ratios.extend(d["ratios"])
    return {"by": by, "ratios": ratios}


def _median_of(recs: list[dict], key: str = "us_per_step") -> float:
    return float(np.median([r[key]["median"] for r in recs]))


def format_table(docs: Sequence[dict]) -> str:
    """Markdown: median us per step (min-max across repeats) per batch size, each implementation, caching off
    and on; then the same-process ratios pagedkv / anchor."""
    m = merge(docs)
    impls = list(dict.fromkeys(k[0] for k in m["by"]))
    impls.sort(key=lambda n: (not n.startswith("pagedkv"), n))
    out = []
    for c in sorted({k[1] for k in m["by"]}):
        bsz = sorted({k[2] for k in m["by"] if k[1] == c})
        out += [f"prefix caching {'on' if c else 'off'}: median us per step [min-max across repeats]", "",
                "| batch | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
        for b in bsz:
            cells = []
            for name in impls:
                recs = m["by"].get((name, c, b))
                if not recs:
                    cells.append("-")
                    continue
                lo = min(r["us_per_step"]["min"] for r in recs)
                hi = max(r["us_per_step"]["max"] for r in recs)
                cells.append(f"{_median_of(recs):.1f} [{lo:.1f}-{hi:.1f}]")
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        out.append("")
        pairs = sorted({(r.get("impl", "pagedkv"), r["anchor"]) for r in m["ratios"] if r["prefix_caching"] == c})
        if pairs:
            out += [f"prefix caching {'on' if c else 'off'}: pagedkv / anchor charged with its engine's CPU work "
                    "(nano-vllm and vLLM v2: block-manager calls + the runner's tables; vLLM V1: request update, "
                    "KV-manager calls, block-id appends), same process, alternating step by step (below 1: pagedkv "
                    "faster); median [min-max across repeats]; in parentheses: vs the anchor's block-manager calls "
                    "alone", "",
                    "| batch | " + " | ".join(f"{p} / {a}" for p, a in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
            for b in bsz:
                cells = []
                for p, a in pairs:
                    rs = [r for r in m["ratios"] if r.get("impl", "pagedkv") == p and r["anchor"] == a
                          and r["prefix_caching"] == c and r["batch"] == b]
                    if not rs:
                        cells.append("-")
                        continue
                    r = rs[0]
                    q = r["ratio"]
                    cells.append(f"{q['median']:.3g} [{q['min']:.3g}-{q['max']:.3g}] "
                                 f"({r['ratio_vs_bm_only']['median']:.3g})")
                out.append(f"| {b} | " + " | ".join(cells) + " |")
            out.append("")
    cfgs = [d["config"] for d in docs if "clock" in d.get("config", {})]
    if cfgs:
        out.append(f"clock {cfgs[0]['clock']} (one read {cfgs[0]['clock_overhead_ns']} ns, subtracted from each timed "
                   f"part); implementations alternating {cfgs[0]['alternation']}; gc {cfgs[0]['gc']}")
    return "\n".join(out).rstrip() + "\n"


def plot(docs: Sequence[dict], outdir: str | Path) -> list[Path]:
    """``sweep.png``: log-log us per step vs batch size, one line per implementation (anchors: solid = with the
    runner's tables, dotted = block-manager calls alone), caching off and on side by side; ``sweep_ratio.png``:
    pagedkv / anchor per batch size (below 1: pagedkv faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = merge(docs)
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    impls = sorted(dict.fromkeys(k[0] for k in m["by"]), key=lambda n: (not n.startswith("pagedkv"), n))
    colors = {name: f"C{i}" for i, name in enumerate(impls)}
    modes = sorted({k[1] for k in m["by"]})
    written = []
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.6), squeeze=False)
    for ax, c in zip(axes[0], modes):
        for name in impls:
            keys = sorted(k for k in m["by"] if k[0] == name and k[1] == c)
            if not keys:
                continue
            b = [k[2] for k in keys]
            ax.plot(b, [_median_of(m["by"][k]) for k in keys], "o-", color=colors[name], ms=3, label=name)
            if not name.startswith("pagedkv"):
                ax.plot(b, [_median_of(m["by"][k], "bm_us_per_step") for k in keys], ":", color=colors[name],
                        label=f"{name} (block manager alone)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("us per decode step (median)")
        ax.set_title(f"prefix caching {'on' if c else 'off'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Decode step vs batch size (block size 16, one token per sequence)")
    fig.tight_layout()
    p = outdir / "sweep.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    if m["ratios"]:
        fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.2), squeeze=False)
        for ax, c in zip(axes[0], modes):
            for a in sorted({r["anchor"] for r in m["ratios"]}):
                rs = sorted((r for r in m["ratios"] if r["anchor"] == a and r["prefix_caching"] == c),
                            key=lambda r: r["batch"])
                if not rs:
                    continue
                b = [r["batch"] for r in rs]
                ax.plot(b, [r["ratio"]["median"] for r in rs], "o-", ms=3, color=colors.get(a), label=a)
                ax.fill_between(b, [r["ratio"]["min"] for r in rs], [r["ratio"]["max"] for r in rs],
                                color=colors.get(a), alpha=0.15)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size (sequences)")
            ax.set_ylabel("pagedkv / anchor (below 1: pagedkv faster)")
            ax.set_title(f"prefix caching {'on' if c else 'off'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = outdir / "sweep_ratio.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


# ---------------------------------------------------------------------------------------------- command line
def _report_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="pagedkv bench sweep report",
                                 description="Merge sweep result files into one table (and chart).",
                                 formatter_class=HelpFormatter)
    ap.add_argument("files", nargs="+", help="result files of pagedkv bench sweep")
    ap.add_argument("--plot", metavar="DIR", help="also write the charts into DIR")
    a = ap.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in a.files]
    print(format_table(docs), end="")
    if a.plot:
        for p in plot(docs, a.plot):
            print(f"wrote {p}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        return _report_main(argv[1:])
    ap = argparse.ArgumentParser(prog="pagedkv bench sweep", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("--impl", nargs="+", default=["pagedkv"], metavar="NAME",
                    help="pagedkv and anchors (vllm_v2, vllm_v1, nanovllm; run under the anchor's virtualenv)")
    ap.add_argument("--batch", nargs="+", type=int, default=None, metavar="B", help="batch sizes (default 1..1024)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per run (default 256, quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, quick 1)")
    ap.add_argument("--skip", type=int, default=8, help="first steps of a run left out of its median")
    ap.add_argument("--caching", choices=("off", "on", "both"), default="both", help="prefix caching off, on or both")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--quick", action="store_true", help="batch 1..8, 16 steps, 1 repeat (a smoke run)")
    ap.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where the JSON goes")
    ap.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    ap.add_argument("--plot", metavar="DIR", help="also write the charts into DIR")
    a = ap.parse_args(argv)
    batch = a.batch or (QUICK_BATCH_SIZES if a.quick else BATCH_SIZES)
    steps = a.steps or (16 if a.quick else 256)
    repeats = a.repeats or (1 if a.quick else 5)
    if min(batch) < 1 or steps < 2 or repeats < 1:
        ap.error("batch sizes >= 1, --steps >= 2 and --repeats >= 1")
    caching = {"off": (False,), "on": (True,), "both": (False, True)}[a.caching]
    t0 = time.perf_counter()
    doc = run_sweep(a.impl, batch_sizes=batch, steps=steps, repeats=repeats, skip=a.skip if not a.quick else 2,
                    seed=a.seed, caching=caching, progress=lambda s: print(s, file=sys.stderr, flush=True))
    for name, why in doc["skipped"].items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    versions = _versions()
    versions["implementations"] = doc.pop("versions_impl")
    doc = {"schema": 1, "kind": "sweep",
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join([Path(sys.executable).name, "-m", "pagedkv.bench", "sweep", *argv]),
           "argv": list(sys.argv), "machine": _machine(), "versions": versions,
           "elapsed_s": round(time.perf_counter() - t0, 1), **{k: v for k, v in doc.items() if k not in ("schema", "kind")}}
    print(format_table([doc]), end="")
    if not a.no_save:
        print(f"\nwrote {save_result(doc, a.out, 'sweep', a.impl, a.quick)}")
    if a.plot:
        for p in plot([doc], a.plot):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
