"""Runs the workloads through block-manager implementations and measures the block-manager time.

The scheduler (:class:`pagedkv.scheduler.Scheduler`) drives a :class:`TimedBlockManager`, which forwards every
call to the implementation and adds its ``time.perf_counter_ns`` duration to a counter (``prepare_step``, the
untimed engine-side bookkeeping of the anchor adapters, is forwarded without timing). The harness reads the
counter around each step, so a step's figure is the block-manager time of that step only: admission, allocation,
the batched append, preemption, swapping, forking and freeing, without the scheduler's or the fake model's own
Python work.

Per workload and implementation: ``warmup`` untimed runs, then ``repeats`` measured runs. Per run: median and
p99 microseconds per decode step, median at the run's largest batch, microseconds per sequence per step, total
block-manager seconds; the summary gives min / median / max of each across runs, plus the (deterministic) prefix
cache hit rate, preemptions, copy-on-writes and swaps of the first run.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..scheduler import Scheduler
from .workloads import FakeModel, Workload

__all__ = ["Impl", "TimedBlockManager", "resolve_impl", "run_replay", "run_scale", "run_workload", "summarize"]

ALL_FEATURES = frozenset({"prefix_caching", "fork", "swap", "lookahead", "sliding_window", "eviction_order"})

_TIMED_METHODS = (
    "can_allocate", "allocate", "can_append_slots", "append_slots", "decode_step", "slot_mapping", "fork", "free",
    "can_swap_out", "swap_out", "can_swap_in", "swap_in", "block_table", "num_tokens", "is_swapped",
)


class TimedBlockManager:
    """Forwards the BlockManager API to ``inner`` and accumulates the nanoseconds spent in it (``ns``).
    ``prepare_step`` (if ``inner`` has one) and attribute reads are forwarded untimed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ns = 0
        self.calls = 0
        prep = getattr(inner, "prepare_step", None)
        if prep is not None:
            self.prepare_step = prep  # untimed
        for name in _TIMED_METHODS:
            m = getattr(inner, name, None)
            if m is not None:
                setattr(self, name, self._wrap(m))

    def _wrap(self, method: Callable) -> Callable:
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns += clock() - t0
                self.calls += 1

        return timed

    def __getattr__(self, name: str) -> Any:  # properties and anything else: untimed
        return getattr(self.inner, name)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.inner

    def __len__(self) -> int:
        return len(self.inner)


@dataclass(frozen=True)
class Impl:
    name: str
    factory: Callable[..., Any]
    supports: frozenset
    missing: str = ""
    version: str = ""
    unavailable: str | None = None  # why it cannot run here (None: it can)
    atomic_append: bool = False  # decode_step is all-or-nothing (the scheduler may skip can_append_slots)


def resolve_impl(name: str) -> Impl:
    """``pagedkv`` or an anchor name (see :mod:`pagedkv.bench.anchors`)."""
    if name == "pagedkv":
        import pagedkv
        from pagedkv import BlockManager

        return Impl("pagedkv", BlockManager, ALL_FEATURES, "", f"pagedkv {pagedkv.__version__}", atomic_append=True)
    try:
        from .anchors import load_anchor

        cls = load_anchor(name)
    except (ImportError, KeyError) as exc:  # AnchorUnavailable is an ImportError
        return Impl(name, None, frozenset(), "", "", unavailable=str(exc).strip("'\""))
    return Impl(name, cls, frozenset(getattr(cls, "supports", ALL_FEATURES)), str(getattr(cls, "missing", "")),
                str(getattr(cls, "name", name)))


class Skip(Exception):
    """The implementation cannot run this workload (the message says why)."""


def _construct(impl: Impl, wl: Workload) -> Any:
    kwargs: dict[str, Any] = dict(num_cpu_blocks=wl.num_cpu_blocks, enable_prefix_caching=wl.prefix_caching)
    if wl.sliding_window is not None:
        kwargs["sliding_window"] = wl.sliding_window
    try:
        return impl.factory(wl.num_gpu_blocks, wl.block_size, **kwargs)
    except NotImplementedError as exc:
        raise Skip(f"{impl.name}: {exc}") from exc


