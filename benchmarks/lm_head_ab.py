"""The exact fast LM head against the float32 one, in one process, alternating (docs/engine-speed.md, round five).

    PYTHONPATH=src .venv/bin/python benchmarks/lm_head_ab.py [--model gemma-3-270m] [--batches 1,4,16,32]
        [--len 32,32] [--rounds 2] [--greedy]

One model loaded once; per round and batch size, ``LLM(model, run_config=ModelRunConfig(fast_lm_head=True))`` and
``False`` run the same random prompts (``--len`` input,output tokens each, end-of-sequence ignored, temperature 1 over
the whole vocabulary, or greedy with ``--greedy``) back to back, so a slow spell of a shared machine hits both alike.
Prints tokens/s (prompt + output) of both, the ratio fast / float32 per pair (median and range over rounds) and the LM
head's counters (bf16 products, float32 fallbacks, rescored entries, rejections); ``--out`` writes JSON. With
``--greedy`` the two heads' tokens are also compared (they must be equal). """

from __future__ import annotations

import argparse
import json
import statistics
import time
from pagedkv.engine.config import ModelRunConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--len", default="32,32", help="input,output tokens per prompt")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--greedy", action="store_true", help="greedy instead of sampling at temperature 1")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()

    import numpy as np
    import torch

    from pagedkv.engine.llm import LLM
    from pagedkv.engine.registry import load_model
    from pagedkv.engine.sampling import SamplingParams

    torch.set_num_threads(a.threads)
    model = load_model(a.model)
    model.head.prepare()
    n_in, n_out = (int(x) for x in a.len.split(","))
    batches = [int(x) for x in a.batches.split(",")]
    vocab = model.config.vocab_size
    sp = SamplingParams(temperature=0.0 if a.greedy else 1.0, max_tokens=n_out, ignore_eos=True, seed=0)
    rows = []
    for rnd in range(a.rounds):
        for bsz in batches:
            rng = np.random.default_rng(1000 * rnd + bsz)
            prompts = [{"prompt_token_ids": rng.integers(100, vocab, n_in).tolist()} for _ in range(bsz)]
            res = {}
            for fast in ((True, False) if rnd % 2 == 0 else (False, True)):
                llm = LLM(model, max_num_seqs=max(32, bsz), run_config=ModelRunConfig(fast_lm_head=fast,
                          threads=a.threads))
                llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)
                before = dict(model.head.stats)
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                el = time.perf_counter() - t
                stats = {k: model.head.stats[k] - before[k] for k in before}
                res[fast] = {"tokens_per_s": bsz * (n_in + n_out) / el, "elapsed_s": el, "head": stats,
                             "model_s": llm.last_times.model, "sampling_s": llm.last_times.sampling,
                             "tokens": [list(o.outputs[0].token_ids) for o in outs]}
            row = {"round": rnd, "batch": bsz, "fast": res[True]["tokens_per_s"], "float32": res[False]["tokens_per_s"],
                   "ratio": res[True]["tokens_per_s"] / res[False]["tokens_per_s"], "head": res[True]["head"],
                   "split_fast": [res[True]["model_s"], res[True]["sampling_s"]],
                   "split_float32": [res[False]["model_s"], res[False]["sampling_s"]]}
            if a.greedy:
                row["equal_tokens"] = res[True]["tokens"] == res[False]["tokens"]
            rows.append(row)
            print(f"round {rnd} batch {bsz:3d}: fast {row['fast']:7.1f} tok/s, float32 {row['float32']:7.1f} tok/s, "
                  f"fast / float32 {row['ratio']:.2f}x; head {row['head']}"
                  + (f"; equal tokens: {row['equal_tokens']}" if a.greedy else ""), flush=True)
    print()
    print(f"| batch | fast LM head tok/s | float32 LM head tok/s | fast / float32 (median, range over {a.rounds}) |")
    print("|---|---|---|---|")
    for bsz in batches:
        rs = [r for r in rows if r["batch"] == bsz]
        ratios = [r["ratio"] for r in rs]
        print(f"| {bsz} | {statistics.median(r['fast'] for r in rs):.1f} | "
              f"{statistics.median(r['float32'] for r in rs):.1f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "len": [n_in, n_out], "greedy": a.greedy, "threads": a.threads,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
