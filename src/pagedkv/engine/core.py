"""``EngineCore``: requests in, one step at a time, outputs out. The one engine API that :class:`~pagedkv.engine.LLM`
and the server (:class:`pagedkv.server.async_engine.AsyncEngine`) both drive.

One step (:meth:`EngineCore.step`)::

    plan = scheduler.schedule()          # block-manager calls: allocate / decode_step / swap / fork
    plan.copies                          # every KV block copy of the step, executed in order
    logits = model(metadata(plan), kv)   # prefills and decodes in one forward
    scheduler.update(plan, sampled)      # append, stop, free

The model only ever sees slots and block tables from the :class:`~pagedkv.BlockManager`; the tests check that
its greedy output equals a contiguous-cache reference token for token.

The core keeps the block tables itself, one row per sequence (indexed by the manager's table rows): a prefill, a
forked sample's first decode and a swap-in load a whole row, every decode step applies only the entries it changed
(``decode_step(..., block_tables=False)``, through the scheduler's ``incremental_tables``), so the block manager's
step costs the same at any context length (docs/engine-contract.md).

The contract: :meth:`~EngineCore.make_request` validates (changes nothing), :meth:`~EngineCore.add_request` queues,
:meth:`~EngineCore.abort` drops, :meth:`~EngineCore.step` runs one step and returns a
:class:`~pagedkv.engine.outputs.StepOutput`. One caller at a time: adds, aborts and the block manager's calls only
between two steps. A fault of one request (its sampling, its stop-string text) fails that request alone; a forward
that raises fails the requests of its step; both are aborted by the core and reported in the step's output.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import InvalidArgumentError, PromptTooLongError
from ..manager import NULL_BLOCK, AllocStatus
from ..retention.steering import Pin
from ..scheduler import FINISH_STOP, Scheduler
from .build import build_cache, load_model_parts
from .config import CacheConfig, ModelRunConfig, SchedulerConfig, TierConfig
from .connector import KVConnector, KVConnectors
from .kv_tiers import EngineTiers
from .model import execute_copy_plan
from .paged_attention import build_attention_metadata, build_group_attention_metadata
from .outputs import CompletionOutput, EngineTimes, RequestOutput, StepOutput
from .request_pins import RequestPins
from .sampling import SamplingParams, sample, sample_batch, sample_bounded
from .cpu import ThreadPolicy

__all__ = ["EngineCore", "Request"]

log = logging.getLogger("pagedkv.engine")


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


class Request:
    """One request, built by :meth:`EngineCore.make_request`. Its caller may set ``priority`` (vLLM's: lower is
    more urgent), ``session`` (the eviction policy's conversation hint) and ``retain`` (an admitted
    ``kv_retention``: ``RequestPins.admit``'s answer) before :meth:`EngineCore.add_request`; ``result`` is set by
    :meth:`finish`; ``live`` holds sample 0's tokens so far, ``pin`` / ``pin_error`` the ``kv_retention`` pin."""

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

    def finish(self, out: Any) -> RequestOutput:
        """Set (and return) :attr:`result` from the scheduler's output of this request: each sample's text, cut
        at its first stop string."""
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
        return self.result


class EngineCore:
    """The model, its KV cache, the block manager, the scheduler and the tiers of one engine; see the module
    docstring. Built from the four configs of :mod:`pagedkv.engine.config` (``InvalidArgumentError`` for what
    they cannot check alone); ``model``: a name, a GGUF path or an already loaded model (its weights shared).

    Read-only attributes: ``model``, ``tokenizer``, ``block_manager``, ``scheduler``, ``kv_cache``,
    ``cpu_kv_cache``, ``kv_cache_groups`` (the groups in use, or None: one table), ``max_model_len``,
    ``max_num_seqs``, ``sliding_window``, ``device``, ``fast_lm_head``, ``quant_kernels``,
    ``enable_chunked_prefill``, ``request_pins`` (:class:`~pagedkv.engine.request_pins.RequestPins`), ``kv_tiers``
    (the storage tiers, or None), ``kv_connectors`` (every KV connector, the tiers included, or None: see
    :mod:`pagedkv.engine.connector`)."""

    def __init__(self, model: Any, cache: CacheConfig, sched: SchedulerConfig, run: ModelRunConfig,
                 tiers: TierConfig, *, seed: int = 0) -> None:
        policy = ThreadPolicy(run.threads)  # first: starts the window of the free-core reading
        if run.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {run.device!r} was asked for but CUDA is not available; "
                                       f"use device='cpu'")
        if sched.preemption_mode == "swap" and cache.num_cpu_blocks <= 0 and not cache.swap_space:
            raise InvalidArgumentError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if tiers.enabled and not cache.enable_prefix_caching:
            raise InvalidArgumentError("the disk and shared KV tiers need enable_prefix_caching=True")
        if tiers.enabled and cache.sliding_window is not None:
            raise InvalidArgumentError("the disk and shared KV tiers are not available with sliding_window")
        m = load_model_parts(model, cache, run)
        self.model, self.device, self.tokenizer, self.max_model_len = m.model, m.device, m.tokenizer, m.max_model_len
        #: whether decode steps read the file's quantized weights (``quant_kernels`` and kernels that built)
        self.quant_kernels = m.quant_kernels
        #: whether the exact fast LM head is in use (``fast_lm_head`` and a model that supports it)
        self.fast_lm_head = m.fast_lm_head
        self._thread_policy = policy
        torch.set_num_threads(policy.initial())  # (automatic: the cores left free while the model loaded)
        c = build_cache(self.model, self.max_model_len, cache, sched, tiers)
        #: the KV cache groups in use (a HybridBlockManager), or None (one block table for all layers)
        self.kv_cache_groups = c.kv_cache_groups
        self.block_manager, self.kv_cache, self.cpu_kv_cache = c.block_manager, c.kv_cache, c.cpu_kv_cache
        self.sliding_window = cache.sliding_window
        self._timed_bm = _TimedCalls(self.block_manager)
        #: a request's ``kv_retention`` (admitted before it is added, settled once its prompt is computed)
        self.request_pins = RequestPins(self.block_manager, self.kv_cache_groups)
        self.scheduler = Scheduler(
            self._timed_bm, max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.token_budget,
            preemption_mode=sched.preemption_mode, num_lookahead_slots=sched.num_lookahead_slots,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            incremental_tables=getattr(self.block_manager, "table_rows", None) is not None,
            scheduling_policy=sched.scheduling_policy,
        )
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.max_num_seqs = sched.max_num_seqs
        # the block tables: row table_rows(seq) holds the sequence's table (with KV cache groups one such matrix
        # per group, the same rows)
        self._tables = [np.full((max(8, sched.max_num_seqs), 16), NULL_BLOCK, dtype=np.int32)
                        for _ in range(len(self.kv_cache_groups) if self.kv_cache_groups is not None else 1)]
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._requests: dict = {}  # request id -> Request, from add_request until it finishes or is aborted
        self._sampling_s = 0.0  # sampling time of the last _execute
        # request id -> the exception its sampling raised in a step (that request got placeholder tokens and is
        # aborted after the step; the others of the step are unaffected)
        self._sample_faults: dict = {}
        #: the storage tiers (kv_disk_dir, kv_shared), or None
        self.kv_tiers: EngineTiers | None = None
        #: the KV connectors the step loop calls (the tiers, a KV port), or None: no KV enters or leaves
        self.kv_connectors: KVConnectors | None = None
        if tiers.enabled:
            grouped = self.kv_cache_groups is not None
            self.kv_tiers = EngineTiers(self.model, self.kv_cache, cache.block_size, disk_dir=tiers.kv_disk_dir,
                                        disk_gib=tiers.kv_disk_gib, shared=tiers.kv_shared,
                                        max_load_ms_per_block=tiers.kv_load_max_ms_per_block,
                                        block_manager=self.block_manager, record_events=cache.enable_kv_events,
                                        cpu_kv_cache=self.cpu_kv_cache,
                                        windows=None if not grouped else
                                        tuple(getattr(g, "window", None) for g in self.kv_cache_groups))
            self.add_kv_connector(self.kv_tiers)

    # ------------------------------------------------------------------ read-only views
    @property
    def threads(self) -> int:
        """CPU threads the engine computes with now (``ModelRunConfig.threads``)."""
        return self._thread_policy.threads

    @property
    def thread_policy(self) -> ThreadPolicy:
        """How the thread count is chosen (its ``source``, its re-``checks``: the benchmarks' record)."""
        return self._thread_policy

    @property
    def block_manager_seconds(self) -> float:
        """Wall time spent inside the block manager's methods since the core was built."""
        return self._timed_bm.seconds

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests waiting, running, swapped, loading, or aborted loads to clear."""
        sched = self.scheduler
        return sched.has_unfinished() or bool(getattr(sched, "num_parked", 0))

    def close(self) -> None:
        """Finish the KV connectors' stores in flight and close them. Nothing to do without connectors."""
        if self.kv_connectors is not None:
            self.kv_connectors.close()

    def add_kv_connector(self, connector: KVConnector, first: bool = False) -> None:
        """Plug ``connector`` into the step loop (asked before the others when ``first``); already plugged:
        nothing. May be called from another thread than the step loop's: the connectors are replaced as one
        object, so a step sees the old set or the new one. O(connectors)."""
        c = self.kv_connectors
        self.kv_connectors = (KVConnectors((connector,)) if c is None else c.with_connector(connector, first))

    # ------------------------------------------------------------------ requests in
    def make_request(self, prompt: Any, params: SamplingParams | None = None, *, namespace: Any = None,
                     check_fit: bool = True) -> Request:
        """Validate one prompt (a string or ``{"prompt_token_ids": [...]}``) and build its request; raises a
        ``pagedkv.errors`` exception and changes nothing if it can never run. ``namespace`` isolates its
        prefix-cache blocks (None: the shared default namespace). ``check_fit=False`` skips the KV-cache fit
        check, which reads the block manager; a caller on another thread than the step loop (the server) makes
        its own check from the pool's sizes instead. O(prompt)."""
        sp = SamplingParams() if params is None else params
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
                f"{self.block_manager.config.num_gpu_blocks} blocks of {self.block_manager.block_size} tokens"
            )
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self._generator
        return Request(next(self._ids), text, tuple(ids), sp, gen, self.tokenizer, namespace)

    def add_request(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request` (between two steps). Raises (and queues nothing) when the
        scheduler refuses it."""
        r, p = request, request.params
        wait = False
        kvc = self.kv_connectors
        if kvc is not None:  # a tier or a prefill replica may hold blocks past the GPU and CPU hit
            wait = kvc.on_add(r.request_id, r.prompt_token_ids, r.namespace, self.block_manager)
        try:
            self.scheduler.add_request(r.request_id, r.prompt_token_ids, n=p.n, max_tokens=p.max_tokens,
                                       eos_token_id=self.tokenizer.eos_token_id, ignore_eos=p.ignore_eos,
                                       stop_token_ids=p.stop_token_ids, namespace=r.namespace, priority=r.priority,
                                       wait_for_kv=wait, session=r.session)
        except Exception:
            if wait:
                kvc.forget(r.request_id)
            raise
        self._requests[r.request_id] = r

    def abort(self, request_id: Any) -> Any:
        """Drop a request (between two steps), freeing its blocks: the scheduler's output for it (finish reason
        ``"abort"``), or None when it was not in flight (idempotent)."""
        self._requests.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def poll_tiers(self) -> None:
        """Account the KV connectors' finished loads and stores without a step (an idle server's metrics stay
        right): loads let their requests join the waiting queue, stores release their pinned blocks.
        O(finished transfers)."""
        if self.kv_connectors is not None:
            self.kv_connectors.poll(self.scheduler)

    def tier_stores_pending(self) -> bool:
        """Whether a KV connector has writes in flight (or finished and not yet polled)."""
        return self.kv_connectors is not None and self.kv_connectors.stores_pending()

    def wait_for_loads(self, timeout: float) -> bool:
        """Nothing can run but requests wait for KV loads: block up to ``timeout`` s for one. True if any
        request is loading."""
        kvc = self.kv_connectors
        if kvc is None or not (self.scheduler.num_loading or self.scheduler.num_parked):
            return False
        kvc.wait(timeout)
        return True

    # ------------------------------------------------------------------ the step
    def step(self, times: EngineTimes | None = None) -> StepOutput:
        """Run one step: finished tier loads join the queue, schedule, KV copies, forward, sample, update, stop
        strings, ``kv_retention`` pins. ``times``: the components' wall time is added to it. Raises only when the
        scheduler itself fails (the engine is then unusable); a request's fault is in the output."""
        sched = self.scheduler
        t0 = time.perf_counter()
        self.poll_tiers()  # finished KV loads let their requests join the waiting queue
        plan = sched.schedule()
        t1 = time.perf_counter()
        self._sampling_s = 0.0
        faults: dict = {}
        forward_error = None
        try:
            sampled = self._execute(plan) if not plan.is_empty else []
        except Exception as e:  # the forward (or its KV copies) raised: the whole step's requests fail
            forward_error = e
            sampled = [[0] * pw.num_samples if pw.num_samples > 1 else 0 for pw in plan.prefills]
            if plan.decode is not None:
                sampled += [0] * len(plan.decode.seq_ids)
            faults = dict.fromkeys(self._plan_requests(plan), e)
        t_sampling = self._sampling_s
        t2 = time.perf_counter()
        sampling_failed = frozenset(self._sample_faults)
        if self._sample_faults:
            faults.update(self._sample_faults)
            self._sample_faults = {}
        done = sched.update(plan, sampled)
        try:
            done += self._after_step(plan)
        except Exception as e:  # (stop strings: text decoding) pin it on no one: the step's requests fail
            faults.update(dict.fromkeys(self._plan_requests(plan) | {out.request_id for out in done}, e))
        if faults:
            done = [out for out in done if out.request_id not in faults]
            for rid in faults:
                self.abort(rid)
        for out in done:
            self._requests.pop(out.request_id, None)
        if forward_error is not None:  # blocks cached in this step may hold KV nobody wrote: nobody may hit them
            n = self.block_manager.reset_prefix_cache()
            log.warning("a forward pass failed (%r): its step's requests failed; the prefix cache was reset (%d "
                        "blocks freed)", forward_error, n)
        if times is not None:
            times.scheduler += (t1 - t0) + (time.perf_counter() - t2)
            times.model += t2 - t1 - t_sampling
            times.sampling += t_sampling
        return StepOutput(plan, tuple(done), faults, forward_error, sampling_failed & faults.keys())

    def _plan_requests(self, plan: Any) -> set:
        """Ids of the requests a step plan computes for. O(plan)."""
        rids = {pw.request_id for pw in plan.prefills}
        if plan.decode is not None:
            seq = self.scheduler.sequence
            for sid in plan.decode.seq_ids.tolist():
                try:
                    rids.add(seq(sid).request_id)
                except KeyError:  # finished (and freed) by the step's update
                    pass
        return rids

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
        """Bring the block tables up to date with a plan: whole rows for its prefills and for the decode's
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

    def _execute(self, plan: Any) -> list:
        """KV copies, forward and sampling of one plan: the sampled tokens (per sequence of the plan); the seconds
        spent sampling are left in ``self._sampling_s``."""
        n = self._thread_policy.tick()  # (one clock read; every RECHECK_S a /proc reading)
        if n is not None:
            torch.set_num_threads(n)
        by_id = self._requests
        incremental = self.scheduler.incremental_tables
        if incremental:
            self._update_tables(plan)  # first: every plan's table changes reach the engine, whatever fails later
        if len(plan.copies):  # every copy of the step, in the order the block manager handed them out
            execute_copy_plan(plan.copies, self.kv_cache, self.cpu_kv_cache)
        kvc = self.kv_connectors
        if plan.kv_loads and kvc is not None:  # reserved blocks: their KV is read off the step loop
            kvc.start_loads(plan.kv_loads)
        if not plan.has_forward:  # a step that only moved blocks
            return []
        if kvc is not None:  # staged KV into its blocks, and what the step's blocks hold, before the forward
            kvc.write_loads(plan, self.kv_cache)
            kvc.on_blocks_filled(plan, self.scheduler, by_id)
        meta, owners, skip = self._metadata(plan, incremental)
        head = self.model.head if self.fast_lm_head else None
        if head is not None:
            hidden = self.model.hidden(meta, self.kv_cache)
            logits = None
        else:
            logits = self.model(meta, self.kv_cache).cpu()
        if not owners:  # only chunks that sample nothing
            if kvc is not None:  # the store plan's blocks: a snapshot for the tiers (written off the loop)
                kvc.store_computed(plan, self.kv_cache, by_id)
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
                    drawn.append([0] * num)  # a placeholder; the request is aborted after the step
        # the LM head's products count as the model's time, the rest (bounds, candidates, draws) as sampling
        self._sampling_s = time.perf_counter() - t - ((head.seconds - head_s) if head is not None else 0.0)
        out = [toks if num > 1 else toks[0] for toks, (_, num) in zip(drawn, owners)]
        for i in skip:  # (in order: each index counts the entries before it)
            out.insert(i, None)
        if kvc is not None:  # after sampling (the first token waits for no snapshot): what to store or hold
            kvc.store_computed(plan, self.kv_cache, by_id)
        return out

    def _metadata(self, plan: Any, incremental: bool) -> tuple[Any, list, list]:
        """The forward's attention metadata of a plan, the ``(request, samples)`` of each row that samples, and
        the indices of the prefills that sample nothing (a chunk that leaves prompt behind)."""
        by_id = self._requests
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
            if incremental:  # the core's own tables: the batch's rows (the same rows in every group's matrix)
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
        return meta, owners, skip

    def _after_step(self, plan: Any) -> list:
        """Pin the prompts computed in this step whose request asked for it (``kv_retention``); record sample 0's
        tokens for streaming; finish samples whose text now contains a stop string."""
        done = []
        sched = self.scheduler
        by_id = self._requests
        for pw in plan.prefills:
            r = by_id.get(pw.request_id)
            if r is not None and r.retain is not None and r.pin is None and pw.num_samples:  # (the last chunk)
                r.pin, r.pin_error = self.request_pins.settle(r.prompt_token_ids, *r.retain, r.namespace)
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
