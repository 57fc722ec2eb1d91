"""When is loading a KV block from a storage tier faster than computing it? (issue 24, item 2)

For each model (SmolLM2-135M, Gemma 3 270M; float32 KV as the reference engine keeps it):

1. one block's KV bytes, from the model's config (``kv_cache_bytes_per_block``; for Gemma 3 the block of all
   its layers, and of its full-attention group alone: a long prompt's sliding groups need only their window);
2. the engine's prefill time per block: ``LLM.generate`` of a ``--prompt-len``-token random prompt, one output
   token, prefix caching off (the engine's default chunked prefill), the median of ``--prefill-repeats`` prompts;
3. the time to load one block from each backend (disk, shared directory, Redis on 127.0.0.1): ``get_many`` of a
   prompt's blocks in one call, the value checked (header + xxh3 checksum), the payload copied into a
   preallocated KV array; the median of ``--repeats`` passes. The disk and shared-directory figures come twice:
   *cold* (each file's pages dropped from the page cache with ``posix_fadvise(DONTNEED)`` before the pass: the
   device is read) and *warm* (the page cache). A single block per call is timed too (the latency a short
   prefix pays);
4. the ratio load / compute per block in the same run, and the crossover bandwidth: the rate at which a tier
   must deliver KV bytes for loading to beat computing them (bytes per block / compute time per block).

Run (minutes: the prefills dominate; the machine is shared, so its load average is printed with the figures)::

    PYTHONPATH=src python benchmarks/tier_crossover.py [--prompt-len 2048] [--prefill-repeats 3] [--repeats 5] \\
        [--json out.json]
    PYTHONPATH=src python benchmarks/tier_crossover.py --show benchmarks/results/tier_crossover.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import pagedkv
from pagedkv.tiers import BlockStore, DiskBackend, ModelFingerprint, PutStatus, RedisBackend, SharedDirBackend
from pagedkv.tiers import _files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tier_common import RedisServer  # noqa: E402


def prefill_ms_per_block(model: str, prompt_len: int, repeats: int, block_size: int) -> tuple[object, float]:
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, block_size=block_size, max_num_seqs=4)
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    llm.generate([{"prompt_token_ids": rng.integers(100, vocab, 16).tolist()}], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        p = {"prompt_token_ids": rng.integers(100, vocab, prompt_len).tolist()}
        t0 = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return llm, 1e3 * statistics.median(times) / (prompt_len / block_size)


def _drop_cache(root: str) -> None:
    for p in Path(root).rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _time_loads(store: BlockStore, keys: list[int], kv: np.ndarray, repeats: int, cold_root: str | None):
    """(batch ms per block, single-block ms per call): get_many + checks + copy into ``kv``."""
    def one_pass(ks):
        t0 = time.perf_counter()
        r = store.get_many(ks)
        for i, v in enumerate(r.values):
            kv[i] = np.frombuffer(v, dtype=kv.dtype).reshape(kv.shape[1:])
        dt = time.perf_counter() - t0
        assert r.hit_prefix == len(ks), r.statuses
        return dt

    batch, single = [], []
    for _ in range(repeats):
        if cold_root:
            _drop_cache(cold_root)
        batch.append(one_pass(keys) / len(keys))
    for k in keys[:32]:
        if cold_root:
            _drop_cache(cold_root)
        single.append(one_pass([k]))
    return 1e3 * statistics.median(batch), 1e3 * statistics.median(single)


def measure_backends(block_bytes: int, n_blocks: int, repeats: int, fp: ModelFingerprint, tmp: str,
                     redis_url: str | None) -> dict:
    keys = pagedkv.block_hashes(np.arange(n_blocks * fp.block_size) % 50000, fp.block_size, "bench")
    rng = np.random.default_rng(1)
    payloads = [rng.standard_normal(block_bytes // 4).astype(np.float32) for _ in range(n_blocks)]
    kv = np.empty((n_blocks, block_bytes // 4), np.float32)
    out = {}
    backends = [("disk", lambda: DiskBackend(os.path.join(tmp, f"disk{block_bytes}"), 64 << 30), True),
                ("shared_dir", lambda: SharedDirBackend(os.path.join(tmp, f"shared{block_bytes}")), True)]
    if redis_url:
        backends.append(("redis", lambda: RedisBackend(redis_url, prefix=f"bench{block_bytes}:",
                                                       socket_timeout=10.0), False))
    for name, make, on_disk in backends:
        b = make()
        s = BlockStore(b, fp, payload_bytes=block_bytes)
        t0 = time.perf_counter()
        got = s.put_many(keys, payloads, namespace="bench")
        store_ms = 1e3 * (time.perf_counter() - t0) / n_blocks
        assert all(g is PutStatus.STORED for g in got), got
        s_ns = _Ns(s, "bench")
        row = {"store_ms_per_block": store_ms}
        if on_disk:
            root = b.path
            row["cold_batch_ms"], row["cold_single_ms"] = _time_loads(s_ns, keys, kv, repeats, root)
        row["warm_batch_ms"], row["warm_single_ms"] = _time_loads(s_ns, keys, kv, repeats, None)
        out[name] = row
        b.close()
    # the floor: the same checks and copy from bytes already in memory (no backend)
    from pagedkv.tiers import codec

    names = s.names(keys, "bench")
    values = [codec.encode(fp.digest, n, p) for n, p in zip(names, payloads)]
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i, (n, v) in enumerate(zip(names, values)):
            kv[i] = np.frombuffer(codec.decode(v, fp.digest, n)[1], np.float32)
        t.append((time.perf_counter() - t0) / n_blocks)
    out["memory (decode + copy only)"] = {"warm_batch_ms": 1e3 * statistics.median(t)}
    return out


class _Ns:
    """A BlockStore bound to a namespace (what _time_loads calls)."""

    def __init__(self, s, ns):
        self.s, self.ns = s, ns

    def get_many(self, ks):
        return self.s.get_many(ks, self.ns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5, help="passes of each load measurement")
    ap.add_argument("--prefill-repeats", type=int, default=3, help="prompts prefilled (the median is kept)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--show", default=None, help="print the figures of a saved --json file and exit")
    a = ap.parse_args(argv)
    if a.show:
        _print(json.loads(Path(a.show).read_text()))
        return 0
    tmp = tempfile.mkdtemp(prefix="pagedkv-tiers-")
    redis_srv = RedisServer(tmp)
    url = redis_srv.url
    results = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
               "prompt_len": a.prompt_len, "block_size": a.block_size, "prefill_repeats": a.prefill_repeats,
               "repeats": a.repeats, "models": {}}
    try:
        for model in a.models.split(","):
            llm, compute_ms = prefill_ms_per_block(model, a.prompt_len, a.prefill_repeats, a.block_size)
            m = llm.model
            grouped = llm.kv_cache_groups is not None
            per_id = m.kv_cache_bytes_per_block(a.block_size, grouped=grouped)
            n_groups = len(llm.kv_cache_groups) if grouped else 1
            block_bytes = per_id * n_groups  # every layer's K and V of block_size tokens
            c = m.config
            layout = f"L{c.n_layer},2,B{a.block_size},H{c.n_head_kv},D{c.head_dim}"
            fp = ModelFingerprint(model, "float32", a.block_size, layout)
            n_blocks = a.prompt_len // a.block_size
            backends = measure_backends(block_bytes, n_blocks, a.repeats, fp, tmp, url)
            row = {"block_bytes_all_layers": block_bytes, "block_bytes_per_group": per_id if grouped else None,
                   "kv_cache_groups": n_groups, "compute_ms_per_block": compute_ms,
                   "crossover_MBps": block_bytes / 1e6 / (compute_ms / 1e3), "backends": backends}
            if grouped:
                row["crossover_MBps_full_group_only"] = per_id / 1e6 / (compute_ms / 1e3)
            results["models"][model] = row
            del llm, m
    finally:
        redis_srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()
    _print(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


def _print(r: dict) -> None:
    print(f"# {r['machine']}, {r['cpus']} CPUs, load average {r['load_avg_start'][0]:.1f} -> "
          f"{r['load_avg_end'][0]:.1f}; prompt {r['prompt_len']} tokens, block {r['block_size']} tokens, float32 KV")
    for model, m in r["models"].items():
        kib = m["block_bytes_all_layers"] / 1024
        extra = (f" ({m['kv_cache_groups']} KV cache groups of {m['block_bytes_per_group'] / 1024:.0f} KiB)"
                 if m["block_bytes_per_group"] else "")
        print(f"\n## {model}: one block = {kib:.0f} KiB{extra}; prefill {m['compute_ms_per_block']:.2f} ms per "
              f"block -> loading wins above {m['crossover_MBps']:.2f} MB/s")
        if "crossover_MBps_full_group_only" in m:
            print(f"   (loading only the full-attention group's block: above {m['crossover_MBps_full_group_only']:.2f}"
                  f" MB/s)")
        print(f"{'backend':28s} {'load ms/block':>14s} {'x compute':>10s} {'1-block call ms':>16s} "
              f"{'store ms/block':>15s}")
        for name, b in m["backends"].items():
            for temp in ("cold", "warm"):
                if f"{temp}_batch_ms" not in b:
                    continue
                ms = b[f"{temp}_batch_ms"]
                single = b.get(f"{temp}_single_ms")
                store = b.get("store_ms_per_block") if temp == "warm" else None
                label = name if name.startswith("memory") else f"{name} ({temp})"
                print(f"{label:28s} {ms:14.3f} {ms / m['compute_ms_per_block']:10.3f} "
                      f"{'' if single is None else f'{single:.3f}':>16s} "
                      f"{'' if store is None else f'{store:.3f}':>15s}")


if __name__ == "__main__":
    sys.exit(main())
