"""``pagedkv router``: a KV-cache-aware router in front of ``pagedkv serve`` replicas (see :mod:`pagedkv.router`).

Example (two replicas publishing KV events, a router on port 8080)::

    pagedkv serve --port 8001 --kv-events-endpoint tcp://127.0.0.1:5557 &
    pagedkv serve --port 8002 --kv-events-endpoint tcp://127.0.0.1:5567 &
    pagedkv router --backend http://127.0.0.1:8001,tcp://127.0.0.1:5557 \\
                   --backend http://127.0.0.1:8002,tcp://127.0.0.1:5567 --port 8080

A prefill/decode split (docs/pd-split.md): prompts to the prefill replicas (by prefix), the decode to a decode
replica with the KV blocks the prefill replica holds for it::

    pagedkv router --prefill http://127.0.0.1:8001,tcp://127.0.0.1:5557 --decode http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """One option per field of :class:`~pagedkv.router.config.RouterConfig`, then the HTTP deadlines
    (:func:`pagedkv.server.http_options.add_http_args`)."""
    from .._cli_config import add_config_args
    from .._help import HelpFormatter, plain
    from ..server.http_options import add_http_args
    from .config import RouterConfig

    p = argparse.ArgumentParser(prog="pagedkv router", description=plain(__doc__), formatter_class=HelpFormatter)
    add_config_args(p, RouterConfig)
    add_http_args(p)
    return p


def make_router(args: argparse.Namespace):
    """A :class:`~pagedkv.router.app.RouterServer` from parsed options (ValueError / FileNotFoundError on bad
    ones)."""
    from .._cli_config import config_from_args
    from ..cluster.redis_index import RedisIndex, open_index
    from ..server.http_options import check_http_args, http_options
    from .app import RouterServer
    from .config import RouterConfig
    from .prompt import PromptBuilder, load_tokenizer
    from .proxy import UpstreamOptions
    from .state import RouterState, parse_backend

    cfg = config_from_args(RouterConfig, args)
    check_http_args(args)
    upstream = UpstreamOptions(connect_timeout=cfg.upstream_connect_timeout, read_timeout=cfg.upstream_read_timeout,
                               max_connections=cfg.upstream_max_connections, api_key=cfg.replica_api_key)
    if not (cfg.backend or cfg.prefill or cfg.decode):
        raise ValueError("give at least one --backend (or --prefill and --decode)")
    if bool(cfg.prefill) != bool(cfg.decode):
        raise ValueError("a prefill/decode split needs both --prefill and --decode replicas")
    replicas = [parse_backend(b) for b in cfg.backend] + [parse_backend(b, "prefill") for b in cfg.prefill] + \
        [parse_backend(b, "decode") for b in cfg.decode]
    if cfg.index.startswith(("redis://", "rediss://", "unix://")):
        try:
            index = RedisIndex(cfg.index, prefix=cfg.index_prefix, shared_capacity_blocks=cfg.shared_index_blocks)
        except ImportError:
            raise ValueError("--index redis:// needs the redis package (pip install 'pagedkv[router]')") from None
        except Exception as e:  # redis.ConnectionError and friends
            raise ValueError(f"cannot reach the Redis index at {cfg.index}: {e}") from None
    else:
        index = open_index(cfg.index, shared_capacity_blocks=cfg.shared_index_blocks)
    state = RouterState(replicas, index, route=cfg.route, balance_slack=cfg.balance_slack,
                        balance_abs=cfg.balance_abs, block_size=cfg.block_size,
                        approx_capacity_blocks=cfg.approx_capacity_blocks, min_match=cfg.min_match,
                        weights=cfg.weights)
    hasher = None
    if cfg.hash_scheme == "vllm":
        from ..cluster.vllm_hash import VLLMHasher

        hasher = VLLMHasher(cfg.vllm_hash_algo, cfg.vllm_hash_seed, cfg.block_size)
    builder = PromptBuilder(load_tokenizer(cfg.model), cfg.block_size, hasher)
    from ..server.launch import served_model_names

    name, aliases = served_model_names(cfg.model)
    return RouterServer(state, builder, host=cfg.host, port=cfg.port, topic=cfg.kv_events_topic,
                        health_interval=cfg.health_interval, health_timeout=cfg.health_timeout,
                        health_fails=cfg.health_fails, api_key=cfg.api_key, upstream=upstream,
                        max_body_bytes=cfg.max_body_bytes, model_names=(name, *aliases), http=http_options(args))


def setup_logging() -> None:
    """The router's own lines (replica down/up, retries, index outages, stream failures) on stderr, in
    uvicorn's style."""
    log = logging.getLogger("pagedkv.router")
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s:     pagedkv.router: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        server = make_router(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:  # (ImportError: a missing extra, named)
        print(f"pagedkv router: error: {e}", file=sys.stderr)
        return 2
    split = f" ({len(args.prefill)} prefill, {len(args.decode)} decode)" if args.prefill else ""
    print(f"pagedkv router: {len(server.state.replicas)} replicas{split}, route {args.route}, index {args.index}, "
          f"on http://{args.host}:{args.port}", file=sys.stderr)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
