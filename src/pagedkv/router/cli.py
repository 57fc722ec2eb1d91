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
    from ..cluster.policy import ROUTES, TIER_WEIGHTS

    from .._help import HelpFormatter, plain
    from ..server.http_options import add_http_args

    p = argparse.ArgumentParser(prog="pagedkv router", description=plain(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--backend", action="append", default=[], metavar="URL[,EVENTS[,REPLAY]]",
                   help="a replica: its base URL, and its KV-events ZMQ endpoint (replay endpoint: the events "
                        "port + 1 unless given); repeat for each replica")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,EVENTS[,REPLAY]]",
                   help="a prefill replica of a prefill/decode split (pagedkv serve --kv-role prefill), as "
                        "--backend; with --decode, prompts go here (by prefix) and the decode to a decode replica "
                        "(docs/pd-split.md)")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,EVENTS[,REPLAY]]",
                   help="a decode replica of a prefill/decode split (pagedkv serve --kv-role decode)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
    p.add_argument("--route", choices=ROUTES, default="prefix", help="routing policy (default: prefix)")
    p.add_argument("--index", default="memory", metavar="memory|redis://HOST:PORT",
                   help="where the prefix index lives (default: this process's memory)")
    p.add_argument("--index-prefix", default="pagedkv", help="key prefix in Redis (default: pagedkv)")
    p.add_argument("--model", default=None, help="model name (smollm2-135m, the default, or gemma-3-270m) or GGUF "
                                                 "file whose tokenizer the replicas use (metadata only); a replica "
                                                 "whose /v1/models lists another model gets a warning at start-up")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size (default 16)")
    p.add_argument("--hash-scheme", choices=("pagedkv", "vllm"), default="pagedkv",
                   help="the block hashes the replicas' KV events name blocks by: pagedkv (pagedkv serve) or vllm "
                        "(vLLM replicas: the router computes vLLM's hashes, docs/compat.md; default pagedkv)")
    p.add_argument("--vllm-hash-algo", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"), default="sha256",
                   help="with --hash-scheme vllm: the replicas' --prefix-caching-hash-algo (default sha256)")
    p.add_argument("--vllm-hash-seed", default=None, metavar="SEED",
                   help="with --hash-scheme vllm: the replicas' PYTHONHASHSEED (default: unset, vLLM's fixed seed "
                        "for sha256 / sha256_cbor; the xxhash algorithms need it)")
    p.add_argument("--balance-slack", type=float, default=0.2,
                   help="prefix routes skip a replica whose load (prompt tokens still to compute for its requests "
                        "in flight) would exceed (1 + slack) x the mean + --balance-abs (default 0.2)")
    p.add_argument("--balance-abs", type=float, default=1024.0, help="absolute allowance in tokens (default 1024)")
    p.add_argument("--min-match", type=float, default=0.3,
                   help="a cached prefix shorter than this fraction of the prompt counts as none (default 0.3)")
    p.add_argument("--cpu-weight", type=float, default=TIER_WEIGHTS["CPU"],
                   help="prefix route: weight of a cached block the replica reads from its CPU tier (a GPU block "
                        f"weighs 1; default {TIER_WEIGHTS['CPU']:g})")
    p.add_argument("--disk-weight", type=float, default=TIER_WEIGHTS["DISK"],
                   help=f"prefix route: weight of a block in the replica's disk tier (default {TIER_WEIGHTS['DISK']:g})")
    p.add_argument("--shared-weight", type=float, default=TIER_WEIGHTS["SHARED"],
                   help="prefix route: weight of a block in the store every replica shares (KV events with medium "
                        f"SHARED), counted for every replica (default {TIER_WEIGHTS['SHARED']:g})")
    p.add_argument("--shared-index-blocks", type=int, default=None, metavar="N",
                   help="keep at most N blocks of the shared store in the index, least recently reported first "
                        "out (the store evicts without telling; default: unbounded)")
    p.add_argument("--approx-capacity-blocks", type=int, default=65536,
                   help="prefix-approx: blocks each replica is assumed to cache (default 65536)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--health-timeout", type=float, default=3.0, help="seconds a health check may take")
    p.add_argument("--health-fails", type=int, default=3,
                   help="failed checks in a row before a replica leaves routing (3)")
    p.add_argument("--kv-events-topic", default="kv-events", help="ZMQ topic of the replicas' KV-event messages")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (/health and /metrics stay open)")
    p.add_argument("--replica-api-key", default=None,
                   help="API key sent to the replicas (default: the client's Authorization header is forwarded)")
    p.add_argument("--upstream-read-timeout", type=float, default=300.0,
                   help="seconds a replica may stay silent (before answering, or between two stream chunks) "
                        "before the request fails with 504 or an error event (default 300)")
    p.add_argument("--upstream-connect-timeout", type=float, default=2.0,
                   help="seconds to connect to a replica before trying another (default 2)")
    p.add_argument("--upstream-max-connections", type=int, default=256,
                   help="connections to each replica at once; requests beyond wait up to 5 s, then go to another "
                        "replica or get 503 (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 2 MiB, as pagedkv serve)")
    add_http_args(p)
    return p


