"""What the check digest costs per block, next to the I/O of a block (issue 24: the 64-bit chain-key decision).

A stored value carries a check digest (:func:`pagedkv.tiers.check_digests`, a BLAKE2b chain over the block's
token prefix) that a load compares (docs/tiers.md#the-check-digest). Per block of ``--block-size`` tokens, in one
run on this machine, the median of ``--repeats`` passes over a ``--prompt-len``-token prompt:

- ``block_hashes`` (the chain keys every load and store already computes) and ``check_digests`` (the new cost);
- a checked load from a disk tier (warm page cache: the cheapest I/O a tier has) and from Redis on 127.0.0.1
  when ``redis-server`` is installed: ``BlockStore.get_many`` with the check digests, per block;
- the ratio check digest / load: how much of a load the decision adds.

Block bytes default to SmolLM2-135M's float32 KV block (30 layers x K,V x 16 tokens x 3 KV heads x 64 dims x 4 B).

    PYTHONPATH=src python benchmarks/tier_check_cost.py [--json benchmarks/results/tier_check_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint, RedisBackend, check_digests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tier_common import RedisServer, machine  # noqa: E402


def _ms_per_block(fn, n_blocks: int, repeats: int) -> float:
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t) / n_blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-bytes", type=int, default=30 * 2 * 16 * 3 * 64 * 4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    bs, n = a.block_size, a.prompt_len // a.block_size
    toks = np.random.default_rng(0).integers(100, 49152, a.prompt_len).tolist()
    res = {"machine": machine(), "prompt_len": a.prompt_len, "block_size": bs, "block_bytes": a.block_bytes,
           "repeats": a.repeats}
    res["block_hashes_ms"] = _ms_per_block(lambda: pagedkv.block_hashes(toks, bs), n, a.repeats)
    res["check_digests_ms"] = _ms_per_block(lambda: check_digests(toks, bs), n, a.repeats)
    keys, checks = pagedkv.block_hashes(toks, bs), check_digests(toks, bs)
    payloads = [np.random.default_rng(i).standard_normal(a.block_bytes // 4).astype(np.float32) for i in range(n)]
    fp = ModelFingerprint("bench", "float32", bs, "L30,2,B,H3,D64")
    loads = {}
    with tempfile.TemporaryDirectory(prefix="pagedkv-check-cost-") as tmp, RedisServer(tmp) as rs:
        backends = [("disk (warm)", DiskBackend(Path(tmp) / "disk", 8 << 30))]
        if rs.url:
            backends.append(("redis", RedisBackend(rs.url, prefix="cc:", socket_timeout=30.0)))
        for name, b in backends:
            s = BlockStore(b, fp, a.block_bytes)
            s.put_many(keys, payloads, None, checks)
            for m in range(0, n, 16):  # bounded calls, as the connector makes them
                assert s.get_many(keys[m:m + 16], None, checks[m:m + 16]).hit_prefix == len(keys[m:m + 16])

            def load(s=s):
                for m in range(0, n, 16):
                    s.get_many(keys[m:m + 16], None, checks[m:m + 16])

            loads[name] = _ms_per_block(load, n, a.repeats)
            b.close()
    res["load_ms"] = loads
    res["check_over_load"] = {k: res["check_digests_ms"] / v for k, v in loads.items()}
    print(f"# {res['machine']['cpus']} CPUs, load average {res['machine']['loadavg'][0]:.1f}; {a.prompt_len}-token "
          f"prompt, blocks of {bs} tokens and {a.block_bytes / 1024:.0f} KiB; medians of {a.repeats}")
    print("| per block | ms | check digest / it |")
    print("|---|---|---|")
    print(f"| block_hashes (chain keys, already computed) | {res['block_hashes_ms']:.4f} | |")
    print(f"| **check_digests (the decision's cost)** | **{res['check_digests_ms']:.4f}** | |")
    for k, v in loads.items():
        print(f"| checked load, {k} | {v:.3f} | {100 * res['check_over_load'][k]:.2f}% |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
