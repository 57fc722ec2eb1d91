"""Same-process A/B of a plain ``LLM.generate`` (no tiers, no split) between this tree's pagedkv and another
checkout's, loaded side by side under another package name, alternating run for run::

    git archive main src/pagedkv | tar -x -C /tmp/base_main
    PYTHONPATH=$PWD/src .venv/bin/python scripts/ab_generate.py /tmp/base_main/src/pagedkv --rounds 9
    PYTHONPATH=$PWD/src .venv/bin/python scripts/ab_generate.py /tmp/base_main/src/pagedkv --rounds 9 --other-first

Each round generates the same batch of greedy completions with each engine (the order alternates per round);
prints each round's ratio this / other and their median. The default model (SmolLM2-135M) on the CPU, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench_groups import load_baseline  # noqa: E402 - (scripts/ is on a script's path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline", help="the other tree's src/pagedkv")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--other-first", action="store_true",
                    help="build the other tree's engine first (the engine built second runs a few %% faster here: "
                         "an A/A run of one tree against itself shows the bias; run both orders)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    import pagedkv.engine as this_engine

    base = load_baseline(args.baseline)
    importlib.import_module("pagedkv_base.engine")
    base_engine = sys.modules["pagedkv_base.engine"]
    kw = dict(num_gpu_blocks=256, max_num_seqs=8)
    engines = {"this": this_engine, "other": base_engine}
    # one thread each, fixed (the automatic policy re-reads the free cores and sets torch's process-wide count)
    order = ("other", "this") if args.other_first else ("this", "other")
    llms = {k: engines[k].LLM(None, run_config=engines[k].ModelRunConfig(threads=1), **kw) for k in order}
    prompts = [f"Question {i}: what is the capital of France? Answer:" for i in range(args.batch)]
    params = {k: e.SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
              for k, e in engines.items()}
    outs = {}
    for k in llms:  # warm-up, and the same tokens from both
        outs[k] = [o.outputs[0].token_ids for o in llms[k].generate(prompts, params[k], use_tqdm=False)]
    assert outs["this"] == outs["other"], "the two trees generate different tokens"
    ratios = []
    for r in range(args.rounds):
        t = {}
        for k in (("this", "other") if r % 2 == 0 else ("other", "this")):
            t0 = time.perf_counter()
            llms[k].generate(prompts, params[k], use_tqdm=False)
            t[k] = time.perf_counter() - t0
        ratios.append(t["this"] / t["other"])
        print(f"round {r}: this {t['this']:.3f} s, other {t['other']:.3f} s, ratio {ratios[-1]:.3f}")
    print(f"median ratio this / other: {statistics.median(ratios):.3f} ({args.rounds} rounds, batch "
          f"{args.batch}, {args.tokens} tokens, built first: {order[0]})")
    del base


if __name__ == "__main__":
    main()
