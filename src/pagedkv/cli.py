"""The ``pagedkv`` command.

::

    pagedkv generate "prompt"            stream a reply (chat template applied if the model has one, else plain
                                         completion; --raw for plain completion)
    pagedkv chat                         interactive chat
    pagedkv bench [options]              block-manager benchmark suite (pagedkv vs anchors, ablation)
    pagedkv bench throughput [options]   end-to-end engine throughput, like vLLM's benchmark_throughput.py
    pagedkv replay TRACE.jsonl [options] replay a production trace through the prefix cache (hit rate vs capacity)
    pagedkv serve [options]              OpenAI-compatible HTTP server (extra pagedkv[serve])
    pagedkv bench serve [options]        load a running server, like vLLM's benchmark_serving.py
    pagedkv router --backend URL,EVENTS  KV-cache-aware router over several `pagedkv serve` replicas

The engine commands import torch lazily; ``pagedkv bench`` (the block-manager suite) and ``pagedkv replay`` never
do, and nothing imports FastAPI before ``pagedkv serve`` or ``pagedkv router`` runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .engine.options import add_engine_args as _engine_args, add_sampling_args as _sampling_args
from .engine.options import make_llm as _make_llm, make_params as _params

__all__ = ["main"]


def _model_label(args: argparse.Namespace) -> str:
    return args.model or "smollm2-135m"


def _cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    prompt = " ".join(args.prompt)
    raw = args.raw
    if args.chat:
        llm.tokenizer.require_chat_template(_model_label(args))
    elif not raw and not llm.tokenizer.has_chat_template:
        print(f"pagedkv: {_model_label(args)} has no chat template (a base model): plain completion", file=sys.stderr)
        raw = True
    if raw:
        source: object = prompt
    else:
        source = {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])}
    before = _cache_counts(llm)
    for piece in llm.stream(source, _params(args)):
        print(piece, end="", flush=True)
    print()
    print(_cache_line(llm, before), file=sys.stderr)
    return 0


def _cache_counts(llm) -> tuple[int, int, int]:
    """(prompt tokens, prefix-cache hit tokens, tokens loaded from the KV tiers) so far."""
    bm, st = llm.block_manager.stats, llm.scheduler.stats
    return (int(getattr(bm, "prefix_query_tokens", 0)), int(getattr(bm, "prefix_hit_tokens", 0)),
            int(getattr(st, "external_tokens", 0)))


def _cache_line(llm, before: tuple[int, int, int]) -> str:
    """How many prompt tokens of the last request came from cache (the GPU prefix cache, the KV tiers)."""
    q, hit, ext = (a - b for a, b in zip(_cache_counts(llm), before))
    tiers = f" ({ext} loaded from the KV tiers)" if llm.kv_tiers is not None else ""
    return f"pagedkv: {hit + ext} of {q} prompt tokens from cache{tiers}"


def _cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    llm.tokenizer.require_chat_template(_model_label(args))
    messages: list[dict] = []
    print("pagedkv chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(messages)
        reply = ""
        for piece in llm.stream({"prompt_token_ids": ids}, _params(args)):
            reply += piece
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def _cmd_bench_throughput(argv: Sequence[str]) -> int:
    from .engine.throughput import main as throughput_main

    return throughput_main(argv)


def _cmd_serve(argv: Sequence[str]) -> int:
    from .server.cli import main as serve_main

    return serve_main(argv)


def _cmd_bench_serve(argv: Sequence[str]) -> int:
    from .server.bench import main as bench_serve_main

    return bench_serve_main(argv)


def _cmd_bench_suite(argv: Sequence[str]) -> int:
    from .bench.__main__ import main as bench_main

    return bench_main(list(argv))


def _cmd_router(argv: Sequence[str]) -> int:
    from .router.cli import main as router_main

    return router_main(list(argv))


def _cmd_replay(argv: Sequence[str]) -> int:
    from .replay.__main__ import main as replay_main

    return replay_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:
        return _cmd_replay(argv[1:])
    if argv[:1] == ["bench"]:
        rest = argv[1:]
        if rest[:1] == ["throughput"]:
            return _cmd_bench_throughput(rest[1:])
        if rest[:1] == ["serve"]:
            return _cmd_bench_serve(rest[1:])
        return _cmd_bench_suite(rest)
    if argv[:1] == ["serve"]:
        return _cmd_serve(argv[1:])
    if argv[:1] == ["router"]:
        return _cmd_router(argv[1:])
    from ._help import HelpFormatter, plain

    parser = argparse.ArgumentParser(prog="pagedkv", description=plain(__doc__), formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a reply to a prompt", description="Stream a reply to a prompt.",
                       formatter_class=HelpFormatter)
    g.add_argument("prompt", nargs="+", help="the prompt (several words are joined by spaces)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    mode.add_argument("--chat", action="store_true",
                      help="apply the chat template (the default when the model has one; refused when it has none)")
    _engine_args(g)
    _sampling_args(g)
    c = sub.add_parser("chat", help="interactive chat", description="Interactive chat; an empty line ends it.",
                       formatter_class=HelpFormatter)
    _engine_args(c)
    _sampling_args(c)
    sub.add_parser("bench", help="benchmarks: `pagedkv bench --help`, `pagedkv bench throughput --help`, "
                                 "`pagedkv bench serve --help`")
    sub.add_parser("replay", help="replay a request trace through the prefix cache: `pagedkv replay --help`")
    sub.add_parser("serve", help="OpenAI-compatible server: `pagedkv serve --help`")
    sub.add_parser("router", help="KV-cache-aware router over serve replicas: `pagedkv router --help`")
    args = parser.parse_args(argv)
    from .errors import PagedKVError

    try:
        return _cmd_generate(args) if args.cmd == "generate" else _cmd_chat(args)
    except (PagedKVError, FileNotFoundError) as e:
        print(f"pagedkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
