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

from pagedkv import NULL_BLOCK
from pagedkv.errors import OutOfBlocksError, SequenceStateError


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
    tokens: list  # tokens appended to the block manager (prompt included); a waiting sequence: its prompt
    pending: list = field(default_factory=list)  # sampled, not appended yet (its KV is computed next step)
    todo: list = field(default_factory=list)  # prompt tokens not appended yet (chunked prefill)
    status: str = "waiting"  # waiting, running, swapped, done


@dataclass
class Request:
    rid: str
    prompt: list
    n: int
    max_new: int
    namespace: object
    seqs: list = field(default_factory=list)
    aborted: bool = False


class ToyEngine:
    """Continuous batching over a block manager, written once against the grouped API (docs/engine-contract.md,
    "One API for one group or many"): the same code drives a ``BlockManager`` (one group) and a
    ``HybridBlockManager`` (G groups), reading ``bm.config.kv_cache_groups``, ``res.group_slot_mapping``,
    ``res.group_block_tables`` / ``res.group_table_updates``, ``bm.block_table(seq, g)`` and
    ``bm.lookahead_slots``; no branch on the manager's type.

    ``lookahead`` > 0: speculative decoding with that many draft tokens per step (drafts from an oracle that is
    right with probability ``p_draft``, so some are accepted and some rejected), their K/V written to the slots of
    ``lookahead_slots``. Parallel samples (``n`` > 1) are forked after the prefill and sampled with a per-sample
    perturbation of the logits. ``chunk``: chunked prefill, at most that many prompt tokens of a sequence per step
    (``allocate_batch(..., num_new_tokens=)``, then ragged ``decode_step`` calls beside the decoding sequences).
    ``incremental``: the engine keeps one table matrix per group (rows from ``table_rows``) and decodes with
    ``block_tables=False``, loading whole rows after allocate, fork and swap_in. ``p_abort``: per step, the chance
    of aborting a request handed slots in the step before its forward (``free(cache=False)``, left out of the
    forward) and the chance of aborting a live request between steps (``free``). Findability: with prefix
    caching, after every allocation and every prompt chunk, ``lookup_prefix(prompt)`` must find the prompt's
    full blocks held so far, up to the last hit point whose blocks the sequence holds in every group (a sliding
    group's window before it; one it moved past may be evicted) (not checked for the sequences live when an in-step abort withdrew blocks: one that
    deduplicated a block against them caches nothing more, as ``free(cache=False)`` documents) (``findable_misses`` counts the calls where it did not, ``findable_examples`` keeps
    the first few; ``strict_findable`` raises at once)."""

    def __init__(self, model: ToyModel, bm, *, lookahead: int = 0, swap: bool = True, token_budget: int = 64,
                 p_draft: float = 0.6, seed: int = 0, chunk: int | None = None, incremental: bool = False,
                 p_abort: float = 0.0, strict_findable: bool = False) -> None:
        self.m, self.bm, self.k, self.swap, self.budget = model, bm, lookahead, swap, token_budget
        self.G = bm.config.num_groups
        windows = tuple(spec.window for spec in bm.config.kv_cache_groups)
        assert windows == model.windows, f"the model's groups {model.windows} are not the manager's {windows}"
        self.bs = bm.block_size
        self.chunk, self.incremental, self.p_abort, self.strict_findable = chunk, incremental, p_abort, strict_findable
        self.gpu = KVStore(model, bm.config.num_gpu_blocks, bm.block_size)
        self.cpu = KVStore(model, bm.config.num_cpu_blocks, bm.block_size)
        self.tables = [np.full((8, 8), NULL_BLOCK, np.int32) for _ in range(self.G)]  # incremental: per group
        self.rng = random.Random(seed)
        self.p_draft = p_draft
        self.waiting: list[Seq] = []  # (prefill queue, oldest first; a forked request waits as its parent)
        self.running: list[Seq] = []  # admission order
        self.swapped: list[list[Seq]] = []  # groups, oldest first
        self.records: list[tuple[tuple, np.ndarray]] = []  # (context tokens, logits of its last position)
        self.counts = dict(steps=0, prefill_tokens=0, cached_tokens=0, predicted_cached=0, swap_outs=0,
                           swap_ins=0, recomputes=0, drafts_accepted=0, drafts_rejected=0, forks=0,
                           window_nulls=0, burst_shared=0, chunks=0, aborts_in_step=0, aborts=0,
                           abort_refused=0, findable_checks=0, findable_misses=0, findable_skipped=0, table_loads=0, table_updates=0)
        self.findable_examples: list = []
        # sequences live when an abort withdrew blocks (free(cache=False)): one that had deduplicated a block against
        # the withdrawn ones keeps it uncached and caches nothing more (BlockManager.free), so not checked
        self._unfindable: set = set()
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
        """``k`` draft tokens after ``s``'s tokens: each the model's own choice with probability p_draft (from a
        non-paged oracle), else a random token."""
        ctx = list(s.tokens)
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

    # -------------------------------------------------------------- the engine's tables (incremental mode)
    def _fit(self, rows: int, cols: int) -> None:
        for g, t in enumerate(self.tables):
            r, c = t.shape
            if rows > r or cols > c:
                n = np.full((max(rows, 2 * r), max(cols, 2 * c)), NULL_BLOCK, np.int32)
                n[:r, :c] = t
                self.tables[g] = n

    def _load(self, sid: str) -> None:
        """The whole row of every group (after allocate, fork, swap_in)."""
        (row,) = self.bm.table_rows([sid]).tolist()
        for g in range(self.G):
            b = self.bm.block_table(sid, g)
            self._fit(row + 1, b.size)
            self.tables[g][row] = NULL_BLOCK
            self.tables[g][row, : b.size] = b
        self.counts["table_loads"] += 1

    def _apply(self, res) -> None:
        for g, u in enumerate(res.group_table_updates):
            if u.rows.size:
                self._fit(int(u.rows.max()) + 1, int(u.cols.max()) + 1)
                u.apply(self.tables[g])
                self.counts["table_updates"] += int(u.rows.size)

    def _row_tables(self, row: int) -> list:
        return [t[row].copy() for t in self.tables]

    # -------------------------------------------------------------- findability
    def _check_findable(self, s: Seq) -> None:
        """After an allocation or a prompt chunk: the prompt's full blocks held so far are found."""
        if not self.bm.config.enable_prefix_caching:
            return
        if s.sid in self._unfindable:
            self.counts["findable_skipped"] += 1
            return
        prompt = s.tokens + s.todo
        want = self._held_hit(s.sid, min(len(s.tokens) // self.bs, (len(prompt) - 1) // self.bs)) * self.bs
        got = self.bm.lookup_prefix(prompt, namespace=s.req.namespace).num_cached_tokens
        self.counts["findable_checks"] += 1
        if got < want:
            self.counts["findable_misses"] += 1
            if len(self.findable_examples) < 5:
                self.findable_examples.append((s.sid, len(prompt), len(s.tokens), want, got))
            assert not self.strict_findable, f"lookup_prefix found {got} of {want} held tokens of {s.sid}"

    def _held_hit(self, sid: str, top: int) -> int:
        """The largest hit point L <= ``top`` (in blocks) whose blocks the sequence itself holds in every group: a
        full-attention group's [0, L), a sliding group's window before L, [max(0, L * bs - W + 1) // bs, L) (the
        hybrid hit rule). A window the sequence has moved past is released and may be evicted since (by the very
        call that released it, when another sequence of the batch needs blocks): that hit point is not the
        sequence's to promise. O(top x groups)."""
        bs = self.bs
        if self.G == 1:  # (one table: checked after allocate only when windowed, where it holds its prompt)
            return top
        tables = [self.bm.block_table(sid, g) for g in range(self.G)]
        for L in range(top, 0, -1):
            ok = True
            for spec, t in zip(self.bm.config.kv_cache_groups, tables):
                w = spec.window
                a = 0 if w is None else max(0, L * bs - w + 1) // bs
                if t.size < L or (t[a:L] == NULL_BLOCK).any():
                    ok = False
                    break
            if ok:
                return L
        return 0

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
                bm.swap_in(ids)  # (its copies are in the step's plan)
                for s in group:
                    s.status = "running"
                    if self.incremental:
                        self._load(s.sid)
                self.running.extend(group)
                self.counts["swap_ins"] += 1
                run_copies(self.gpu, self.cpu, bm.take_copy_plan())
                return
        entries, preempted = self._decode()
        if not preempted and not self.swapped:
            entries += self._admit()
        if self.p_abort and entries and self.rng.random() < self.p_abort:
            entries = self._abort_in_step(entries)
        run_copies(self.gpu, self.cpu, bm.take_copy_plan())
        if not entries:
            return
        segs = [(toks, pos, slots, tables) for _, _, _, toks, pos, slots, tables in entries]
        for (s, kind, ndraft, toks, pos, _, _), logits in zip(entries, self.m.paged_forward(self.gpu, segs)):
            base = int(pos[0])
            ctx = s.tokens[:base] + [int(t) for t in toks]
            for j in range(len(toks)):
                self.records.append((tuple(ctx[: base + j + 1]), logits[j]))
            if s.todo:
                continue  # a prompt chunk that is not the last: nothing to sample
            if kind == "decode":
                self._accept(s, toks, logits, ndraft)
            else:  # the prompt's last tokens
                s.pending = [self.sample(logits[-1 - ndraft], s.index, len(s.tokens))]
                self._maybe_fork(s, logits[-1 - ndraft])
            if self._generated(s) >= s.req.max_new:
                self._finish(s)
        if self.p_abort and self.rng.random() < self.p_abort:
            self._abort_between_steps()

    def _decode(self):
        """One decode_step over every running sequence (a decoding one appends its pending tokens and reserves
        ``k`` lookahead slots for its drafts; a sequence in chunked prefill appends its next chunk); preempt the
        most recent request while it does not fit (``can_append_slots`` with the ragged counts must say so)."""
        bm = self.bm
        preempted = False
        while self.running:
            seqs = self.running
            ids = [s.sid for s in seqs]
            new = [s.pending if s.pending else s.todo[: self.chunk] for s in seqs]
            counts = [len(n) for n in new]
            flat = np.array([t for n in new for t in n], dtype=np.int64)
            fits = bm.can_append_slots(ids, self.k, num_new_tokens=counts)
            try:
                if self.k == 0 and max(counts) == 1:
                    res = bm.decode_step(ids, flat, block_tables=not self.incremental)
                else:
                    res = bm.decode_step(ids, flat, self.k, num_new_tokens=np.array(counts),
                                         block_tables=not self.incremental)
                assert fits, "can_append_slots said no to a step that fitted"
                break
            except OutOfBlocksError:
                assert not fits, "can_append_slots said yes to a step that did not fit"
                self._preempt()
                preempted = True
        else:
            return [], preempted
        if self.incremental:
            self._apply(res)
        slots_all = res.group_slot_mapping  # (G, T), whatever G
        drafting = self.k and any(s.pending for s in seqs)
        la = bm.lookahead_slots(ids, self.k) if drafting else None  # (G, B * k), one call for the batch
        entries, off = [], 0
        for i, s in enumerate(seqs):
            q = counts[i]
            start = len(s.tokens)
            if s.pending:
                kind = "decode"
                s.tokens += s.pending
                s.pending = []
            else:
                kind = "chunk"
                s.tokens += s.todo[:q]
                s.todo = s.todo[q:]
                self.counts["chunks"] += 1
            toks = list(s.tokens[start:])
            slots = slots_all[:, off : off + q]
            off += q
            drafts = self._draft(s) if drafting and kind == "decode" else []
            if drafts:  # their K/V go to the lookahead slots reserved past the sequence's tokens
                slots = np.concatenate((slots, la[:, i * self.k : i * self.k + len(drafts)]), axis=1)
            if self.incremental:
                tables = self._row_tables(int(res.table_rows[i]))
            else:
                tables = [t[i] for t in res.group_block_tables]
            nb = -(-len(s.tokens) // self.bs)
            self.counts["window_nulls"] += sum(int((t[:nb] == NULL_BLOCK).sum()) for t in tables)
            entries.append((s, kind, len(drafts), np.array(toks + drafts), np.arange(start, start + q + len(drafts)),
                            slots, tables))
            if kind == "chunk" and (self.G > 1 or bm.config.kv_cache_groups[0].window is None):
                # (one windowed table: its lookup needs the chain from block 0, which the chunks released)
                self._check_findable(s)
        return entries, preempted

    def _preempt(self) -> None:
        bm = self.bm
        req = self.running[-1].req
        group = [s for s in self.running if s.req is req]
        self.running = [s for s in self.running if s.req is not req]
        ids = [s.sid for s in group]
        if self.swap and bm.can_swap_out(ids):
            bm.swap_out(ids)
            for s in group:
                s.status = "swapped"
            self.swapped.append(group)
            self.counts["swap_outs"] += 1
            return
        for s in reversed(group):  # recompute: prompt + generated tokens become the new prompt
            bm.free(s.sid)
            s.tokens = s.tokens + s.pending + s.todo  # (their KV is recomputed with the prompt)
            s.pending, s.todo = [], []
            s.status = "waiting"
        self.waiting[:0] = group
        self.counts["recomputes"] += 1

    def _admit(self) -> list:
        """Admit waiting sequences first come first served within the token budget, charged with only the tokens
        each has to compute now (lookup_prefix); one allocate_batch for all of them (burst sharing), a chunk of
        each prompt with ``chunk``."""
        bm = self.bm
        chosen, used, need = [], 0, 0
        c = self.chunk
        for s in self.waiting:
            hit = bm.lookup_prefix(s.tokens, self.k, namespace=s.req.namespace, num_new_tokens=c)
            cost = len(s.tokens) - hit.num_cached_tokens if c is None else \
                min(c, len(s.tokens) - hit.num_cached_tokens)
            if chosen and (used + cost > self.budget or need + hit.num_new_blocks > bm.num_free_gpu_blocks - 2):
                break
            chosen.append((s, hit))
            used += cost
            need += hit.num_new_blocks
        while chosen:
            try:
                res = bm.allocate_batch([s.sid for s, _ in chosen], [s.tokens for s, _ in chosen], self.k,
                                        namespaces=[s.req.namespace for s, _ in chosen],
                                        num_new_tokens=None if c is None else [c] * len(chosen))
                break
            except OutOfBlocksError:
                chosen.pop()
        if not chosen:
            return []
        seqs = [s for s, _ in chosen]
        del self.waiting[: len(seqs)]
        q = res.query_start_loc
        slots_all = res.group_slot_mapping
        entries = []
        for i, (s, (_, hit)) in enumerate(zip(seqs, chosen)):
            cached = int(res.num_cached_tokens[i])
            assert cached >= hit.num_cached_tokens  # the batch finds at least the lookup's hit
            self.counts["burst_shared"] += cached > hit.num_cached_tokens
            self.counts["predicted_cached"] += hit.num_cached_tokens
            self.counts["cached_tokens"] += cached
            held = int(res.seq_lens[i])
            self.counts["prefill_tokens"] += held - cached
            s.tokens, s.todo = s.tokens[:held], s.tokens[held:]
            s.status = "running"
            a, z = int(q[i]), int(q[i + 1])
            if self.incremental:
                self._load(s.sid)
                tables = self._row_tables(int(bm.table_rows([s.sid])[0]))
            else:
                tables = [t[i] for t in res.group_block_tables]
            entries.append((s, "prefill", 0, res.token_ids[a:z], res.positions[a:z], slots_all[:, a:z], tables))
        for s in seqs:  # once the whole batch is allocated
            self._check_findable(s)
        self.running.extend(seqs)
        return entries

    def _abort_in_step(self, entries: list) -> list:
        """Abort one request handed slots in this step, before its forward: ``free(cache=False)`` of its
        sequences, last allocated first, and leave them out of the forward. A sequence another one already
        depends on (it found a block of this step's as a hit) is refused (SequenceStateError, nothing changes)
        and stays: it runs on and finishes as usual."""
        reqs = list({id(e[0].req): e[0].req for e in entries}.values())
        req = self.rng.choice(reqs)
        gone = set()
        for s in reversed([s for s in req.seqs if s.status == "running"]):
            try:
                self.bm.free(s.sid, cache=False)
            except SequenceStateError:
                self.counts["abort_refused"] += 1
                continue
            gone.add(s.sid)
            s.status = "done"
            self.running.remove(s)
            self.counts["aborts_in_step"] += 1
        if gone:
            req.aborted = True
            self._unfindable.update(s.sid for s in self.running)
            self._unfindable.update(s.sid for g in self.swapped for s in g)
        return [e for e in entries if e[0].sid not in gone]

    def _abort_between_steps(self) -> None:
        """Abort a live request between steps: its KV is written, ``free`` keeps its blocks cached."""
        live = [s for s in self.running + self.waiting + [s for g in self.swapped for s in g]]
        if not live:
            return
        req = self.rng.choice(live).req
        for s in reversed(req.seqs):
            if s.status in ("running", "swapped"):
                self.bm.free(s.sid)
            if s.status != "done":
                s.status = "done"
        self.running = [s for s in self.running if s.req is not req]
        self.waiting = [s for s in self.waiting if s.req is not req]
        self.swapped = [g for g in self.swapped if g[0].req is not req]
        req.aborted = True
        self.counts["aborts"] += 1

    def _maybe_fork(self, s: Seq, last_logits: np.ndarray) -> None:
        """After a fresh request's prefill, fork its other samples from sample 0: they share every block."""
        r = s.req
        if s.index != 0 or len(r.seqs) > 1 or r.n == 1 or r.aborted:
            return
        for i in range(1, r.n):
            c = Seq(f"{r.rid}/{i}", r, i, list(s.tokens), status="running")
            self.bm.fork(s.sid, c.sid)
            if self.incremental:
                self._load(c.sid)
            c.pending = [self.sample(last_logits, i, len(s.tokens))]
            r.seqs.append(c)
            self.running.insert(self.running.index(s) + i, c)
            self.counts["forks"] += 1

    def _accept(self, s: Seq, toks, logits, ndraft: int) -> None:
        """Speculative decoding: accept the drafts that match the model's own choices, then one more token."""
        q = len(toks) - ndraft
        drafts = [int(t) for t in toks[q:]]
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