def make_router(args: argparse.Namespace):
    """A :class:`~pagedkv.router.app.RouterServer` from parsed options (ValueError / FileNotFoundError on bad
    ones)."""
    from ..cluster.redis_index import RedisIndex, open_index
    from ..server.http_options import check_http_args, http_options
    from .app import RouterServer
    from .prompt import PromptBuilder, load_tokenizer
    from .proxy import UpstreamOptions
    from .state import RouterState, parse_backend

    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.balance_slack < 0 or args.balance_abs < 0:
        raise ValueError("--balance-slack and --balance-abs must be >= 0")
    if not 0 <= args.min_match <= 1:
        raise ValueError(f"--min-match must lie in [0, 1], got {args.min_match}")
    for name in ("cpu_weight", "disk_weight", "shared_weight"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(args, name)}")
    if args.shared_index_blocks is not None and args.shared_index_blocks < 0:
        raise ValueError(f"--shared-index-blocks must be >= 0, got {args.shared_index_blocks}")
    if args.health_interval <= 0 or args.health_timeout <= 0 or args.health_fails < 1:
        raise ValueError("--health-interval and --health-timeout must be > 0, --health-fails >= 1")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    check_http_args(args)
    upstream = UpstreamOptions(connect_timeout=args.upstream_connect_timeout,
                               read_timeout=args.upstream_read_timeout,
                               max_connections=args.upstream_max_connections, api_key=args.replica_api_key)
    if not (args.backend or args.prefill or args.decode):
        raise ValueError("give at least one --backend (or --prefill and --decode)")
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("a prefill/decode split needs both --prefill and --decode replicas")
    replicas = [parse_backend(b) for b in args.backend] + [parse_backend(b, "prefill") for b in args.prefill] + \
        [parse_backend(b, "decode") for b in args.decode]
    if args.index.startswith(("redis://", "rediss://", "unix://")):
        try:
            index = RedisIndex(args.index, prefix=args.index_prefix, shared_capacity_blocks=args.shared_index_blocks)
        except ImportError:
            raise ValueError("--index redis:// needs the redis package (pip install 'pagedkv[router]')") from None
        except Exception as e:  # redis.ConnectionError and friends
            raise ValueError(f"cannot reach the Redis index at {args.index}: {e}") from None
    else:
        index = open_index(args.index, shared_capacity_blocks=args.shared_index_blocks)
    state = RouterState(replicas, index, route=args.route, balance_slack=args.balance_slack,
                        balance_abs=args.balance_abs, block_size=args.block_size,
                        approx_capacity_blocks=args.approx_capacity_blocks, min_match=args.min_match,
                        weights={"CPU": args.cpu_weight, "DISK": args.disk_weight, "SHARED": args.shared_weight})
    hasher = None
    if args.hash_scheme == "vllm":
        from ..cluster.vllm_hash import VLLMHasher

        hasher = VLLMHasher(args.vllm_hash_algo, args.vllm_hash_seed, args.block_size)
    elif args.vllm_hash_seed is not None or args.vllm_hash_algo != "sha256":
        raise ValueError("--vllm-hash-algo and --vllm-hash-seed need --hash-scheme vllm")
    builder = PromptBuilder(load_tokenizer(args.model), args.block_size, hasher)
    from ..server.launch import served_model_names

    name, aliases = served_model_names(args.model)
    return RouterServer(state, builder, host=args.host, port=args.port, topic=args.kv_events_topic,
                        health_interval=args.health_interval, health_timeout=args.health_timeout,
                        health_fails=args.health_fails, api_key=args.api_key, upstream=upstream,
                        max_body_bytes=args.max_body_bytes, model_names=(name, *aliases), http=http_options(args))


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