def _percentile(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else float("nan")


def run_replay(wl: Workload, impl: Impl, seed: int = 0, *, series: bool = False, precheck: bool = True) -> dict:
    """One offline run of a replay workload; returns its metrics (and per-step series when ``series``).
    ``precheck=False`` lets the scheduler skip ``can_append_slots`` for an all-or-nothing implementation."""
    missing = wl.requires - impl.supports
    if missing:
        raise Skip(f"{impl.name} does not support {', '.join(sorted(missing))}"
                   + (f" ({impl.missing})" if impl.missing else ""))
    bm = _construct(impl, wl)
    timed = TimedBlockManager(bm)
    sched = Scheduler(timed, max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
                      preemption_mode=wl.preemption_mode, num_lookahead_slots=wl.num_lookahead_slots,
                      precheck_append=precheck or not impl.atomic_append)
    prompts = wl.prompts(seed)
    for i in range(wl.num_requests):
        sched.add_request(i, prompts[i], n=wl.n, max_tokens=wl.output_len, ignore_eos=True)
    model = FakeModel(seed, num_lookahead_slots=wl.num_lookahead_slots)
    num_gpu = wl.num_gpu_blocks
    step_ns: list[int] = []  # every step
    batch: list[int] = []  # decode batch size of every step (0: no decode)
    used: list[int] = []  # GPU blocks in use after every step
    max_per_seq = 0.0
    outputs = 0
    gc.collect()
    t_wall = time.perf_counter()
    try:
        while sched.has_unfinished():
            timed.ns = 0
            plan = sched.schedule()
            sampled = model.sample(plan)
            done = sched.update(plan, sampled)
            step_ns.append(timed.ns)
            b = 0 if plan.decode is None else len(plan.decode.seq_ids)
            batch.append(b)
            u = num_gpu - bm.num_free_gpu_blocks
            used.append(u)
            running = sched.num_running_seqs
            if running and wl.sliding_window is not None:
                max_per_seq = max(max_per_seq, u / running)
            for o in done:
                outputs += sum(len(t) for t in o.outputs)
                if o.finish_reason == "ignored":
                    raise RuntimeError(f"request {o.request_id} was ignored: {o.error}")
    except NotImplementedError as exc:
        raise Skip(f"{impl.name}: {exc}") from exc
    wall = time.perf_counter() - t_wall
    ns = np.asarray(step_ns, dtype=np.int64)
    bsz = np.asarray(batch, dtype=np.int64)
    dec = bsz > 0
    dec_us = ns[dec] / 1e3
    full = bsz == bsz.max() if bsz.size else dec
    st = sched.stats
    m = {
        "steps": len(step_ns),
        "decode_steps": int(dec.sum()),
        "max_batch": int(bsz.max()) if bsz.size else 0,
        "median_us_per_step": float(np.median(dec_us)) if dec_us.size else float("nan"),
        "p99_us_per_step": _percentile(dec_us, 99),
        "median_us_per_step_at_max_batch": float(np.median(ns[full] / 1e3)) if full.any() else float("nan"),
        "us_per_seq_step": float(ns[dec].sum() / 1e3 / bsz[dec].sum()) if dec.any() else float("nan"),
        "total_bm_s": float(ns.sum() / 1e9),
        "wall_s": wall,
        "output_tokens": outputs,
        "hit_rate": st.hit_rate,
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "preemptions": st.preemptions,
        "recompute_preemptions": st.recompute_preemptions,
        "swap_outs": st.swap_outs,
        "swap_ins": st.swap_ins,
        "swapped_out_blocks": st.swapped_out_blocks,
        "swapped_in_blocks": st.swapped_in_blocks,
        "copy_on_writes": st.copy_on_writes,
        "forks": st.forks,
        "max_blocks_used": int(max(used)) if used else 0,
    }
    if wl.sliding_window is not None:
        m["max_blocks_per_seq"] = max_per_seq
        m["blocks_per_seq_without_window"] = -(-(wl.prompt_len + wl.output_len) // wl.block_size)
    if series:
        m["series"] = _series(ns, bsz, np.asarray(used, dtype=np.int64), num_gpu)
    return m


def _series(ns: np.ndarray, bsz: np.ndarray, used: np.ndarray, num_gpu: int, max_points: int = 2000) -> dict:
    """Per-batch-size median step cost and a down-sampled block-usage curve (for the plots)."""
    dec = bsz > 0
    by_batch: list[list[float]] = []
    if dec.any():
        b, us = bsz[dec], ns[dec] / 1e3
        order = np.argsort(b, kind="stable")
        b, us = b[order], us[order]
        uniq, first, count = np.unique(b, return_index=True, return_counts=True)
        for u, f, c in zip(uniq.tolist(), first.tolist(), count.tolist()):
            by_batch.append([u, float(np.median(us[f : f + c])), c])
    stride = max(1, -(-len(used) // max_points))
    idx = np.arange(0, len(used), stride)
    return {
        "cost_by_batch": by_batch,  # [batch size, median us per step, steps]
        "usage_step": idx.tolist(),
        "usage_blocks": used[idx].tolist(),
        "num_gpu_blocks": num_gpu,
    }


def run_scale(wl: Workload, impl: Impl, repeats: int, warmup: int) -> dict:
    """Construction time and bookkeeping bytes per block of pools of ``wl.scale_sizes`` blocks."""
    rows = []
    for size in wl.scale_sizes:
        for caching in (False, True):
            if caching and "prefix_caching" not in impl.supports:
                continue
            make = lambda: impl.factory(size, wl.block_size, enable_prefix_caching=caching)  # noqa: E731
            try:
                for _ in range(warmup):
                    make()
                times = []
                for _ in range(repeats):
                    gc.collect()
                    t0 = time.perf_counter_ns()
                    obj = make()
                    times.append((time.perf_counter_ns() - t0) / 1e6)
                    del obj
                gc.collect()
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
                obj = make()
                size_bytes = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()
                del obj
            except NotImplementedError as exc:
                raise Skip(f"{impl.name}: {exc}") from exc
            finally:
                if tracemalloc.is_tracing():
                    tracemalloc.stop()
            t = np.asarray(times)
            row = {
                "num_blocks": size,
                "prefix_caching": caching,
                "construct_ms": {"min": float(t.min()), "median": float(np.median(t)), "max": float(t.max())},
                "bytes": int(size_bytes),
                "bytes_per_block": size_bytes / size,
            }
            if caching and size == wl.scale_sizes[0]:
                row["bytes_per_block_full"] = _full_cache_bytes(make, size, wl.block_size) / size
            rows.append(row)
    return {"pools": rows}


def _full_cache_bytes(make: Callable[[], Any], size: int, block_size: int, blocks_per_prompt: int = 64) -> int:
    """Bytes held by a new manager once about 90% of its blocks cache distinct content: prompts of
    ``blocks_per_prompt`` full blocks plus one token are allocated and freed (their full blocks stay cached),
    measured with tracemalloc from before construction to after the frees."""
    rng = np.random.default_rng(0)
    n_prompts = int(0.9 * size) // (blocks_per_prompt + 1)
    prompts = rng.integers(0, 32_000, size=(n_prompts, blocks_per_prompt * block_size + 1)).tolist()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        bm = make()
        for i, p in enumerate(prompts):
            bm.allocate(i, p)
            bm.free(i)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


_SUMMARY_KEYS = ("median_us_per_step", "p99_us_per_step", "median_us_per_step_at_max_batch", "us_per_seq_step",
                 "total_bm_s", "wall_s")


def summarize(runs: list[dict]) -> dict:
    """min / median / max across runs of the timing metrics; the deterministic counters of the first run."""
    out = {k: v for k, v in runs[0].items() if k not in _SUMMARY_KEYS and k != "series"}
    for k in _SUMMARY_KEYS:
        vals = np.asarray([r[k] for r in runs], dtype=float)
        out[k] = {"min": float(np.min(vals)), "median": float(np.median(vals)), "max": float(np.max(vals))}
    out["repeats"] = len(runs)
    return out


def run_workload(wl: Workload, impl: Impl, *, repeats: int, warmup: int, seed: int = 0, precheck: bool = True,
                 progress: Callable[[], None] | None = None) -> dict:
    """Warm-up plus measured runs of one workload with one implementation; a result record (status ok, skipped
    or error)."""
    rec: dict[str, Any] = {"workload": wl.name, "impl": impl.name, "impl_version": impl.version,
                           "precheck_append": precheck or not impl.atomic_append}
    tick = progress or (lambda: None)
    if impl.unavailable:
        rec.update(status="skipped", reason=impl.unavailable)
        return rec
    try:
        if wl.kind == "scale":
            rec["metrics"] = run_scale(wl, impl, repeats, warmup)
            for _ in range(repeats + warmup):
                tick()
        else:
            for _ in range(warmup):
                run_replay(wl, impl, seed, precheck=precheck)
                tick()
            runs = []
            for i in range(repeats):
                runs.append(run_replay(wl, impl, seed, series=(i == 0), precheck=precheck))
                tick()
            summary = summarize(runs)
            summary["series"] = runs[0]["series"]
            rec["metrics"] = summary
        rec["status"] = "ok"
    except Skip as exc:
        rec.update(status="skipped", reason=str(exc))
    except Exception as exc:  # a failing anchor must not stop the suite
        rec.update(status="error", reason=f"{type(exc).__name__}: {exc}")
    return rec
