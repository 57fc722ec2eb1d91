"""``LLM``: generate with a real model through the paged KV cache (in the style of vLLM's ``LLM``).

One engine step::

    plan = scheduler.schedule()          # block-manager calls: allocate / decode_step / swap / fork
    plan.copies                          # every KV block copy of the step, executed in order
    logits = model(metadata(plan), kv)   # prefills and decodes in one forward
    scheduler.update(plan, sampled)      # append, stop, free

The model only ever sees slots and block tables from the :class:`~pagedkv.BlockManager`; the tests check that
its greedy output equals a contiguous-cache reference token for token.

The engine keeps the block tables itself, one row per sequence (``LLM._tables``, indexed by the manager's table
rows): a prefill, a forked sample's first decode and a swap-in load a whole row, every decode step applies only
the entries it changed (``decode_step(..., block_tables=False)``, through the scheduler's ``incremental_tables``),
so the block manager's step costs the same at any context length (docs/engine-contract.md).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError, PromptTooLongError
from ..hybrid import HybridBlockManager
from ..manager import NULL_BLOCK, AllocStatus, BlockManager
from ..retention.steering import Pin
from ..scheduler import FINISH_STOP, Scheduler
from .model import build_attention_metadata, build_group_attention_metadata, execute_copy_plan
from .registry import load_model, make_tokenizer
from ..tiers.connector import DEFAULT_MAX_LOAD_MS_PER_BLOCK
from .kv_tiers import EngineTiers, parse_store_policy
from .request_pins import KVRetention, RequestPins, parse_kv_retention
from .sampling import SamplingParams, sample, sample_batch, sample_bounded
from .threads import ThreadPolicy

__all__ = ["LLM", "CompletionOutput", "KVRetention", "RequestOutput", "SamplingParams"]

DEFAULT_CHUNKED_BUDGET = 512  # max_num_batched_tokens with chunked prefill (prompt chunks plus decodes a step)
DEFAULT_BUDGET = 2048  # without it (whole prompts a step)


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sample."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length" (max_tokens) or "abort"


@dataclass(frozen=True)
class RequestOutput:
    """Result of one prompt: its samples, and how many prompt tokens came from the prefix cache. With
    ``kv_retention``: ``pin``, the request's pin (``pin_id`` 0 when nothing was pinned), and ``pin_error``, why
    not when the pin budget was taken between admission and the pin (see :mod:`pagedkv.engine.request_pins`)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    pin: Pin | None = None
    pin_error: str | None = None


@dataclass
class EngineTimes:
    """Wall time of the last ``generate`` call, split by component (seconds)."""

    total: float = 0.0
    scheduler: float = 0.0  # schedule() + update(), block-manager calls included
    block_manager: float = 0.0  # inside BlockManager methods only
    model: float = 0.0  # KV copies + metadata + forward (sampling excluded)
    sampling: float = 0.0  # drawing the next tokens from the logits


