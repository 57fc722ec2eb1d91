"""The KV-content model: a BlockManager driven step by step as an engine drives it, checked in the KV data itself.

A simulated GPU and CPU KV store (one int64 per slot, ``slot = block * block_size + offset``) holds, instead of
K/V, the *identity* of the prefix whose KV belongs there: the KV of position ``p`` depends on the namespace and
on tokens ``0..p``, so identities are interned ``(parent identity, token)`` pairs. One step is what an engine does:

1. the calls of the step, several of them, in a random order: decodes (one token, or several with lookahead
   slots that receive rejected speculative tokens), admissions (bursts of identical and prefix-sharing prompts,
   namespaces; chunked prefill: a prompt allocated as its hit plus one chunk, later chunks appended by
   ``decode_step`` in later steps, forks refused until the last one), preemption by swap-out and by recompute
   (in the middle of a prefill too), swap-ins, aborts with ``free(cache=False)`` (refusals
   included: the dependents are aborted first, or the abort waits for the forward), ``reset_prefix_cache``,
   KV-event reads (with a small buffer that overflows);
2. the step's copies, taken once (:meth:`BlockManager.take_copy_plan`) and executed in order (copy by copy, or
   batch by batch with :meth:`CopyPlan.batches`, the way a GPU engine does it);
3. the forward: the KV of every token handed out in the step is written through the slot it was handed out at
   (prefix hits are not written: a hit on wrong content shows up as a wrong read); lookahead slots get garbage;
4. after the forward, what an engine does between steps: finished sequences are freed, sampled prompts forked.

After every step every live sequence must read back exactly its own identities through its block table (on the
CPU side while swapped out), except at positions the sliding window released. ``order="documented"`` executes
the copies in the order the documentation gave before the copy plan existed (the tier's demotions, its
promotions, then the swap-out, swap-in and copy-on-write lists of the calls): it corrupts KV, which is what the
copy plan fixes.

**Hybrid configurations** (``Config.draw_hybrid``): a :class:`HybridBlockManager` with KV cache groups (full
attention and sliding windows). All groups share the block ids, so the store stands for one layer slot of every
group: group g writes the value ``identity * G + g`` through its own slot mapping, so a block handed to two
groups at once, or read through the wrong group's table, shows up as a wrong read. After every step every live
sequence reads back its own identities through every group's table, and a sliding group's table holds every
position its window still needs (``(num_tokens - W, num_tokens)``, what the next query reads).

**Findability** (issue 23): after every ``allocate`` (and ``allocate_batch``) the prompt's full blocks the
sequence holds are found by ``lookup_prefix`` once the call returns, and so are a chunk's (single-table manager
without a window: a window may release and evict earlier blocks in the same call) when its prefix still was.

Used by tests/test_kv_content.py (a CI-sized run) and scripts/soak_kv.py (long runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from pagedkv import EVICTION_POLICIES, BlockManager, FullAttentionSpec, HybridBlockManager, SlidingWindowSpec
from pagedkv.errors import OutOfBlocksError, PinBudgetError, SequenceStateError

GARBAGE = -2  # what a rejected speculative token leaves in a lookahead slot
UNWRITTEN = -1


@dataclass
class Config:
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    prefix: bool
    tier: bool
    window: int | None
    lookahead: int
    events: bool
    max_events: int
    groups: tuple | None = None  # hybrid: the window of each KV cache group (None: full attention)
    vectorised: bool = False  # hybrid: every batch takes the numpy step (no plain-Python small-batch step)
    chunked: bool = False  # admissions are often chunked prefills
    policy: str = "lru"  # the eviction policy (BlockManager with prefix caching; priorities and session hints too)
    pin_budget: int = 0  # pins of the shared documents' prefixes (0: none)
    retention: bool = True  # hybrid: window retention

    @staticmethod
    def draw(rng: random.Random) -> "Config":
        cfg = Config._draw(rng)
        if cfg.prefix:
            cfg.pin_budget = rng.choice([0, 0, 2, 6, 12])
        return cfg

    @staticmethod
    def _draw(rng: random.Random) -> "Config":
        bs = rng.choice([4, 4, 4, 2, 8])
        prefix = rng.random() < 0.85
        tier = prefix and rng.random() < 0.75
        return Config(
            num_gpu_blocks=rng.randint(12, 48) * 4 // bs,
            num_cpu_blocks=rng.randint(16, 96) * 4 // bs,
            block_size=bs,
            prefix=prefix,
            tier=tier,
            window=rng.choice([None, None, None, rng.randint(6, 30)]),
            lookahead=rng.choice([0, 0, 1, 2]),
            events=prefix and rng.random() < 0.3,
            max_events=rng.randint(4, 64),
            chunked=rng.random() < 0.6,
            policy=rng.choice(EVICTION_POLICIES) if prefix else "lru",
            pin_budget=0,
        )

    @staticmethod
    def draw_hybrid(rng: random.Random) -> "Config":
        """A HybridBlockManager configuration: 2 to 4 groups, at least one sliding, windows around the prompts'
        lengths (so that hits need the window rule), pools scaled by the number of groups."""
        bs = rng.choice([4, 4, 2, 8])
        g = rng.randint(2, 4)
        groups = [None if rng.random() < 0.4 else rng.randint(3, 30) for _ in range(g)]
        if all(w is None for w in groups):
            groups[rng.randrange(g)] = rng.randint(3, 30)
        prefix = rng.random() < 0.9
        tier = prefix and rng.random() < 0.6
        policy = rng.choice(EVICTION_POLICIES) if prefix else "lru"
        budget = rng.choice([0, 0, 3, 8, 20]) if prefix else 0
        return Config(
            num_gpu_blocks=rng.randint(12, 40) * 4 // bs * g,
            num_cpu_blocks=rng.randint(16, 80) * 4 // bs * g,
            block_size=bs, prefix=prefix, tier=tier, window=None, lookahead=rng.choice([0, 0, 1, 2]),
            events=prefix and rng.random() < 0.3, max_events=rng.randint(8, 64), groups=tuple(groups),
            vectorised=rng.random() < 0.5, chunked=rng.random() < 0.6, policy=policy, pin_budget=budget,
            retention=rng.random() < 0.7,
        )

    def manager(self):
        if self.groups is not None:
            hm = BlockManager(
                self.num_gpu_blocks, self.block_size, num_cpu_blocks=self.num_cpu_blocks,
                kv_cache_groups=[FullAttentionSpec() if w is None else SlidingWindowSpec(w) for w in self.groups],
                enable_prefix_caching=self.prefix, cpu_prefix_cache=self.tier, watermark=0,
                enable_kv_events=self.events, max_kv_events=self.max_events, window_retention=self.retention,
                eviction_policy=self.policy, pin_budget_blocks=self.pin_budget, grouped_results=True
            )
            if self.vectorised:
                hm._step.small_batch = 0
            return hm
        return BlockManager(
            self.num_gpu_blocks, self.block_size, num_cpu_blocks=self.num_cpu_blocks,
            enable_prefix_caching=self.prefix, cpu_prefix_cache=self.tier, sliding_window=self.window,
            watermark=0, enable_kv_events=self.events, max_kv_events=self.max_events,
            eviction_policy=self.policy, pin_budget_blocks=self.pin_budget,
        )


class _Seq:
    __slots__ = ("ns", "toks", "ids", "swapped", "rest")

    def __init__(self, ns, toks, ids, rest=None):
        self.ns, self.toks, self.ids, self.swapped = ns, toks, ids, False
        self.rest = rest or []  # chunked prefill: the prompt tokens not appended yet


@dataclass
class Report:
    steps: int = 0
    calls: int = 0
    violations: int = 0
    messages: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


class KVModel:
    """One manager, its simulated KV stores and the live sequences (see the module docstring)."""

    def __init__(self, cfg: Config, seed: int, order: str = "plan", check_every: int = 1) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.order = order
        self.check_every = check_every
        self.bm = cfg.manager()
        self.G = len(cfg.groups) if cfg.groups is not None else 0  # 0: a single-group BlockManager
        bs = cfg.block_size
        self.gpu = np.full((cfg.num_gpu_blocks, bs), UNWRITTEN, dtype=np.int64)
        self.cpu = np.full((max(cfg.num_cpu_blocks, 1), bs), UNWRITTEN, dtype=np.int64)
        self.intern: dict = {}
        self.seqs: dict[int, _Seq] = {}
        self.order_of: dict[int, int] = {}  # allocation serial (abort dependents in reverse order)
        self.next_id = 0
        self.waiting: list = []  # (tokens, namespace) of sequences preempted by recompute
        self.docs = [[self.rng.randrange(3) for _ in range(48)] for _ in range(4)]
        self.report = Report()
        if order == "plan":
            self.bm.take_copy_plan()  # (an empty step: the same-step checks are on from the first step)
        self._new_step()

    # ------------------------------------------------------------------ identities
    def _ids(self, ns, toks, start_ids=None) -> list:
        ids = list(start_ids) if start_ids else []
        parent = ids[-1] if ids else self.intern.setdefault(("root", ns), len(self.intern))
        for t in toks[len(ids):]:
            parent = self.intern.setdefault((parent, t), len(self.intern))
            ids.append(parent)
        return ids

    # ------------------------------------------------------------------ step bookkeeping
    def _new_step(self) -> None:
        self.touched: dict[int, int] = {}  # sequences handed slots in this step (in order): how many calls
        self.writes: list = []  # (seq_id, slots, values) of this step's forward
        self.aborted: set = set()
        self.swapped_in: set = set()  # (swap_out may refuse these: a reused GPU block may be cached in this step)
        self.deferred: list = []  # aborts refused before the forward: freed after it
        self.legacy = {"swap_out": [], "swap_in": [], "cow": []}

    def _fail(self, msg: str) -> None:
        self.report.violations += 1
        if len(self.report.messages) < 20:
            self.report.messages.append(f"step {self.report.steps}: {msg}")

    def _write(self, sid: int, slots, values) -> None:
        """The forward's writes of one call: ``slots`` (T,) for a BlockManager, (G, T) for a hybrid one (group g
        writes ``identity * G + g``)."""
        slots = np.asarray(slots, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        if self.G:
            G = self.G
            slots = slots.reshape(-1)
            values = (values[None, :] * G + np.arange(G)[:, None]).reshape(-1)
        self.writes.append((sid, slots, values))
        self.touched[sid] = self.touched.get(sid, 0) + 1

    def _slots(self, sid: int, a: int, b: int) -> np.ndarray:
        """Slots of positions [a, b): (T,), or (G, T) for a hybrid manager."""
        if self.G:
            return np.stack([np.asarray(self.bm.slot_mapping(sid, a, b, g)) for g in range(self.G)])
        return np.asarray(self.bm.slot_mapping(sid, a, b))

    def _gpu_seqs(self) -> list:
        return [s for s, q in self.seqs.items() if not q.swapped]

    # ------------------------------------------------------------------ the calls of a step
    def op_decode(self) -> None:
        bm, rng, cfg = self.bm, self.rng, self.cfg
        # one slot-handing call a step each; a partly prefilled prompt gets its next chunk instead (op_prefill)
        cand = [s for s in self._gpu_seqs() if s not in self.touched and not self.seqs[s].rest]
        if not cand:
            return
        rng.shuffle(cand)
        batch = cand[: rng.randint(1, len(cand))]
        la = cfg.lookahead
        counts = [rng.randint(1, la + 1) if la and rng.random() < 0.5 else 1 for _ in batch]
        toks = [[rng.randrange(3) for _ in range(c)] for c in counts]
        before = {s: len(self.seqs[s].toks) for s in batch}
        try:
            if len(batch) == 1 and rng.random() < 0.3:
                cow = bm.append_slots(batch[0], toks[0], la)
                slots = self._slots(batch[0], before[batch[0]], before[batch[0]] + counts[0])
            elif all(c == 1 for c in counts) and rng.random() < 0.7:
                res = bm.decode_step(batch, np.array([t[0] for t in toks], dtype=np.int64), la)
                cow, slots = res.cow, res.slot_mapping
            else:
                res = bm.decode_step(batch, toks, la)
                cow, slots = res.cow, res.slot_mapping
        except OutOfBlocksError:
            self.report.count("decode_refused")
            return
        self.report.count("decodes")
        self.legacy["cow"].extend((int(a), int(b)) for a, b in np.asarray(cow).reshape(-1, 2))
        pos = 0
        for s, c, t in zip(batch, counts, toks):
            q = self.seqs[s]
            q.toks.extend(t)
            q.ids = self._ids(q.ns, q.toks, q.ids)
            self._write(s, slots[..., pos : pos + c], q.ids[-c:])
            pos += c
            if la:  # the forward also writes the draft tokens' KV into the lookahead slots: rejected here
                n = len(q.toks)
                sl = self._slots(s, n, n + la).reshape(-1)
                self.writes.append((s, sl, np.full(sl.size, GARBAGE)))
        if len(cow):
            self.report.count("cow", len(cow))

    def _prompt(self) -> tuple:
        rng = self.rng
        doc = rng.choice(self.docs)
        k = rng.randint(1, len(doc))
        toks = doc[:k] + [rng.randrange(3) for _ in range(rng.choice([0, 0, 1, 3, 6]))]
        return toks, rng.choice([None, None, None, "t1", 2])

    def op_admit(self) -> None:
        bm, rng = self.bm, self.rng
        burst = []
        if self.waiting and rng.random() < 0.5:
            burst.append(self.waiting.pop(rng.randrange(len(self.waiting))))
        base = self._prompt()
        for _ in range(rng.choice([1, 1, 2, 3, 5])):  # identical and prefix-sharing prompts in one step
            if rng.random() < 0.5:
                burst.append((list(base[0]), base[1]))
            else:
                toks, ns = base
                cut = rng.randint(1, len(toks))
                burst.append((toks[:cut] + [rng.randrange(3) for _ in range(rng.randint(0, 5))], ns))
        burst = [(t, ns) for t, ns in burst if t]
        if self.G and len(burst) > 1 and rng.random() < 0.4:  # one allocate_batch: all or nothing
            self._admit_batch(burst)
            return
        for toks, ns in burst:
            sid = self.next_id
            self.next_id += 1
            chunk = rng.choice([1, 2, 3, 5, 8]) if self.cfg.chunked and rng.random() < 0.6 else None
            try:
                hit = bm.allocate(sid, toks, namespace=ns, num_new_tokens=chunk) if chunk is not None else \
                    bm.allocate(sid, toks, namespace=ns)
            except OutOfBlocksError:  # (PromptTooLongError included)
                self.report.count("admit_refused")
                continue
            if hit % self.cfg.block_size or hit >= len(toks):
                self._fail(f"allocate({sid}) returned a hit of {hit} for {len(toks)} tokens")
            self.report.count("admits")
            self.report.count("hit_tokens", hit)
            if self.G and hit and any(bm.block_table(sid, g)[0] < 0 for g in range(self.G)):
                self.report.count("hits_past_window")  # a sliding group hit its window only
            self._findable(sid, toks, ns, min(len(toks), hit + chunk) if chunk is not None else len(toks))
            rest = []
            if chunk is not None:
                held = min(len(toks), hit + chunk)
                if bm.num_tokens(sid) != held:
                    self._fail(f"allocate({sid}, num_new_tokens={chunk}) holds {bm.num_tokens(sid)} tokens, "
                               f"not the hit {hit} plus the chunk")
                toks, rest = toks[:held], toks[held:]
                self.report.count("chunked_admits" if rest else "chunked_admits_whole")
            q = _Seq(ns, list(toks), self._ids(ns, toks), list(rest))
            self.seqs[sid] = q
            self.order_of[sid] = sid
            self._write(sid, self._slots(sid, hit, len(toks)), q.ids[hit:])

    def _admit_batch(self, burst: list) -> None:
        bm = self.bm
        sids = list(range(self.next_id, self.next_id + len(burst)))
        self.next_id += len(burst)
        rng = self.rng
        chunks = [rng.choice([1, 2, 3, 5, 8]) for _ in burst] if self.cfg.chunked and rng.random() < 0.6 else None
        try:
            pb = bm.allocate_batch(sids, [t for t, _ in burst], namespaces=[ns for _, ns in burst],
                                   num_new_tokens=chunks)
        except OutOfBlocksError:
            self.report.count("admit_refused")
            if any(s in bm for s in sids):
                self._fail("a refused allocate_batch allocated some of its sequences")
            return
        self.report.count("batch_admits")
        qsl = pb.query_start_loc.tolist()
        for i, (sid, (toks, ns)) in enumerate(zip(sids, burst)):
            hit = int(pb.num_cached_tokens[i])
            if hit % self.cfg.block_size or hit >= len(toks):
                self._fail(f"allocate_batch: {sid} got a hit of {hit} for {len(toks)} tokens")
            self.report.count("admits")
            self.report.count("hit_tokens", hit)
            rest = []
            if chunks is not None:
                held = min(len(toks), hit + chunks[i])
                if bm.num_tokens(sid) != held or int(pb.seq_lens[i]) != held or qsl[i + 1] - qsl[i] != held - hit:
                    self._fail(f"allocate_batch: {sid} (num_new_tokens={chunks[i]}) holds {bm.num_tokens(sid)} "
                               f"tokens, not the hit {hit} plus the chunk")
                toks, rest = toks[:held], toks[held:]
                self.report.count("chunked_batch_admits" if rest else "chunked_admits_whole")
            self._findable(sid, burst[i][0], ns, held if chunks is not None else len(burst[i][0]))
            q = _Seq(ns, list(toks), self._ids(ns, toks), list(rest))
            self.seqs[sid] = q
            self.order_of[sid] = sid
            sl = pb.slot_mapping[:, qsl[i] : qsl[i + 1]]
            if not np.array_equal(sl, self._slots(sid, hit, len(toks))):
                self._fail(f"allocate_batch: {sid}'s slot mapping differs from slot_mapping()")
            self._write(sid, sl, q.ids[hit:])

    def op_prefill(self) -> None:
        """The next chunk of some partly prefilled prompts: one decode_step, flat tokens and counts."""
        bm, rng = self.bm, self.rng
        cand = [s for s in self._gpu_seqs() if s not in self.touched and self.seqs[s].rest]
        if not cand:
            return
        rng.shuffle(cand)
        batch = cand[: rng.randint(1, len(cand))]
        counts = [min(len(self.seqs[s].rest), rng.choice([1, 2, 3, 4, 7])) for s in batch]
        flat = np.array([t for s, c in zip(batch, counts) for t in self.seqs[s].rest[:c]], dtype=np.int64)
        # (the chunk's blocks are findable when the prefix before it still is: a reset, a withdrawal or an eviction
        # of a block the sequence deduplicated into can have cut it since; a window may release and evict in the call)
        intact = {s: not self.G and self.cfg.window is None and self.cfg.prefix
                  and self._found(s) for s in batch}
        try:
            res = bm.decode_step(batch, flat, 0, num_new_tokens=np.array(counts))
        except OutOfBlocksError:
            self.report.count("prefill_refused")
            return
        self.legacy["cow"].extend((int(a), int(b)) for a, b in np.asarray(res.cow).reshape(-1, 2))
        pos = 0
        for s, c in zip(batch, counts):
            q = self.seqs[s]
            if intact[s]:
                self._findable(s, q.toks + q.rest, q.ns, len(q.toks) + c)
            q.toks.extend(q.rest[:c])
            del q.rest[:c]
            q.ids = self._ids(q.ns, q.toks, q.ids)
            self._write(s, res.slot_mapping[..., pos : pos + c], q.ids[-c:])  # (G, c) for a hybrid manager
            pos += c
            self.report.count("prefill_chunks" if q.rest else "prefill_last_chunks")

    def op_swap_out(self) -> None:
        bm, rng = self.bm, self.rng
        cand = self._gpu_seqs()
        if not cand:
            return
        group = rng.sample(cand, min(len(cand), rng.choice([1, 1, 2])))
        touched = any(s in self.touched for s in group)
        if touched and self.order == "documented":
            return  # the old API cannot tell: an engine must not do it
        try:
            pairs = bm.swap_out(group)
        except SequenceStateError:
            if not touched and not self.swapped_in.intersection(group):
                self._fail(f"swap_out({group}) refused though no sequence was handed slots in this step")
            self.report.count("swap_out_refused_pending")
            return
        except OutOfBlocksError:
            self.report.count("swap_out_refused")
            return
        if touched:
            self._fail(f"swap_out({group}) accepted sequences whose KV this step's forward has not written")
        self.legacy["swap_out"].extend(pairs)
        for s in group:
            self.seqs[s].swapped = True
        self.report.count("swap_outs")

    def op_swap_in(self) -> None:
        bm, rng = self.bm, self.rng
        cand = [s for s, q in self.seqs.items() if q.swapped]
        if not cand:
            return
        group = rng.sample(cand, min(len(cand), rng.choice([1, 1, 2])))
        try:
            pairs = bm.swap_in(group)
        except OutOfBlocksError:
            self.report.count("swap_in_refused")
            return
        self.legacy["swap_in"].extend(pairs)
        for s in group:
            self.seqs[s].swapped = False
        self.swapped_in.update(group)
        self.report.count("swap_ins")

    def op_recompute(self) -> None:
        cand = [s for s in self._gpu_seqs() if s not in self.touched]
        if not cand:
            return
        s = self.rng.choice(cand)
        try:
            self.bm.free(s)
        except SequenceStateError:
            # swap_in in this step may reuse a block cached in this step (its KV this step's forward writes): the
            # sequence is then pending like one handed slots, and free(cache=True) is refused, changing nothing;
            # an abort (cache=False) always succeeds, and the request is recomputed all the same
            if s not in self.swapped_in:
                self._fail(f"free({s}) refused though it was neither handed slots nor swapped in in this step")
            if not self._abort_swapped_in(s):
                return
            self.report.count("recompute_refused_pending")
        q = self.seqs.pop(s)
        self.waiting.append((q.toks + q.rest, q.ns))  # (mid-prefill: the whole prompt again)
        self.report.count("recomputes_mid_prefill" if q.rest else "recomputes")

    def _abort_swapped_in(self, s) -> bool:
        """free(s, cache=False) of a sequence swapped in in this step: it must succeed (nothing of the swap-in is
        withdrawn: its KV is the plan's copies). False (a violation) if refused."""
        try:
            self.bm.free(s, cache=False)
        except SequenceStateError as e:
            self._fail(f"free({s}, cache=False) refused after a swap-in in this step: {e}")
            return False
        return True

    def op_abort(self) -> None:
        bm, rng = self.bm, self.rng
        if not self.seqs:
            return
        s = rng.choice(list(self.seqs))
        if s not in self.touched:  # its KV is written: either way is correct
            cache = rng.random() < 0.5
            try:
                bm.free(s, cache=cache)
            except SequenceStateError:
                if cache:
                    # swapped in in this step on a block cached in this step (its KV this step's forward writes):
                    # pending like one handed slots, so free(cache=True) is refused; the abort always succeeds
                    if s not in self.swapped_in:
                        self._fail(f"free({s}) refused though it was neither handed slots nor swapped in this step")
                    if not self._abort_swapped_in(s):
                        return
                    self.report.count("abort_pending_swapped_in")
                else:  # its blocks are others' prefix hits in this step (a sequence swapped in is never refused)
                    if s in self.swapped_in:
                        self._fail(f"free({s}, cache=False) refused for a sequence swapped in in this step")
                    bm.free(s)
            del self.seqs[s]
            self.report.count("aborts")
            return
        if self.touched[s] > 1:  # free(cache=False) withdraws what its last call cached: the forward must run
            self.deferred.append(s)
            return
        try:
            bm.free(s, cache=False)
        except SequenceStateError:
            self.report.count("abort_refused")
            if rng.random() < 0.5 or any(self.touched[t] > 1 for t in self.touched if t in self.seqs
                                         and self.order_of.get(t, -1) > self.order_of.get(s, -1)):
                # wait for the forward
                self.deferred.append(s)
                return
            # abort the later admissions of the step first (reverse order of allocation always works)
            later = sorted((t for t in self.touched if t in self.seqs and t not in self.aborted
                            and self.order_of.get(t, -1) > self.order_of.get(s, -1)), key=self.order_of.get,
                           reverse=True)
            for i, t in enumerate(later + [s]):
                try:
                    bm.free(t, cache=False)
                except SequenceStateError:  # held by a sequence swapped in on a block cached in this step
                    self.report.count("abort_refused")
                    self.deferred.extend(u for u in (later + [s])[i:] if u not in self.deferred)
                    return
                if t in self.deferred:
                    self.deferred.remove(t)
                del self.seqs[t]
                self.aborted.add(t)
                self.report.count("aborts")
            return
        if s in self.deferred:
            self.deferred.remove(s)
        del self.seqs[s]
        self.aborted.add(s)
        self.report.count("aborts")

    def op_reset(self) -> None:
        self.bm.reset_prefix_cache()
        self.report.count("resets")

    def op_events(self) -> None:
        self.bm.events.take()

    OPS = (("decode", 3.0), ("admit", 2.5), ("prefill", 2.0), ("swap_out", 1.5), ("swap_in", 1.5), ("recompute", 0.4),
           ("abort", 1.0), ("reset", 0.03), ("events", 0.3), ("retain", 0.5), ("pin", 0.2), ("unpin", 0.1))

    def op_retain(self) -> None:
        """A priority and a session hint for a live sequence (used when it is freed)."""
        if not self.cfg.prefix or not self.seqs:
            return
        s = self.rng.choice(list(self.seqs))
        self.bm.retention.set_retention(s, priority=self.rng.randint(-2, 2), session=self.rng.randrange(3))
        self.report.count("retention_hints")

    def op_pin(self) -> None:
        """Pin the cached prefix of a shared document (refused past the budget: nothing changes)."""
        if not self.cfg.pin_budget:
            return
        doc = self.rng.choice(self.docs)
        before = (self.bm.retention.num_pinned_blocks, self.bm.retention.pins, self.bm.num_free_gpu_blocks)
        try:
            pin = self.bm.retention.pin_prefix(doc[: self.rng.randint(1, len(doc))])
        except PinBudgetError:
            if (self.bm.retention.num_pinned_blocks, self.bm.retention.pins, self.bm.num_free_gpu_blocks) != before:
                self._fail("a refused pin changed the manager")
            self.report.count("pins_refused")
            return
        if pin.num_blocks:
            self.report.count("pins")

    def op_unpin(self) -> None:
        if not self.cfg.pin_budget or not self.bm.retention.pins:
            return
        self.bm.retention.unpin(self.rng.choice(self.bm.retention.pins).pin_id)

    # ------------------------------------------------------------------ copies, forward, check
    def _execute_plan(self) -> None:
        bm = self.bm
        if self.order == "documented":
            legacy = self.legacy
            if bm.config.cpu_prefix_cache:
                dem, pro = bm.take_copies()
                self._copy(self.gpu, self.cpu, dem)
                self._copy(self.cpu, self.gpu, pro)
            self._copy(self.gpu, self.cpu, legacy["swap_out"])
            self._copy(self.cpu, self.gpu, legacy["swap_in"])
            self._copy(self.gpu, self.gpu, legacy["cow"])
            return
        plan = bm.take_copy_plan()
        self.report.count("copies", len(plan))
        if self.rng.random() < 0.5:  # copy by copy
            stores = {0: (self.gpu, self.cpu), 1: (self.cpu, self.gpu), 2: (self.gpu, self.gpu)}
            for s, d, k in zip(plan.src.tolist(), plan.dst.tolist(), plan.kind.tolist()):
                a, b = stores[k]
                b[d] = a[s]
        else:  # batch by batch: gather every source of a batch, then scatter
            stores = {0: (self.gpu, self.cpu), 1: (self.cpu, self.gpu), 2: (self.gpu, self.gpu)}
            for kind, src, dst in plan.batches():
                a, b = stores[int(kind)]
                b[dst] = a[src]
        legacy = self.legacy  # the per-call return values hold the same copies as the plan
        pairs = {k: [(a, b) for a, b, kk in zip(plan.src.tolist(), plan.dst.tolist(), plan.kind.tolist()) if kk == k]
                 for k in (0, 1, 2)}
        if pairs[2] != legacy["cow"] or (not bm.config.cpu_prefix_cache and (pairs[0] != legacy["swap_out"]
                                                                      or pairs[1] != legacy["swap_in"])):
            self._fail("the plan's copies differ from those the calls returned")

    @staticmethod
    def _copy(src_store, dst_store, pairs) -> None:
        p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if p.size:
            dst_store[p[:, 1]] = src_store[p[:, 0]]

    def _forward(self) -> None:
        flat = self.gpu.reshape(-1)
        seen: dict = {}
        for sid, slots, vals in self.writes:
            if sid in self.aborted:
                continue
            if sid not in self.seqs and sid not in self.deferred:
                self._fail(f"sequence {sid} was freed before the forward without cache=False")
            for sl, v in zip(slots.tolist(), vals.tolist()):
                old = seen.get(sl)
                if old is not None and old != v and v != GARBAGE and old != GARBAGE:
                    self._fail(f"the forward writes slot {sl} twice ({old} and {v})")
                seen[sl] = v
            flat[slots] = vals

    def check(self) -> None:
        bm, bs = self.bm, self.cfg.block_size
        if set(bm.seq_ids) != set(self.seqs):
            self._fail("the manager's sequences differ from the model's")
        for sid, q in self.seqs.items():
            n = len(q.toks)
            if bm.num_tokens(sid) != n or bm.is_swapped(sid) != q.swapped:
                self._fail(f"sequence {sid}: token count or swap state differs")
                continue
            for g in range(max(self.G, 1)):
                table = (bm.block_table(sid, g) if self.G else bm.block_table(sid)).astype(np.int64)
                pos = np.arange(n)
                blk = table[pos // bs]
                keep = blk >= 0
                if self.G:
                    w = self.cfg.groups[g]
                    if not keep[max(0, n - w + 1) if w else 0 :].all():  # (the next query reads (n - W, n])
                        self._fail(f"sequence {sid} group {g}: a position its window needs has no block "
                                   f"(table {table.tolist()}, {n} tokens)")
                store = self.cpu if q.swapped else self.gpu
                got = store[blk[keep], pos[keep] % bs]
                want = np.asarray(q.ids, dtype=np.int64)[keep]
                if self.G:
                    want = want * self.G + g
                if not np.array_equal(got, want):
                    bad = int(pos[keep][np.flatnonzero(got != want)[0]])
                    self._fail(f"sequence {sid} group {g} ({'CPU' if q.swapped else 'GPU'}) reads wrong KV at "
                               f"position {bad} of {n} (table {table.tolist()})")

    # ------------------------------------------------------------------ after the forward
    def _after_forward(self) -> None:
        bm, rng = self.bm, self.rng
        for s in self.deferred:
            if s in self.seqs:
                bm.free(s)
                del self.seqs[s]
        live = list(self.seqs)
        rng.shuffle(live)
        for s in live[: rng.choice([0, 0, 1, 2])]:  # finished
            bm.free(s)
            del self.seqs[s]
            self.report.count("finished")
        if self.seqs and rng.random() < 0.3:  # parallel sampling: fork after the prompt's forward
            p = rng.choice(list(self.seqs))
            if self.seqs[p].rest:  # partly prefilled: fork waits for the last chunk
                try:
                    bm.fork(p, ("refused", p))
                except SequenceStateError:
                    self.report.count("fork_refused_mid_prefill")
                else:
                    self._fail(f"fork of {p}, partly prefilled, was not refused")
                return
            for _ in range(rng.randint(1, 2)):
                c = self.next_id
                self.next_id += 1
                bm.fork(p, c)
                q = self.seqs[p]
                child = _Seq(q.ns, list(q.toks), list(q.ids))
                child.swapped = q.swapped
                self.seqs[c] = child
                self.order_of[c] = c
                self.report.count("forks")
        while len(self.seqs) > 24:  # keep the model small
            s = next(iter(self.seqs))
            bm.free(s)
            del self.seqs[s]

    def step(self) -> None:
        rng = self.rng
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for name in rng.choices(names, weights, k=rng.randint(1, 6)):
            getattr(self, "op_" + name)()
            self.report.calls += 1
        if self.order == "plan" and rng.random() < 0.1:  # the refused calls of a step change nothing
            self._probe_refusals()
        self._execute_plan()
        self._forward()
        self.report.steps += 1
        self.check()
        if self.report.steps % self.check_every == 0:
            try:
                self.bm.check_invariants()
            except AssertionError as e:
                self._fail(f"check_invariants: {e}")
        self._new_step()
        self._after_forward()

    def _found(self, sid) -> bool:
        """Whether lookup_prefix finds every full block ``sid`` holds of its prompt."""
        q, bs = self.seqs[sid], self.cfg.block_size
        t, cache = self.bm._t, self.bm._cache
        row = t.row_of[sid]
        if not cache.live_parent(int(t.ccid[row]), int(t.ckey[row])):
            # its chain ends in a content that left the cache (a swapped-in row whose prefix is not cached again whole,
            # or a windowed one whose registered blocks were all released: Swapper.rechain cannot walk those from the
            # root): what it registers next is not found by a walk from the root (a stated gap)
            return False
        # (an uncached copy of a content another block caches, deduplicated at registration, inherits the content
        # when that block is evicted: prefix_cache "Copies"; no gap left there)
        prompt = q.toks + q.rest
        want = min(len(q.toks) // bs, (len(prompt) - 1) // bs) * bs
        return self.bm.lookup_prefix(prompt, namespace=q.ns).num_cached_tokens >= want

    def _findable(self, sid, prompt: list, ns, held: int) -> None:
        """lookup_prefix finds the full blocks of ``prompt`` that ``sid`` holds (``held`` tokens) once the call
        that handed them out returns (issue 23 A)."""
        if not self.cfg.prefix:
            return
        bs = self.cfg.block_size
        want = min(held // bs, (len(prompt) - 1) // bs) * bs
        got = self.bm.lookup_prefix(prompt, namespace=ns).num_cached_tokens
        if got < want:
            self._fail(f"sequence {sid}: lookup_prefix finds {got} of the {want} tokens it holds cached")
        self.report.count("findable_checks")

    def _probe_refusals(self) -> None:
        """fork / swap_out of a sequence handed slots in this step must raise SequenceStateError."""
        live = [s for s in self.touched if s in self.seqs and not self.seqs[s].swapped and s not in self.aborted]
        if not live:
            return
        s = self.rng.choice(live)
        calls = [lambda: self.bm.fork(s, ("probe", s)), lambda: self.bm.swap_out([s])]
        if self.cfg.prefix:  # free(s) would cache blocks nobody wrote yet (issue 23 B)
            calls.append(lambda: self.bm.free(s))
        for call in calls:
            try:
                call()
            except SequenceStateError:
                self.report.count("refusals_ok")
            else:
                self._fail(f"a call on sequence {s}, handed slots in this step, was not refused")


def run(seed: int, steps: int, order: str = "plan", check_every: int = 1, cfg: Config | None = None,
        hybrid: bool = False) -> Report:
    """Run one manager (configuration drawn from ``seed`` unless given; a HybridBlockManager's with ``hybrid``)
    for ``steps`` steps."""
    cfg = cfg or (Config.draw_hybrid if hybrid else Config.draw)(random.Random(seed))
    model = KVModel(cfg, seed, order=order, check_every=check_every)
    for _ in range(steps):
        model.step()
    model.report.count("event_overflows", model.bm.events.overflows)
    return model.report
