"""The engine's configuration, declared once: four frozen dataclasses, each field with its default, its check
(in ``__post_init__``: a bad value raises :class:`~pagedkv.errors.InvalidArgumentError` when the config is made)
and its help (``metadata["help"]``): the command-line options of every command that builds an engine are derived
from these fields (:func:`pagedkv.engine.options.add_engine_args`; ``metadata["cli"]`` False: no option,
``"negated"`` / ``"policy"``: spelled by hand there).

* :class:`CacheConfig`: the KV cache and the block manager (block size and counts, prefix caching, CPU blocks,
  eviction, pins, KV events, sliding window, KV cache groups).
* :class:`SchedulerConfig`: the scheduler (batch size, token budget, chunked prefill, preemption, policy).
* :class:`ModelRunConfig`: how the model is loaded and run (device, dtype, fast LM head, quantized kernels,
  context, threads).
* :class:`TierConfig`: the disk and shared KV tiers under the prefix cache.

``LLM(model, cache_config=..., scheduler_config=..., run_config=..., tier_config=...)`` takes them; the common
keywords (``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching``, ``max_num_seqs``, ``device``) override
their field. Field names are unique across the four, so :func:`engine_configs` builds them from flat option
names (``pagedkv generate``'s options, tests' keyword sets). Checks that need the model or two configs together
(``max_model_len`` against the model's context, swap preemption without CPU blocks, tiers without prefix caching)
are made when the engine is built. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from ..retention.eviction import EVICTION_POLICIES
from ..tiers.connector import DEFAULT_MAX_LOAD_MS_PER_BLOCK

__all__ = ["CacheConfig", "SchedulerConfig", "ModelRunConfig", "TierConfig", "CONFIG_CLASSES", "engine_configs",
           "DEFAULT_CHUNKED_BUDGET", "DEFAULT_BUDGET", "parse_store_policy"]

DEFAULT_CHUNKED_BUDGET = 512  # max_num_batched_tokens with chunked prefill (prompt chunks plus decodes a step)
DEFAULT_BUDGET = 2048  # without it (whole prompts a step)


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A field with its default and its help (and any command-line metadata: ``metavar``, ``choices``)."""
    return field(default=default, metadata={"help": help, **meta})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, low: int, none: bool = False) -> None:
    if (none and v is None) or (_is_int(v) and v >= low):
        return
    raise InvalidArgumentError(f"{name} must be an int >= {low}{' or None' if none else ''}, got {v!r}")


def _num(name: str, v: Any, low: float, none: bool = False, strict: bool = False) -> None:
    if none and v is None:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > low if strict
                                                                                          else v >= low)
    if not ok:
        raise InvalidArgumentError(f"{name} must be a finite number {'>' if strict else '>='} {low}"
                                   f"{' or None' if none else ''}, got {v!r}")


def _bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {v!r}")