class _TimedCalls:
    """Forwards every method call to ``target`` and adds its wall time to ``self.seconds``."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


class LLM:
    """A GGUF model (Llama architecture, or Gemma 3) served through pagedkv's block manager.

    The block manager's options (``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``,
    ``enable_prefix_caching``, ``sliding_window``, ``enable_kv_events``, ``cpu_prefix_cache``) and the
    scheduler's (``max_num_seqs``, ``max_num_batched_tokens``, ``preemption_mode``, ``num_lookahead_slots``,
    ``enable_chunked_prefill``, ``long_prefill_token_threshold``) are passed on as they are; KV events come out of ``llm.block_manager.take_events()``, and the CPU tier of
    the prefix cache lives in the ``num_cpu_blocks`` CPU blocks, shared with swap preemption.

    Args:
        model: a model name (``"smollm2-135m"``, the default, or ``"gemma-3-270m"``; see
            :mod:`pagedkv.engine.registry`), the path of a GGUF file (its ``general.architecture`` picks the model
            class), or an already loaded model (``PagedLlama``, ``PagedGemma3``) to share its weights.
        num_gpu_blocks: KV-cache blocks; None sizes the KV cache to ``kv_cache_gib`` GiB (capped at what
            ``max_num_seqs`` full-context sequences can use).
        kv_cache_gib: the KV cache's size when ``num_gpu_blocks`` is None.
        device: "cpu" (default) or "cuda".
        dtype: weights and KV dtype (float32 default).
        seed: seed of the generator used by requests without their own seed.
        max_num_batched_tokens: the token budget of one step; None: 512 with chunked prefill (a step then costs
            about as much as a 512-token prefill, which bounds what the decoding sequences wait), 2048 without.
        enable_chunked_prefill: schedule each step by a budget of ``max_num_batched_tokens`` tokens, decodes
            first, then the next chunk of partly prefilled prompts, then new prompts (docs/chunked-prefill.md):
            a long prompt no longer stops the sequences that are decoding. False: a prompt is prefilled in one
            step (a prompt longer than the budget alone in its step).
        long_prefill_token_threshold: with chunked prefill, the most prompt tokens one request gets in one
            step (0: no cap besides the budget), so that several long prompts progress together.
        kv_cache_groups: for a model with KV cache groups (Gemma 3: its full-attention layers in one group, its
            sliding-window layers in groups of the same size), a :class:`pagedkv.HybridBlockManager` with a block
            table per group, so a sliding layer keeps only the blocks of its window (True, the default); False:
            one :class:`pagedkv.BlockManager` table for all layers. Models without groups (SmolLM2) always use
            one table. ``llm.kv_cache_groups`` says which is in use.
        fast_lm_head: the exact fast LM head (docs/engine-speed.md, :mod:`pagedkv.engine.lm_head`): logits from a
            bf16 copy of the output table with a rigorous per-row error bound; greedy and top-k
            rescore in float32 only the entries the bound cannot rule out, plain sampling draws by rejection against
            the bound, top-p computes its row in float32. The tokens are those of the float32 logits (True, the
            default; float32 weights on the CPU only, else off). Costs the low-precision copies' memory (Gemma 3
            270M: +335 MB, SmolLM2-135M: +57 MB). False: the float32 logits of every row, as before.
        quant_kernels: decode steps of up to 32 sequences read the GGUF file's quantized weights with float32
            activations, each weight rebuilt exactly as the float32 one (:mod:`pagedkv.engine.qmatmul`; the same
            float32 products up to summation order; True, the default, where the kernels build: CPU, float32).
            A loading option: with an already loaded model it must match how that model was loaded
            (``InvalidArgumentError`` otherwise). ``llm.quant_kernels`` says whether they are in use.
        max_model_len: the longest sequence (prompt + output) a request may have, at most the model's context
            (vLLM's ``max_model_len``); None: the model's context.
        swap_space: the CPU blocks for swap and the CPU tier given in GiB, as vLLM's ``swap_space``: sets
            ``num_cpu_blocks`` to as many blocks as fit (``num_cpu_blocks`` must then be 0); None: use
            ``num_cpu_blocks``. ``llm.block_manager.num_cpu_blocks`` says how many that is.
        threads: CPU threads of torch and the quantized kernels (process-wide: ``torch.set_num_threads``). None
            (the default): ``OMP_NUM_THREADS`` when set, else automatic: the cores other processes leave free,
            re-checked every half second of steps (:mod:`pagedkv.engine.threads`), so that engines side by side
            share the machine. An int >= 1: that many, fixed (``InvalidArgumentError`` otherwise).
            ``llm.threads`` is the current count. A ``torch.set_num_threads`` of the caller's before ``LLM()`` is
            overridden by the automatic count: pass ``threads=`` instead.
        kv_disk_dir: a directory for the **disk tier** of the prefix cache (one process at a time: a second
            opener gets :class:`~pagedkv.tiers.TierInUseError`), bounded to ``kv_disk_gib`` GiB (LRU); it survives
            restarts: a new engine over the same directory loads what an earlier one stored. LMCache's
            ``local_disk`` / ``max_local_disk_size``.
        kv_disk_gib: the disk tier's bound in GiB (required with ``kv_disk_dir``).
        kv_shared: the **shared tier**, which every replica reads and writes: ``redis://host:port`` (Redis or
            Valkey; LMCache's ``remote_url``) or ``file:///dir`` (a shared directory).
        kv_load_max_ms_per_block: the crossover: a tier whose measured load time per block is above this is not
            read (the prompt is computed); the default is this machine's measured SmolLM2 prefill time per
            16-token block (683 ms, benchmarks/tier_crossover.py). None: always load.
        kv_store: the tiers' write policy (SGLang's ``--hicache-write-policy``), the block manager's store plans
            written off the step loop: ``"through"`` (True, the default: every full block once computed or
            loaded), ``"selective:N"`` (a block once prefix hits have taken it N times; ``"selective"``: N = 1),
            ``"back"`` (a cached block about to be evicted from the GPU prefix cache, pinned until stored),
            ``"off"`` (False: loads only).

    With ``enable_kv_events``, ``llm.kv_tiers.take_events()`` returns the ``BlockStored`` events of what the tiers
    stored, ``medium`` ``"DISK"`` or ``"SHARED"`` (the server publishes them with the block manager's).

    With tiers, a request whose prompt continues past the GPU/CPU hit in a tier waits while the tiers are asked
    how many blocks they hold (an I/O thread), is then admitted with GPU blocks reserved for them
    (``allocate(..., num_external_tokens=)``; out of every batch while they are read on an I/O thread and
    written in), and its prefill computes the rest (``PrefillWork.num_external_tokens``: the loaded tokens); a
    failed, corrupt or timed-out load computes what did not arrive. With KV cache groups (Gemma 3's default) each
    group's blocks are stored under its own fingerprint, and a sliding group stores and loads only the blocks
    its window still sees (docs/tiers.md#kv-cache-groups). ``sliding_window`` (one table whose window releases
    blocks) refuses tiers (``InvalidArgumentError``). Call :meth:`close` (or use ``with LLM(...) as llm``) to finish the stores.
        scheduling_policy: ``"fcfs"`` (default) or ``"priority"`` (vLLM's: admission by (priority, arrival),
            preemption of the largest first; :meth:`generate`'s ``priority``).
        eviction_policy: the prefix cache's eviction order, ``"lru"`` (default), ``"slru"``, ``"session"``,
            ``"density"`` or ``"arc"``
            (:mod:`pagedkv.retention.eviction`), with one block table or KV cache groups alike.
        pin_budget_blocks: the most KV blocks (every group's, with KV cache groups) :meth:`pin_prefix` may hold
            pinned (0, the default: no pins).
    """

    def __init__(
        self,
        model: Any = None,
        *,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = None,
        preemption_mode: str = "recompute",
        num_lookahead_slots: int = 0,
        sliding_window: int | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        enable_kv_events: bool = False,
        cpu_prefix_cache: bool = False,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        kv_cache_groups: bool = True,
        fast_lm_head: bool = True,
        quant_kernels: bool = True,
        max_model_len: int | None = None,
        swap_space: float | None = None,
        scheduling_policy: str = "fcfs",
        eviction_policy: str = "lru",
        pin_budget_blocks: int = 0,
        threads: int | None = None,
        kv_disk_dir: str | os.PathLike | None = None,
        kv_disk_gib: float | None = None,
        kv_shared: str | None = None,
        kv_load_max_ms_per_block: float | None = DEFAULT_MAX_LOAD_MS_PER_BLOCK,
        kv_store: bool | str = True,
    ) -> None:
        policy = ThreadPolicy(threads)  # first: validates, and starts the window of the free-core reading
        if scheduling_policy not in ("fcfs", "priority"):
            raise InvalidArgumentError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {device!r} was asked for but CUDA is not available; use device='cpu'")
        if preemption_mode not in ("recompute", "swap"):
            raise InvalidArgumentError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks <= 0 and not swap_space:
            raise InvalidArgumentError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_CHUNKED_BUDGET if enable_chunked_prefill else DEFAULT_BUDGET
        if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
                or max_num_batched_tokens < 1:
            raise InvalidArgumentError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
        if isinstance(long_prefill_token_threshold, bool) or not isinstance(long_prefill_token_threshold, int) \
                or long_prefill_token_threshold < 0:
            raise InvalidArgumentError(
                f"long_prefill_token_threshold must be an int >= 0, got {long_prefill_token_threshold!r}")
        self.device = torch.device(device)
        if model is not None and not isinstance(model, (str, os.PathLike)):  # share already loaded weights
            if not quant_kernels and getattr(model, "quant_kernels", False):
                raise InvalidArgumentError(
                    "quant_kernels=False, but this model was loaded with the quantized kernels: load it with "
                    "from_gguf(..., quant_kernels=False), or pass its name or path")
            self.model = model
            self.device = model.device
        else:
            self.model = load_model(model, device=self.device, dtype=dtype, quant_kernels=quant_kernels)
        self._thread_policy = policy
        torch.set_num_threads(policy.initial())  # (automatic: the cores left free while the model loaded)
        #: whether decode steps read the file's quantized weights (``quant_kernels`` and kernels that built)
        self.quant_kernels = bool(getattr(self.model, "quant_kernels", False))
        if sliding_window is not None and getattr(self.model, "layer_windows", None) is not None:
            raise InvalidArgumentError(
                "this model has per-layer sliding windows (its full-attention layers need every block): "
                "sliding_window must be None"
            )
        head = getattr(self.model, "head", None)
        #: whether the exact fast LM head is in use (``fast_lm_head`` and a model that supports it)
        self.fast_lm_head = bool(fast_lm_head and head is not None and head.supports_approx
                                 and hasattr(self.model, "hidden"))
        if self.fast_lm_head:
            head.prepare()  # the low-precision copies, once per model (shared by LLMs sharing the model)
        self.tokenizer = make_tokenizer(self.model.tokenizer_metadata)
        self.max_model_len = int(self.model.config.context_length)
        if max_model_len is not None:
            if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
                    or not 1 <= max_model_len <= self.max_model_len:
                raise InvalidArgumentError(f"max_model_len must be an int in [1, {self.max_model_len}] (the model's "
                                           f"context), got {max_model_len!r}")
            self.max_model_len = max_model_len
        groups = getattr(self.model, "kv_cache_groups", None) if kv_cache_groups else None
        #: the KV cache groups in use (a HybridBlockManager), or None (one block table for all layers)
        self.kv_cache_groups = tuple(groups) if groups else None
        grouped = self.kv_cache_groups is not None
        n_groups = len(self.kv_cache_groups) if grouped else 1
        if num_gpu_blocks is None:
            per_block = self.model.kv_cache_bytes_per_block(block_size, **({"grouped": True} if grouped else {}))
            cap = n_groups * max_num_seqs * -(-self.max_model_len // block_size)
            num_gpu_blocks = max(1, min(cap, int(kv_cache_gib * 2**30) // per_block))
        if swap_space is not None:
            if num_cpu_blocks or isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) \
                    or not 0 <= swap_space < float("inf"):
                raise InvalidArgumentError(f"swap_space must be a finite number of GiB >= 0 and num_cpu_blocks 0 "
                                           f"(give one of them), got swap_space={swap_space!r}, "
                                           f"num_cpu_blocks={num_cpu_blocks!r}")
            per_block = self.model.kv_cache_bytes_per_block(block_size, **({"grouped": True} if grouped else {}))
            num_cpu_blocks = int(swap_space * 2**30) // per_block
        common = dict(num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=enable_prefix_caching,
                      enable_kv_events=enable_kv_events, cpu_prefix_cache=cpu_prefix_cache)
        common.update(eviction_policy=eviction_policy, pin_budget_blocks=pin_budget_blocks)
        store_policy, store_min_hits = parse_store_policy(kv_store)
        tiered = kv_disk_dir is not None or kv_shared is not None
        if tiered and enable_prefix_caching and store_policy != "none" and (grouped or sliding_window is None):
            common.update(store_policy=store_policy, store_min_hits=store_min_hits)
        if grouped:
            self.block_manager = HybridBlockManager(num_gpu_blocks, block_size, kv_cache_groups=self.kv_cache_groups,
                                                    **common)
        else:
            self.block_manager = BlockManager(num_gpu_blocks, block_size, sliding_window=sliding_window, **common)
        self._timed_bm = _TimedCalls(self.block_manager)
        self._request_pins = RequestPins(self.block_manager, self.kv_cache_groups)  # generate's kv_retention
        self.scheduler = Scheduler(
            self._timed_bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode, num_lookahead_slots=num_lookahead_slots,
            enable_chunked_prefill=enable_chunked_prefill, long_prefill_token_threshold=long_prefill_token_threshold,
            incremental_tables=getattr(self.block_manager, "table_rows", None) is not None,
            scheduling_policy=scheduling_policy,
        )
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        # the engine's block tables: row table_rows(seq) holds the sequence's table (see the module docstring)
        # (with KV cache groups one such matrix per group, the same rows)
        self._tables = [np.full((max(8, max_num_seqs), 16), NULL_BLOCK, dtype=np.int32)
                        for _ in range(len(self.kv_cache_groups) if self.kv_cache_groups is not None else 1)]
        kv_kw = {"grouped": True} if grouped else {}
        self.kv_cache = self.model.allocate_kv_cache(num_gpu_blocks, block_size, **kv_kw)
        self.cpu_kv_cache = self.model.allocate_kv_cache(num_cpu_blocks, block_size, device="cpu", **kv_kw) \
            if num_cpu_blocks else None
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self.last_times = EngineTimes()
        self._sampling_s = 0.0  # sampling time of the last _execute
        # request id -> the exception its sampling raised in a step (that request got placeholder tokens and must
        # be aborted; the others of the step are unaffected). ``generate`` raises it; the server fails the request.
        self._sample_faults: dict = {}
        #: the storage tiers (kv_disk_dir, kv_shared), or None
        self.kv_tiers: EngineTiers | None = None
        if kv_disk_dir is not None or kv_shared is not None:
            if not enable_prefix_caching:
                raise InvalidArgumentError("the disk and shared KV tiers need enable_prefix_caching=True")
            if sliding_window is not None:
                raise InvalidArgumentError("the disk and shared KV tiers are not available with sliding_window")
            self.kv_tiers = EngineTiers(self.model, self.kv_cache, block_size, disk_dir=kv_disk_dir,
                                        disk_gib=kv_disk_gib, shared=kv_shared,
                                        max_load_ms_per_block=kv_load_max_ms_per_block,
                                        block_manager=self.block_manager, record_events=enable_kv_events,
                                        cpu_kv_cache=self.cpu_kv_cache,
                                        windows=None if not grouped else
                                        tuple(getattr(g, "window", None) for g in self.kv_cache_groups))
        elif kv_disk_gib is not None:
            raise InvalidArgumentError("kv_disk_gib needs kv_disk_dir")
        # the engine's own tiers (a KV port may wrap llm.kv_tiers later; the decode-filled blocks' check digests
        # go to these)
        self._own_tiers = self.kv_tiers

    def close(self) -> None:
        """Finish the storage tiers' stores in flight and close them (the disk directory may then be opened by
        another engine). The engine must not run afterwards. Nothing to do without tiers."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def threads(self) -> int:
        """CPU threads the engine computes with now (see ``threads`` in the class docstring)."""
        return self._thread_policy.threads

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
        session: Any = None,
        kv_retention: Mapping[str, Any] | KVRetention | Sequence[Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or ``{"prompt_token_ids": [...]}``); results in prompt order.
        ``priority`` (vLLM's: one int, or one per prompt; lower is more urgent): the admission order and the
        preemption victims with ``scheduling_policy="priority"``, and the eviction class of the request's cached
        blocks with any policy (:meth:`pagedkv.BlockManager.set_retention`).

        ``session``: the conversation each prompt belongs to (any hashable: a str, an int; a list or tuple gives
        one per prompt, None entries for none; anything else is every prompt's), the hint of the ``"session"`` and
        ``"density"`` eviction policies (``set_retention``'s ``session``; other policies ignore it).

        ``kv_retention`` (:mod:`pagedkv.engine.request_pins`): ``{"pin_tokens": N | "prompt", "ttl": seconds}``
        (or a :class:`KVRetention`; a list or tuple: one per prompt, None entries for none) pins the first N
        prompt tokens (whole blocks) once computed, within ``pin_budget_blocks``, TTL refreshed on every hit; the
        pin is ``RequestOutput.pin`` and is listed in :attr:`pins`. Checked before anything runs:
        InvalidArgumentError (pinning off, N longer than the prompt, a bad field), PinBudgetError (the pin does not
        fit the budget now); nothing is generated then."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        requests = self._make_requests(prompts, sampling_params)
        if priority is not None:
            prios = [priority] * len(requests) if isinstance(priority, int) else list(priority)
            if len(prios) != len(requests) or any(isinstance(p, bool) or not isinstance(p, int) for p in prios):
                raise InvalidArgumentError(f"priority must be an int or one int per prompt, got {priority!r}")
            for r, p in zip(requests, prios):
                r.priority = p
        sessions = _per_prompt(session, len(requests), "session")
        for s in sessions:
            try:
                hash(s)
            except TypeError:
                raise InvalidArgumentError(f"session must be hashable (a str, an int), got {type(s).__name__}") \
                    from None
        specs = [parse_kv_retention(k) for k in _per_prompt(kv_retention, len(requests), "kv_retention",
                                                             (Mapping, KVRetention))]
        retain = [None if k is None else self._request_pins.admit(r.prompt_token_ids, k, r.namespace)
                  for r, k in zip(requests, specs)]  # (checked for every request before any is changed)
        for r, s, k in zip(requests, sessions, retain):
            r.session, r.retain = s, k
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generate", unit="req")
        try:
            for finished in self._run(requests):
                if bar is not None:
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
        return [r.result for r in requests]

    def pin_prefix(self, prompt: str | Mapping[str, Any] | Sequence[int], *, ttl: float | None = None,
                   namespace: Any = None, compute: bool = True) -> Pin:
        """Pin a prefix (a system prompt, a tool list) in the prefix cache: its blocks are never evicted while
        pinned (:meth:`pagedkv.BlockManager.pin_prefix`; with KV cache groups, every group's blocks a hit at its
        length needs: :meth:`pagedkv.HybridBlockManager.pin_prefix`). ``prompt``: a string (encoded as
        :meth:`generate` encodes it, special tokens included), ``{"prompt_token_ids": [...]}`` or a list of token
        ids. ``compute`` (default): when the prefix's full blocks are not all cached, its KV is computed first
        (a one-token generation of the prefix; not while another thread runs this LLM); False: pin only what is
        cached. ``ttl``: seconds, refreshed on every hit (None: until :meth:`unpin`). Returns the
        :class:`~pagedkv.Pin` (``num_tokens``: the tokens pinned, a multiple of the block size; ``pin_id`` 0 when
        nothing could be pinned, e.g. a prefix shorter than a block). Needs ``pin_budget_blocks`` > 0 and prefix
        caching (InvalidArgumentError); past the budget PinBudgetError, nothing pinned. O(prefix) plus the
        prefill when it computes."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, Sequence) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                   for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise InvalidArgumentError("a prompt to pin is a string, {'prompt_token_ids': [...]} or a list of token ids")
        bm = self.block_manager
        if not bm.enable_prefix_caching or not bm.pin_budget_blocks:
            raise InvalidArgumentError("pin_prefix needs enable_prefix_caching=True and pin_budget_blocks > 0")
        if not ids:
            raise InvalidArgumentError("empty prompt")
        full = len(ids) // bm.block_size * bm.block_size
        if compute and full and bm.lookup_prefix(ids + ids[:1], namespace=namespace).num_cached_tokens < full:
            req = self._make_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0),
                                     namespace=namespace)
            for _ in self._run([req]):
                pass
        pin = bm.pin_prefix(ids, ttl=ttl, namespace=namespace)
        self._request_pins.remember(ids[: pin.num_tokens], pin, namespace)  # (requests of that prefix: no new blocks)
        return pin

    def unpin(self, pin_id: int) -> None:
        """Drop a pin made by :meth:`pin_prefix` (UnknownPinError if there is none by that id, e.g. expired)."""
        self.block_manager.unpin(pin_id)

    @property
    def pins(self) -> tuple:
        """The live pins (:class:`~pagedkv.Pin`; expired ones dropped first)."""
        return self.block_manager.pins

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        **retention: Any,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of ``{"role", "content"}`` dicts) or to each of several,
        using the model's own chat template. :class:`~pagedkv.errors.NoChatTemplateError` when the model's file
        carries none (a base model: use :meth:`generate`). ``priority``, ``session`` and ``kv_retention`` as in
        :meth:`generate`."""
        bad = set(retention) - {"priority", "session", "kv_retention"}
        if bad:
            raise TypeError(f"chat() got unexpected keyword argument(s) {', '.join(sorted(bad))}")
        self.tokenizer.require_chat_template()
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **retention)

    def stream(self, prompt: str | Mapping[str, Any], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of sample 0 piece by piece as it is generated."""
        (req,) = self._make_requests([prompt], sampling_params)
        shown = ""
        for _ in self._run([req]):
            text = req.text()
            if len(text) > len(shown) and not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
        final = req.result.outputs[0].text
        if len(final) > len(shown):
            yield final[len(shown):]

    # ------------------------------------------------------------------ the loop
    def _make_requests(self, prompts: Sequence[Any], sampling_params: Any) -> list["_Request"]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return [self._make_request(p, sp) for p, sp in zip(prompts, params)]

    def _make_request(self, prompt: Any, sp: SamplingParams, *, namespace: Any = None,
                      check_fit: bool = True) -> "_Request":
        """Validate one prompt (a string or ``{"prompt_token_ids": [...]}``) and build its request; raises a
        ``pagedkv.errors`` exception and changes nothing if it can never run. ``namespace`` isolates its
        prefix-cache blocks (None: the shared default namespace). ``check_fit=False`` skips the KV-cache fit
        check, which reads the block manager; a caller on another thread than the step loop (the server) makes
        its own check from the pool's sizes instead."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = None, [int(t) for t in prompt["prompt_token_ids"]]
        else:
            raise InvalidArgumentError("a prompt is a string or a dict with 'prompt_token_ids'")
        if not ids:
            raise InvalidArgumentError("empty prompt")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidArgumentError(f"prompt token ids must lie in [0, {vocab})")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens plus max_tokens={sp.max_tokens} exceeds the model's context of "
                f"{self.max_model_len} tokens"
            )
        if sp.n > self.max_num_seqs:
            raise InvalidArgumentError(f"n={sp.n} is larger than max_num_seqs={self.max_num_seqs}")
        sch = self.scheduler
        fit_kw = {"num_new_tokens": sch.long_prefill_token_threshold or sch.max_num_batched_tokens} \
            if sch.enable_chunked_prefill else {}  # (chunks: a sliding group holds at most its window and a chunk)
        if check_fit and self.block_manager.can_allocate(ids, namespace=namespace, **fit_kw) is AllocStatus.NEVER:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens can never fit in the KV cache of "
                f"{self.block_manager.num_gpu_blocks} blocks of {self.block_manager.block_size} tokens"
            )
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self._generator
        return _Request(next(self._ids), text, tuple(ids), sp, gen, self.tokenizer, namespace)

    def _add(self, r: "_Request") -> None:
        """Queue a request built by :meth:`_make_request` in the scheduler."""
        p = r.params
        wait = False
        if self.kv_tiers is not None:  # the disk / shared tiers may hold blocks past the GPU and CPU hit
            wait = self.kv_tiers.on_add(r.request_id, r.prompt_token_ids, r.namespace, self.block_manager)
        try:
            self.scheduler.add_request(r.request_id, r.prompt_token_ids, n=p.n, max_tokens=p.max_tokens,
                                       eos_token_id=self.tokenizer.eos_token_id, ignore_eos=p.ignore_eos,
                                       stop_token_ids=p.stop_token_ids, namespace=r.namespace, priority=r.priority,
                                       wait_for_kv=wait, session=r.session)
        except Exception:
            if wait:
                self.kv_tiers.forget(r.request_id)
            raise

    def _poll_tiers(self) -> None:
        """Before a schedule: finished tier loads let their requests join the waiting queue."""
        if self.kv_tiers is not None:
            self.kv_tiers.poll(self.scheduler)

    def _wait_for_loads(self, timeout: float) -> bool:
        """Nothing can run but requests wait for tier loads: block up to ``timeout`` s for one. True if any
        request is loading."""
        if self.kv_tiers is None or not (self.scheduler.num_loading or self.scheduler.num_parked):
            return False
        self.kv_tiers.wait(timeout)
        return True

    def _step(self, by_id: dict, times: EngineTimes | None = None) -> tuple[Any, list]:
        """Run one engine step for the requests of ``by_id`` (request id -> ``_Request``): schedule, KV copies,
        forward, sample, update, stop strings. Returns the plan and the scheduler outputs of the requests that
        finished in it (not yet applied to their ``_Request``). Not thread-safe: one caller at a time, and
        ``abort_request`` only between two calls."""
        sched = self.scheduler
        t0 = time.perf_counter()
        self._poll_tiers()
        plan = sched.schedule()
        t1 = time.perf_counter()
        self._sampling_s = 0.0
        sampled = self._execute(plan, by_id) if not plan.is_empty else []
        t_sampling = self._sampling_s
        t2 = time.perf_counter()
        done = sched.update(plan, sampled)
        done += self._after_step(plan, by_id)
        if times is not None:
            times.scheduler += (t1 - t0) + (time.perf_counter() - t2)
            times.model += t2 - t1 - t_sampling
            times.sampling += t_sampling
        return plan, done

    def _run(self, requests: list["_Request"]) -> Iterator[list["_Request"]]:
        """Run until every request finished; yields the requests finished by each step."""
        by_id = {r.request_id: r for r in requests}
        for r in requests:
            self._add(r)
        times = self.last_times = EngineTimes()
        bm0 = self._timed_bm.seconds
        t_start = time.perf_counter()
        pending = len(requests)
        while pending:
            plan, done = self._step(by_id, times)
            if self._sample_faults:
                faults, self._sample_faults = self._sample_faults, {}
                for rid in faults:
                    self.scheduler.abort_request(rid)
                for r in requests:
                    if r.result is None:
                        self.scheduler.abort_request(r.request_id)
                rid, e = next(iter(faults.items()))
                raise RuntimeError(f"sampling failed for request {rid}: {e!r}") from e
            finished = []
            for out in done:
                r = by_id.get(out.request_id)
                if r is not None and r.result is None:
                    r.finish(out)
                    finished.append(r)
            pending -= len(finished)
            if plan.is_empty and not done and pending and not self._wait_for_loads(0.05):
                raise RuntimeError("the scheduler made no progress (no request can be scheduled)")
            yield finished
        times.total = time.perf_counter() - t_start
        times.block_manager = self._timed_bm.seconds - bm0

    def _fit_tables(self, g: int, rows: int, cols: int) -> None:
        t = self._tables[g]
        if rows > t.shape[0] or cols > t.shape[1]:
            grown = np.full((max(rows, 2 * t.shape[0]), max(cols, 2 * t.shape[1])), NULL_BLOCK, dtype=np.int32)
            grown[: t.shape[0], : t.shape[1]] = t
            self._tables[g] = grown

    def _load_row(self, row: int, table: Any) -> None:
        """Load a sequence's whole table (a tuple of one per group with KV cache groups) into row ``row``."""
        for g, tab in enumerate((table,) if self.kv_cache_groups is None else table):
            self._fit_tables(g, row + 1, tab.size)
            t = self._tables[g]
            t[row] = NULL_BLOCK
            t[row, : tab.size] = tab

    def _update_tables(self, plan: Any) -> None:
        """Bring the engine's block tables up to date with a plan: whole rows for its prefills and for the decode's
        ``table_loads``, then the decode step's changed entries (every group's). O(prefill tables + loaded rows +
        changes)."""
        for pw in plan.prefills:
            self._load_row(pw.table_row, pw.block_table)
        d = plan.decode
        if d is not None:
            for _, row, table in d.table_loads:
                self._load_row(row, table)
            for g, upd in enumerate(d.result.group_table_updates):  # (one group or many: the same names)
                if upd.rows.size:
                    self._fit_tables(g, int(upd.rows.max()) + 1, int(upd.cols.max()) + 1)
                    upd.apply(self._tables[g])

    def _execute(self, plan: Any, by_id: dict) -> list:
        """KV copies, forward and sampling of one plan: the sampled tokens (per sequence of the plan); the seconds
        spent sampling are left in ``self._sampling_s``."""
        n = self._thread_policy.tick()  # (one clock read; every RECHECK_S a /proc reading)
        if n is not None:
            torch.set_num_threads(n)
        incremental = self.scheduler.incremental_tables
        if incremental:
            self._update_tables(plan)  # first: every plan's table changes reach the engine, whatever fails later
        if len(plan.copies):  # every copy of the step, in the order the block manager handed them out
            execute_copy_plan(plan.copies, self.kv_cache, self.cpu_kv_cache)
        if plan.kv_loads and self.kv_tiers is not None:  # reserved blocks: their KV is read off the step loop
            self.kv_tiers.start_loads(plan.kv_loads)  # (a KV port starts its transfers, passes the tiers' on)
        if not plan.has_forward:  # a step that only moved blocks
            return []
        tiers = self.kv_tiers
        if tiers is not None:  # KV loaded from the disk / shared tiers, into its blocks before the forward
            tiers.write_loads(plan, self.kv_cache)
        if self._own_tiers is not None:  # the check digests of the blocks decodes fill (their stores need them)
            self._own_tiers.on_blocks_filled(plan, self.scheduler, by_id)
        new_tokens, computed, slots, owners = [], [], [], []
        G = len(self.kv_cache_groups) if self.kv_cache_groups is not None else 0
        tables = [[] for _ in range(max(G, 1))]  # each group's tables (one group without KV cache groups)
        rows, skip = [], []  # the sequences that sample (chunked prefill: not a chunk that leaves prompt behind)
        ntok = 0
        for i, pw in enumerate(plan.prefills):
            new_tokens.append(pw.token_ids)
            computed.append(pw.num_cached_tokens if pw.positions.size == 0 else int(pw.positions[0]))
            slots.append(pw.slot_mapping)
            for g, table in enumerate(pw.block_table if G else (pw.block_table,)):
                tables[g].append(table)
            ntok += len(pw.token_ids)
            if pw.num_samples == 0:
                skip.append(i)
                continue
            rows.append(ntok - 1)
            owners.append((by_id[pw.request_id], pw.num_samples))
        d = plan.decode
        if d is not None:
            starts = np.concatenate(([0], np.cumsum(d.query_lens)))
            for i, sid in enumerate(d.seq_ids.tolist()):
                a, z = starts[i], starts[i + 1]
                new_tokens.append(d.input_tokens[a:z])
                computed.append(int(d.positions[a]))
                owners.append((by_id[self.scheduler.sequence(sid).request_id], 1))
                rows.append(ntok + int(z) - 1)
            slots.append(d.result.slot_mapping)
            if incremental:  # the engine's own tables: the batch's rows (the same rows in every group's matrix)
                bs = self.block_manager.block_size
                width = -(-int(d.result.seq_lens.max()) // bs)  # the blocks attention reads
                decode_tables = [t[d.result.table_rows, :width] for t in self._tables]
            else:  # (a block manager without the incremental form: the step's padded tables)
                decode_tables = d.result.group_block_tables
            for g, dt in enumerate(decode_tables):  # a (B, width) matrix per group, after the prefills' tables
                tables[g] = dt if not tables[g] else tables[g] + list(dt)
        logit_rows = "last" if not skip else np.asarray(rows, dtype=np.int64)
        if self.kv_cache_groups is None:
            meta = build_attention_metadata(new_tokens, computed, np.concatenate(slots), tables[0],
                                            block_size=self.block_manager.block_size,
                                            sliding_window=self.sliding_window, device=self.device,
                                            logits=logit_rows)
        else:  # (G, T) slots; every sequence's table per group
            meta = build_group_attention_metadata(
                new_tokens, computed, np.concatenate(slots, axis=1),
                tables,
                block_size=self.block_manager.block_size, device=self.device, logits=logit_rows)
        head = self.model.head if self.fast_lm_head else None
        if head is not None:
            hidden = self.model.hidden(meta, self.kv_cache)
            logits = None
        else:
            logits = self.model(meta, self.kv_cache).cpu()
        if not owners:  # only chunks that sample nothing
            if tiers is not None:  # the store plan's blocks: a snapshot for the tiers (written off the loop)
                tiers.store_computed(plan, self.kv_cache, by_id)
            return [None] * len(plan.prefills)
        t = time.perf_counter()
        head_s = head.seconds if head is not None else 0.0
        params, nums, gens = [r.params for r, _ in owners], [num for _, num in owners], [r.generator for r, _ in owners]
        try:
            if head is not None:
                drawn = sample_bounded(head, hidden, params, nums, gens)
            else:
                drawn = sample_batch(logits, params, nums, gens)
        except Exception:  # some row failed: draw row by row so that request alone fails (see _sample_faults)
            if logits is None:
                logits = head.logits(hidden)
            drawn = []
            for i, (r, num) in enumerate(owners):
                try:
                    drawn.append(sample(logits[i], r.params, num, r.generator))
                except Exception as e:
                    self._sample_faults.setdefault(r.request_id, e)
                    drawn.append([0] * num)  # a placeholder; the caller aborts the request after the step
        # the LM head's products count as the model's time, the rest (bounds, candidates, draws) as sampling
        self._sampling_s = time.perf_counter() - t - ((head.seconds - head_s) if head is not None else 0.0)
        out = [toks if num > 1 else toks[0] for toks, (_, num) in zip(drawn, owners)]
        for i in skip:  # (in order: each index counts the entries before it)
            out.insert(i, None)
        if tiers is not None:  # after sampling (the first token waits for no snapshot): the store plan's blocks
            tiers.store_computed(plan, self.kv_cache, by_id)
        return out

    def _after_step(self, plan: Any, by_id: dict) -> list:
        """Pin the prompts computed in this step whose request asked for it (``kv_retention``); record sample 0's
        tokens for streaming; finish samples whose text now contains a stop string."""
        done = []
        sched = self.scheduler
        for pw in plan.prefills:
            r = by_id.get(pw.request_id)
            if r is not None and r.retain is not None and r.pin is None and pw.num_samples:  # (the last chunk)
                r.pin, r.pin_error = self._request_pins.settle(r.prompt_token_ids, *r.retain, r.namespace)
        seq_ids = [pw.seq_id for pw in plan.prefills]
        if plan.decode is not None:
            seq_ids += plan.decode.seq_ids.tolist()
        for sid in seq_ids:
            try:
                view = sched.sequence(sid)
            except KeyError:
                continue
            r = by_id.get(view.request_id)
            if r is None:
                continue
            if view.sample_index == 0:
                r.live = view.output
            if not r.params.stop:
                continue
            text = r.tokenizer.decode(view.output, skip_special_tokens=True)
            if any(s in text for s in r.params.stop):
                out = sched.finish_sequence(sid, FINISH_STOP)
                if out is not None:
                    done.append(out)
        return done


def _per_prompt(value: Any, n: int, name: str, single: tuple = ()) -> list:
    """``value`` for each of ``n`` prompts: a list or tuple (not of the ``single`` types) gives one per prompt
    (InvalidArgumentError on a length mismatch), anything else is every prompt's."""
    if isinstance(value, (list, tuple)) and not isinstance(value, single):
        if len(value) != n:
            raise InvalidArgumentError(f"{name}: {len(value)} values for {n} prompts (give one, or one per prompt)")
        return list(value)
    return [value] * n


class _Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "generator", "tokenizer", "result", "live",
                 "namespace", "priority", "session", "retain", "pin", "pin_error")

    def __init__(self, rid: int, prompt: str | None, ids: tuple, params: SamplingParams,
                 generator: torch.Generator, tokenizer: Any, namespace: Any = None) -> None:
        self.request_id = rid
        self.prompt = prompt
        self.prompt_token_ids = ids
        self.params = params
        self.generator = generator
        self.tokenizer = tokenizer
        self.result: RequestOutput | None = None
        self.live: tuple = ()  # tokens generated so far by sample 0 (for streaming)
        self.namespace = namespace  # prefix-cache namespace (None: the shared default)
        self.priority = 0  # vLLM's request priority (lower is more urgent)
        self.session: Any = None  # the conversation hint of the eviction policy (None: none)
        self.retain: tuple | None = None  # kv_retention admitted: (prompt tokens to pin, ttl)
        self.pin: Pin | None = None  # that pin, once made (Pin(0, ...): nothing pinned)
        self.pin_error: str | None = None  # why it was not made

    def text(self) -> str:
        """Text of sample 0 so far (the final text once finished)."""
        if self.result is not None:
            return self.result.outputs[0].text
        return self.tokenizer.decode(self.live, skip_special_tokens=True)

    def finish(self, out: Any) -> None:
        outs = []
        for i, (toks, reason) in enumerate(zip(out.outputs, out.finish_reasons)):
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            for s in self.params.stop:
                cut = text.find(s)
                if cut >= 0:
                    text, reason = text[:cut], FINISH_STOP
            outs.append(CompletionOutput(i, text, tuple(int(t) for t in toks), reason))
        self.result = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, tuple(outs),
                                    int(out.num_cached_tokens), self.pin, self.pin_error)
