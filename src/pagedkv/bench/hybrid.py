"""Hybrid side by side: :class:`pagedkv.HybridBlockManager` against vLLM V1's ``HybridKVCacheCoordinator``.

``python -m pagedkv.bench hybrid [--impl pagedkv vllm_v1] [--quick]`` (also ``pagedkv bench hybrid``; vLLM V1
needs its virtualenv: ``.venv-anchor-v1/bin/python -m pagedkv.bench hybrid --impl pagedkv vllm_v1``);
``python -m pagedkv.bench hybrid report FILE.json ...`` re-renders saved files.

Configuration (both managers): a Gemma-3-like model, one full-attention group and five sliding-window groups
of window 512 (Gemma 3 270M's 18 layers as 6 groups of 3), block size 16, all groups over ONE shared pool
(pagedkv: ``BlockManager(kv_cache_groups=GEMMA3_GROUPS)``; V1: a ``KVCacheConfig`` with six
``KVCacheGroupSpec`` of equal page size, for which ``KVCacheManager`` picks ``HybridKVCacheCoordinator``,
see :mod:`pagedkv.bench.anchors.vllm_v1`).

Both measurements time each implementation with what its own engine does on the CPU and nothing else, as
:mod:`pagedkv.bench.fair` states: CPU time of the thread (``time.thread_time_ns``, one clock read subtracted per
timed part), implementations alternating call by call in one process, the garbage collector frozen once the
managers are built (vLLM's engine core calls ``gc.freeze()`` after start-up), and the tokens as lists of Python
ints (what an engine's sampler hands over after ``.tolist()``).

``decode``  For each batch size B (1 .. 1000) and prefix caching on and off, fresh managers (pool: every
            sequence's final length in the full group plus a window and two blocks in each sliding group, plus
            one prompt's worth of blocks in every group and 16) admit B prompts of 2048..4096 seeded random
            tokens and run each one's first decode step alone (untimed; every manager releases the sliding
            groups' blocks outside the window there, so the pool holds one prompt in full at a time), then
            ``--steps`` decode steps of one token per sequence, the implementations alternating step by step.
            Timed per step: ``pagedkv``: ``decode_step(seq_ids, tokens, block_tables=False)`` (what its engine
            asks for: the slot mapping ``(G, B)``, the lengths and each group's changed table entries);
            ``pagedkv-tables``: the same with the six padded tables; ``vllm_v1``: what V1's engine does on the
            CPU for the KV cache per step, in three parts: ``request`` (``num_computed_tokens`` and
            ``Request.append_output_token_ids``, where V1 hashes a block that has just filled), ``calls`` (its
            scheduler's KV-cache-manager calls: ``allocate_slots`` per request, the per-step ``take_*`` calls)
            and ``runner`` (the new block ids appended to the CPU block-table rows, ``BlockTable.append_row``,
            :class:`pagedkv.bench.runner_tables.V1BlockRows`). V1 builds no slot mapping and no padded table on
            the CPU (its slot mapping is a GPU kernel), so none is charged. Ratios are given against all of V1's
            parts and against its ``calls`` alone.
``prefix``  Allocation with hybrid prefix hits: a conversation's second turn. For prompt lengths 1k, 4k and
            16k tokens, ``--requests`` sessions each admit their first turn (L random tokens; untimed), free it
            into the prefix cache, then admit the second turn (the first + 256 tokens), timed, the
            implementations alternating admission by admission: the hit covers the first turn's full blocks in
            the full group and the last window in every sliding group. pagedkv: ``allocate(seq, tokens)``
            (hashing included); V1: ``hash`` (building the engine-side ``Request``, where V1 hashes the prompt's
            blocks when it arrives) and ``calls`` (``get_computed_blocks`` + ``allocate_slots`` + ``get_blocks``,
            its scheduler's admission calls). Ratios against V1's calls alone and against calls + hashing. The
            hit token counts of both are recorded (they must agree).

Per (implementation, setting) and repeat: the median over the timed calls (decode: after the first ``--skip``
steps). Repeats are sequential (every setting, then the next repeat) after one untimed warm-up; ratios pagedkv /
V1 are taken per repeat, then median, min and max (below 1: pagedkv faster).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .._help import HelpFormatter, plain
from .meta import machine as _machine, versions as _versions
from .report import save_result
from .fair import CLOCK, alternate, clock_overhead, engine_gc, net, pagedkv_step, v1_step
from .runner_tables import V1BlockRows

__all__ = ["BATCH_SIZES", "PREFIX_LENGTHS", "GEMMA3_WINDOWS", "gemma3_groups", "run_hybrid", "format_table", "main"]

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)
QUICK_BATCH_SIZES = (1, 4, 16)
PREFIX_LENGTHS = (1024, 4096, 16384)
QUICK_PREFIX_LENGTHS = (1024,)
BLOCK_SIZE = 16
CONTEXT = (2048, 4096)
QUICK_CONTEXT = (600, 1200)
TURN = 256  # tokens the second turn adds
VOCAB = 32_000
GEMMA3_WINDOWS = (None, 512, 512, 512, 512, 512)  # group 0 full attention, groups 1..5 sliding window 512


class _Spec(NamedTuple):
    """Stand-in group spec (``window`` None: full attention) where pagedkv's kv_groups is not importable."""

    window: int | None

    @property
    def kind(self) -> str:
        return "full_attention" if self.window is None else "sliding_window"


