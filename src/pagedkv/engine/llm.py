"""``LLM``: generate with a real model through the paged KV cache (in the style of vLLM's ``LLM``).

A facade over :class:`~pagedkv.engine.core.EngineCore` (``llm.core``), which holds the model, the block manager,
the scheduler and the step (see :mod:`pagedkv.engine.core`): ``generate`` / ``chat`` / ``stream`` build requests
with ``core.make_request``, queue them with ``core.add_request`` and call ``core.step()`` until they finish. The
server (:mod:`pagedkv.server.async_engine`) drives the same core.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from ..retention.steering import Pin
from .config import CacheConfig, ModelRunConfig, SchedulerConfig, TierConfig
from .core import EngineCore, Request
from .outputs import CompletionOutput, EngineTimes, RequestOutput
from .request_pins import KVRetention, parse_kv_retention
from .sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "KVRetention", "RequestOutput", "SamplingParams", "CacheConfig",
           "SchedulerConfig", "ModelRunConfig", "TierConfig"]


def _override(config: Any, **fields: Any) -> Any:
    """``config`` with the fields given (not None) replaced (a config is frozen: a new one)."""
    given = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(config, **given) if given else config


class LLM:
    """A GGUF model (Llama architecture, or Gemma 3) served through pagedkv's block manager.

    Args:
        model: a model name (``"smollm2-135m"``, the default, or ``"gemma-3-270m"``; see
            :mod:`pagedkv.engine.registry`), the path of a GGUF file (its ``general.architecture`` picks the model
            class), or an already loaded model (``PagedLlama``, ``PagedGemma3``) to share its weights.
        block_size: the :class:`~pagedkv.engine.config.CacheConfig` field (None: the config's).
        num_gpu_blocks: the :class:`~pagedkv.engine.config.CacheConfig` field (None: the config's).
        enable_prefix_caching: the :class:`~pagedkv.engine.config.CacheConfig` field (None: the config's).
        max_num_seqs: the :class:`~pagedkv.engine.config.SchedulerConfig` field (None: the config's).
        device: the :class:`~pagedkv.engine.config.ModelRunConfig` field, ``"cpu"`` or ``"cuda"`` (None: the
            config's).
        seed: seed of the generator used by requests without their own seed.
        cache_config: the KV cache and the block manager (:class:`~pagedkv.engine.config.CacheConfig`; default
            ``CacheConfig()``).
        scheduler_config: the scheduler (:class:`~pagedkv.engine.config.SchedulerConfig`).
        run_config: how the model is loaded and run (:class:`~pagedkv.engine.config.ModelRunConfig`: dtype, fast
            LM head, quantized kernels, ``max_model_len``, threads).
        tier_config: the disk and shared KV tiers (:class:`~pagedkv.engine.config.TierConfig`; none by default).

    Every option is declared, checked and documented once, in :mod:`pagedkv.engine.config`;
    :func:`~pagedkv.engine.config.engine_configs` builds the configs from flat option names
    (``LLM(model, **engine_configs(eviction_policy="slru", kv_shared=url))``). A bad value raises
    :class:`~pagedkv.errors.InvalidArgumentError`.

    KV events (``CacheConfig.enable_kv_events``) come out of ``llm.block_manager.events.take()`` and, for what the
    tiers stored (``medium`` ``"DISK"`` or ``"SHARED"``), ``llm.kv_tiers.take_events()``. The CPU tier of the
    prefix cache lives in the ``num_cpu_blocks`` CPU blocks, shared with swap preemption.

    With tiers, a request whose prompt continues past the GPU/CPU hit in a tier waits while the tiers are asked
    how many blocks they hold (an I/O thread), is then admitted with GPU blocks reserved for them
    (``allocate(..., num_external_tokens=)``; out of every batch while they are read on an I/O thread and
    written in), and its prefill computes the rest (``PrefillWork.num_external_tokens``: the loaded tokens); a
    failed, corrupt or timed-out load computes what did not arrive. With KV cache groups (Gemma 3's default) each
    group's blocks are stored under its own fingerprint, and a sliding group stores and loads only the blocks
    its window still sees (docs/tiers.md#kv-cache-groups). ``sliding_window`` (one table whose window releases
    blocks) refuses tiers (``InvalidArgumentError``). Call :meth:`close` (or use ``with LLM(...) as llm``) to
    finish the stores.

    Attributes (read-only): ``core`` (the :class:`~pagedkv.engine.core.EngineCore`), and from it ``model``,
    ``tokenizer``, ``block_manager``, ``scheduler``, ``kv_cache``, ``cpu_kv_cache``, ``kv_cache_groups`` (the KV
    cache groups in use, or None: one table), ``max_model_len``, ``max_num_seqs``, ``sliding_window``, ``device``,
    ``fast_lm_head``, ``quant_kernels`` (whether each is in use), ``enable_chunked_prefill``, ``request_pins``,
    ``kv_tiers``, ``threads``; ``last_times`` (:class:`~pagedkv.engine.outputs.EngineTimes` of the last call).
    """

    def __init__(
        self,
        model: Any = None,
        *,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        enable_prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        device: str | None = None,
        seed: int = 0,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        run_config: ModelRunConfig | None = None,
        tier_config: TierConfig | None = None,
    ) -> None:
        cache = _override(cache_config or CacheConfig(), block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                          enable_prefix_caching=enable_prefix_caching)
        sched = _override(scheduler_config or SchedulerConfig(), max_num_seqs=max_num_seqs)
        run = _override(run_config or ModelRunConfig(), device=device)
        core = self.core = EngineCore(model, cache, sched, run, tier_config or TierConfig(), seed=seed)
        # the core's fixed parts, as plain attributes (read on the server's request path)
        self.model, self.tokenizer, self.device = core.model, core.tokenizer, core.device
        self.block_manager, self.scheduler = core.block_manager, core.scheduler
        self.kv_cache, self.cpu_kv_cache = core.kv_cache, core.cpu_kv_cache
        self.kv_cache_groups, self.sliding_window = core.kv_cache_groups, core.sliding_window
        self.max_model_len, self.max_num_seqs = core.max_model_len, core.max_num_seqs
        self.fast_lm_head, self.quant_kernels = core.fast_lm_head, core.quant_kernels
        self.enable_chunked_prefill, self.request_pins = core.enable_chunked_prefill, core.request_pins
        self.last_times = EngineTimes()

    @property
    def kv_tiers(self) -> Any:
        """The storage tiers (``TierConfig``), or None (a KV connector: :mod:`pagedkv.engine.connector`)."""
        return self.core.kv_tiers

    def close(self) -> None:
        """Finish the storage tiers' stores in flight and close them (the disk directory may then be opened by
        another engine). The engine must not run afterwards. Nothing to do without tiers."""
        self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def threads(self) -> int:
        """CPU threads the engine computes with now (``ModelRunConfig.threads``)."""
        return self.core.threads

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
        specs = [None if k is None else parse_kv_retention(k)
                 for k in _per_prompt(kv_retention, len(requests), "kv_retention", (Mapping, KVRetention))]
        retain = [None if k is None else self.core.request_pins.admit(r.prompt_token_ids, k, r.namespace)
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
        if not bm.config.enable_prefix_caching or not bm.config.pin_budget_blocks:
            raise InvalidArgumentError("pin_prefix needs enable_prefix_caching=True and pin_budget_blocks > 0")
        if not ids:
            raise InvalidArgumentError("empty prompt")
        full = len(ids) // bm.block_size * bm.block_size
        if compute and full and bm.lookup_prefix(ids + ids[:1], namespace=namespace).num_cached_tokens < full:
            req = self.core.make_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0),
                                         namespace=namespace)
            for _ in self._run([req]):
                pass
        pin = bm.retention.pin_prefix(ids, ttl=ttl, namespace=namespace)
        # (requests of that prefix then need no new blocks)
        self.core.request_pins.remember(ids[: pin.num_tokens], pin, namespace)
        return pin

    def unpin(self, pin_id: int) -> None:
        """Drop a pin made by :meth:`pin_prefix` (UnknownPinError if there is none by that id, e.g. expired)."""
        self.block_manager.retention.unpin(pin_id)

    @property
    def pins(self) -> tuple:
        """The live pins (:class:`~pagedkv.Pin`; expired ones dropped first)."""
        return self.block_manager.retention.pins

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
    def _make_requests(self, prompts: Sequence[Any], sampling_params: Any) -> list[Request]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return [self.core.make_request(p, sp) for p, sp in zip(prompts, params)]

    def _run(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Run until every request finished; yields the requests finished by each step. A request's fault aborts
        every request of the call and raises (a sampler's: RuntimeError; a forward's: its exception)."""
        core = self.core
        by_id = {r.request_id: r for r in requests}
        for r in requests:
            core.add_request(r)
        times = self.last_times = EngineTimes()
        bm0 = core.block_manager_seconds
        t_start = time.perf_counter()
        pending = len(requests)
        while pending:
            out = core.step(times)
            if out.faults:
                for r in requests:
                    if r.result is None:
                        core.abort(r.request_id)
                if out.forward_error is not None:
                    raise out.forward_error
                rid, e = next(iter(out.faults.items()))
                if rid in out.sampling_failed:
                    raise RuntimeError(f"sampling failed for request {rid}: {e!r}") from e
                raise e
            finished = []
            for o in out.finished:
                r = by_id.get(o.request_id)
                if r is not None and r.result is None:
                    r.finish(o)
                    finished.append(r)
            pending -= len(finished)
            if out.plan.is_empty and not out.finished and pending and not core.wait_for_loads(0.05):
                raise RuntimeError("the scheduler made no progress (no request can be scheduled)")
            yield finished
        times.total = time.perf_counter() - t_start
        times.block_manager = core.block_manager_seconds - bm0


def _per_prompt(value: Any, n: int, name: str, single: tuple = ()) -> list:
    """``value`` for each of ``n`` prompts: a list or tuple (not of the ``single`` types) gives one per prompt
    (InvalidArgumentError on a length mismatch), anything else is every prompt's."""
    if isinstance(value, (list, tuple)) and not isinstance(value, single):
        if len(value) != n:
            raise InvalidArgumentError(f"{name}: {len(value)} values for {n} prompts (give one, or one per prompt)")
        return list(value)
    return [value] * n
