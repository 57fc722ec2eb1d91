"""Command-line options shared by every command that builds an engine (``generate``, ``chat``,
``bench throughput``, ``serve``), and the constructors that turn them into an ``LLM`` and ``SamplingParams``.

Torch-free at import time (the engine is imported inside the constructors), so the ``pagedkv`` command imports it
without loading torch until an engine command runs.
"""

from __future__ import annotations

import argparse
import re

from ..retention.eviction import EVICTION_POLICIES

__all__ = ["add_engine_args", "add_sampling_args", "make_llm", "make_params"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model name (smollm2-135m, the default, or gemma-3-270m) or the path of a GGUF file")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV-cache blocks (default: 1 GiB worth)")
    p.add_argument("--num-cpu-blocks", type=int, default=0,
                   help="CPU blocks for swap preemption and the CPU tier of the prefix cache")
    p.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="the CPU blocks given in GiB, as vLLM's --swap-space (instead of --num-cpu-blocks; "
                        "default: --num-cpu-blocks)")
    p.add_argument("--cpu-prefix-cache", action="store_true",
                   help="demote evicted prefix-cache blocks to the CPU blocks and promote them back on a hit")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="no_prefix_caching",
                   action="store_true", help="turn the prefix cache off (on by default; the second name is vLLM's)")
    p.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false",
                   help="the prefix cache on (the default; vLLM's name)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="the longest sequence (prompt + output) a request may have (default: the model's context)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step: with chunked prefill, decodes plus prompt chunks; without, "
                        "whole prompts (a longer prompt runs alone in its step) (default: 512 with chunked "
                        "prefill, 2048 without)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill long prompts in chunks within the step's token budget, decodes first, so that "
                        "a long prompt does not stop the streams that are decoding")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
                   help="with chunked prefill, the most prompt tokens one request gets in one step, so that "
                        "several long prompts progress together (0: no cap besides the budget)")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="what a preempted request gives up: its KV (recompute) or its GPU blocks (swap to the "
                        "--num-cpu-blocks)")
    p.add_argument("--fast-lm-head", action=argparse.BooleanOptionalAction, default=True,
                   help="the exact fast LM head: bf16 logits with a rigorous error bound, the entries the bound "
                        "cannot decide rescored in float32 (same tokens as float32 logits; docs/engine-speed.md); "
                        "--no-fast-lm-head computes every row's logits in float32")
    p.add_argument("--quant-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="decode steps of up to 32 sequences read the GGUF file's quantized weights with float32 "
                        "activations, each weight rebuilt exactly (the float32 model's products up to summation "
                        "order; docs/engine-speed.md); --no-quant-kernels uses the dense float32 weights only")
    p.add_argument("--threads", type=_threads_arg, default=None, metavar="N",
                   help="CPU threads of the model's products (default: OMP_NUM_THREADS when set, else the cores "
                        "other processes leave free, re-checked while running; docs/engine-speed.md)")
    p.add_argument("--sliding-window", type=int, default=None, metavar="TOKENS",
                   help="attend to the last TOKENS tokens only, releasing older blocks (default: full attention)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: admit by each request's priority then arrival, preempt the largest first "
                        "(vLLM's; a lower value is more urgent)")
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="lru",
                   help="the prefix cache's eviction order (pagedkv.retention.eviction; one block table only)")
    p.add_argument("--pin-budget-blocks", type=int, default=0, metavar="BLOCKS",
                   help="most KV blocks pinned prefixes may hold (BlockManager.pin_prefix; one block table only)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="a disk tier under the prefix cache in DIR (one process at a time; survives restarts: "
                        "a restarted engine loads the KV stored there; a directory that cannot be written is "
                        "served read-only by pagedkv serve) (LMCache's local_disk)")
    p.add_argument("--kv-disk-gib", type=float, default=None, metavar="GIB",
                   help="the disk tier's bound in GiB; past it a chain's tail is evicted before its head, least "
                        "recently used first (default with pagedkv serve: 10, or half the free space when less; "
                        "LMCache's max_local_disk_size)")
    p.add_argument("--kv-shared", default=None, metavar="URL",
                   help="a KV tier every replica shares: redis://HOST:PORT (Redis or Valkey; LMCache's remote_url) "
                        "or file:///DIR (a shared directory)")
    p.add_argument("--kv-load-max-ms-per-block", type=float, default=683.0, metavar="MS",
                   help="the crossover: a tier whose measured load time per block is above MS is not read and the "
                        "prompt is computed (default 683: this machine's SmolLM2 prefill time per 16-token block; "
                        "0: always load)")
    p.add_argument("--kv-store-policy", type=_store_policy_arg, default=None, metavar="POLICY",
                   help="what the engine writes to the tiers, off the step loop (SGLang's --hicache-write-policy): "
                        "through (default: every full block once computed or loaded), selective:N (a block once "
                        "prefix hits took it N times), back (a cached block about to be evicted), off (load only)")
    p.add_argument("--kv-store", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-kv-store: the same as --kv-store-policy off")


_STORE_POLICY = re.compile(r"^(through|write_through|(selective|write_through_selective)(:[1-9][0-9]*)?|back|write_back"
                           r"|off)$")


def _store_policy_arg(text: str) -> str:
    t = text.strip().lower()
    if not _STORE_POLICY.match(t):
        raise argparse.ArgumentTypeError(f"must be through, selective[:N] (N >= 1), back or off, got {text!r}")
    return t


def _threads_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return n


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens generated per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this total probability")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh one)")


def _store_policy(args: argparse.Namespace) -> str:
    """``--kv-store-policy``, or ``--[no-]kv-store`` without it."""
    pol = getattr(args, "kv_store_policy", None)
    if pol is not None:
        return pol
    return "through" if getattr(args, "kv_store", True) else "off"


def make_llm(args: argparse.Namespace, **over):
    """An ``LLM`` from the options of :func:`add_engine_args`; keywords in ``over`` take precedence."""
    from .llm import LLM

    kw = dict(
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
        enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, preemption_mode=args.preemption_mode,
        sliding_window=args.sliding_window, device=args.device, cpu_prefix_cache=args.cpu_prefix_cache,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        fast_lm_head=getattr(args, "fast_lm_head", True),
        quant_kernels=getattr(args, "quant_kernels", True),
        max_model_len=getattr(args, "max_model_len", None), swap_space=getattr(args, "swap_space", None),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        eviction_policy=getattr(args, "eviction_policy", "lru"),
        pin_budget_blocks=getattr(args, "pin_budget_blocks", 0),
        threads=getattr(args, "threads", None),
    )
    if getattr(args, "kv_disk_dir", None) is not None or getattr(args, "kv_shared", None) is not None:
        ms = getattr(args, "kv_load_max_ms_per_block", 683.0)
        kw.update(kv_disk_dir=args.kv_disk_dir, kv_disk_gib=args.kv_disk_gib, kv_shared=args.kv_shared,
                  kv_load_max_ms_per_block=ms if ms else None, kv_store=_store_policy(args))
    elif getattr(args, "kv_disk_gib", None) is not None:
        kw["kv_disk_gib"] = args.kv_disk_gib  # (LLM refuses it without a directory)
    kw.update(over)
    return LLM(args.model, **kw)


def make_params(args: argparse.Namespace, **over):
    """``SamplingParams`` from the options of :func:`add_sampling_args`."""
    from .sampling import SamplingParams

    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed)
    kw.update(over)
    return SamplingParams(**kw)
