"""``pagedkv bench throughput``: offline throughput of the reference engine, like vLLM's benchmark_throughput.py.

Random prompts of ``--input-len`` token ids, ``--output-len`` tokens generated each with end-of-sequence ignored,
all submitted at once. Prints ``Throughput: X requests/s, Y tokens/s`` (prompt plus output tokens per second, as
vLLM counts them), output tokens/s, and the engine-time split: the share of wall time spent in the block
manager, in the rest of the scheduler, in the model (metadata, KV copies, forward) and in sampling, so the next
bottleneck is visible.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Sequence

import numpy as np

__all__ = ["format_split", "main", "run_throughput"]


def run_throughput(llm, *, input_len: int, output_len: int, num_prompts: int, n: int = 1, seed: int = 0,
                   use_tqdm: bool = True) -> dict:
    """Run the workload on ``llm`` (after a short warm-up) and return the measured figures."""
    from .sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.model.config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab, input_len).tolist()} for _ in range(num_prompts)]
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True, seed=seed)
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    t = llm.last_times
    out_tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
    total_tokens = num_prompts * input_len + out_tokens
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "n": n,
        "elapsed_s": t.total,
        "requests_per_s": num_prompts / t.total,
        "tokens_per_s": total_tokens / t.total,
        "output_tokens_per_s": out_tokens / t.total,
        "block_manager_s": t.block_manager,
        "scheduler_s": t.scheduler - t.block_manager,
        "model_s": t.model,
        "sampling_s": t.sampling,
        "model_share": t.model / t.total,
        "sampling_share": t.sampling / t.total,
        "torch_threads": _threads(),
        "threads_source": llm.core.thread_policy.source,
        "thread_checks": llm.core.thread_policy.checks,
        "fast_lm_head": bool(getattr(llm, "fast_lm_head", False)),
        "quant_kernels": bool(getattr(llm, "quant_kernels", False)),
        "block_manager_share": t.block_manager / t.total,
        "scheduler_share": (t.scheduler - t.block_manager) / t.total,
        "num_gpu_blocks": llm.block_manager.config.num_gpu_blocks,
        "preemptions": llm.scheduler.stats.preemptions,
        "prefix_hit_rate": llm.block_manager.stats.hit_rate,
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def format_split(r: dict) -> str:
    """The engine-time split of a :func:`run_throughput` result as one line."""
    return (f"Engine time: block manager {100 * r['block_manager_share']:.3f}% ({r['block_manager_s'] * 1e3:.1f} ms), "
            f"scheduler (rest) {100 * r['scheduler_share']:.3f}% ({r['scheduler_s'] * 1e3:.1f} ms), "
            f"model {100 * r['model_share']:.1f}% ({r['model_s']:.2f} s), "
            f"sampling {100 * r['sampling_share']:.1f}% ({r['sampling_s']:.2f} s); "
            f"torch threads: {r['torch_threads']}; preemptions: {r['preemptions']}"
            + (f"; fast LM head: {'on' if r['fast_lm_head'] else 'off'}" if "fast_lm_head" in r else "")
            + (f"; quantized kernels: {'on' if r['quant_kernels'] else 'off'}" if "quant_kernels" in r else ""))


def main(argv: Sequence[str] | None = None) -> int:
    from .options import add_engine_args as _engine_args, make_llm as _make_llm

    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv bench throughput", description=plain(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request")
    p.add_argument("--num-prompts", type=int, default=32, help="requests, all submitted at once")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and of sampling")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the figures as JSON to PATH")
    _engine_args(p)
    args = p.parse_args(argv)
    import torch

    llm = _make_llm(args)
    r = run_throughput(llm, input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                       n=args.n, seed=args.seed)
    print(f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['tokens_per_s']:.2f} tokens/s "
          f"({r['output_tokens_per_s']:.2f} output tokens/s)")
    print(format_split(r))
    if args.output_json:
        r["machine"] = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                        "threads": torch.get_num_threads()}
        r["command"] = "pagedkv bench throughput " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
