"""In-process A/B of the scheduler's hot path, ``schedule()`` + ``update()``, between this tree's pagedkv and
another checkout's (loaded side by side under another package name), alternating step for step::

    PYTHONPATH=src .venv/bin/python benchmarks/sched_ab.py /path/to/main/src [--steps 1000]

Each case runs one Scheduler of each tree over its own tree's BlockManager (blocks of 16, prefix caching on; or,
first, over a block manager that does nothing, to time the scheduler's own Python alone) with a fake model (the
sampled token is a hash of sequence id and position, EOS now and then), refilled to 256 requests as requests
finish, for ``--steps`` steps, ``--repeats`` times. Only ``schedule()`` and ``update()`` are timed; the order of
the two trees alternates every step, and which is built first alternates every run. Both trees must make the same
plans: each step's plan (decode ids and positions, prefills, preemptions, copies) and the final statistics are
compared, and a difference stops the run.
Prints, per case, the total milliseconds of each tree, the median step in microseconds and the ratio this / other.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

import pagedkv as this
from ab_inproc import load  # (this folder is on sys.path when run as a script)


EOS = 0

class NullBM:
    """A block manager that always has room and does nothing (no slots, no tables, no copy plan of its own): the
    steps then time the scheduler's own Python alone."""

    atomic_append = True

    def __init__(self, **_: object) -> None:
        pass

    def can_allocate(self, *a, **k):
        return "OK"

    def allocate(self, *a, **k):
        return 0

    def decode_step(self, *a, **k):
        return _NULL_STEP

    def free(self, *a, **k):
        pass

    def fork(self, *a, **k):
        pass


class _NullStep:
    cow = None
    slot_mapping = None


_NULL_STEP = _NullStep()

# name -> (BlockManager kwargs, Scheduler kwargs, samples per request); "null" in the kwargs: NullBM
CASES = {
    "scheduler alone (NullBM)": (dict(null=True), dict(), 1),
    "decode (roomy pool)": (dict(num_gpu_blocks=8192), dict(), 1),
    "preempt recompute, n=2": (dict(num_gpu_blocks=2200), dict(), 2),
    "preempt swap": (dict(num_gpu_blocks=2200, num_cpu_blocks=8192), dict(preemption_mode="swap"), 1),
    "chunked + incremental": (dict(num_gpu_blocks=4096), dict(enable_chunked_prefill=True, incremental_tables=True,
                                                               max_num_batched_tokens=1024), 1),
}