def gemma3_groups(windows: Sequence[int | None] = GEMMA3_WINDOWS) -> list:
    """pagedkv's group specs for ``windows`` (None: full attention)."""
    try:
        from ..kv_groups import FullAttentionSpec, SlidingWindowSpec
    except ImportError:  # pragma: no cover - before the groups branch
        return [_Spec(w) for w in windows]
    return [FullAttentionSpec() if w is None else SlidingWindowSpec(w) for w in windows]


class _Impl(NamedTuple):
    name: str
    make: Callable[[int, bool], Any] | None  # (num_blocks, caching) -> manager
    version: str
    unavailable: str = ""


def _resolve(name: str, groups: list) -> _Impl:
    if name == "pagedkv":
        try:
            import pagedkv
            from pagedkv import BlockManager
        except ImportError as exc:
            return _Impl(name, None, "", f"pagedkv has no BlockManager here: {exc}")
        return _Impl(name, lambda n, c: BlockManager(n, BLOCK_SIZE, kv_cache_groups=groups,
                                                     enable_prefix_caching=c, grouped_results=True),
                     f"pagedkv {pagedkv.__version__}")
    if name in ("vllm_v1", "v1", "vllm-v1"):
        from .anchors import AnchorUnavailable, load_anchor

        try:
            cls = load_anchor("vllm_v1")
        except AnchorUnavailable as exc:
            return _Impl("vllm_v1", None, "", str(exc))
        return _Impl("vllm_v1", lambda n, c: cls(n, BLOCK_SIZE, enable_prefix_caching=c, kv_cache_groups=groups),
                     str(cls.name))
    raise KeyError(f"unknown implementation {name!r} (pagedkv, vllm_v1)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- decode

def _pool_blocks(b: int, longest: int, steps: int, windows: Sequence[int | None]) -> int:
    per_seq = 0
    for w in windows:
        full = _cdiv(longest + steps + 1, BLOCK_SIZE)
        per_seq += full if w is None else min(full, _cdiv(w, BLOCK_SIZE) + 2)
    transient = len(windows) * _cdiv(longest, BLOCK_SIZE)  # one prompt admitted in full before its first step
    return b * per_seq + transient + 16


class _Contender(NamedTuple):
    name: str
    step: Callable[[int], dict]  # call i -> its timed parts (ns by name)


def _pagedkv_decoder(name: str, bm: Any, prompts: list[list[int]], first: list[int], toks: list[list[int]],
                     clock: Callable[[], int]) -> _Contender:
    """pagedkv as its engine runs it: ``decode_step(seq_ids, tokens)`` with the sampled tokens as a list of ints;
    ``pagedkv``: ``block_tables=False`` (the step's changed table entries, what :class:`pagedkv.engine.LLM`
    asks for), ``pagedkv-tables``: the padded tables. The slot mapping is built in both (pagedkv's engine has
    no GPU to build it)."""
    tables = name == "pagedkv-tables"
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
        bm.decode_step([i], [first[i]], block_tables=tables)  # its first step alone, untimed (see the docstring)
    seq_ids = list(range(len(prompts)))
    return _Contender(name, pagedkv_step(bm.decode_step, seq_ids, toks, tables, clock))


def _v1_decoder(bm: Any, prompts: list[list[int]], first: list[int], toks: list[list[int]], ngroups: int,
                width: int, clock: Callable[[], int]) -> _Contender:
    """vLLM V1 charged with its engine's CPU work for the KV cache per decode step, in three parts:
    ``request`` (``update_requests``: ``num_computed_tokens`` and ``append_output_token_ids``, where V1 hashes
    a block that has just filled), ``calls`` (its scheduler's KV-cache-manager calls, the adapter's
    ``decode_step``) and ``runner`` (the new block ids appended to the CPU block-table rows,
    :class:`~pagedkv.bench.runner_tables.V1BlockRows`). No slot mapping or padded table: V1 builds none on the
    CPU. The adapter's own bookkeeping (``stage``) is not timed."""
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
        bm.prepare_step([i], [first[i]])
        bm.decode_step([i])
    seq_ids = list(range(len(prompts)))
    rows = V1BlockRows(len(seq_ids), ngroups, width)
    for s in seq_ids:
        rows.add_row(s, [bm.block_table(s, g) for g in range(ngroups)])
    return _Contender("vllm_v1", v1_step(bm, rows, seq_ids, toks, clock))


def _summarise(calls: list[dict], overhead: int, skip: int) -> dict:
    """Medians (us) of the total and of each part over the calls after the first ``skip``, each part less one
    clock read."""
    k = min(skip, len(calls) - 1)
    kept = [net(c, overhead) for c in calls[k:]]
    parts = {name: float(np.median([c[name] for c in kept])) / 1e3 for name in kept[0]}
    return {"us": float(np.median([sum(c.values()) for c in kept])) / 1e3, "parts_us": parts,
            "calls_us": parts["calls"]}


def _decoders(impls: Sequence[_Impl]) -> list[str]:
    names = []
    for impl in impls:
        names += ["pagedkv", "pagedkv-tables"] if impl.name == "pagedkv" else [impl.name]
    return names


def run_decode(impls: Sequence[_Impl], b: int, caching: bool, steps: int, seed: int, skip: int,
               context: tuple[int, int] = CONTEXT, windows: Sequence[int | None] = GEMMA3_WINDOWS,
               clock: Callable[[], int] = CLOCK) -> dict[str, dict]:
    """One measured decode run of every implementation, alternating step by step (see the module docstring):
    per contender the medians (us) over the steps after the first ``skip``, and its free blocks."""
    rng = np.random.default_rng([seed, b])
    lens = rng.integers(context[0], context[1] + 1, size=b)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in lens]
    first = np.random.default_rng([seed, b, 3]).integers(0, VOCAB, size=b).tolist()
    toks = np.random.default_rng([seed, b, 1]).integers(0, VOCAB, size=(steps, b)).tolist()
    pool = _pool_blocks(b, context[1], steps, windows)
    width = _cdiv(context[1] + steps + 2, BLOCK_SIZE)
    by_name = {i.name: i for i in impls}
    managers = {n: by_name["pagedkv" if n.startswith("pagedkv") else n].make(pool, caching) for n in _decoders(impls)}
    with engine_gc():
        contenders = [_pagedkv_decoder(n, bm, prompts, first, toks, clock) if n.startswith("pagedkv") else
                      _v1_decoder(bm, prompts, first, toks, len(windows), width, clock)
                      for n, bm in managers.items()]
        calls = alternate([c.step for c in contenders], steps)
    overhead = clock_overhead(clock)
    out = {}
    for c, cs in zip(contenders, calls):
        out[c.name] = {**_summarise(cs, overhead, skip), "free_blocks": int(managers[c.name].num_free_gpu_blocks)}
    return out