def _choice(name: str, v: Any, choices: tuple) -> None:
    if v not in choices:
        raise InvalidArgumentError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {v!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache and its block manager (:class:`pagedkv.BlockManager`, or a
    :class:`pagedkv.HybridBlockManager` for a model with KV cache groups)."""

    block_size: int = _opt(16, "tokens per KV-cache block")
    num_gpu_blocks: int | None = _opt(None, "KV-cache blocks (default: 1 GiB worth, capped at what max_num_seqs "
                                            "full-context sequences can use)")
    kv_cache_gib: float = _opt(1.0, "the KV cache's size in GiB when num_gpu_blocks is not given", metavar="GIB",
                               cli=False)
    num_cpu_blocks: int = _opt(0, "CPU blocks for swap preemption and the CPU tier of the prefix cache")
    swap_space: float | None = _opt(None, "the CPU blocks given in GiB, as vLLM's --swap-space: as many blocks as "
                                          "fit (instead of --num-cpu-blocks, which must then be 0; "
                                          "llm.block_manager.config.num_cpu_blocks says how many)", metavar="GIB")
    enable_prefix_caching: bool = _opt(True, "the prefix cache (on by default; vLLM's name)", cli="negated")
    cpu_prefix_cache: bool = _opt(False, "demote evicted prefix-cache blocks to the CPU blocks and promote them "
                                         "back on a hit")
    sliding_window: int | None = _opt(None, "attend to the last TOKENS tokens only, releasing older blocks "
                                            "(default: full attention)", metavar="TOKENS")
    kv_cache_groups: bool = _opt(True, "a model with KV cache groups (Gemma 3) gets a block table per group, so "
                                       "a sliding layer keeps only its window's blocks (a HybridBlockManager); "
                                       "False: one BlockManager table for all layers; models without groups "
                                       "(SmolLM2) always use one table", cli=False)
    eviction_policy: str = _opt("lru", "the prefix cache's eviction order: lru, slru, session, density or arc "
                                       "(pagedkv.retention.eviction), with one block table or KV cache groups",
                                choices=EVICTION_POLICIES)
    pin_budget_blocks: int = _opt(0, "most KV blocks (every group's, with KV cache groups) pinned prefixes may "
                                     "hold: LLM.pin_prefix, a request's kv_retention (0: no pins)", metavar="BLOCKS")
    enable_kv_events: bool = _opt(False, "record the block manager's KV events (take_events)", cli=False)

    def __post_init__(self) -> None:
        _int("block_size", self.block_size, 1)
        _int("num_gpu_blocks", self.num_gpu_blocks, 1, none=True)
        _num("kv_cache_gib", self.kv_cache_gib, 0, strict=True)
        _int("num_cpu_blocks", self.num_cpu_blocks, 0)
        if self.swap_space is not None:
            ok = isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool) \
                and 0 <= self.swap_space < float("inf")
            if self.num_cpu_blocks or not ok:
                raise InvalidArgumentError(f"swap_space must be a finite number of GiB >= 0 and num_cpu_blocks 0 "
                                           f"(give one of them), got swap_space={self.swap_space!r}, "
                                           f"num_cpu_blocks={self.num_cpu_blocks!r}")
        for name in ("enable_prefix_caching", "cpu_prefix_cache", "kv_cache_groups", "enable_kv_events"):
            _bool(name, getattr(self, name))
        _int("sliding_window", self.sliding_window, 1, none=True)
        _choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _int("pin_budget_blocks", self.pin_budget_blocks, 0)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler (:class:`pagedkv.scheduler.Scheduler`)."""

    max_num_seqs: int = _opt(32, "most sequences in one batch")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget of one step: with chunked prefill, decodes plus prompt chunks; without, whole prompts "
              "(a longer prompt runs alone in its step) (default: 512 with chunked prefill, 2048 without)")
    enable_chunked_prefill: bool = _opt(True, "prefill long prompts in chunks within the step's token budget, "
                                              "decodes first, so that a long prompt does not stop the streams "
                                              "that are decoding")
    long_prefill_token_threshold: int = _opt(0, "with chunked prefill, the most prompt tokens one request gets in "
                                                "one step (0: no cap besides the budget)", metavar="TOKENS")
    preemption_mode: str = _opt("recompute", "what a preempted request gives up: its KV (recompute) or its GPU "
                                             "blocks (swap to the CPU blocks)", choices=("recompute", "swap"))
    num_lookahead_slots: int = _opt(0, "slots reserved past each decode's token (speculative decoding)",
                                    cli=False)
    scheduling_policy: str = _opt("fcfs", "priority: admit by each request's priority (LLM.generate's priority=, "
                                          "the server's priority field) then arrival, preempt the largest first "
                                          "(vLLM's; a lower value is more urgent)",
                                  choices=("fcfs", "priority"))

    def __post_init__(self) -> None:
        _int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None and not (_is_int(self.max_num_batched_tokens)
                                                            and self.max_num_batched_tokens >= 1):
            raise InvalidArgumentError(
                f"max_num_batched_tokens must be an int >= 1, got {self.max_num_batched_tokens!r}")
        _bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        _int("num_lookahead_slots", self.num_lookahead_slots, 0)
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens``, or its default (512 with chunked prefill, 2048 without)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_CHUNKED_BUDGET if self.enable_chunked_prefill else DEFAULT_BUDGET


@dataclass(frozen=True)
class ModelRunConfig:
    """How the model is loaded and run. ``dtype``: a ``torch.dtype`` (None: float32)."""

    device: str = _opt("cpu", "cpu (default) or cuda")
    dtype: Any = _opt(None, "weights and KV dtype (a torch.dtype; default float32)", cli=False)
    fast_lm_head: bool = _opt(True, "the exact fast LM head: bf16 logits with a rigorous error bound, the entries "
                                    "the bound cannot decide rescored in float32 (same tokens as float32 logits; "
                                    "docs/engine-speed.md; float32 weights on the CPU only; costs the bf16 "
                                    "copy's memory: Gemma 3 270M +335 MB, SmolLM2-135M +57 MB); --no-fast-lm-head "
                                    "computes every row's logits in float32")
    quant_kernels: bool = _opt(True, "decode steps of up to 32 sequences read the GGUF file's quantized weights "
                                     "with float32 activations, each weight rebuilt exactly (the float32 model's "
                                     "products up to summation order; docs/engine-speed.md); --no-quant-kernels "
                                     "uses the dense float32 weights only (with an already loaded model: must "
                                     "match how it was loaded)")
    max_model_len: int | None = _opt(None, "the longest sequence (prompt + output) a request may have (default: "
                                           "the model's context)", metavar="TOKENS")
    threads: int | None = _opt(None, "CPU threads of the model's products (default: OMP_NUM_THREADS when set, "
                                     "else the cores other processes leave free, re-checked every half second of "
                                     "steps; process-wide: torch.set_num_threads; docs/engine-speed.md)",
                               metavar="N")

    def __post_init__(self) -> None:
        if not isinstance(self.device, str):
            raise InvalidArgumentError(f"device must be a string ('cpu' or 'cuda'), got {self.device!r}")
        _bool("fast_lm_head", self.fast_lm_head)
        _bool("quant_kernels", self.quant_kernels)
        if self.max_model_len is not None and not (_is_int(self.max_model_len) and self.max_model_len >= 1):
            raise InvalidArgumentError(f"max_model_len must be an int >= 1 (at most the model's context), got "
                                       f"{self.max_model_len!r}")
        from .cpu import validate_threads

        validate_threads(self.threads)


