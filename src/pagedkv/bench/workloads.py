"""Workloads of the block-manager benchmark suite and the fake model that drives them.

Each replay workload is an offline throughput run: every request is queued at once, the scheduler
(:class:`pagedkv.scheduler.Scheduler`) admits prompts while they fit (``max_num_batched_tokens`` prefill tokens a
step), decodes every running sequence every step and preempts when memory runs out. The model is fake: the token
a sequence samples at position ``p`` is a seeded hash of (sequence id, ``p``), so every block-manager
implementation sees the same token stream whatever its scheduling, and a recomputed sequence regenerates exactly
the tokens it had. Requests ignore EOS and stop at ``max_tokens``.

The scale workload constructs pools and measures construction time and bookkeeping bytes per block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["Workload", "FakeModel", "build_workloads", "resolve_workloads", "WORKLOAD_GROUPS", "VOCAB_SIZE"]

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    kind: str = "replay"  # "replay" or "scale"
    num_requests: int = 0
    prompt_len: int = 0
    output_len: int = 0  # max_tokens per sample
    block_size: int = 16
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    prefix_caching: bool = False
    shared_prefix_len: int = 0
    n: int = 1
    preemption_mode: str = "recompute"
    num_lookahead_slots: int = 0
    sliding_window: int | None = None
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 2048
    scale_sizes: tuple = ()
    requires: frozenset = field(default_factory=frozenset)  # features the implementation needs

    def params(self) -> dict:
        d = asdict(self)
        d["requires"] = sorted(self.requires)
        d["scale_sizes"] = list(self.scale_sizes)
        return d

    def prompts(self, seed: int) -> np.ndarray:
        """(num_requests, prompt_len) int64 prompt tokens; the first ``shared_prefix_len`` are common to all."""
        rng = np.random.default_rng([seed, 0x5EED])
        p = rng.integers(1, VOCAB_SIZE, size=(self.num_requests, self.prompt_len), dtype=np.int64)
        if self.shared_prefix_len:
            p[:, : self.shared_prefix_len] = rng.integers(1, VOCAB_SIZE, size=self.shared_prefix_len, dtype=np.int64)
        return p


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


class FakeModel:
    """Deterministic sampling for a plan: the token at position ``p`` of sequence ``s`` is a seeded hash of
    (s, p); with ``num_lookahead_slots = k`` a decode accepts a hashed 0..k draft tokens plus one bonus token."""

    def __init__(self, seed: int = 0, *, num_lookahead_slots: int = 0, vocab_size: int = VOCAB_SIZE) -> None:
        self.k = num_lookahead_slots
        self.vocab = np.uint64(vocab_size - 1)
        base = _mix(np.array([seed], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))[0]
        self._tok_key = base
        self._acc_key = _mix(np.array([base ^ np.uint64(0xA5A5A5A5)], dtype=np.uint64))[0]

    def tokens(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        s = np.asarray(seq_ids, dtype=np.uint64)
        p = np.asarray(positions, dtype=np.uint64)
        h = _mix(_mix(s ^ self._tok_key) + p)
        return (h % self.vocab + np.uint64(1)).astype(np.int64)

    def accepted(self, seq_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        s = np.asarray(seq_ids, dtype=np.uint64)
        p = np.asarray(positions, dtype=np.uint64)
        h = _mix(_mix(s ^ self._acc_key) + p)
        return (h % np.uint64(self.k + 1)).astype(np.int64)

    def sample(self, plan) -> list:
        """Entries for :meth:`Scheduler.update`: prefills (in order) then decodes."""
        out: list = []
        for pw in plan.prefills:
            m = pw.num_samples
            if m == 1:
                out.append(int(self.tokens(np.array([pw.seq_id]), np.array([pw.seq_len]))[0]))
            else:  # samples are seq ids seq_id .. seq_id + m - 1
                ids = np.arange(pw.seq_id, pw.seq_id + m)
                out.append(self.tokens(ids, np.full(m, pw.seq_len)).tolist())
        d = plan.decode
        if d is None:
            return out
        seq_ids = d.seq_ids
        if len(d.positions) == len(seq_ids):
            nxt = d.positions + 1
        else:
            nxt = d.positions[np.cumsum(d.query_lens) - 1] + 1
        if not self.k:
            out.extend(self.tokens(seq_ids, nxt).tolist())
            return out
        acc = self.accepted(seq_ids, nxt)
        counts = acc + 1
        rep_ids = np.repeat(seq_ids, counts)
        offs = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        toks = self.tokens(rep_ids, np.repeat(nxt, counts) + offs).tolist()
        ends = np.cumsum(counts).tolist()
        start = 0
        for e in ends:
            out.append(toks[start:e])
            start = e
        return out


def build_workloads(quick: bool = False) -> dict[str, Workload]:
    """The suite, in run order. ``quick`` shrinks every size (for smoke tests)."""
    if quick:
        N, P, O, bs, budget, mns = 64, 64, 64, 16, 512, 128
    else:
        N, P, O, bs, budget, mns = 1000, 256, 256, 16, 2048, 1024
    per_seq = -(-(P + O) // bs)
    slack = 1024 if not quick else 64
    full = N * per_seq + slack
    common = dict(num_requests=N, prompt_len=P, output_len=O, block_size=bs, max_num_seqs=mns,
                  max_num_batched_tokens=budget)
    w: list[Workload] = [
        Workload("seed", f"{N} prompts x {P} + {O} tokens, every sequence fits", num_gpu_blocks=full, **common),
        Workload("constrained-recompute", "a quarter of the seed pool; preemption by recompute",
                 num_gpu_blocks=full // 4, **common),
        Workload("constrained-swap", "a quarter of the seed pool; preemption by swap to a CPU pool (recompute "
                 "when it is full)", num_gpu_blocks=full // 4, num_cpu_blocks=full // 4,
                 preemption_mode="swap", requires=frozenset({"swap"}), **common),
        Workload("prefix-shared", f"prefix caching, a {P * 200 // 256}-token prefix shared by all prompts",
                 num_gpu_blocks=full, prefix_caching=True, shared_prefix_len=P * 200 // 256,
                 requires=frozenset({"prefix_caching"}), **common),
        Workload("prefix-none", "prefix caching on, no shared prefix (pure overhead)", num_gpu_blocks=full,
                 prefix_caching=True, requires=frozenset({"prefix_caching"}), **common),
    ]
    n4 = dict(common, num_requests=N // 4, prompt_len=P - 6 if not quick else P - 4)
    w.append(Workload("parallel-n4", f"n=4 parallel samples of {n4['prompt_len']}-token prompts (fork, "
                      "copy-on-write of the shared partial block)", num_gpu_blocks=full, n=4,
                      requires=frozenset({"fork"}), **n4))
    k = 4
    w.append(Workload("spec-decode", f"speculative decoding: {k} lookahead slots, 0..{k} drafts accepted "
                      "(ragged append)", num_gpu_blocks=N * -(-(P + O + k) // bs) + slack,
                      num_lookahead_slots=k, requires=frozenset({"lookahead"}), **common))
    if quick:
        win, total, nseq = 128, 1024, 2
    else:
        win, total, nseq = 4096, 32768, 8
    sw = dict(num_requests=nseq, prompt_len=win, output_len=total - win, block_size=bs, max_num_seqs=mns,
              max_num_batched_tokens=budget)
    w.append(Workload("sliding-window", f"sliding window {win}, {nseq} sequences of {total} tokens",
                      num_gpu_blocks=nseq * (win // bs + 16) + 64, sliding_window=win,
                      requires=frozenset({"sliding_window"}), **sw))
    w.append(Workload("scale", "pool construction time and bookkeeping bytes per block", kind="scale",
                      block_size=bs, scale_sizes=(10_000,) if quick else (100_000, 1_000_000)))
    return {x.name: x for x in w}


WORKLOAD_GROUPS = {
    "constrained": ("constrained-recompute", "constrained-swap"),
    "prefix": ("prefix-shared", "prefix-none"),
}


def resolve_workloads(names: list[str] | None, quick: bool = False) -> list[Workload]:
    """Workloads by name (or group name: ``constrained``, ``prefix``); all when ``names`` is empty."""
    allw = build_workloads(quick)
    if not names:
        return list(allw.values())
    out: list[Workload] = []
    for name in names:
        keys = WORKLOAD_GROUPS.get(name, (name,))
        for key in keys:
            if key not in allw:
                raise KeyError(f"unknown workload {name!r}; known: {', '.join([*allw, *WORKLOAD_GROUPS])}")
            if allw[key] not in out:
                out.append(allw[key])
    return out
