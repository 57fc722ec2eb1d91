"""Concurrent 4k-token Gemma 3 270M sequences per GiB of KV cache: KV cache groups against one table for all layers.

    PYTHONPATH=src python benchmarks/gemma3_kv_memory.py [--tokens 4096] [--gib 1] [--dtype-bytes 4]

Counted with the real block managers (no model, no torch): a pool of ``GiB / bytes per block id`` blocks, then
sequences of random tokens grown to ``--tokens`` tokens one after another (allocated with one block of prompt, then
appended a block at a time with ``decode_step``, as decoding does), until the next one no longer fits. Gemma 3
270M's KV per token and layer: 1 KV head x 256 dims x (key + value) x 4 bytes (fp32).

* one table (``BlockManager``): a block id holds 16 tokens of all 18 layers (18 x 2 x 16 x 256 x 4 B = 576 KiB);
  every layer keeps every token;
* KV cache groups (``HybridBlockManager``, what ``LLM("gemma-3-270m")`` uses): 6 groups of 3 layers, a block id
  holds 16 tokens of the 3 layers of one group (96 KiB); the full-attention group keeps every token, each of the
  5 sliding-window groups only the blocks covering its last 512 tokens.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pagedkv import BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import OutOfBlocksError

LAYERS, HEAD_DIM, KV_HEADS, WINDOW, GROUPS = 18, 256, 1, 512, 6


def count(manager, tokens: int, block_size: int, seed: int = 0) -> int:
    """Sequences grown to ``tokens`` tokens in ``manager`` before the next one does not fit."""
    rng = np.random.default_rng(seed)
    n = 0
    while True:
        seq = rng.integers(0, 262_144, tokens)
        try:
            manager.allocate(n, seq[:block_size].tolist())
        except OutOfBlocksError:
            return n
        done = block_size
        try:
            while done < tokens:
                step = min(block_size, tokens - done)
                manager.decode_step([n], seq[done:done + step].reshape(1, step))
                done += step
        except OutOfBlocksError:
            manager.free(n, cache=False)
            return n
        n += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per KV element (4: fp32, 2: bf16)")
    a = p.parse_args()
    bs = a.block_size
    per_token_layer = 2 * KV_HEADS * HEAD_DIM * a.dtype_bytes
    budget = int(a.gib * 2**30)
    rows = []
    one_bytes = LAYERS * bs * per_token_layer
    one = BlockManager(budget // one_bytes, bs, watermark=0.0)
    rows.append(("one table for all 18 layers", one_bytes, one, count(one, a.tokens, bs)))
    grp_bytes = LAYERS // GROUPS * bs * per_token_layer
    specs = [FullAttentionSpec()] + [SlidingWindowSpec(WINDOW)] * (GROUPS - 1)
    hyb = BlockManager(budget // grp_bytes, bs, kv_cache_groups=specs, watermark=0.0, grouped_results=True)
    rows.append(("KV cache groups (1 full + 5 sliding W=512)", grp_bytes, hyb, count(hyb, a.tokens, bs)))
    hyb.check_invariants()
    print(f"Gemma 3 270M, {a.tokens}-token sequences, {a.gib:g} GiB of KV ({a.dtype_bytes}-byte elements), "
          f"block size {bs}:")
    print()
    print("| layout | bytes per block id | blocks per GiB | concurrent sequences | blocks per sequence | "
          "KV per sequence (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, per_block, m, n in rows:
        used = (m.config.num_gpu_blocks - m.num_free_gpu_blocks) / n if n else float("nan")
        print(f"| {name} | {per_block:,} | {m.config.num_gpu_blocks:,} | {n} | {used:.0f} | {used * per_block / 2**20:.1f} |")
    print()
    print(f"groups / one table: {rows[1][3] / rows[0][3]:.2f}x the sequences per GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
