"""``pagedkv router``'s settings, declared once: :class:`RouterConfig`, one frozen dataclass whose fields are the
command's options (``pagedkv.router.cli`` derives its parser from them with
:func:`pagedkv._cli_config.add_config_args`; the HTTP deadlines come from :mod:`pagedkv.server.http_options`).

The options the router shares with ``pagedkv serve`` are not declared here: ``--host``, ``--port``, ``--api-key``,
``--max-body-bytes`` and ``--kv-events-topic`` point to :class:`pagedkv._cli_config.ServiceConfig`, ``--block-size``
to the engine's :class:`~pagedkv.engine.config.CacheConfig` and ``--model`` to the engine's own option
(:func:`pagedkv.engine.options.add_engine_args`); the router only adds a note to their help (and its port
default). ``tests/test_router_options.py`` fails if an option is declared twice. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .._cli_config import ServiceConfig, option, same_as
from ..cluster.policy import ROUTES, TIER_WEIGHTS
from ..engine.config import CacheConfig
from ..errors import InvalidArgumentError

__all__ = ["RouterConfig", "engine_option", "VLLM_HASH_ALGOS"]

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_REPLICA = "URL[,EVENTS[,REPLAY]]"


def engine_option(name: str) -> dict:
    """The argparse keywords of the engine's own ``--NAME`` (declared in
    :func:`pagedkv.engine.options.add_engine_args`), read from a scratch parser that function fills."""
    from ..engine.options import add_engine_args

    scratch = argparse.ArgumentParser(add_help=False)
    add_engine_args(scratch)
    for action in scratch._actions:
        if "--" + name.replace("_", "-") in action.option_strings:
            return {"help": action.help, "type": action.type, "metavar": action.metavar, "choices": action.choices,
                    "default": action.default}
    raise KeyError(f"the engine has no option --{name}")


@dataclass(frozen=True)
class RouterConfig:
    """Every setting of ``pagedkv router`` but the HTTP deadlines; a bad value raises
    :class:`~pagedkv.errors.InvalidArgumentError` (a ValueError) naming the option. Which replicas are given, and
    how they combine, is checked when the router is made (:func:`pagedkv.router.cli.make_router`)."""

    backend: tuple[str, ...] = option(
        (), "a replica: its base URL, and its KV-events ZMQ endpoint (replay endpoint: the events port + 1 unless "
            "given); repeat for each replica", many=True, metavar=_REPLICA)
    prefill: tuple[str, ...] = option(
        (), "a prefill replica of a prefill/decode split (pagedkv serve --kv-role prefill), as --backend; with "
            "--decode, prompts go here (by prefix) and the decode to a decode replica (docs/pd-split.md)",
        many=True, metavar=_REPLICA)
    decode: tuple[str, ...] = option(
        (), "a decode replica of a prefill/decode split (pagedkv serve --kv-role decode)", many=True, metavar=_REPLICA)
    host: str = same_as(ServiceConfig, "host")
    port: int = same_as(ServiceConfig, "port", default=8080)
    route: str = option("prefix", "routing policy (default: prefix)", choices=ROUTES)
    index: str = option("memory", "where the prefix index lives (default: this process's memory)",
                        metavar="memory|redis://HOST:PORT")
    index_prefix: str = option("pagedkv", "key prefix in Redis (default: pagedkv)")
    model: str | None = same_as(engine_option, "model", default=None,
                                note="the router reads its tokenizer (metadata only), which must be the replicas': "
                                     "a replica whose /v1/models lists another model gets a warning at start-up")
    block_size: int = same_as(CacheConfig, "block_size",
                              note="the replicas' block size, by which the router hashes prompts")
    hash_scheme: str = option(
        "pagedkv", "the block hashes the replicas' KV events name blocks by: pagedkv (pagedkv serve) or vllm (vLLM "
                   "replicas: the router computes vLLM's hashes, docs/compat.md; default pagedkv)",
        choices=("pagedkv", "vllm"))
    vllm_hash_algo: str = option("sha256", "with --hash-scheme vllm: the replicas' --prefix-caching-hash-algo "
                                           "(default sha256)", choices=VLLM_HASH_ALGOS)
    vllm_hash_seed: str | None = option(
        None, "with --hash-scheme vllm: the replicas' PYTHONHASHSEED (default: unset, vLLM's fixed seed for sha256 / "
              "sha256_cbor; the xxhash algorithms need it)", metavar="SEED")
    balance_slack: float = option(
        0.2, "prefix routes skip a replica whose load (prompt tokens still to compute for its requests in flight) "
             "would exceed (1 + slack) x the mean + --balance-abs (default 0.2)")
    balance_abs: float = option(1024.0, "absolute allowance in tokens (default 1024)")
    min_match: float = option(0.3, "a cached prefix shorter than this fraction of the prompt counts as none "
                                   "(default 0.3)")
    cpu_weight: float = option(TIER_WEIGHTS["CPU"], "prefix route: weight of a cached block the replica reads from "
                                                    f"its CPU tier (a GPU block weighs 1; default "
                                                    f"{TIER_WEIGHTS['CPU']:g})")
    disk_weight: float = option(TIER_WEIGHTS["DISK"], "prefix route: weight of a block in the replica's disk tier "
                                                      f"(default {TIER_WEIGHTS['DISK']:g})")
    shared_weight: float = option(
        TIER_WEIGHTS["SHARED"], "prefix route: weight of a block in the store every replica shares (KV events with "
                                f"medium SHARED), counted for every replica (default {TIER_WEIGHTS['SHARED']:g})")
    shared_index_blocks: int | None = option(
        None, "keep at most N blocks of the shared store in the index, least recently reported first out (the store "
              "evicts without telling; default: unbounded)", metavar="N")
    approx_capacity_blocks: int = option(65536, "prefix-approx: blocks each replica is assumed to cache "
                                                "(default 65536)")
    health_interval: float = option(1.0, "seconds between health checks")
    health_timeout: float = option(3.0, "seconds a health check may take")
    health_fails: int = option(3, "failed checks in a row before a replica leaves routing (3)")
    kv_events_topic: str = same_as(ServiceConfig, "kv_events_topic", note="the replicas' --kv-events-topic")
    api_key: str | None = same_as(ServiceConfig, "api_key")
    replica_api_key: str | None = option(None, "API key sent to the replicas (default: the client's Authorization "
                                               "header is forwarded)")
    upstream_read_timeout: float = option(
        300.0, "seconds a replica may stay silent (before answering, or between two stream chunks) before the "
               "request fails with 504 or an error event (default 300)")
    upstream_connect_timeout: float = option(2.0, "seconds to connect to a replica before trying another (default 2)")
    upstream_max_connections: int = option(
        256, "connections to each replica at once; requests beyond wait up to 5 s, then go to another replica or "
             "get 503 (default 256)")
    max_body_bytes: int = same_as(ServiceConfig, "max_body_bytes", note="at least 1024 for the router")

    def __post_init__(self) -> None:
        ServiceConfig(host=self.host, port=self.port, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                      kv_events_topic=self.kv_events_topic)  # (the shared options' checks)
        CacheConfig(block_size=self.block_size)
        if self.max_body_bytes < 1024:
            raise InvalidArgumentError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not (self.balance_slack >= 0 and self.balance_abs >= 0):
            raise InvalidArgumentError("--balance-slack and --balance-abs must be >= 0")
        if not 0 <= self.min_match <= 1:
            raise InvalidArgumentError(f"--min-match must lie in [0, 1], got {self.min_match}")
        for name in ("cpu_weight", "disk_weight", "shared_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(self, name)}")
        if self.shared_index_blocks is not None and self.shared_index_blocks < 0:
            raise InvalidArgumentError(f"--shared-index-blocks must be >= 0, got {self.shared_index_blocks}")
        if not (self.health_interval > 0 and self.health_timeout > 0 and self.health_fails >= 1):
            raise InvalidArgumentError("--health-interval and --health-timeout must be > 0, --health-fails >= 1")
        if self.hash_scheme != "vllm" and (self.vllm_hash_seed is not None or self.vllm_hash_algo != "sha256"):
            raise InvalidArgumentError("--vllm-hash-algo and --vllm-hash-seed need --hash-scheme vllm")
        for name, values in (("route", ROUTES), ("hash_scheme", ("pagedkv", "vllm")),
                             ("vllm_hash_algo", VLLM_HASH_ALGOS)):
            if getattr(self, name) not in values:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be one of {', '.join(values)}, got "
                                           f"{getattr(self, name)!r}")

    @property
    def weights(self) -> dict:
        """The prefix route's tier weights by medium (:data:`pagedkv.cluster.policy.TIER_WEIGHTS`' keys)."""
        return {"CPU": self.cpu_weight, "DISK": self.disk_weight, "SHARED": self.shared_weight}
