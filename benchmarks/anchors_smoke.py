"""Smoke test and rough timing of the anchor adapters (src/pagedkv/bench/anchors).

Run it with the interpreter of an anchor's virtualenv (scripts/install_anchors.sh makes them)::

    .venv-anchor-v2/bin/python   benchmarks/anchors_smoke.py vllm_v2
    .venv-anchor-v1/bin/python   benchmarks/anchors_smoke.py vllm_v1
    .venv-anchor-nano/bin/python benchmarks/anchors_smoke.py nanovllm

With no anchor named it runs every anchor that loads in this interpreter; name ``pagedkv`` to run
pagedkv's own ``BlockManager`` through the same timing loop for comparison (same interpreter, same numpy).  Per anchor and prefix-caching
setting it allocates ``--seqs`` prompts of ``--prompt`` random tokens, runs ``--steps`` decode steps over
the whole batch through ``prepare_step`` (untimed) + ``decode_step`` (timed with perf_counter_ns), checks
the block tables, frees everything and checks that every block came back.  It then runs small
functional checks: prefix-cache hits, and fork + copy-on-write + swap out/in where the anchor has them.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import numpy as np

from pagedkv.bench.anchors import ANCHORS, AllocStatus, AnchorUnavailable, load_anchor


def _ms(ns: float) -> float:
    return ns / 1e6


def bench(Anchor, *, seqs: int, prompt: int, steps: int, block_size: int, prefix: bool, check_in_step: bool,
          seed: int) -> dict:
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-(prompt + steps) // block_size)
    num_blocks = int(seqs * blocks_per_seq * 1.05) + 64  # "enough": room for the watermark
    bm = Anchor(num_blocks, block_size, enable_prefix_caching=prefix)
    bm.check_in_step = check_in_step
    free0 = bm.num_free_gpu_blocks
    prompts = rng.integers(0, 32000, size=(seqs, prompt), dtype=np.int64)
    new_tokens = rng.integers(0, 32000, size=(steps, seqs), dtype=np.int64)
    ids = list(range(seqs))

    t0 = time.perf_counter_ns()
    for i in ids:
        assert bm.can_allocate(prompts[i]) is AllocStatus.OK
        bm.allocate(i, prompts[i])
    t_alloc = time.perf_counter_ns() - t0

    prep_ns: list[int] = []
    step_ns: list[int] = []
    step_cpu_ns: list[int] = []
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    gc.collect()
    for s in range(steps):
        toks = new_tokens[s]
        assert bm.can_append_slots(ids)
        a = wall()
        bm.prepare_step(ids, toks)
        b = wall()
        b_cpu = cpu()
        out = bm.decode_step(ids, toks)
        c_cpu = cpu()
        c = wall()
        prep_ns.append(b - a)
        step_ns.append(c - b)
        step_cpu_ns.append(c_cpu - b_cpu)
    assert len(out.block_tables) == seqs and len(out.cow) == 0

    for i in (0, seqs // 2, seqs - 1):
        assert bm.num_tokens(i) == prompt + steps, (i, bm.num_tokens(i))
        assert len(bm.block_table(i)) == blocks_per_seq, (i, bm.block_table(i))
    used = set()
    for i in ids:
        used.update(bm.block_table(i))
    assert len(used) == seqs * blocks_per_seq  # distinct random prompts share no block

    t0 = time.perf_counter_ns()
    for i in ids:
        bm.free(i)
    t_free = time.perf_counter_ns() - t0
    assert len(bm) == 0 and bm.num_free_gpu_blocks == free0, (bm.num_free_gpu_blocks, free0)
    return {
        "anchor": bm.name,
        "prefix_caching": prefix,
        "check_in_step": check_in_step,
        "batch": seqs,
        "steps": steps,
        "decode_step_median_ms": _ms(statistics.median(step_ns)),
        # all prompts have the same length, so every block_size-th step is a block boundary for the
        # whole batch: the median is a mid-block step, the mean includes the boundary steps
        "decode_step_mean_ms": _ms(statistics.fmean(step_ns)),
        "decode_step_p90_ms": _ms(float(np.percentile(step_ns, 90))),
        "decode_step_min_ms": _ms(min(step_ns)),
        # CPU time of this thread: robust to other processes competing for the cores
        "decode_step_cpu_median_ms": _ms(statistics.median(step_cpu_ns)),
        "prepare_step_median_ms": _ms(statistics.median(prep_ns)),
        "allocate_total_ms": _ms(t_alloc),
        "free_total_ms": _ms(t_free),
        "stats": bm.stats,
    }


def check_prefix_hits(Anchor, block_size: int = 16) -> str:
    bm = Anchor(256, block_size, enable_prefix_caching=True)
    prompt = list(range(1000, 1000 + 5 * block_size + 3))  # 5 full blocks + 3 tokens
    assert bm.allocate(1, prompt) == 0
    bm.prepare_step([1], [7])
    bm.decode_step([1], [7])
    hit = bm.allocate(2, prompt)
    assert hit == 5 * block_size, hit
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 256
    return f"prefix hit {hit} tokens of {len(prompt)}"


def check_fork_swap(Anchor, block_size: int = 16) -> str:
    bm = Anchor(64, block_size, num_cpu_blocks=64)
    prompt = list(range(2 * block_size + 5))  # last block partly filled, so a fork shares it
    bm.allocate(1, prompt)
    bm.prepare_step([1], [11])
    bm.decode_step([1], [11])
    used = 64 - bm.num_free_gpu_blocks
    bm.fork(1, 2)
    assert 64 - bm.num_free_gpu_blocks == used  # the child shares every block
    assert bm.block_table(1) == bm.block_table(2)
    bm.prepare_step([1, 2], [21, 22])
    step = bm.decode_step([1, 2], [21, 22])
    assert len(step.cow) == 1, step.cow  # one of the two writers copies the shared last block
    src, dst = step.cow[0]
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert t1[:-1] == t2[:-1] and t1[-1] != t2[-1] and src in (t1[-1], t2[-1]) and dst in (t1[-1], t2[-1])

    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2])
    # vLLM v2 swaps sequence by sequence: blocks shared by the fork are copied once per sequence, so
    # the CPU side holds len(t1) + len(t2) blocks and the sharing is gone after swap-in.
    n_distinct = len(set(t1) | set(t2))
    assert n_distinct <= len(out) <= len(t1) + len(t2), (out, t1, t2)
    assert {g for g, _ in out} == set(t1) | set(t2)
    assert bm.num_free_gpu_blocks == 64 and bm.stats.num_free_cpu_blocks == 64 - len({c for _, c in out})
    assert bm.can_swap_in([1, 2]) is AllocStatus.OK
    back = bm.swap_in([1, 2])
    assert sorted({c for c, _ in back}) == sorted({c for _, c in out})
    assert bm.stats.num_free_cpu_blocks == 64 and bm.num_free_gpu_blocks == 64 - len({g for _, g in back})
    for s in range(block_size + 1):  # both keep decoding and cross a block boundary
        bm.prepare_step([1, 2], [30 + s, 60 + s])
        step = bm.decode_step([1, 2], [30 + s, 60 + s])
        assert not step.cow
    assert bm.num_tokens(1) == bm.num_tokens(2) == len(prompt) + 2 + block_size + 1
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 64 and bm.stats.num_free_cpu_blocks == 64
    return (f"fork + CoW {(src, dst)} + swap out/in: {n_distinct} distinct GPU blocks -> {len(out)} CPU blocks "
            f"-> {len({g for _, g in back})} GPU blocks")


def check_lookahead(Anchor, block_size: int = 16) -> str:
    """Lookahead slots reserve blocks beyond the appended tokens; (B, k) token rows append k tokens."""
    bm = Anchor(64, block_size)
    bm.allocate(1, list(range(2 * block_size - 2)))  # 30 tokens: 2 blocks
    assert len(bm.block_table(1)) == 2
    assert bm.can_append_slots([1], num_lookahead_slots=4)
    bm.prepare_step([1], [5])
    bm.decode_step([1], [5], num_lookahead_slots=4)  # 31 tokens + 4 slots -> 3 blocks
    assert len(bm.block_table(1)) == 3, bm.block_table(1)
    rows = np.array([[6, 7]])
    bm.prepare_step([1], rows)
    bm.decode_step([1], rows, num_lookahead_slots=16)  # 33 tokens + 16 slots -> 4 blocks
    assert bm.num_tokens(1) == 33 and len(bm.block_table(1)) == 4, bm.block_table(1)
    bm.free(1)
    assert bm.num_free_gpu_blocks == 64
    return "lookahead slots and 2-token rows reserve the expected blocks"


def check_sliding_window(Anchor, block_size: int = 16, window: int = 64) -> str:
    """A long decode under a sliding window keeps a bounded number of blocks."""
    bm = Anchor(64, block_size, sliding_window=window)
    bm.allocate(1, list(range(3 * block_size)))
    peak = 0
    for s in range(12 * block_size):
        assert bm.can_append_slots([1])
        bm.prepare_step([1], [s])
        bm.decode_step([1], [s])
        peak = max(peak, 64 - bm.num_free_gpu_blocks)
    table = bm.block_table(1)
    n = bm.num_tokens(1)
    bm.free(1)
    assert bm.num_free_gpu_blocks >= 63  # vLLM v2 keeps the null block it allocated for released positions
    # the window, vLLM v2's extra margin block, a partly filled block at each end, and the null block
    bound = window // block_size + 4
    assert peak <= bound, (peak, bound)
    return f"sliding window {window}: {n} tokens, {len(table)} table entries, at most {peak} blocks held"


def _report(r: dict, args) -> None:
    if args.json:
        print(json.dumps(r, default=str))
        return
    print(f"{r['anchor']:<24} prefix_caching={str(r['prefix_caching']):<5} check_in_step={str(r['check_in_step']):<5} "
          f"batch {r['batch']}: decode_step median {r['decode_step_median_ms']:.3f} ms "
          f"(mean {r['decode_step_mean_ms']:.3f}, p90 {r['decode_step_p90_ms']:.3f}, min {r['decode_step_min_ms']:.3f}; "
          f"thread CPU time median {r['decode_step_cpu_median_ms']:.3f}); "
          f"prepare_step median {r['prepare_step_median_ms']:.3f} ms; "
          f"allocate {r['allocate_total_ms']:.0f} ms, free {r['free_total_ms']:.0f} ms total")


class _PagedKV:
    """pagedkv.BlockManager in the smoke loop: it has no engine-side step, so prepare_step does nothing."""

    supports = frozenset()  # the functional checks below are written for the anchors

    def __init__(self, *args, **kwargs):
        import pagedkv

        self._bm = pagedkv.BlockManager(*args, **kwargs)
        self.name = f"pagedkv {pagedkv.__version__}"
        self.check_in_step = False

    def prepare_step(self, seq_ids, token_ids):
        pass

    def __getattr__(self, attr):
        return getattr(self._bm, attr)

    def __len__(self):
        return len(self._bm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("anchors", nargs="*", help=f"anchors to run (default: those that load): {', '.join(ANCHORS)}")
    ap.add_argument("--seqs", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-in-step", action="store_true",
                    help="also time the per-sequence capacity check the anchor's scheduler makes")
    ap.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = ap.parse_args(argv)

    names = args.anchors or list(ANCHORS)
    print(f"# python {platform.python_version()} on {platform.machine()}, numpy {np.__version__}", file=sys.stderr)
    ran = 0
    for name in names:
        if name == "pagedkv":
            ran += 1
            for prefix in (False, True):
                r = bench(_PagedKV, seqs=args.seqs, prompt=args.prompt, steps=args.steps, block_size=args.block_size,
                          prefix=prefix, check_in_step=False, seed=args.seed)
                _report(r, args)
            continue
        try:
            Anchor = load_anchor(name)
        except AnchorUnavailable as exc:
            if args.anchors:
                raise
            print(f"# skip {name}: {str(exc).split('. It needs')[0]}", file=sys.stderr)
            continue
        ran += 1
        settings = [False, True] if "prefix_caching" in Anchor.supports else [False]
        if name == "nanovllm" or Anchor.__name__ == "NanoVllmAnchor":
            settings = [True]  # nano-vllm always caches
        for prefix in settings:
            r = bench(Anchor, seqs=args.seqs, prompt=args.prompt, steps=args.steps, block_size=args.block_size,
                      prefix=prefix, check_in_step=args.check_in_step, seed=args.seed)
            _report(r, args)
        if "prefix_caching" in Anchor.supports:
            print(f"{Anchor.name:<24} ok: {check_prefix_hits(Anchor)}")
        if "lookahead" in Anchor.supports:
            print(f"{Anchor.name:<24} ok: {check_lookahead(Anchor)}")
        if "sliding_window" in Anchor.supports:
            print(f"{Anchor.name:<24} ok: {check_sliding_window(Anchor)}")
        if {"fork", "swap"} <= Anchor.supports:
            print(f"{Anchor.name:<24} ok: {check_fork_swap(Anchor)}")
    if not ran:
        print("no anchor loads in this interpreter; see scripts/install_anchors.sh", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