# ---------------------------------------------------------------------------------------------- prefix hits
def run_prefix(impls: Sequence[_Impl], length: int, n: int, seed: int,
               windows: Sequence[int | None] = GEMMA3_WINDOWS, clock: Callable[[], int] = CLOCK) -> dict[str, dict]:
    """``n`` second-turn admissions with a hybrid prefix hit per implementation, alternating admission by
    admission (see the module docstring): per implementation the median (us) of the charged admission and of
    its parts (V1: ``hash``, building the engine-side ``Request``, where V1 hashes the prompt's blocks, and
    ``calls``, its scheduler's admission calls; pagedkv: ``calls``, ``allocate`` with its hashing), and the hit
    tokens of each admission."""
    rng = np.random.default_rng([seed, length, 2])
    firsts = [rng.integers(0, VOCAB, size=length).tolist() for _ in range(n)]
    seconds = [f + rng.integers(0, VOCAB, size=TURN).tolist() for f in firsts]
    nblk = _cdiv(length + TURN, BLOCK_SIZE)
    managers = [(impl.name, impl.make(len(windows) * nblk * (n + 2) + 16, True)) for impl in impls]
    hits: dict[str, list[int]] = {name: [] for name, _ in managers}

    def contender(name: str, bm: Any) -> Callable[[int], dict]:
        got = hits[name]
        if name == "pagedkv":
            allocate = bm.allocate

            def step(i: int) -> dict:
                bm.allocate(i, firsts[i])
                bm.free(i)
                prompt = seconds[i]
                t0 = clock()
                hit = allocate(n + i, prompt)
                t1 = clock()
                got.append(int(hit))
                bm.free(n + i)
                return {"calls": t1 - t0}
        else:
            make, admit = bm.make_request, bm.admit

            def step(i: int) -> dict:
                bm.allocate(i, firsts[i])
                bm.free(i)
                prompt = seconds[i]
                t0 = clock()
                req = make(n + i, prompt)
                t1 = clock()
                hit = admit(n + i, req)
                t2 = clock()
                got.append(int(hit))
                bm.free(n + i)
                return {"hash": t1 - t0, "calls": t2 - t1}
        return step

    with engine_gc():
        calls = alternate([contender(name, bm) for name, bm in managers], n)
    overhead = clock_overhead(clock)
    return {name: {**_summarise(cs, overhead, 0), "hit_tokens": hits[name]} for (name, _), cs in zip(managers, calls)}