@dataclass(frozen=True)
class TierConfig:
    """The disk and shared KV tiers under the prefix cache (docs/tiers.md); none by default."""

    kv_disk_dir: str | os.PathLike | None = _opt(
        None, "a disk tier under the prefix cache in DIR (one process at a time; survives restarts: a restarted "
              "engine loads the KV stored there; a directory that cannot be written is served read-only by "
              "pagedkv serve) (LMCache's local_disk)", metavar="DIR")
    kv_disk_gib: float | None = _opt(None, "the disk tier's bound in GiB; past it a chain's tail is evicted before "
                                           "its head, least recently used first (default with pagedkv serve: 10, "
                                           "or half the free space when less; LMCache's max_local_disk_size)",
                                     metavar="GIB")
    kv_shared: str | None = _opt(None, "a KV tier every replica shares: redis://HOST:PORT (Redis or Valkey; "
                                       "LMCache's remote_url) or file:///DIR (a shared directory)", metavar="URL")
    kv_load_max_ms_per_block: float | None = _opt(
        DEFAULT_MAX_LOAD_MS_PER_BLOCK, "the crossover: a tier whose measured load time per block is above MS is not "
                                       "read and the prompt is computed (default 683: this machine's SmolLM2 "
                                       "prefill time per 16-token block; 0 on the command line, None here: always "
                                       "load)", metavar="MS")
    kv_store: bool | str = _opt(True, "what the engine writes to the tiers, off the step loop (SGLang's "
                                      "--hicache-write-policy): through (True, the default: every full block once "
                                      "computed or loaded), selective:N (a block once prefix hits took it N "
                                      "times), back (a cached block about to be evicted), off (False: load only)",
                                cli="policy", metavar="POLICY")

    def __post_init__(self) -> None:
        if self.kv_disk_gib is not None and self.kv_disk_dir is None:
            raise InvalidArgumentError("kv_disk_gib needs kv_disk_dir")
        _num("kv_disk_gib", self.kv_disk_gib, 0, none=True, strict=True)
        _num("kv_load_max_ms_per_block", self.kv_load_max_ms_per_block, 0, none=True)
        if self.kv_shared is not None and not isinstance(self.kv_shared, str):
            raise InvalidArgumentError(f"kv_shared must be a redis:// or file:// URL, got {self.kv_shared!r}")
        parse_store_policy(self.kv_store)

    @property
    def enabled(self) -> bool:
        """Whether any tier is configured."""
        return self.kv_disk_dir is not None or self.kv_shared is not None


def parse_store_policy(policy: Any) -> tuple[str, int]:
    """``TierConfig(kv_store=)`` / ``pagedkv serve --kv-store-policy`` to the block manager's ``(store_policy,
    store_min_hits)``: ``"through"`` (or True, or SGLang's ``"write_through"``): every full block once computed
    or loaded; ``"selective:N"`` (or ``"selective"``, N = 1; SGLang's ``"write_through_selective"``): a block
    once prefix hits have taken it N times; ``"back"`` (SGLang's ``"write_back"``): a cached block when it is
    about to be evicted; ``"off"`` (or False): loads only. Anything else: InvalidArgumentError."""
    if policy is True:
        return "write_through", 1
    if policy is False or policy is None:
        return "none", 1
    if not isinstance(policy, str):
        raise InvalidArgumentError(f"kv_store must be through, selective[:N], back or off, got {policy!r}")
    p = policy.strip().lower()
    if p in ("through", "write_through", "on"):
        return "write_through", 1
    if p in ("off", "none"):
        return "none", 1
    if p in ("back", "write_back"):
        return "write_back", 1
    head, _, n = p.partition(":")
    if head in ("selective", "write_through_selective"):
        if not n:
            return "selective", 1
        if n.isdigit() and int(n) >= 1:
            return "selective", int(n)
    raise InvalidArgumentError(f"kv_store must be through, selective[:N] (N >= 1 hits), back or off, got {policy!r}")


CONFIG_CLASSES = {"cache_config": CacheConfig, "scheduler_config": SchedulerConfig, "run_config": ModelRunConfig,
                  "tier_config": TierConfig}
_FIELD_OWNER = {f.name: key for key, cls in CONFIG_CLASSES.items() for f in dataclasses.fields(cls)}


def engine_configs(**options: Any) -> dict[str, Any]:
    """The config objects from flat option names (each the field of exactly one config): ``{"cache_config":
    CacheConfig(...), ...}``, a config only where one of its fields was given, for ``LLM(model, **...)``. A name
    no config has: ``TypeError``; a bad value: ``InvalidArgumentError``. O(options)."""
    per: dict[str, dict] = {}
    for name, value in options.items():
        key = _FIELD_OWNER.get(name)
        if key is None:
            raise TypeError(f"no engine option named {name!r}")
        per.setdefault(key, {})[name] = value
    return {key: CONFIG_CLASSES[key](**kw) for key, kw in per.items()}
