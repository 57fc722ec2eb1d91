"""Timed mode: requests arrive at their timestamps and hold their blocks while they run, as in an engine.

Service model (simulated clock, nothing sleeps; every figure is an option of :class:`ServiceModel`):

- The engine runs in *steps*. A step first admits waiting requests, oldest first, while fewer than
  ``max_running`` run and ``allocate`` finds room (a request that does not fit stays first in line: no
  overtaking). Its prompt costs ``(prompt - hit) / prefill_tps`` seconds of that step.
- Then every running request appends one output token through one batched ``decode_step`` (for pagedkv in its
  incremental form, ``block_tables=False``, as an engine that keeps its own block tables calls it), which costs
  ``decode_step_s`` seconds whatever the batch (a memory-bound decode); a request is done, and freed (its full
  blocks stay cached), after ``output_length`` tokens.
- When ``decode_step`` finds no free block, the most recently admitted request is preempted by recompute: freed
  (its blocks stay cached) and put back first in line; when readmitted it allocates its prompt plus the tokens it
  had generated (hits on that second allocate are reported apart, as ``recompute_*``). A request that runs alone
  and still finds no block has outgrown the whole pool: it is stopped there (``truncated``), as an engine stops
  at its maximum length.
- With nothing running and nobody waiting the clock jumps to the next arrival.

Output token ``k`` of request ``r`` is ``2**30 + (r * 2**16 + k) % 2**30``: distinct from every prompt token of the
trace (below ``2**30``), so outputs never hit prompts (the trace's ids do not say what a reply contained).
A run costs O(steps) numpy calls of O(running) work each, O(1) Python work per request admitted, preempted or
finished, plus the manager's calls; steps are about makespan / decode_step_s. (A running request's count of
generated tokens is not stepped one by one: it is ``gen0 + steps - step0`` from its admission on, and its last step
is known when it is admitted.)
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import InvalidArgumentError, OutOfBlocksError
from .point import PointResult, all_or_nothing, make_manager, setting, tier_figures
from .trace import Trace

__all__ = ["ServiceModel", "replay_timed"]

_OUT_BASE = 1 << 30


@dataclass(frozen=True)
class ServiceModel:
    """The engine's speed (see the module docstring)."""

    prefill_tps: float = 50_000.0  #: prompt tokens computed per second (cache hits are free)
    decode_step_s: float = 0.03  #: seconds per decode step (each running request gains one token)
    max_running: int = 64  #: concurrency cap (the engine's max batch)
    watermark: float = 0.01  #: fraction of blocks admission keeps free for running requests

    def __post_init__(self) -> None:
        if not self.prefill_tps > 0 or not self.decode_step_s > 0:
            raise InvalidArgumentError("prefill tokens/s and decode step time must be > 0")
        if self.max_running < 1:
            raise InvalidArgumentError(f"max running requests must be >= 1, got {self.max_running}")
        if not 0 <= self.watermark < 1:
            raise InvalidArgumentError(f"watermark must lie in [0, 1), got {self.watermark}")


def _outputs(r: int, start: int, stop: int) -> np.ndarray:
    return (_OUT_BASE + (r * 65536 + np.arange(start, stop, dtype=np.int64)) % _OUT_BASE).astype(np.int32)


