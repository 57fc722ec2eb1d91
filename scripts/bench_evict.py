"""Eviction policies and the manager's hot path: an A/B against a baseline checkout in ONE process.

    git -C /path/to/repo archive BASE_COMMIT src/pagedkv | tar -x -C /tmp/evict_base   # the baseline's package
    PYTHONPATH=src python scripts/bench_evict.py --baseline /tmp/evict_base/src/pagedkv

Cases: (1) under each eviction policy, a churn of requests (allocate a prompt that hits a cached document, set a
session hint, free) on a pool that holds a fraction of the documents, so most allocates evict; (2) decode_step at
batch 1 and 256 with prefix caching on; (3) allocate with hits (a 512-token prompt sharing its first half); (4)
the LRU evictor alone (push / pop one block, and batches). The baseline package is imported as ``pagedkv_base``
(the core uses relative imports only); measurements alternate A, B, A, B ... and the report gives the median of
the per-round ratios (new / baseline: 1.00 = unchanged). Times are this thread's CPU time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

_clock = time.thread_time


from bench_groups import decode_case as _groups_decode, load_baseline  # noqa: E402 - (scripts/ is on a script's path)


def _workload(n_req: int, n_docs: int = 160, doc_len: int = 128, tail: int = 20):
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 30000, doc_len).tolist() for _ in range(n_docs)]
    pick = np.minimum(rng.zipf(1.3, n_req) - 1, n_docs - 1)
    return [(int(d), docs[d] + rng.integers(0, 30000, tail).tolist()) for d in pick]


WORK = _workload(600)


def churn_case(mod, policy: str, reps: int = 3) -> float:
    """Seconds per request (allocate with a hit, session hint, free) under ``policy`` on a pool of 400 blocks of
    16 tokens (about a third of the documents fit): the best of ``reps`` fresh managers."""
    best = float("inf")
    for _ in range(reps):
        m = mod.BlockManager(400, 16, enable_prefix_caching=True, eviction_policy=policy, watermark=0)
        t0 = _clock()
        for i, (d, p) in enumerate(WORK):
            m.allocate(i, p)
            getattr(m, "retention", m).set_retention(i, session=d)  # (a baseline tree: the old spelling)
            m.free(i)
        best = min(best, (_clock() - t0) / len(WORK))
    return best


def decode_case(mod, batch: int, steps: int = 0, ctx: int = 100, reps: int = 3) -> float:
    """Seconds per decode_step of ``batch`` sequences (one token each), prefix caching on: the best of ``reps``
    runs (scripts/bench_groups.py's case)."""
    return _groups_decode(mod, batch, True, steps or max(32, 2048 // batch), ctx, reps)


def fork_case(mod, n: int = 200, reps: int = 3) -> float:
    """Seconds per fork + free of a 100-token sequence (the plain-Python fork_row and free_small), best of
    ``reps``."""
    m = mod.BlockManager(64, 16, enable_prefix_caching=True, watermark=0)
    m.allocate("p", list(range(100)))
    best = float("inf")
    for _ in range(reps):
        t0 = _clock()
        for i in range(n):
            m.fork("p", i)
            m.free(i)
        best = min(best, (_clock() - t0) / n)
    return best


def allocate_case(mod, n: int = 64, plen: int = 512, reps: int = 3) -> float:
    """Seconds per allocate of a ``plen``-token prompt sharing its first half with the previous ones (best of
    ``reps`` managers)."""
    bs = 16
    best = float("inf")
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 30000, plen // 2).tolist()
    prompts = [shared + rng.integers(0, 30000, plen - plen // 2).tolist() for _ in range(n)]
    for _ in range(reps):
        m = mod.BlockManager(n * (plen // bs + 2) + 16, bs, enable_prefix_caching=True, watermark=0)
        t0 = _clock()
        for i, p in enumerate(prompts):
            m.allocate(i, p)
        best = min(best, (_clock() - t0) / n)
    return best


def lru_case(mod, batch: bool, n: int = 4096, reps: int = 3) -> float:
    return min(_lru_once(mod, batch, n) for _ in range(reps))


def _lru_once(mod, batch: bool, n: int) -> float:
    from importlib import import_module

    lru = import_module(mod.__name__ + ".blocks.evictor").LRUEvictor(n)
    rng = np.random.default_rng(3)
    order = rng.permutation(n)
    t0 = _clock()
    if batch:
        for a in range(0, n, 64):
            lru.push_many(order[a : a + 64].astype(np.int32))
        for _ in range(n // 64):
            lru.discard_many(lru.pop_many(32).astype(np.int64)[:0])
            lru.push_many(lru.pop_many(32))
        lru.pop_many(len(lru))
    else:
        for b in order.tolist():
            lru.push(b)
        for _ in range(n):
            lru.push(lru.pop())
        for b in order.tolist():
            lru.discard(b)
    return (_clock() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    import pagedkv as new

    base = load_baseline(args.baseline)
    cases = [(f"churn {p}", lambda mod, p=p: churn_case(mod, p)) for p in new.EVICTION_POLICIES]
    cases += [(f"decode_step batch {b}, caching on", lambda mod, b=b: decode_case(mod, b)) for b in (1, 8, 256)]
    cases += [("fork + free (small path)", fork_case)]
    cases += [("allocate 512 tokens, 256 hit", allocate_case)]
    cases += [("LRU push/pop one block", lambda mod: lru_case(mod, False)),
              ("LRU push_many/pop_many", lambda mod: lru_case(mod, True))]
    print(f"{'case':36s} {'new us':>9s} {'base us':>9s} {'ratio':>6s}  (median of {args.rounds} rounds)")
    for name, fn in cases:
        if args.only not in name:
            continue
        fn(new), fn(base)  # warm-up
        ratios, tn, tb = [], [], []
        for _ in range(args.rounds):
            gc.collect()
            a = fn(new)
            gc.collect()
            b = fn(base)
            tn.append(a)
            tb.append(b)
            ratios.append(a / b)
        print(f"{name:36s} {1e6 * statistics.median(tn):9.2f} {1e6 * statistics.median(tb):9.2f} "
              f"{statistics.median(ratios):6.3f}", flush=True)


if __name__ == "__main__":
    main()
