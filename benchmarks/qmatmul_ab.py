"""The quantized kernels against the dense float32 products, in one process, alternating (docs/engine-speed.md).

    PYTHONPATH=src .venv/bin/python benchmarks/qmatmul_ab.py [--model smollm2|gemma-3-270m]
        [--batches 1,4,16,32,48] [--rounds 5] [--threads 1] [--head-rows 1,2,4,8] [--engine-len 32,64]
        [--engine-batches 1,4]

The model (default SmolLM2-135M, its Q4_1 file; Gemma 3 270M's Q4_K_M) loaded once. Three parts:

1. products: every per-layer product of the model (SmolLM2: 30 layers x qkv, attn_output, gate_up, down, 107M
   weights) on random rows, the quantized kernels (``QuantLinear``) and ``F.linear`` on the dense float32 weight
   taking turns round by round; per row count the median ms of one pass over all of them, and the ratio kernels /
   dense (median and range over rounds). The weights stream from memory as in a forward, not from cache.
2. the LM head: the quantized table's float32 products (``LMHead.approx(h, proposals=False)``, greedy / top-k
   steps) against the bf16 product with its bound (``LMHead.approx(h)``), per row count.
3. engine: ``LLM`` on the model with the kernels and on the same weights without them (the same model object
   with dense products and a head without the quantized table), greedy, the same random prompts back to back per
   round; tokens/s (prompt + output) and whether the two gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pagedkv.engine.config import ModelRunConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, gemma-3-270m or a GGUF path")
    p.add_argument("--batches", default="1,4,16,32,48")
    p.add_argument("--head-rows", default="1,2,4,8", help="row counts of part 2 ('' skips it)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine-len", default="32,64", help="input,output tokens per prompt of part 2")
    p.add_argument("--engine-batches", default="1,4", help="prompts per run of part 2 ('' skips it)")
    a = p.parse_args()

    import numpy as np
    import torch
    import torch.nn.functional as F

    import copy

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.cpu import kernel_status
    from pagedkv.engine.model import DenseLinear
    from pagedkv.engine.sampling import LMHead
    from pagedkv.engine.registry import load_model
    from pagedkv.engine.sampling import SamplingParams

    torch.set_num_threads(a.threads)
    fast = load_model(None if a.model == "smollm2" else a.model)
    config = fast.config
    print(f"[qmatmul_ab] {a.model}, {a.threads} thread(s); kernels: {kernel_status()}; per-layer products: "
          f"{sorted({lin.kind if lin.uses_kernel else 'dense' for layer in fast.linears for lin in layer})}; "
          f"head: {fast.head.quantized.kind if fast.head.quantized is not None else 'bf16 only'}")
    if not fast.quant_kernels:
        print("[qmatmul_ab] no kernels: nothing to compare")
        return 1
    lins = [lin for layer in fast.linears for lin in layer]
    print("\n| rows | kernel ms | dense float32 ms | kernel / dense, median (min-max) |\n|---|---|---|---|")
    for rows in [int(b) for b in a.batches.split(",")]:
        xs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1]) for lin in lins}
        for lin in lins:
            lin.max_rows = max(rows, lin.max_rows)

        def one_pass(dense: bool) -> float:
            t = time.perf_counter()
            for lin in lins:
                x = xs[lin.weight.shape[1]]
                F.linear(x, lin.weight) if dense else lin(x)
            return time.perf_counter() - t

        one_pass(False), one_pass(True)  # warm-up
        k, d = [], []
        for _ in range(a.rounds):
            k.append(one_pass(False))
            d.append(one_pass(True))
        ratios = [x / y for x, y in zip(k, d)]
        print(f"| {rows} | {statistics.median(k) * 1e3:.2f} | {statistics.median(d) * 1e3:.2f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
    for lin in lins:
        lin.max_rows = type(lin).DEFAULT_MAX_ROWS

    def median_ms(fn) -> float:
        fn()
        ts = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    if a.head_rows and fast.head.quantized is not None:
        head = fast.head
        head.prepare()
        print("\n| head rows | quantized table ms | bf16 + bound ms | ratio |\n|---|---|---|---|")
        for rows in [int(r) for r in a.head_rows.split(",")]:
            h = torch.randn(rows, head.weight.shape[1])
            head.quantized.max_rows = max(rows, head.quantized.max_rows)
            q = median_ms(lambda: head._quantized_approx(h))
            b = median_ms(lambda: head.approx(h))
            print(f"| {rows} | {q:.2f} | {b:.2f} | {q / b:.2f} |", flush=True)
        head.quantized.max_rows = LMHead.QUANT_ROWS

    if not a.engine_batches:
        return 0
    dense = copy.copy(fast)  # the same weights; dense products, a head without the quantized table
    dense.linears = [tuple(DenseLinear(lin.weight) for lin in layer) for layer in fast.linears]
    dense.head = LMHead(fast.lm_head, softcap=fast.head.softcap)
    s_in, s_out = (int(v) for v in a.engine_len.split(","))
    sp = SamplingParams(temperature=0.0, max_tokens=s_out, ignore_eos=True)
    print(f"\nengine, greedy, {s_in} + {s_out} tokens per prompt, {a.rounds} rounds:\n")
    print("| prompts | with kernels tok/s | dense tok/s | ratio, median (min-max) | same tokens |\n|---|---|---|---|---|")
    for batch in [int(b) for b in a.engine_batches.split(",")]:
        rng = np.random.default_rng(batch)
        prompts = [rng.integers(100, config.vocab_size, s_in).tolist() for _ in range(batch)]
        rates: dict[str, list[float]] = {"fast": [], "dense": []}
        outs: dict[str, list] = {}
        for _ in range(a.rounds):
            for name, model in (("fast", fast), ("dense", dense)):
                llm = LLM(model, max_num_seqs=max(32, batch), run_config=ModelRunConfig(threads=a.threads))
                t = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
                rates[name].append(batch * (s_in + s_out) / (time.perf_counter() - t))
                outs[name] = [r.outputs[0].token_ids for r in res]
        ratios = [x / y for x, y in zip(rates["fast"], rates["dense"])]
        print(f"| {batch} | {statistics.median(rates['fast']):.1f} | {statistics.median(rates['dense']):.1f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{'yes' if outs['fast'] == outs['dense'] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
