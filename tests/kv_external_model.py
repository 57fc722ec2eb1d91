"""The KV-content model of external KV (docs/external-kv.md): a BlockManager driven step by step as an engine with
storage tiers and a remote reader drives it, checked in the KV data itself.

As in tests/kv_model.py, a simulated GPU KV store holds one int64 per slot: instead of K/V, the *identity* of
the prefix whose KV belongs there (interned ``(parent identity, token)`` pairs). One step:

1. calls in a random order: admissions (prompts sharing prefixes; some with ``num_external_tokens``, some as a
   batch, some chunked; with KV cache groups some loads ``external_window_only``: a sliding group receives only
   its window's blocks, and those complete whole or are aborted), decodes, frees (``cache=False`` for a sequence handed slots in the step), aborts of
   LOADING sequences, holds (``hold`` / ``free(hold_for=)``), lease renewals, ``take_store_plan``;
2. the step's copy plan, executed in order;
3. transfers: each load completes after a random delay, in any order, writing its bytes into its blocks **even
   when its sequence was aborted** (a parked block that had been reused would be corrupted and caught), and some
   fail part way (only the first ``ok`` blocks are written, garbage in the rest); a transfer writes only after
   the copy plan of the step that handed its blocks out has run (those blocks may be that plan's copy sources:
   a swap-out, a demotion); completed transfers are reported with ``finish_external`` (done or failed) in a
   later step, before its copy plan;
4. the forward: the KV of every token handed out in the step (finished loads included, from the count
   ``finish_external`` returned) is written through its slot;
5. holds are read by a second party (a "decode replica") when they are released or expire: the held blocks
   must still hold the sequence's identities of hold time; stores complete after a random delay and read their
   blocks then: each must still hold the content its key names (a store that read a reused block is caught).

After every step every running sequence reads back exactly its own identities through its block table, and
``check_invariants`` runs every ``check_every`` steps. Used by tests/test_external_model.py and
``scripts/soak_kv.py --external``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from pagedkv import BlockManager, FullAttentionSpec, SlidingWindowSpec, block_hashes
from pagedkv.errors import OutOfBlocksError, SequenceStateError

GARBAGE = -2
UNWRITTEN = -1


@dataclass
class Report:
    steps: int = 0
    violations: int = 0
    messages: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def count(self, k: str, n: int = 1) -> None:
        self.counts[k] = self.counts.get(k, 0) + n


class _Violation(Exception):
    pass


class ExternalModel:
    def __init__(self, seed: int, check_every: int = 1, hybrid: bool = False) -> None:
        rng = self.rng = random.Random(seed)
        self.bs = rng.choice([2, 4, 8])
        self.nblocks = rng.randint(24, 96)
        policy = rng.choice(["none", "write_through", "selective", "write_back"])
        prefix = rng.random() < 0.85
        ncpu = rng.choice([0, 16, 48])
        tier = prefix and ncpu > 0 and rng.random() < 0.6
        kw = dict(enable_prefix_caching=prefix, num_cpu_blocks=ncpu, cpu_prefix_cache=tier, watermark=0.0,
                  store_policy=policy if prefix else "none", store_min_hits=rng.randint(1, 3),
                  # (its own draw: the main stream, and so every seed's run, stays as it was) with KV events the
                  # store plans carry each block's parent key, checked against its content
                  enable_kv_events=random.Random(seed * 7 + 1).random() < 0.5)
        if hybrid:  # KV cache groups: full attention and sliding windows over one pool
            specs = [FullAttentionSpec()] + [SlidingWindowSpec(rng.choice([self.bs, 2 * self.bs, 3 * self.bs + 1]))
                                             for _ in range(rng.randint(1, 2))]
            rng.shuffle(specs)
            self.nblocks *= len(specs)
            self.bm = BlockManager(self.nblocks, self.bs, kv_cache_groups=specs, **kw, grouped_results=True)
        else:
            self.bm = BlockManager(self.nblocks, self.bs, **kw)
        self.G = self.bm.config.num_groups
        self.gpu = np.full(self.nblocks * self.bs, UNWRITTEN, np.int64)
        self.cpu = np.full(max(ncpu, 1) * self.bs, UNWRITTEN, np.int64)
        self.swapped: set = set()
        self.ident: dict = {}  # (parent identity, token) -> identity
        self.ident_toks: dict = {0: ()}  # identity -> its tokens (for the store check)
        self.seqs: dict = {}  # running seq -> list of identities (one per token)
        self.toks: dict = {}  # seq -> tokens
        self.loading: dict = {}  # seq -> (prompt identities, ExternalLoad)
        self.transfers: list = []  # [complete_at, seq, ExternalLoad, ok or None, written, report_at]
        self.holds: dict = {}  # hold_id -> (block ids, identities at hold time)
        self.stores: list = []  # [complete_at, plan]
        self.writes: list = []  # (slots, identities) of this step's forward
        self.step_no = 0
        self.next_id = 0
        self.check_every = check_every
        self.report = Report()
        self.prefixes = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 5) * self.bs)] for _ in range(4)]
        self.bm.take_copy_plan()  # same-step checks on

    # ------------------------------------------------------------------ helpers
    def fail(self, msg: str) -> None:
        raise _Violation(f"step {self.step_no}: {msg}")

    def identities(self, toks: list, start_id: int = 0) -> list:
        out, p = [], start_id
        for t in toks:
            key = (p, t)
            q = self.ident.get(key)
            if q is None:
                q = self.ident[key] = len(self.ident) + 1
                self.ident_toks[q] = self.ident_toks[p] + (t,)
            out.append(q)
            p = q
        return out

    def put(self, seq, a: int, b: int, ids: list) -> tuple:
        """A forward write of positions ``[a, b)`` in every group: group g's slots take ``identity * G + g``."""
        G = self.G
        slots = np.concatenate([self.bm.slot_mapping(seq, a, b, g) for g in range(G)])
        vals = np.concatenate([np.asarray(ids, np.int64) * G + g for g in range(G)])
        return (seq, slots, vals)

    def new_prompt(self) -> list:
        rng = self.rng
        p = list(rng.choice(self.prefixes)) if rng.random() < 0.8 else []
        p += [rng.randrange(1, 50) for _ in range(rng.randint(1, 4 * self.bs))]
        return p

    # ------------------------------------------------------------------ calls
    def admit(self) -> None:
        rng, bm, bs = self.rng, self.bm, self.bs
        k = rng.randint(1, 3) if rng.random() < 0.3 else 1
        seqs = [f"s{self.next_id + i}" for i in range(k)]
        self.next_id += k
        prompts = [self.new_prompt() for _ in seqs]
        exts = [rng.randrange(0, 6) * bs if rng.random() < 0.6 else 0 for _ in seqs]
        # KV cache groups: some single loads bring only the blocks each sliding window sees at their end
        wo = self.G > 1 and k == 1 and exts[0] > 0 and rng.random() < 0.4
        try:
            if k > 1:
                res = bm.allocate_batch(seqs, prompts, num_external_tokens=exts)
                cached = res.num_cached_tokens.tolist()
            elif wo:
                cached = [bm.allocate(seqs[0], prompts[0], num_external_tokens=exts[0], external_window_only=True)]
            else:
                cached = [bm.allocate(seqs[0], prompts[0], num_external_tokens=exts[0])]
        except OutOfBlocksError:
            self.report.count("admit_refused")
            return
        for s, p, c in zip(seqs, prompts, cached):
            ids = self.identities(p)
            self.toks[s] = list(p)
            ext = bm.external.external_blocks(s)
            if ext is None:
                self.seqs[s] = ids
                self.writes.append(self.put(s, c, len(p), ids[c:]))
                self.stepped.add(s)
                self.report.count("admitted")
                continue
            if c != ext.start_token + ext.num_tokens:
                self.fail(f"{s}: allocate returned {c}, its load ends at {ext.start_token + ext.num_tokens}")
            for g in range(self.G):
                if ext.group_keys[g] != tuple(block_hashes(p[: c], bs, group=g)[ext.start_token // bs:]):
                    self.fail(f"{s}: the load's keys of group {g} are not the prompt's")
            cut = False
            h0 = ext.start_token // bs
            for g, spec in enumerate(bm.config.kv_cache_groups):  # a cut group: NULL_BLOCK exactly before its window
                first = max(0, c - spec.window + 1) // bs if wo and spec.window is not None else 0
                first = first if first > h0 else 0
                nulls = [h0 + i < first for i in range(len(ext.group_block_ids[g]))]
                if [b < 0 for b in ext.group_block_ids[g]] != nulls:
                    self.fail(f"{s}: group {g}'s external blocks {ext.group_block_ids[g]} are not NULL_BLOCK exactly "
                              f"before block {first}")
                cut = cut or any(nulls)
            self.loading[s] = ids
            nblk = len(ext.block_ids)
            ok = None if rng.random() < 0.75 else rng.randrange(0, nblk) * bs
            if cut:  # (such a load completes whole, or is aborted)
                ok = None
                self.report.count("loads_window_only")
            done_at = self.step_no + rng.randint(0, 4)
            self.transfers.append([done_at, s, ext, ok, False, done_at + rng.randint(0, 2)])
            self.report.count("loads")

    def decode(self) -> None:
        rng, bm = self.rng, self.bm
        run = [s for s in self.seqs if s not in self.stepped and s not in self.swapped]
        if not run:
            return
        batch = rng.sample(run, rng.randint(1, min(len(run), 6)))
        toks = [rng.randrange(1, 50) for _ in batch]
        try:
            bm.decode_step(batch, toks)
        except OutOfBlocksError:
            self.report.count("decode_refused")
            return
        for s, t in zip(batch, toks):
            ids = self.seqs[s]
            ids.append(self.identities([t], ids[-1])[0])
            self.toks[s].append(t)
            n = len(ids)
            self.writes.append(self.put(s, n - 1, n, ids[n - 1:]))
            self.stepped.add(s)

    def free_one(self) -> None:
        rng, bm = self.rng, self.bm
        if self.loading and rng.random() < 0.3:  # an abort while loading: its blocks park
            s = rng.choice(list(self.loading))
            bm.free(s)
            del self.loading[s]
            self.report.count("aborted_loading")
            return
        if not self.seqs:
            return
        s = rng.choice(list(self.seqs))
        hold = rng.random() < 0.3 and s not in self.swapped
        fresh = s in self.stepped
        if fresh:
            # handed slots in this step: an abort (cache=False); its holds are dropped first (their reader is told)
            for hid in [h.hold_id for h in self.bm.external.holds if h.seq_id == s]:
                self.bm.external.release_hold(hid)
                del self.holds[hid]
            try:
                bm.free(s, cache=False)
            except SequenceStateError:
                self.report.count("abort_refused")
                return
            self.writes = [w for w in self.writes if w[0] != s]
            del self.seqs[s]
            self.report.count("aborted")
            return
        if hold:
            ids = list(self.seqs[s])
            where = self.hold_positions(s)
            h = bm.free(s, hold_for=self.rng.choice([1.0, 3.0, 100.0]), now=float(self.step_no))
            self.holds[h.hold_id] = self.hold_record(h, where, ids)
            self.report.count("held_on_free")
        else:
            bm.free(s)
        del self.seqs[s]
        self.swapped.discard(s)

    def swap(self) -> None:
        """Preemption by swap: a running sequence out (not one handed slots in this step), or one back in."""
        bm, rng = self.bm, self.rng
        if not bm.config.num_cpu_blocks:
            return
        if self.swapped and rng.random() < 0.5:
            s = rng.choice(sorted(self.swapped))
            try:
                bm.swap_in([s])
            except OutOfBlocksError:
                return
            self.swapped.discard(s)
            self.stepped.add(s)  # (its copies run before this step's forward; no more calls for it this step)
            self.report.count("swapped_in")
            return
        cand = [s for s in self.seqs if s not in self.stepped and s not in self.swapped]
        if not cand:
            return
        s = rng.choice(cand)
        try:
            bm.swap_out([s])
        except (OutOfBlocksError, SequenceStateError):
            return
        self.swapped.add(s)
        self.report.count("swapped_out")

    def hold_one(self) -> None:
        if not self.seqs:
            return
        s = self.rng.choice(list(self.seqs))
        if s in self.swapped:
            return
        where = self.hold_positions(s)
        h = self.bm.external.hold(s, self.rng.choice([1.0, 3.0]), now=float(self.step_no))
        self.holds[h.hold_id] = self.hold_record(h, where, list(self.seqs[s]))
        self.report.count("holds")

    def release_holds(self) -> None:
        bm = self.bm
        for hid in list(self.holds):
            if self.rng.random() < 0.2:
                self.read_hold(hid)
                bm.external.release_hold(hid)
        if self.rng.random() < 0.2 and self.holds:
            hid = self.rng.choice(list(self.holds))
            bm.external.renew_hold(hid, 2.0, now=float(self.step_no))
        gone_before = set(self.holds)
        # the reader reads every hold about to expire before the manager releases it
        live = {h.hold_id: h for h in bm.external.holds}
        for hid in list(self.holds):
            if live[hid].expires_at <= float(self.step_no):
                self.read_hold(hid)
        expired = bm.external.expire_holds(now=float(self.step_no))
        for hid in expired:
            if hid not in gone_before:
                self.fail(f"hold {hid} expired but was not live")
            self.holds.pop(hid, None)
        self.report.count("holds_expired", len(expired))

    def hold_positions(self, s) -> list:
        """Per group, the table column of each block (the reader's map from a held block to its positions)."""
        return [{int(b): c for c, b in enumerate(self.bm.block_table(s, g).tolist()) if b >= 0}
                for g in range(self.G)]

    def hold_record(self, h, where: list, ids: list) -> list:
        """``[(block, expected values)]`` of every held block, every group (positions below num_tokens)."""
        bs, G, n = self.bs, self.G, h.num_tokens
        if len(h.group_block_ids) != G:
            self.fail(f"hold {h.hold_id}: {len(h.group_block_ids)} groups of blocks, the manager has {G}")
        out = []
        for g, blocks in enumerate(h.group_block_ids):
            for b in blocks:
                c = where[g].get(b)
                if c is None:
                    self.fail(f"hold {h.hold_id}: block {b} is not in group {g}'s table")
                out.append((b, [i * G + g for i in ids[c * bs : min((c + 1) * bs, n)]]))
        return out

    def read_hold(self, hid: int) -> None:
        bs = self.bs
        for b, want in self.holds.pop(hid):
            got = self.gpu[b * bs : b * bs + bs].tolist()
            if got[: len(want)] != want:
                self.fail(f"hold {hid}: block {b} holds {got}, the reader expected {want}")
        self.report.count("holds_read")

    def take_store(self) -> None:
        plan = self.bm.external.take_store_plan()
        if plan is None:
            return
        self.stores.append([self.step_no + self.rng.randint(0, 3), plan])
        self.report.count("stores_planned", len(plan.block_ids))
        if plan.medium == "CPU":
            self.report.count("stores_planned_cpu", len(plan.block_ids))

    def complete_stores(self) -> None:
        bs = self.bs
        keep = []
        for at, plan in self.stores:
            if at > self.step_no:
                keep.append([at, plan])
                continue
            # the store reads its blocks now: GPU blocks, or CPU blocks (write-back over the CPU tier: the
            # blocks next to leave the CPU pool, kept in the tier until stored)
            mem = self.cpu if plan.medium == "CPU" else self.gpu
            for i, (b, key) in enumerate(zip(plan.block_ids, plan.keys)):
                v = int(mem[b * bs + bs - 1])
                if v <= 0:
                    self.fail(f"store {plan.store_id}: {plan.medium} block {b} holds no KV ({v})")
                last, g = divmod(v, self.G)
                toks = self.ident_toks[last]
                chain = block_hashes(list(toks), bs, group=g) if len(toks) % bs == 0 else []
                if not chain or chain[-1] != key:
                    self.fail(f"store {plan.store_id}: block {b} holds content other than its key names")
                want = [i * self.G + g for i in self.identities(list(toks))[-bs:]]
                if mem[b * bs : b * bs + bs].tolist() != want:
                    self.fail(f"store {plan.store_id}: block {b} is not the KV of its content")
                if plan.token_ids[i].tolist() != list(toks[-bs:]):  # (what the tiers' events publish)
                    self.fail(f"store {plan.store_id}: block {b}'s planned tokens are not its content's")
                if plan.parent_keys is not None and plan.parent_keys[i] != (chain[-2] if len(chain) > 1 else None):
                    self.fail(f"store {plan.store_id}: block {b}'s planned parent key is not its content's")
            self.bm.external.complete_store(plan.store_id, success=self.rng.random() < 0.9)
            self.report.count("stores_done")
        self.stores = keep

    def transfers_write(self) -> None:
        """Transfers that complete now write their blocks. Called after the step's copy plan is executed: a load
        writes its blocks only once the copies of the step that handed them out have run (a block freed and
        handed out again in one step is a copy source until then: a swap-out, a demotion)."""
        bs = self.bs
        for tr in self.transfers:
            at, s, ext, ok, written, _ = tr
            if written is not False or at > self.step_no:
                continue
            ids = self.identities(self.toks[s][: ext.start_token + ext.num_tokens])
            for g, blocks in enumerate(ext.group_block_ids):
                for i, b in enumerate(blocks):
                    if b < 0:  # (a cut sliding group's position: no block, nothing sent)
                        continue
                    good = ok is None or i * bs < ok
                    vals = [x * self.G + g for x in ids[ext.start_token + i * bs : ext.start_token + (i + 1) * bs]] \
                        if good else [GARBAGE] * bs
                    self.gpu[b * bs : b * bs + bs] = vals
            tr[4] = self.step_no

    def transfers_step(self) -> None:
        """Transfers written in an earlier step and due are reported (done / failed), in a random order."""
        rng = self.rng
        due = [tr for tr in self.transfers if tr[4] is not False and tr[4] < self.step_no and tr[5] <= self.step_no]
        rng.shuffle(due)
        if not due:
            return
        done = [tr[1] for tr in due if tr[3] is None]
        failed = {tr[1]: tr[3] for tr in due if tr[3] is not None}
        got = self.bm.external.finish_external(done=done, failed=failed)
        for tr in due:
            self.transfers.remove(tr)
            s = tr[1]
            if s not in self.loading:
                if s in got:
                    self.fail(f"{s} was aborted but finish_external returned it")
                continue
            ids = self.loading.pop(s)
            c = got[s]
            want = tr[2].start_token + (tr[2].num_tokens if tr[3] is None else tr[3])
            if c != want:
                self.fail(f"{s}: finish_external says {c} tokens computed, the transfer brought {want}")
            self.seqs[s] = ids
            n = self.bm.num_tokens(s)
            if n != len(ids):
                self.fail(f"{s}: holds {n} tokens, its prompt is {len(ids)}")
            self.seqs[s] = ids[:n]
            self.writes.append(self.put(s, c, n, ids[c:n]))
            self.stepped.add(s)
            self.report.count("loads_done" if tr[3] is None else "loads_failed")

    # ------------------------------------------------------------------ one step
    def step(self, calls: bool = True) -> None:
        rng = self.rng
        self.begin_step()
        for _ in range(rng.randint(1, 5) if calls else 0):
            r = rng.random()
            if r < 0.35:
                self.admit()
            elif r < 0.65:
                self.decode()
            elif r < 0.85:
                self.free_one()
            elif r < 0.88:
                self.hold_one()
            elif r < 0.93:
                self.swap()
            else:
                self.take_store()
        self.end_step()

    def begin_step(self) -> None:
        self.stepped: set = set()
        self.writes = []
        self.step_no += 1

    def end_step(self) -> None:
        """Transfers, the copy plan, the forward, holds and stores, then the checks."""
        self.transfers_step()
        plan = self.bm.take_copy_plan()
        self.bm.events.take()  # (KV events on or off: nothing kept)
        stores = {0: (self.gpu, self.cpu), 1: (self.cpu, self.gpu), 2: (self.gpu, self.gpu)}
        bs = self.bs
        for kind, src, dst in plan.batches():  # gather every source of a batch, then scatter
            a, b = stores[int(kind)]
            vals = [a[x * bs : x * bs + bs].copy() for x in src.tolist()]
            for d, v in zip(dst.tolist(), vals):
                b[d * bs : d * bs + bs] = v
        self.transfers_write()
        for _, slots, vals in self.writes:  # the forward
            self.gpu[slots] = vals
        self.release_holds()
        self.complete_stores()
        self.check()
        if self.step_no % self.check_every == 0:
            self.bm.check_invariants()

    def check(self) -> None:
        bm, bs = self.bm, self.bs
        if set(bm.seq_ids) != set(self.seqs) | set(self.loading):
            self.fail("the manager's sequences differ from the model's")
        if set(bm.external.loading_seq_ids) != set(self.loading):
            self.fail("the manager's LOADING sequences differ from the model's")
        G = self.G
        for s, ids in self.seqs.items():
            n = bm.num_tokens(s)
            store = self.cpu if s in self.swapped else self.gpu
            pos = np.arange(n)
            want = np.asarray(ids[:n], np.int64)
            for g in range(G):
                t = bm.block_table(s, g).astype(np.int64)[pos // bs]
                held = t >= 0  # (a sliding group: the positions its window still holds)
                got = store[t[held] * bs + pos[held] % bs]
                exp = want[held] * G + g
                if not np.array_equal(got, exp):
                    bad = int(np.flatnonzero(got != exp)[0])
                    self.fail(f"{s}: group {g} position {int(pos[held][bad])} reads {int(got[bad])}, "
                              f"expected {int(exp[bad])}")

    def drain(self) -> None:
        """Every transfer completed and reported, every hold read and released, every store completed."""
        for tr in self.transfers:
            tr[0] = tr[5] = self.step_no + 1
        for st in self.stores:
            st[0] = self.step_no + 1
        self.step(calls=False)  # (the transfers write)
        self.step(calls=False)  # (and are reported)
        for hid in list(self.holds):
            self.read_hold(hid)
            self.bm.external.release_hold(hid)
        self.bm.check_invariants()
        if self.transfers or self.bm.external.parked_seq_ids or self.bm.external.pending_stores or self.bm.external.holds:
            self.fail("something is left in flight after draining")


def run(seed: int, steps: int, check_every: int = 1, hybrid: bool = False) -> Report:
    m = ExternalModel(seed, check_every, hybrid)
    try:
        for _ in range(steps):
            m.step()
            m.report.steps += 1
        m.drain()
    except Exception as e:  # (a violation, a failed audit, or any unexpected error)
        m.report.violations += 1
        m.report.messages.append(f"seed {seed}: {type(e).__name__}: {e}")
    return m.report
