"""The stall of decoding streams when a long prompt arrives, chunked prefill against one-step prefill, in one
process (no server): ``streams`` requests decode; at step ``arrive`` a prompt of ``prompt_len`` tokens is added;
every step is timed until that prompt has its first token. Prints, per mode and repeat (modes alternate), the
longest step the decoding streams waited through (the stall), the long prompt's time to first token, and the
median step time before it arrived; then the ratios of the medians (chunked / one-step).

    PYTHONPATH=src python benchmarks/chunked_stall.py --prompt-len 3500 --repeats 2 --threads 2

Engine-level counterpart of the serving benchmark's stall figure (``pagedkv bench serve``); noisy on a shared
machine: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def one_run(model, chunked: bool, args) -> dict:
    from pagedkv.engine.config import engine_configs
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampling import SamplingParams

    kw = {} if args.budget is None else {"max_num_batched_tokens": args.budget}
    if not chunked:
        kw["max_num_batched_tokens"] = max(args.prompt_len, 2048)
    llm = LLM(model, **engine_configs(enable_chunked_prefill=chunked, enable_prefix_caching=False, max_num_seqs=8,
                                      threads=args.threads,
                                      num_gpu_blocks=-(-(args.prompt_len + 128) // 16) + args.streams * 260, **kw))
    rng = random.Random(args.seed)

    def add(n_tokens: int, max_tokens: int):
        r = llm.core.make_request({"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(n_tokens)]},
                                  SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        llm.core.add_request(r)
        return r

    for _ in range(args.streams):
        add(16, 4000)
    before, after, after_cpu = [], [], []
    long_req = t_arrive = None
    step = 0
    while True:
        t, c = time.perf_counter(), time.process_time()
        llm.core.step()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        step += 1
        if long_req is None:
            before.append(dt)
            if step == args.arrive:
                long_req = add(args.prompt_len, 100)
                t_arrive = time.perf_counter()
            continue
        after.append(dt)
        after_cpu.append(dc)
        if llm.scheduler.sequence(_seq0(llm, long_req)).output:
            ttft = time.perf_counter() - t_arrive
            break
    return {"stall": max(after), "stall_cpu": max(after_cpu), "ttft": ttft, "ttft_cpu": sum(after_cpu),
            "steps": len(after), "step_before": statistics.median(before[2:])}


def _seq0(llm, req) -> int:
    return llm.scheduler._requests[req.request_id].seqs[0].seq_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=3500)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--arrive", type=int, default=6, help="the step after which the long prompt arrives")
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens with chunking (default: LLM's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from pagedkv.engine.registry import load_model

    model = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
    res: dict = {"one-step": [], "chunked": []}
    for rep in range(args.repeats):
        for mode in (("one-step", "chunked") if rep % 2 == 0 else ("chunked", "one-step")):
            r = one_run(model, mode == "chunked", args)
            res[mode].append(r)
            print(f"{mode:9s} rep {rep}: stall {r['stall']:.2f} s (CPU {r['stall_cpu']:.2f} s)  ttft {r['ttft']:.2f} s "
                  f"(CPU {r['ttft_cpu']:.2f} s)  steps {r['steps']}  step before {r['step_before'] * 1e3:.0f} ms",
                  flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("stall", "ttft", "stall_cpu", "ttft_cpu")}
           for m, rs in res.items()}
    c, o = med["chunked"], med["one-step"]
    print(f"chunked / one-step (medians): stall {c['stall'] / o['stall']:.2f}x ({c['stall']:.2f} vs {o['stall']:.2f} s), "
          f"CPU time of the longest step {c['stall_cpu'] / o['stall_cpu']:.2f}x ({c['stall_cpu']:.2f} vs "
          f"{o['stall_cpu']:.2f} s); ttft {c['ttft'] / o['ttft']:.2f}x ({c['ttft']:.2f} vs {o['ttft']:.2f} s), "
          f"CPU {c['ttft_cpu'] / o['ttft_cpu']:.2f}x")


if __name__ == "__main__":
    main()
