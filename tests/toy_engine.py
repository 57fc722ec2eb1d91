"""A toy engine written against pagedkv's public API and docs/engine-contract.md only (no private attribute).

A tiny random transformer in numpy (float64; embeddings plus absolute sinusoidal positions, pre-norm attention
and MLP blocks, tied output), its KV in paged stores indexed by slot (``block_id * block_size + offset``), and a
step driver that uses every feature of the block manager: batched prefill with burst sharing
(``allocate_batch``), a token budget from ``lookup_prefix``, forks with copy-on-write (parallel sampling),
swap and recompute preemption, the CPU tier of the prefix cache, lookahead slots with speculative tokens
(accepted and rejected), a sliding window, namespaces and fixed-width block tables. Every logit the paged
engine computes is recorded with its context, and :func:`check_against_reference` recomputes each one without
paging (plain causal attention over the whole context): equal within float64 rounding, or the KV was wrong.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from pagedkv import NULL_BLOCK, BlockManager
from pagedkv.errors import OutOfBlocksError


# ---------------------------------------------------------------------------------------------------- model
class ToyModel:
    """L layers, H heads of size Dh, vocabulary V, width D; random weights from ``seed``.

    ``windows``: the attention of each KV cache group, in group order (None: full attention, W: a sliding window
    of W tokens, a query at p seeing ``(p - W, p]``); layer ``l`` belongs to group ``l % len(windows)`` (at least
    one layer per group). ``window=W`` is ``windows=(W,)``."""

    def __init__(self, seed: int = 0, V: int = 16, D: int = 16, L: int = 2, H: int = 2, Dh: int = 8,
                 window: int | None = None, windows: tuple | None = None) -> None:
        g = np.random.default_rng(seed)
        self.windows = tuple(windows) if windows is not None else (window,)
        L = max(L, len(self.windows))
        self.V, self.D, self.L, self.H, self.Dh = V, D, L, H, Dh
        self.window = self.windows[0] if len(self.windows) == 1 else None  # (the one group's, for old callers)
        self.group_of = [l % len(self.windows) for l in range(L)]
        self.emb = g.normal(0, 1, (V, D))
        s = 1 / np.sqrt(D)
        self.wq = g.normal(0, s, (L, D, H * Dh))
        self.wk = g.normal(0, s, (L, D, H * Dh))
        self.wv = g.normal(0, s, (L, D, H * Dh))
        self.wo = g.normal(0, 1 / np.sqrt(H * Dh), (L, H * Dh, D))
        self.w1 = g.normal(0, s, (L, D, 2 * D))
        self.w2 = g.normal(0, 1 / np.sqrt(2 * D), (L, 2 * D, D))

    @staticmethod
    def _norm(x):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    def _embed(self, tokens, positions):
        i = np.arange(self.D // 2)
        ang = np.asarray(positions, dtype=np.float64)[:, None] / (50.0 ** (2 * i / self.D))
        return self.emb[tokens] + np.concatenate((np.sin(ang), np.cos(ang)), axis=1)

    def _qkv(self, l, x):
        h = self._norm(x)
        T = x.shape[0]
        shape = (T, self.H, self.Dh)
        return (h @ self.wq[l]).reshape(shape), (h @ self.wk[l]).reshape(shape), (h @ self.wv[l]).reshape(shape)

    def _attend(self, q, qpos, k, v, kpos, window):
        """q (T, H, Dh) at positions qpos over k/v (S, H, Dh) at kpos: causal, sliding window if any."""
        sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.Dh)
        ok = kpos[None, :] <= qpos[:, None]
        if window is not None:
            ok &= kpos[None, :] > qpos[:, None] - window
        sc = np.where(ok[None], sc, -np.inf)
        sc -= sc.max(-1, keepdims=True)
        p = np.exp(sc)
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, v).reshape(q.shape[0], -1)

    def _mlp(self, l, x, a):
        x = x + a @ self.wo[l]
        return x + np.maximum(self._norm(x) @ self.w1[l], 0) @ self.w2[l]

    def reference(self, tokens) -> np.ndarray:
        """Logits (T, V) of every position of ``tokens``, without paging."""
        tokens = np.asarray(tokens)
        pos = np.arange(tokens.size)
        x = self._embed(tokens, pos)
        for l in range(self.L):
            q, k, v = self._qkv(l, x)
            x = self._mlp(l, x, self._attend(q, pos, k, v, pos, self.windows[self.group_of[l]]))
        return self._norm(x) @ self.emb.T

    def paged_forward(self, kv: "KVStore", segs: list) -> list[np.ndarray]:
        """One forward over a batch of segments ``(tokens, positions, slots, block_tables)``: ``slots`` (G, q)
        and ``block_tables`` G tables, group g's for the layers of group g (one group: ``slots`` (q,) and one
        table are accepted too). Per layer, the K/V of every token of the batch are written through the layer's
        group's slots first, then each segment attends by reading its context back through that group's block
        table (the engine contract). Returns each segment's logits."""
        segs = [(t, p, np.asarray(sl).reshape(-1, len(t)), tb if np.asarray(sl).ndim == 2 else (tb,))
                for t, p, sl, tb in segs]
        toks = np.concatenate([s[0] for s in segs])
        pos = np.concatenate([s[1] for s in segs])
        slots = np.concatenate([s[2] for s in segs], axis=1)
        bounds = np.cumsum([0] + [len(s[0]) for s in segs])
        x = self._embed(toks, pos)
        bs = kv.block_size
        for l in range(self.L):
            g = self.group_of[l]
            window = self.windows[g]
            q, k, v = self._qkv(l, x)
            kv.k[l, slots[g]] = k  # the whole batch's K/V first ...
            kv.v[l, slots[g]] = v
            out = np.empty((x.shape[0], self.H * self.Dh))
            for (_, p, _, tables), a, z in zip(segs, bounds[:-1], bounds[1:]):
                lo = 0 if window is None else max(0, int(p[0]) - window + 1)
                kpos = np.arange(lo, int(p[-1]) + 1)
                blocks = np.asarray(tables[g])[kpos // bs]
                assert (blocks != NULL_BLOCK).all(), "a visible position's block was released"
                ks = blocks.astype(np.int64) * bs + kpos % bs  # ... then attention reads through the table
                out[a:z] = self._attend(q[a:z], p, kv.k[l, ks], kv.v[l, ks], kpos, window)
            x = self._mlp(l, x, out)
        logits = self._norm(x) @ self.emb.T
        return [logits[a:z] for a, z in zip(bounds[:-1], bounds[1:])]


class KVStore:
    """K and V of every layer for one device: ``(L, num_blocks * block_size, H, Dh)``, row = slot."""

    def __init__(self, model: ToyModel, num_blocks: int, block_size: int) -> None:
        shape = (model.L, max(num_blocks, 1) * block_size, model.H, model.Dh)
        self.block_size = block_size
        self.k = np.full(shape, np.nan)  # never-written slots poison any read of them
        self.v = np.full(shape, np.nan)

    def blocks(self, which):
        bs = self.block_size
        return which.reshape(which.shape[0], -1, bs, *which.shape[2:])


def copy_blocks(src: KVStore, dst: KVStore, pairs) -> None:
    """Copy whole blocks (src block, dst block) from one store to another (or within one)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if pairs.size:
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            sb, db = src.blocks(a), dst.blocks(b)
            db[:, pairs[:, 1]] = sb[:, pairs[:, 0]]


def run_copies(gpu: KVStore, cpu: KVStore, plan) -> None:
    """Execute one step's copy plan (``bm.take_copy_plan()``) in its order, run by run: each run is one
    gather-then-scatter of whole blocks (GPU -> CPU: swap-outs and CPU-tier demotions; CPU -> GPU: swap-ins and
    promotions; GPU -> GPU: copy-on-write)."""
    from pagedkv import CopyKind

    stores = {CopyKind.GPU_TO_CPU: (gpu, cpu), CopyKind.CPU_TO_GPU: (cpu, gpu), CopyKind.GPU_TO_GPU: (gpu, gpu)}
    for kind, src, dst in plan.batches():
        a, b = stores[CopyKind(kind)]
        copy_blocks(a, b, np.stack((np.asarray(src), np.asarray(dst)), axis=1))


# ---------------------------------------------------------------------------------------------------- driver
@dataclass
class Seq:
    sid: str
    req: "Request"
    index: int  # sample index (0: the parent)
    tokens: list  # tokens appended to the block manager (prompt included)
    pending: list = field(default_factory=list)  # sampled, not appended yet (its KV is computed next step)
    status: str = "waiting"  # waiting, running, swapped, done


@dataclass
class Request:
    rid: str
    prompt: list
    n: int
    max_new: int
    namespace: object
    seqs: list = field(default_factory=list)


class ToyEngine:
    """Continuous batching over a BlockManager. ``lookahead`` > 0: speculative decoding with that many draft
    tokens per step (drafts from an oracle that is right with probability ``p_draft``, so some are accepted and
    some rejected). Parallel samples (``n`` > 1) are sampled with a per-sample perturbation of the logits."""

    def __init__(self, model: ToyModel, bm: BlockManager, *, lookahead: int = 0, swap: bool = True,
                 token_budget: int = 64, p_draft: float = 0.6, seed: int = 0) -> None:
        self.m, self.bm, self.k, self.swap, self.budget = model, bm, lookahead, swap, token_budget
        self.gpu = KVStore(model, bm.num_gpu_blocks, bm.block_size)
        self.cpu = KVStore(model, bm.num_cpu_blocks, bm.block_size)
        self.rng = random.Random(seed)
        self.p_draft = p_draft
        self.waiting: list[Seq] = []  # (prefill queue, oldest first; a forked request waits as its parent)
        self.running: list[Seq] = []  # admission order
        self.swapped: list[list[Seq]] = []  # groups, oldest first
        self.records: list[tuple[tuple, np.ndarray]] = []  # (context tokens, logits of its last position)
        self.counts = dict(steps=0, prefill_tokens=0, cached_tokens=0, predicted_cached=0, swap_outs=0,
                           swap_ins=0, recomputes=0, drafts_accepted=0, drafts_rejected=0, forks=0,
                           window_nulls=0, burst_shared=0)
        self.finished: dict[str, list[list[int]]] = {}

    # -------------------------------------------------------------- requests and sampling
    def add(self, rid: str, prompt: list, n: int = 1, max_new: int = 8, namespace: object = None) -> None:
        r = Request(rid, list(prompt), n, max_new, namespace)
        r.seqs.append(Seq(f"{rid}/0", r, 0, list(prompt)))
        self.waiting.append(r.seqs[0])

    def sample(self, logits: np.ndarray, index: int, pos: int) -> int:
        if index:  # parallel samples differ: a deterministic perturbation per (sample, position)
            logits = logits + np.random.default_rng(index * 100_003 + pos).gumbel(size=logits.shape)
        return int(np.argmax(logits))

    def _draft(self, s: Seq) -> list[int]:
        """``k`` draft tokens after ``s``'s tokens and pending ones: each the model's own choice with probability
        p_draft (from a non-paged oracle), else a random token."""
        ctx = s.tokens + s.pending
        out = []
        for _ in range(self.k):
            if self.rng.random() < self.p_draft:
                t = self.sample(self.m.reference(ctx + out)[-1], s.index, len(ctx) + len(out))
            else:
                t = self.rng.randrange(self.m.V)
            out.append(t)
        return out

    def _generated(self, s: Seq) -> int:
        return len(s.tokens) + len(s.pending) - len(s.req.prompt)

    # -------------------------------------------------------------- one step
    def step(self) -> None:
        """One step: a swap-in step does nothing else and a step that preempts admits nothing (a simple
        scheduling policy; the copy plan is safe for any mix of calls, which tests/test_kv_content.py checks)."""
        bm = self.bm
        self.counts["steps"] += 1
        if self.swapped:
            group = self.swapped[0]
            ids = [s.sid for s in group]
            if bm.can_swap_in(ids, self.k).name == "OK":
                self.swapped.pop(0)
                pairs = bm.swap_in(ids)
                for s in group:
                    s.status = "running"
                self.running.extend(group)
                self.counts["swap_ins"] += 1
                del pairs  # (the same copies are in the step's plan)
                run_copies(self.gpu, self.cpu, bm.take_copy_plan())
                return
        swap_out: list = []
        decode, preempted = self._decode(swap_out)
        prefill = [] if preempted or self.swapped else self._admit()
        run_copies(self.gpu, self.cpu, bm.take_copy_plan())
        segs, owners = [], []
        if prefill:
            res, seqs = prefill
            q = res.query_start_loc
            for i, s in enumerate(seqs):
                a, z = int(q[i]), int(q[i + 1])
                segs.append((res.token_ids[a:z], res.positions[a:z], res.slot_mapping[a:z], res.block_tables[i]))
                owners.append((s, "prefill", 0))
        if decode:
            for seg, own in zip(*decode[0]):
                segs.append(seg)
                owners.append(own)
        if not segs:
            return
        for (s, kind, ndraft), seg, logits in zip(owners, segs, self.m.paged_forward(self.gpu, segs)):
            base = int(seg[1][0])
            ctx = s.tokens[:base] + [int(t) for t in seg[0]]
            for j in range(len(seg[0])):
                self.records.append((tuple(ctx[: base + j + 1]), logits[j]))
            if kind == "prefill":
                s.pending = [self.sample(logits[-1], s.index, len(s.tokens))]
                self._maybe_fork(s, logits[-1])
            else:
                self._accept(s, seg, logits, ndraft)
            if self._generated(s) >= s.req.max_new:
                self._finish(s)

    def _decode(self, swap_out: list):
        """decode_step over every running sequence (their pending tokens, plus ``k`` lookahead slots for the
        drafts); preempt the most recent request while it does not fit."""
        bm = self.bm
        preempted = False
        while self.running:
            seqs = self.running
            ids = [s.sid for s in seqs]
            counts = [len(s.pending) for s in seqs]
            flat = np.array([t for s in seqs for t in s.pending], dtype=np.int64)
            try:
                if self.k == 0 and max(counts) == 1:
                    res = bm.decode_step(ids, flat)
                else:
                    res = bm.decode_step(ids, flat, self.k, num_new_tokens=np.array(counts))
                break
            except OutOfBlocksError:
                self._preempt(swap_out)
                preempted = True
        else:
            return None, preempted
        segs, owners = [], []
        off = 0
        for i, s in enumerate(seqs):
            q = counts[i]
            start = len(s.tokens)
            s.tokens += s.pending
            s.pending = []
            toks, slots = list(s.tokens[start:]), list(res.slot_mapping[off : off + q])
            off += q
            drafts = self._draft(s) if self.k else []
            if drafts:  # their K/V go to the lookahead slots reserved past the sequence's tokens
                slots += list(bm.slot_mapping(s.sid, len(s.tokens), len(s.tokens) + len(drafts)))
            table = res.block_tables[i]
            self.counts["window_nulls"] += int((table[: -(-len(s.tokens) // bm.block_size)] == NULL_BLOCK).sum())
            segs.append((np.array(toks + drafts), np.arange(start, start + q + len(drafts)),
                         np.array(slots, dtype=np.int64), table))
            owners.append((s, "decode", len(drafts)))
        return ((segs, owners), res.cow), preempted

    def _preempt(self, swap_out: list) -> None:
        bm = self.bm
        req = self.running[-1].req
        group = [s for s in self.running if s.req is req]
        self.running = [s for s in self.running if s.req is not req]
        ids = [s.sid for s in group]
        if self.swap and bm.can_swap_out(ids):
            swap_out.extend(bm.swap_out(ids))
            for s in group:
                s.status = "swapped"
            self.swapped.append(group)
            self.counts["swap_outs"] += 1
            return
        for s in reversed(group):  # recompute: prompt + generated tokens become the new prompt
            bm.free(s.sid)
            s.tokens = s.tokens + s.pending  # (pending tokens: their KV is recomputed with the prompt)
            s.pending = []
            s.status = "waiting"
        self.waiting[:0] = group
        self.counts["recomputes"] += 1

    def _admit(self):
        """Admit waiting sequences first come first served within the token budget, charged with only the tokens
        each has to compute (lookup_prefix); one allocate_batch for all of them (burst sharing)."""
        bm = self.bm
        chosen, used, need = [], 0, 0
        for s in self.waiting:
            hit = bm.lookup_prefix(s.tokens, self.k, namespace=s.req.namespace)
            cost = len(s.tokens) - hit.num_cached_tokens
            if chosen and (used + cost > self.budget or need + hit.num_new_blocks > bm.num_free_gpu_blocks - 2):
                break
            chosen.append((s, hit))
            used += cost
            need += hit.num_new_blocks
        while chosen:
            try:
                res = bm.allocate_batch([s.sid for s, _ in chosen], [s.tokens for s, _ in chosen], self.k,
                                        namespaces=[s.req.namespace for s, _ in chosen])
                break
            except OutOfBlocksError:
                chosen.pop()
        if not chosen:
            return []
        seqs = [s for s, _ in chosen]
        del self.waiting[: len(seqs)]
        for s, (_, hit), c in zip(seqs, chosen, res.num_cached_tokens.tolist()):
            assert c >= hit.num_cached_tokens  # the batch finds at least the lookup's hit
            self.counts["burst_shared"] += c > hit.num_cached_tokens
            self.counts["predicted_cached"] += hit.num_cached_tokens
            self.counts["cached_tokens"] += c
            self.counts["prefill_tokens"] += len(s.tokens) - c
            s.status = "running"
        self.running.extend(seqs)
        return res, seqs

    def _maybe_fork(self, s: Seq, last_logits: np.ndarray) -> None:
        """After a fresh request's prefill, fork its other samples from sample 0: they share every block."""
        r = s.req
        if s.index != 0 or len(r.seqs) > 1 or r.n == 1:
            return
        for i in range(1, r.n):
            c = Seq(f"{r.rid}/{i}", r, i, list(s.tokens), status="running")
            self.bm.fork(s.sid, c.sid)
            c.pending = [self.sample(last_logits, i, len(s.tokens))]
            r.seqs.append(c)
            self.running.insert(self.running.index(s) + i, c)
            self.counts["forks"] += 1

    def _accept(self, s: Seq, seg, logits, ndraft: int) -> None:
        """Speculative decoding: accept the drafts that match the model's own choices, then one more token."""
        q = len(seg[0]) - ndraft
        drafts = [int(t) for t in seg[0][q:]]
        base = len(s.tokens) - 1  # position of the last appended token (row q - 1 of the logits)
        out = []
        for j in range(ndraft + 1):
            t = self.sample(logits[q - 1 + j], s.index, base + 1 + j)
            out.append(t)
            if j == ndraft or drafts[j] != t:
                break
        self.counts["drafts_accepted"] += len(out) - 1
        self.counts["drafts_rejected"] += ndraft - (len(out) - 1)
        s.pending = out

    def _finish(self, s: Seq) -> None:
        self.bm.free(s.sid)
        s.status = "done"
        self.running.remove(s)
        gen = (s.tokens + s.pending)[len(s.req.prompt) :][: s.req.max_new]
        self.finished.setdefault(s.req.rid, []).append(gen)

    def run(self, max_steps: int = 2000) -> None:
        while (self.waiting or self.running or self.swapped) and self.counts["steps"] < max_steps:
            self.step()
            self.bm.check_invariants()
        assert not (self.waiting or self.running or self.swapped), "the engine did not finish its requests"


def check_against_reference(engine: ToyEngine) -> int:
    """Recompute every recorded logit without paging; returns how many were checked. A context that is a prefix
    of another shares its reference (one full forward per distinct longest context)."""
    by_len = sorted({c for c, _ in engine.records}, key=len, reverse=True)
    refs: dict[tuple, np.ndarray] = {}
    owner: dict[tuple, tuple] = {}
    longest: list[tuple] = []
    for c in by_len:
        if c in owner:
            continue
        refs[c] = engine.m.reference(list(c))
        longest.append(c)
        for n in range(1, len(c) + 1):
            owner.setdefault(c[:n], c)
    for c, logits in engine.records:
        full = owner[c]
        np.testing.assert_allclose(logits, refs[full][len(c) - 1], rtol=1e-9, atol=1e-9,
                                   err_msg=f"logits at position {len(c) - 1} of context {c}")
    return len(engine.records)
