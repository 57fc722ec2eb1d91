"""TTFT of a long prompt served from the storage tiers against recomputing it (issue 24, item 6).

Three servers' worth of scenarios, in one process over one loaded model (each server: ``make_server`` on
127.0.0.1, a fresh ``LLM``, its own GPU pool, so nothing is in the GPU prefix cache at the start), and per repeat a
fresh random ``--prompt-len``-token prompt (token ids; no GPU hit from an earlier repeat):

1. **recompute** (the baseline, measured in the same run): a server without tiers answers the prompt;
2. **disk restart**: a server with ``kv_disk_dir`` answers the prompt (it computes and writes every full block
   through to disk), is stopped (its stores finished); a new server over the same directory answers it again:
   its prompt's blocks come from disk;
3. **replica A -> B through the shared store**: two servers at once on one shared store (Redis on 127.0.0.1 when
   ``redis-server`` is installed, else a shared directory: ``--shared file``); A answers the prompt, its stores
   finish, then B answers it from the shared store.

TTFT is the time from sending a streaming ``/v1/completions`` request (``max_tokens`` 2, greedy) to its first
streamed chunk, measured by the client. The ratio is TTFT / the recompute TTFT of the same repeat. The texts must
be equal (greedy).

Run (minutes: every repeat computes the prompt three times)::

    PYTHONPATH=src python benchmarks/tier_serving.py [--prompt-len 2048] [--repeats 3] [--shared redis|file] \\
        [--model gemma-3-270m --no-kv-cache-groups] [--json benchmarks/results/tier_serving.json]
    PYTHONPATH=src python benchmarks/tier_serving.py --show benchmarks/results/tier_serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tier_common import RedisServer, TierServer, machine, medians  # noqa: E402


def run(args) -> dict:
    from pagedkv.engine.registry import load_model

    model = load_model(args.model)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    tmp = tempfile.mkdtemp(prefix="pagedkv-tier-serving-")
    redis_srv = RedisServer(tmp) if args.shared == "redis" else None
    url = redis_srv.url if redis_srv is not None else None
    if args.shared == "redis" and url is None:
        print("redis-server not available: the shared tier is a shared directory", file=sys.stderr)
    if url is None:
        url = "file://" + os.path.join(tmp, "shared")
    grp = {} if args.kv_cache_groups else {"kv_cache_groups": False}
    load0 = os.getloadavg()
    rows = []

    def _Server(model, block_size, **kw):  # noqa: N802 - every server of the run, with the run's groups setting
        return TierServer(model, block_size, **grp, **kw)

    try:
        warm = _Server(model, args.block_size)
        warm.ttft(rng.integers(100, vocab, 32).tolist())  # warm-up (threads, kernels)
        warm.close()
        for rep in range(args.repeats):
            prompt = rng.integers(100, vocab, args.prompt_len).tolist()
            row = {"repeat": rep}
            s = _Server(model, args.block_size)
            row["recompute_s"], base_text, _ = s.ttft(prompt)
            s.close()
            disk = os.path.join(tmp, f"disk{rep}")
            s = _Server(model, args.block_size, kv_disk_dir=disk, kv_disk_gib=args.disk_gib)
            row["disk_first_s"], t1, _ = s.ttft(prompt)
            s.close()
            d0 = s.connector.counters()[0]
            row["disk_stored_blocks"], row["disk_stored_bytes"] = d0.stored_blocks, d0.stored_bytes
            s = _Server(model, args.block_size, kv_disk_dir=disk, kv_disk_gib=args.disk_gib)
            row["disk_restart_s"], t2, row["disk_loaded_tokens"] = s.ttft(prompt)
            d1 = s.connector.counters()[0]
            row["disk_load_ms_per_block"] = d1.load_ms_per_block
            row["disk_loaded_blocks"], row["disk_loaded_bytes"] = d1.hit_blocks, d1.hit_bytes
            s.close()
            prompt_b = rng.integers(100, vocab, args.prompt_len).tolist()
            s = _Server(model, args.block_size)
            row["recompute_b_s"], base_b, _ = s.ttft(prompt_b)
            s.close()
            a = _Server(model, args.block_size, kv_shared=url)
            b = _Server(model, args.block_size, kv_shared=url)
            try:
                row["replica_a_s"], ta, _ = a.ttft(prompt_b)
                a.connector.flush(300)
                row["replica_b_s"], tb, row["replica_b_loaded_tokens"] = b.ttft(prompt_b)
                row["replica_b_loaded_bytes"] = b.connector.counters()[0].hit_bytes
            finally:
                a.close()
                b.close()
            row["same_text"] = base_text == t1 == t2 and base_b == ta == tb
            row["disk_ratio"] = row["disk_restart_s"] / row["recompute_s"]
            row["shared_ratio"] = row["replica_b_s"] / row["recompute_b_s"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        if redis_srv is not None:
            redis_srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model": args.model, "prompt_len": args.prompt_len, "block_size": args.block_size,
        "kv_cache_groups": bool(args.kv_cache_groups),
        "shared": "redis" if url.startswith("redis") else "shared directory", "repeats": rows,
        "machine": dict(machine(), loadavg_start=load0, loadavg_end=os.getloadavg()),
        "median": medians(rows, ("recompute_s", "disk_first_s", "disk_restart_s", "disk_ratio", "recompute_b_s",
                                 "replica_a_s", "replica_b_s", "shared_ratio")),
    }


def show(res: dict) -> None:
    m = res["median"]
    one = "" if res.get("kv_cache_groups", True) else " (kv_cache_groups=False: one block table)"
    print(f"{res['model']}{one}, {res['prompt_len']}-token prompt, blocks of {res['block_size']}, shared tier: "
          f"{res['shared']}; load average {res['machine']['loadavg_start'][0]:.1f} -> "
          f"{res['machine']['loadavg_end'][0]:.1f}; medians of {len(res['repeats'])} repeats")
    print("| scenario | TTFT s | x recompute |")
    print("|---|---|---|")
    print(f"| recompute (no tiers) | {m['recompute_s']:.2f} | 1.00 |")
    print(f"| first server with a disk tier (computes, writes through) | {m['disk_first_s']:.2f} | "
          f"{m['disk_first_s'] / m['recompute_s']:.2f} |")
    print(f"| **restarted server, prompt from its disk tier** | {m['disk_restart_s']:.2f} | "
          f"**{m['disk_ratio']:.3f}** |")
    print(f"| recompute, second prompt (no tiers) | {m['recompute_b_s']:.2f} | 1.00 |")
    print(f"| replica A (computes, writes to the shared store) | {m['replica_a_s']:.2f} | "
          f"{m['replica_a_s'] / m['recompute_b_s']:.2f} |")
    print(f"| **replica B, prompt from the shared store** | {m['replica_b_s']:.2f} | **{m['shared_ratio']:.3f}** |")
    print("same greedy text everywhere:", all(r["same_text"] for r in res["repeats"]))
    r0 = res["repeats"][0]
    if "disk_stored_bytes" in r0:  # (result files since the KV cache groups' tiers)
        print(f"bytes per prompt (repeat 0): stored to disk {r0['disk_stored_bytes'] / 2**20:.1f} MiB in "
              f"{r0['disk_stored_blocks']} values; loaded from disk {r0['disk_loaded_bytes'] / 2**20:.1f} MiB in "
              f"{r0['disk_loaded_blocks']} values; replica B loaded {r0['replica_b_loaded_bytes'] / 2**20:.1f} MiB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disk-gib", type=float, default=2.0)
    p.add_argument("--shared", choices=("redis", "file"), default="redis")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-cache-groups", dest="kv_cache_groups", action="store_false",
                   help="one block table for a model with KV cache groups (Gemma 3): the tiers refuse groups today")
    p.add_argument("--json", default=None)
    p.add_argument("--show", default=None, metavar="JSON", help="reprint a result file")
    args = p.parse_args(argv)
    if args.show:
        with open(args.show) as f:
            show(json.load(f))
        return 0
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    show(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