# ---------------------------------------------------------------------------------------------- the run
def _mmm(vals: Sequence[float]) -> dict:
    a = np.asarray(vals, dtype=float)
    return {"min": float(a.min()), "median": float(np.median(a)), "max": float(a.max())}


def run_hybrid(impl_names: Sequence[str], *, batch_sizes: Sequence[int] = BATCH_SIZES,
               lengths: Sequence[int] = PREFIX_LENGTHS, steps: int = 64, repeats: int = 3, skip: int = 8,
               requests: int = 32, seed: int = 0, caching: Sequence[bool] = (True, False),
               context: tuple[int, int] = CONTEXT, parts: Sequence[str] = ("decode", "prefix"),
               progress: Callable[[str], None] | None = None, clock: Callable[[], int] = CLOCK) -> dict:
    """Run the benchmark; returns the result document (without machine/command, see :func:`main`)."""
    groups = gemma3_groups()
    windows = [getattr(g, "window", None) for g in groups]
    impls, skipped = [], {}
    for name in impl_names:
        impl = _resolve(name, groups)
        if impl.unavailable:
            skipped[impl.name] = impl.unavailable
        else:
            impls.append(impl)
    say = progress or (lambda s: None)
    if "decode" in parts:  # warm-up
        for c in caching:
            run_decode(impls, min(4, max(batch_sizes)), c, min(steps, 16), seed, 0, context, windows, clock)
    if "prefix" in parts:
        run_prefix(impls, min(lengths), 4, seed, windows, clock)
    dec: dict[tuple[str, bool, int], list[dict]] = {}
    pre: dict[tuple[str, int], list[dict]] = {}
    for rep in range(repeats):
        if "decode" in parts:
            for b in batch_sizes:
                say(f"repeat {rep + 1}/{repeats}: decode, batch {b}")
                for c in caching:
                    for name, r in run_decode(impls, b, c, steps, seed, skip, context, windows, clock).items():
                        dec.setdefault((name, c, b), []).append(r)
        if "prefix" in parts:
            for length in lengths:
                say(f"repeat {rep + 1}/{repeats}: prefix hits, {length} tokens")
                for name, r in run_prefix(impls, length, requests, seed, windows, clock).items():
                    pre.setdefault((name, length), []).append(r)
    decode_results, decode_ratios = [], []
    for (name, c, b), rs in dec.items():
        decode_results.append({"impl": name, "prefix_caching": c, "batch": b, "us_per_step": _mmm([r["us"] for r in rs]),
                               "parts_us": {p: _mmm([r["parts_us"][p] for r in rs]) for p in rs[0]["parts_us"]},
                               "runs_us": [r["us"] for r in rs]})
        if name.startswith("pagedkv"):
            continue
        for mine in ("pagedkv", "pagedkv-tables"):
            base = dec.get((mine, c, b))
            if base is not None:
                decode_ratios.append({"impl": mine, "anchor": name, "prefix_caching": c, "batch": b,
                                      "ratio": _mmm([p["us"] / a["us"] for p, a in zip(base, rs)]),
                                      "ratio_vs_calls_only": _mmm([p["us"] / a["calls_us"] for p, a in zip(base, rs)])})
    prefix_results, prefix_ratios = [], []
    for (name, length), rs in pre.items():
        prefix_results.append({"impl": name, "prompt_tokens": length + TURN, "us_per_allocate": _mmm([r["us"] for r in rs]),
                               "parts_us": {p: _mmm([r["parts_us"][p] for r in rs]) for p in rs[0]["parts_us"]},
                               "hit_tokens_median": float(np.median(rs[0]["hit_tokens"])),
                               "hit_tokens": rs[0]["hit_tokens"]})
        base = pre.get(("pagedkv", length))
        if name != "pagedkv" and base is not None:
            prefix_ratios.append({
                "impl": "pagedkv", "anchor": name, "prompt_tokens": length + TURN,
                "ratio": _mmm([p["us"] / a["calls_us"] for p, a in zip(base, rs)]),
                "ratio_vs_with_hash": _mmm([p["us"] / a["us"] for p, a in zip(base, rs)]),
                "same_hits": all(p["hit_tokens"] == a["hit_tokens"] for p, a in zip(base, rs))})
    return {
        "schema": 2,
        "kind": "hybrid",
        "config": {"impl": list(impl_names), "groups": [{"kind": getattr(g, "kind", None), "window": w}
                                                        for g, w in zip(groups, windows)],
                   "block_size": BLOCK_SIZE, "batch_sizes": list(batch_sizes), "context": list(context),
                   "steps": steps, "skip_steps": skip, "repeats": repeats, "prefix_caching": list(caching),
                   "prefix_lengths": list(lengths), "turn_tokens": TURN, "requests": requests, "seed": seed,
                   "parts": list(parts), "clock": getattr(clock, "__name__", str(clock)),
                   "clock_overhead_ns": clock_overhead(clock), "gc": "frozen after the managers are built",
                   "alternation": "call by call"},
        "versions_impl": {i.name: i.version for i in impls},
        "skipped": skipped,
        "decode": decode_results,
        "decode_ratios": decode_ratios,
        "prefix": prefix_results,
        "prefix_ratios": prefix_ratios,
    }