def replay_timed(trace: Trace, capacity_tokens: int, *, block_size: int = 16, cpu_capacity_tokens: int = 0,
                 model: ServiceModel = ServiceModel(), manager_cls=None, impl: str = "pagedkv",
                 progress=None) -> PointResult:
    """Replay ``trace`` in timed mode at ``capacity_tokens``. Hit figures count first admissions only;
    ``extra`` holds ``preemptions``, ``truncated``, ``recompute_tokens``, ``recompute_hit_tokens``, ``makespan_s`` (simulated),
    ``mean_wait_s`` (arrival to first admission) and ``steps``. ``progress(k)``: k requests finished or skipped."""
    if manager_cls is None:
        from ..manager import BlockManager as manager_cls
    if not all_or_nothing(manager_cls):
        raise InvalidArgumentError(f"timed mode needs a manager whose decode_step is all-or-nothing for the batch "
                                   f"(atomic_append); {getattr(manager_cls, '__name__', manager_cls)} is not")
    num_blocks = capacity_tokens // block_size
    bm = make_manager(manager_cls, num_blocks, block_size, cpu_capacity_tokens // block_size, model.watermark)
    limit = num_blocks - int(setting(bm, "watermark_blocks", 0) or 0)
    n = len(trace)
    arrival = (trace.timestamps / 1000.0).tolist()
    lengths = trace.input_lengths.tolist()
    outlen = trace.output_lengths.tolist()
    allocate, free, decode_step = bm.allocate, bm.free, bm.decode_step
    if getattr(bm, "table_rows", None) is not None:  # pagedkv: the step hands back table changes, not tables
        decode_step = partial(decode_step, block_tables=False)
    take_copies = bm.take_copy_plan if setting(bm, "cpu_prefix_cache", False) else None
    prepare = getattr(bm, "prepare_step", None)  # anchors: engine-side bookkeeping before each step
    waiting: deque[int] = deque()
    running: list[int] = []  # in admission order (the victim of a preemption is the last one)
    gen = [0] * n  # output tokens generated before the request's current admission (all of them once it leaves)
    admitted = [False] * n
    # a running request r generated gen[r] + steps - step0[r] tokens; it finishes after step last[r]
    step0 = [0] * n
    epoch = [0] * n  # admissions so far: tells a finishing entry of an earlier admission (preempted since) apart
    finishing: dict[int, list] = {}  # step -> (request, epoch) finishing after it, in admission order
    base = np.zeros(0, dtype=np.int64)  # per running request: r * 65536 + gen[r] - step0[r] (its next token's id)
    stale = True  # running changed since base was built
    hits = prompt = skipped = preempt = rc_tok = rc_hit = steps = truncated = 0
    wait_sum = 0.0
    clock, j, done = 0.0, 0, 0
    t0 = time.perf_counter()
    while j < n or waiting or running:
        if not running and not waiting:
            clock = max(clock, arrival[j])
        while j < n and arrival[j] <= clock:
            waiting.append(j)
            j += 1
        prefill = 0
        while waiting and len(running) < model.max_running:
            r = waiting[0]
            ntok = lengths[r] + gen[r]
            if -(-ntok // block_size) > limit:  # can never fit
                waiting.popleft()
                skipped += 1
                done += 1
                continue
            toks = trace.tokens(r)
            if gen[r]:
                toks = np.concatenate((toks, _outputs(r, 0, gen[r])))
            try:
                h = allocate(r, toks)
            except OutOfBlocksError:
                break
            waiting.popleft()
            running.append(r)
            stale = True
            step0[r] = steps
            epoch[r] += 1
            if gen[r] < outlen[r]:
                finishing.setdefault(steps + outlen[r] - gen[r], []).append((r, epoch[r]))
            prefill += ntok - h
            if admitted[r]:
                rc_tok += ntok
                rc_hit += h
            else:
                admitted[r] = True
                hits += h
                prompt += ntok
                wait_sum += clock - arrival[r]
        step_s = prefill / model.prefill_tps
        if running:
            # requests with nothing (left) to generate finish right after their prefill (only new admissions can)
            if stale and any(gen[r] >= outlen[r] for r in running):
                for r in [r for r in running if gen[r] >= outlen[r]]:
                    free(r)
                    running.remove(r)
                    done += 1
            while running:
                if stale:
                    base = np.fromiter((r * 65536 + gen[r] - step0[r] for r in running), dtype=np.int64,
                                       count=len(running))
                    stale = False
                toks = (_OUT_BASE + (base + steps) % _OUT_BASE).astype(np.int32)
                try:
                    if prepare is not None:
                        prepare(running, toks)
                    decode_step(running, toks)
                    break
                except OutOfBlocksError:
                    victim = running.pop()
                    base = base[:-1]
                    free(victim)
                    gen[victim] += steps - step0[victim]
                    step0[victim] = -1  # (not running: its finishing entry is void)
                    if running:
                        waiting.appendleft(victim)
                        preempt += 1
                    else:  # alone and out of blocks: it can never grow further
                        truncated += 1
                        done += 1
            if running:
                steps += 1
                step_s += model.decode_step_s
                ending = finishing.pop(steps, None)
                if ending is not None:
                    finished = [r for r, e in ending if e == epoch[r] and step0[r] >= 0]
                    for r in finished:
                        free(r)
                        running.remove(r)
                        step0[r] = -1  # (not running)
                    if finished:
                        stale = True
                    done += len(finished)
        if take_copies is not None:  # the engine makes the CPU tier's copies of the step
            take_copies()
        clock += step_s
        if progress is not None and done >= 256:
            progress(done)
            done = 0
    seconds = time.perf_counter() - t0
    if progress is not None and done:
        progress(done)
    res = PointResult(impl, "timed", capacity_tokens, cpu_capacity_tokens, block_size, requests=n - skipped,
                      skipped=skipped, prompt_tokens=prompt, hit_tokens=hits, seconds=seconds)
    for k, v in tier_figures(bm.stats, bool(setting(bm, "cpu_prefix_cache", False))).items():
        setattr(res, k, v)
    res.extra = {"preemptions": preempt, "truncated": truncated, "recompute_tokens": rc_tok,
                 "recompute_hit_tokens": rc_hit,
                 "makespan_s": clock, "mean_wait_s": wait_sum / max(n - skipped, 1), "steps": steps,
                 "model": asdict(model)}
    return res
