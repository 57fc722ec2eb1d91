"""In-process A/B of ``allocate`` and ``decode_step`` between this tree's pagedkv and another checkout's, loaded
side by side under another package name, alternating call for call (the fairest comparison on a noisy machine)::

    PYTHONPATH=src .venv/bin/python benchmarks/ab_inproc.py /path/to/main/src

Prints, per case, the median microseconds of each tree and the ratio this / other. Cases: allocate of one
prompt of 200-299 tokens (blocks of 16, prefix caching on; half of it a hit), and decode_step of one token per
sequence at batch 1, 4, 16, 64 and 1000, prefix caching off and on. ``--hybrid`` adds HybridBlockManager's
decode_step (one full-attention group and five sliding-window groups of 64 tokens) at batch 1 to 256, and its
allocate with a prefix hit of 1024, 4096 and 16384 tokens (a conversation's next turn: the cached stem plus 256
new tokens; one full-attention group and five sliding-window groups of 512 tokens, as Gemma 3; each sequence freed
untimed after its allocation).
"""

from __future__ import annotations

import importlib.util
import sys
import time

import numpy as np

import pagedkv as this


def load(src: str, name: str = "pagedkv_other"):
    spec = importlib.util.spec_from_file_location(name, f"{src}/pagedkv/__init__.py",
                                                  submodule_search_locations=[f"{src}/pagedkv"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def alloc_case(pk, rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, 32000, 160).tolist()
    prompts = [stem + rng.integers(0, 32000, int(rng.integers(40, 140))).tolist() for _ in range(rounds)]
    bm = pk.BlockManager(rounds * 24 + 64, 16, enable_prefix_caching=True)
    bm.allocate("warm", stem + [1])
    it = iter(range(rounds))

    def one():
        i = next(it)
        t = time.perf_counter()
        bm.allocate(i, prompts[i])
        return time.perf_counter() - t
    return one


def _decode_case(m, batch: int, rounds: int, rng):
    """Timed decode steps of ``batch`` sequences of 200-299 prompt tokens on manager ``m``."""
    ids = list(range(batch))
    for i in ids:
        m.allocate(i, rng.integers(0, 32000, int(rng.integers(200, 300))).tolist())
    toks = rng.integers(0, 32000, (rounds, batch))
    it = iter(range(rounds))

    def one():
        s = next(it)
        t = time.perf_counter()
        m.decode_step(ids, toks[s])
        return time.perf_counter() - t
    return one


def step_case(pk, batch: int, caching: bool, rounds: int, seed: int = 0):
    bm = pk.BlockManager(batch * 40 + 64, 16, enable_prefix_caching=caching)
    return _decode_case(bm, batch, rounds, np.random.default_rng(seed))


def hybrid_case(pk, batch: int, caching: bool, rounds: int, seed: int = 0):
    groups = [pk.FullAttentionSpec()] + [pk.SlidingWindowSpec(64)] * 5
    m = pk.HybridBlockManager(batch * 6 * 24 + 256, 16, kv_cache_groups=groups, enable_prefix_caching=caching)
    return _decode_case(m, batch, rounds, np.random.default_rng(seed))


def hybrid_alloc_case(pk, hit: int, rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = [pk.FullAttentionSpec()] + [pk.SlidingWindowSpec(512)] * 5
    n = hit + 256
    m = pk.HybridBlockManager(6 * (n // 16 + 2) * 3 + 512, 16, kv_cache_groups=groups, enable_prefix_caching=True)
    stem = rng.integers(0, 32000, hit).tolist()
    m.allocate("warm", stem + [1])
    m.free("warm")
    prompts = [stem + rng.integers(0, 32000, 256).tolist() for _ in range(rounds)]
    it = iter(range(rounds))

    def one():
        i = next(it)
        t = time.perf_counter()
        m.allocate(i, prompts[i])
        t = time.perf_counter() - t
        m.free(i)
        return t
    return one


def ab(make, rounds: int, other) -> tuple[float, float]:
    a, b = make(this, rounds), make(other, rounds)
    ta, tb = [], []
    for i in range(rounds):  # alternate which goes first
        if i % 2:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    return float(np.median(ta)) * 1e6, float(np.median(tb)) * 1e6


if __name__ == "__main__":
    other = load(sys.argv[1])
    rows = [("allocate", ab(lambda pk, r: alloc_case(pk, r), 400, other))]
    for batch in (1, 4, 16, 64, 1000):
        for caching in (False, True):
            n = 300 if batch < 1000 else 150
            rows.append((f"decode_step B{batch}/{'on' if caching else 'off'}",
                         ab(lambda pk, r: step_case(pk, batch, caching, r), n, other)))
    if "--hybrid" in sys.argv[2:]:
        for batch in (1, 4, 16, 64, 256):
            for caching in (False, True):
                rows.append((f"hybrid step B{batch}/{'on' if caching else 'off'}",
                             ab(lambda pk, r: hybrid_case(pk, batch, caching, r), 300, other)))
        for hit in (1024, 4096, 16384):
            rows.append((f"hybrid allocate hit {hit}", ab(lambda pk, r: hybrid_alloc_case(pk, hit, r), 200, other)))
    for name, (t, o) in rows:
        print(f"{name:24s} this {t:8.2f} us   other {o:8.2f} us   this/other {t / o:5.2f}")