# ---------------------------------------------------------------------------------------------- report
def _cell(q: dict) -> str:
    return f"{q['median']:.3g} [{q['min']:.3g}-{q['max']:.3g}]"


def format_table(doc: dict) -> str:
    """Markdown tables: decode us per step and ratios per batch size (caching on, off); prefix-hit admission."""
    out: list[str] = []
    impls = sorted({r["impl"] for r in doc["decode"] + doc["prefix"]}, key=lambda n: (not n.startswith("pagedkv"), n))
    for c in doc["config"]["prefix_caching"]:
        rows = [r for r in doc["decode"] if r["prefix_caching"] == c]
        if not rows:
            continue
        by = {(r["impl"], r["batch"]): r for r in rows}
        rat = {(r.get("impl", "pagedkv"), r["batch"]): r for r in doc["decode_ratios"] if r["prefix_caching"] == c}
        pairs = sorted({(r.get("impl", "pagedkv"), r["anchor"]) for r in doc["decode_ratios"]
                        if r["prefix_caching"] == c})
        out += [f"decode step, prefix caching {'on' if c else 'off'}: median us of CPU time per step [min-max across "
                "repeats]; ratio pagedkv / V1 charged with its engine's CPU work (request update with hashing, "
                "KV-manager calls, block-id appends; below 1: pagedkv faster), in parentheses vs V1's KV-manager "
                "calls alone", "",
                "| batch | " + " | ".join(impls) + "".join(f" | {p} / {a}" for p, a in pairs) + " |",
                "|---" * (len(impls) + 1 + len(pairs)) + "|"]
        for b in sorted({r["batch"] for r in rows}):
            cells = []
            for name in impls:
                r = by.get((name, b))
                cells.append("-" if r is None else f"{r['us_per_step']['median']:.1f} [{r['us_per_step']['min']:.1f}-"
                             f"{r['us_per_step']['max']:.1f}]")
            for p, _a in pairs:
                q = rat.get((p, b))
                if q is None:
                    cells.append("-")
                    continue
                alone = q.get("ratio_vs_calls_only", q.get("ratio_vs_bm_only"))  # schema 1 files: ratio_vs_bm_only
                cells.append(f"{_cell(q['ratio'])} ({alone['median']:.3g})")
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        out.append("")
    if doc["prefix"]:
        by = {(r["impl"], r["prompt_tokens"]): r for r in doc["prefix"]}
        rat = {r["prompt_tokens"]: r for r in doc["prefix_ratios"]}
        pimpls = [n for n in impls if any(k[0] == n for k in by)]
        out += ["allocate with a hybrid prefix hit (second turn of a conversation): median us of CPU time per "
                "admission; hit tokens; for vllm_v1 its scheduler's calls alone and with its request hashing (V1 "
                "hashes a request's blocks when it arrives); ratios pagedkv / vllm_v1 [min-max across repeats]", "",
                "| prompt tokens | " + " | ".join(f"{n} us | {n} + hashing us | {n} hit" if n != "pagedkv" else
                                                  f"{n} us | {n} hit" for n in pimpls)
                + (" | ratio vs calls alone | ratio vs calls + hashing |" if rat else " |"),
                "|---" * (2 * len(pimpls) + sum(n != "pagedkv" for n in pimpls) + 1 + 2 * bool(rat)) + "|"]
        for t in sorted({r["prompt_tokens"] for r in doc["prefix"]}):
            cells = []
            for name in pimpls:
                r = by.get((name, t))
                wide = name != "pagedkv"
                if r is None:
                    cells += ["-"] * (3 if wide else 2)
                    continue
                if wide and "parts_us" not in r:  # a schema 1 file: us_per_allocate is V1's calls alone
                    w = r.get("us_with_hash")
                    cells += [f"{r['us_per_allocate']['median']:.1f}", "-" if w is None else f"{w['median']:.1f}"]
                elif wide:
                    cells += [f"{r['parts_us']['calls']['median']:.1f}", f"{r['us_per_allocate']['median']:.1f}"]
                else:
                    cells.append(f"{r['us_per_allocate']['median']:.1f}")
                cells.append(f"{r['hit_tokens_median']:.0f}")
            line = f"| {t} | " + " | ".join(cells)
            if rat:
                q = rat.get(t)
                line += " | " + ("- | -" if q is None else f"{_cell(q['ratio'])} | {_cell(q['ratio_vs_with_hash'])}"
                                 + ("" if q["same_hits"] else " hits differ"))
            out.append(line + " |")
        out.append("")
    cfg = doc["config"]
    if "clock" in cfg:
        out.append(f"clock {cfg['clock']} (one read {cfg['clock_overhead_ns']} ns, subtracted from each timed part); "
                   f"implementations alternating {cfg['alternation']}; gc {cfg['gc']}")
    for name, why in doc.get("skipped", {}).items():
        out.append(f"skipped {name}: {why}")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        for f in argv[1:]:
            print(format_table(json.loads(Path(f).read_text())), end="")
        return 0
    ap = argparse.ArgumentParser(prog="pagedkv bench hybrid", description=plain(__doc__), formatter_class=HelpFormatter)
    ap.add_argument("--impl", nargs="+", default=["pagedkv"], metavar="NAME",
                    help="pagedkv and vllm_v1 (run under .venv-anchor-v1 for vllm_v1)")
    ap.add_argument("--batch", nargs="+", type=int, default=None, metavar="B", help="batch sizes (default 1..1000)")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, metavar="L",
                    help="first-turn prompt lengths of the prefix-hit part (default 1024 4096 16384)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per run (default 64, quick 12)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3, quick 1)")
    ap.add_argument("--skip", type=int, default=8, help="first steps of a run left out of its median")
    ap.add_argument("--requests", type=int, default=None, help="admissions per prefix-hit run (default 32, quick 4)")
    ap.add_argument("--caching", choices=("off", "on", "both"), default="both", help="prefix caching of the decode part")
    ap.add_argument("--parts", nargs="+", choices=("decode", "prefix"), default=["decode", "prefix"])
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--quick", action="store_true", help="small batches and contexts, 1 repeat (a smoke run)")
    ap.add_argument("--out", default="benchmarks/results", metavar="DIR", help="where the JSON goes")
    ap.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    a = ap.parse_args(argv)
    batch = a.batch or (QUICK_BATCH_SIZES if a.quick else BATCH_SIZES)
    lengths = a.lengths or (QUICK_PREFIX_LENGTHS if a.quick else PREFIX_LENGTHS)
    steps = a.steps or (12 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    requests = a.requests or (4 if a.quick else 32)
    if min(batch) < 1 or steps < 2 or repeats < 1 or requests < 1 or min(lengths) < 1:
        ap.error("batch sizes, lengths, --requests and --repeats >= 1, --steps >= 2")
    caching = {"off": (False,), "on": (True,), "both": (True, False)}[a.caching]
    t0 = time.perf_counter()
    try:
        doc = run_hybrid(a.impl, batch_sizes=batch, lengths=lengths, steps=steps, repeats=repeats,
                         skip=a.skip if not a.quick else 2, requests=requests, seed=a.seed, caching=caching,
                         context=QUICK_CONTEXT if a.quick else CONTEXT, parts=a.parts,
                         progress=lambda s: print(s, file=sys.stderr, flush=True))
    except KeyError as exc:
        ap.error(str(exc.args[0]))
    versions = _versions()
    versions["implementations"] = doc.pop("versions_impl")
    doc = {"schema": 1, "kind": "hybrid",
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join([Path(sys.executable).name, "-m", "pagedkv.bench", "hybrid", *argv]),
           "argv": list(sys.argv), "machine": _machine(), "versions": versions,
           "elapsed_s": round(time.perf_counter() - t0, 1), **{k: v for k, v in doc.items() if k not in ("schema", "kind")}}
    print(format_table(doc), end="")
    if not a.no_save:
        print(f"\nwrote {save_result(doc, a.out, 'hybrid', a.impl, a.quick)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
