"""The trace replay, pagedkv against vLLM V1's ``KVCacheManager``, under the fair harness's rules.

    bash scripts/install_anchors.sh v1                       # .venv-anchor-v1 (once)
    PYTHONPATH=src .venv-anchor-v1/bin/python benchmarks/replay_fair.py [--capacity 300k 1M 3M 10M] [--limit N]

The replay suite (docs/guide/replay.md) timed each implementation's whole replay by wall clock, one after the
other. Here both replay the same trace in one interpreter, request by request, under the rules of
:mod:`pagedkv.bench.fair`:

* CPU time of the calling thread per request, one clock read subtracted;
* call-by-call alternation: request i goes through both managers before request i + 1 through either, the
  first of each pair rotating;
* the garbage collector frozen after both managers are built (vLLM's engine core freezes its start-up heap);
* token lists as input (what a request brings; built outside the timed region for both).

Each is charged with what its engine does for a request of sequence mode (allocate, then free): pagedkv's
``allocate`` (its chained keys computed inside) and ``free``; V1's request construction with its block hashes
(``Request(..., block_hasher=...)``, what V1's engine core does when a request arrives), ``get_computed_blocks``,
``allocate_slots`` and ``free`` (the anchor's ``make_request`` + ``admit`` + ``free``). Both must report the same
hit tokens for every request; the run stops at the first difference.

Prints, per capacity, the hit rate and each side's CPU seconds over the whole trace with the ratio pagedkv / V1,
and writes the figures as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedkv import BlockManager
from pagedkv.bench.fair import CLOCK, clock_overhead, engine_gc
from pagedkv.replay.__main__ import parse_tokens
from pagedkv.replay.trace import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_speed import _default_trace  # noqa: E402


def run_point(trace, capacity: int, anchor_cls, block_size: int = 16, progress: bool = True) -> dict:
    nb = capacity // block_size
    pm = BlockManager(nb, block_size, enable_prefix_caching=True, watermark=0.0)
    am = anchor_cls(nb, block_size, enable_prefix_caching=True, watermark=0.0)
    over = clock_overhead()
    need = (-(-trace.input_lengths // block_size)).tolist()
    clock = CLOCK
    t_p = t_a = 0
    hits = prompt = skipped = 0
    n = len(need)
    t0 = time.perf_counter()
    with engine_gc():
        for i in range(n):
            if need[i] > nb:
                skipped += 1
                continue
            toks = trace.tokens(i).tolist()
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                if side == 0:
                    c0 = clock()
                    h_p = pm.allocate(i, toks)
                    pm.free(i)
                    t_p += clock() - c0 - over
                else:
                    c0 = clock()
                    req = am.make_request(i, toks)
                    h_a = am.admit(i, req)
                    am.free(i)
                    t_a += clock() - c0 - over
            if h_p != h_a:
                raise SystemExit(f"request {i}: pagedkv hit {h_p} tokens, the anchor {h_a}: not the same replay")
            hits += h_p
            prompt += len(toks)
            if progress and i % 1000 == 0:
                print(f"\r  {capacity:>10,} tokens: {i:,}/{n:,} requests", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return {"capacity_tokens": capacity, "requests": n - skipped, "skipped": skipped, "prompt_tokens": prompt,
            "hit_tokens": hits, "hit_rate": hits / max(prompt, 1), "pagedkv_cpu_s": t_p / 1e9,
            "anchor_cpu_s": t_a / 1e9, "ratio": t_p / max(t_a, 1), "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--capacity", type=parse_tokens, nargs="+", default=[300_000, 1_000_000, 3_000_000, 10_000_000])
    ap.add_argument("--limit", type=int, default=None, metavar="N", help="the first N requests only")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    a = ap.parse_args(argv)
    path = a.trace or _default_trace()
    if path is None or not Path(path).is_file():
        ap.error("no trace: pass --trace FILE (../shared/data/mooncake/conversation_trace.jsonl)")
    try:
        from pagedkv.bench.anchors.vllm_v1 import VLLM_VERSION, VllmV1Anchor
    except ImportError as e:
        ap.error(f"{e}: run under .venv-anchor-v1 (bash scripts/install_anchors.sh v1)")
    trace = load_trace(path, a.limit)
    rows = []
    print(f"trace {Path(path).name}: {len(trace):,} requests; pagedkv vs vLLM V1 {VLLM_VERSION}, CPU time per thread, "
          f"alternating request by request, gc frozen")
    print("| capacity (tokens) | hit rate | pagedkv CPU s | V1 CPU s | pagedkv / V1 |")
    print("|---|---|---|---|---|")
    for cap in a.capacity:
        r = run_point(trace, cap, VllmV1Anchor)
        rows.append(r)
        print(f"| {cap:,} | {100 * r['hit_rate']:.1f}% | {r['pagedkv_cpu_s']:.2f} | {r['anchor_cpu_s']:.2f} | "
              f"**{r['ratio']:.2f}x** |", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"trace": str(path), "anchor": f"vllm_v1 {VLLM_VERSION}", "points": rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
