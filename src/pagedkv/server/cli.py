"""``pagedkv serve``: run the OpenAI-compatible server over pagedkv's engine (see :mod:`pagedkv.server.app`)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..engine.options import add_engine_args, make_llm

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .._help import HelpFormatter, plain

    p = argparse.ArgumentParser(prog="pagedkv serve", description=plain(__doc__), formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the GGUF file stem)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for admission; beyond, new requests get 503 (default 256)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV-cache events on this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (default: none)")
    p.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZMQ ROUTER address for replays (default: the events port + 1)")
    p.add_argument("--kv-events-topic", default="kv-events", help="ZMQ topic of the KV-event messages")
    return p


def _replay_default(endpoint: str) -> str:
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot derive a replay endpoint from {endpoint!r}; give --kv-events-replay-endpoint")
    return f"{head}:{int(port) + 1}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..errors import PagedKVError
    from .launch import default_model_name, make_server

    try:
        over = {"enable_kv_events": True} if args.kv_events_endpoint else {}
        llm = make_llm(args, **over)
        replay = args.kv_events_replay_endpoint
        if args.kv_events_endpoint and replay is None:
            replay = _replay_default(args.kv_events_endpoint)
        server = make_server(
            llm, model_name=args.served_model_name or default_model_name(llm, args.model), host=args.host,
            port=args.port, api_key=args.api_key, max_waiting=args.max_waiting,
            kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=replay,
            kv_events_topic=args.kv_events_topic,
        )
    except (PagedKVError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        return 2
    print(f"pagedkv serve: model {server.model_name!r} on http://{args.host}:{args.port}", file=sys.stderr)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