class Run:
    """One tree's scheduler on one case: the request stream, the fake model, the timer."""

    def __init__(self, pk, bm_kw: dict, sched_kw: dict, n: int, seed: int = 0) -> None:
        self.pk = pk
        if bm_kw.get("null"):
            self.bm = NullBM()
        else:
            self.bm = pk.BlockManager(block_size=16, enable_prefix_caching=True, **bm_kw)
        self.sched = pk.scheduler.Scheduler(self.bm, max_num_seqs=256, **sched_kw)
        self.rng = np.random.default_rng(seed)
        self.stem = self.rng.integers(1, 32000, 48)
        self.n = n
        self.next_id = 0
        self.elapsed = 0.0
        self.steps: list[float] = []
        for _ in range(256 // n):
            self.add()

    def add(self) -> None:
        r = self.rng
        body = r.integers(1, 32000, int(r.integers(16, 272)))
        prompt = np.concatenate((self.stem, body)) if r.random() < 0.5 else body
        self.sched.add_request(self.next_id, prompt, n=self.n, max_tokens=int(r.integers(64, 1024)),
                               eos_token_id=EOS)
        self.next_id += 1

    @staticmethod
    def sample(plan) -> list:
        out: list = []
        for pw in plan.prefills:
            toks = [(pw.seq_id * 7919 + pw.seq_len * 31 + k) % 32000 for k in range(pw.num_samples)]
            out.append(toks if pw.num_samples > 1 else (toks[0] if toks else None))
        d = plan.decode
        if d is not None:
            ids = d.seq_ids
            pos = d.positions + 1
            toks = (ids * 7919 + pos * 31) % 32000
            toks[(ids * 13 + pos) % 700 == 0] = EOS
            out.extend(toks.tolist())
        return out

    def step(self):
        s = self.sched
        t = time.perf_counter()
        plan = s.schedule()
        self.elapsed_schedule = time.perf_counter() - t
        sampled = self.sample(plan)
        t = time.perf_counter()
        finished = s.update(plan, sampled)
        dt = self.elapsed_schedule + time.perf_counter() - t
        self.elapsed += dt
        self.steps.append(dt)
        for _ in finished:
            self.add()
        return plan, finished


def digest(plan, finished) -> tuple:
    d = plan.decode
    return (
        None if d is None else (d.seq_ids.tobytes(), d.positions.tobytes(), d.input_tokens.tobytes(),
                                d.table_loads and tuple((a, b) for a, b, _ in d.table_loads)),
        tuple((p.seq_id, p.num_cached_tokens, p.seq_len, p.num_samples, p.table_row) for p in plan.prefills),
        tuple((p.request_id, p.seq_ids, p.mode) for p in plan.preempted),
        plan.copies.src.tobytes(), plan.copies.dst.tobytes(), plan.copy_on_write.tobytes(),
        tuple((f.request_id, f.outputs, f.finish_reasons) for f in finished),
    )


def ab(case: str, steps: int, other, repeats: int) -> tuple[float, float, float, float]:
    """Totals (ms) and median steps (us) of this tree and the other over ``repeats`` runs of the case; the tree
    built first and the tree stepped first alternate (an A/A run of one tree against itself shows a bias of a few
    percent for a fixed order)."""
    ta = tb = 0.0
    sa_steps: list[float] = []
    sb_steps: list[float] = []
    bm_kw, sched_kw, n = CASES[case]
    for rep in range(repeats):
        if rep % 2:
            b = Run(other, bm_kw, sched_kw, n)
            a = Run(this, bm_kw, sched_kw, n)
        else:
            a = Run(this, bm_kw, sched_kw, n)
            b = Run(other, bm_kw, sched_kw, n)
        gc.collect()
        for i in range(steps):
            if (i + rep) % 2:
                ra, rb = a.step(), b.step()
            else:
                rb, ra = b.step(), a.step()
            if digest(*ra) != digest(*rb):
                raise SystemExit(f"{case}: the trees' plans differ at step {i + 1}")
        sa, sb = a.sched.stats.as_dict(), b.sched.stats.as_dict()
        if sa != sb:
            raise SystemExit(f"{case}: the trees' statistics differ: {sa} vs {sb}")
        ta += a.elapsed
        tb += b.elapsed
        sa_steps += a.steps
        sb_steps += b.steps
    st = a.sched.stats
    print(f"  ({case}, per run: {st.decode_tokens} decode tokens, {st.prefills} prefills, {st.preemptions} "
          f"preemptions, {st.swap_outs} swap-outs, {st.prefill_chunks} chunks, {st.finished} finished)",
          file=sys.stderr)
    return ta * 1e3, tb * 1e3, float(np.median(sa_steps)) * 1e6, float(np.median(sb_steps)) * 1e6


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other_src")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2, help="runs per case (even: both orders equally)")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    other = load(args.other_src)
    import pagedkv_other.scheduler  # noqa: F401  (the other tree's scheduler, under its package name)
    import pagedkv.scheduler  # noqa: F401
    for case in args.cases:
        ta, tb, ma, mb = ab(case, args.steps, other, args.repeats)
        print(f"{case:26s} this {ta:8.1f} ms  other {tb:8.1f} ms  this/other {ta / tb:5.3f}   "
              f"median step this {ma:7.1f} us  other {mb:7.1f} us  ({ma / mb:5.3f})", flush=True)
